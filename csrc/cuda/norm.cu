// RMSNorm forward and backward: one block per row, fp32 reductions. The weight gradient is a
// column sum over rows, done as fixed row-range partials summed in range order: deterministic,
// no atomics.
#include "common.cuh"

namespace krnl::cuda {
namespace {

// v as dtype dt stores it: a fused residual add rounds where a separate add's output would.
__device__ __forceinline__ float rounded(DType dt, float v) {
  switch (dt) {
    case DType::f16: return __half2float(__ushort_as_half(to_f16_bits(v)));
    case DType::bf16: return __uint_as_float(uint32_t(to_bf16_bits(v)) << 16);
    default: return v;
  }
}

// y = x * rstd * w per row of C; rstd = 1 / sqrt(mean(x^2) + eps). w is f32 or x's dtype. y's
// rows lie ldy apart (C, or a wider buffer's row stride). res (or null): x += res first, in place.
__global__ void rmsnorm_fwd_kernel(DType xd, void* x, const void* res, DType wd, const void* w, DType yd, void* y,
                                   float* rstd, int64_t C, int64_t ldy, float eps) {
  __shared__ float sh[32];
  const int64_t base = int64_t(blockIdx.x) * C, ybase = int64_t(blockIdx.x) * ldy;
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float v = ld(xd, x, base + c);
    if (res) {  // each element read and rewritten by one thread, before the barrier below
      v = rounded(xd, v + ld(xd, res, base + c));
      st(xd, x, base + c, v);
    }
    ss += v * v;
  }
  ss = block_sum(ss, sh);
  const float inv = 1.f / sqrtf(ss / float(C) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = inv;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) st(yd, y, ybase + c, ld(xd, x, base + c) * inv * ld(wd, w, c));
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w (+ res, after rounding to dx's dtype). dx may
// alias dy: each element is read (after the row's reduction) and written by the same thread. dx's
// and res's rows lie ldx and ldr apart.
__global__ void rmsnorm_bwd_kernel(DType dyd, const void* dy, DType xd, const void* x, DType wd, const void* w,
                                   const float* rstd, DType dxd, void* dx, const void* res, int64_t C, int64_t ldx,
                                   int64_t ldr) {
  __shared__ float sh[32];
  const int64_t base = int64_t(blockIdx.x) * C;
  const float inv = rstd[blockIdx.x];
  float dot = 0.f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    dot += ld(dyd, dy, base + c) * ld(wd, w, c) * ld(xd, x, base + c);
  const float m = block_sum(dot, sh) * inv / float(C);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xv = ld(xd, x, base + c);
    const float g = ld(dyd, dy, base + c) * ld(wd, w, c);
    float v = inv * (g - xv * inv * m);
    if (res) v = rounded(dxd, v) + ld(dxd, res, int64_t(blockIdx.x) * ldr + c);
    st(dxd, dx, int64_t(blockIdx.x) * ldx + c, v);
  }
}

// Register-resident rows (x, y, dy, dx of one dtype, C a multiple of the vector, aligned): each
// row read once with 16-byte loads. w is read per element (L1/L2-resident across rows).
template <bool W16, int NV>
__global__ void rmsnorm_fwd_reg_kernel(DType dt, void* x, const void* res, DType wd, const void* w, void* y,
                                       float* rstd, int64_t C, int64_t ldy, float eps) {
  constexpr int VEC = W16 ? 8 : 4;
  __shared__ float sh[32];
  const int64_t base = int64_t(blockIdx.x) * C;
  float v[NV][VEC];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c0 = (int64_t(k) * blockDim.x + threadIdx.x) * VEC;
    if (c0 < C) {
      load_vec<W16>(dt, x, base + c0, v[k]);
      if (res) {
        float r[VEC];
        load_vec<W16>(dt, res, base + c0, r);
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[k][e] = rounded(dt, v[k][e] + r[e]);
        store_vec<W16>(dt, x, base + c0, v[k]);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) ss += v[k][e] * v[k][e];
    }
  }
  const float inv = 1.f / sqrtf(block_sum(ss, sh) / float(C) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = inv;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c0 = (int64_t(k) * blockDim.x + threadIdx.x) * VEC;
    if (c0 < C) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[k][e] = v[k][e] * inv * ld(wd, w, c0 + e);
      store_vec<W16>(dt, y, int64_t(blockIdx.x) * ldy + c0, v[k]);
    }
  }
}

template <bool W16, int NV>
__global__ void rmsnorm_bwd_reg_kernel(DType dt, const void* dy, const void* x, DType wd, const void* w,
                                       const float* rstd, void* dx, const void* res, int64_t C, int64_t ldx,
                                       int64_t ldr) {
  constexpr int VEC = W16 ? 8 : 4;
  __shared__ float sh[32];
  const int64_t base = int64_t(blockIdx.x) * C;
  const float inv = rstd[blockIdx.x];
  float g[NV][VEC], xv[NV][VEC];
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c0 = (int64_t(k) * blockDim.x + threadIdx.x) * VEC;
    if (c0 < C) {
      load_vec<W16>(dt, dy, base + c0, g[k]);
      load_vec<W16>(dt, x, base + c0, xv[k]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        g[k][e] *= ld(wd, w, c0 + e);
        dot += g[k][e] * xv[k][e];
      }
    }
  }
  const float m = block_sum(dot, sh) * inv / float(C);  // barriers: every dy read precedes dx writes
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c0 = (int64_t(k) * blockDim.x + threadIdx.x) * VEC;
    if (c0 < C) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) g[k][e] = inv * (g[k][e] - xv[k][e] * inv * m);
      if (res) {
        load_vec<W16>(dt, res, int64_t(blockIdx.x) * ldr + c0, xv[k]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) g[k][e] = rounded(dt, g[k][e]) + xv[k][e];
      }
      store_vec<W16>(dt, dx, int64_t(blockIdx.x) * ldx + c0, g[k]);
    }
  }
}

