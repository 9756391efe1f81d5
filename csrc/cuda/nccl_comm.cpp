#include "nccl_comm.h"

#include <cstring>
#include <stdexcept>

namespace krnl::cuda {

NcclComm::NcclComm(CudaBackend* dev, const std::string& unique_id, int rank, int nranks)
    : api_(nccl::api()), dev_(dev), rank_(rank), nranks_(nranks) {
  if (unique_id.size() != size_t(nccl::kUniqueIdBytes))
    throw std::invalid_argument("[nccl] the unique id must be " + std::to_string(nccl::kUniqueIdBytes) +
                                " bytes (ncclGetUniqueId's), got " + std::to_string(unique_id.size()));
  if (nranks < 1 || rank < 0 || rank >= nranks)
    throw std::invalid_argument("[nccl] rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                                " ranks: need 0 <= rank < nranks");
  if (dev->capturing()) throw std::runtime_error("[nccl] cannot join a communicator inside a graph capture");
  nccl::UniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof id.internal);
  // NCCL binds the communicator to the current device of the calling thread.
  cuda::check(cudaSetDevice(dev->device_ordinal()), "nccl");
  const nccl::Result r = api_.comm_init_rank(&comm_, nranks, id, rank);
  if (r != nccl::kSuccess) nccl::fail(api_, "ncclCommInitRank", r);
}

NcclComm::~NcclComm() {
  if (comm_) api_.comm_destroy(comm_);
}

void NcclComm::allreduce_sum(const std::vector<Tensor>& tensors) {
  if (!comm_) throw std::runtime_error("[nccl] allreduce on a communicator that was aborted");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    const std::string name = "[nccl] allreduce: tensor " + std::to_string(i);
    if (!t.defined()) throw std::invalid_argument(name + " is undefined");
    if (t.device() != dev_)
      throw std::invalid_argument(name + " is on " + t.device()->name() + ", the communicator's device is " +
                                  dev_->name());
    if (t.dtype() != DType::f32) throw std::invalid_argument(name + " must be f32, got " + t.describe());
    if (!t.is_contiguous()) throw std::invalid_argument(name + " must be contiguous, got " + t.describe());
  }
  const bool implicit = !dev_->in_step();
  if (implicit) dev_->begin_step();
  nccl::Result r = api_.group_start();
  for (const Tensor& t : tensors) {
    if (r != nccl::kSuccess) break;
    dev_->keep_for_capture(t.storage());  // a recorded collective bakes in this address
    r = api_.all_reduce(t.data(), t.data(), size_t(t.numel()), nccl::kFloat32, nccl::kSum, comm_, dev_->stream());
  }
  const nccl::Result end = api_.group_end();  // closes the group even after a failed call
  if (implicit) dev_->commit();
  if (r != nccl::kSuccess) nccl::fail(api_, "ncclAllReduce", r, comm_);
  if (end != nccl::kSuccess) nccl::fail(api_, "ncclGroupEnd", end, comm_);
}

void NcclComm::check() const {
  if (!comm_) return;
  nccl::Result async = nccl::kSuccess;
  const nccl::Result r = api_.comm_get_async_error(comm_, &async);
  if (r != nccl::kSuccess) nccl::fail(api_, "ncclCommGetAsyncError", r, comm_);
  if (async != nccl::kSuccess && async != nccl::kInProgress) nccl::fail(api_, "a collective", async, comm_);
}

void NcclComm::abort() {
  if (!comm_) return;
  api_.comm_abort(comm_);
  comm_ = nullptr;
}

}  // namespace krnl::cuda
