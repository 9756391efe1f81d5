// The Metal backend's bindings. In krnl._core: the MSL sources embedded in the binary (product
// facts; the macOS workflow reads their versions). In krnl._core.testing, its test surface: the
// metal-sim device (its executor comes from Python: tools/mslsim runs the kernels) and its lag,
// the last step's records and command buffers, the portable policy functions on made-up GPUs, the
// ordering switches, the command-buffer policy and the row-split option of every Metal device
// (no product path sets it: it takes measured rates, which only the tests supply).
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <thread>

#include "bindings.h"
#include "metal/library_cache.h"
#include "metal/metal_ops.h"
#include "metal/metal_sim.h"
#include "metal/policy.h"

namespace krnl::bindings {
namespace {

using namespace nb::literals;
using metal::Dispatch;

nb::dict to_dict(const Dispatch& d) {
  nb::dict r;
  r["op"] = d.op;
  r["library"] = d.library;
  r["kernel"] = d.kernel;
  r["host"] = bool(d.host);
  nb::list consts;
  for (const auto& c : d.constants) consts.append(nb::make_tuple(c.index, c.value));
  r["constants"] = consts;
  nb::list bufs;
  for (const auto& b : d.buffers)
    bufs.append(nb::make_tuple(b.index, uintptr_t(static_cast<char*>(b.base) + b.offset), b.extent, uintptr_t(b.base), b.offset));
  r["buffers"] = bufs;
  r["args_index"] = d.args_index;
  r["args"] = nb::bytes(reinterpret_cast<const char*>(d.args.data()), d.args.size());
  r["flops"] = d.flops;
  r["bytes"] = d.bytes;
  r["rate"] = metal::rate_class_name(d.rate);
  r["grid"] = nb::make_tuple(d.grid[0], d.grid[1], d.grid[2]);
  r["threads"] = nb::make_tuple(d.threads[0], d.threads[1], d.threads[2]);
  r["flops"] = d.flops;
  return r;
}

nb::list to_list(const std::vector<Dispatch>& v) {
  nb::list l;
  for (const auto& d : v) l.append(to_dict(d));
  return l;
}

// A simulator device's executor calling `fn`, kept alive for the life of the process (a static
// destructor must not touch Python). It runs on the device's worker thread; a Python error becomes
// a C++ one while the GIL is held (its text needs it): the command buffer's failure, raised at its
// step's end.
metal::SimExecutor python_executor(nb::callable fn) {
  auto* keep = new nb::callable(std::move(fn));
  return [keep](const std::vector<Dispatch>& records) {
    nb::gil_scoped_acquire gil;
    try {
      (*keep)(to_list(records));
    } catch (nb::python_error& e) {
      throw std::runtime_error(e.what());
    }
  };
}

// The workers call into Python: they finish and stop while the interpreter still runs (one atexit
// hook for every simulator device).
void stop_workers_at_exit() {
  static bool registered = false;
  if (registered) return;
  nb::module_::import_("atexit").attr("register")(nb::cpp_function([] {
    nb::gil_scoped_release release;
    metal::metal_sim_shutdown();
  }));
  registered = true;
}

metal::MetalOps& metal_device(Backend& d, const char* what) {
  auto* m = dynamic_cast<metal::MetalOps*>(&d);
  if (!m) throw std::invalid_argument(std::string("[") + what + "] device " + d.name() + " is not a Metal device");
  return *m;
}

// A made-up GPU for the policy functions: {name, apple_family, mac2, unified_memory, low_power,
// removable, working_set}, absent keys at their defaults.
metal::GpuDescription gpu_from(const nb::dict& d) {
  metal::GpuDescription g;
  for (auto [k, v] : d) {
    const std::string key = nb::cast<std::string>(k);
    if (key == "name") g.name = nb::cast<std::string>(v);
    else if (key == "apple_family") g.apple_family = nb::cast<int>(v);
    else if (key == "mac2") g.mac2 = nb::cast<bool>(v);
    else if (key == "unified_memory") g.unified_memory = nb::cast<bool>(v);
    else if (key == "low_power") g.low_power = nb::cast<bool>(v);
    else if (key == "removable") g.removable = nb::cast<bool>(v);
    else if (key == "working_set") g.working_set = nb::cast<uint64_t>(v);
    else throw std::invalid_argument("[metal_gpu] unknown GPU description key '" + key + "'");
  }
  return g;
}

constexpr metal::RateClass kRateClasses[] = {metal::RateClass::memory,          metal::RateClass::gemm,
                                             metal::RateClass::attention,       metal::RateClass::quantized_tiled,
                                             metal::RateClass::quantized_rows};

metal::RateClass rate_class(const std::string& name) {
  for (metal::RateClass r : kRateClasses)
    if (name == metal::rate_class_name(r)) return r;
  throw std::invalid_argument("[metal_rate_class] unknown rate class '" + name + "'");
}

nb::dict policy_dict(const metal::CommandBufferPolicy& p) {
  nb::dict r;
  r["max_dispatches"] = p.max_dispatches, r["max_ms"] = p.max_ms, r["max_dispatch_ms"] = p.max_dispatch_ms;
  r["peak_gflops"] = p.peak_gflops, r["gbps"] = p.gbps;
  nb::dict rates;
  for (metal::RateClass c : kRateClasses) rates[metal::rate_class_name(c)] = p.gflops(c);
  r["gflops"] = rates;
  return r;
}

// device.mm's library cache with a fake compiler: compiling a library sleeps its delay (ms, from
// the constructor) and then returns "lib:<name>", or throws a two-line log for a failing one.
// Counts each library's compiles, which must be one.
struct LibraryCacheProbe {
  std::map<std::string, double> delay_ms;
  std::set<std::string> failing;
  std::map<std::string, std::atomic<int>> compiles;
  std::unique_ptr<metal::LibraryCache<std::string>> cache;

