#include "ops.h"

#include <chrono>
#include <cmath>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace krnl::ops {
namespace {

// Validation of one op call: every failure names the op and the argument.
struct Check {
  const char* op;
  Backend* dev = nullptr;

  [[noreturn]] void fail(const std::string& msg) const { throw std::invalid_argument(std::string("[") + op + "] " + msg); }

  const Tensor& tensor(const char* name, const Tensor& x) {
    tensor_any(name, x);
    if (!x.is_contiguous()) fail(std::string(name) + " must be contiguous, got " + x.describe());
    return x;
  }
  // Defined and on the op's device; layout checked by the caller.
  const Tensor& tensor_any(const char* name, const Tensor& x) {
    if (!x.defined()) fail(std::string(name) + " is undefined");
    if (!dev)
      dev = x.device();
    else if (x.device() != dev)
      fail(std::string(name) + " is on " + x.device()->name() + " but the other operands are on " + dev->name());
    dev->keep_for_capture(x.storage());  // a captured graph bakes in this operand's address
    return x;
  }
  void dtype(const char* name, const Tensor& x, std::initializer_list<DType> ok) {
    for (DType d : ok)
      if (x.dtype() == d) return;
    std::string allowed;
    for (DType d : ok) allowed += (allowed.empty() ? "" : "/") + std::string(dtype_name(d));
    fail(std::string(name) + " must be " + allowed + ", got " + x.describe());
  }
  void floating(const char* name, const Tensor& x) { dtype(name, x, {DType::f32, DType::f16, DType::bf16}); }
  void same_dtype(const char* name, const Tensor& x, const char* ref_name, const Tensor& ref) {
    if (x.dtype() != ref.dtype())
      fail(std::string(name) + " must have the dtype of " + ref_name + " (" + dtype_name(ref.dtype()) + "), got " + x.describe());
  }
  void shape(const char* name, const Tensor& x, const Shape& want) {
    if (x.shape() != want) fail(std::string(name) + " must have shape " + shape_str(want) + ", got " + x.describe());
  }
  void numel(const char* name, const Tensor& x, int64_t want) {
    if (x.numel() != want) fail(std::string(name) + " must have " + std::to_string(want) + " elements, got " + x.describe());
  }
  // A token-major (B, T, H, D) view on a device that takes one: rows of D contiguous, the other
  // strides positive and disjoint (no two elements share an address).
  const Tensor& token_major(const char* name, const Tensor& x) {
    tensor_any(name, x);
    if (!dev->token_major_attention())
      throw NotImplementedError(std::string("[") + op + "] " + dev->name() +
                                " takes no token-major (B, T, H, D) operands (capabilities: fused_attention.token_major)");
    const Shape& s = x.strides();
    if (x.dim() != 4 || s[3] != 1 || s[2] < x.size(3) || s[1] < x.size(2) * s[2] || s[0] < x.size(1) * s[1])
      fail(std::string(name) + " must be a token-major (B, T, H, D) view with contiguous rows of D, got " + x.describe());
    return x;
  }
  // Contiguous, or a row-strided 2-D view (a column block of a wider buffer).
  const Tensor& rows(const char* name, const Tensor& x) {
    if (x.defined() && x.dim() == 2 && !x.is_contiguous() && x.strides()[1] == 1 && x.strides()[0] >= x.size(1))
      return tensor_any(name, x);
    return tensor(name, x);
  }
  void rank_at_least(const char* name, const Tensor& x, int64_t r) {
    if (x.dim() < r) fail(std::string(name) + " must have at least " + std::to_string(r) + " dimensions, got " + x.describe());
  }
};

// Runs a validated op: inside the open step, or as a one-op step; timed when profiling.
template <class F>
void run(Check& c, const std::string& shape, double flops, double bytes, DType dt, F&& body) {
  Backend* dev = c.dev;
  const bool implicit = !dev->in_step();
  if (implicit) dev->begin_step();
  try {
    if (!dev->profiling()) {
      body();
    } else {
      dev->take_device_ms();  // device time not reported inside an op belongs to none
      auto t0 = std::chrono::steady_clock::now();
      body();
      auto t1 = std::chrono::steady_clock::now();
      // One record per op: the host time of the call, or the device's own time of the op's work
      // where it measures it (Backend::profiles_device_time: Metal's GPU time per dispatch).
      const double ms = dev->profiles_device_time() ? dev->take_device_ms()
                                                    : std::chrono::duration<double, std::milli>(t1 - t0).count();
      dev->add_record({c.op, shape, dtype_name(dt), ms, flops, bytes});
    }
  } catch (...) {
    if (implicit) {  // close the one-op step; the op's own error is the one to report
      try {
        dev->commit();
      } catch (...) {
      }
    }
    throw;
  }
  // Outside the try: a failing commit (an asynchronous device's execution error) reaches the caller.
  if (implicit) dev->commit();
}

double nbytes(std::initializer_list<const Tensor*> ts) {
  double b = 0;
  for (auto* t : ts)
    if (t && t->defined()) b += double(t->nbytes());
  return b;
}

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

void swiglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) {
  Check c{"swiglu_forward"};
  c.tensor("g", g), c.tensor("u", u), c.tensor("s", s);
  c.floating("g", g);
  c.shape("u", u, g.shape()), c.same_dtype("u", u, "g", g);
  c.shape("s", s, g.shape()), c.same_dtype("s", s, "g", g);
  run(c, shape_str(g.shape()), 6.0 * double(g.numel()), nbytes({&g, &u, &s}), g.dtype(),
      [&] { c.dev->swiglu_forward(g, u, s); });
}

void swiglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) {
  Check c{"swiglu_backward"};
  c.tensor("ds", ds), c.tensor("g", g), c.tensor("u", u), c.tensor("dg", dg), c.tensor("du", du);
  c.floating("g", g);
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"ds", &ds}, {"u", &u}, {"dg", &dg}, {"du", &du}}) {
    c.shape(n, *t, g.shape());
    c.same_dtype(n, *t, "g", g);
  }
  run(c, shape_str(g.shape()), 12.0 * double(g.numel()), nbytes({&ds, &g, &u, &dg, &du}), g.dtype(),
      [&] { c.dev->swiglu_backward(ds, g, u, dg, du); });
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

namespace {
// RoPE's arguments beside x (rope, transpose_heads): i32 positions, 1 to D/2 f32 frequencies, sign +-1.
void check_rope(Check& c, const Tensor& positions, const Tensor& inv_freq, int64_t D, float sign) {
  c.dtype("positions", positions, {DType::i32});
  c.dtype("inv_freq", inv_freq, {DType::f32});
  if (inv_freq.dim() != 1 || inv_freq.size(0) == 0 || 2 * inv_freq.size(0) > D)
    c.fail("inv_freq must be 1-D with 1 to D/2 = " + std::to_string(D / 2) + " entries, got " + inv_freq.describe());
  if (sign != 1.f && sign != -1.f) c.fail("sign must be +1 (forward) or -1 (backward), got " + std::to_string(sign));
}
}  // namespace

void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float sign, bool token_major) {
  Check c{"rope"};
  c.tensor("positions", positions), c.tensor("inv_freq", inv_freq);
  int64_t T = 0;
  if (token_major) {
    c.token_major("x", x);
    T = x.size(1);
    if (!(positions.shape() == Shape{x.size(0), T} || positions.shape() == Shape{T}))
      c.fail("positions must have shape " + shape_str({x.size(0), T}) + " or (" + std::to_string(T) + ",), got " +
             positions.describe());
  } else {
    c.tensor("x", x);
    c.rank_at_least("x", x, 2);
    T = x.size(-2);
    c.shape("positions", positions, {T});
  }
  c.floating("x", x);
  check_rope(c, positions, inv_freq, x.size(-1), sign);
  run(c, shape_str(x.shape()) + (token_major ? " token-major" : ""), 6.0 * double(x.numel()), 2.0 * nbytes({&x}),
      x.dtype(), [&] { c.dev->rope(x, positions, inv_freq, sign, token_major); });
}

void softmax_causal_forward(const Tensor& S, const Tensor& P, float scale, const Tensor* segments, int64_t window) {
  Check c{"softmax_causal_forward"};
  c.tensor("S", S), c.tensor("P", P);
  c.rank_at_least("S", S, 2);
  c.floating("S", S);
  c.shape("P", P, S.shape()), c.same_dtype("P", P, "S", S);
  const int64_t Tq = S.size(-2), Tk = S.size(-1);
  if (Tq > Tk) c.fail("S must have at most as many query rows as key columns, got " + S.describe());
  if (segments) {
    c.tensor("segments", *segments);
    c.dtype("segments", *segments, {DType::i32});
    if (Tq != Tk) c.fail("segments need square scores (Tq == Tk), got " + S.describe());
    c.shape("segments", *segments, {Tk});
  }
  if (!(scale > 0)) c.fail("scale must be > 0");
  if (window < 0) c.fail("window must be >= 0 (0: no sliding window), got " + std::to_string(window));
  run(c, shape_str(S.shape()), 5.0 * double(S.numel()), nbytes({&S, &P}), S.dtype(),
      [&] { c.dev->softmax_causal_forward(S, P, scale, segments, window); });
}

