// The op entry points (ops.h): this file holds their shared validation (Check, ops_common.h) and
// check_ids; the entry points themselves are in the file of their family beside it
// (ops_gemm.cpp, ops_norm.cpp, ops_attention.cpp, ops_elementwise.cpp, ops_loss.cpp,
// ops_quantized.cpp, ops_optim.cpp), the families of csrc/cpu and csrc/metal.
#include <stdexcept>
#include <string>

#include "ops_common.h"

namespace krnl::ops {

void Check::fail(const std::string& msg) const { throw std::invalid_argument(std::string("[") + op + "] " + msg); }

const Tensor& Check::tensor(const char* name, const Tensor& x) {
  tensor_any(name, x);
  if (!x.is_contiguous()) fail(std::string(name) + " must be contiguous, got " + x.describe());
  return x;
}

const Tensor& Check::tensor_any(const char* name, const Tensor& x) {
  if (!x.defined()) fail(std::string(name) + " is undefined");
  if (!dev)
    dev = x.device();
  else if (x.device() != dev)
    fail(std::string(name) + " is on " + x.device()->name() + " but the other operands are on " + dev->name());
  dev->keep_for_capture(x.storage());  // a captured graph bakes in this operand's address
  return x;
}

void Check::dtype(const char* name, const Tensor& x, std::initializer_list<DType> ok) {
  for (DType d : ok)
    if (x.dtype() == d) return;
  std::string allowed;
  for (DType d : ok) allowed += (allowed.empty() ? "" : "/") + std::string(dtype_name(d));
  fail(std::string(name) + " must be " + allowed + ", got " + x.describe());
}

void Check::same_dtype(const char* name, const Tensor& x, const char* ref_name, const Tensor& ref) {
  if (x.dtype() != ref.dtype())
    fail(std::string(name) + " must have the dtype of " + ref_name + " (" + dtype_name(ref.dtype()) + "), got " + x.describe());
}

void Check::shape(const char* name, const Tensor& x, const Shape& want) {
  if (x.shape() != want) fail(std::string(name) + " must have shape " + shape_str(want) + ", got " + x.describe());
}

void Check::numel(const char* name, const Tensor& x, int64_t want) {
  if (x.numel() != want) fail(std::string(name) + " must have " + std::to_string(want) + " elements, got " + x.describe());
}

const Tensor& Check::token_major(const char* name, const Tensor& x) {
  tensor_any(name, x);
  if (!dev->token_major_attention())
    throw NotImplementedError(std::string("[") + op + "] " + dev->name() +
                              " takes no token-major (B, T, H, D) operands (capabilities: fused_attention.token_major)");
  const Shape& s = x.strides();
  if (x.dim() != 4 || s[3] != 1 || s[2] < x.size(3) || s[1] < x.size(2) * s[2] || s[0] < x.size(1) * s[1])
    fail(std::string(name) + " must be a token-major (B, T, H, D) view with contiguous rows of D, got " + x.describe());
  return x;
}

const Tensor& Check::rows(const char* name, const Tensor& x) {
  if (x.defined() && x.dim() == 2 && !x.is_contiguous() && x.strides()[1] == 1 && x.strides()[0] >= x.size(1))
    return tensor_any(name, x);
  return tensor(name, x);
}

void Check::rank_at_least(const char* name, const Tensor& x, int64_t r) {
  if (x.dim() < r) fail(std::string(name) + " must have at least " + std::to_string(r) + " dimensions, got " + x.describe());
}

double nbytes(std::initializer_list<const Tensor*> ts) {
  double b = 0;
  for (auto* t : ts)
    if (t && t->defined()) b += double(t->nbytes());
  return b;
}

void check_ids(const char* op, const char* what, const char* where, const int32_t* ids, int64_t n, int64_t V,
               const int32_t* ignore) {
  for (int64_t i = 0; i < n; ++i) {
    if (ignore && ids[i] == *ignore) continue;
    if (ids[i] < 0 || ids[i] >= V)
      throw std::invalid_argument(std::string("[") + op + "] " + what + " " + std::to_string(ids[i]) + " at " + where +
                                  " " + std::to_string(i) + " is out of range [0, " + std::to_string(V) + ")");
  }
}

}  // namespace krnl::ops
