// Elementwise ops: add, axpy, scale, cast, fill, dropout, SwiGLU, GeGLU, soft-capping and the
// head transpose. Each
// element is read before its output is written by the same thread, so in-place calls (out
// aliasing an input) are safe, as on the CPU backend.
#include <cmath>
#include <limits>

#include "common.cuh"
#include "core/rng.h"
#include "swiglu.cuh"

namespace krnl::cuda {
namespace {

#define KRNL_GRID_LOOP(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

__global__ void add_kernel(DType dt, const void* a, const void* b, void* out, int64_t n) {
  KRNL_GRID_LOOP(i, n) st(dt, out, i, ld(dt, a, i) + ld(dt, b, i));
}

// y += alpha * x; x and y may differ in dtype (f16 gradients into an f32 accumulator).
__global__ void axpy_kernel(float alpha, DType xd, const void* x, DType yd, void* y, int64_t n) {
  KRNL_GRID_LOOP(i, n) st(yd, y, i, ld(yd, y, i) + alpha * ld(xd, x, i));
}

__global__ void scale_kernel(DType dt, const void* x, float alpha, void* out, int64_t n) {
  KRNL_GRID_LOOP(i, n) st(dt, out, i, alpha * ld(dt, x, i));
}

__global__ void cast_kernel(DType xd, const void* x, DType od, void* out, int64_t n) {
  KRNL_GRID_LOOP(i, n) st(od, out, i, ld(xd, x, i));
}

template <class T>
__global__ void fill_kernel(T* p, T v, int64_t n) {
  KRNL_GRID_LOOP(i, n) p[i] = v;
}

// offset (2,) i32, where given, moves the seed by a per-step uint64 on the device (rng.h).
// width > 0: offset holds a third word, the first row of x in its batch (rows of width elements).
__global__ void dropout_kernel(DType dt, const void* x, void* out, int64_t n, float p, uint64_t seed, float keep_scale,
                               const int32_t* offset, uint64_t width) {
  if (offset) seed = dropout_seed(seed, uint32_t(offset[0]), uint32_t(offset[1]));
  const uint64_t base = offset && width ? dropout_base(uint32_t(offset[2]), width) : 0;
  KRNL_GRID_LOOP(i, n) st(dt, out, i, dropout_keep(seed, base + uint64_t(i), p) ? ld(dt, x, i) * keep_scale : 0.f);
}

// The gated activations s = act(g) * u as functors, each with its forward and its backward
// (dg, du from ds, g, u; in that expression order, which fixes the rounding), for one set of
// kernels and launchers below; passed by value (SwiGLU's clamped form carries alpha and limit).
// SwiGLU's forms: swiglu.cuh.

// GeGLU: gelu_tanh(x) = x sg with sg = sigmoid(2 k (x + a x^3)) = (1 + tanh(k (x + a x^3))) / 2
// (transformers' "gelu_pytorch_tanh"); 1 + tanh from the sigmoid keeps its relative accuracy for
// very negative x, as on the CPU backend. gelu' = sg + 2 x sg (1 - sg) k (1 + 3 a x^2).
// 1 - sg is taken as e sg (e = exp(-2 z)) where sg > 1/2, where 1 - sg would cancel.
__device__ __forceinline__ float gelu_exp(float x) {
  return expf(-2.f * 0.7978845608028654f * (x + 0.044715f * x * x * x));
}
__device__ __forceinline__ float gelu_sigmoid(float x) { return 1.f / (1.f + gelu_exp(x)); }
__device__ __forceinline__ float gelu_grad(float x, float& sg) {  // also returns sg
  const float e = gelu_exp(x);
  sg = 1.f / (1.f + e);
  const float om = sg < 0.5f ? 1.f - sg : e * sg;
  return sg + 2.f * x * sg * om * 0.7978845608028654f * (1.f + 3.f * 0.044715f * x * x);
}
struct Geglu {
  static constexpr const char* fwd_name = "geglu_forward";
  static constexpr const char* bwd_name = "geglu_backward";
  __device__ float forward(float g, float u) const { return g * gelu_sigmoid(g) * u; }
  __device__ void backward(float d, float g, float u, float& dg, float& du) const {
    float sg;
    dg = d * u * gelu_grad(g, sg);
    du = d * g * sg;
  }
};

template <class Act>
__global__ void gated_fwd_kernel(Act act, DType dt, const void* g, const void* u, void* s, int64_t n) {
  KRNL_GRID_LOOP(i, n) st(dt, s, i, act.forward(ld(dt, g, i), ld(dt, u, i)));
}

// dg/du may alias ds: all three inputs are read before either output is written.
template <class Act>
__global__ void gated_bwd_kernel(Act act, DType dt, const void* ds, const void* g, const void* u, void* dg, void* du,
                                 int64_t n) {
  KRNL_GRID_LOOP(i, n) {
    float dgi, dui;
    act.backward(ld(dt, ds, i), ld(dt, g, i), ld(dt, u, i), dgi, dui);
    st(dt, dg, i, dgi);
    st(dt, du, i, dui);
  }
}

// out = cap tanh(x / cap) (out may be x); dx = dy (1 - (y / cap)^2) from the output y.
__global__ void softcap_kernel(DType dt, const void* x, float cap, void* out, int64_t n) {
  KRNL_GRID_LOOP(i, n) st(dt, out, i, cap * tanhf(ld(dt, x, i) / cap));
}

__global__ void softcap_bwd_kernel(DType dt, const void* dy, const void* y, float cap, void* dx, int64_t n) {
  KRNL_GRID_LOOP(i, n) {
    const float d = ld(dt, dy, i), r = ld(dt, y, i) / cap;
    st(dt, dx, i, d * (1.f - r * r));
  }
}

// 16-byte vector forms of the big elementwise ops (n a multiple of the vector, aligned).
template <bool W16>
__global__ void add_vec_kernel(DType dt, const void* a, const void* b, void* out, int64_t nvec) {
  constexpr int VEC = W16 ? 8 : 4;
  KRNL_GRID_LOOP(v, nvec) {
    float x[VEC], y[VEC];
    load_vec<W16>(dt, a, v * VEC, x);
    load_vec<W16>(dt, b, v * VEC, y);
#pragma unroll
    for (int e = 0; e < VEC; ++e) x[e] += y[e];
    store_vec<W16>(dt, out, v * VEC, x);
  }
}

template <bool W16>
__global__ void axpy_vec_kernel(float alpha, DType dt, const void* x, void* y, int64_t nvec) {
  constexpr int VEC = W16 ? 8 : 4;
  KRNL_GRID_LOOP(v, nvec) {
    float xv[VEC], yv[VEC];
    load_vec<W16>(dt, x, v * VEC, xv);
    load_vec<W16>(dt, y, v * VEC, yv);
#pragma unroll
    for (int e = 0; e < VEC; ++e) yv[e] += alpha * xv[e];
    store_vec<W16>(dt, y, v * VEC, yv);
  }
}

template <class Act, bool W16>
__global__ void gated_fwd_vec_kernel(Act act, DType dt, const void* g, const void* u, void* s, int64_t nvec) {
  constexpr int VEC = W16 ? 8 : 4;
  KRNL_GRID_LOOP(v, nvec) {
    float gv[VEC], uv[VEC];
    load_vec<W16>(dt, g, v * VEC, gv);
    load_vec<W16>(dt, u, v * VEC, uv);
#pragma unroll
    for (int e = 0; e < VEC; ++e) gv[e] = act.forward(gv[e], uv[e]);
    store_vec<W16>(dt, s, v * VEC, gv);
  }
}

template <class Act, bool W16>
__global__ void gated_bwd_vec_kernel(Act act, DType dt, const void* ds, const void* g, const void* u, void* dg,
                                     void* du, int64_t nvec) {
  constexpr int VEC = W16 ? 8 : 4;
  KRNL_GRID_LOOP(v, nvec) {
    float d[VEC], gv[VEC], uv[VEC];
    load_vec<W16>(dt, ds, v * VEC, d);
    load_vec<W16>(dt, g, v * VEC, gv);
    load_vec<W16>(dt, u, v * VEC, uv);
#pragma unroll
    for (int e = 0; e < VEC; ++e) act.backward(d[e], gv[e], uv[e], d[e], uv[e]);  // d becomes dg, uv du
    store_vec<W16>(dt, dg, v * VEC, d);
    store_vec<W16>(dt, du, v * VEC, uv);
  }
}

// out (B, A, D) from x (A, B, D): W is the element type's width (2 or 4 bytes), or uint4 when
// whole rows go as 16-byte vectors (D is then counted in vectors).
template <class W, class I>
__global__ void transpose_heads_kernel(const W* __restrict__ x, W* __restrict__ out, I A, I B, I D) {
  const I n = A * B * D;
  for (I i = blockIdx.x * I(blockDim.x) + threadIdx.x; i < n; i += I(gridDim.x) * blockDim.x) {
    const I d = i % D, r = i / D, a = r / B, b = r % B;
    out[(b * A + a) * D + d] = x[i];
  }
}

}  // namespace

void CudaBackend::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  OpTimer timer(this);
  const int64_t n = a.numel();
  if (!n) return;
  if (vectorizable(a.dtype(), n, {a.data(), b.data(), out.data()})) {
    const int64_t nv = n / vec_width(a.dtype());
#define KRNL_ADD(W) add_vec_kernel<W><<<grid_for(nv), kThreads, 0, stream_>>>(a.dtype(), a.data(), b.data(), out.data(), nv)
    KRNL_DISPATCH_VEC(a.dtype() != DType::f32, KRNL_ADD)
#undef KRNL_ADD
    check_launch("add");
    return;
  }
  add_kernel<<<grid_for(n), kThreads, 0, stream_>>>(a.dtype(), a.data(), b.data(), out.data(), n);
  check_launch("add");
}

