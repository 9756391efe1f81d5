// krnl._core: the native core. Python holds handles (Device, Tensor) and calls ops; all math
// runs here.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "core/thread_pool.h"
#include "cpu/cpu_backend.h"
#ifdef KRNL_HAS_CUDA
#include "cuda/cuda_backend.h"
#endif
#include "metal/metal_device.h"

namespace krnl::bindings {

Shape to_shape(nb::handle obj) {
  if (nb::isinstance<nb::int_>(obj)) return {nb::cast<int64_t>(obj)};
  Shape s;
  try {
    for (nb::handle h : obj) s.push_back(nb::cast<int64_t>(h));
  } catch (const std::exception&) {
    throw std::invalid_argument("[shape] expected an int or a sequence of ints, got " +
                                std::string(nb::str(obj).c_str()));
  }
  return s;
}

DType to_dtype(nb::handle obj) {
  if (nb::isinstance<nb::str>(obj)) return dtype_from_name(nb::cast<std::string>(obj));
  // numpy dtypes and scalar types: np.float16, np.dtype("int32"), ...
  nb::object np = nb::module_::import_("numpy");
  return dtype_from_name(nb::cast<std::string>(np.attr("dtype")(obj).attr("name")));
}

}  // namespace krnl::bindings

NB_MODULE(_core, m) {
  using namespace krnl::bindings;
  m.doc() = "krnl native core: devices, tensors, ops, profiler";
  krnl::cpu::register_backend();
#ifdef KRNL_HAS_CUDA
  krnl::cuda::register_backend();  // only where a CUDA device and cuBLAS are usable
#endif
#ifdef KRNL_HAS_METAL
  krnl::metal::register_metal_backend();  // only where a Metal GPU exists
#endif

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const krnl::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    }
  });

  m.def("num_threads", [] { return krnl::ThreadPool::global().size(); },
        "Threads of the core's pool (KRNL_NUM_THREADS, else the hardware's count).");

  bind_devices(m);
  bind_tensors(m);
  bind_ops(m);
  bind_profiler(m);
  nb::module_ testing = m.def_submodule(
      "testing", "Test devices and hooks for krnl's own tests (tests/conftest.py, tools/mslsim): not the user API.");
  bind_testing(testing);
  bind_metal(m, testing);
  bind_nccl(m, testing);
}
