// CUDA graphs: one call of a step function recorded by stream capture and replayed with one
// cudaGraphLaunch per step, so the host-side cost of issuing its ops (Python, validation,
// launches) is paid once.
//
// Memory: a graph bakes in device addresses. While recording, every op operand made before it
// lands in the graph's keep set (Backend::keep_for_capture), so none of them is freed or handed
// to another tensor while the graph exists; every buffer made while recording comes from the
// graph arena (backend.h), which keeps it for graphs only, shared by every live graph and reused
// within a recording once released. The warm-up call before recording leaves its buffers in the
// pool, so recording usually allocates nothing new; uploads made while recording come from
// pinned staging the warm-up sized, and are repeated (with the same data) by every replay.
#include <cuda_runtime.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>

#include "cuda_backend.h"

namespace krnl::cuda {
namespace {

using Keep = std::unordered_set<std::shared_ptr<Storage>>;

class CudaGraph final : public Graph {
 public:
  CudaGraph(CudaBackend* dev, cudaGraph_t g, cudaGraphExec_t e, Keep keep, char* staging)
      : dev_(dev), graph_(g), exec_(e), keep_(std::move(keep)), staging_(staging) {
    dev_->graph_created();
  }
  ~CudaGraph() override { release(); }

  uint64_t replay() override {
    if (!exec_) throw std::runtime_error("[replay] the graph was released");
    if (dev_->capturing()) throw std::runtime_error("[replay] cannot replay a graph inside a graph capture");
    const bool own = !dev_->in_step();
    if (own) dev_->begin_step();
    const cudaError_t e = cudaGraphLaunch(exec_, dev_->stream());
    if (e != cudaSuccess) {
      if (own) dev_->commit();  // the (empty) step closes; the launch error is the one to report
      check(e, "replay");
    }
    return own ? dev_->commit() : 0;
  }

  void release() override {
    if (!exec_) return;
    // The newest step that may run it: the open one, else the last committed.
    const uint64_t seq = dev_->last_committed() + (dev_->in_step() ? 1 : 0);
    cudaGraphExec_t exec = exec_;
    cudaGraph_t graph = graph_;
    char* staging = staging_;
    exec_ = nullptr, graph_ = nullptr, staging_ = nullptr;
    dev_->defer(seq, [exec, graph, staging] {
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      if (staging) cudaFreeHost(staging);
    });
    keep_.clear();  // storages retire on the current step, so the pool waits for the replays
    dev_->graph_released();
  }

  bool released() const override { return exec_ == nullptr; }

 private:
  CudaBackend* dev_;
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  Keep keep_;
  char* staging_;
};

}  // namespace

std::unique_ptr<Graph> CudaBackend::capture(const std::function<void(bool)>& fn) {
  if (capture_busy_ || capturing())
    throw std::runtime_error("[capture] nested capture: a graph is already being captured on cuda");
  if (in_step())
    throw std::runtime_error("[capture] cannot capture inside an open step (call it outside `with dev.step()`)");

  // 1. Warm-up: one ordinary step. It loads kernels and cuBLAS's workspace, leaves its buffers in
  // the pool for the recorded call, and measures the staging its uploads need.
  struct Busy {  // cleared on every way out
    bool& b;
    explicit Busy(bool& f) : b(f) { b = true; }
    ~Busy() { b = false; }
  } busy(capture_busy_);
  probing_ = true;
  probe_bytes_ = 0;
  begin_step();
  try {
    fn(false);
  } catch (...) {
    probing_ = false;
    commit();
    throw;
  }
  probing_ = false;
  wait(commit());  // completed: the pool may hand the warm-up's buffers out again

  // 2. Recording, as one step whose commit runs nothing.
  char* staging = nullptr;
  if (probe_bytes_) check(cudaMallocHost(reinterpret_cast<void**>(&staging), probe_bytes_), "capture");
  staging_ = staging, staging_size_ = probe_bytes_, staging_used_ = 0;
  Keep keep;
  begin_step();
  // Thread-local: a forbidden call from this thread fails loudly; other threads are not ours.
  cudaError_t e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
  auto finish = [&] {  // leaves recording state; the step closes
    end_recording();
    staging_ = nullptr, staging_size_ = 0;
    commit();
  };
  auto fail = [&] {  // no graph: what the recording took from the arena goes back to the pool
    finish();
    settle_arena();
    if (staging) cudaFreeHost(staging);
  };
  if (e != cudaSuccess) {
    fail();
    check(e, "capture");
  }
  begin_recording(&keep);
  cudaGraph_t graph = nullptr;
  try {
    fn(true);
  } catch (...) {
    cudaStreamEndCapture(stream_, &graph);  // ends a capture that an error may have invalidated
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    fail();
    throw;
  }
  e = cudaStreamEndCapture(stream_, &graph);
  finish();
  cudaGraphExec_t exec = nullptr;
  if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
  if (e != cudaSuccess) {
    if (graph) cudaGraphDestroy(graph);
    settle_arena();
    if (staging) cudaFreeHost(staging);
    cudaGetLastError();
    check(e, "capture");
  }
  return std::make_unique<CudaGraph>(this, graph, exec, std::move(keep), staging);
}

}  // namespace krnl::cuda
