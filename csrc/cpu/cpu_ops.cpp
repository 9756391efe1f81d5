// CPU ops other than gemm: loops over the core's thread pool, computing in float on rows or
// blocks loaded and stored through convert.h, so each op is written once for every float dtype.
// Calls arrive validated (ops.cpp); only data-dependent errors (ids, targets) are raised here.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "blas.h"
#include "convert.h"
#include "core/ops.h"
#include "core/rng.h"
#include "cpu_backend.h"
#include "vmath.h"

namespace krnl::cpu {
namespace {

// Row count of a tensor seen as (rows, cols), cols being its last dimension.
inline int64_t rows_of(const Tensor& t, int64_t cols) { return cols ? t.numel() / cols : 0; }
}  // namespace

// ---- normalisation

void CpuBackend::rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, float eps,
                                 const Tensor* residual) {
  const int64_t C = x.size(-1), rows = rows_of(x, C);
  if (rows == 0) return;
  const DType xd = x.dtype(), yd = y.dtype();
  const int64_t ldy = y.row_stride();  // C, or a row-strided 2-D y's (ops.cpp)
  std::vector<float> wf(static_cast<size_t>(C));
  load(w.dtype(), w.data(), 0, C, wf.data());
  float* rs = rstd.ptr<float>();
  for_rows(rows, C, [&](int64_t r0, int64_t r1) {
    float* xs = scratch(0, C);
    float* ys = scratch(1, C);
    float* rsd = scratch(2, C);
    for (int64_t r = r0; r < r1; ++r) {
      if (residual) {  // x += residual, stored (rounded) and read back: the norm sees what add would leave
        float* xw = inout(xd, x.data(), r * C, C, xs);
        const float* rr = view(xd, residual->data(), r * C, C, rsd);
        for (int64_t c = 0; c < C; ++c) xw[c] += rr[c];
        flush(xd, xw, C, x.data(), r * C);
      }
      const float* xr = view(xd, x.data(), r * C, C, xs);
      const float inv = 1.f / std::sqrt(dot(xr, xr, C) / float(C) + eps);
      rs[r] = inv;
      float* yr = out_window(yd, y.data(), r * ldy, ys);
      for (int64_t c = 0; c < C; ++c) yr[c] = xr[c] * inv * wf[size_t(c)];
      flush(yd, yr, C, y.data(), r * ldy);
    }
  });
}

void CpuBackend::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                  const Tensor& dx, const Tensor* dw, const Tensor* residual) {
  const int64_t C = x.size(-1), rows = rows_of(x, C);
  if (rows == 0) return;
  std::vector<float> wf(static_cast<size_t>(C));
  load(w.dtype(), w.data(), 0, C, wf.data());
  const float* rs = rstd.ptr<float>();
  const DType dxd = dx.dtype();
  const int64_t ldx = dx.row_stride(), ldr = residual ? residual->row_stride() : C;  // row-strided views (ops.cpp)
  // dw: one partial per fixed row range, summed in range order (deterministic).
  const int64_t parts = num_parts(rows, C);
  std::vector<float> dwp(dw ? size_t(parts * C) : 0, 0.f);
  for_parts(rows, parts, [&](int64_t p, int64_t r0, int64_t r1) {
    float* xs = scratch(0, C);
    float* dys = scratch(1, C);
    float* g = scratch(2, C);
    float* dxs = scratch(3, C);
    float* rsd = scratch(4, C);
    float* acc = dw ? dwp.data() + p * C : nullptr;
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = view(x.dtype(), x.data(), r * C, C, xs);
      const float* dyr = view(dy.dtype(), dy.data(), r * C, C, dys);
      const float inv = rs[r];
      for (int64_t c = 0; c < C; ++c) g[c] = dyr[c] * wf[size_t(c)];
      const float m = dot(g, xr, C) * inv / float(C);  // mean(g * xhat)
      if (acc)
        for (int64_t c = 0; c < C; ++c) acc[c] += dyr[c] * (xr[c] * inv);
      float* dxr = out_window(dxd, dx.data(), r * ldx, dxs);  // written after dy is read
      for (int64_t c = 0; c < C; ++c) dxr[c] = inv * (g[c] - xr[c] * inv * m);
      if (residual) {  // rounded to dx's dtype first, then the residual added: what axpy would leave
        flush(dxd, dxr, C, dx.data(), r * ldx);
        dxr = inout(dxd, dx.data(), r * ldx, C, dxs);
        const float* rr = view(dxd, residual->data(), r * ldr, C, rsd);
        for (int64_t c = 0; c < C; ++c) dxr[c] += rr[c];
      }
      flush(dxd, dxr, C, dx.data(), r * ldx);
    }
  });
  if (!dw) return;
  float* dwd = dw->ptr<float>();
  for_blocks(C, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      float s = dwp[size_t(c)];
      for (int64_t p = 1; p < parts; ++p) s += dwp[size_t(p * C + c)];
      dwd[c] += s;
    }
  });
}

// ---- SwiGLU

// ---- gated MLPs: s = act(g) * u with act(x) = x sg(x), sg a sigmoid of some z(x) computed as
// 1 / (1 + e), e = exp(-z) from a bulk exp. SwiGLU: z = x (act = SiLU); GeGLU (Gemma): z = 2 k (x +
// a x^3), act the tanh-approximated GELU. Act gives e, and dg = d u act'(x) from x, e and sg.

