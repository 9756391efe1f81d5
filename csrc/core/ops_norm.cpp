// RMSNorm forward and backward's entry points (with the fused residual add).
#include <algorithm>
#include <string>

#include "ops_common.h"

namespace krnl::ops {

void rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, float eps,
                     const Tensor* residual) {
  Check c{"rmsnorm_forward"};
  // y may be a row-strided view: the first columns of a (rows, C + g) buffer (lora_fold.py)
  c.tensor("x", x), c.tensor("w", w), c.rows("y", y), c.tensor("rstd", rstd);
  c.rank_at_least("x", x, 1);
  c.floating("x", x);
  const int64_t C = x.size(-1), rows = x.numel() / std::max<int64_t>(C, 1);
  c.shape("w", w, {C});
  if (w.dtype() != x.dtype()) c.dtype("w", w, {DType::f32});
  c.shape("y", y, x.shape());
  c.floating("y", y);
  c.numel("rstd", rstd, rows);
  c.dtype("rstd", rstd, {DType::f32});
  if (!(eps >= 0)) c.fail("eps must be >= 0");
  if (residual) {  // x += residual first, in place (a residual stream's add, fused)
    c.tensor("residual", *residual);
    c.shape("residual", *residual, x.shape());
    c.same_dtype("residual", *residual, "x", x);
  }
  run(c, shape_str(x.shape()), 4.0 * double(x.numel()), nbytes({&x, &w, &y, &rstd, residual, residual ? &x : nullptr}),
      x.dtype(), [&] { c.dev->rmsnorm_forward(x, w, y, rstd, eps, residual); });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dx,
                      const Tensor* dw, const Tensor* residual) {
  Check c{"rmsnorm_backward"};
  // dx and residual may be row-strided views: the first columns of a (rows, C + g) buffer whose
  // last g columns a LoRA fold uses (lora_fold.py)
  c.tensor("dy", dy), c.tensor("x", x), c.tensor("w", w), c.tensor("rstd", rstd), c.rows("dx", dx);
  c.rank_at_least("x", x, 1);
  c.floating("x", x);
  const int64_t C = x.size(-1), rows = x.numel() / std::max<int64_t>(C, 1);
  c.shape("dy", dy, x.shape());
  c.floating("dy", dy);
  c.shape("dx", dx, x.shape());
  c.floating("dx", dx);
  c.shape("w", w, {C});
  if (w.dtype() != x.dtype()) c.dtype("w", w, {DType::f32});
  c.numel("rstd", rstd, rows);
  c.dtype("rstd", rstd, {DType::f32});
  if (dw) {
    c.tensor("dw", *dw);
    c.shape("dw", *dw, {C});
    c.dtype("dw", *dw, {DType::f32});
  }
  if (residual) {  // dx = the norm's gradient + residual (a residual stream's add, fused)
    c.rows("residual", *residual);
    c.shape("residual", *residual, x.shape());
    c.same_dtype("residual", *residual, "dx", dx);
  }
  run(c, shape_str(x.shape()), 8.0 * double(x.numel()), nbytes({&dy, &x, &w, &dx, dw, residual}), x.dtype(),
      [&] { c.dev->rmsnorm_backward(dy, x, w, rstd, dx, dw, residual); });
}

}  // namespace krnl::ops
