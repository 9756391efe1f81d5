// gemm's entry point: its operands (contiguous, row-strided 2-D or row-block 3-D views, batch
// strides) checked into the backend's GemmArgs, and the split-K router's choice (gemm_plan).
#include <string>

#include "ops_common.h"

namespace krnl::ops {

namespace {

struct GemmOperand {
  int64_t rows, cols, stride, ld;
};

GemmOperand gemm_operand(Check& c, const char* name, const Tensor& X, int64_t batch, int64_t stride, bool is_output) {
  if (X.defined() && X.dim() == 2 && !X.is_contiguous() && X.strides()[1] == 1 && X.strides()[0] >= X.size(1)) {
    // A row-strided 2-D view (a column block): one matrix, never batched over.
    c.tensor_any(name, X);
    if (batch > 1 && stride != 0 && !(stride < 0 && !is_output))
      c.fail(std::string(name) + " is a row-strided view; it can only be broadcast (stride 0) across a batch");
    if (batch > 1 && is_output) c.fail(std::string(name) + " is a row-strided view and cannot be a batched output");
    return {X.size(0), X.size(1), 0, X.strides()[0]};
  }
  if (X.defined() && X.dim() == 3 && !X.is_contiguous() && X.strides()[2] == 1 && X.strides()[1] >= X.size(2) &&
      X.strides()[0] >= X.size(1) * X.strides()[1]) {
    // A 3-D view of row blocks (e.g. rows r0:r1 of every head of a (H, T, D) tensor): batch
    // entries at its leading stride, rows at its row stride; entries never overlap.
    c.tensor_any(name, X);
    if (X.size(0) != batch || stride >= 0)
      c.fail(std::string(name) + " is a strided 3-D view: its leading dimension must equal batch (" +
             std::to_string(batch) + ") and no explicit stride may be given, got " + X.describe());
    return {X.size(1), X.size(2), X.strides()[0], X.strides()[1]};
  }
  c.tensor(name, X);
  if (X.dim() != 2 && X.dim() != 3) c.fail(std::string(name) + " must be 2-D or 3-D (batch, rows, cols), got " + X.describe());
  GemmOperand o{X.size(-2), X.size(-1), 0, X.size(-1)};
  const int64_t mat = o.rows * o.cols;
  if (X.dim() == 3 && X.size(0) != batch && stride < 0)
    c.fail(std::string(name) + " has leading dimension " + std::to_string(X.size(0)) + " but batch is " + std::to_string(batch));
  o.stride = stride >= 0 ? stride : (X.dim() == 3 ? mat : 0);
  if (batch > 1 && is_output && o.stride < mat)
    c.fail(std::string(name) + " stride " + std::to_string(o.stride) + " would make batch entries overlap (matrix has " +
           std::to_string(mat) + " elements)");
  if ((batch - 1) * o.stride + mat > X.numel())
    c.fail(std::string(name) + " with stride " + std::to_string(o.stride) + " and batch " + std::to_string(batch) +
           " reaches past its " + std::to_string(X.numel()) + " elements");
  return o;
}

GemmArgs gemm_args(Check& c, const Tensor& A, const Tensor& B, const Tensor& C, bool ta, bool tb, int64_t batch,
                   int64_t sa, int64_t sb, int64_t sc, int64_t split_k) {
  if (batch < 1) c.fail("batch must be >= 1, got " + std::to_string(batch));
  auto a = gemm_operand(c, "A", A, batch, sa, false);
  auto b = gemm_operand(c, "B", B, batch, sb, false);
  auto o = gemm_operand(c, "C", C, batch, sc, true);
  c.floating("A", A);
  c.same_dtype("B", B, "A", A);
  if (C.dtype() != A.dtype() && C.dtype() != DType::f32)
    c.fail("C must be " + std::string(dtype_name(A.dtype())) + " or f32, got " + C.describe());
  GemmArgs g;
  g.A = A, g.B = B, g.C = C, g.trans_a = ta, g.trans_b = tb, g.batch = batch;
  g.M = ta ? a.cols : a.rows;
  g.K = ta ? a.rows : a.cols;
  const int64_t kb = tb ? b.cols : b.rows;
  g.N = tb ? b.rows : b.cols;
  if (kb != g.K)
    c.fail("inner dimensions differ: op(A) is (" + std::to_string(g.M) + ", " + std::to_string(g.K) + ") and op(B) is (" +
           std::to_string(kb) + ", " + std::to_string(g.N) + ")");
  if (o.rows != g.M || o.cols != g.N)
    c.fail("C must be (" + std::to_string(g.M) + ", " + std::to_string(g.N) + ") per batch entry, got " + C.describe());
  g.stride_a = a.stride, g.stride_b = b.stride, g.stride_c = o.stride;
  g.lda = a.ld, g.ldb = b.ld, g.ldc = o.ld;
  if (split_k < 0) {
    g.split_k = plan_split_k(g.M, g.N, g.K, batch, c.dev->split_k_config()).splits;
  } else if (split_k <= 1) {
    g.split_k = 1;
  } else {
    if (g.K % split_k) c.fail("split_k=" + std::to_string(split_k) + " does not divide K=" + std::to_string(g.K));
    g.split_k = split_k;
  }
  return g;
}

}  // namespace

SplitKPlan gemm_plan(const Tensor& A, const Tensor& B, const Tensor& C, bool ta, bool tb, int64_t batch, int64_t sa,
                     int64_t sb, int64_t sc, int64_t split_k) {
  Check c{"gemm"};
  GemmArgs g = gemm_args(c, A, B, C, ta, tb, batch, sa, sb, sc, split_k);
  return {g.split_k, g.K / g.split_k};
}

void gemm(const Tensor& A, const Tensor& B, const Tensor& C, bool ta, bool tb, float alpha, float beta, int64_t batch,
          int64_t sa, int64_t sb, int64_t sc, int64_t split_k) {
  Check c{"gemm"};
  GemmArgs g = gemm_args(c, A, B, C, ta, tb, batch, sa, sb, sc, split_k);
  g.alpha = alpha, g.beta = beta;
  std::string shape = std::string(ta ? "t" : "n") + (tb ? "t" : "n") + " M=" + std::to_string(g.M) + " N=" + std::to_string(g.N) +
                      " K=" + std::to_string(g.K) + (batch > 1 ? " batch=" + std::to_string(batch) : "") +
                      (g.split_k > 1 ? " split_k=" + std::to_string(g.split_k) : "");
  double flops = 2.0 * double(g.M) * double(g.N) * double(g.K) * double(batch);
  run(c, shape, flops, nbytes({&A, &B, &C}), A.dtype(), [&] { c.dev->gemm(g); });
}

}  // namespace krnl::ops