  LibraryCacheProbe(const std::vector<std::string>& names, std::map<std::string, double> delays,
                    std::set<std::string> fail)
      : delay_ms(std::move(delays)), failing(std::move(fail)) {
    for (const auto& n : names) compiles[n];
    cache = std::make_unique<metal::LibraryCache<std::string>>(names, [this](const std::string& n) {
      compiles[n]++;
      auto it = delay_ms.find(n);
      if (it != delay_ms.end())
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(it->second));
      if (failing.count(n)) throw std::runtime_error("program_source:3:5: error: use of undeclared identifier 'x'\n  x = 1;");
      return "lib:" + n;
    });
  }
};

}  // namespace

void bind_metal(nb::module_& m, nb::module_& t) {
  m.def("metal_gpu", [](Backend& d) {
          metal::MetalOps& mo = metal_device(d, "metal_gpu");
          const metal::GpuDescription& g = mo.gpu();
          nb::dict r;  // gpu_from's keys, and the command-buffer budget derived from them
          r["name"] = g.name, r["apple_family"] = g.apple_family, r["mac2"] = g.mac2;
          r["unified_memory"] = g.unified_memory, r["low_power"] = g.low_power, r["removable"] = g.removable;
          r["working_set"] = g.working_set;
          r["command_buffer_policy"] = policy_dict(mo.command_buffer_policy());
          return r;
        }, "device"_a,
        "What a Metal device knows of its GPU (krnl doctor's report): name, apple_family (0: below Apple7), mac2, "
        "unified_memory, low_power, removable, working_set (recommendedMaxWorkingSetSize, bytes) and the "
        "command-buffer policy its limits give.");
  m.def("metal_libraries", &metal::library_names, "The op families of metal/ (one .metal file each).");
  m.def("metal_library_source", &metal::library_source, "name"_a,
        "The MSL source of metal/<name>.metal embedded in the binary, includes inlined (what the Metal device "
        "compiles at run time).");
  m.def("metal_library_msl_version", &metal::library_msl_version, "name"_a,
        "The MSL version metal/<name>.metal declares on its first line ('// msl: X.Y') as major * 100 + minor "
        "(3.1 -> 301): the language version the Metal device compiles it with.");
  nb::class_<LibraryCacheProbe>(t, "LibraryCacheProbe",
                                 "device.mm's library cache (csrc/metal/library_cache.h) over a fake compiler.")
      .def(nb::init<const std::vector<std::string>&, std::map<std::string, double>, std::set<std::string>>(),
           "names"_a, "delay_ms"_a = std::map<std::string, double>{}, "failing"_a = std::set<std::string>{})
      .def("start_background", [](LibraryCacheProbe& p) { p.cache->start_background(); })
      .def("get", [](LibraryCacheProbe& p, const std::string& name, const std::string& op) { return p.cache->get(name, op); },
           "name"_a, "op"_a = "an_op", nb::call_guard<nb::gil_scoped_release>())
      .def("compile_all", [](LibraryCacheProbe& p) { return p.cache->compile_all("compile_libraries"); },
           nb::call_guard<nb::gil_scoped_release>())
      .def("stop", [](LibraryCacheProbe& p) { p.cache->stop(); }, nb::call_guard<nb::gil_scoped_release>())
      .def("progress", [](LibraryCacheProbe& p) { return p.cache->progress(); })
      .def("compiled_in_background", [](LibraryCacheProbe& p, const std::string& n) { return p.cache->compiled_in_background(n); })
      .def("compiles", [](LibraryCacheProbe& p) {
        std::map<std::string, int> r;
        for (auto& [n, c] : p.compiles) r[n] = c.load();
        return r;
      });
  t.def("register_metal_sim", [](nb::callable fn) {
    metal::register_metal_sim(python_executor(std::move(fn)));
    stop_workers_at_exit();
  }, "executor"_a,
        "Registers the 'metal-sim' device: each committed command buffer's dispatch records (dicts: kernel, "
        "library, constants, buffers as (index, address, extent, base, offset), args bytes, grid, threads) run "
        "as executor(records) on a worker thread. The test suite passes tools/mslsim's executor.");
  t.def("register_metal_cuda", [](nb::callable fn, uintptr_t alloc, uintptr_t free, int apple_family) {
    metal::SimMemory mem;
    mem.alloc = reinterpret_cast<void* (*)(size_t)>(alloc);
    mem.free = reinterpret_cast<void (*)(void*)>(free);
    metal::register_metal_cuda(python_executor(std::move(fn)), mem, apple_family);
    stop_workers_at_exit();
  }, "executor"_a, "alloc"_a, "free"_a, "apple_family"_a = 9,
        "Registers the 'metal-cuda' device: metal-sim's device with executor(records) running each committed "
        "command buffer on an NVIDIA GPU (tools/mslcuda; it returns once the GPU has finished) and memory from "
        "the C functions at addresses alloc (void* (size_t)) and free (void (void*)). apple_family: the GPU "
        "family it stands for (its capabilities).");
  t.def("metal_sim_set_lag", [](const std::string& mode, double max_ms, uint64_t seed) {
          nb::gil_scoped_release release;
          metal::metal_sim_set_lag(mode, max_ms, seed);
        }, "mode"_a, "max_ms"_a = 0.0, "seed"_a = 0,
        "How metal-sim's completion lags behind commit: 'wait' (a command buffer runs only once waited for; the "
        "default), 'delay' (also after a seeded random delay of up to max_ms), 'none' (at once).");
  t.def("metal_sim_set_gpu", [](int apple_family, uint64_t working_set) {
          nb::gil_scoped_release release;
          metal::metal_sim_set_gpu(apple_family, working_set);
        }, "apple_family"_a, "working_set"_a = 0,
        "Makes metal-sim stand for an Apple GPU of that family (7: M1, 8: M2, 9: M3, the default): its capabilities "
        "and its bf16 policy (offered from 9, where bf16 is native) follow. working_set: its recommended working "
        "set in bytes, the pool's default limit (0: none, the default). Waits for committed work first.");
  t.def("metal_last_step", [](Backend& d) {
          metal::MetalOps& mo = metal_device(d, "metal_last_step");
          nb::dict r;
          r["records"] = to_list(mo.last_step_records());
          r["command_buffers"] = mo.last_step_command_buffers();
          return r;
        }, "device"_a,
        "The last committed step of a Metal device that keeps its log (metal-sim): its records (GPU and host, in "
        "call order) and the dispatch count of each of its command buffers.");
  t.def("metal_sim_last_step", [] { return to_list(metal_device(*get_device("metal-sim"), "metal_sim_last_step").last_step_records()); },
        "The dispatch records of the last step the metal-sim device committed.");
  t.def("metal_set_ordering_rules", [](Backend& d, bool host_after_earlier, bool upload_in_order, bool split_steps) {
          metal_device(d, "metal_set_ordering_rules").set_ordering_rules({host_after_earlier, upload_in_order, split_steps});
        }, "device"_a, "host_after_earlier"_a = true, "upload_in_order"_a = true, "split_steps"_a = true,
        "Tests only: switches the ordering rules of a Metal device's steps off, to show what each is for.");
  t.def("metal_command_buffer_policy", [](Backend& d) {
          return policy_dict(metal_device(d, "metal_command_buffer_policy").command_buffer_policy());
        }, "device"_a);
  t.def("metal_set_command_buffer_policy", [](Backend& d, uint32_t max_dispatches, double max_ms, double max_dispatch_ms) {
          if (max_dispatches < 1 || !(max_ms > 0) || max_dispatch_ms < 0)
            throw std::invalid_argument(
                "[metal_set_command_buffer_policy] max_dispatches must be >= 1, max_ms > 0 and max_dispatch_ms >= 0");
          metal::MetalOps& mo = metal_device(d, "metal_set_command_buffer_policy");
          metal::CommandBufferPolicy p = mo.command_buffer_policy();
          p.max_dispatches = max_dispatches, p.max_ms = max_ms;
          if (max_dispatch_ms > 0) p.max_dispatch_ms = max_dispatch_ms;
          mo.set_command_buffer_policy(p);
        }, "device"_a, "max_dispatches"_a, "max_ms"_a, "max_dispatch_ms"_a = 0.0,
        "When a step's work goes into another command buffer on a Metal device, and (max_dispatch_ms, when > 0) "
        "the estimated time above which one product is split into several dispatches.");
  // The portable policy functions device.mm calls, on made-up GPUs (tests/test_metal_policy.py).
  t.def("metal_gpu_policy", [](const nb::dict& desc) {
          metal::GpuDescription g = gpu_from(desc);
          std::string why;
          nb::dict r;
          r["usable"] = metal::gpu_usable(g, &why);
          r["reason"] = why;
          r["native_bf16"] = metal::native_bf16(g);
          r["dtypes"] = dtype_names(metal::compute_dtypes(g, false));
          r["compute_dtype"] = dtype_name(metal::default_compute_dtype(g, false));
          r["dtypes_with_bf16_kernels"] = dtype_names(metal::compute_dtypes(g, true));
          r["compute_dtype_with_bf16_kernels"] = dtype_name(metal::default_compute_dtype(g, true));
          r["command_buffer"] = policy_dict(metal::command_buffer_policy(g));
          return r;
        }, "gpu"_a, "What the Metal backend decides for a GPU described as a dict (device.mm's view of it).");
  t.def("metal_choose_device", [](const std::vector<nb::dict>& candidates, uint32_t os_msl, uint32_t needed_msl) {
          std::vector<metal::GpuDescription> gs;
          for (const auto& c : candidates) gs.push_back(gpu_from(c));
          metal::DeviceChoice ch = metal::choose_device(gs, os_msl, needed_msl);
          return nb::make_tuple(ch.index, ch.reason);
        }, "candidates"_a, "os_msl"_a, "needed_msl"_a,
        "The GPU the 'metal' device takes: (index into candidates, '') or (-1, one-line reason). Candidates list "
        "the system default first; os_msl / needed_msl are MSL versions as major*100+minor.");
  t.def("metal_estimate_ms", [](const nb::dict& gpu, double flops, double bytes, const std::string& rate) {
          return metal::estimate_ms(flops, bytes, rate_class(rate), metal::command_buffer_policy(gpu_from(gpu)));
        }, "gpu"_a, "flops"_a, "bytes"_a, "rate"_a,
        "Estimated GPU milliseconds of one dispatch of that many flops and bytes by a kernel of that rate class "
        "on the GPU described (what the command-buffer cut and the dispatch budget use).");
  t.def("metal_plan_blocks", [](const nb::dict& gpu, int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols,
                                const std::string& rate, double flops_per_elem, double bytes_per_row,
                                double bytes_per_col, double bytes_per_elem, double max_dispatch_ms) {
          const metal::CommandBufferPolicy p = metal::command_buffer_policy(gpu_from(gpu));
          const metal::RateClass rc = rate_class(rate);
          auto ms = [&](int64_t r, int64_t c) {
            return metal::estimate_ms(flops_per_elem * double(r) * double(c),
                                      bytes_per_row * double(r) + bytes_per_col * double(c) +
                                          bytes_per_elem * double(r) * double(c),
                                      rc, p);
          };
          const metal::BlockPlan b =
              metal::plan_blocks(rows, cols, tile_rows, tile_cols, max_dispatch_ms > 0 ? max_dispatch_ms : p.max_dispatch_ms, ms);
          nb::dict r;
          r["rows"] = b.rows, r["cols"] = b.cols, r["row_blocks"] = b.row_blocks, r["col_blocks"] = b.col_blocks;
          r["block_ms"] = ms(b.rows, b.cols);
          r["whole_ms"] = ms(rows, cols);
          return r;
        }, "gpu"_a, "rows"_a, "cols"_a, "tile_rows"_a, "tile_cols"_a, "rate"_a, "flops_per_elem"_a, "bytes_per_row"_a,
        "bytes_per_col"_a, "bytes_per_elem"_a, "max_dispatch_ms"_a = 0.0,
        "How a product's (rows, cols) output is cut into dispatches under the GPU's per-dispatch budget (policy.h "
        "plan_blocks), for a cost of flops_per_elem per output element and bytes linear in the block's rows, "
        "columns and elements: block size, block counts, the largest block's and the whole product's estimate.");
  t.def("metal_plan_attention", [](const nb::dict& gpu, const std::string& kernel, int64_t Hq, int64_t Hk, int64_t T,
                                   int64_t D, int64_t window, size_t dtype_bytes, double max_dispatch_ms) {
          metal::CommandBufferPolicy p = metal::command_buffer_policy(gpu_from(gpu));
          if (max_dispatch_ms > 0) p.max_dispatch_ms = max_dispatch_ms;
          const metal::AttentionKernel k = kernel == "forward" ? metal::AttentionKernel::forward
                                           : kernel == "dq"    ? metal::AttentionKernel::dq
                                           : kernel == "dkv"   ? metal::AttentionKernel::dkv
                                                               : throw std::invalid_argument(
                                                                     "[metal_plan_attention] kernel must be forward, dq or dkv");
          nb::list l;
          for (const metal::AttentionPart& a : metal::attention_parts(p, k, Hq, Hk, T, D, window, dtype_bytes)) {
            nb::dict r;
            r["head0"] = a.part.head0, r["heads"] = a.part.heads, r["row0"] = a.part.row0, r["rows"] = a.part.rows;
            r["tile"] = a.tile, r["flops"] = a.flops, r["bytes"] = a.bytes, r["ms"] = a.ms;
            l.append(r);
          }
          return l;
        }, "gpu"_a, "kernel"_a, "Hq"_a, "Hk"_a, "T"_a, "D"_a, "window"_a = 0, "dtype_bytes"_a = 2, "max_dispatch_ms"_a = 0.0,
        "The dispatches one attention kernel ('forward', 'dq', 'dkv') is cut into on the GPU described: parts of "
        "its grid (heads, rows) with their flops, bytes and estimate, as the Metal backend encodes them.");
  t.def("metal_plan_command_buffers", [](const nb::dict& gpu, const std::vector<std::pair<double, double>>& work,
                                         uint32_t max_dispatches, double max_ms) {
          metal::CommandBufferPolicy p = metal::command_buffer_policy(gpu_from(gpu));
          if (max_dispatches) p.max_dispatches = max_dispatches;
          if (max_ms > 0) p.max_ms = max_ms;
          std::vector<double> ms;
          for (auto [flops, bytes] : work) {
            Dispatch d;
            d.flops = flops;
            d.rate = metal::RateClass::gemm;  // (flops, bytes) pairs describe GEMMs
            d.buffers.push_back({0, nullptr, 0, size_t(bytes)});
            ms.push_back(metal::estimate_ms(d, p));
          }
          return metal::plan_command_buffers(p, ms);
        }, "gpu"_a, "work"_a, "max_dispatches"_a = 0, "max_ms"_a = 0.0,
        "Command-buffer sizes (dispatch counts) for a step of GEMM dispatches given as (flops, bytes), under the GPU's "
        "policy (max_dispatches / max_ms override it when set).");
  t.def("set_row_split", [](Backend& d, bool enabled, double cpu_gflops, double gpu_gflops, double overhead_ms,
                            int64_t min_flops) {
    metal::RowSplitConfig c{enabled, cpu_gflops, gpu_gflops, overhead_ms, min_flops};
    if (enabled && !(cpu_gflops > 0 && gpu_gflops > 0))
      throw std::invalid_argument("[row_split] cpu_gflops and gpu_gflops must be > 0 (measured rates)");
    metal_device(d, "row_split").set_row_split(c);
  }, "device"_a, "enabled"_a, "cpu_gflops"_a = 0.0, "gpu_gflops"_a = 0.0, "overhead_ms"_a = 0.0,
        "min_flops"_a = int64_t(1) << 30,
        "CPU/GPU row split of large f32 GEMMs on a Metal device: the CPU takes the share of rows the core's planner "
        "computes from the two rates so both engines finish together.");
}

}  // namespace krnl::bindings
