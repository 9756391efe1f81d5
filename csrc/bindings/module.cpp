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
#ifdef __APPLE__
#include <Availability.h>  // __MAC_OS_X_VERSION_MAX_ALLOWED: the SDK this binary was built against
#endif

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

namespace {

// How this binary was built, for `krnl doctor`'s report: what a user's Mac ran is otherwise unknown
// to us (which SDK, which deployment target, which compiler).
nb::dict build_info() {
  nb::dict d;
#if defined(__clang__)
  d["compiler"] = "clang " __clang_version__;
#elif defined(__GNUC__)
  d["compiler"] = "gcc " __VERSION__;
#elif defined(_MSC_VER)
  d["compiler"] = "msvc " + std::to_string(_MSC_VER);
#else
  d["compiler"] = "unknown";
#endif
  d["cplusplus"] = long(__cplusplus);
#ifdef NDEBUG
  d["assertions"] = false;
#else
  d["assertions"] = true;
#endif
#ifdef __APPLE__
  // Both are MMmmpp numbers (140000 = 14.0.0) from macOS 10.10 on.
  d["macos_sdk"] = long(__MAC_OS_X_VERSION_MAX_ALLOWED);
  d["macos_deployment_target"] = long(__MAC_OS_X_VERSION_MIN_REQUIRED);
  d["blas"] = "Accelerate";
#else
  d["macos_sdk"] = nb::none();
  d["macos_deployment_target"] = nb::none();
  d["blas"] = "scipy-openblas32";
#endif
#ifdef KRNL_HAS_METAL
  d["metal"] = true;
#else
  d["metal"] = false;
#endif
#ifdef KRNL_HAS_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
  return d;
}

}  // namespace

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
  m.def("build_info", &build_info,
        "How this extension was built: compiler, C++ standard, assertions, macOS SDK and deployment target "
        "(MMmmpp numbers on Apple, else None), the BLAS it links, and whether it has the Metal and CUDA backends.");

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
