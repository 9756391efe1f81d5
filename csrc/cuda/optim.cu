// Optimizer ops over the flat fp32 parameter buffers: AdamW, Adam, SGD, Lion; per parameter 8-bit
// AdamW, Adafactor, Muon's two (each with the working-copy refresh), sumsq (fp64 partials, summed in a fixed order:
// the result does not depend on timing) and the non-finite flag.
#include <cmath>

#include "common.cuh"

namespace krnl::cuda {
namespace {

constexpr int kSumBlocks = 1024;  // fixed partial count: the summation order depends only on n

// The optimizer kernels' device scalars: where hyper is given, hyper (5,) [.., .., .., inv_denom,
// max_norm], sq (1,) and flag (1,) replace the scalar arguments (a replayed graph reads them
// afresh): every thread forms the same f32 values in the contract's order (op_list.h). Returns
// false on a non-finite step (nothing is written); sets *gs to the clip-and-unscale factor.
// __fmul_rn keeps nvcc from fusing norm's product into the add after it.
__device__ bool device_clip(const float* hyper, const float* sq, const int32_t* flag, float* gs) {
  const float s = *sq;
  if ((flag && *flag != 0) || (__float_as_uint(s) & 0x7f800000u) == 0x7f800000u) return false;
  const float inv_denom = hyper[3], max_norm = hyper[4];
  const float norm = __fmul_rn(sqrtf(s), inv_denom);
  const float clip = max_norm > 0.f ? fminf(1.f, max_norm / (norm + 1e-6f)) : 1.f;
  *gs = clip * inv_denom;
  return true;
}

// hyper [step_size, bc2_sqrt, decay, inv_denom, max_norm]. l2: Adam's weight decay (decay is
// weight_decay, added to the gradient) instead of AdamW's decoupled one.
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, float gs, float decay, float b1,
                             float b2, float step_size, float bc2_sqrt, float eps, bool l2, DType wd, void* working,
                             const float* hyper, const float* sq, const int32_t* flag) {
  if (hyper) {
    if (!device_clip(hyper, sq, flag, &gs)) return;
    step_size = hyper[0], bc2_sqrt = hyper[1], decay = hyper[2];
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float gi = g[i] * gs;
    float pi = p[i];
    if (l2) {
      gi += decay * pi;
    } else {
      pi -= decay * pi;
    }
    const float mi = b1 * m[i] + (1.f - b1) * gi;
    const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
    pi -= step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
    m[i] = mi, v[i] = vi, p[i] = pi;
    if (working) st(wd, working, i, pi);
  }
}

// hyper [lr, keep, in, inv_denom, max_norm]; buf null without momentum.
__global__ void sgd_kernel(float* p, const float* g, float* buf, int64_t n, float gs, float lr, float keep, float in,
                           float weight_decay, float momentum, bool nesterov, DType wd, void* working,
                           const float* hyper, const float* sq, const int32_t* flag) {
  if (hyper) {
    if (!device_clip(hyper, sq, flag, &gs)) return;
    lr = hyper[0], keep = hyper[1], in = hyper[2];
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float gi = g[i] * gs + weight_decay * p[i];
    if (buf) {
      const float bi = keep != 0.f ? keep * buf[i] + in * gi : in * gi;  // step 1 never reads buf
      buf[i] = bi;
      gi = nesterov ? gi + momentum * bi : bi;
    }
    const float pi = p[i] - lr * gi;
    p[i] = pi;
    if (working) st(wd, working, i, pi);
  }
}

// hyper [lr, decay, -, inv_denom, max_norm].
__global__ void lion_kernel(float* p, const float* g, float* m, int64_t n, float gs, float lr, float decay, float b1,
                            float b2, DType wd, void* working, const float* hyper, const float* sq,
                            const int32_t* flag) {
  if (hyper) {
    if (!device_clip(hyper, sq, flag, &gs)) return;
    lr = hyper[0], decay = hyper[1];
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = g[i] * gs;
    float pi = p[i];
    pi -= decay * pi;
    const float c = b1 * m[i] + (1.f - b1) * gi;
    pi -= lr * float((c > 0.f) - (c < 0.f));
    m[i] = b2 * m[i] + (1.f - b2) * gi;
    p[i] = pi;
    if (working) st(wd, working, i, pi);
  }
}

// ---- adafactor_update: six kernels in order (rows, cols, stats, unorm, finish, apply) over one
// parameter (B, R, C), as metal/optimizer.metal runs them; work (2 B R + B + 2,) f32 holds the
// per-row sums of params^2 and of u^2, each entry's max(mean(row), eps1), alpha and the step.
struct AdaArgs {
  int64_t B, R, C;
  float rho, w, decay, eps1, eps2, d, gs;
  const float *hyper, *sq;
  const int32_t* flag;
};

// The step's scalars into a (from hyper where given); false on a non-finite step.
__device__ bool ada_scalars(AdaArgs& a) {
  if (!a.hyper) return true;
  if (!device_clip(a.hyper, a.sq, a.flag, &a.gs)) return false;
  a.rho = a.hyper[0], a.w = a.hyper[1], a.decay = a.hyper[2];
  return true;
}

__device__ __forceinline__ float ada_lerp(float a, float b, float w) {  // torch.lerp's form
  return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.f - w);
}