void CudaBackend::axpy(float alpha, const Tensor& x, const Tensor& y) {
  OpTimer timer(this);
  const int64_t n = x.numel();
  if (!n) return;
  if (x.dtype() == y.dtype() && vectorizable(x.dtype(), n, {x.data(), y.data()})) {
    const int64_t nv = n / vec_width(x.dtype());
#define KRNL_AXPY(W) axpy_vec_kernel<W><<<grid_for(nv), kThreads, 0, stream_>>>(alpha, x.dtype(), x.data(), y.data(), nv)
    KRNL_DISPATCH_VEC(x.dtype() != DType::f32, KRNL_AXPY)
#undef KRNL_AXPY
    check_launch("axpy");
    return;
  }
  axpy_kernel<<<grid_for(n), kThreads, 0, stream_>>>(alpha, x.dtype(), x.data(), y.dtype(), y.data(), n);
  check_launch("axpy");
}

void CudaBackend::scale(const Tensor& x, float alpha, const Tensor& out) {
  OpTimer timer(this);
  const int64_t n = x.numel();
  if (!n) return;
  scale_kernel<<<grid_for(n), kThreads, 0, stream_>>>(x.dtype(), x.data(), alpha, out.data(), n);
  check_launch("scale");
}

void CudaBackend::cast(const Tensor& x, const Tensor& out) {
  OpTimer timer(this);
  const int64_t n = x.numel();
  if (!n) return;
  if (x.dtype() == out.dtype()) {  // a copy (i32 included); nothing to do when out is x itself
    if (x.data() != out.data())
      check(cudaMemcpyAsync(out.data(), x.data(), x.nbytes(), cudaMemcpyDeviceToDevice, stream_), "cast");
    return;
  }
  cast_kernel<<<grid_for(n), kThreads, 0, stream_>>>(x.dtype(), x.data(), out.dtype(), out.data(), n);
  check_launch("cast");
}

