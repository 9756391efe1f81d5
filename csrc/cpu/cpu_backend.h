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

// out (n, C) = rows ids (n,) i32 of table (V, C), the ids checked with op's name (loss.cpp):
// embedding_forward's work, and moe_gather's.
void gather_rows(const char* op, const char* what, const Tensor& ids, const Tensor& table, const Tensor& out);

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

  // Every op of op_list.h, one file per family. attention_forward/backward are the reference of the
  // fused attention contract (plain f32 loops, O(Hq T^2 D)); the model keeps the materialised path
  // here (capabilities() lists no fused attention dtypes).
  KRNL_OPS(KRNL_OVERRIDE_OP)

 protected:
  void* raw_alloc(size_t bytes) override;
  void raw_free(void* p, size_t bytes) override;
};

}  // namespace krnl::cpu
