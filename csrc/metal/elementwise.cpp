// Elementwise ops on the Metal kernels: SwiGLU, GeGLU, soft-capping (their own libraries), then
// DoRA's column scaling and norm, add, axpy, scale, cast, fill, dropout and the head transpose
// (metal/elementwise.metal).
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>

#include "core/dtype.h"
#include "metal/metal_ops.h"
#include "metal/ops_common.h"

namespace krnl::metal {

// ---- gated MLPs and soft-capping

void MetalOps::swiglu_forward(const Tensor& g, const Tensor& u, const Tensor& s, float alpha, float limit) {
  Emit e{this, "swiglu_forward"};
  Dispatch d = e.make("swiglu", "swiglu_forward_" + e.sfx(g.dtype()));
  if (g.numel() == 0) return;
  bind(d, 0, g), bind(d, 1, u), bind(d, 2, s);
  d.set_args(3, SwigluArgs{u32(e.op, g.numel(), "n"), alpha, limit});
  ew_geometry(d, g.numel());
  encode(std::move(d));
}

void MetalOps::swiglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du,
                               float alpha, float limit) {
  Emit e{this, "swiglu_backward"};
  Dispatch d = e.make("swiglu", "swiglu_backward_" + e.sfx(g.dtype()));
  if (g.numel() == 0) return;
  bind(d, 0, ds), bind(d, 1, g), bind(d, 2, u), bind(d, 3, dg), bind(d, 4, du);
  d.set_args(5, SwigluArgs{u32(e.op, g.numel(), "n"), alpha, limit});
  ew_geometry(d, g.numel());
  encode(std::move(d));
}

void MetalOps::geglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) {
  Emit e{this, "geglu_forward"};
  Dispatch d = e.make("geglu", "geglu_forward_" + e.sfx(g.dtype()));
  if (g.numel() == 0) return;
  bind(d, 0, g), bind(d, 1, u), bind(d, 2, s);
  d.set_args(3, GegluArgs{u32(e.op, g.numel(), "n")});
  ew_geometry(d, g.numel());
  encode(std::move(d));
}

void MetalOps::geglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) {
  Emit e{this, "geglu_backward"};
  Dispatch d = e.make("geglu", "geglu_backward_" + e.sfx(g.dtype()));
  if (g.numel() == 0) return;
  bind(d, 0, ds), bind(d, 1, g), bind(d, 2, u), bind(d, 3, dg), bind(d, 4, du);
  d.set_args(5, GegluArgs{u32(e.op, g.numel(), "n")});
  ew_geometry(d, g.numel());
  encode(std::move(d));
}

void MetalOps::softcap(const Tensor& x, float cap, const Tensor& out) {
  Emit e{this, "softcap"};
  Dispatch d = e.make("softcap", "softcap_" + e.sfx(x.dtype()));
  if (x.numel() == 0) return;
  bind(d, 0, x), bind(d, 1, out);
  d.set_args(2, SoftcapArgs{u32(e.op, x.numel(), "n"), cap});
  ew_geometry(d, x.numel());
  encode(std::move(d));
}

void MetalOps::softcap_backward(const Tensor& dy, const Tensor& y, float cap, const Tensor& dx) {
  Emit e{this, "softcap_backward"};
  Dispatch d = e.make("softcap", "softcap_backward_" + e.sfx(y.dtype()));
  if (y.numel() == 0) return;
  bind(d, 0, dy), bind(d, 1, y), bind(d, 2, dx);
  d.set_args(3, SoftcapArgs{u32(e.op, y.numel(), "n"), cap});
  ew_geometry(d, y.numel());
  encode(std::move(d));
}

// ---- DoRA: (rows, cols) views whose rows may be strided, bound over the bytes they span

namespace {
void bind_rows(Dispatch& d, uint32_t index, const Tensor& t) {
  bind(d, index, t, size_t(extent_elems(t.size(0), t.size(1), t.strides()[0], 0, 1)) * dtype_size(t.dtype()));
}
}  // namespace