namespace {
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

struct Silu {
  static void exps(const float* g, float* e, int64_t n) {
    for (int64_t i = 0; i < n; ++i) e[i] = -g[i];
    exp_inplace(e, n);
  }
  // d u act'(x), multiplied in this order (pinned results depend on it)
  static float dg(float d, float u, float x, float, float sg) { return d * u * sg * (1.f + x * (1.f - sg)); }
};

// sg = 1 / (1 + exp(-2 z)) = (1 + tanh z) / 2, so gelu_tanh(x) = x sg: 1 + tanh from the sigmoid
// keeps its relative accuracy for very negative x (1 + tanh would cancel there).
struct GeluTanh {
  static void exps(const float* g, float* e, int64_t n) {
    for (int64_t i = 0; i < n; ++i) e[i] = -2.f * kGeluK * (g[i] + kGeluA * g[i] * g[i] * g[i]);
    exp_inplace(e, n);
  }
  // gelu_tanh'(x) = (1 + t) / 2 + x (1 - t^2) k (1 + 3 a x^2) / 2 with 1 + t = 2 sg and
  // 1 - t^2 = 4 sg (1 - sg); 1 - sg as e sg where sg > 1/2, where 1 - sg would cancel.
  static float dg(float d, float u, float x, float e, float sg) {
    const float om = sg < 0.5f ? 1.f - sg : e * sg;
    return d * u * (sg + 2.f * x * sg * om * kGeluK * (1.f + 3.f * kGeluA * x * x));
  }
};

template <class Act>
void gated_forward(const Tensor& g, const Tensor& u, const Tensor& s) {
  const DType dt = g.dtype();
  for_blocks(g.numel(), [&](int64_t b, int64_t e) {
    float gs[kBlock], us[kBlock], ss[kBlock], t[kBlock];
    const int64_t n = e - b;
    const float* gv = view(dt, g.data(), b, n, gs);
    const float* uv = view(dt, u.data(), b, n, us);
    Act::exps(gv, t, n);
    float* sv = out_window(dt, s.data(), b, ss);
    for (int64_t i = 0; i < n; ++i) sv[i] = gv[i] / (1.f + t[i]) * uv[i];
    flush(dt, sv, n, s.data(), b);
  });
}

template <class Act>
void gated_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) {
  const DType dt = g.dtype();
  for_blocks(g.numel(), [&](int64_t b, int64_t e) {
    float dss[kBlock], gs[kBlock], us[kBlock], dgs[kBlock], dus[kBlock], t[kBlock];
    const int64_t n = e - b;
    const float* dv = view(dt, ds.data(), b, n, dss);
    const float* gv = view(dt, g.data(), b, n, gs);
    const float* uv = view(dt, u.data(), b, n, us);
    Act::exps(gv, t, n);
    float* dgv = out_window(dt, dg.data(), b, dgs);
    float* duv = out_window(dt, du.data(), b, dus);
    for (int64_t i = 0; i < n; ++i) {
      // All inputs read before either output is written: dg/du may alias ds.
      const float d = dv[i], x = gv[i], ui = uv[i], sg = 1.f / (1.f + t[i]);
      dgv[i] = Act::dg(d, ui, x, t[i], sg);
      duv[i] = d * x * sg;
    }
    flush(dt, dgv, n, dg.data(), b);
    flush(dt, duv, n, du.data(), b);
  });
}
}  // namespace

void CpuBackend::swiglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) { gated_forward<Silu>(g, u, s); }

void CpuBackend::swiglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg,
                                 const Tensor& du) {
  gated_backward<Silu>(ds, g, u, dg, du);
}

void CpuBackend::geglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) { gated_forward<GeluTanh>(g, u, s); }

void CpuBackend::geglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg,
                                const Tensor& du) {
  gated_backward<GeluTanh>(ds, g, u, dg, du);
}

// ---- soft-capping (Gemma 2's attention scores and logits)

// std::tanh: within an ulp everywhere, near 0 too, where capped small scores need relative accuracy.
void CpuBackend::softcap(const Tensor& x, float cap, const Tensor& out) {
  const DType dt = x.dtype();
  for_blocks(x.numel(), [&](int64_t b, int64_t e) {
    float xs[kBlock], os[kBlock];
    const int64_t n = e - b;
    const float* xv = view(dt, x.data(), b, n, xs);
    float* ov = out_window(dt, out.data(), b, os);  // may alias xv: element i read before written
    for (int64_t i = 0; i < n; ++i) ov[i] = cap * std::tanh(xv[i] / cap);
    flush(dt, ov, n, out.data(), b);
  });
}

void CpuBackend::softcap_backward(const Tensor& dy, const Tensor& y, float cap, const Tensor& dx) {
  const DType dt = y.dtype();
  for_blocks(y.numel(), [&](int64_t b, int64_t e) {
    float dys[kBlock], ys[kBlock], dxs[kBlock];
    const int64_t n = e - b;
    const float* dv = view(dt, dy.data(), b, n, dys);
    const float* yv = view(dt, y.data(), b, n, ys);
    float* dxv = out_window(dt, dx.data(), b, dxs);
    for (int64_t i = 0; i < n; ++i) {
      const float r = yv[i] / cap;  // tanh(x / cap): its derivative is 1 - tanh^2
      dxv[i] = dv[i] * (1.f - r * r);
    }
    flush(dt, dxv, n, dx.data(), b);
  });
}

