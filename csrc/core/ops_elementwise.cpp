// The elementwise ops' entry points: SwiGLU, GeGLU, soft-capping, DoRA's column scaling and norm,
// add, axpy, scale, cast, fill and dropout.
#include <cmath>
#include <string>
#include <utility>

#include "ops_common.h"

namespace krnl::ops {

namespace {
// SwiGLU's clamp: limit > 0 takes gpt-oss's clamped form with any finite alpha; limit <= 0 the
// plain silu(g) * u, which has no alpha (1, its only value, keeps a wrong call from passing).
void check_swiglu(Check& c, float alpha, float limit) {
  if (!std::isfinite(limit)) c.fail("limit must be finite (<= 0: no clamp), got " + std::to_string(limit));
  if (!std::isfinite(alpha)) c.fail("alpha must be finite, got " + std::to_string(alpha));
  if (limit <= 0.f && alpha != 1.f)
    c.fail("alpha=" + std::to_string(alpha) + " needs limit > 0 (the clamped form); plain silu(g) * u takes alpha 1");
}
}  // namespace

void swiglu_forward(const Tensor& g, const Tensor& u, const Tensor& s, float alpha, float limit) {
  Check c{"swiglu_forward"};
  c.tensor("g", g), c.tensor("u", u), c.tensor("s", s);
  c.floating("g", g);
  c.shape("u", u, g.shape()), c.same_dtype("u", u, "g", g);
  c.shape("s", s, g.shape()), c.same_dtype("s", s, "g", g);
  check_swiglu(c, alpha, limit);
  run(c, shape_str(g.shape()) + (limit > 0.f ? " clamped" : ""), 6.0 * double(g.numel()), nbytes({&g, &u, &s}),
      g.dtype(), [&] { c.dev->swiglu_forward(g, u, s, alpha, limit); });
}

void swiglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du,
                     float alpha, float limit) {
  Check c{"swiglu_backward"};
  c.tensor("ds", ds), c.tensor("g", g), c.tensor("u", u), c.tensor("dg", dg), c.tensor("du", du);
  c.floating("g", g);
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"ds", &ds}, {"u", &u}, {"dg", &dg}, {"du", &du}}) {
    c.shape(n, *t, g.shape());
    c.same_dtype(n, *t, "g", g);
  }
  check_swiglu(c, alpha, limit);
  run(c, shape_str(g.shape()) + (limit > 0.f ? " clamped" : ""), 12.0 * double(g.numel()),
      nbytes({&ds, &g, &u, &dg, &du}), g.dtype(), [&] { c.dev->swiglu_backward(ds, g, u, dg, du, alpha, limit); });
}

void geglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) {
  Check c{"geglu_forward"};
  c.tensor("g", g), c.tensor("u", u), c.tensor("s", s);
  c.floating("g", g);
  c.shape("u", u, g.shape()), c.same_dtype("u", u, "g", g);
  c.shape("s", s, g.shape()), c.same_dtype("s", s, "g", g);
  run(c, shape_str(g.shape()), 10.0 * double(g.numel()), nbytes({&g, &u, &s}), g.dtype(),
      [&] { c.dev->geglu_forward(g, u, s); });
}

void geglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) {
  Check c{"geglu_backward"};
  c.tensor("ds", ds), c.tensor("g", g), c.tensor("u", u), c.tensor("dg", dg), c.tensor("du", du);
  c.floating("g", g);
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"ds", &ds}, {"u", &u}, {"dg", &dg}, {"du", &du}}) {
    c.shape(n, *t, g.shape());
    c.same_dtype(n, *t, "g", g);
  }
  run(c, shape_str(g.shape()), 18.0 * double(g.numel()), nbytes({&ds, &g, &u, &dg, &du}), g.dtype(),
      [&] { c.dev->geglu_backward(ds, g, u, dg, du); });
}