void CudaBackend::fill(const Tensor& x, double value) {
  OpTimer timer(this);
  const int64_t n = x.numel();
  if (!n) return;
  // The bit pattern is made on the host with dtype.h's conversions: identical to the CPU's.
  switch (x.dtype()) {
    case DType::f32:
      fill_kernel<float><<<grid_for(n), kThreads, 0, stream_>>>(x.ptr<float>(), float(value), n);
      break;
    case DType::f16:
      fill_kernel<uint16_t><<<grid_for(n), kThreads, 0, stream_>>>(x.ptr<uint16_t>(), f32_to_f16(float(value)), n);
      break;
    case DType::bf16:
      fill_kernel<uint16_t><<<grid_for(n), kThreads, 0, stream_>>>(x.ptr<uint16_t>(), f32_to_bf16(float(value)), n);
      break;
    case DType::i32: {
      // Saturating, NaN -> 0, as on the CPU backend.
      double v = std::isnan(value) ? 0.0 : value;
      v = std::min<double>(std::max<double>(v, std::numeric_limits<int32_t>::min()), std::numeric_limits<int32_t>::max());
      fill_kernel<int32_t><<<grid_for(n), kThreads, 0, stream_>>>(x.ptr<int32_t>(), int32_t(v), n);
      break;
    }
  }
  check_launch("fill");
}