// ---- RoPE

namespace {

// cos/sin tables (T, R) of sign * pos[t] * inv_freq[i], angles in double: positions reach 1e5+
// where float angles lose digits.
void rope_table(const int32_t* pos, const Tensor& inv_freq, float sign, int64_t T, std::vector<float>& cs,
                std::vector<float>& sn) {
  const int64_t R = inv_freq.numel();
  const float* invf = inv_freq.ptr<float>();
  cs.resize(size_t(T * R)), sn.resize(size_t(T * R));
  for_rows(T, 8 * R, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < R; ++i) {
        const double th = double(sign) * double(pos[t]) * double(invf[i]);
        cs[size_t(t * R + i)] = float(std::cos(th));
        sn[size_t(t * R + i)] = float(std::sin(th));
      }
  });
}

// rotate_half of one row's first 2R values by the table row (c, s).
inline void rope_row(float* xr, const float* c, const float* s, int64_t R) {
  for (int64_t i = 0; i < R; ++i) {
    const float a = xr[i], b = xr[i + R];
    xr[i] = a * c[i] - b * s[i];
    xr[i + R] = b * c[i] + a * s[i];
  }
}

}  // namespace

void CpuBackend::rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float sign, bool token_major) {
  const DType dt = x.dtype();
  std::vector<float> cs, sn;
  if (token_major) {  // x (B, T, H, D) view: row (b, t, h) at its strides, positions (B, T) or shared (T,)
    const int64_t B = x.size(0), T = x.size(1), H = x.size(2), R = inv_freq.numel();
    const Shape& st = x.strides();
    const bool shared = positions.dim() == 1;
    rope_table(positions.ptr<int32_t>(), inv_freq, sign, shared ? T : B * T, cs, sn);
    for_rows(B * T * H, 2 * R, [&](int64_t r0, int64_t r1) {
      float* xs = scratch(0, 2 * R);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t bt = r / H, h = r % H, b = bt / T, t = bt % T, o = b * st[0] + t * st[1] + h * st[2];
        const int64_t row = (shared ? t : bt) * R;
        float* xr = inout(dt, x.data(), o, 2 * R, xs);
        rope_row(xr, cs.data() + row, sn.data() + row, R);
        flush(dt, xr, 2 * R, x.data(), o);
      }
    });
    return;
  }
  const int64_t T = x.size(-2), D = x.size(-1), R = inv_freq.numel(), rows = rows_of(x, D);
  if (rows == 0 || T == 0) return;
  rope_table(positions.ptr<int32_t>(), inv_freq, sign, T, cs, sn);
  for_rows(rows, 2 * R, [&](int64_t r0, int64_t r1) {
    float* xs = scratch(0, 2 * R);
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = inout(dt, x.data(), r * D, 2 * R, xs);  // dims >= 2R are never touched
      rope_row(xr, cs.data() + (r % T) * R, sn.data() + (r % T) * R, R);
      flush(dt, xr, 2 * R, x.data(), r * D);
    }
  });
}

// ---- attention softmax

void CpuBackend::softmax_causal_forward(const Tensor& S, const Tensor& P, float scale, const Tensor* segments,
                                        int64_t window) {
  const int64_t Tq = S.size(-2), Tk = S.size(-1), rows = rows_of(S, Tk);
  if (rows == 0) return;
  const DType dt = S.dtype();
  const int32_t* seg = segments ? segments->ptr<int32_t>() : nullptr;
  for_rows(rows, Tk, [&](int64_t r0, int64_t r1) {
    float* ss = scratch(0, Tk);
    float* ps = scratch(1, Tk);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t q = r % Tq + (Tk - Tq);  // absolute position of the query; keys j <= q
      const int64_t lo = window > 0 ? std::max<int64_t>(0, q - window + 1) : 0;  // and j >= lo
      const float* sr = view(dt, S.data(), r * Tk, q + 1, ss);
      float* pr = out_window(dt, P.data(), r * Tk, ps);  // may alias sr: read-before-write per j
      const int32_t sq = seg ? seg[q] : 0;
      float m = sr[q];  // the diagonal is always visible: no -inf seed needed
      if (!seg) {
        for (int64_t j = lo; j < q; ++j) m = std::max(m, sr[j]);
      } else {
        for (int64_t j = lo; j < q; ++j)
          if (seg[j] == sq) m = std::max(m, sr[j]);
      }
      for (int64_t j = lo; j <= q; ++j) pr[j] = scale * (sr[j] - m);
      exp_inplace(pr + lo, q + 1 - lo);
      if (seg)
        for (int64_t j = lo; j < q; ++j)
          if (seg[j] != sq) pr[j] = 0.f;
      const float inv = 1.f / sum(pr + lo, q + 1 - lo);
      for (int64_t j = lo; j <= q; ++j) pr[j] *= inv;
      for (int64_t j = 0; j < lo; ++j) pr[j] = 0.f;  // after the reads above: pr may alias sr
      for (int64_t j = q + 1; j < Tk; ++j) pr[j] = 0.f;
      flush(dt, pr, Tk, P.data(), r * Tk);
    }
  });
}

