// Shared declarations of the nanobind module's parts: one .cpp per area.
#pragma once
#include <nanobind/nanobind.h>

#include "core/backend.h"

namespace krnl::bindings {

namespace nb = nanobind;

void bind_devices(nb::module_& m);
void bind_tensors(nb::module_& m);
void bind_ops(nb::module_& m);
void bind_profiler(nb::module_& m);
// The Metal sources' facts go to the module, its test hooks to krnl._core.testing.
void bind_metal(nb::module_& m, nb::module_& testing);
// krnl._core.testing: test devices and hooks, built in but not part of the user API.
void bind_testing(nb::module_& testing);
// NCCL's loader (every build) and, with CUDA, the communicator; its test hook joins testing.
void bind_nccl(nb::module_& m, nb::module_& testing);

Shape to_shape(nb::handle obj);       // int or sequence of ints
DType to_dtype(nb::handle obj);       // "f16", "float16", numpy dtypes, ...
nb::dict pool_stats_dict(const PoolStats& s);  // Device.pool_stats and the test pool's stats
nb::list dtype_names(const std::vector<DType>& v);  // ["f32", "f16", ...]

}  // namespace krnl::bindings
