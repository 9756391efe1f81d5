// Tensors: views, metadata and zero-copy numpy access on host-visible devices.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "bindings.h"

namespace krnl::bindings {
namespace {

using namespace nb::literals;

void check_readable(const Tensor& t, const char* what) {
  Backend* d = t.device();
  if (d->in_step())
    throw std::runtime_error(std::string("[") + what + "] cannot read a tensor while a step is open on " + d->name() +
                             ": read results after the step is committed");
  nb::gil_scoped_release release;  // the wait may need another thread's Python (metal-sim's executor)
  d->synchronize();
}

// A host copy of a tensor on a device whose memory the CPU cannot read (CUDA): the bytes spanned
// by the view are downloaded, then gathered through its strides. The array is the caller's own;
// it is read-only, since writes could not reach the device (Device.tensor() / ops do that).
nb::object to_numpy_copy(const Tensor& t) {
  nb::object np = nb::module_::import_("numpy");
  const Shape& sh = t.shape();
  const Shape& stv = t.strides();
  const size_t es = dtype_size(t.dtype());
  const int64_t n = t.numel();
  int64_t span = n ? 1 : 0;  // elements from the first to the last one the view reaches
  for (size_t d = 0; d < sh.size() && n; ++d) span += (sh[d] - 1) * stv[d];
  std::vector<uint8_t> raw(size_t(span) * es);
  if (span) {
    Tensor flat(t.storage(), t.offset(), Shape{span}, t.dtype());  // contiguous window of the buffer
    t.device()->download(flat, raw.data());
  }
  const bool bf = t.dtype() == DType::bf16;
  const char* name = bf ? "float32" : (t.dtype() == DType::f32 ? "float32" : t.dtype() == DType::f16 ? "float16" : "int32");
  nb::object out = np.attr("empty")(nb::cast(sh), "dtype"_a = name);
  auto view = nb::cast<nb::ndarray<nb::c_contig, nb::device::cpu>>(out);
  auto* dst = static_cast<uint8_t*>(view.data());
  const bool contiguous = t.is_contiguous();
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = i;
    if (!contiguous) {
      int64_t rem = i;
      off = 0;
      for (size_t d = sh.size(); d-- > 0;) {
        off += (rem % sh[d]) * stv[d];
        rem /= sh[d];
      }
    }
    if (bf) {
      uint16_t h;
      std::memcpy(&h, raw.data() + size_t(off) * 2, 2);
      const float f = bf16_to_f32(h);
      std::memcpy(dst + size_t(i) * 4, &f, 4);
    } else {
      std::memcpy(dst + size_t(i) * es, raw.data() + size_t(off) * es, es);
    }
  }
  // Read-only, so that code writing through numpy() (which works on host-visible devices) fails
  // loudly here instead of losing its writes in a copy.
  out.attr("setflags")("write"_a = false);
  return out;
}

nb::object to_numpy(const Tensor& t) {
  check_readable(t, "numpy");
  if (!t.device()->host_visible()) return to_numpy_copy(t);
  if (t.dtype() == DType::bf16) {
    // numpy has no bfloat16: return a float32 copy.
    nb::object np = nb::module_::import_("numpy");
    nb::object out = np.attr("empty")(nb::cast(t.shape()), "dtype"_a = "float32");
    auto view = nb::cast<nb::ndarray<float, nb::c_contig, nb::device::cpu>>(out);
    float* dst = view.data();
    const Shape& sh = t.shape();
    const Shape& st = t.strides();
    const uint16_t* src = t.ptr<uint16_t>();
    const int64_t n = t.numel();
    for (int64_t i = 0; i < n; ++i) {
      int64_t rem = i, off = 0;
      for (size_t d = sh.size(); d-- > 0;) {
        off += (rem % sh[d]) * st[d];
        rem /= sh[d];
      }
      dst[i] = bf16_to_f32(src[off]);
    }
    return out;
  }
  nb::dlpack::dtype dt;
  switch (t.dtype()) {
    case DType::f32: dt = nb::dtype<float>(); break;
    case DType::i32: dt = nb::dtype<int32_t>(); break;
    default: dt = {uint8_t(nb::dlpack::dtype_code::Float), 16, 1}; break;
  }
  auto* keep = new std::shared_ptr<Storage>(t.storage());
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<Storage>*>(p); });
  std::vector<size_t> shape(t.shape().begin(), t.shape().end());
  std::vector<int64_t> strides(t.strides().begin(), t.strides().end());
  nb::ndarray<nb::numpy> arr(t.data(), shape.size(), shape.data(), owner, strides.data(), dt);
  return nb::cast(arr, nb::rv_policy::reference);
}