void MetalOps::scale_columns(const Tensor& x, const Tensor& v, const Tensor& out) {
  Emit e{this, "scale_columns"};
  Dispatch d = e.make("elementwise", "scale_columns_" + e.sfx(x.dtype()));
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows * cols == 0) return;
  bind_rows(d, 0, x), bind(d, 1, v), bind_rows(d, 2, out);
  d.set_args(3, ScaleColumnsArgs{u32(e.op, rows, "rows"), u32(e.op, cols, "cols"), u32(e.op, x.strides()[0], "ldx"),
                                 u32(e.op, out.strides()[0], "ldo"), 0u, 0u});
  ew_geometry(d, u32(e.op, rows * cols, "rows * cols"));
  encode(std::move(d));
}

void MetalOps::scale_columns_backward(const Tensor& dy, const Tensor& x, const Tensor& v, const Tensor& dx,
                                      const Tensor& dv) {
  Emit e{this, "scale_columns_backward"};
  Dispatch d = e.make("elementwise", "scale_columns_backward_" + e.sfx(x.dtype()));
  const int64_t rows = x.size(0), cols = x.size(1), S = dv.size(0);
  if (cols == 0) return;
  bind_rows(d, 0, dy), bind_rows(d, 1, x), bind(d, 2, v), bind_rows(d, 3, dx), bind(d, 4, dv);
  d.set_args(5, ScaleColumnsArgs{u32(e.op, rows, "rows"), u32(e.op, cols, "cols"), u32(e.op, x.strides()[0], "ldx"),
                                 u32(e.op, dx.strides()[0], "ldd"), u32(e.op, dy.strides()[0], "ldy"),
                                 u32(e.op, rows / S, "rows per block")});
  d.grid = {ceil_div(cols, 32), u32(e.op, S, "blocks"), 1};
  d.threads = {32, 8, 1};  // elementwise.metal's SC_LANES
  encode(std::move(d));
}

void MetalOps::dora_norm(const Tensor& w2, const Tensor& B, const Tensor& Q, const Tensor& m, float alpha,
                         const Tensor& scale, const Tensor& inv_norm) {
  Emit e{this, "dora_norm"};
  Dispatch d = e.make("elementwise", "dora_norm_" + e.sfx(B.dtype()));
  const int64_t M = B.size(0);
  if (M == 0) return;
  bind(d, 0, w2), bind(d, 1, B), bind(d, 2, Q), bind(d, 3, m), bind(d, 4, scale), bind(d, 5, inv_norm);
  d.set_args(6, DoraNormArgs{u32(e.op, M, "M"), u32(e.op, B.size(1), "r"), alpha});
  ew_geometry(d, M);
  encode(std::move(d));
}

// ---- elementwise

// A grid-stride kernel of elementwise.metal: the tensors at buffers 0, 1, ..., then ElementwiseArgs.
void MetalOps::elementwise(const char* op, const std::string& kernel, std::initializer_list<const Tensor*> tensors,
                           int64_t n, float alpha) {
  if (n == 0) return;
  Dispatch d = Emit{this, op}.make("elementwise", kernel);
  uint32_t i = 0;
  for (const Tensor* t : tensors) bind(d, i++, *t);
  d.set_args(i, ElementwiseArgs{u32(op, n, "n"), alpha, 0.f});
  ew_geometry(d, n);
  encode(std::move(d));
}

void MetalOps::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  elementwise("add", "add_" + Emit{this, "add"}.sfx(a.dtype()), {&a, &b, &out}, a.numel(), 0.f);
}

void MetalOps::axpy(float alpha, const Tensor& x, const Tensor& y) {
  Emit e{this, "axpy"};
  const std::string k = x.dtype() == y.dtype() ? e.sfx(x.dtype()) : e.sfx(x.dtype()) + "_" + e.sfx(y.dtype());
  elementwise("axpy", "axpy_" + k, {&x, &y}, x.numel(), alpha);
}

