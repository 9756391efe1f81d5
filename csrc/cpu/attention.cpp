// RoPE, the materialised attention softmax, the reference fused attention (plain f32 loops) and
// the head transpose (which turns rows as RoPE does, with its tables) on the CPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "convert.h"
#include "cpu_backend.h"
#include "ops_common.h"
#include "vmath.h"

namespace krnl::cpu {

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
                                        int64_t window, const Tensor* sinks) {
  const int64_t Tq = S.size(-2), Tk = S.size(-1), rows = rows_of(S, Tk);
  if (rows == 0) return;
  const DType dt = S.dtype();
  const int32_t* seg = segments ? segments->ptr<int32_t>() : nullptr;
  const float* sink = sinks ? sinks->ptr<float>() : nullptr;  // (rows / Tq,): one per score matrix
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
      if (sink) m = std::max(m, sink[r / Tq] / scale);  // the unscaled sink joins the max, in S's units
      for (int64_t j = lo; j <= q; ++j) pr[j] = scale * (sr[j] - m);
      exp_inplace(pr + lo, q + 1 - lo);
      if (seg)
        for (int64_t j = lo; j < q; ++j)
          if (seg[j] != sq) pr[j] = 0.f;
      const float inv = 1.f / (sum(pr + lo, q + 1 - lo) + (sink ? std::exp(sink[r / Tq] - scale * m) : 0.f));
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
// (Hq, T), sinks (Hq,) or null; o starts at zero.
void attention_forward_f32(const float* qf, const float* kf, const float* vf, float* of, float* ls, int64_t Hq,
                           int64_t Hk, int64_t T, int64_t D, float scale, const AttentionMask& mask,
                           const float* sinks) {
  const int64_t g = Hq / Hk;
  for_rows(Hq * T, T * D, [&](int64_t r0, int64_t r1) {
    float* p = scratch(0, T);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r / T, i = r % T, kv = (h / g) * T * D, j0 = mask.first(i);
      const float* qi = &qf[r * D];
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = j0; j <= i; ++j)
        if (mask.sees(i, j)) m = std::max(m, p[j] = scale * dot(qi, &kf[kv + j * D], D));
      if (sinks) m = std::max(m, sinks[h]);  // the sink: a column of the softmax without a value
      float l = sinks ? std::exp(sinks[h] - m) : 0.f;
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
                                   const Tensor& lse, float scale, const Tensor* segments, int64_t window,
                                   const Tensor* sinks) {
  const bool tm = q.dim() == 4;
  const int64_t B = tm ? q.size(0) : 1, Hq = q.size(tm ? 2 : 0), Hk = k.size(tm ? 2 : 0), T = q.size(1), D = q.size(-1);
  const AttentionMask mask{segments ? segments->ptr<int32_t>() : nullptr, window};
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<float> qf = heads_f32(q, b), kf = heads_f32(k, b), vf = heads_f32(v, b);
    std::vector<float> of(qf.size());
    attention_forward_f32(qf.data(), kf.data(), vf.data(), of.data(), lse.ptr<float>() + b * Hq * T, Hq, Hk, T, D,
                          scale, mask, sinks ? sinks->ptr<float>() : nullptr);
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

// ---- head transpose

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

}  // namespace krnl::cpu
