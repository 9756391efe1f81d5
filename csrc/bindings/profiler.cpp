// Per-op profiling: one record per op while enabled (python/krnl/profiler.py builds the report).
#include <nanobind/stl/string.h>

#include "bindings.h"

namespace krnl::bindings {

void bind_profiler(nb::module_& m) {
  using namespace nb::literals;
  m.def("set_profiling", [](Backend& d, bool on) { d.set_profiling(on); }, "device"_a, "on"_a);
  m.def("profile_records", [](Backend& d) {
          nb::list out;
          for (const auto& r : d.records()) {
            nb::dict e;
            e["op"] = r.op, e["shape"] = r.shape, e["dtype"] = r.dtype;
            e["ms"] = r.ms, e["flops"] = r.flops, e["bytes"] = r.bytes;
            out.append(e);
          }
          return out;
        }, "device"_a, "The records of every op run since profiling was enabled (op, shape, dtype, ms, flops, bytes).");
  m.def("clear_profile", [](Backend& d) { d.clear_records(); }, "device"_a);
}

}  // namespace krnl::bindings