// part[p][c] = sum over rows of range p of dy * x * rstd (coalesced over c).
__global__ void rmsnorm_dw_partial_kernel(DType dyd, const void* dy, DType xd, const void* x, const float* rstd,
                                          float* part, int64_t rows, int64_t C, int64_t rows_per_part) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const int64_t p = blockIdx.y, r0 = p * rows_per_part, r1 = min(rows, r0 + rows_per_part);
  float acc = 0.f;
  for (int64_t r = r0; r < r1; ++r) acc += ld(dyd, dy, r * C + c) * (ld(xd, x, r * C + c) * rstd[r]);
  part[p * C + c] = acc;
}

__global__ void rmsnorm_dw_reduce_kernel(const float* part, int64_t parts, int64_t C, float* dw) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  float s = part[c];
  for (int64_t p = 1; p < parts; ++p) s += part[p * C + c];
  dw[c] += s;  // accumulates, like the CPU backend
}

}  // namespace

void CudaBackend::rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, float eps,
                                  const Tensor* residual) {
  OpTimer timer(this);
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  if (rows == 0) return;
  const int64_t ldy = y.row_stride();  // C, or a row-strided 2-D y's (ops.cpp)
  const void* res = residual ? residual->data() : nullptr;
  const RegPlan rp = y.dtype() == x.dtype() && ldy % vec_width(y.dtype()) == 0
                         ? reg_plan(x.dtype(), C, {x.data(), y.data(), res ? res : x.data()})
                         : RegPlan{};
  if (rp.threads) {
    const bool w16 = x.dtype() != DType::f32;
#define KRNL_RMS_FWD(W, NV)                                                                                   \
  rmsnorm_fwd_reg_kernel<W, NV><<<unsigned(rows), rp.threads, 0, stream_>>>(                                  \
      x.dtype(), x.data(), res, w.dtype(), w.data(), y.data(), rstd.ptr<float>(), C, ldy, eps)
    KRNL_DISPATCH_REG(w16, rp.nv, KRNL_RMS_FWD)
#undef KRNL_RMS_FWD
    check_launch("rmsnorm_forward");
    return;
  }
  rmsnorm_fwd_kernel<<<unsigned(rows), std::min(row_threads(C), 512), 0, stream_>>>(
      x.dtype(), x.data(), res, w.dtype(), w.data(), y.dtype(), y.data(), rstd.ptr<float>(), C, ldy, eps);
  check_launch("rmsnorm_forward");
}

void CudaBackend::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                   const Tensor& dx, const Tensor* dw, const Tensor* residual) {
  OpTimer timer(this);
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  if (rows == 0) return;
  if (dw) {  // before dx: dx may overwrite dy
    const int64_t parts = std::min<int64_t>(rows, 128), per = (rows + parts - 1) / parts;
    Tensor part = scratch(parts * C);  // (parts, C) f32
    dim3 grid(unsigned((C + kThreads - 1) / kThreads), unsigned(parts));
    rmsnorm_dw_partial_kernel<<<grid, kThreads, 0, stream_>>>(dy.dtype(), dy.data(), x.dtype(), x.data(),
                                                              rstd.ptr<float>(), part.ptr<float>(), rows, C, per);
    rmsnorm_dw_reduce_kernel<<<unsigned((C + kThreads - 1) / kThreads), kThreads, 0, stream_>>>(
        part.ptr<float>(), parts, C, dw->ptr<float>());
    check_launch("rmsnorm_backward");
  }
  // row-strided 2-D dx and residual (ops.cpp): the register path wants their rows 16-byte aligned
  const int64_t ldx = dx.row_stride(), ldr = residual ? residual->row_stride() : C;
  const void* res = residual ? residual->data() : nullptr;
  const RegPlan rp = dy.dtype() == x.dtype() && dx.dtype() == x.dtype() && ldx % vec_width(x.dtype()) == 0 &&
                             ldr % vec_width(x.dtype()) == 0
                         ? reg_plan(x.dtype(), C, {dy.data(), x.data(), dx.data(), res ? res : x.data()})
                         : RegPlan{};
  if (rp.threads) {
    const bool w16 = x.dtype() != DType::f32;
#define KRNL_RMS_BWD(W, NV)                                                                                      \
  rmsnorm_bwd_reg_kernel<W, NV><<<unsigned(rows), rp.threads, 0, stream_>>>(                                  \
      x.dtype(), dy.data(), x.data(), w.dtype(), w.data(), rstd.ptr<float>(), dx.data(), res, C, ldx, ldr)
    KRNL_DISPATCH_REG(w16, rp.nv, KRNL_RMS_BWD)
#undef KRNL_RMS_BWD
    check_launch("rmsnorm_backward");
    return;
  }
  rmsnorm_bwd_kernel<<<unsigned(rows), std::min(row_threads(C), 512), 0, stream_>>>(
      dy.dtype(), dy.data(), x.dtype(), x.data(), w.dtype(), w.data(), rstd.ptr<float>(), dx.dtype(), dx.data(), res, C,
      ldx, ldr);
  check_launch("rmsnorm_backward");
}

}  // namespace krnl::cuda