void CpuBackend::softmax_backward(const Tensor& P, const Tensor& dP, const Tensor& dS, float scale) {
  const int64_t L = P.dim() ? P.size(-1) : 1, rows = rows_of(P, L);
  if (rows == 0) return;
  const DType dt = P.dtype();
  for_rows(rows, L, [&](int64_t r0, int64_t r1) {
    float* ps = scratch(0, L);
    float* ds = scratch(1, L);
    float* os = scratch(2, L);
    for (int64_t r = r0; r < r1; ++r) {
      const float* p = view(dt, P.data(), r * L, L, ps);
      const float* d = view(dt, dP.data(), r * L, L, ds);
      const float pd = dot(p, d, L);  // read fully before dS (which may alias dP) is written
      float* o = out_window(dt, dS.data(), r * L, os);
      for (int64_t j = 0; j < L; ++j) o[j] = p[j] * (d[j] - pd) * scale;
      flush(dt, o, L, dS.data(), r * L);
    }
  });
}

namespace {
std::vector<float> to_f32(const Tensor& x) {
  std::vector<float> f(size_t(x.numel()));
  load_all(x.dtype(), x.data(), 0, x.numel(), f.data());
  return f;
}

// The keys query i sees (op_list.h): j in [first(i), i] with the same segment.
struct AttentionMask {
  const int32_t* seg;  // (T,) or null
  int64_t window;      // 0: none
  int64_t first(int64_t i) const { return window > 0 ? std::max<int64_t>(0, i - window + 1) : 0; }
  bool sees(int64_t i, int64_t j) const { return !seg || seg[i] == seg[j]; }
};
}  // namespace

namespace {

// One sequence's attention over head-major f32 arrays: q, o (Hq, T, D), k, v (Hk, T, D), lse
// (Hq, T); o starts at zero.
void attention_forward_f32(const float* qf, const float* kf, const float* vf, float* of, float* ls, int64_t Hq,
                           int64_t Hk, int64_t T, int64_t D, float scale, const AttentionMask& mask) {
  const int64_t g = Hq / Hk;
  for_rows(Hq * T, T * D, [&](int64_t r0, int64_t r1) {
    float* p = scratch(0, T);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r / T, i = r % T, kv = (h / g) * T * D, j0 = mask.first(i);
      const float* qi = &qf[r * D];
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = j0; j <= i; ++j)
        if (mask.sees(i, j)) m = std::max(m, p[j] = scale * dot(qi, &kf[kv + j * D], D));
      float l = 0.f;
      for (int64_t j = j0; j <= i; ++j) l += (p[j] = mask.sees(i, j) ? std::exp(p[j] - m) : 0.f);
      float* oi = &of[r * D];
      for (int64_t j = j0; j <= i; ++j)
        for (int64_t d = 0; d < D; ++d) oi[d] += p[j] * vf[kv + j * D + d];
      for (int64_t d = 0; d < D; ++d) oi[d] /= l;
      ls[r] = m + std::log(l);
    }
  });
}

// Its backward: dq, dk, dv (zeroed) from dout (Hq, T, D) and the forward's o and lse.
void attention_backward_f32(const float* qf, const float* kf, const float* vf, const float* of, const float* df,
                            const float* ls, float* dqf, float* dkf, float* dvf, int64_t Hq, int64_t Hk, int64_t T,
                            int64_t D, float scale, const AttentionMask& mask) {
  const int64_t g = Hq / Hk;
  // One task per KV head: it owns that head's dk/dv rows and its g query heads' dq rows.
  ThreadPool::global().parallel_for(Hk, 1, [&](int64_t k0, int64_t k1) {
    float* ds = scratch(0, T);
    for (int64_t kh = k0; kh < k1; ++kh)
      for (int64_t h = kh * g; h < (kh + 1) * g; ++h)
        for (int64_t i = 0; i < T; ++i) {
          const int64_t r = h * T + i, kv = kh * T * D, j0 = mask.first(i);
          const float* qi = &qf[r * D];
          const float* doi = &df[r * D];
          const float Di = dot(doi, &of[r * D], D);  // rowsum(dP * P) = dO . O
          for (int64_t j = j0; j <= i; ++j) {
            if (!mask.sees(i, j)) {
              ds[j] = 0.f;
              continue;
            }
            const float p = std::exp(scale * dot(qi, &kf[kv + j * D], D) - ls[r]);
            ds[j] = p * (dot(doi, &vf[kv + j * D], D) - Di) * scale;
            for (int64_t d = 0; d < D; ++d) dvf[kv + j * D + d] += p * doi[d];
          }
          float* dqi = &dqf[r * D];
          for (int64_t j = j0; j <= i; ++j)
            for (int64_t d = 0; d < D; ++d) {
              dqi[d] += ds[j] * kf[kv + j * D + d];
              dkf[kv + j * D + d] += ds[j] * qi[d];
            }
        }
  });
}

// Sequence b of an attention operand as head-major (H, T, D) f32: a 3-D tensor is one sequence
// already; a token-major (B, T, H, D) view is gathered row by row at its strides.
std::vector<float> heads_f32(const Tensor& x, int64_t b) {
  if (x.dim() == 3) return to_f32(x);
  const int64_t T = x.size(1), H = x.size(2), D = x.size(3);
  const Shape& st = x.strides();
  std::vector<float> f(size_t(H * T * D));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t) load(x.dtype(), x.data(), b * st[0] + t * st[1] + h * st[2], D, &f[(h * T + t) * D]);
  return f;
}

