// An NCCL communicator of one CUDA device: the ranks of a data-parallel run sum their flat LoRA
// gradient with it on the device, on the backend's stream, so the sum is ordered after the
// backward that produced the gradient and before the optimizer's update that reads it, with no
// host copy; inside a graph capture the collective is recorded with the rest (NCCL >= 2.9).
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"
#include "cuda_backend.h"
#include "nccl_api.h"

namespace krnl::cuda {

class NcclComm {
 public:
  // Joins the communicator named by `unique_id` (ncclGetUniqueId's 128 bytes, made by one rank and
  // sent to the others) as `rank` of `nranks`. Blocks until every rank has joined.
  NcclComm(CudaBackend* dev, const std::string& unique_id, int rank, int nranks);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // In-place sums over the ranks of contiguous f32 tensors of this device, queued on its stream
  // (one NCCL group: one launch), inside the open step or as a step of their own; recorded when a
  // capture is open. Returns without waiting.
  void allreduce_sum(const std::vector<Tensor>& tensors);
  // Throws "[nccl] ..." if the communicator met an asynchronous error (a peer's failure, a
  // network error); to be called after waiting for the work that used it.
  void check() const;
  // Ends the communicator at once (work in flight is abandoned): after an error, so that no rank
  // waits forever in a collective.
  void abort();
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  CudaBackend* device() const { return dev_; }

 private:
  const nccl::Api& api_;
  CudaBackend* dev_;
  nccl::Comm comm_ = nullptr;
  int rank_, nranks_;
};

}  // namespace krnl::cuda
