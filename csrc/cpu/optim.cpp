// Optimizer ops on the CPU: AdamW (with the working-copy refresh), sumsq (double partials summed
// in a fixed order) and the non-finite flag.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "convert.h"
#include "cpu_backend.h"

namespace krnl::cpu {

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