// The inverse: head-major f32 rows into sequence b of x.
void store_heads(const std::vector<float>& f, const Tensor& x, int64_t b) {
  if (x.dim() == 3) return store_all(x.dtype(), f.data(), x.numel(), x.data(), 0);
  const int64_t T = x.size(1), H = x.size(2), D = x.size(3);
  const Shape& st = x.strides();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t) store(x.dtype(), &f[(h * T + t) * D], D, x.data(), b * st[0] + t * st[1] + h * st[2]);
}

}  // namespace

// 3-D operands are one head-major sequence; 4-D ones token-major views of B sequences, each
// gathered head-major, attended and scattered back.
void CpuBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                   const Tensor& lse, float scale, const Tensor* segments, int64_t window) {
  const bool tm = q.dim() == 4;
  const int64_t B = tm ? q.size(0) : 1, Hq = q.size(tm ? 2 : 0), Hk = k.size(tm ? 2 : 0), T = q.size(1), D = q.size(-1);
  const AttentionMask mask{segments ? segments->ptr<int32_t>() : nullptr, window};
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<float> qf = heads_f32(q, b), kf = heads_f32(k, b), vf = heads_f32(v, b);
    std::vector<float> of(qf.size());
    attention_forward_f32(qf.data(), kf.data(), vf.data(), of.data(), lse.ptr<float>() + b * Hq * T, Hq, Hk, T, D,
                          scale, mask);
    store_heads(of, o, b);
  }
}

void CpuBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                    const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                    const Tensor& dv, float scale, const Tensor* segments, int64_t window) {
  const bool tm = q.dim() == 4;
  const int64_t B = tm ? q.size(0) : 1, Hq = q.size(tm ? 2 : 0), Hk = k.size(tm ? 2 : 0), T = q.size(1), D = q.size(-1);
  const AttentionMask mask{segments ? segments->ptr<int32_t>() : nullptr, window};
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<float> qf = heads_f32(q, b), kf = heads_f32(k, b), vf = heads_f32(v, b), of = heads_f32(o, b),
                             df = heads_f32(dout, b);
    std::vector<float> dqf(qf.size()), dkf(kf.size()), dvf(vf.size());
    attention_backward_f32(qf.data(), kf.data(), vf.data(), of.data(), df.data(), lse.ptr<float>() + b * Hq * T,
                           dqf.data(), dkf.data(), dvf.data(), Hq, Hk, T, D, scale, mask);
    store_heads(dqf, dq, b), store_heads(dkf, dk, b), store_heads(dvf, dv, b);
  }
}

// ---- embedding

void CpuBackend::embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out) {
  const int64_t V = table.size(0), C = table.size(1), n = ids.numel();
  ops::check_ids("embedding_forward", "id", "position", ids.ptr<int32_t>(), n, V);
  const int32_t* id = ids.ptr<int32_t>();
  const size_t row_bytes = size_t(C) * dtype_size(table.dtype());
  const char* src = static_cast<const char*>(table.data());
  char* dst = static_cast<char*>(out.data());
  for_rows(n, C, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) std::memcpy(dst + size_t(t) * row_bytes, src + size_t(id[t]) * row_bytes, row_bytes);
  });
}

void CpuBackend::embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  const int64_t V = dtable.size(0), C = dtable.size(1), n = ids.numel();
  ops::check_ids("embedding_backward", "id", "position", ids.ptr<int32_t>(), n, V);
  if (n == 0 || C == 0) return;
  const int32_t* id = ids.ptr<int32_t>();
  float* tab = dtable.ptr<float>();
  const DType dt = dout.dtype();
  // Threads own column ranges and walk tokens in order: no races on repeated ids, and each
  // element sums in token order as a serial loop would.
  const int64_t grain = std::max<int64_t>(64, kGrainElems / n);
  ThreadPool::global().parallel_for(C, grain, [&](int64_t c0, int64_t c1) {
    float* buf = scratch(0, c1 - c0);
    for (int64_t t = 0; t < n; ++t) {
      const float* g = view(dt, dout.data(), t * C + c0, c1 - c0, buf);
      float* row = tab + int64_t(id[t]) * C + c0;
      for (int64_t c = 0; c < c1 - c0; ++c) row[c] += g[c];
    }
  });
}

// ---- loss

void CpuBackend::cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& loss,
                               const Tensor* dlogits, int32_t ignore_index, float scale, const Tensor* scale_by) {
  const int64_t T = logits.size(0), V = logits.size(1);
  if (scale_by) scale = scale * scale_by->ptr<float>()[0];  // the factor formed once, in f32
  ops::check_ids("cross_entropy", "target", "row", targets.ptr<int32_t>(), T, V, &ignore_index);
  const int32_t* tg = targets.ptr<int32_t>();
  float* lo = loss.ptr<float>();
  const DType dt = logits.dtype();
  for_rows(T, V, [&](int64_t t0, int64_t t1) {
    float* buf = scratch(0, V);
    for (int64_t t = t0; t < t1; ++t) {
      const int32_t y = tg[t];
      if (y == ignore_index) {
        lo[t] = 0.f;
        if (dlogits) std::memset(at(dt, dlogits->data(), t * V), 0, size_t(V) * dtype_size(dt));  // +0 is all-zero bits
        continue;
      }
      const float* xr = view(dt, logits.data(), t * V, V, buf);
      float mx, se;
      max_sumexp(xr, V, mx, se);  // one pass, online max and sum-exp
      const float xt = xr[y];     // read before dlogits (which may alias logits) is written
      lo[t] = mx + std::log(se) - xt;
      if (!dlogits) continue;
      const float inv = 1.f / se;
      float* o = out_window(dt, dlogits->data(), t * V, buf);  // same scratch: elementwise in place
      for (int64_t j = 0; j < V; ++j) o[j] = xr[j] - mx;
      exp_inplace(o, V);
      const float ey = o[y];
      for (int64_t j = 0; j < V; ++j) o[j] = scale * (o[j] * inv);
      o[y] = scale * (ey * inv - 1.f);
      flush(dt, o, V, dlogits->data(), t * V);
    }
  });
}

