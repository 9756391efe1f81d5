// The Metal backend's ops (docs/architecture.md, 'The Metal backend'): this file holds MetalOps'
// construction and capabilities; every other op of the contract becomes Dispatch records in the
// file of its family beside it (gemm.cpp, norm.cpp, attention.cpp, elementwise.cpp, loss.cpp,
// moe.cpp, quantized.cpp, optim.cpp; their shared helpers in ops_common.h). Portable C++: runs in CI on the
// metal-sim device, and on macOS under the Objective-C++ encoder. The core has validated every
// call (shapes, dtypes, devices); what is checked here is only what the kernels add: bf16 kernels
// run only where the GPU has native bf16 (emulated bf16 is ~40x slower than f16 before M3;
// docs/architecture.md, 'Device capabilities'), and argument structs hold 32-bit sizes.
#include <map>
#include <string>
#include <utility>

#include "metal/metal_ops.h"
#include "metal/ops_common.h"

namespace krnl::metal {

// library_names() is defined in sources.cpp, from the table cmake/embed_metal.cmake generates.

MetalOps::MetalOps(std::string name, GpuDescription gpu)
    : Backend(std::move(name)), gpu_(std::move(gpu)), cb_policy_(metal::command_buffer_policy(gpu_)) {
  apply_working_set();
}

std::map<std::string, double> MetalOps::compile_libraries() {
  throw NotImplementedError("[compile_libraries] " + name() +
                            " compiles no Metal libraries: its executor compiles the kernels in Python "
                            "(tools/mslsim, tools/mslcuda); only the 'metal' device on a Mac does");
}

// Past the recommended working set macOS pages GPU memory or fails command buffers (MLX gives its
// cache back from 0.95 of it and waits or swaps from 1.5x); a clean error at it is the safe
// default, KRNL_MAX_MEMORY or Device.set_memory_limit move it. 0 (metal-sim by default): no limit.
void MetalOps::apply_working_set() {
  set_default_memory_limit(size_t(gpu_.working_set),
                           "the GPU's recommended working set, MTLDevice.recommendedMaxWorkingSetSize");
}
MetalOps::~MetalOps() = default;

Capabilities MetalOps::capabilities() const {
  Capabilities c = Backend::capabilities();
  c.dtypes = compute_dtypes(gpu_, kBf16Kernels);
  c.compute_dtype = default_compute_dtype(gpu_, kBf16Kernels);
  // metal/attention.metal: every dtype the backend has kernels for (its bf16 kernels sit behind
  // KRNL_BF16, like every family's, so they come with the backend's bf16 policy), every
  // mask of the contract, at the head sizes it instantiates.
  c.fused_attention_dtypes = c.dtypes;
  c.fused_attention_segments = c.fused_attention_window = c.fused_attention_sinks = true;
  c.fused_attention_head_dims = attention_head_dims();
  // The LoRA fold (python/krnl/models/lora_fold.py) pays by a static count of bytes per LoRA'd
  // projection, each operand moved once (Metal GPUs are bandwidth-bound; docs/architecture.md,
  // 'The fold on Metal'): T rows, N outputs, G members of rank r. The forward's one GEMM saves
  // the rank-r product's write of y and the frozen GEMM's read of it (2 T N elements) for
  // N (G + 1) r + G r^2 more (S rewritten and read whole, less B's reads): it pays above
  // (G + 1) r / 2 rows (32 for q|k|v at r 16; lora_fold.py keeps smaller calls unfolded). The
  // o/down backward saves 2 T in for 2 r in: it pays above r rows. Training's B T rows are far
  // above both (q|k|v -41%, gate/up -53% of bytes at T 4096, C 2048, F 8192, r 16). Not in the
  // count: the FLOPs the wider K adds (G r / C of the frozen GEMM's). Unmeasured on Apple hardware.
  c.lora_fold = true;
  c.details = {{"gpu", gpu_.name},
               {"gpu_family", gpu_.apple_family ? "apple" + std::to_string(gpu_.apple_family) : "below apple7"},
               {"bf16", native_bf16(gpu_) ? std::string("native")
                                          : std::string("emulated by Metal (~40x slower than f16): not offered")},
               {"command_buffer", "at most " + std::to_string(cb_policy_.max_dispatches) + " dispatches or ~" +
                                      std::to_string(int(cb_policy_.max_ms)) + " ms of estimated GPU work, ~" +
                                      std::to_string(int(cb_policy_.max_dispatch_ms)) + " ms a dispatch"}};
  return c;
}

SplitKConfig MetalOps::split_k_config() const {
  SplitKConfig c;
  c.tile_m = c.tile_n = kGemmTile;
  // An output of fewer tiles than this leaves most of an M-series GPU idle (a tile is one
  // SIMD-group; even an M1 keeps a few hundred in flight): split K to make up the difference.
  c.min_tiles = 256;
  c.k_unit = kGemmTile;
  c.max_splits = 16;
  c.min_k_per_split = 256;
  return c;
}

}  // namespace krnl::metal
