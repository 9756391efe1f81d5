// krnl._core.testing: what only the tests call, built into the module but kept out of its
// user API: a second CPU device, the buffer pool over malloc, the pure planners and the op list.
// The Metal hooks (metal-sim and friends) join it from metal.cpp.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <unordered_map>

#include "bindings.h"
#include "core/split_k.h"
#include "cpu/cpu_backend.h"

namespace krnl::bindings {

void bind_testing(nb::module_& m) {
  using namespace nb::literals;
  m.def("register_second_cpu", &cpu::register_second_backend,
        "Registers a second CPU device, 'cpu:1', for the cross-device error tests (idempotent).");
  m.def("op_names", [] {
          std::vector<std::string> names;
#define KRNL_OP_NAME(name, params) names.push_back(#name);
          KRNL_OPS(KRNL_OP_NAME)
#undef KRNL_OP_NAME
          return names;
        }, "The ops of csrc/core/op_list.h, in order: the tests check that krnl._core.ops binds each.");

  // The pool logic on its own, with the caller playing the device's submission clock.
  struct HostPool {
    BufferPool pool{[](size_t n) { return std::malloc(n); }, [](void* p, size_t) { std::free(p); }};
    std::unordered_map<uint64_t, Buffer> live;
  };
  nb::class_<HostPool>(m, "HostBufferPool", "A BufferPool over malloc, for testing its policy.")
      .def(nb::init<>())
      .def_static("class_size", &BufferPool::class_size, "bytes"_a)
      .def("acquire", [](HostPool& h, size_t bytes, uint64_t completed, bool exact) {
             Buffer b = h.pool.acquire(bytes, completed, exact);
             h.live[b.id] = b;
             return nb::make_tuple(b.id, b.bytes);
           }, "bytes"_a, "completed_seq"_a, "exact"_a = false, "Returns (buffer id, bytes reserved: the class size, "
           "or with exact the size in multiples of 256).")
      .def("release", [](HostPool& h, uint64_t id, uint64_t retire_seq, uint64_t completed, bool reuse_now) {
             auto it = h.live.find(id);
             if (it == h.live.end()) throw std::invalid_argument("[release] buffer " + std::to_string(id) + " is not in use");
             h.pool.release(it->second, retire_seq, completed, reuse_now);
             h.live.erase(it);
           }, "id"_a, "retire_seq"_a, "completed_seq"_a, "reuse_now"_a = false)
      .def("has_cached", [](HostPool& h, size_t bytes, uint64_t completed) { return h.pool.has_cached(bytes, completed); },
           "bytes"_a, "completed_seq"_a, "Whether acquire(bytes) would reuse a cached buffer.")
      .def("trim", [](HostPool& h, uint64_t completed) { h.pool.trim(completed); }, "completed_seq"_a = UINT64_MAX)
      .def("set_limit", [](HostPool& h, size_t bytes, const std::string& origin) { h.pool.set_limit(bytes, origin); },
           "bytes"_a, "origin"_a = "a test")
      .def("reset_peak", [](HostPool& h) { h.pool.reset_peak(); })
      .def("stats", [](HostPool& h) { return pool_stats_dict(h.pool.stats()); });

  m.def("probe_blas_threads", &cpu::probe_blas_threads,
        "The BLAS's thread count before, inside each chunk of a parallel region that holds the CPU GEMM's "
        "single-thread scopes, and after (OpenBLAS: its count; Accelerate: 1 single-threaded, 0 its own choice).");
  m.def("blas_fans_out", &cpu::blas_fans_out, "Whether the CPU backend runs BLAS calls side by side on its pool.");
  m.def("parse_size", [](const std::string& text) { return BufferPool::parse_size(text, "parse_size"); }, "text"_a,
        "A size as KRNL_MAX_MEMORY takes it, in bytes (0: no limit).");
  m.def("plan_split_k", [](int64_t M, int64_t N, int64_t K, int64_t batch, int64_t tile_m, int64_t tile_n,
                           int64_t min_tiles, int64_t k_unit, int64_t max_splits, int64_t min_k_per_split) {
          SplitKConfig c{tile_m, tile_n, min_tiles, k_unit, max_splits, min_k_per_split};
          SplitKPlan p = plan_split_k(M, N, K, batch, c);
          return nb::make_tuple(p.splits, p.k_per_split);
        }, "M"_a, "N"_a, "K"_a, "batch"_a = 1, "tile_m"_a = 32, "tile_n"_a = 32, "min_tiles"_a = 0, "k_unit"_a = 32,
        "max_splits"_a = 16, "min_k_per_split"_a = 256, "Split-K routing: returns (splits, k_per_split).");
  m.def("plan_row_split", [](int64_t M, double t_cpu, double t_gpu, double overhead, int64_t tile_m) {
          RowSplitPlan p = plan_row_split(M, t_cpu, t_gpu, overhead, tile_m);
          nb::dict r;
          r["cpu_rows"] = p.cpu_rows, r["gpu_rows"] = p.gpu_rows, r["cpu_fraction"] = p.cpu_fraction;
          return r;
        }, "M"_a, "t_cpu"_a, "t_gpu"_a, "overhead"_a = 0.0, "tile_m"_a = 32,
        "CPU/GPU row split of a GEMM so both finish together: p = (O + T_gpu)/(T_cpu + T_gpu).");
}

}  // namespace krnl::bindings