// ---- elementwise

void CpuBackend::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  const DType dt = a.dtype();
  for_blocks(a.numel(), [&](int64_t i0, int64_t i1) {
    float as[kBlock], bs[kBlock], os[kBlock];
    const int64_t n = i1 - i0;
    const float* av = view(dt, a.data(), i0, n, as);
    const float* bv = view(dt, b.data(), i0, n, bs);
    float* o = out_window(dt, out.data(), i0, os);
    for (int64_t i = 0; i < n; ++i) o[i] = av[i] + bv[i];
    flush(dt, o, n, out.data(), i0);
  });
}

void CpuBackend::axpy(float alpha, const Tensor& x, const Tensor& y) {
  for_blocks(x.numel(), [&](int64_t i0, int64_t i1) {
    float xs[kBlock], ys[kBlock];
    const int64_t n = i1 - i0;
    const float* xv = view(x.dtype(), x.data(), i0, n, xs);
    float* yv = inout(y.dtype(), y.data(), i0, n, ys);
    for (int64_t i = 0; i < n; ++i) yv[i] += alpha * xv[i];
    flush(y.dtype(), yv, n, y.data(), i0);
  });
}

void CpuBackend::scale(const Tensor& x, float alpha, const Tensor& out) {
  const DType dt = x.dtype();
  for_blocks(x.numel(), [&](int64_t i0, int64_t i1) {
    float xs[kBlock], os[kBlock];
    const int64_t n = i1 - i0;
    const float* xv = view(dt, x.data(), i0, n, xs);
    float* o = out_window(dt, out.data(), i0, os);
    for (int64_t i = 0; i < n; ++i) o[i] = alpha * xv[i];
    flush(dt, o, n, out.data(), i0);
  });
}

void CpuBackend::cast(const Tensor& x, const Tensor& out) {
  if (x.dtype() == out.dtype()) {  // plain copy, i32 included; memmove: out may be x itself
    const size_t es = dtype_size(x.dtype());
    for_blocks(x.numel(), [&](int64_t i0, int64_t i1) {
      std::memmove(static_cast<char*>(out.data()) + size_t(i0) * es,
                   static_cast<const char*>(x.data()) + size_t(i0) * es, size_t(i1 - i0) * es);
    });
    return;
  }
  for_blocks(x.numel(), [&](int64_t i0, int64_t i1) {
    float xs[kBlock];
    const float* xv = view(x.dtype(), x.data(), i0, i1 - i0, xs);
    store(out.dtype(), xv, i1 - i0, out.data(), i0);
  });
}

namespace {
template <class T>
void fill_as(const Tensor& x, T v) {
  T* p = x.ptr<T>();
  for_blocks(x.numel(), [&](int64_t i0, int64_t i1) { std::fill(p + i0, p + i1, v); });
}
}  // namespace

// ---- quantized matmul: W dequantized a tile of rows at a time into f32, each tile one sgemm

void CpuBackend::quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor& biases,
                                  const Tensor& out, bool transpose, int64_t group_size, int64_t bits, float beta) {
  const int64_t N = x.size(0), O = w.size(0), words = w.size(1), I = words * 32 / bits, G = I / group_size;
  const int64_t M = transpose ? O : I, K = transpose ? I : O;
  const int64_t ldx = x.strides()[0], ldo = out.strides()[0];  // row strides: x and out may be column blocks
  if (N == 0 || M == 0) return;
  constexpr int64_t kTile = 256;  // rows of W per dequantized tile: (256, I) f32, a few MB at most
  std::vector<float> xf(size_t(N * K)), of(size_t(N * M)), sf(size_t(O * G)), bf(size_t(O * G));
  for (int64_t n = 0; n < N; ++n) load_all(x.dtype(), x.data(), n * ldx, K, &xf[size_t(n * K)]);
  load_all(scales.dtype(), scales.data(), 0, O * G, sf.data());
  load_all(biases.dtype(), biases.data(), 0, O * G, bf.data());
  if (beta != 0.f) {
    for (int64_t n = 0; n < N; ++n) load_all(out.dtype(), out.data(), n * ldo, M, &of[size_t(n * M)]);
    for (float& v : of) v *= beta;
  }
  const uint32_t* codes = static_cast<const uint32_t*>(w.data());
  const uint32_t mask = (1u << bits) - 1u;
  std::vector<float> tile(size_t(std::min(kTile, O) * I));
  for (int64_t o0 = 0; o0 < O; o0 += kTile) {
    const int64_t rows = std::min(kTile, O - o0);
    ThreadPool::global().parallel_for(rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const uint32_t* wr = codes + (o0 + r) * words;
        const float* s = &sf[size_t((o0 + r) * G)];
        const float* b = &bf[size_t((o0 + r) * G)];
        float* t = &tile[size_t(r * I)];
        for (int64_t j = 0; j < I; ++j) {
          // The row's codes are one bit stream: a code may straddle two words (3, 5, 6 bits).
          const int64_t bit = j * bits, wi = bit >> 5, sh = bit & 31;
          uint32_t q = wr[wi] >> sh;
          if (sh + bits > 32) q |= wr[wi + 1] << (32 - sh);
          t[j] = s[j / group_size] * float(q & mask) + b[j / group_size];
        }
      }
    });
    if (transpose)  // out[:, o0:o0+rows] (+)= x (N, I) tile^T
      sgemm(false, true, N, rows, I, 1.f, xf.data(), I, tile.data(), I, beta != 0.f ? 1.f : 0.f, &of[size_t(o0)], O);
    else            // out (N, I) += x[:, o0:o0+rows] tile
      sgemm(false, false, N, I, rows, 1.f, &xf[size_t(o0)], O, tile.data(), I, o0 > 0 || beta != 0.f ? 1.f : 0.f,
            of.data(), I);
  }
  for (int64_t n = 0; n < N; ++n) store_all(out.dtype(), &of[size_t(n * M)], M, out.data(), n * ldo);
}