void softcap(const Tensor& x, float cap, const Tensor& out) {
  Check c{"softcap"};
  c.tensor("x", x), c.tensor("out", out);
  c.floating("x", x);
  c.shape("out", out, x.shape()), c.same_dtype("out", out, "x", x);
  if (!(cap > 0) || !std::isfinite(cap)) c.fail("cap must be finite and > 0, got " + std::to_string(cap));
  run(c, shape_str(x.shape()), 4.0 * double(x.numel()), nbytes({&x, &out}), x.dtype(),
      [&] { c.dev->softcap(x, cap, out); });
}

void softcap_backward(const Tensor& dy, const Tensor& y, float cap, const Tensor& dx) {
  Check c{"softcap_backward"};
  c.tensor("dy", dy), c.tensor("y", y), c.tensor("dx", dx);
  c.floating("y", y);
  c.shape("dy", dy, y.shape()), c.same_dtype("dy", dy, "y", y);
  c.shape("dx", dx, y.shape()), c.same_dtype("dx", dx, "y", y);
  if (!(cap > 0) || !std::isfinite(cap)) c.fail("cap must be finite and > 0, got " + std::to_string(cap));
  run(c, shape_str(y.shape()), 4.0 * double(y.numel()), nbytes({&dy, &y, &dx}), y.dtype(),
      [&] { c.dev->softcap_backward(dy, y, cap, dx); });
}

// ---- DoRA (op_list.h's notes): activations may be column blocks of wider buffers (q|k|v)

namespace {
void check_columns(Check& c, const char* name, const Tensor& x, const Tensor& ref) {
  c.rows(name, x);
  c.shape(name, x, ref.shape()), c.same_dtype(name, x, "x", ref);
}
}  // namespace

void scale_columns(const Tensor& x, const Tensor& v, const Tensor& out) {
  Check c{"scale_columns"};
  c.rows("x", x), c.tensor("v", v);
  c.floating("x", x);
  if (x.dim() != 2) c.fail("x must be 2-D (rows, columns), got " + x.describe());
  c.shape("v", v, {x.size(1)}), c.dtype("v", v, {DType::f32});
  check_columns(c, "out", out, x);
  run(c, shape_str(x.shape()), double(x.numel()), nbytes({&x, &v, &out}), x.dtype(),
      [&] { c.dev->scale_columns(x, v, out); });
}

void scale_columns_backward(const Tensor& dy, const Tensor& x, const Tensor& v, const Tensor& dx, const Tensor& dv) {
  Check c{"scale_columns_backward"};
  c.rows("x", x), c.tensor("v", v), c.tensor("dv", dv);
  c.floating("x", x);
  if (x.dim() != 2) c.fail("x must be 2-D (rows, columns), got " + x.describe());
  check_columns(c, "dy", dy, x), check_columns(c, "dx", dx, x);
  c.shape("v", v, {x.size(1)}), c.dtype("v", v, {DType::f32});
  c.dtype("dv", dv, {DType::f32});
  if (dv.dim() != 2 || dv.size(1) != x.size(1) || dv.size(0) < 1 || x.size(0) % dv.size(0))
    c.fail("dv must be (S, " + std::to_string(x.size(1)) + ") with S dividing the " + std::to_string(x.size(0)) +
           " rows of x, got " + dv.describe());
  run(c, shape_str(x.shape()) + " in " + std::to_string(dv.size(0)), 3.0 * double(x.numel()),
      nbytes({&dy, &x, &dx, &dv}), x.dtype(), [&] { c.dev->scale_columns_backward(dy, x, v, dx, dv); });
}