Tensor index(const Tensor& t, nb::handle key) {
  nb::tuple keys = nb::isinstance<nb::tuple>(key) ? nb::borrow<nb::tuple>(key) : nb::make_tuple(key);
  if (keys.size() > size_t(t.dim())) throw nb::index_error("[index] too many indices");
  Tensor r = t;
  int64_t dim = 0;  // dimension of r the next key applies to
  for (nb::handle k : keys) {
    if (nb::isinstance<nb::int_>(k)) {
      int64_t i = nb::cast<int64_t>(k), n = r.size(dim);
      if (i < -n || i >= n)
        throw nb::index_error(("[index] index " + std::to_string(i) + " out of range for size " + std::to_string(n)).c_str());
      r = r.select(dim, i);
    } else if (nb::isinstance<nb::slice>(k)) {
      auto [start, stop, step, len] = nb::borrow<nb::slice>(k).compute(size_t(r.size(dim)));
      if (step != 1) throw nb::index_error("[index] slices with a step are not supported");
      (void)len;
      r = r.slice(dim, int64_t(start), int64_t(stop));
      ++dim;
    } else {
      throw nb::type_error("[index] indices must be ints or slices");
    }
  }
  return r;
}

}  // namespace

void bind_tensors(nb::module_& m) {
  nb::class_<Tensor>(m, "Tensor", "A typed, shaped view of one device buffer (row-major).")
      .def_prop_ro("shape", [](const Tensor& t) {
        nb::list l;
        for (auto d : t.shape()) l.append(d);
        return nb::tuple(l);
      })
      .def_prop_ro("dtype", [](const Tensor& t) { return std::string(dtype_name(t.dtype())); })
      .def_prop_ro("device", &Tensor::device, nb::rv_policy::reference)
      .def_prop_ro("ndim", &Tensor::dim)
      .def_prop_ro("numel", &Tensor::numel)
      .def_prop_ro("nbytes", &Tensor::nbytes)
      .def_prop_ro("strides", [](const Tensor& t) { return t.strides(); }, "Strides in elements.")
      .def_prop_ro("offset", &Tensor::offset, "Byte offset of the view into its buffer.")
      .def_prop_ro("buffer_id", [](const Tensor& t) { return t.storage()->id(); },
                   "Identity of the pooled buffer (stable across reuse; 0 for wrapped memory).")
      .def("is_contiguous", &Tensor::is_contiguous)
      .def("__len__", [](const Tensor& t) { return t.dim() ? t.size(0) : 0; })
      .def("reshape", [](const Tensor& t, nb::args shape) {
             if (shape.size() == 1 && !nb::isinstance<nb::int_>(shape[0])) return t.reshape(to_shape(shape[0]));
             return t.reshape(to_shape(shape));
           }, "A view with another shape (contiguous tensors; -1 infers one dimension).")
      .def_prop_ro("T", &Tensor::transpose, "Strided view with the last two dimensions swapped.")
      .def("__getitem__", &index)
      .def("numpy", &to_numpy,
           "A numpy view of the memory (zero-copy; bf16 returns a float32 copy; on a device whose memory is "
           "not host-visible, such as cuda, always a copy). Waits for committed work.")
      .def("__array__", [](const Tensor& t, nb::handle dtype, nb::handle copy) {
             nb::object a = to_numpy(t);
             (void)copy;
             if (!dtype.is_none()) a = a.attr("astype")(dtype);
             return a;
           }, "dtype"_a = nb::none(), "copy"_a = nb::none())
      .def("__repr__", [](const Tensor& t) { return "krnl.Tensor(" + t.describe() + ")"; });
}

}  // namespace krnl::bindings
