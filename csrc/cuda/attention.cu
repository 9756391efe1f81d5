// RoPE and the materialised attention softmax (docs/architecture.md, 'Attention'), one block per score row.
#include <type_traits>

#include "common.cuh"

namespace krnl::cuda {
namespace {

// cos/sin table (T, R) of sign * pos[t] * inv_freq[i], angles in double: positions reach 1e5+
// where float angles lose digits (same choice as the CPU backend).
__global__ void rope_table_kernel(const int32_t* pos, const float* invf, float sign, int64_t T, int64_t R, float* cs,
                                  float* sn) {
  const int64_t n = T * R;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = k / R, i = k % R;
    const double th = double(sign) * double(pos[t]) * double(invf[i]);
    double s, c;
    sincos(th, &s, &c);
    cs[k] = float(c);
    sn[k] = float(s);
  }
}

// rotate_half of V pairs (lo[e], hi[e]) by the table entries c[e], s[e] (every rope kernel's
// arithmetic, so that they agree bit for bit).
template <int V>
__device__ __forceinline__ void rotate_pairs(float* lo, float* hi, const float* c, const float* s) {
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const float a = lo[e];
    lo[e] = a * c[e] - hi[e] * s[e];
    hi[e] = hi[e] * c[e] + a * s[e];
  }
}

// V consecutive elements of p from i: a 16-byte vector when VEC, else one element.
template <bool VEC, bool W16>
__device__ __forceinline__ void load_n(DType dt, const void* p, int64_t i, float* v) {
  if constexpr (VEC)
    load_vec<W16>(dt, p, i, v);
  else
    v[0] = ld(dt, p, i);
}

template <bool VEC, bool W16>
__device__ __forceinline__ void store_n(DType dt, void* p, int64_t i, const float* v) {
  if constexpr (VEC)
    store_vec<W16>(dt, p, i, v);
  else
    st(dt, p, i, v[0]);
}

// Rotate-half on the first 2R dims of each row of D (row r is position r % T); dims >= 2R stay.
template <class I>
__global__ void rope_apply_kernel(DType dt, void* x, I rows, I T, I D, I R, const float* cs, const float* sn) {
  const I n = rows * R;
  for (I k = blockIdx.x * I(blockDim.x) + threadIdx.x; k < n; k += I(gridDim.x) * blockDim.x) {
    const I r = k / R, i = k % R, t = r % T;
    const float c = cs[t * R + i], s = sn[t * R + i];
    const I o = r * D + i;
    const float a = ld(dt, x, o), b = ld(dt, x, o + R);
    st(dt, x, o, a * c - b * s);
    st(dt, x, o + R, b * c + a * s);
  }
}

// The same with VEC consecutive rotation indices per work item, as 16-byte vectors of both
// halves (R a multiple of the vector, rows 16-byte aligned).
template <class I, bool W16>
__global__ void rope_apply_vec_kernel(DType dt, void* x, I rows, I T, I D, I R, const float* cs, const float* sn) {
  constexpr int VEC = W16 ? 8 : 4;
  const I per_row = R / VEC, n = rows * per_row;
  for (I k = blockIdx.x * I(blockDim.x) + threadIdx.x; k < n; k += I(gridDim.x) * blockDim.x) {
    const I r = k / per_row, i0 = (k % per_row) * VEC, t = r % T;
    const I o = r * D + i0;
    float a[VEC], b[VEC];
    load_vec<W16>(dt, x, o, a);
    load_vec<W16>(dt, x, o + R, b);
    rotate_pairs<VEC>(a, b, cs + t * R + i0, sn + t * R + i0);
    store_vec<W16>(dt, x, o, a);
    store_vec<W16>(dt, x, o + R, b);
  }
}

// Row r of (.., Tq, Tk) scores: query at absolute position q = r % Tq + (Tk - Tq) sees keys
// j <= q, q - j < window where window > 0, and of its own segment when segments are given.
// Masked entries are exact zeros. P may alias S: every pass reads only what the same thread
// writes last. sinks (rows / Tq,) where given: sinks[r / Tq] joins the row's softmax unscaled.
__device__ __forceinline__ int64_t window_start(int64_t q, int64_t window) {
  return window > 0 && q >= window ? q - window + 1 : 0;
}