__device__ __forceinline__ float ada_u(const AdaArgs& a, int64_t r, int64_t j, const float* g, const float* row,
                                       const float* col, const float* work) {
  const int64_t b = r / a.R;
  const float v = fmaxf(row[r] * col[b * a.C + j] / work[2 * a.B * a.R + b], a.eps1 * a.eps1);
  return g[r * a.C + j] * a.gs / sqrtf(v);
}

__global__ void adafactor_rows_kernel(AdaArgs a, const float* p, const float* g, float* row, float* work) {
  __shared__ float sh[32];
  if (!ada_scalars(a)) return;
  const int64_t r = blockIdx.x;
  float pp = 0.f, gg = 0.f;
  for (int64_t j = threadIdx.x; j < a.C; j += blockDim.x) {
    const float gi = g[r * a.C + j] * a.gs, pi = p[r * a.C + j];
    pp = fmaf(pi, pi, pp), gg = fmaf(gi, gi, gg);
  }
  pp = block_sum(pp, sh);
  gg = block_sum(gg, sh);
  if (threadIdx.x == 0) work[r] = pp, row[r] = ada_lerp(row[r], gg / float(a.C), a.w);
}

__global__ void adafactor_cols_kernel(AdaArgs a, const float* g, float* col) {
  if (!ada_scalars(a)) return;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < a.B * a.C; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = k / a.C, j = k % a.C;
    float acc = 0.f;
    for (int64_t i = 0; i < a.R; ++i) {
      const float gi = g[(b * a.R + i) * a.C + j] * a.gs;
      acc = fmaf(gi, gi, acc);
    }
    col[k] = ada_lerp(col[k], acc / float(a.R), a.w);
  }
}

__global__ void adafactor_stats_kernel(AdaArgs a, const float* row, float* work) {
  __shared__ float sh[32];
  if (!ada_scalars(a)) return;
  const int64_t rows = a.B * a.R;
  float acc = 0.f;
  for (int64_t k = threadIdx.x; k < rows; k += blockDim.x) acc += work[k];
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) work[2 * rows + a.B] = fmaxf(a.eps2, sqrtf(acc / (float(rows) * float(a.C)))) * a.rho;
  for (int64_t b = 0; b < a.B; ++b) {
    float rs = 0.f;
    for (int64_t i = threadIdx.x; i < a.R; i += blockDim.x) rs += row[b * a.R + i];
    rs = block_sum(rs, sh);
    if (threadIdx.x == 0) work[2 * rows + b] = fmaxf(rs / float(a.R), a.eps1);
  }
}

