// NCCL: the loader's answers (every build) and, in CUDA builds, a communicator of a CUDA device
// (csrc/cuda/nccl_comm.h), which krnl.train.dist.nccl sums the flat LoRA gradient with.
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "bindings.h"
#include "cuda/nccl_api.h"
#ifdef KRNL_HAS_CUDA
#include "cuda/nccl_comm.h"
#endif

namespace krnl::bindings {
namespace {

nb::dict describe(const nccl::Api& a) {
  nb::dict d;
  d["version"] = nccl::version_string(a.version);
  d["code"] = a.version;
  d["path"] = a.path;
  return d;
}

}  // namespace

void bind_nccl(nb::module_& m, nb::module_& testing) {
  using namespace nb::literals;
  m.def("nccl_info", [] { return describe(nccl::api()); },
        "The NCCL this process opens (once): {version, code, path}. Raises RuntimeError('[nccl] ...') in one "
        "line when none loads: KRNL_NCCL names the library, else libnccl.so.2 on the loader's path (the "
        "package points KRNL_NCCL at an installed nvidia-nccl wheel's).");
  m.def("nccl_unique_id", [] {
          const nccl::Api& a = nccl::api();
          nccl::UniqueId id{};
          nccl::Result r;
          {
            nb::gil_scoped_release release;
            r = a.get_unique_id(&id);
          }
          if (r != nccl::kSuccess) nccl::fail(a, "ncclGetUniqueId", r);
          return nb::bytes(id.internal, sizeof id.internal);
        },
        "ncclGetUniqueId's 128 bytes: made by one rank, sent to the others (krnl.train.dist.world does it over MPI), "
        "then every rank joins with nccl_comm.");
  testing.def("nccl_load", [](const std::string& path) { return describe(nccl::load(path)); }, "path"_a,
              "nccl_info's loading of one library path, uncached (the loader's tests).");

#ifdef KRNL_HAS_CUDA
  nb::class_<cuda::NcclComm>(m, "NcclComm", "An NCCL communicator of one CUDA device (nccl_comm).")
      .def("allreduce", [](cuda::NcclComm& c, const std::vector<Tensor>& tensors) {
             nb::gil_scoped_release release;  // a first collective may wait for the peers to connect
             c.allreduce_sum(tensors);
           }, "tensors"_a,
           "In-place sums over the ranks of contiguous f32 tensors of the device, queued on its stream as one "
           "NCCL group (recorded when a graph capture is open); returns without waiting.")
      .def("check", &cuda::NcclComm::check,
           "Raises RuntimeError('[nccl] ...') if a collective failed asynchronously (call after waiting).")
      .def("abort", &cuda::NcclComm::abort, "Ends the communicator at once, abandoning work in flight.")
      .def_prop_ro("rank", &cuda::NcclComm::rank)
      .def_prop_ro("nranks", &cuda::NcclComm::nranks);
#endif
  m.def("nccl_comm", [](Backend& dev, nb::bytes unique_id, int rank, int nranks) -> nb::object {
#ifdef KRNL_HAS_CUDA
          if (auto* cuda = dynamic_cast<cuda::CudaBackend*>(&dev)) {
            std::string id(static_cast<const char*>(unique_id.c_str()), unique_id.size());
            std::unique_ptr<cuda::NcclComm> c;
            {
              nb::gil_scoped_release release;  // ncclCommInitRank waits for every rank to join
              c = std::make_unique<cuda::NcclComm>(cuda, id, rank, nranks);
            }
            return nb::cast(std::move(c));
          }
#endif
          (void)unique_id, (void)rank, (void)nranks;
          throw NotImplementedError("[nccl] " + dev.name() + " has no NCCL communicator (NCCL runs on CUDA "
                                    "devices: capabilities()['collectives'])");
        },
        "device"_a, "unique_id"_a, "rank"_a, "nranks"_a,
        "Joins the NCCL communicator named by unique_id (nccl_unique_id's bytes) as `rank` of `nranks` on a "
        "CUDA device; blocks until every rank has joined. NotImplementedError on other devices.");
}

}  // namespace krnl::bindings