void dora_norm(const Tensor& w2, const Tensor& B, const Tensor& Q, const Tensor& m, float alpha, const Tensor& scale,
               const Tensor& inv_norm) {
  Check c{"dora_norm"};
  c.tensor("w2", w2), c.tensor("B", B), c.tensor("Q", Q), c.tensor("m", m), c.tensor("scale", scale);
  c.tensor("inv_norm", inv_norm);
  c.floating("B", B);
  if (B.dim() != 2) c.fail("B must be 2-D (outputs, rank), got " + B.describe());
  const int64_t M = B.size(0), r = B.size(1);
  c.shape("Q", Q, {r, M}), c.dtype("Q", Q, {DType::f32});
  c.shape("m", m, {M}), c.same_dtype("m", m, "B", B);
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"w2", &w2}, {"scale", &scale}, {"inv_norm", &inv_norm}})
    c.shape(n, *t, {M}), c.dtype(n, *t, {DType::f32});
  if (!std::isfinite(alpha)) c.fail("alpha must be finite, got " + std::to_string(alpha));
  run(c, shape_str(B.shape()), 2.0 * double(B.numel()), nbytes({&w2, &B, &Q, &m, &scale, &inv_norm}), B.dtype(),
      [&] { c.dev->dora_norm(w2, B, Q, m, alpha, scale, inv_norm); });
}

void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  Check c{"add"};
  c.tensor("a", a), c.tensor("b", b), c.tensor("out", out);
  c.floating("a", a);
  c.shape("b", b, a.shape()), c.same_dtype("b", b, "a", a);
  c.shape("out", out, a.shape()), c.same_dtype("out", out, "a", a);
  run(c, shape_str(a.shape()), double(a.numel()), nbytes({&a, &b, &out}), a.dtype(), [&] { c.dev->add(a, b, out); });
}

void axpy(float alpha, const Tensor& x, const Tensor& y) {
  Check c{"axpy"};
  c.tensor("x", x), c.tensor("y", y);
  c.floating("x", x), c.floating("y", y);
  c.shape("y", y, x.shape());
  run(c, shape_str(x.shape()), 2.0 * double(x.numel()), nbytes({&x, &y, &y}), y.dtype(), [&] { c.dev->axpy(alpha, x, y); });
}

void scale(const Tensor& x, float alpha, const Tensor& out) {
  Check c{"scale"};
  c.tensor("x", x), c.tensor("out", out);
  c.floating("x", x);
  c.shape("out", out, x.shape()), c.same_dtype("out", out, "x", x);
  run(c, shape_str(x.shape()), double(x.numel()), nbytes({&x, &out}), x.dtype(), [&] { c.dev->scale(x, alpha, out); });
}

void cast(const Tensor& x, const Tensor& out) {
  Check c{"cast"};
  c.tensor("x", x), c.tensor("out", out);
  c.shape("out", out, x.shape());
  if ((x.dtype() == DType::i32) != (out.dtype() == DType::i32))
    c.fail("casts between i32 and floating types are not supported: " + x.describe() + " -> " + out.describe());
  run(c, shape_str(x.shape()) + " " + dtype_name(x.dtype()) + "->" + dtype_name(out.dtype()), 0, nbytes({&x, &out}),
      x.dtype(), [&] { c.dev->cast(x, out); });
}

void fill(const Tensor& x, double value) {
  Check c{"fill"};
  c.tensor("x", x);
  run(c, shape_str(x.shape()), 0, nbytes({&x}), x.dtype(), [&] { c.dev->fill(x, value); });
}

void dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, const Tensor* seed_offset) {
  Check c{"dropout"};
  c.tensor("x", x), c.tensor("out", out);
  c.floating("x", x);
  c.shape("out", out, x.shape()), c.same_dtype("out", out, "x", x);
  if (!(p >= 0.f && p < 1.f)) c.fail("p must be in [0, 1), got " + std::to_string(p));
  if (seed_offset) {
    c.tensor("seed_offset", *seed_offset);
    if (seed_offset->shape() != Shape{3}) c.shape("seed_offset", *seed_offset, {2});  // (3,): with a first row
    c.dtype("seed_offset", *seed_offset, {DType::i32});
  }
  run(c, shape_str(x.shape()), double(x.numel()), nbytes({&x, &out}), x.dtype(),
      [&] { c.dev->dropout(x, out, p, seed, seed_offset); });
}

}  // namespace krnl::ops
