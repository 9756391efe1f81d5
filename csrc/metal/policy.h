// Metal device policy as portable functions: which GPU to take and
// whether it can run the kernels, which dtypes it computes in, and when a step's work is cut into
// another command buffer. device.mm fills a GpuDescription from the Metal API and calls these;
// metal-sim and the tests call the same functions on made-up descriptions (an M1, an M3, an Intel
// Mac, a paravirtual CI runner), so the rules are tested in CI although device.mm never runs here.
#pragma once
#include <cstddef>
#include <cstdint>
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

// When a step's GPU work goes into another command buffer (submission.cpp): after
// `max_dispatches` dispatches, or once the estimated GPU time of the open one reaches `max_ms`.
// The estimate uses rates at the low end of the GPU's family, so a real command buffer runs
// shorter than estimated: far below the macOS watchdog, which ends command buffers that run for
// seconds on a display-attached Mac, and a GPU that starts before the step is fully encoded.
struct CommandBufferPolicy {
  uint32_t max_dispatches = 64;
  double max_ms = 100;
  double gflops = 2000;  // f32 FMA rate assumed
  double gbps = 60;      // memory bandwidth assumed
};
CommandBufferPolicy command_buffer_policy(const GpuDescription& g);

// Estimated GPU time of one dispatch: its counted flops and the bytes it may touch.
double estimate_ms(const Dispatch& d, const CommandBufferPolicy& p);

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

// The command-buffer sizes (dispatch counts) a step of dispatches with these estimated times gets.
std::vector<size_t> plan_command_buffers(const CommandBufferPolicy& p, const std::vector<double>& ms);

}  // namespace krnl::metal