void MetalOps::scale(const Tensor& x, float alpha, const Tensor& out) {
  elementwise("scale", "scale_" + Emit{this, "scale"}.sfx(x.dtype()), {&x, &out}, x.numel(), alpha);
}

void MetalOps::cast(const Tensor& x, const Tensor& out) {
  Emit c{this, "cast"};
  // i32 -> i32 is a copy of 4-byte words: the f32 copy kernel moves the bits unchanged.
  const std::string src = x.dtype() == DType::i32 ? "f32" : c.sfx(x.dtype());
  const std::string dst = out.dtype() == DType::i32 ? "f32" : c.sfx(out.dtype());
  elementwise("cast", "cast_" + src + "_" + dst, {&x, &out}, x.numel(), 0.f);
}

void MetalOps::fill(const Tensor& x, double value) {
  const std::string s = Emit{this, "fill"}.sfx(x.dtype());
  // alpha carries the value as a float (the i32 kernel saturates it as the CPU backend does);
  // i32 values beyond float's 24-bit mantissa would round, so they are written from the host.
  if (x.dtype() == DType::i32 && std::abs(value) > 16777216.0 && !std::isnan(value)) {
    throw NotImplementedError("[fill] i32 values beyond +-2^24 are not implemented on " + name());
  }
  elementwise("fill", "fill_" + s, {&x}, x.numel(), float(value));
}

void MetalOps::dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, const Tensor* seed_offset) {
  Emit e{this, "dropout"};
  const std::string s = e.sfx(x.dtype());
  if (p == 0.f) {
    cast(x, out);  // same dtype: a copy
    return;
  }
  Dispatch d = e.make("elementwise", "dropout_" + s);
  if (x.numel() == 0) return;
  bind(d, 0, x), bind(d, 1, out);
  bind_optional(d, 3, seed_offset, x);
  const int64_t width = seed_offset && seed_offset->numel() == 3 ? (x.shape().empty() ? 1 : x.shape().back()) : 0;
  d.set_args(2, DropoutArgs{u32(e.op, x.numel(), "n"), uint32_t(seed), uint32_t(seed >> 32), p, 1.f / (1.f - p),
                            seed_offset ? 1u : 0u, u32(e.op, width, "row width")});
  ew_geometry(d, x.numel());
  encode(std::move(d));
}

void MetalOps::transpose_heads(const Tensor& x, const Tensor& out, const Tensor* positions, const Tensor* inv_freq,
                               int64_t rotate, float sign, int64_t heads_axis) {
  Emit e{this, "transpose_heads"};
  // i32 moves as f32 bits (positions, ids): the kernel only copies.
  Dispatch d = e.make("elementwise", "transpose_heads_" + (x.dtype() == DType::i32 ? "f32" : e.sfx(x.dtype())));
  const int64_t A = x.size(0), B = x.size(1), D = x.size(2);
  if (x.numel() == 0) return;
  bind(d, 0, x), bind(d, 1, out);
  const bool turn = rotate > 0;
  if (turn)
    bind(d, 3, *positions), bind(d, 4, *inv_freq);
  else
    bind(d, 3, x, 0), bind(d, 4, x, 0);  // must be bound; not read
  const uint32_t R = turn ? uint32_t(inv_freq->numel()) : 0u;
  d.set_args(2, TransposeHeadsArgs{u32(e.op, A, "A"), u32(e.op, B, "B"), u32(e.op, D, "D"), uint32_t(rotate), R,
                                   uint32_t(heads_axis), sign});
  // One row of D per (x-lanes, b, a): the lanes stride over D (by 4 when D % 4 == 0).
  const uint32_t lanes = uint32_t(std::min<int64_t>(32, std::max<int64_t>(1, D % 4 == 0 ? D / 4 : D)));
  const uint32_t ty = std::max<uint32_t>(1, 64 / lanes);
  d.grid = {1, ceil_div(B, ty), uint32_t(A)};
  d.threads = {lanes, ty, 1};
  encode(std::move(d));
}

}  // namespace krnl::metal
