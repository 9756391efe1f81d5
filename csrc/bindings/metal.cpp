// The Metal backend's test surface: the metal-sim device (its executor comes from Python:
// tools/mslsim runs the kernels), its last step's dispatch records, and the row-split option of
// every Metal device.
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "bindings.h"
#include "metal/metal_sim.h"

namespace krnl::bindings {
namespace {

using namespace nb::literals;
using metal::Dispatch;
using metal::FunctionConstant;

nb::dict to_dict(const Dispatch& d) {
  nb::dict r;
  r["op"] = d.op;
  r["library"] = d.library;
  r["kernel"] = d.kernel;
  r["host"] = bool(d.host);
  r["concurrent"] = d.concurrent;
  nb::list consts;
  for (const auto& c : d.constants) {
    nb::object v;
    if (c.type == FunctionConstant::Type::Bool) {
      v = nb::bool_(c.bits != 0);
    } else if (c.type == FunctionConstant::Type::UInt) {
      v = nb::int_(c.bits);
    } else {
      float f;
      std::memcpy(&f, &c.bits, 4);
      v = nb::float_(f);
    }
    consts.append(nb::make_tuple(c.index, v));
  }
  r["constants"] = consts;
  nb::list bufs;
  for (const auto& b : d.buffers)
    bufs.append(nb::make_tuple(b.index, uintptr_t(static_cast<char*>(b.base) + b.offset), b.extent, uintptr_t(b.base), b.offset));
  r["buffers"] = bufs;
  r["args_index"] = d.args_index;
  r["args"] = nb::bytes(reinterpret_cast<const char*>(d.args.data()), d.args.size());
  nb::list tgm;
  for (const auto& [i, n] : d.threadgroup_memory) tgm.append(nb::make_tuple(i, n));
  r["threadgroup_memory"] = tgm;
  r["grid"] = nb::make_tuple(d.grid[0], d.grid[1], d.grid[2]);
  r["threads"] = nb::make_tuple(d.threads[0], d.threads[1], d.threads[2]);
  return r;
}

nb::list to_list(const std::vector<Dispatch>& v) {
  nb::list l;
  for (const auto& d : v) l.append(to_dict(d));
  return l;
}

metal::MetalOps& metal_device(Backend& d) {
  auto* m = dynamic_cast<metal::MetalOps*>(&d);
  if (!m) throw std::invalid_argument("[row_split] device " + d.name() + " is not a Metal device");
  return *m;
}

}  // namespace

void bind_metal(nb::module_& m) {
  m.def("register_metal_sim", [](nb::callable fn) {
    // Kept alive for the life of the process: a static destructor must not touch Python.
    auto* keep = new nb::callable(std::move(fn));
    metal::register_metal_sim([keep](const std::vector<Dispatch>& step) {
      nb::gil_scoped_acquire gil;
      (*keep)(to_list(step));
    });
  }, "executor"_a,
        "Registers the 'metal-sim' device: at each commit, executor(records) runs the step's dispatch records "
        "(dicts: kernel, library, constants, buffers as (index, address, extent, base, offset), args bytes, grid, "
        "threads) on the CPU. The test suite passes tools/mslsim's executor.");
  m.def("metal_sim_last_step", [] { return to_list(metal::metal_sim_last_step()); },
        "The dispatch records of the last step the metal-sim device committed.");
  m.def("metal_libraries", &metal::library_names, "The op families of metal/ (one .metal file each).");
  m.def("metal_library_source", &metal::library_source, "name"_a,
        "The MSL source of metal/<name>.metal embedded in the binary, includes inlined (what the Metal device "
        "compiles at run time).");
  m.def("set_row_split", [](Backend& d, bool enabled, double cpu_gflops, double gpu_gflops, double overhead_ms,
                            int64_t min_flops) {
    metal::RowSplitConfig c{enabled, cpu_gflops, gpu_gflops, overhead_ms, min_flops};
    if (enabled && !(cpu_gflops > 0 && gpu_gflops > 0))
      throw std::invalid_argument("[row_split] cpu_gflops and gpu_gflops must be > 0 (measured rates)");
    metal_device(d).set_row_split(c);
  }, "device"_a, "enabled"_a, "cpu_gflops"_a = 0.0, "gpu_gflops"_a = 0.0, "overhead_ms"_a = 0.0,
        "min_flops"_a = int64_t(1) << 30,
        "CPU/GPU row split of large f32 GEMMs on a Metal device: the CPU takes the share of rows the core's planner "
        "computes from the two rates so both engines finish together.");
}

}  // namespace krnl::bindings