// The row max m (of S, before scale) with the row's sink joined in S's units, and the sink's
// term of the row sum; m unchanged and 0 without sinks.
__device__ __forceinline__ float sink_term(const float* sinks, int64_t r, int64_t Tq, float scale, float& m) {
  if (!sinks) return 0.f;
  const float s = sinks[r / Tq];
  m = fmaxf(m, s / scale);
  return expf(s - scale * m);
}

__global__ void softmax_causal_kernel(DType dt, const void* S, void* P, int64_t Tq, int64_t Tk, float scale,
                                      const int32_t* seg, int64_t window, const float* sinks) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x, base = r * Tk, q = r % Tq + (Tk - Tq), lo = window_start(q, window);
  const int32_t sq = seg ? seg[q] : 0;
  float m = -3.402823466e38f;
  for (int64_t j = lo + threadIdx.x; j <= q; j += blockDim.x)
    if (!seg || seg[j] == sq) m = fmaxf(m, ld(dt, S, base + j));
  m = block_max(m, sh);
  const float sink = sink_term(sinks, r, Tq, scale, m);
  float sum = 0.f;
  for (int64_t j = lo + threadIdx.x; j <= q; j += blockDim.x)
    if (!seg || seg[j] == sq) sum += expf(scale * (ld(dt, S, base + j) - m));
  const float inv = 1.f / (block_sum(sum, sh) + sink);
  for (int64_t j = threadIdx.x; j < Tk; j += blockDim.x) {
    float p = 0.f;
    if (j >= lo && j <= q && (!seg || seg[j] == sq)) p = expf(scale * (ld(dt, S, base + j) - m)) * inv;
    st(dt, P, base + j, p);
  }
}

// dS = P * (dP - rowsum(P * dP)) * scale; dS may alias dP.
__global__ void softmax_bwd_kernel(DType dt, const void* P, const void* dP, void* dS, int64_t L, float scale) {
  __shared__ float sh[32];
  const int64_t base = int64_t(blockIdx.x) * L;
  float pd = 0.f;
  for (int64_t j = threadIdx.x; j < L; j += blockDim.x) pd += ld(dt, P, base + j) * ld(dt, dP, base + j);
  pd = block_sum(pd, sh);
  for (int64_t j = threadIdx.x; j < L; j += blockDim.x) {
    const float p = ld(dt, P, base + j), d = ld(dt, dP, base + j);
    st(dt, dS, base + j, p * (d - pd) * scale);
  }
}

// Same contract as softmax_causal_kernel. Vectors starting past q are neither read nor needed.
template <bool W16, int NV>
__global__ void softmax_causal_reg_kernel(DType dt, const void* S, void* P, int64_t Tq, int64_t Tk, float scale,
                                          const int32_t* seg, int64_t window, const float* sinks) {
  constexpr int VEC = W16 ? 8 : 4;
  __shared__ float sh[32];
  const int64_t r = blockIdx.x, base = r * Tk, q = r % Tq + (Tk - Tq), lo = window_start(q, window);
  const int32_t sq = seg ? seg[q] : 0;
  float x[NV][VEC];  // the row's values, then their exponentials
  float m = -3.402823466e38f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j0 = (int64_t(k) * blockDim.x + threadIdx.x) * VEC;
    if (j0 <= q) {
      load_vec<W16>(dt, S, base + j0, x[k]);
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (j0 + e >= lo && j0 + e <= q && (!seg || seg[j0 + e] == sq)) m = fmaxf(m, x[k][e]);
    }
  }
  m = block_max(m, sh);
  const float sink = sink_term(sinks, r, Tq, scale, m);
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j0 = (int64_t(k) * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const bool vis = j0 + e >= lo && j0 + e <= q && (!seg || seg[j0 + e] == sq);
      x[k][e] = vis ? expf(scale * (x[k][e] - m)) : 0.f;
      sum += x[k][e];
    }
  }
  const float inv = 1.f / (block_sum(sum, sh) + sink);
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j0 = (int64_t(k) * blockDim.x + threadIdx.x) * VEC;
    if (j0 < Tk) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) x[k][e] *= inv;
      store_vec<W16>(dt, P, base + j0, x[k]);
    }
  }
}

