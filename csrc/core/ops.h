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

// quantized_matmul's and moe_quantized_matmul's mode (op_list.h's notes): how a code becomes a weight.
enum QuantMode : int64_t { kQuantAffine = 0, kQuantMxfp4 = 1 };

// Every other op of op_list.h, with the backend's parameters.
#define KRNL_CORE_OP(name, params) void name params;
KRNL_DIRECT_OPS(KRNL_CORE_OP)
#undef KRNL_CORE_OP

// Range check of n token ids held in host memory, for the backends (before a gather or scatter
// reads out of bounds), serial so that the error names the first bad entry: throws std::invalid_argument "[op] <what> <id> at <where> <i> is out of
// range [0, V)"; ids equal to *ignore pass.
void check_ids(const char* op, const char* what, const char* where, const int32_t* ids, int64_t n, int64_t V,
               const int32_t* ignore = nullptr);

}  // namespace krnl::ops
