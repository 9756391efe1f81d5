// The CUDA backend: device memory from cudaMalloc through the BufferPool, every op enqueued on one
// stream as it is called, one event per committed step (completed_seq polls them in order),
// GEMMs through cuBLAS opened at run time (cublas_api.h, cuda_backend.cpp), the rest as kernels (*.cu, one
// file per op family). Memory is not host-visible: upload/download copy.
#pragma once
#include <cuda_runtime.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/backend.h"

namespace krnl::cuda {

// Registers "cuda" (priority above "cpu") when a CUDA device and cuBLAS are usable; a machine
// without a GPU, driver or cuBLAS has no "cuda" device, and register_unavailable says why.
void register_backend();

// Throws std::runtime_error("[op] CUDA error <name>: <text>") unless e is cudaSuccess.
void check(cudaError_t e, const char* op);

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  bool host_visible() const override { return false; }
  bool synchronous() const override { return false; }
  bool queue_ordered() const override { return true; }  // kernels, cuBLAS and copies all on stream_
  // Every float dtype, training in bf16, graphs, attention in blocks of 1024 query rows or fused
  // (cuDNN, 16-bit); details: the GPU's name, compute capability and SM count.
  Capabilities capabilities() const override;
  SplitKConfig split_k_config() const override;
  // While profiling, each op's work is bracketed by two events and waited for (OpTimer), so the
  // records hold GPU time, not the microseconds the host spends queueing.
  bool profiles_device_time() const override { return true; }

  void upload(const Tensor& dst, const void* src) override;
  void download(const Tensor& src, void* dst) override;

  // Records fn(true) as a CUDA graph after one warm-up call fn(false) (cuda_graph.cpp).
  std::unique_ptr<Graph> capture(const std::function<void(bool)>& fn) override;
  // Runs f once the step seq has completed and no capture is open (graph teardown, whose
  // cudaFree-like calls would break a capture and whose memory a running replay may still use).
  void defer(uint64_t seq, std::function<void()> f);

  cudaStream_t stream() const { return stream_; }
  int device_ordinal() const { return device_; }  // the CUDA device (as this process numbers them)
  int sm_count() const { return sm_count_; }
  // Copies n i32 entries at device address p to the host (waits for the stream: the ids may be
  // written by work already queued).
  std::vector<int32_t> read_i32(const void* p, int64_t n, const char* op);
  // A scratch f32/f64 buffer from the pool, released (retired on the open step) by the caller
  // dropping the tensor: kernels queued before the release still own it until the step completes.
  Tensor scratch(int64_t n, DType dt = DType::f32) { return empty({n}, dt); }
  // Throws naming op where 16-bit tensor-core kernels (the grouped GEMMs' bf16/f16 tiles) cannot
  // run: compute capability below 8.0 (moe.cu).
  void require_tensor_cores(const char* op) const;

  // Scope of one op's launches: when profiling, events around them and their elapsed time
  // reported through add_device_ms; otherwise nothing.
  class OpTimer {
   public:
    explicit OpTimer(CudaBackend* d);
    ~OpTimer();
    OpTimer(const OpTimer&) = delete;
    OpTimer& operator=(const OpTimer&) = delete;

   private:
    CudaBackend* dev_;
    bool on_;
  };

  // Every op of op_list.h (one .cu file per family) but fused attention, which is cuDNN's SDPA
  // graphs, bf16/f16 (attention_cudnn.cpp): left out without cuDNN at build time, so that the
  // Backend defaults throw.
  KRNL_OPS_BUT_FUSED_ATTENTION(KRNL_OVERRIDE_OP)
#ifdef KRNL_HAS_CUDNN
  KRNL_FUSED_ATTENTION_OPS(KRNL_OVERRIDE_OP)
  // The dtypes in which the ops above run here, so that the model takes them: cuDNN's (bf16, f16)
  // where libcudnn loaded, else none.
  std::vector<DType> fused_attention_dtypes() const;
  bool token_major_attention() const override;  // cuDNN's graphs take the views' strides
#endif

 protected:
  void* raw_alloc(size_t bytes) override;
  void raw_free(void* p, size_t bytes) override;
  void on_commit(uint64_t seq) override;
  void on_wait(uint64_t seq) override;
  uint64_t query_completed() override;

 private:
  // SwiGLU's and GeGLU's launchers, one for each direction over the activation (elementwise.cu).
  template <class Act>
  void gated_forward(const Act& act, const Tensor& g, const Tensor& u, const Tensor& s);
  template <class Act>
  void gated_backward(const Act& act, const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg,
                      const Tensor& du);
  // beta * C over a (possibly row-strided, batched) output: the K = 0 GEMM.
  void gemm_untimed(const GemmArgs& g);  // gemm's body, for ops that end in a GEMM (quantized_matmul)
  void gemm_scale_output(const GemmArgs& g);
  void gemm_split(const GemmArgs& g);
  // RoPE's cos/sin table (rows, R) each of sign * positions[r] * inv_freq[i] for the first `rows`
  // positions, launched on the stream into a scratch tensor: cos then sin (attention.cu).
  Tensor rope_table(const Tensor& positions, const Tensor& inv_freq, float sign, int64_t rows);
  // rope over a token-major (B, T, H, D) view, and attention_backward's T = 1 case (attention.cu).
  void rope_token_major(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float sign);
  void attention_backward_one_token(const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv);
  // transpose_heads with RoPE on the way (attention.cu, next to rope's table).
  void transpose_heads_rope(const Tensor& x, const Tensor& out, const Tensor& positions, const Tensor& inv_freq,
                            int64_t rotate, float sign, int64_t heads_axis);
  void run_deferred();

  int device_ = 0;
  int sm_count_ = 132;
  std::string gpu_name_, compute_capability_, pci_bus_id_;  // for capabilities(): read once, outside any capture
  cudaStream_t stream_ = nullptr;
  void* cublas_ = nullptr;  // cublasHandle_t, opaque here (cuBLAS is loaded at run time)
  std::deque<std::pair<uint64_t, cudaEvent_t>> inflight_;  // committed steps not yet seen complete
  std::vector<cudaEvent_t> spare_events_;
  uint64_t completed_ = 0;
  cudaEvent_t prof_start_ = nullptr, prof_end_ = nullptr;  // timing events, made on first use
  int timer_depth_ = 0;  // an op calling another (dropout p=0 -> cast) is timed once, outermost
  // Uploads while recording copy from pinned staging (a graph node replays the copy): the warm-up
  // call sizes it (probe), the graph owns it.
  bool capture_busy_ = false;  // inside capture(): warm-up or recording (nesting is refused in both)
  bool probing_ = false;
  size_t probe_bytes_ = 0;
  char* staging_ = nullptr;
  size_t staging_size_ = 0, staging_used_ = 0;
  std::vector<std::pair<uint64_t, std::function<void()>>> deferred_;
#ifdef KRNL_HAS_CUDNN
  struct CudnnState;  // the cuDNN handle and built attention graphs, made on first use
  CudnnState& cudnn(const char* op);
  std::shared_ptr<CudnnState> cudnn_;
#endif
};

}  // namespace krnl::cuda