template <bool W16, int NV>
__global__ void softmax_bwd_reg_kernel(DType dt, const void* P, const void* dP, void* dS, int64_t L, float scale) {
  constexpr int VEC = W16 ? 8 : 4;
  __shared__ float sh[32];
  const int64_t base = int64_t(blockIdx.x) * L;
  float p[NV][VEC], d[NV][VEC];
  float pd = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j0 = (int64_t(k) * blockDim.x + threadIdx.x) * VEC;
    if (j0 < L) {
      load_vec<W16>(dt, P, base + j0, p[k]);
      load_vec<W16>(dt, dP, base + j0, d[k]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) pd += p[k][e] * d[k][e];
    }
  }
  pd = block_sum(pd, sh);  // every load of the block precedes its barriers: dS may alias dP
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j0 = (int64_t(k) * blockDim.x + threadIdx.x) * VEC;
    if (j0 < L) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) p[k][e] = p[k][e] * (d[k][e] - pd) * scale;
      store_vec<W16>(dt, dS, base + j0, p[k]);
    }
  }
}

// out (B, A, D) = x (A, B, D), the rows of heads h < rotate turned as rope turns them (h is b when
// heads_axis == 1, else a; t the other index). Item j < P = R / V of a row moves the vector pair
// (j, j + P), rotated or not; items past P copy dims >= 2R. V = 1 (scalar) or a 16-byte vector.
template <class I, bool VEC, bool W16>
__global__ void transpose_heads_rope_kernel(DType dt, const void* x, void* out, I A, I B, I D, I R, I rotate,
                                            int heads_axis, const float* cs, const float* sn) {
  constexpr int V = VEC ? (W16 ? 8 : 4) : 1;
  const I P = R / V, items = P + (D - 2 * R) / V, n = A * B * items;
  for (I k = blockIdx.x * I(blockDim.x) + threadIdx.x; k < n; k += I(gridDim.x) * blockDim.x) {
    const I r = k / items, j = k % items, a = r / B, b = r % B;
    const I src = r * D, dst = (b * A + a) * D;
    float lo[V], hi[V];
    if (j >= P) {  // dims >= 2R: a plain copy
      const I o = 2 * R + (j - P) * V;
      load_n<VEC, W16>(dt, x, src + o, lo);
      store_n<VEC, W16>(dt, out, dst + o, lo);
      continue;
    }
    const I i0 = j * V;
    load_n<VEC, W16>(dt, x, src + i0, lo);
    load_n<VEC, W16>(dt, x, src + R + i0, hi);
    const I h = heads_axis == 1 ? b : a, t = heads_axis == 1 ? a : b;
    if (h < rotate) rotate_pairs<V>(lo, hi, cs + t * R + i0, sn + t * R + i0);
    store_n<VEC, W16>(dt, out, dst + i0, lo);
    store_n<VEC, W16>(dt, out, dst + R + i0, hi);
  }
}

// Token-major rope: x (B, T, H, D) at strides (s0, s1, s2, 1); row (b, t, h) turns by table row
// t (positions shared by the sequences) or b T + t. Item j of a row moves the vector pair (j, j + P).
template <class I, bool VEC, bool W16>
__global__ void rope_token_major_kernel(DType dt, void* x, I B, I T, I H, I R, I s0, I s1, I s2, bool shared,
                                        const float* cs, const float* sn) {
  constexpr int V = VEC ? (W16 ? 8 : 4) : 1;
  const I P = R / V, n = B * T * H * P;
  for (I k = blockIdx.x * I(blockDim.x) + threadIdx.x; k < n; k += I(gridDim.x) * blockDim.x) {
    const I row = k / P, j = k % P, h = row % H, bt = row / H, b = bt / T, t = bt % T;
    const I o = b * s0 + t * s1 + h * s2 + j * V, tab = (shared ? t : bt) * R + j * V;
    float lo[V], hi[V];
    load_n<VEC, W16>(dt, x, o, lo);
    load_n<VEC, W16>(dt, x, o + R, hi);
    rotate_pairs<V>(lo, hi, cs + tab, sn + tab);
    store_n<VEC, W16>(dt, x, o, lo);
    store_n<VEC, W16>(dt, x, o + R, hi);
  }
}