void CudaBackend::dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, const Tensor* seed_offset) {
  OpTimer timer(this);
  if (p == 0.f) return cast(x, out);  // same dtype: a copy
  const int64_t n = x.numel();
  if (!n) return;
  const bool rows = seed_offset && seed_offset->numel() == 3;  // a first row: index from it
  const uint64_t width = rows ? uint64_t(x.shape().empty() ? 1 : x.shape().back()) : 0;
  dropout_kernel<<<grid_for(n), kThreads, 0, stream_>>>(x.dtype(), x.data(), out.data(), n, p, seed, 1.f / (1.f - p),
                                                        seed_offset ? seed_offset->ptr<int32_t>() : nullptr, width);
  check_launch("dropout");
}

// The launchers of a gated activation's forward and backward (16-byte vectors where aligned).
template <class Act>
void CudaBackend::gated_forward(const Act& act, const Tensor& g, const Tensor& u, const Tensor& s) {
  OpTimer timer(this);
  const int64_t n = g.numel();
  if (!n) return;
  if (vectorizable(g.dtype(), n, {g.data(), u.data(), s.data()})) {
    const int64_t nv = n / vec_width(g.dtype());
#define KRNL_GATED_FWD(W)                                                                                   \
  gated_fwd_vec_kernel<Act, W><<<grid_for(nv), kThreads, 0, stream_>>>(act, g.dtype(), g.data(), u.data(), s.data(), \
                                                                       nv)
    KRNL_DISPATCH_VEC(g.dtype() != DType::f32, KRNL_GATED_FWD)
#undef KRNL_GATED_FWD
  } else {
    gated_fwd_kernel<Act><<<grid_for(n), kThreads, 0, stream_>>>(act, g.dtype(), g.data(), u.data(), s.data(), n);
  }
  check_launch(Act::fwd_name);
}

template <class Act>
void CudaBackend::gated_backward(const Act& act, const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg,
                                 const Tensor& du) {
  OpTimer timer(this);
  const int64_t n = g.numel();
  if (!n) return;
  if (vectorizable(g.dtype(), n, {ds.data(), g.data(), u.data(), dg.data(), du.data()})) {
    const int64_t nv = n / vec_width(g.dtype());
#define KRNL_GATED_BWD(W)                                                                                       \
  gated_bwd_vec_kernel<Act, W><<<grid_for(nv), kThreads, 0, stream_>>>(act, g.dtype(), ds.data(), g.data(),      \
                                                                       u.data(), dg.data(), du.data(), nv)
    KRNL_DISPATCH_VEC(g.dtype() != DType::f32, KRNL_GATED_BWD)
#undef KRNL_GATED_BWD
  } else {
    gated_bwd_kernel<Act><<<grid_for(n), kThreads, 0, stream_>>>(act, g.dtype(), ds.data(), g.data(), u.data(),
                                                                 dg.data(), du.data(), n);
  }
  check_launch(Act::bwd_name);
}