void softmax_backward(const Tensor& P, const Tensor& dP, const Tensor& dS, float scale) {
  Check c{"softmax_backward"};
  c.tensor("P", P), c.tensor("dP", dP), c.tensor("dS", dS);
  c.rank_at_least("P", P, 1);
  c.floating("P", P);
  c.shape("dP", dP, P.shape()), c.same_dtype("dP", dP, "P", P);
  c.shape("dS", dS, P.shape()), c.same_dtype("dS", dS, "P", P);
  run(c, shape_str(P.shape()), 4.0 * double(P.numel()), nbytes({&P, &dP, &dS}), P.dtype(),
      [&] { c.dev->softmax_backward(P, dP, dS, scale); });
}

namespace {
// Shared checks of attention_forward/backward: q (Hq, T, D), k and v (Hk, T, D) with Hk dividing
// Hq, o like q, lse (Hq, T) f32. Returns the causal FLOPs of the forward's two products.
double check_attention(Check& c, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                       const Tensor& lse, float scale, const Tensor* segments, int64_t window) {
  // 4-D: token-major views of B sequences (op_list.h); 3-D: one sequence, head-major.
  const bool tm = q.dim() == 4;
  if (tm) {
    c.token_major("q", q), c.token_major("k", k), c.token_major("v", v), c.token_major("o", o);
    c.tensor("lse", lse);
  } else {
    c.tensor("q", q), c.tensor("k", k), c.tensor("v", v), c.tensor("o", o), c.tensor("lse", lse);
    if (q.dim() != 3) c.fail("q must be (Hq, T, D) or a token-major (B, T, Hq, D) view, got " + q.describe());
  }
  c.floating("q", q);
  const int64_t B = tm ? q.size(0) : 1, T = q.size(1), Hq = q.size(tm ? 2 : 0), D = q.size(-1);  // T: axis 1 both ways
  const int64_t Hk = k.size(tm ? 2 : 0);
  const Shape kshape = tm ? Shape{B, T, Hk, D} : Shape{Hk, T, D};
  if (k.shape() != kshape || Hk < 1 || Hq % Hk != 0)
    c.fail("k must be " + std::string(tm ? "(B, T, Hk, D) = (" + std::to_string(B) + ", " : "(Hk, ") +
           std::to_string(T) + (tm ? ", Hk, " : ", ") + std::to_string(D) + ") with Hk dividing Hq = " +
           std::to_string(Hq) + ", got " + k.describe());
  c.same_dtype("k", k, "q", q);
  c.shape("v", v, k.shape()), c.same_dtype("v", v, "q", q);
  c.shape("o", o, q.shape()), c.same_dtype("o", o, "q", q);
  c.shape("lse", lse, tm ? Shape{B, Hq, T} : Shape{Hq, T}), c.dtype("lse", lse, {DType::f32});
  if (!(scale > 0)) c.fail("scale must be > 0");
  if (segments) {
    if (tm) c.fail("segments are not taken with token-major operands (packed rows stay head-major)");
    c.tensor("segments", *segments);
    c.dtype("segments", *segments, {DType::i32});
    c.shape("segments", *segments, {T});
  }
  if (window < 0) c.fail("window must be >= 0 (0: no sliding window), got " + std::to_string(window));
  // QK^T and PV over the keys each query sees (an upper bound with segments)
  const double keys = window > 0 && window < T ? double(window) * double(2 * T - window + 1) / 2.0
                                               : double(T) * double(T + 1) / 2.0;
  return 4.0 * double(B) * double(Hq) * double(D) * keys;
}
}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                       float scale, const Tensor* segments, int64_t window) {
  Check c{"attention_forward"};
  const double flops = check_attention(c, q, k, v, o, lse, scale, segments, window);
  run(c, shape_str(q.shape()) + " kv " + shape_str(k.shape()), flops, nbytes({&q, &k, &v, &o, &lse}), q.dtype(),
      [&] { c.dev->attention_forward(q, k, v, o, lse, scale, segments, window); });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& dout,
                        const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, float scale,
                        const Tensor* segments, int64_t window) {
  Check c{"attention_backward"};
  const double flops = check_attention(c, q, k, v, o, lse, scale, segments, window);
  if (q.dim() == 4)
    c.token_major("dout", dout), c.token_major("dq", dq), c.token_major("dk", dk), c.token_major("dv", dv);
  else
    c.tensor("dout", dout), c.tensor("dq", dq), c.tensor("dk", dk), c.tensor("dv", dv);
  c.shape("dout", dout, q.shape()), c.same_dtype("dout", dout, "q", q);
  c.shape("dq", dq, q.shape()), c.same_dtype("dq", dq, "q", q);
  c.shape("dk", dk, k.shape()), c.same_dtype("dk", dk, "q", q);
  c.shape("dv", dv, k.shape()), c.same_dtype("dv", dv, "q", q);
  // Backward recomputes S and runs four more products: 2.5 forwards, as flash attention counts.
  run(c, shape_str(q.shape()) + " kv " + shape_str(k.shape()), 2.5 * flops,
      nbytes({&q, &k, &v, &o, &dout, &lse, &dq, &dk, &dv}), q.dtype(),
      [&] { c.dev->attention_backward(q, k, v, o, dout, lse, dq, dk, dv, scale, segments, window); });
}

void embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out) {
  Check c{"embedding_forward"};
  c.tensor("ids", ids), c.tensor("table", table), c.tensor("out", out);
  c.dtype("ids", ids, {DType::i32});
  if (table.dim() != 2) c.fail("table must be 2-D (V, C), got " + table.describe());
  c.floating("table", table);
  Shape want = ids.shape();
  want.push_back(table.size(1));
  c.shape("out", out, want);
  c.same_dtype("out", out, "table", table);
  run(c, shape_str(out.shape()), 0, 2.0 * nbytes({&out}), table.dtype(),
      [&] { c.dev->embedding_forward(ids, table, out); });
}

void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  Check c{"embedding_backward"};
  c.tensor("ids", ids), c.tensor("dout", dout), c.tensor("dtable", dtable);
  c.dtype("ids", ids, {DType::i32});
  if (dtable.dim() != 2) c.fail("dtable must be 2-D (V, C), got " + dtable.describe());
  c.dtype("dtable", dtable, {DType::f32});
  Shape want = ids.shape();
  want.push_back(dtable.size(1));
  c.shape("dout", dout, want);
  c.floating("dout", dout);
  run(c, shape_str(dout.shape()), double(dout.numel()), 3.0 * nbytes({&dout}), dout.dtype(),
      [&] { c.dev->embedding_backward(ids, dout, dtable); });
}

