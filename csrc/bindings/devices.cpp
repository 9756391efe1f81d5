// Devices: creation of tensors, the step context, pool statistics.
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "bindings.h"
#include "core/ops.h"
#include "core/split_k.h"
#include "metal/metal_ops.h"

namespace krnl::bindings {
namespace {

using namespace nb::literals;

const char* numpy_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "float32";  // converted on the host below
    case DType::i32: return "int32";
  }
  return "float32";
}

DType default_dtype(nb::handle arr) {
  std::string kind = nb::cast<std::string>(arr.attr("dtype").attr("kind"));
  std::string name = nb::cast<std::string>(arr.attr("dtype").attr("name"));
  if (name == "float16") return DType::f16;
  if (kind == "i" || kind == "u" || kind == "b") return DType::i32;
  return DType::f32;
}

// Copies array-like data, converted to t's dtype, into the contiguous tensor t.
void upload_into(Backend& dev, const Tensor& t, nb::handle arr) {
  nb::object np = nb::module_::import_("numpy");
  nb::object a = np.attr("ascontiguousarray")(arr, "dtype"_a = numpy_name(t.dtype()));
  auto view = nb::cast<nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>>(a);
  if (t.dtype() == DType::bf16) {
    std::vector<uint16_t> bits(size_t(t.numel()));
    const float* src = static_cast<const float*>(view.data());
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = f32_to_bf16(src[i]);
    nb::gil_scoped_release release;  // an upload may wait for device work (metal-sim's executor is Python)
    dev.upload(t, bits.data());
  } else {
    nb::gil_scoped_release release;
    dev.upload(t, view.data());
  }
}

// Backend::empty without the GIL: past the pool's limit it may wait for device work, which
// metal-sim's executor runs in Python.
Tensor empty_nogil(Backend& dev, const Shape& shape, DType dt) {
  nb::gil_scoped_release release;
  return dev.empty(shape, dt);
}

// Copies any array-like into a new tensor of `dt` on `dev`.
Tensor tensor_from(Backend& dev, nb::handle data, nb::handle dtype) {
  nb::object np = nb::module_::import_("numpy");
  nb::object arr = np.attr("asarray")(data);
  DType dt = dtype.is_none() ? default_dtype(arr) : to_dtype(dtype);
  Tensor t = empty_nogil(dev, to_shape(arr.attr("shape")), dt);
  upload_into(dev, t, arr);
  return t;
}

// Device.upload: new contents for an existing tensor (same shape), e.g. a captured graph's input.
void upload_to(Backend& dev, const Tensor& t, nb::handle data) {
  if (t.device() != &dev)
    throw std::invalid_argument("[upload] the tensor is on " + t.device()->name() + ", not " + dev.name());
  if (!t.is_contiguous()) throw std::invalid_argument("[upload] needs a contiguous tensor, got " + t.describe());
  nb::object arr = nb::module_::import_("numpy").attr("asarray")(data);
  if (to_shape(arr.attr("shape")) != t.shape())
    throw std::invalid_argument("[upload] data of shape " + shape_str(to_shape(arr.attr("shape"))) +
                                " does not match " + t.describe());
  upload_into(dev, t, arr);
}

// A recorded graph and what the recorded call returned (its tensors are the graph's outputs).
struct PyGraph {
  std::unique_ptr<Graph> graph;
  nb::object outputs;
};