// attention_backward at T = 1 (cuDNN's backward refuses it): the one key is the query's own, so
// o = v, dq = dk = 0 and dv of KV head kh sums dout over its g query heads. Operands (B, 1, H, D)
// at strides (s*0, -, s*2, 1); item (b, head, d) over the Hq + Hk heads.
__global__ void attention_backward_one_token_kernel(DType dt, const void* dout, void* dq, void* dk, void* dv,
                                                    int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t so0,
                                                    int64_t so2, int64_t sq0, int64_t sq2, int64_t sk0, int64_t sk2,
                                                    int64_t sv0, int64_t sv2) {
  const int64_t heads = Hq + Hk, n = B * heads * D, g = Hq / Hk;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % D, h = (i / D) % heads, b = i / (D * heads);
    if (h < Hq) {
      st(dt, dq, b * sq0 + h * sq2 + d, 0.f);
      continue;
    }
    const int64_t kh = h - Hq;
    float acc = 0.f;
    for (int64_t e = kh * g; e < (kh + 1) * g; ++e) acc += ld(dt, dout, b * so0 + e * so2 + d);
    st(dt, dk, b * sk0 + kh * sk2 + d, 0.f);
    st(dt, dv, b * sv0 + kh * sv2 + d, acc);
  }
}

}  // namespace

Tensor CudaBackend::rope_table(const Tensor& positions, const Tensor& inv_freq, float sign, int64_t rows) {
  const int64_t R = inv_freq.numel();
  Tensor tab = scratch(2 * rows * R);  // cos (rows, R) then sin (rows, R)
  float* cs = tab.ptr<float>();
  rope_table_kernel<<<grid_for(rows * R), kThreads, 0, stream_>>>(positions.ptr<int32_t>(), inv_freq.ptr<float>(), sign,
                                                                   rows, R, cs, cs + rows * R);
  return tab;
}

void CudaBackend::rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float sign, bool token_major) {
  OpTimer timer(this);
  if (token_major) return rope_token_major(x, positions, inv_freq, sign);
  const int64_t T = x.size(-2), D = x.size(-1), R = inv_freq.numel(), rows = D ? x.numel() / D : 0;
  if (rows == 0 || T == 0) return;
  const Tensor tab = rope_table(positions, inv_freq, sign, T);
  const float *cs = tab.ptr<float>(), *sn = cs + T * R;
  const int64_t vec = vec_width(x.dtype());
  // 32-bit index arithmetic where every offset fits: 64-bit divisions dominate these kernels.
  const bool i32 = x.numel() < (int64_t(1) << 31);
  if (R % vec == 0 && vectorizable(x.dtype(), D, {x.data()})) {
    const int64_t n = rows * (R / vec);
#define KRNL_ROPE(W)                                                                                              \
  if (i32)                                                                                                         \
    rope_apply_vec_kernel<uint32_t, W><<<grid_for(n), kThreads, 0, stream_>>>(x.dtype(), x.data(), uint32_t(rows),  \
                                                                               uint32_t(T), uint32_t(D), uint32_t(R), \
                                                                               cs, sn);                              \
  else                                                                                                             \
    rope_apply_vec_kernel<int64_t, W><<<grid_for(n), kThreads, 0, stream_>>>(x.dtype(), x.data(), rows, T, D, R, cs, sn)
    KRNL_DISPATCH_VEC(x.dtype() != DType::f32, KRNL_ROPE)
#undef KRNL_ROPE
  } else if (i32) {
    rope_apply_kernel<uint32_t><<<grid_for(rows * R), kThreads, 0, stream_>>>(
        x.dtype(), x.data(), uint32_t(rows), uint32_t(T), uint32_t(D), uint32_t(R), cs, sn);
  } else {
    rope_apply_kernel<int64_t><<<grid_for(rows * R), kThreads, 0, stream_>>>(x.dtype(), x.data(), rows, T, D, R, cs, sn);
  }
  check_launch("rope");
}