void CpuBackend::quantized_embedding(const Tensor& ids, const Tensor& w, const Tensor& scales, const Tensor& biases,
                                     const Tensor& out, int64_t group_size, int64_t bits) {
  const int64_t V = w.size(0), words = w.size(1), C = words * 32 / bits, G = C / group_size, n = ids.numel();
  ops::check_ids("quantized_embedding", "id", "position", ids.ptr<int32_t>(), n, V);
  const int32_t* id = ids.ptr<int32_t>();
  const uint32_t* codes = static_cast<const uint32_t*>(w.data());
  const uint32_t mask = (1u << bits) - 1u;
  for_rows(n, C, [&](int64_t t0, int64_t t1) {
    std::vector<float> row(static_cast<size_t>(C)), s(static_cast<size_t>(G)), b(static_cast<size_t>(G));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t v = id[t];
      load_all(scales.dtype(), scales.data(), v * G, G, s.data());
      load_all(biases.dtype(), biases.data(), v * G, G, b.data());
      const uint32_t* wr = codes + v * words;
      for (int64_t j = 0; j < C; ++j) {
        const int64_t bit = j * bits, wi = bit >> 5, sh = bit & 31;
        uint32_t q = wr[wi] >> sh;
        if (sh + bits > 32) q |= wr[wi + 1] << (32 - sh);
        row[size_t(j)] = s[size_t(j / group_size)] * float(q & mask) + b[size_t(j / group_size)];
      }
      store_all(out.dtype(), row.data(), C, out.data(), t * C);
    }
  });
}

void CpuBackend::transpose_heads(const Tensor& x, const Tensor& out, const Tensor* positions, const Tensor* inv_freq,
                                 int64_t rotate, float sign, int64_t heads_axis) {
  // Rows of D elements move as whole; the dtype only sets the row's byte size. Rotated rows then
  // turn in place at their destination, as `rope` turns them.
  const int64_t A = x.size(0), B = x.size(1), D = x.size(2), R = inv_freq ? inv_freq->numel() : 0;
  const size_t row = size_t(D) * dtype_size(x.dtype());
  const char* src = static_cast<const char*>(x.data());
  char* dst = static_cast<char*>(out.data());
  std::vector<float> cs, sn;
  if (rotate > 0) rope_table(positions->ptr<int32_t>(), *inv_freq, sign, heads_axis == 1 ? A : B, cs, sn);
  const DType dt = x.dtype();
  for_rows(A * B, D, [&](int64_t r0, int64_t r1) {
    float* xs = rotate > 0 ? scratch(0, 2 * R) : nullptr;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t a = r / B, b = r % B, o = (b * A + a) * int64_t(D);
      std::memcpy(dst + size_t(b * A + a) * row, src + size_t(r) * row, row);
      const int64_t h = heads_axis == 1 ? b : a, t = heads_axis == 1 ? a : b;
      if (h >= rotate) continue;
      float* xr = inout(dt, out.data(), o, 2 * R, xs);
      rope_row(xr, cs.data() + t * R, sn.data() + t * R, R);
      flush(dt, xr, 2 * R, out.data(), o);
    }
  });
}

void CpuBackend::fill(const Tensor& x, double value) {
  switch (x.dtype()) {
    case DType::f32: fill_as<float>(x, float(value)); break;
    case DType::f16: fill_as<uint16_t>(x, f32_to_f16(float(value))); break;
    case DType::bf16: fill_as<uint16_t>(x, f32_to_bf16(float(value))); break;
    case DType::i32: {
      // Saturate instead of the undefined out-of-range conversion; NaN gives 0.
      double v = std::isnan(value) ? 0.0 : value;
      v = std::min<double>(std::max<double>(v, std::numeric_limits<int32_t>::min()), std::numeric_limits<int32_t>::max());
      fill_as<int32_t>(x, int32_t(v));
      break;
    }
  }
}