// Zero-copy view of a numpy array's memory (like torch.from_numpy): the tensor keeps the array
// alive and ops write through to it.
Tensor tensor_wrap(Backend& dev, nb::handle obj) {
  if (!dev.host_visible())
    throw std::invalid_argument("[from_numpy] " + dev.name() +
                                " memory is not host-visible, so a numpy array cannot be shared with it; "
                                "use Device.tensor() to copy");
  // No implicit conversion: a converted copy would silently swallow every write.
  nb::ndarray<nb::c_contig, nb::device::cpu> arr;
  if (!nb::try_cast(obj, arr, /*convert=*/false))
    throw std::invalid_argument("[from_numpy] needs a C-contiguous numpy array (got " +
                                std::string(nb::str(nb::handle(obj.type())).c_str()) +
                                " that is not one); use Device.tensor() to copy and convert");
  DType dt;
  if (arr.dtype() == nb::dtype<float>())
    dt = DType::f32;
  else if (arr.dtype() == nb::dtype<int32_t>())
    dt = DType::i32;
  else if (arr.dtype().code == uint8_t(nb::dlpack::dtype_code::Float) && arr.dtype().bits == 16)
    dt = DType::f16;
  else
    throw std::invalid_argument("[from_numpy] needs a C-contiguous float32, float16 or int32 array; "
                                "use Device.tensor() to copy and convert");
  Shape shape;
  for (size_t i = 0; i < arr.ndim(); ++i) shape.push_back(int64_t(arr.shape(i)));
  PyObject* raw = obj.inc_ref().ptr();  // keeps the numpy array alive
  return dev.wrap(arr.data(), shape, dt, [raw] {
    nb::gil_scoped_acquire gil;
    Py_DECREF(raw);
  });
}

nb::dict capabilities_dict(const Capabilities& c) {
  nb::dict fused;
  fused["dtypes"] = dtype_names(c.fused_attention_dtypes);
  fused["segments"] = c.fused_attention_segments;
  fused["window"] = c.fused_attention_window;
  fused["sinks"] = c.fused_attention_sinks;
  fused["token_major"] = c.fused_attention_token_major;
  nb::list workspace;
  workspace.append(c.fused_attention_workspace_element);
  workspace.append(c.fused_attention_workspace_row);
  fused["workspace"] = workspace;
  nb::list dims;
  for (int64_t D : c.fused_attention_head_dims) dims.append(D);
  fused["head_dims"] = dims;
  nb::dict details;
  for (const auto& [k, v] : c.details) details[k.c_str()] = v;
  nb::dict d;
  d["kind"] = c.kind;
  d["dtypes"] = dtype_names(c.dtypes);
  d["compute_dtype"] = dtype_name(c.compute_dtype);
  d["fused_attention"] = fused;
  d["graphs"] = c.graphs;
  d["host_visible"] = c.host_visible;
  d["synchronous"] = c.synchronous;
  d["queue_ordered"] = c.queue_ordered;
  d["attention_block"] = c.attention_block;
  d["gemm_tuning"] = c.gemm_tuning;
  nb::list coll;
  for (const auto& name : c.collectives) coll.append(name);
  d["collectives"] = coll;
  d["lora_fold"] = c.lora_fold;
  d["details"] = details;
  return d;
}

// The GEMM variant table lives on Metal devices; `what` names the method in the error.
metal::MetalOps& gemm_table(Backend& d, const char* what) {
  auto* m = dynamic_cast<metal::MetalOps*>(&d);
  if (!m) throw std::invalid_argument(std::string("[") + what + "] " + d.name() + " has one GEMM kernel (no variants)");
  return *m;
}

struct Step {
  Backend* dev;
  uint64_t seq = 0;
};

}  // namespace

nb::dict pool_stats_dict(const PoolStats& s) {
  nb::dict d;
  d["in_use"] = s.in_use;
  d["pending"] = s.pending;
  d["cached"] = s.cached;
  d["reserved"] = s.reserved;
  d["peak_in_use"] = s.peak_in_use;
  d["peak_reserved"] = s.peak_reserved;
  d["allocations"] = s.allocations;
  d["reuses"] = s.reuses;
  return d;
}

nb::list dtype_names(const std::vector<DType>& v) {
  nb::list l;
  for (DType d : v) l.append(dtype_name(d));
  return l;
}

