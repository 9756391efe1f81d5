// RMSNorm forward and backward on the CPU: rows over the thread pool; the weight gradient as
// fixed row-range partials summed in range order (deterministic).
#include <cmath>
#include <vector>

#include "convert.h"
#include "cpu_backend.h"
#include "ops_common.h"

namespace krnl::cpu {

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

}  // namespace krnl::cpu
