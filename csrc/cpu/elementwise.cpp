// Elementwise ops on the CPU: SwiGLU, GeGLU, soft-capping, DoRA's column scaling and norm, add,
// axpy, scale, cast, fill and dropout, in blocks over the thread pool.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "convert.h"
#include "core/rng.h"
#include "cpu_backend.h"
#include "ops_common.h"
#include "vmath.h"

namespace krnl::cpu {

// ---- gated MLPs: s = act(g) * u with act(x) = x sg(x), sg a sigmoid of some z(x) computed as
// 1 / (1 + e), e = exp(-z) from a bulk exp. SwiGLU: z = x (act = SiLU); GeGLU (Gemma): z = 2 k (x +
// a x^3), act the tanh-approximated GELU. Act gives e, and dg = d u act'(x) from x, e and sg.
// gpt-oss's clamped SwiGLU (SiluClamped) turns g and u first: x = min(g, limit) and u + 1 with u
// clamped to +-limit, z = alpha x; gates() says where the gradients pass the clamps.

namespace {
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

struct Silu {
  float x(float g) const { return g; }
  float u(float u) const { return u; }
  void exps(const float* g, float* e, int64_t n) const {
    for (int64_t i = 0; i < n; ++i) e[i] = -g[i];
    exp_inplace(e, n);
  }
  // d u act'(x), multiplied in this order (pinned results depend on it)
  float dg(float d, float u, float x, float, float sg) const { return d * u * sg * (1.f + x * (1.f - sg)); }
  bool g_passes(float) const { return true; }
  bool u_passes(float) const { return true; }
};

struct SiluClamped {
  float alpha, limit;
  float x(float g) const { return g > limit ? limit : g; }  // NaN stays NaN, as torch.clamp keeps it
  float u(float u) const { return (u > limit ? limit : (u < -limit ? -limit : u)) + 1.f; }
  void exps(const float* g, float* e, int64_t n) const {
    for (int64_t i = 0; i < n; ++i) e[i] = -alpha * x(g[i]);
    exp_inplace(e, n);
  }
  float dg(float d, float u, float x, float, float sg) const { return d * u * sg * (1.f + alpha * x * (1.f - sg)); }
  // torch.clamp's gradient: through where the input lies within the bounds, bounds included
  bool g_passes(float g) const { return g <= limit; }
  bool u_passes(float u) const { return u >= -limit && u <= limit; }
};

// sg = 1 / (1 + exp(-2 z)) = (1 + tanh z) / 2, so gelu_tanh(x) = x sg: 1 + tanh from the sigmoid
// keeps its relative accuracy for very negative x (1 + tanh would cancel there).
struct GeluTanh {
  float x(float g) const { return g; }
  float u(float u) const { return u; }
  void exps(const float* g, float* e, int64_t n) const {
    for (int64_t i = 0; i < n; ++i) e[i] = -2.f * kGeluK * (g[i] + kGeluA * g[i] * g[i] * g[i]);
    exp_inplace(e, n);
  }
  // gelu_tanh'(x) = (1 + t) / 2 + x (1 - t^2) k (1 + 3 a x^2) / 2 with 1 + t = 2 sg and
  // 1 - t^2 = 4 sg (1 - sg); 1 - sg as e sg where sg > 1/2, where 1 - sg would cancel.
  float dg(float d, float u, float x, float e, float sg) const {
    const float om = sg < 0.5f ? 1.f - sg : e * sg;
    return d * u * (sg + 2.f * x * sg * om * kGeluK * (1.f + 3.f * kGeluA * x * x));
  }
  bool g_passes(float) const { return true; }
  bool u_passes(float) const { return true; }
};

template <class Act>
void gated_forward(const Act& act, const Tensor& g, const Tensor& u, const Tensor& s) {
  const DType dt = g.dtype();
  for_blocks(g.numel(), [&](int64_t b, int64_t e) {
    float gs[kBlock], us[kBlock], ss[kBlock], t[kBlock];
    const int64_t n = e - b;
    const float* gv = view(dt, g.data(), b, n, gs);
    const float* uv = view(dt, u.data(), b, n, us);
    act.exps(gv, t, n);
    float* sv = out_window(dt, s.data(), b, ss);
    for (int64_t i = 0; i < n; ++i) sv[i] = act.x(gv[i]) / (1.f + t[i]) * act.u(uv[i]);
    flush(dt, sv, n, s.data(), b);
  });
}

template <class Act>
void gated_backward(const Act& act, const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg,
                    const Tensor& du) {
  const DType dt = g.dtype();
  for_blocks(g.numel(), [&](int64_t b, int64_t e) {
    float dss[kBlock], gs[kBlock], us[kBlock], dgs[kBlock], dus[kBlock], t[kBlock];
    const int64_t n = e - b;
    const float* dv = view(dt, ds.data(), b, n, dss);
    const float* gv = view(dt, g.data(), b, n, gs);
    const float* uv = view(dt, u.data(), b, n, us);
    act.exps(gv, t, n);
    float* dgv = out_window(dt, dg.data(), b, dgs);
    float* duv = out_window(dt, du.data(), b, dus);
    for (int64_t i = 0; i < n; ++i) {
      // All inputs read before either output is written: dg/du may alias ds.
      const float d = dv[i], x = act.x(gv[i]), ui = act.u(uv[i]), sg = 1.f / (1.f + t[i]);
      const bool gp = act.g_passes(gv[i]), up = act.u_passes(uv[i]);
      dgv[i] = gp ? act.dg(d, ui, x, t[i], sg) : 0.f;
      duv[i] = up ? d * x * sg : 0.f;
    }
    flush(dt, dgv, n, dg.data(), b);
    flush(dt, duv, n, du.data(), b);
  });
}
}  // namespace

void CpuBackend::swiglu_forward(const Tensor& g, const Tensor& u, const Tensor& s, float alpha, float limit) {
  if (limit > 0.f) return gated_forward(SiluClamped{alpha, limit}, g, u, s);
  gated_forward(Silu{}, g, u, s);
}

void CpuBackend::swiglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg,
                                 const Tensor& du, float alpha, float limit) {
  if (limit > 0.f) return gated_backward(SiluClamped{alpha, limit}, ds, g, u, dg, du);
  gated_backward(Silu{}, ds, g, u, dg, du);
}