__global__ void adafactor_unorm_kernel(AdaArgs a, const float* g, const float* row, const float* col, float* work) {
  __shared__ float sh[32];
  if (!ada_scalars(a)) return;
  const int64_t r = blockIdx.x;
  float uu = 0.f;
  for (int64_t j = threadIdx.x; j < a.C; j += blockDim.x) {
    const float u = ada_u(a, r, j, g, row, col, work);
    uu = fmaf(u, u, uu);
  }
  uu = block_sum(uu, sh);
  if (threadIdx.x == 0) work[a.B * a.R + r] = uu;
}

__global__ void adafactor_finish_kernel(AdaArgs a, float* work) {
  __shared__ float sh[32];
  if (!ada_scalars(a)) return;
  const int64_t rows = a.B * a.R;
  float acc = 0.f;
  for (int64_t k = threadIdx.x; k < rows; k += blockDim.x) acc += work[rows + k];
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) {
    const float rms = sqrtf(acc / (float(rows) * float(a.C)));
    work[2 * rows + a.B + 1] = work[2 * rows + a.B] / fmaxf(1.f, rms / a.d);
  }
}

__global__ void adafactor_apply_kernel(AdaArgs a, float* p, const float* g, const float* row, const float* col,
                                       const float* work, DType wd, void* working) {
  if (!ada_scalars(a)) return;
  const int64_t rows = a.B * a.R, n = rows * a.C;
  const float step = work[2 * rows + a.B + 1], keep = 1.f - a.decay;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float pi = p[i] * keep - step * ada_u(a, i / a.C, i % a.C, g, row, col, work);
    p[i] = pi;
    if (working) st(wd, working, i, pi);
  }
}

// ---- muon_momentum (its kernel, then sumsq's over out, then the normalize kernel) and muon_update

__global__ void muon_momentum_kernel(const float* g, float* buf, float* out, int64_t n, float gs, float mu,
                                     bool nesterov, const float* hyper, const float* sq, const int32_t* flag) {
  if (hyper && !device_clip(hyper, sq, flag, &gs)) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = g[i] * gs;
    const float bi = ada_lerp(buf[i], gi, 1.f - mu);
    buf[i] = bi;
    out[i] = nesterov ? ada_lerp(gi, bi, mu) : bi;
  }
}

__global__ void muon_normalize_kernel(float* out, int64_t n, float eps, const float* total, const float* hyper,
                                      const float* sq, const int32_t* flag) {
  float gs;
  if (hyper && !device_clip(hyper, sq, flag, &gs)) return;
  const float denom = fmaxf(sqrtf(*total), eps);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] /= denom;
}

__global__ void muon_update_kernel(float* p, const float* x, int64_t n, float lr, float decay, float scale, DType wd,
                                   void* working, const float* hyper, const float* sq, const int32_t* flag) {
  if (hyper) {
    float gs;
    if (!device_clip(hyper, sq, flag, &gs)) return;
    lr = hyper[0], decay = hyper[2];
  }
  const float step = lr * scale, keep = 1.f - decay;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float pi = p[i] * keep - step * x[i];
    p[i] = pi;
    if (working) st(wd, working, i, pi);
  }
}

// ---- adamw8bit_update: a block of 256 threads per block of 256 elements, as metal/optimizer.metal