void CudaBackend::rope_token_major(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, float sign) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), R = inv_freq.numel();
  if (x.numel() == 0) return;
  const bool shared = positions.dim() == 1;
  const int64_t rows = shared ? T : B * T;
  const Tensor tab = rope_table(positions, inv_freq, sign, rows);
  const float *cs = tab.ptr<float>(), *sn = cs + rows * R;
  const Shape& st = x.strides();
  const int64_t vec = vec_width(x.dtype());
  const bool vector = R % vec == 0 && st[0] % vec == 0 && st[1] % vec == 0 && st[2] % vec == 0 &&
                      vectorizable(x.dtype(), vec, {x.data()});
  const bool i32 = (B - 1) * st[0] + (T - 1) * st[1] + (H - 1) * st[2] + D < (int64_t(1) << 31);
  const auto launch = [&](auto idx, auto vec_tag, auto w16_tag) {
    using I = decltype(idx);
    constexpr bool VEC = decltype(vec_tag)::value;
    const int64_t n = B * T * H * (VEC ? R / vec : R);
    rope_token_major_kernel<I, VEC, decltype(w16_tag)::value><<<grid_for(n), kThreads, 0, stream_>>>(
        x.dtype(), x.data(), I(B), I(T), I(H), I(R), I(st[0]), I(st[1]), I(st[2]), shared, cs, sn);
  };
  using Y = std::true_type;
  using N = std::false_type;
  const bool w16 = x.dtype() != DType::f32;
  if (vector && i32)
    w16 ? launch(uint32_t(), Y(), Y()) : launch(uint32_t(), Y(), N());
  else if (vector)
    w16 ? launch(int64_t(), Y(), Y()) : launch(int64_t(), Y(), N());
  else
    i32 ? launch(uint32_t(), N(), N()) : launch(int64_t(), N(), N());
  check_launch("rope");
}

void CudaBackend::attention_backward_one_token(const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                               const Tensor& dv) {
  // 3-D operands are (H, 1, D): B = 1, head stride D; 4-D ones (B, 1, H, D) at their strides.
  const auto s0 = [](const Tensor& t) { return t.dim() == 4 ? t.strides()[0] : 0; };
  const auto s2 = [](const Tensor& t) { return t.dim() == 4 ? t.strides()[2] : t.size(2); };
  const bool tm = dout.dim() == 4;
  const int64_t B = tm ? dout.size(0) : 1, Hq = dout.size(tm ? 2 : 0), Hk = dk.size(tm ? 2 : 0), D = dout.size(-1);
  attention_backward_one_token_kernel<<<grid_for(B * (Hq + Hk) * D), kThreads, 0, stream_>>>(
      dout.dtype(), dout.data(), dq.data(), dk.data(), dv.data(), B, Hq, Hk, D, s0(dout), s2(dout), s0(dq), s2(dq),
      s0(dk), s2(dk), s0(dv), s2(dv));
  check_launch("attention_backward");
}