void CudaBackend::swiglu_forward(const Tensor& g, const Tensor& u, const Tensor& s, float alpha, float limit) {
  if (limit > 0.f) return gated_forward(SwigluClamped{alpha, limit}, g, u, s);
  gated_forward(Swiglu{}, g, u, s);
}
void CudaBackend::swiglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg,
                                  const Tensor& du, float alpha, float limit) {
  if (limit > 0.f) return gated_backward(SwigluClamped{alpha, limit}, ds, g, u, dg, du);
  gated_backward(Swiglu{}, ds, g, u, dg, du);
}
void CudaBackend::geglu_forward(const Tensor& g, const Tensor& u, const Tensor& s) { gated_forward(Geglu{}, g, u, s); }
void CudaBackend::geglu_backward(const Tensor& ds, const Tensor& g, const Tensor& u, const Tensor& dg,
                                 const Tensor& du) {
  gated_backward(Geglu{}, ds, g, u, dg, du);
}

void CudaBackend::softcap(const Tensor& x, float cap, const Tensor& out) {
  OpTimer timer(this);
  const int64_t n = x.numel();
  if (!n) return;
  softcap_kernel<<<grid_for(n), kThreads, 0, stream_>>>(x.dtype(), x.data(), cap, out.data(), n);
  check_launch("softcap");
}

void CudaBackend::softcap_backward(const Tensor& dy, const Tensor& y, float cap, const Tensor& dx) {
  OpTimer timer(this);
  const int64_t n = y.numel();
  if (!n) return;
  softcap_bwd_kernel<<<grid_for(n), kThreads, 0, stream_>>>(y.dtype(), dy.data(), y.data(), cap, dx.data(), n);
  check_launch("softcap_backward");
}

void CudaBackend::transpose_heads(const Tensor& x, const Tensor& out, const Tensor* positions, const Tensor* inv_freq,
                                  int64_t rotate, float sign, int64_t heads_axis) {
  OpTimer timer(this);
  const int64_t A = x.size(0), B = x.size(1), D = x.size(2), n = A * B * D;
  if (!n) return;
  if (rotate > 0) return transpose_heads_rope(x, out, *positions, *inv_freq, rotate, sign, heads_axis);
  const size_t row = size_t(D) * dtype_size(x.dtype());
  // 32-bit index arithmetic where it fits: the 64-bit divisions cost more than the copy.
  const bool i32 = n < (int64_t(1) << 31);
#define KRNL_TH(W, xp, op, a, b, d, cnt)                                                                              \
  if (i32)                                                                                                          \
    transpose_heads_kernel<W, uint32_t><<<grid_for(cnt), kThreads, 0, stream_>>>(xp, op, uint32_t(a), uint32_t(b),   \
                                                                                uint32_t(d));                        \
  else                                                                                                              \
    transpose_heads_kernel<W, int64_t><<<grid_for(cnt), kThreads, 0, stream_>>>(xp, op, a, b, d)
  if (row % 16 == 0 && vectorizable(DType::f32, 4, {x.data(), out.data()})) {
    const int64_t dv = int64_t(row / 16);
    KRNL_TH(uint4, x.ptr<uint4>(), out.ptr<uint4>(), A, B, dv, A * B * dv);
  } else if (dtype_size(x.dtype()) == 4) {
    KRNL_TH(uint32_t, x.ptr<uint32_t>(), out.ptr<uint32_t>(), A, B, D, n);
  } else {
    KRNL_TH(uint16_t, x.ptr<uint16_t>(), out.ptr<uint16_t>(), A, B, D, n);
  }
#undef KRNL_TH
  check_launch("transpose_heads");
}

}  // namespace krnl::cuda
