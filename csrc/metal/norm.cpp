// RMSNorm forward and backward on the Metal kernels (metal/rmsnorm.metal): one threadgroup per row;
// the weight gradient in its own dispatch of column strips.
#include <string>

#include "core/dtype.h"
#include "metal/metal_ops.h"
#include "metal/ops_common.h"

namespace krnl::metal {

void MetalOps::rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, float eps,
                               const Tensor* residual) {
  // A residual add is its own dispatch here (rmsnorm.metal has no fused kernel): the same values.
  if (residual) add(x, *residual, x);
  Emit e{this, "rmsnorm_forward"};
  const std::string s = e.sfx(x.dtype());
  // y in x's dtype, or f32 from bf16 x scaled by f32 w (the kernels rmsnorm.metal has)
  const bool wide = y.dtype() != x.dtype();
  if (wide && !(x.dtype() == DType::bf16 && w.dtype() == DType::f32 && y.dtype() == DType::f32))
    throw NotImplementedError("[rmsnorm_forward] y must have x's dtype (or be f32, from bf16 x and f32 w) on " + name());
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  if (rows == 0) return;
  const int64_t ldy = y.row_stride();  // C, or a LoRA fold's wider buffer (core ops.cpp checked the view)
  const std::string wsfx = w.dtype() != x.dtype() ? "_wf32" : "";  // f32 weights scaling f16/bf16 activations
  Dispatch d = e.make("rmsnorm", "rmsnorm_forward_" + s + wsfx + (wide ? "_yf32" : ""));
  const size_t ys = dtype_size(y.dtype());
  bind(d, 0, x), bind(d, 1, w), bind(d, 3, rstd);
  bind(d, 2, y, size_t(extent_elems(rows, C, ldy, 0, 1)) * ys);
  const bool vec4 = C % 4 == 0 && ldy % 4 == 0 && (x.offset() / dtype_size(x.dtype())) % 4 == 0 && (y.offset() / ys) % 4 == 0;
  d.set_args(4, RmsnormArgs{u32(e.op, rows, "rows"), u32(e.op, C, "cols"), eps, u32(e.op, ldy, "ldy"), vec4 ? 1u : 0u});
  d.grid = {uint32_t(rows), 1, 1};
  d.threads = {row_threads(C), 1, 1};
  encode(std::move(d));
}

void MetalOps::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                const Tensor& dx, const Tensor* dw, const Tensor* residual) {
  Emit e{this, "rmsnorm_backward"};
  const std::string s = e.sfx(x.dtype());
  // dy and dx in x's dtype, or both f32 with bf16 x and f32 w (the kernels rmsnorm.metal has)
  const bool wide = dy.dtype() != x.dtype();
  if (dx.dtype() != dy.dtype() ||
      (wide && !(x.dtype() == DType::bf16 && w.dtype() == DType::f32 && dy.dtype() == DType::f32)))
    throw NotImplementedError("[rmsnorm_backward] dy and dx must have x's dtype (or both be f32, with bf16 x and f32 w) on " +
                              name());
  const std::string gsfx = wide ? "_dyf32" : "";
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  if (rows == 0) return;
  // dx and residual: C, or a LoRA fold's wider buffers (core ops.cpp checked the views)
  const int64_t ldx = dx.row_stride(), ldr = residual ? residual->row_stride() : C;
  const RmsnormBackwardArgs args{u32(e.op, rows, "rows"), u32(e.op, C, "cols"), u32(e.op, ldx, "ldx"),
                                 u32(e.op, ldr, "ldr"), residual ? 1u : 0u};
  if (dw) {  // first: dx may overwrite dy
    Dispatch d = e.make("rmsnorm", "rmsnorm_backward_dw_" + s + gsfx);
    bind(d, 0, dy), bind(d, 1, x), bind(d, 2, rstd), bind(d, 3, *dw);
    d.set_args(4, args);
    d.grid = {ceil_div(C, 32), 1, 1};  // 32 columns per threadgroup, rows in 8 strands
    d.threads = {32, 8, 1};
    encode(std::move(d));
  }
  Dispatch d = e.make("rmsnorm", "rmsnorm_backward_" + s + (w.dtype() != x.dtype() ? "_wf32" : "") + gsfx);
  const size_t gs = dtype_size(dx.dtype());
  bind(d, 0, dy), bind(d, 1, x), bind(d, 2, w), bind(d, 3, rstd);
  bind(d, 4, dx, size_t(extent_elems(rows, C, ldx, 0, 1)) * gs);
  // The residual add is fused (one pass over dx fewer); without one, buffer(6) is dy, never read.
  if (residual) bind(d, 6, *residual, size_t(extent_elems(rows, C, ldr, 0, 1)) * gs);
  else bind(d, 6, dy);
  d.set_args(5, args);
  d.grid = {uint32_t(rows), 1, 1};
  d.threads = {row_threads(C), 1, 1};
  encode(std::move(d));
}

}  // namespace krnl::metal
