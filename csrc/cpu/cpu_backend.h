// The CPU backend: host memory, ops run synchronously as they are called, GEMMs through the
// platform BLAS (blas.h; gemm.cpp), everything else as loops over the core's thread pool, one file
// per op family as in csrc/cuda (norm.cpp, attention.cpp, elementwise.cpp, loss.cpp, quantized.cpp,
// optim.cpp): computing in float on rows or blocks loaded and stored through convert.h, so each op
// is written once for every float dtype. Calls arrive validated (core/ops.cpp); only data-dependent
// errors (ids, targets) are raised in the backend.
#pragma once
#include <vector>

#include "core/backend.h"

namespace krnl::cpu {

// Registers the "cpu" device (lowest priority: any accelerator is preferred).
void register_backend();
// A second, independent CPU device "cpu:1", for tests of cross-device errors.
void register_second_backend();

// Tests of blas.h's thread scopes: the BLAS's thread count (OpenBLAS's count; Accelerate's
// per-thread setting, 1 single, 0 its own choice) before, inside each chunk of a parallel region
// holding the scopes gemm_split_k holds, and after.
std::vector<int> probe_blas_threads();
// Whether BLAS calls run side by side on the pool (blas.h's blas_fan_out).
bool blas_fans_out();
// Row-major f32 C (M, N) = alpha op(A) op(B) + beta C (blas.h's sgemm); with rows > 0 (the device's
// gemm_row_block) in the sample order's blocks of that many rows (gemm.cpp).
void sgemm_rows(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                const float* B, int64_t ldb, float beta, float* C, int64_t ldc, int64_t rows);

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(const char* name = "cpu");
  bool host_visible() const override { return true; }
  bool synchronous() const override { return true; }
  bool token_major_attention() const override { return true; }  // the reference loops take any strides
  // Every float dtype (16-bit operands widen to f32 in the kernels), training in f32, attention in
  // blocks of 128 query rows, never fused (the reference attention ops lose to BLAS).
  Capabilities capabilities() const override;
  SplitKConfig split_k_config() const override;

  void gemm(const GemmArgs& a) override;
  void rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, float eps,
                       const Tensor* residual) override;
  void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dx,
                        const Tensor* dw, const Tensor* residual) override;
  void swiglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) override;
  void swiglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) override;
  void geglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) override;
  void geglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) override;
  void softcap(const Tensor& x, float cap, const Tensor& out) override;
  void softcap_backward(const Tensor& dy, const Tensor& y, float cap, const Tensor& dx) override;
  void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float sign, bool token_major) override;
  void softmax_causal_forward(const Tensor& S, const Tensor& P, float scale, const Tensor* segments,
                              int64_t window) override;
  void softmax_backward(const Tensor& P, const Tensor& dP, const Tensor& dS, float scale) override;
  // The reference of the fused attention contract: plain loops in f32, O(Hq T^2 D). The model
  // keeps the materialised row-block path on the CPU (BLAS runs it faster): capabilities() lists no
  // fused_attention dtypes.
  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                         float scale, const Tensor* segments, int64_t window) override;
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& dout,
                          const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, float scale,
                          const Tensor* segments, int64_t window) override;
  void embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out) override;
  void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) override;
  void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& loss, const Tensor* dlogits,
                     int32_t ignore_index, float scale, const Tensor* scale_by) override;
  void add(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void axpy(float alpha, const Tensor& x, const Tensor& y) override;
  void scale(const Tensor& x, float alpha, const Tensor& out) override;
  void cast(const Tensor& x, const Tensor& out) override;
  // Tiles of 256 rows of W dequantized to f32, one sgemm each (never all of W at once).
  void quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor& biases,
                        const Tensor& out, bool transpose, int64_t group_size, int64_t bits, float beta) override;
  void quantized_embedding(const Tensor& ids, const Tensor& w, const Tensor& scales, const Tensor& biases,
                           const Tensor& out, int64_t group_size, int64_t bits) override;
  void transpose_heads(const Tensor& x, const Tensor& out, const Tensor* positions, const Tensor* inv_freq,
                       int64_t rotate, float sign, int64_t heads_axis) override;
  void fill(const Tensor& x, double value) override;
  void dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, const Tensor* seed_offset) override;
  void adamw_update(const AdamWArgs& a) override;
  void sumsq(const Tensor& x, const Tensor& out) override;
  void nonfinite(const Tensor& x, const Tensor& flag) override;

 protected:
  void* raw_alloc(size_t bytes) override;
  void raw_free(void* p, size_t bytes) override;
};

}  // namespace krnl::cpu
