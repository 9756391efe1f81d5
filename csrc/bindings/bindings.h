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
void bind_metal(nb::module_& m);

Shape to_shape(nb::handle obj);       // int or sequence of ints
DType to_dtype(nb::handle obj);       // "f16", "float16", numpy dtypes, ...

}  // namespace krnl::bindings