void CpuBackend::dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, const Tensor* seed_offset) {
  if (p == 0.f) {
    cast(x, out);  // same dtype: a copy
    return;
  }
  uint64_t base = 0;  // the flat index of x's first element in the rows it is a slice of
  if (seed_offset) {
    const int32_t* off = seed_offset->ptr<int32_t>();
    seed = dropout_seed(seed, uint32_t(off[0]), uint32_t(off[1]));
    if (seed_offset->numel() == 3) base = dropout_base(uint32_t(off[2]), x.shape().empty() ? 1 : x.shape().back());
  }
  const DType dt = x.dtype();
  const float keep_scale = 1.f / (1.f - p);
  for_blocks(x.numel(), [&](int64_t i0, int64_t i1) {
    float xs[kBlock], os[kBlock];
    const int64_t n = i1 - i0;
    const float* xv = view(dt, x.data(), i0, n, xs);
    float* o = out_window(dt, out.data(), i0, os);
    for (int64_t i = 0; i < n; ++i) o[i] = dropout_keep(seed, base + uint64_t(i0 + i), p) ? xv[i] * keep_scale : 0.f;
    flush(dt, o, n, out.data(), i0);
  });
}

// ---- optimizer

namespace {

struct AdamwDeviceScalars {
  bool skip;         // a non-finite step: nothing is written
  float grad_scale;  // clip * inv_denom
};

// adamw_update's scalars from its device tensors (op_list.h), in f32 and in the contract's order.
AdamwDeviceScalars adamw_device_scalars(const float* hyper, float sq, const int32_t* flag) {
  uint32_t bits;
  std::memcpy(&bits, &sq, 4);
  if ((flag && flag[0] != 0) || (bits & 0x7f800000u) == 0x7f800000u) return {true, 0.f};  // inf/NaN by its bits
  const float inv_denom = hyper[3], max_norm = hyper[4];
  const float norm = std::sqrt(sq) * inv_denom;
  const float clip = max_norm > 0.f ? std::min(1.f, max_norm / (norm + 1e-6f)) : 1.f;
  return {false, clip * inv_denom};
}

}  // namespace

void CpuBackend::adamw_update(const AdamWArgs& a) {
  float* p = a.params.ptr<float>();
  const float* g = a.grads.ptr<float>();
  float* m = a.m.ptr<float>();
  float* v = a.v.ptr<float>();
  const bool working = a.working.defined();
  const double bc1 = 1.0 - std::pow(double(a.beta1), double(a.step));
  const double bc2 = 1.0 - std::pow(double(a.beta2), double(a.step));
  float step_size = float(double(a.lr) / bc1), bc2_sqrt = float(std::sqrt(bc2));
  float decay = a.lr * a.weight_decay, gs = a.grad_scale;
  const float b1 = a.beta1, b2 = a.beta2, eps = a.eps;
  if (a.hyper.defined()) {
    const float* h = a.hyper.ptr<float>();
    const int32_t* flag = a.flag.defined() ? a.flag.ptr<int32_t>() : nullptr;
    const AdamwDeviceScalars d = adamw_device_scalars(h, a.sq.ptr<float>()[0], flag);
    if (d.skip) return;  // a non-finite step: params, m, v and working stay as they are
    step_size = h[0], bc2_sqrt = h[1], decay = h[2], gs = d.grad_scale;
  }
  for_blocks(a.params.numel(), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float gi = g[i] * gs;
      float pi = p[i];
      pi -= decay * pi;
      const float mi = b1 * m[i] + (1.f - b1) * gi;
      const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
      pi -= step_size * (mi / (std::sqrt(vi) / bc2_sqrt + eps));
      m[i] = mi, v[i] = vi, p[i] = pi;
    }
    if (working) store(a.working.dtype(), p + i0, i1 - i0, a.working.data(), i0);
  });
}

void CpuBackend::sumsq(const Tensor& x, const Tensor& out) {
  const int64_t n = x.numel(), parts = num_parts(n);
  const DType dt = x.dtype();
  std::vector<double> partial(size_t(parts), 0.0);
  for_parts(n, parts, [&](int64_t part, int64_t b, int64_t e) {
    double acc[4] = {0, 0, 0, 0};
    float xs[kBlock];
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      const int64_t k = std::min(kBlock, e - i0);
      const float* xv = view(dt, x.data(), i0, k, xs);
      for (int64_t i = 0; i < k; ++i) acc[i & 3] += double(xv[i]) * double(xv[i]);
    }
    partial[size_t(part)] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  });
  double total = 0;
  for (double s : partial) total += s;
  out.ptr<float>()[0] = float(total);
}

void CpuBackend::nonfinite(const Tensor& x, const Tensor& flag) {
  std::atomic<bool> found{false};
  const DType dt = x.dtype();
  // Exponent all ones = inf or NaN; tested on the raw bits, no conversion needed.
  for_blocks(x.numel(), [&](int64_t i0, int64_t i1) {
    if (found.load(std::memory_order_relaxed)) return;
    bool bad = false;
    if (dt == DType::f32) {
      const uint32_t* p = x.ptr<uint32_t>();
      for (int64_t i = i0; i < i1; ++i) bad |= (p[i] & 0x7f800000u) == 0x7f800000u;
    } else {
      const uint16_t* p = x.ptr<uint16_t>();
      const uint16_t e = dt == DType::f16 ? 0x7c00 : 0x7f80;
      for (int64_t i = i0; i < i1; ++i) bad |= (p[i] & e) == e;
    }
    if (bad) found.store(true, std::memory_order_relaxed);
  });
  if (found.load()) flag.ptr<int32_t>()[0] = 1;
}

}  // namespace krnl::cpu