// the code of x in a sorted 256-entry map: how many midpoints lie below x (bucketize's count)
__device__ unsigned map_code(float x, const float* map) {
  unsigned lo = 0, hi = 255;
  while (lo < hi) {
    const unsigned mid = (lo + hi) / 2;
    if ((map[mid] + map[mid + 1]) / 2.f < x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// a full block multiplies by the reciprocal of its absmax, a partial one divides (bitsandbytes')
__device__ unsigned quantize8(float x, float amax, bool full, const float* map) {
  const float am = fmaxf(amax, 1e-38f);
  return map_code(fminf(1.f, fmaxf(-1.f, full ? x * (1.f / am) : x / am)), map);
}

__global__ void adamw8bit_kernel(float* p, const float* g, uint32_t* mc, uint32_t* vc, float* m_absmax,
                                 float* v_absmax, const float* m_map, const float* v_map, int64_t n, float gs,
                                 float decay, float b1, float b2, float c1, float c2, float step_size, float bc2_sqrt,
                                 float eps, DType wd, void* working, const float* hyper, const float* sq,
                                 const int32_t* flag) {
  __shared__ float sh[32];
  __shared__ unsigned mq[256], vq[256];
  if (hyper) {
    if (!device_clip(hyper, sq, flag, &gs)) return;
    step_size = hyper[0], bc2_sqrt = hyper[1], decay = hyper[2];
  }
  const int64_t b = blockIdx.x, i0 = b * 256, i = i0 + threadIdx.x;
  const int len = int(n - i0 < 256 ? n - i0 : 256);
  const bool on = int(threadIdx.x) < len;
  float mi = 0.f, vi = 0.f;
  if (on) {
    const unsigned sh8 = 8 * unsigned(i % 4), mcode = (mc[i / 4] >> sh8) & 0xffu, vcode = (vc[i / 4] >> sh8) & 0xffu;
    const float gi = g[i] * gs;
    float pi = p[i] * (1.f - decay);
    mi = fmaf(c1, gi, b1 * (m_map[mcode] * m_absmax[b]));
    vi = b2 * (v_map[vcode] * v_absmax[b]) + c2 * gi * gi;
    pi -= step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
    p[i] = pi;
    if (working) st(wd, working, i, pi);
  }
  const float ma = block_max(fabsf(mi), sh), va = block_max(fabsf(vi), sh);
  const bool full = len == 256;
  mq[threadIdx.x] = on ? quantize8(mi, ma, full, m_map) : 0u;
  vq[threadIdx.x] = on ? quantize8(vi, va, full, v_map) : 0u;
  __syncthreads();
  if (int(threadIdx.x) < (len + 3) / 4) {
    const int k = 4 * threadIdx.x;
    mc[i0 / 4 + threadIdx.x] = mq[k] | (mq[k + 1] << 8) | (mq[k + 2] << 16) | (mq[k + 3] << 24);
    vc[i0 / 4 + threadIdx.x] = vq[k] | (vq[k + 1] << 8) | (vq[k + 2] << 16) | (vq[k + 3] << 24);
  }
  if (threadIdx.x == 0) m_absmax[b] = full ? ma : fmaxf(ma, 1e-38f), v_absmax[b] = full ? va : fmaxf(va, 1e-38f);
}

__global__ void sumsq_partial_kernel(DType dt, const void* x, int64_t n, double* part) {
  __shared__ double sh[kThreads];
  double acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double v = ld(dt, x, i);
    acc += v * v;
  }
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {  // tree in a fixed shape
    if (int(threadIdx.x) < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) part[blockIdx.x] = sh[0];
}

__global__ void sumsq_final_kernel(const double* part, int parts, float* out) {
  double s = 0;
  for (int i = 0; i < parts; ++i) s += part[i];
  *out = float(s);
}

// Exponent all ones = inf or NaN, tested on the raw bits. The flag is only ever set, never
// cleared (the caller zeroes it once for many tensors).
__global__ void nonfinite_kernel(DType dt, const void* x, int64_t n, int32_t* flag) {
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (dt == DType::f32) {
      bad |= (static_cast<const uint32_t*>(x)[i] & 0x7f800000u) == 0x7f800000u;
    } else {
      const uint16_t e = dt == DType::f16 ? 0x7c00 : 0x7f80;
      bad |= (static_cast<const uint16_t*>(x)[i] & e) == e;
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

}  // namespace

namespace {

// The pointers of an update's optional tensors.
struct Optional {
  void* working;
  DType wd;
  const float *hyper, *sq;
  const int32_t* flag;
};

template <typename A>
Optional optional(const A& a) {
  return {a.working.defined() ? a.working.data() : nullptr, a.working.defined() ? a.working.dtype() : DType::f32,
          a.hyper.defined() ? a.hyper.template ptr<float>() : nullptr,
          a.sq.defined() ? a.sq.template ptr<float>() : nullptr,
          a.flag.defined() ? a.flag.template ptr<int32_t>() : nullptr};
}

}  // namespace

void CudaBackend::adamw_update(const AdamWArgs& a) {
  OpTimer timer(this);
  const int64_t n = a.params.numel();
  if (!n) return;
  // Bias corrections in double on the host, as the CPU backend computes them.
  const double bc1 = 1.0 - std::pow(double(a.beta1), double(a.step));
  const double bc2 = 1.0 - std::pow(double(a.beta2), double(a.step));
  const float step_size = float(double(a.lr) / bc1), bc2_sqrt = float(std::sqrt(bc2));
  const float decay = a.decoupled ? a.lr * a.weight_decay : a.weight_decay;
  const Optional o = optional(a);
  adamw_kernel<<<grid_for(n), kThreads, 0, stream_>>>(
      a.params.ptr<float>(), a.grads.ptr<float>(), a.m.ptr<float>(), a.v.ptr<float>(), n, a.grad_scale, decay,
      a.beta1, a.beta2, step_size, bc2_sqrt, a.eps, !a.decoupled, o.wd, o.working, o.hyper, o.sq, o.flag);
  check_launch("adamw_update");
}

void CudaBackend::sgd_update(const SgdUpdateArgs& a) {
  OpTimer timer(this);
  const int64_t n = a.params.numel();
  if (!n) return;
  const bool momentum = a.momentum != 0.f, first = a.step == 1;
  const Optional o = optional(a);
  sgd_kernel<<<grid_for(n), kThreads, 0, stream_>>>(
      a.params.ptr<float>(), a.grads.ptr<float>(), momentum ? a.buf.ptr<float>() : nullptr, n, a.grad_scale, a.lr,
      first ? 0.f : a.momentum, first ? 1.f : 1.f - a.dampening, a.weight_decay, a.momentum, a.nesterov, o.wd,
      o.working, o.hyper, o.sq, o.flag);
  check_launch("sgd_update");
}

void CudaBackend::lion_update(const LionUpdateArgs& a) {
  OpTimer timer(this);
  const int64_t n = a.params.numel();
  if (!n) return;
  const Optional o = optional(a);
  lion_kernel<<<grid_for(n), kThreads, 0, stream_>>>(
      a.params.ptr<float>(), a.grads.ptr<float>(), a.m.ptr<float>(), n, a.grad_scale, a.lr, a.lr * a.weight_decay,
      a.beta1, a.beta2, o.wd, o.working, o.hyper, o.sq, o.flag);
  check_launch("lion_update");
}

void CudaBackend::adafactor_update(const AdafactorUpdateArgs& a) {
  OpTimer timer(this);
  const Shape& s = a.params.shape();
  const int64_t n = a.params.numel(), C = s.back(), R = s[s.size() - 2];
  if (!n) return;
  const int64_t B = n / (R * C), rows = B * R;
  Tensor work = scratch(2 * rows + B + 2);
  const Optional o = optional(a);
  const AdaArgs args{B, R, C, a.rho, a.beta2t, a.decay, a.eps1, a.eps2, a.d, a.grad_scale, o.hyper, o.sq, o.flag};
  float *p = a.params.ptr<float>(), *row = a.row.ptr<float>(), *col = a.col.ptr<float>(), *w = work.ptr<float>();
  const float* g = a.grads.ptr<float>();
  adafactor_rows_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(args, p, g, row, w);
  adafactor_cols_kernel<<<grid_for(B * C), kThreads, 0, stream_>>>(args, g, col);
  adafactor_stats_kernel<<<1, kThreads, 0, stream_>>>(args, row, w);
  adafactor_unorm_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(args, g, row, col, w);
  adafactor_finish_kernel<<<1, kThreads, 0, stream_>>>(args, w);
  adafactor_apply_kernel<<<grid_for(n), kThreads, 0, stream_>>>(args, p, g, row, col, w, o.wd, o.working);
  check_launch("adafactor_update");
}

void CudaBackend::muon_momentum(const MuonMomentumArgs& a) {
  const int64_t n = a.grads.numel();
  if (!n) return;
  const Optional o{nullptr, DType::f32, a.hyper.defined() ? a.hyper.ptr<float>() : nullptr,
                   a.sq.defined() ? a.sq.ptr<float>() : nullptr, a.flag.defined() ? a.flag.ptr<int32_t>() : nullptr};
  {
    OpTimer timer(this);
    muon_momentum_kernel<<<grid_for(n), kThreads, 0, stream_>>>(a.grads.ptr<float>(), a.buf.ptr<float>(),
                                                                a.out.ptr<float>(), n, a.grad_scale, a.momentum,
                                                                a.nesterov, o.hyper, o.sq, o.flag);
    check_launch("muon_momentum");
  }
  Tensor total = scratch(1);
  sumsq(a.out, total);  // the update's norm (a stale one on a skipped step, never used)
  OpTimer timer(this);
  muon_normalize_kernel<<<grid_for(n), kThreads, 0, stream_>>>(a.out.ptr<float>(), n, a.eps, total.ptr<float>(),
                                                               o.hyper, o.sq, o.flag);
  check_launch("muon_momentum");
}

void CudaBackend::muon_update(const MuonUpdateArgs& a) {
  OpTimer timer(this);
  const int64_t n = a.params.numel();
  if (!n) return;
  const Optional o = optional(a);
  muon_update_kernel<<<grid_for(n), kThreads, 0, stream_>>>(a.params.ptr<float>(), a.update.ptr<float>(), n, a.lr,
                                                            a.decay, a.scale, o.wd, o.working, o.hyper, o.sq, o.flag);
  check_launch("muon_update");
}

void CudaBackend::adamw8bit_update(const AdamW8bitArgs& a) {
  OpTimer timer(this);
  const int64_t n = a.params.numel();
  if (!n) return;
  const double bc1 = 1.0 - std::pow(double(a.beta1), double(a.step));
  const double bc2 = 1.0 - std::pow(double(a.beta2), double(a.step));
  const Optional o = optional(a);
  adamw8bit_kernel<<<unsigned((n + 255) / 256), 256, 0, stream_>>>(
      a.params.ptr<float>(), a.grads.ptr<float>(), static_cast<uint32_t*>(a.m_codes.data()),
      static_cast<uint32_t*>(a.v_codes.data()), a.m_absmax.ptr<float>(), a.v_absmax.ptr<float>(), a.m_map.ptr<float>(),
      a.v_map.ptr<float>(), n, a.grad_scale, a.lr * a.weight_decay, a.beta1, a.beta2,
      a.beta1_complement > 0.f ? a.beta1_complement : 1.f - a.beta1,
      a.beta2_complement > 0.f ? a.beta2_complement : 1.f - a.beta2, float(double(a.lr) / bc1),
      float(std::sqrt(bc2)), a.eps, o.wd, o.working, o.hyper, o.sq, o.flag);
  check_launch("adamw8bit_update");
}

void CudaBackend::sumsq(const Tensor& x, const Tensor& out) {
  OpTimer timer(this);
  const int64_t n = x.numel();
  Tensor part64 = scratch(2 * kSumBlocks, DType::f32);  // (kSumBlocks,) f64 partials in f32-sized storage
  double* p = static_cast<double*>(part64.data());
  sumsq_partial_kernel<<<kSumBlocks, kThreads, 0, stream_>>>(x.dtype(), x.data(), n, p);
  sumsq_final_kernel<<<1, 1, 0, stream_>>>(p, kSumBlocks, out.ptr<float>());
  check_launch("sumsq");
}

void CudaBackend::nonfinite(const Tensor& x, const Tensor& flag) {
  OpTimer timer(this);
  const int64_t n = x.numel();
  if (!n) return;
  nonfinite_kernel<<<grid_for(n), kThreads, 0, stream_>>>(x.dtype(), x.data(), n, flag.ptr<int32_t>());
  check_launch("nonfinite");
}

}  // namespace krnl::cuda
