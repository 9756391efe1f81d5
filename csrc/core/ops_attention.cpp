// The attention family's entry points: RoPE, the materialised attention softmax, fused
// attention (head-major or token-major) and the head transpose, which turns rows as RoPE does.
#include <string>

#include "ops_common.h"

namespace krnl::ops {

namespace {
// RoPE's arguments beside x (rope, transpose_heads): i32 positions, 1 to D/2 f32 frequencies, sign +-1.
void check_rope(Check& c, const Tensor& positions, const Tensor& inv_freq, int64_t D, float sign) {
  c.dtype("positions", positions, {DType::i32});
  c.dtype("inv_freq", inv_freq, {DType::f32});
  if (inv_freq.dim() != 1 || inv_freq.size(0) == 0 || 2 * inv_freq.size(0) > D)
    c.fail("inv_freq must be 1-D with 1 to D/2 = " + std::to_string(D / 2) + " entries, got " + inv_freq.describe());
  if (sign != 1.f && sign != -1.f) c.fail("sign must be +1 (forward) or -1 (backward), got " + std::to_string(sign));
}

// Attention sinks where given: one f32 logit per head (softmax_causal_forward: per score matrix).
void check_sinks(Check& c, const Tensor* sinks, int64_t heads) {
  if (!sinks) return;
  c.tensor("sinks", *sinks);
  c.dtype("sinks", *sinks, {DType::f32});
  c.shape("sinks", *sinks, {heads});
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

void softmax_causal_forward(const Tensor& S, const Tensor& P, float scale, const Tensor* segments, int64_t window,
                            const Tensor* sinks) {
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
  int64_t A = 1;  // score matrices: one sink each
  for (int64_t i = 0; i + 2 < S.dim(); ++i) A *= S.size(i);
  check_sinks(c, sinks, A);
  run(c, shape_str(S.shape()), 5.0 * double(S.numel()), nbytes({&S, &P, sinks}), S.dtype(),
      [&] { c.dev->softmax_causal_forward(S, P, scale, segments, window, sinks); });
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
                       float scale, const Tensor* segments, int64_t window, const Tensor* sinks) {
  Check c{"attention_forward"};
  const double flops = check_attention(c, q, k, v, o, lse, scale, segments, window);
  check_sinks(c, sinks, q.size(q.dim() == 4 ? 2 : 0));
  run(c, shape_str(q.shape()) + " kv " + shape_str(k.shape()) + (sinks ? " sinks" : ""), flops,
      nbytes({&q, &k, &v, &o, &lse, sinks}), q.dtype(),
      [&] { c.dev->attention_forward(q, k, v, o, lse, scale, segments, window, sinks); });
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

}  // namespace krnl::ops
