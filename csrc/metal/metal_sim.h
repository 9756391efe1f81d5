// The metal-sim test device (DESIGN section 7): the Metal backend's op logic (MetalOps) with an
// encoder that queues the dispatch records of a step and, at commit, hands them to an executor
// running the MSL kernels on the CPU (tools/mslsim, registered from Python by the test suite).
// Memory is plain host memory, as Apple's shared-storage buffers are host-visible.
#pragma once
#include <functional>
#include <vector>

#include "metal/metal_ops.h"

namespace krnl::metal {

using SimExecutor = std::function<void(const std::vector<Dispatch>&)>;

// Registers the "metal-sim" device (lowest priority: never the default) running on `executor`.
void register_metal_sim(SimExecutor executor);

// The dispatches the metal-sim device executed in its last committed step (for tests of the
// host logic: which kernels, grids and offsets an op produced).
const std::vector<Dispatch>& metal_sim_last_step();

}  // namespace krnl::metal