void bind_devices(nb::module_& m) {
  using namespace nb::literals;

  m.def("devices", &available_devices, "Names of the devices this build can use, best first.");
  m.def("unavailable_devices", [] {
          nb::dict d;
          for (const auto& [name, reason] : unavailable_devices()) d[name.c_str()] = reason;
          return d;
        }, "Devices this build has but this machine cannot run: {name: one-line reason}.");
  m.def(
      "device", [](const std::string& name) { return get_device(name); }, "name"_a, nb::rv_policy::reference,
      "The device called `name` ('cpu', ...).");

  nb::class_<Step>(m, "Step", "Context manager of one submission: `with dev.step(): ...`.")
      .def("__enter__", [](Step& s) { s.dev->begin_step(); return &s; }, nb::rv_policy::reference)
      .def("__exit__", [](Step& s, nb::handle, nb::handle, nb::handle) {
             nb::gil_scoped_release release;
             s.seq = s.dev->commit();
             return false;
           },
           nb::arg().none(), nb::arg().none(), nb::arg().none())
      .def_ro("seq", &Step::seq, "The submission's sequence number once committed (0 before).");

  nb::class_<Backend>(m, "Device")
      .def_prop_ro("name", &Backend::name)
      .def("capabilities", [](const Backend& d) { return capabilities_dict(d.capabilities()); },
           "What this device can do, from its backend: kind, dtypes (float compute dtypes with kernels here), "
           "compute_dtype (the training default), fused_attention ({dtypes, segments, window, sinks, head_dims, "
           "token_major, workspace}: where the fused attention ops beat the materialised path, with packed segments, a "
           "sliding window, attention sinks, for which head sizes ([] = any), on token-major (B, T, H, D) views; the "
           "bytes the backward's workspace takes per (B, H, T, D) element and per (B, H, T) row), graphs (capture/replay), host_visible (zero-copy numpy views), "
           "synchronous (ops complete when they return), queue_ordered (buffers released inside a step are "
           "reused within it), attention_block (query rows per materialised attention block, 0: all), "
           "gemm_tuning (timing the GEMM variants measures a real GPU: krnl tune), collectives (libraries summing tensors "
           "across processes on the device itself: 'nccl' on CUDA), lora_fold (the model folds each LoRA's second product "
           "into its frozen GEMM's K), details (hardware facts).")
      .def("gemm_variants", [](Backend& d) {
             auto* m = dynamic_cast<metal::MetalOps*>(&d);
             return m ? m->gemm_variants() : std::vector<std::string>{};
           },
           "The plain GEMM kernels this device can choose between, the default first ([] where there is one).")
      .def("gemm_shape_classes", [](Backend& d) { return gemm_table(d, "gemm_shape_classes").gemm_shape_classes(); },
           "Every shape class a GEMM variant is chosen for: dtype.form.size, e.g. f16.nt.large.")
      .def("gemm_shape_class", [](Backend& d, int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b,
                                  nb::handle dtype, nb::handle c_dtype, int64_t batch) {
             const DType a = to_dtype(dtype);
             return gemm_table(d, "gemm_shape_class")
                 .gemm_shape_class(M, N, K, batch, trans_a, trans_b, a, c_dtype.is_none() ? a : to_dtype(c_dtype));
           },
           "M"_a, "N"_a, "K"_a, "trans_a"_a = false, "trans_b"_a = false, "dtype"_a = "f32",
           "c_dtype"_a = nb::none(), "batch"_a = 1,
           "The shape class of gemm(op(A) (M, K), op(B) (K, N)) with operands of `dtype` and C of `c_dtype`.")
      .def("gemm_choices", [](Backend& d) {
             auto* m = dynamic_cast<metal::MetalOps*>(&d);
             return m ? m->gemm_choices() : std::map<std::string, std::string>{};
           },
           "The variant table: {shape class or '*': variant}; a class without an entry takes '*', else the default.")
      .def("set_gemm_choice", [](Backend& d, const std::string& shape_class, nb::handle variant) {
             gemm_table(d, "set_gemm_choice")
                 .set_gemm_choice(shape_class, variant.is_none() ? std::string() : nb::cast<std::string>(variant));
           },
           "shape_class"_a, "variant"_a.none(),
           "Runs `variant` for GEMMs of `shape_class` ('*': every class without its own entry); None removes the entry.")
      .def("clear_gemm_choices", [](Backend& d) {
             if (auto* m = dynamic_cast<metal::MetalOps*>(&d)) m->clear_gemm_choices();
           },
           "Every GEMM back to the default variant.")
      .def("compile_libraries", [](Backend& d) {
             auto* m = dynamic_cast<metal::MetalOps*>(&d);
             if (!m) throw NotImplementedError("[compile_libraries] " + d.name() + " is not a Metal device: it has no "
                                               "Metal libraries to compile");
             nb::gil_scoped_release release;
             return m->compile_libraries();
           },
           "Metal only: waits until every kernel library of metal/ is compiled (the device compiles them in the "
           "background from its creation; this compiles any not yet started) and returns {library: compile "
           "milliseconds}. A library that does not compile raises RuntimeError naming it. NotImplementedError on "
           "metal-sim and metal-cuda (their kernels compile in a Python executor) and on other devices.")
      .def("__repr__", [](const Backend& d) { return "krnl.device('" + d.name() + "')"; })
      .def("empty", [](Backend& d, nb::handle shape, nb::handle dtype) { return empty_nogil(d, to_shape(shape), to_dtype(dtype)); },
           "shape"_a, "dtype"_a = "f32", "A new uninitialised tensor from the device's pool.")
      .def("set_exact_sizes", &Backend::set_exact_sizes, "on"_a,
           "While on, new tensors (outside a capture) take buffers of their own size, rounded up to 256 bytes, "
           "instead of the pool's size class (up to 25% more), and give them back to the system when released: "
           "for what lives all run, such as a model's weights (LlamaModel builds under it). Returns the previous "
           "setting.")
      .def("zeros", [](Backend& d, nb::handle shape, nb::handle dtype) {
             Tensor t = empty_nogil(d, to_shape(shape), to_dtype(dtype));
             ops::fill(t, 0.0);
             return t;
           }, "shape"_a, "dtype"_a = "f32")
      .def("tensor", &tensor_from, "data"_a, "dtype"_a = nb::none(),
           "Copies an array-like into a new tensor (dtype: f32, f16, bf16, i32; default from the data).")
      .def("from_numpy", &tensor_wrap, "array"_a,
           "Zero-copy tensor over a C-contiguous float32/float16/int32 numpy array (host-visible devices).")
      .def("upload", &upload_to, "tensor"_a, "data"_a,
           "Copies array-like data (converted to the tensor's dtype) into an existing contiguous tensor of the "
           "same shape, in stream order.")
      .def("capture", [](Backend& d, nb::callable fn) {
             nb::object out = nb::none();
             std::unique_ptr<Graph> g = d.capture([&](bool recording) {
               nb::object r = fn();
               if (recording) out = r;  // the warm-up's result is dropped at once: its buffers go back to the pool
             });
             return PyGraph{std::move(g), out};
           }, "fn"_a,
           "Records fn() as a graph that replay() re-runs with one launch (CUDA graphs; other devices raise "
           "NotImplementedError). fn is called twice: once as an ordinary step (warm-up), then recorded; the "
           "graph's `outputs` is what the recorded call returned.\n\n"
           "Constraints: call it outside a step; fn must do the same work on both calls and may not open "
           "steps, commit, wait, read device memory on the host (numpy(), host id checks such as "
           "embedding_backward's) or capture again: those raise. Every replay repeats the recorded work on the "
           "same buffers with the same shapes and scalars (seeds, lr, loss scale are frozen); data uploaded "
           "inside fn (Device.tensor of numpy data) is a constant of the graph. To vary inputs, create them "
           "before capture and write new contents with Device.upload (or ops) between replays. The graph keeps "
           "every tensor made before the recording that the recorded call touched alive until release(); what "
           "the recording allocates comes from the graph arena that every live graph shares, so the outputs of "
           "a graph stay valid until another graph replays (read or copy them first). A bad id in a replayed embedding "
           "or cross entropy gives NaN (the eager call's host check cannot run).")
      .def_prop_ro("capturing", &Backend::capturing, "Whether a graph is being recorded.")
      .def("step", [](Backend& d) { return Step{&d}; },
           "One submission: every op inside joins it; it is committed on exit.")
      .def("begin_step", &Backend::begin_step)
      // Without the GIL: these may wait for device work, which metal-sim runs in Python.
      .def("commit", &Backend::commit, nb::call_guard<nb::gil_scoped_release>(),
           "Closes the open step; returns its sequence number.")
      .def("wait", &Backend::wait, nb::call_guard<nb::gil_scoped_release>(), "seq"_a,
           "Blocks until submission `seq` has completed.")
      .def("synchronize", &Backend::synchronize, nb::call_guard<nb::gil_scoped_release>(),
           "Blocks until every committed submission has completed.")
      .def_prop_ro("in_step", &Backend::in_step)
      .def_prop_rw("gemm_row_block", &Backend::gemm_row_block, &Backend::set_gemm_row_block,
                   "Rows of one sample while the sample reduce order runs (krnl.models.sample_sums), 0 when off: the "
                   "CPU backend then computes each GEMM in blocks of that many rows (where M is a multiple of "
                   "it) and fixed column chunks, one single-threaded BLAS call each, so a row's bits do not "
                   "depend on how many samples the call holds or on the thread count. Other devices ignore it.")
      .def_prop_ro("completed_seq", &Backend::completed_seq)
      .def_prop_ro("last_committed", &Backend::last_committed)
      .def("pool_stats", [](Backend& d) {
             d.pool().collect(d.completed_seq());
             nb::dict r = pool_stats_dict(d.pool().stats());
             r["graph_arena"] = d.arena_bytes();
             return r;
           },
           "Bytes in use, pending (released inside an unfinished submission), cached, reserved, peaks; "
           "graph_arena: the part of in_use that live graphs' recordings hold (shared by every graph).")
      .def("set_memory_limit", [](Backend& d, nb::handle limit) {
             size_t bytes = 0;
             if (nb::isinstance<nb::str>(limit)) {
               bytes = BufferPool::parse_size(nb::cast<std::string>(limit), "set_memory_limit");
             } else if (nb::isinstance<nb::int_>(limit) && nb::cast<double>(limit) >= 0 &&
                        nb::cast<double>(limit) < 1.8e19) {
               bytes = nb::cast<size_t>(limit);
             } else if (!limit.is_none()) {
               throw std::invalid_argument("[set_memory_limit] takes bytes (an int >= 0), a size such as '24G', or "
                                           "None, got " + nb::cast<std::string>(nb::repr(limit)));
             }
             d.set_memory_limit(bytes);
           }, "limit"_a.none(),
           "The most bytes this device's pool may hold (bytes, or a size such as '24G'); None or 0: no limit. "
           "Overrides KRNL_MAX_MEMORY and the device's default (Metal: the GPU's recommended working set). An "
           "allocation past it raises RuntimeError naming the request and the limit.")
      .def_prop_ro("memory_limit", [](Backend& d) {
             nb::dict r;
             r["bytes"] = d.pool().limit();
             r["origin"] = d.pool().limit_origin();
             return r;
           }, "The pool's limit: {bytes (0: none), origin (where it came from)}.")
      .def("reset_peak", [](Backend& d) { d.pool().reset_peak(); })
      .def("trim", [](Backend& d) { d.pool().trim(d.completed_seq()); },
           "Returns cached buffers to the system (those no unfinished work may still use).")
      .def_prop_ro("split_k_config", [](const Backend& d) {
        SplitKConfig c = d.split_k_config();
        nb::dict r;
        r["tile_m"] = c.tile_m, r["tile_n"] = c.tile_n, r["min_tiles"] = c.min_tiles, r["k_unit"] = c.k_unit;
        r["max_splits"] = c.max_splits, r["min_k_per_split"] = c.min_k_per_split;
        return r;
      });

  nb::class_<PyGraph>(m, "Graph", "A recorded step (Device.capture): replay() re-runs it with one launch.")
      .def("replay", [](PyGraph& g) { return g.graph->replay(); },
           "Queues the recorded work: as its own step (returns its seq) or inside the open step (returns 0).")
      .def("release", [](PyGraph& g) { g.graph->release(); },
           "Frees the graph; its buffers return to the pool once queued replays complete. `outputs` stay valid.")
      .def_prop_ro("released", [](const PyGraph& g) { return g.graph->released(); })
      .def_ro("outputs", &PyGraph::outputs, "What the recorded call of fn returned.")
      .def("__enter__", [](PyGraph& g) { return &g; }, nb::rv_policy::reference)
      .def("__exit__", [](PyGraph& g, nb::handle, nb::handle, nb::handle) { g.graph->release(); return false; },
           nb::arg().none(), nb::arg().none(), nb::arg().none());
}

}  // namespace krnl::bindings