void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& loss, const Tensor* dlogits,
                   int32_t ignore_index, float scale, const Tensor* scale_by) {
  Check c{"cross_entropy"};
  c.tensor("logits", logits), c.tensor("targets", targets), c.tensor("loss", loss);
  if (logits.dim() != 2) c.fail("logits must be 2-D (T, V), got " + logits.describe());
  c.floating("logits", logits);
  const int64_t T = logits.size(0);
  c.shape("targets", targets, {T});
  c.dtype("targets", targets, {DType::i32});
  c.shape("loss", loss, {T});
  c.dtype("loss", loss, {DType::f32});
  if (dlogits) {
    c.tensor("dlogits", *dlogits);
    c.shape("dlogits", *dlogits, logits.shape());
    c.same_dtype("dlogits", *dlogits, "logits", logits);
  }
  if (scale_by) {
    c.tensor("scale_by", *scale_by);
    c.shape("scale_by", *scale_by, {1});
    c.dtype("scale_by", *scale_by, {DType::f32});
  }
  run(c, shape_str(logits.shape()), 5.0 * double(logits.numel()), nbytes({&logits, dlogits}), logits.dtype(),
      [&] { c.dev->cross_entropy(logits, targets, loss, dlogits, ignore_index, scale, scale_by); });
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

namespace {

// The quantized table W (O, I) of quantized_matmul and quantized_embedding: packed codes, scales
// and biases checked against each other and against `act` (x or out: scales in its dtype or f32).
// Returns I.
int64_t check_quantized(Check& c, const Tensor& w, const Tensor& scales, const Tensor& biases, const char* act_name,
                        const Tensor& act, int64_t group_size, int64_t bits) {
  c.tensor("w", w), c.tensor("scales", scales), c.tensor("biases", biases);
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
    c.fail("bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  if (group_size != 16 && group_size != 32 && group_size != 64 && group_size != 128)
    c.fail("group_size must be 16, 32, 64 or 128, got " + std::to_string(group_size));
  c.floating(act_name, act);
  c.dtype("w", w, {DType::i32});
  if (w.dim() != 2 || (w.size(1) * 32) % bits)
    c.fail("w must be 2-D (O, I * bits / 32) of packed " + std::to_string(bits) + "-bit codes, got " + w.describe());
  const int64_t O = w.size(0), I = w.size(1) * 32 / bits, G = I / group_size;
  if (scales.dim() != 2 || scales.size(0) != O || scales.size(1) * group_size != I)
    c.fail("scales must be (" + std::to_string(O) + ", " + std::to_string(G) + ") for w " + w.describe() +
           " at " + std::to_string(bits) + " bits and group_size " + std::to_string(group_size) + ", got " +
           scales.describe());
  if (scales.dtype() != act.dtype() && scales.dtype() != DType::f32)
    c.fail("scales must be " + (act.dtype() == DType::f32 ? std::string("f32")
                                                         : std::string(dtype_name(act.dtype())) + " (" + act_name +
                                                               "'s dtype) or f32") +
           ", got " + scales.describe());
  c.shape("biases", biases, scales.shape()), c.same_dtype("biases", biases, "scales", scales);
  return I;
}

}  // namespace

void quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor& biases, const Tensor& out,
                      bool transpose, int64_t group_size, int64_t bits, float beta) {
  Check c{"quantized_matmul"};
  // x and out may be row-strided 2-D views (column blocks of a fused q|k|v projection).
  c.rows("x", x), c.rows("out", out);
  const int64_t I = check_quantized(c, w, scales, biases, "x", x, group_size, bits), O = w.size(0);
  if (x.dim() != 2) c.fail("x must be 2-D (N, I) or (N, O), got " + x.describe());
  const int64_t N = x.size(0), K = transpose ? I : O, M = transpose ? O : I;
  if (x.size(1) != K)
    c.fail("x must be (N, " + std::to_string(K) + ") for " + (transpose ? "out = x W^T" : "out = x W") + " with W (" +
           std::to_string(O) + ", " + std::to_string(I) + "), got " + x.describe());
  c.shape("out", out, {N, M}), c.same_dtype("out", out, "x", x);
  if (out.storage() == x.storage() && out.numel() > 0) c.fail("out must not share memory with x");
  run(c, shape_str(x.shape()) + (transpose ? " W^T " : " W ") + "(" + std::to_string(O) + ", " + std::to_string(I) +
             ") q" + std::to_string(bits) + "g" + std::to_string(group_size),
      2.0 * double(N) * double(O) * double(I), nbytes({&x, &w, &scales, &biases, &out}), x.dtype(),
      [&] { c.dev->quantized_matmul(x, w, scales, biases, out, transpose, group_size, bits, beta); });
}

void quantized_embedding(const Tensor& ids, const Tensor& w, const Tensor& scales, const Tensor& biases,
                         const Tensor& out, int64_t group_size, int64_t bits) {
  Check c{"quantized_embedding"};
  c.tensor("ids", ids), c.tensor("out", out);
  c.dtype("ids", ids, {DType::i32});
  const int64_t C = check_quantized(c, w, scales, biases, "out", out, group_size, bits);
  Shape want = ids.shape();
  want.push_back(C);
  c.shape("out", out, want);
  run(c, shape_str(out.shape()) + " q" + std::to_string(bits) + "g" + std::to_string(group_size), 0,
      2.0 * nbytes({&out}), out.dtype(), [&] { c.dev->quantized_embedding(ids, w, scales, biases, out, group_size, bits); });
}

void transpose_heads(const Tensor& x, const Tensor& out, const Tensor* positions, const Tensor* inv_freq,
                     int64_t rotate, float sign, int64_t heads_axis) {
  Check c{"transpose_heads"};
  c.tensor("x", x), c.tensor("out", out);
  if (x.dim() != 3) c.fail("x must be 3-D (A, B, D), got " + x.describe());
  c.shape("out", out, {x.size(1), x.size(0), x.size(2)});
  c.same_dtype("out", out, "x", x);
  if (x.storage() == out.storage() && x.numel() > 0) c.fail("out must not share memory with x");
  if (bool(positions) != bool(inv_freq)) c.fail("positions and inv_freq come together (RoPE on the way) or not at all");
  if (!positions) {
    if (rotate != 0) c.fail("rotate=" + std::to_string(rotate) + " needs positions and inv_freq");
  } else {
    c.tensor("positions", *positions), c.tensor("inv_freq", *inv_freq);
    c.floating("x", x);
    if (heads_axis != 0 && heads_axis != 1) c.fail("heads_axis must be 0 or 1, got " + std::to_string(heads_axis));
    const int64_t H = x.size(heads_axis), T = x.size(1 - heads_axis);
    c.shape("positions", *positions, {T});
    check_rope(c, *positions, *inv_freq, x.size(2), sign);
    if (rotate < 0 || rotate > H)
      c.fail("rotate must be in [0, " + std::to_string(H) + "] (the heads), got " + std::to_string(rotate));
  }
  const double flops = positions ? 6.0 * double(rotate) * double(x.numel() / x.size(heads_axis)) : 0.0;
  run(c, shape_str(x.shape()) + (rotate ? " rope " + std::to_string(rotate) : ""), flops, nbytes({&x, &out}),
      x.dtype(), [&] { c.dev->transpose_heads(x, out, positions, inv_freq, rotate, sign, heads_axis); });
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

void adamw_update(const AdamWArgs& a) {
  Check c{"adamw_update"};
  c.tensor("params", a.params), c.tensor("grads", a.grads), c.tensor("m", a.m), c.tensor("v", a.v);
  const int64_t n = a.params.numel();
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"params", &a.params}, {"grads", &a.grads}, {"m", &a.m}, {"v", &a.v}}) {
    c.dtype(name, *t, {DType::f32});
    c.numel(name, *t, n);
  }
  if (a.working.defined()) {
    c.tensor("working", a.working);
    c.floating("working", a.working);
    c.numel("working", a.working, n);
  }
  if (a.hyper.defined()) {
    c.tensor("hyper", a.hyper);
    c.shape("hyper", a.hyper, {5});
    c.dtype("hyper", a.hyper, {DType::f32});
    if (!a.sq.defined()) c.fail("sq is required with hyper (the global norm comes from it)");
  } else if (a.sq.defined() || a.flag.defined()) {
    c.fail(std::string(a.sq.defined() ? "sq" : "flag") + " is only read with hyper; pass hyper too");
  }
  if (a.sq.defined()) {
    c.tensor("sq", a.sq);
    c.shape("sq", a.sq, {1});
    c.dtype("sq", a.sq, {DType::f32});
  }
  if (a.flag.defined()) {
    c.tensor("flag", a.flag);
    c.shape("flag", a.flag, {1});
    c.dtype("flag", a.flag, {DType::i32});
  }
  if (!a.hyper.defined() && a.step < 1) c.fail("step is 1-based, got " + std::to_string(a.step));
  if (!(a.beta1 >= 0 && a.beta1 < 1) || !(a.beta2 >= 0 && a.beta2 < 1)) c.fail("betas must be in [0, 1)");
  if (!(a.eps > 0)) c.fail("eps must be > 0");
  run(c, "n=" + std::to_string(n), 16.0 * double(n), nbytes({&a.params, &a.grads, &a.m, &a.v}) * 1.75, DType::f32,
      [&] { c.dev->adamw_update(a); });
}

void sumsq(const Tensor& x, const Tensor& out) {
  Check c{"sumsq"};
  c.tensor("x", x), c.tensor("out", out);
  c.floating("x", x);
  c.numel("out", out, 1);
  c.dtype("out", out, {DType::f32});
  run(c, shape_str(x.shape()), 2.0 * double(x.numel()), nbytes({&x}), x.dtype(), [&] { c.dev->sumsq(x, out); });
}

void nonfinite(const Tensor& x, const Tensor& flag) {
  Check c{"nonfinite"};
  c.tensor("x", x), c.tensor("flag", flag);
  c.floating("x", x);
  c.numel("flag", flag, 1);
  c.dtype("flag", flag, {DType::i32});
  run(c, shape_str(x.shape()), double(x.numel()), nbytes({&x}), x.dtype(), [&] { c.dev->nonfinite(x, flag); });
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
