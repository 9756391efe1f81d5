// Metal device policy as portable functions: which GPU to take and
// whether it can run the kernels, which dtypes it computes in, and when a step's work is cut into
// another command buffer. device.mm fills a GpuDescription from the Metal API and calls these;
// metal-sim and the tests call the same functions on made-up descriptions (an M1, an M3, an Intel
// Mac, a paravirtual CI runner), so the rules are tested in CI although device.mm never runs here.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace krnl::metal {

struct Dispatch;

// A Metal GPU as device.mm reads it (supportsFamily:, the MTLDevice properties).
struct GpuDescription {
  std::string name;
  int apple_family = 0;  // highest N with supportsFamily(MTLGPUFamilyAppleN) among 7..9; 0: below Apple7
  bool mac2 = false;     // MTLGPUFamilyMac2 (Intel/AMD Macs and paravirtual GPUs report it)
  bool unified_memory = false;
  bool low_power = false;
  bool removable = false;
  uint64_t working_set = 0;  // recommendedMaxWorkingSetSize, bytes
};

// Whether the kernels run on g; `why` (may be null) gets the reason when not. The GEMM needs
// simdgroup matrices, which Apple documents for the Apple7 family on (M1 and later).
bool gpu_usable(const GpuDescription& g, std::string* why);

// MSL `bfloat` runs natively from the Apple9 family (M3) on; before it Metal emulates it in
// software, ~40x slower than f16 in the KRNL report's M1 Pro measurement.
bool native_bf16(const GpuDescription& g);

// The float dtypes the Metal kernels compute in on g, and the training default among them.
// `bf16_kernels`: whether metal/ has bf16 kernels at all (not yet).
std::vector<DType> compute_dtypes(const GpuDescription& g, bool bf16_kernels);
DType default_compute_dtype(const GpuDescription& g, bool bf16_kernels);

// The GPU the "metal" device takes. `candidates` lists MTLCreateSystemDefaultDevice() first when
// it returned one (it can return nil in a process that does not link CoreGraphics), then the
// other devices of MTLCopyAllDevices(). `os_msl` is the newest MSL version the OS compiles
// (major * 100 + minor; 0: too old to know), `needed_msl` the newest the kernels declare.
struct DeviceChoice {
  int index = -1;      // into candidates; -1: none
  std::string reason;  // one line, when index is -1
};
DeviceChoice choose_device(const std::vector<GpuDescription>& candidates, uint32_t os_msl, uint32_t needed_msl);

// What bounds a dispatch's speed, for the time estimates: each kind of kernel of metal/ reaches
// its own fraction of the GPU's f32 peak. The op files (gemm.cpp, norm.cpp, ...) set it on every
// dispatch (Dispatch::rate).
enum class RateClass {
  memory,           // elementwise, norms, losses, optimizer: bytes at the memory bandwidth
  gemm,             // gemm.metal's simdgroup-matrix tiles
  attention,        // attention.metal's fused kernels
  quantized_tiled,  // quantized.metal's tiled products (codes dequantized into threadgroup memory)
  quantized_rows,   // quantized.metal's few-row products (generation): a pass over W per row block
};
const char* rate_class_name(RateClass r);

// When a step's GPU work goes into another command buffer (submission.cpp), and how large one
// dispatch may be (gemm.cpp and quantized.cpp split a larger product into blocks). macOS ends a
// command buffer that runs for seconds on a display-attached Mac (the GPU watchdog); a dispatch
// cannot be cut, so the budget applies to each dispatch first. The estimate takes the slowest GPU
// of the family and, per kernel kind, a rate at the low end of what that kernel can reach there: a
// real dispatch should run shorter than estimated. No rate was measured on Apple hardware (none
// exists here).
struct CommandBufferPolicy {
  uint32_t max_dispatches = 64;
  double max_ms = 100;          // estimated GPU time of one command buffer
  double max_dispatch_ms = 25;  // estimated GPU time of one dispatch
  double peak_gflops = 2290;    // f32 FMA peak of the family's smallest GPU
  double gbps = 60;             // memory bandwidth assumed
  // The fraction of peak_gflops each kind of kernel reaches at least (by RateClass).
  double gemm_share = 0.2, attention_share = 0.1, quantized_tiled_share = 0.1, quantized_rows_share = 0.05;
  double gflops(RateClass r) const;  // 0 for memory: its time is its bytes
};
CommandBufferPolicy command_buffer_policy(const GpuDescription& g);

// Estimated GPU time of one dispatch: its counted flops at its kernel's rate, plus the bytes it
// may touch at the memory bandwidth.
double estimate_ms(const Dispatch& d, const CommandBufferPolicy& p);
double estimate_ms(double flops, double bytes, RateClass r, const CommandBufferPolicy& p);

// A product's output (rows x cols) in blocks, each one dispatch: block sizes are multiples of the
// kernel's tile (the last block of each dimension takes the rest). Rows are split first (whole
// tile rows), then columns, until every block's estimate (`ms(rows, cols)`, monotone in both)
// fits `budget`; blocks are then evened out. A single tile over the budget stays one block.
struct BlockPlan {
  int64_t rows = 0, cols = 0;  // block size
  int64_t row_blocks = 1, col_blocks = 1;
};
BlockPlan plan_blocks(int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols, double budget,
                      const std::function<double(int64_t, int64_t)>& ms);

// Cuts a sequence of dispatches into command buffers the way the backend does as it encodes.
class CommandBufferCutter {
 public:
  explicit CommandBufferCutter(const CommandBufferPolicy& p) : p_(p) {}
  // Adds one dispatch to the open command buffer; true when the buffer is full after it.
  bool add(double ms);
  void reset() { n_ = 0, ms_ = 0; }

 private:
  CommandBufferPolicy p_;
  uint32_t n_ = 0;
  double ms_ = 0;
};

// A grid of `heads` x `rows` (rows in blocks of `tile`, the last one partial) whose cost is not
// even over the rows (causal attention: later query rows see more keys), cut into dispatches:
// whole heads grouped while a group's full rows fit `budget`; otherwise one head at a time in
// consecutive row ranges, each as long as fits (at least one tile). `ms(heads, row0, row1)` is a
// dispatch's estimate, monotone in each.
struct GridPart {
  int64_t head0 = 0, heads = 0, row0 = 0, rows = 0;
};
std::vector<GridPart> plan_row_blocks(int64_t heads, int64_t rows, int64_t tile, double budget,
                                      const std::function<double(int64_t, int64_t, int64_t)>& ms);

// The command-buffer sizes (dispatch counts) a step of dispatches with these estimated times gets.
std::vector<size_t> plan_command_buffers(const CommandBufferPolicy& p, const std::vector<double>& ms);

}  // namespace krnl::metal
