// The op entry points: validate once (shapes, dtypes, device, contiguity), route, then hand the
// call to the tensors' backend. Errors are std::invalid_argument naming the op and argument.
// Outside an open step an op runs as its own one-op step.
#pragma once
#include <cstdint>
#include <optional>

#include "backend.h"

namespace krnl::ops {

// split_k: -1 lets the router decide, 1 forces the plain path, s > 1 forces s K-slices.
// stride_*: -1 for the default (matrix size for a 3-D operand, 0 = broadcast for a 2-D one).
void gemm(const Tensor& A, const Tensor& B, const Tensor& C, bool trans_a, bool trans_b, float alpha,
          float beta, int64_t batch = 1, int64_t stride_a = -1, int64_t stride_b = -1, int64_t stride_c = -1,
          int64_t split_k = -1);
// The routing decision gemm would take for these operands (without running it).
SplitKPlan gemm_plan(const Tensor& A, const Tensor& B, const Tensor& C, bool trans_a, bool trans_b,
                     int64_t batch = 1, int64_t stride_a = -1, int64_t stride_b = -1, int64_t stride_c = -1,
                     int64_t split_k = -1);

void rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, float eps);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dx,
                      const Tensor* dw);
void swiglu_forward(const Tensor& g, const Tensor& u, const Tensor& s);
void swiglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du);
void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float sign);
void softmax_causal_forward(const Tensor& S, const Tensor& P, float scale, const Tensor* segments);
void softmax_backward(const Tensor& P, const Tensor& dP, const Tensor& dS, float scale);
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                       float scale);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& dout,
                        const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, float scale);
void embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable);
void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& loss, const Tensor* dlogits,
                   int32_t ignore_index, float scale);
void add(const Tensor& a, const Tensor& b, const Tensor& out);
void axpy(float alpha, const Tensor& x, const Tensor& y);
void scale(const Tensor& x, float alpha, const Tensor& out);
void cast(const Tensor& x, const Tensor& out);
void transpose_heads(const Tensor& x, const Tensor& out);
void fill(const Tensor& x, double value);
void dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed);
void adamw_update(const AdamWArgs& a);
void sumsq(const Tensor& x, const Tensor& out);
void nonfinite(const Tensor& x, const Tensor& flag);

// Range check of n token ids held in host memory, for the backends (before a gather or scatter
// reads out of bounds), serial so that the error names the first bad entry: throws std::invalid_argument "[op] <what> <id> at <where> <i> is out of
// range [0, V)"; ids equal to *ignore pass.
void check_ids(const char* op, const char* what, const char* where, const int32_t* ids, int64_t n, int64_t V,
               const int32_t* ignore = nullptr);

}  // namespace krnl::ops