void CudaBackend::transpose_heads_rope(const Tensor& x, const Tensor& out, const Tensor& positions,
                                       const Tensor& inv_freq, int64_t rotate, float sign, int64_t heads_axis) {
  const int64_t A = x.size(0), B = x.size(1), D = x.size(2), R = inv_freq.numel();
  const int64_t T = heads_axis == 1 ? A : B;
  const Tensor tab = rope_table(positions, inv_freq, sign, T);
  const float *cs = tab.ptr<float>(), *sn = cs + T * R;
  const int64_t vec = vec_width(x.dtype());
  const int ax = int(heads_axis);
  const bool i32 = x.numel() < (int64_t(1) << 31);  // 32-bit offsets where they fit, as in rope
  const auto launch = [&](auto idx, auto vec_tag, auto w16_tag, int64_t n) {
    using I = decltype(idx);
    transpose_heads_rope_kernel<I, decltype(vec_tag)::value, decltype(w16_tag)::value>
        <<<grid_for(n), kThreads, 0, stream_>>>(x.dtype(), x.data(), out.data(), I(A), I(B), I(D), I(R), I(rotate), ax,
                                                cs, sn);
  };
  using Y = std::true_type;
  using N = std::false_type;
  if (R % vec == 0 && vectorizable(x.dtype(), D, {x.data(), out.data()})) {
    const int64_t n = A * B * (R / vec + (D - 2 * R) / vec);
    const bool w16 = x.dtype() != DType::f32;
    if (i32)
      w16 ? launch(uint32_t(), Y(), Y(), n) : launch(uint32_t(), Y(), N(), n);
    else
      w16 ? launch(int64_t(), Y(), Y(), n) : launch(int64_t(), Y(), N(), n);
  } else {
    i32 ? launch(uint32_t(), N(), N(), A * B * (D - R)) : launch(int64_t(), N(), N(), A * B * (D - R));
  }
  check_launch("transpose_heads");
}

void CudaBackend::softmax_causal_forward(const Tensor& S, const Tensor& P, float scale, const Tensor* segments,
                                         int64_t window, const Tensor* sinks) {
  OpTimer timer(this);
  const int64_t Tq = S.size(-2), Tk = S.size(-1), rows = Tk ? S.numel() / Tk : 0;
  if (rows == 0) return;
  const RegPlan rp = reg_plan(S.dtype(), Tk, {S.data(), P.data()});
  const int32_t* seg = segments ? segments->ptr<int32_t>() : nullptr;
  const float* sink = sinks ? sinks->ptr<float>() : nullptr;
  if (rp.threads) {
    const bool w16 = S.dtype() != DType::f32;
    const unsigned g = unsigned(rows);
#define KRNL_SOFTMAX_FWD(W, NV) \
  softmax_causal_reg_kernel<W, NV><<<g, rp.threads, 0, stream_>>>(S.dtype(), S.data(), P.data(), Tq, Tk, scale, seg, \
                                                                   window, sink)
    KRNL_DISPATCH_REG(w16, rp.nv, KRNL_SOFTMAX_FWD)
#undef KRNL_SOFTMAX_FWD
    check_launch("softmax_causal_forward");
    return;
  }
  softmax_causal_kernel<<<unsigned(rows), std::min(row_threads(Tk), 512), 0, stream_>>>(
      S.dtype(), S.data(), P.data(), Tq, Tk, scale, seg, window, sink);
  check_launch("softmax_causal_forward");
}

void CudaBackend::softmax_backward(const Tensor& P, const Tensor& dP, const Tensor& dS, float scale) {
  OpTimer timer(this);
  const int64_t L = P.dim() ? P.size(-1) : 1, rows = L ? P.numel() / L : 0;
  if (rows == 0) return;
  const RegPlan rp = reg_plan(P.dtype(), L, {P.data(), dP.data(), dS.data()});
  if (rp.threads) {
    const bool w16 = P.dtype() != DType::f32;
    const unsigned g = unsigned(rows);
#define KRNL_SOFTMAX_BWD(W, NV) \
  softmax_bwd_reg_kernel<W, NV><<<g, rp.threads, 0, stream_>>>(P.dtype(), P.data(), dP.data(), dS.data(), L, scale)
    KRNL_DISPATCH_REG(w16, rp.nv, KRNL_SOFTMAX_BWD)
#undef KRNL_SOFTMAX_BWD
    check_launch("softmax_backward");
    return;
  }
  softmax_bwd_kernel<<<unsigned(rows), std::min(row_threads(L), 512), 0, stream_>>>(P.dtype(), P.data(), dP.data(),
                                                                                     dS.data(), L, scale);
  check_launch("softmax_backward");
}

}  // namespace krnl::cuda
