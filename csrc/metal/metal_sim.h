// The metal-sim test device: the Metal backend's op logic and its
// submission of steps (MetalOps, the same code device.mm runs) with an executor that runs each
// committed command buffer's dispatch records on a worker thread, through the MSL kernels run on
// the CPU (tools/mslsim, registered from Python by the test suite). Memory is plain host memory,
// as Apple's shared-storage buffers are host-visible.
//
// Completion lags behind commit, deterministically, so that CI sees ordering bugs:
//   "wait"  (default): a command buffer runs only once someone waits for it or a later one;
//   "delay": also after a delay drawn from a seeded generator (0..max_ms), so work overlaps the
//            host the way a GPU does;
//   "none":  as soon as it is committed.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "metal/metal_ops.h"

namespace krnl::metal {

using SimExecutor = std::function<void(const std::vector<Dispatch>&)>;

// Registers the "metal-sim" device (lowest priority: never the default) running on `executor`.
void register_metal_sim(SimExecutor executor);

// The memory of an executor device, as C functions: metal-cuda's are cudaMallocManaged and
// cudaFree (tools/mslcuda), visible to the host like Apple's shared storage; called without the
// GIL. alloc returns null when it fails.
struct SimMemory {
  void* (*alloc)(size_t bytes) = nullptr;
  void (*free)(void* p) = nullptr;
};

// Registers "metal-cuda": the same device as metal-sim (MetalOps on a worker thread) with its own
// executor (tools/mslcuda: the kernels of metal/ on an NVIDIA GPU, each command buffer finished
// before the executor returns), its own memory, and the Apple GPU family it stands for. Never the
// default. Completion does not lag: a command buffer runs as soon as it is committed.
void register_metal_cuda(SimExecutor executor, SimMemory memory, int apple_family);

// Sets how completion lags behind commit (see above); waits for the work committed so far first.
void metal_sim_set_lag(const std::string& mode, double max_ms, uint64_t seed);

// Runs what was committed and stops the workers of metal-sim and metal-cuda (at interpreter exit,
// while Python still runs).
void metal_sim_shutdown();

// Makes metal-sim stand for an Apple GPU of that family (7: M1, 8: M2, 9: M3), so that its
// capabilities() and bf16 refusals follow that GPU's policy; waits for committed work first.
// working_set: its recommended working set in bytes, the pool's default ceiling (0: none).
void metal_sim_set_gpu(int apple_family, uint64_t working_set = 0);

// The GPU the simulator stands for: by default an Apple9 GPU (an M3), which has native bf16, so
// that every kernel of metal/ runs; metal_sim_set_gpu picks another family.
GpuDescription metal_sim_gpu(int apple_family = 9);

}  // namespace krnl::metal