void CpuBackend::geglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) { gated_forward(GeluTanh{}, g, u, s); }

void CpuBackend::geglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg,
                                const Tensor& du) {
  gated_backward(GeluTanh{}, ds, g, u, dg, du);
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

// ---- DoRA's per-column scale (2-D views whose rows may be strided: column blocks of q|k|v)

namespace {
constexpr int64_t kColumnChunk = 256;  // columns a task of scale_columns_backward sums (parallelism over them)
}

void CpuBackend::scale_columns(const Tensor& x, const Tensor& v, const Tensor& out) {
  const DType dt = x.dtype();
  const int64_t M = x.size(1), ldx = x.strides()[0], ldo = out.strides()[0];
  const float* vv = v.ptr<float>();
  for_rows(x.size(0), M, [&](int64_t r0, int64_t r1) {
    float xs[kBlock], os[kBlock];
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j0 = 0; j0 < M; j0 += kBlock) {
        const int64_t n = std::min(kBlock, M - j0);
        const float* xv = view(dt, x.data(), r * ldx + j0, n, xs);
        float* o = out_window(dt, out.data(), r * ldo + j0, os);  // may alias xv: element i read before written
        for (int64_t i = 0; i < n; ++i) o[i] = xv[i] * vv[j0 + i];
        flush(dt, o, n, out.data(), r * ldo + j0);
      }
  });
}

// One task per (row block, column chunk): its rows in order, so a block's sums depend on its rows only.
void CpuBackend::scale_columns_backward(const Tensor& dy, const Tensor& x, const Tensor& v, const Tensor& dx,
                                        const Tensor& dv) {
  const DType dt = x.dtype();
  const int64_t M = x.size(1), S = dv.size(0), per = x.size(0) / S, chunks = (M + kColumnChunk - 1) / kColumnChunk;
  const int64_t ldy = dy.strides()[0], ldx = x.strides()[0], ldd = dx.strides()[0];
  const float* vv = v.ptr<float>();
  float* out = dv.ptr<float>();
  ThreadPool::global().parallel_for(S * chunks, 1, [&](int64_t t0, int64_t t1) {
    float ds[kColumnChunk], xs[kColumnChunk], os[kColumnChunk], acc[kColumnChunk];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = t / chunks, j0 = t % chunks * kColumnChunk, n = std::min(kColumnChunk, M - j0);
      std::fill(acc, acc + n, 0.f);
      for (int64_t r = s * per; r < (s + 1) * per; ++r) {
        const float* d = view(dt, dy.data(), r * ldy + j0, n, ds);
        const float* xv = view(dt, x.data(), r * ldx + j0, n, xs);
        float* o = out_window(dt, dx.data(), r * ldd + j0, os);  // may alias d
        for (int64_t i = 0; i < n; ++i) {
          acc[i] += d[i] * xv[i];
          o[i] = d[i] * vv[j0 + i];
        }
        flush(dt, o, n, dx.data(), r * ldd + j0);
      }
      std::copy(acc, acc + n, out + s * M + j0);
    }
  });
}

void CpuBackend::dora_norm(const Tensor& w2, const Tensor& B, const Tensor& Q, const Tensor& m, float alpha,
                           const Tensor& scale, const Tensor& inv_norm) {
  const DType dt = B.dtype();
  const int64_t M = B.size(0), r = B.size(1);
  const float *w = w2.ptr<float>(), *q = Q.ptr<float>();
  float *sc = scale.ptr<float>(), *inv = inv_norm.ptr<float>();
  for_rows(M, r, [&](int64_t o0, int64_t o1) {
    float bs[kBlock], ms[1];
    for (int64_t o = o0; o < o1; ++o) {
      float dot = 0.f;
      for (int64_t k0 = 0; k0 < r; k0 += kBlock) {
        const int64_t n = std::min(kBlock, r - k0);
        const float* b = view(dt, B.data(), o * r + k0, n, bs);
        for (int64_t k = 0; k < n; ++k) dot += b[k] * q[(k0 + k) * M + o];
      }
      const float norm = std::sqrt(std::max(w[o] + alpha * dot, 0.f));
      sc[o] = *view(dt, m.data(), o, 1, ms) / norm;
      inv[o] = 1.f / norm;
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

}  // namespace krnl::cpu
