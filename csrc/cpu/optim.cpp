// Optimizer ops on the CPU: AdamW, Adam, 8-bit AdamW, SGD, Lion, Adafactor, Muon's (with the
// working-copy refresh), sumsq (double partials summed in a fixed order) and the non-finite flag.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "cpu_backend.h"

namespace krnl::cpu {

// ---- optimizer

namespace {

struct DeviceScalars {
  bool skip;         // a non-finite step: nothing is written
  float grad_scale;  // clip * inv_denom
};

// The optimizer ops' shared scalars from their device tensors (op_list.h), in f32 and in the
// contract's order: hyper[3] = inv_denom, hyper[4] = max_norm.
DeviceScalars device_scalars(const float* hyper, float sq, const int32_t* flag) {
  uint32_t bits;
  std::memcpy(&bits, &sq, 4);
  if ((flag && flag[0] != 0) || (bits & 0x7f800000u) == 0x7f800000u) return {true, 0.f};  // inf/NaN by its bits
  const float inv_denom = hyper[3], max_norm = hyper[4];
  const float norm = std::sqrt(sq) * inv_denom;
  const float clip = max_norm > 0.f ? std::min(1.f, max_norm / (norm + 1e-6f)) : 1.f;
  return {false, clip * inv_denom};
}

// hyper's values, or nullptr when the update is skipped; the grad scale into *gs. Without hyper,
// `fallback` (the call's own scalars) and `grad_scale` stand.
template <typename A>
const float* step_scalars(const A& a, const float* fallback, float grad_scale, float* gs) {
  *gs = grad_scale;
  if (!a.hyper.defined()) return fallback;
  const float* h = a.hyper.template ptr<float>();
  const DeviceScalars d = device_scalars(h, a.sq.template ptr<float>()[0],
                                         a.flag.defined() ? a.flag.template ptr<int32_t>() : nullptr);
  *gs = d.grad_scale;
  return d.skip ? nullptr : h;
}

}  // namespace

void CpuBackend::adamw_update(const AdamWArgs& a) {
  float* p = a.params.ptr<float>();
  const float* g = a.grads.ptr<float>();
  float* m = a.m.ptr<float>();
  float* v = a.v.ptr<float>();
  const bool working = a.working.defined(), l2 = !a.decoupled;
  const double bc1 = 1.0 - std::pow(double(a.beta1), double(a.step));
  const double bc2 = 1.0 - std::pow(double(a.beta2), double(a.step));
  const float host[3] = {float(double(a.lr) / bc1), float(std::sqrt(bc2)), l2 ? a.weight_decay : a.lr * a.weight_decay};
  float gs;
  const float* h = step_scalars(a, host, a.grad_scale, &gs);
  if (!h) return;  // a non-finite step: params, m, v and working stay as they are
  const float step_size = h[0], bc2_sqrt = h[1], decay = h[2];
  const float b1 = a.beta1, b2 = a.beta2, eps = a.eps;
  // the form a compile-time choice, so that each loop is the plain one the compiler vectorises
  auto run = [&](auto adam) {
    for_blocks(a.params.numel(), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        float gi = g[i] * gs;
        float pi = p[i];
        if constexpr (decltype(adam)::value) {
          gi += decay * pi;
        } else {
          pi -= decay * pi;
        }
        const float mi = b1 * m[i] + (1.f - b1) * gi;
        const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
        pi -= step_size * (mi / (std::sqrt(vi) / bc2_sqrt + eps));
        m[i] = mi, v[i] = vi, p[i] = pi;
      }
      if (working) store(a.working.dtype(), p + i0, i1 - i0, a.working.data(), i0);
    });
  };
  l2 ? run(std::true_type{}) : run(std::false_type{});
}

void CpuBackend::sgd_update(const SgdUpdateArgs& a) {
  float* p = a.params.ptr<float>();
  const float* g = a.grads.ptr<float>();
  const bool momentum = a.momentum != 0.f, first = a.step == 1;
  float* buf = momentum ? a.buf.ptr<float>() : nullptr;
  const float host[3] = {a.lr, first ? 0.f : a.momentum, first ? 1.f : 1.f - a.dampening};
  float gs;
  const float* h = step_scalars(a, host, a.grad_scale, &gs);
  if (!h) return;
  const float lr = h[0], keep = h[1], in = h[2], wd = a.weight_decay, mu = a.momentum;
  const bool nesterov = a.nesterov, working = a.working.defined();
  for_blocks(a.params.numel(), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float gi = g[i] * gs + wd * p[i];
      if (buf) {
        const float bi = keep != 0.f ? keep * buf[i] + in * gi : in * gi;  // step 1 never reads buf
        buf[i] = bi;
        gi = nesterov ? gi + mu * bi : bi;
      }
      p[i] -= lr * gi;
    }
    if (working) store(a.working.dtype(), p + i0, i1 - i0, a.working.data(), i0);
  });
}

void CpuBackend::lion_update(const LionUpdateArgs& a) {
  float* p = a.params.ptr<float>();
  const float* g = a.grads.ptr<float>();
  float* m = a.m.ptr<float>();
  const float host[2] = {a.lr, a.lr * a.weight_decay};
  float gs;
  const float* h = step_scalars(a, host, a.grad_scale, &gs);
  if (!h) return;
  const float lr = h[0], decay = h[1], b1 = a.beta1, b2 = a.beta2;
  const bool working = a.working.defined();
  for_blocks(a.params.numel(), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float gi = g[i] * gs;
      float pi = p[i];
      pi -= decay * pi;
      const float c = b1 * m[i] + (1.f - b1) * gi;
      pi -= lr * float((c > 0.f) - (c < 0.f));
      m[i] = b2 * m[i] + (1.f - b2) * gi;
      p[i] = pi;
    }
    if (working) store(a.working.dtype(), p + i0, i1 - i0, a.working.data(), i0);
  });
}

namespace {

// torch.lerp's form: exact at both ends (w = 1 gives b).
inline float lerp(float a, float b, float w) { return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.f - w); }

}  // namespace

void CpuBackend::adafactor_update(const AdafactorUpdateArgs& a) {
  float* p = a.params.ptr<float>();
  const float* g = a.grads.ptr<float>();
  float* row = a.row.ptr<float>();
  float* col = a.col.ptr<float>();
  const Shape& s = a.params.shape();
  const int64_t C = s.back(), R = s[s.size() - 2], n = a.params.numel(), B = n / std::max<int64_t>(R * C, 1);
  if (n == 0) return;
  const float host[3] = {a.rho, a.beta2t, a.decay};
  float gs;
  const float* h = step_scalars(a, host, a.grad_scale, &gs);
  if (!h) return;
  const float rho = h[0], w = h[1], decay = h[2], eps1 = a.eps1;
  // Per row: the sums of params^2 (before the decay) and g^2; the row's moment.
  std::vector<double> psq(static_cast<size_t>(B * R));
  for_rows(B * R, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      double pp = 0, gg = 0;
      for (int64_t j = 0; j < C; ++j) {
        const float gi = g[r * C + j] * gs;
        pp += double(p[r * C + j]) * p[r * C + j], gg += double(gi) * gi;
      }
      psq[size_t(r)] = pp;
      row[r] = lerp(row[r], float(gg / double(C)), w);
    }
  });
  double total = 0;
  for (double v : psq) total += v;
  const float alpha = std::max(a.eps2, float(std::sqrt(total / double(n)))) * rho;
  std::vector<float> row_mean(static_cast<size_t>(B));
  std::vector<double> acc(static_cast<size_t>(C));
  for (int64_t b = 0; b < B; ++b) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t j = 0; j < C; ++j) {
        const float gi = g[(b * R + i) * C + j] * gs;
        acc[size_t(j)] += double(gi) * gi;
      }
    }
    for (int64_t j = 0; j < C; ++j) col[b * C + j] = lerp(col[b * C + j], float(acc[size_t(j)] / double(R)), w);
    double rs = 0;
    for (int64_t i = 0; i < R; ++i) rs += row[b * R + i];
    row_mean[size_t(b)] = std::max(float(rs / double(R)), eps1);
  }
  // u = g / sqrt(max(row col / mean(row), eps1^2)), formed twice: for its norm, then for the update.
  auto u_at = [&](int64_t r, int64_t j) {
    const int64_t b = r / R;
    const float v = std::max(row[r] * col[b * C + j] / row_mean[size_t(b)], eps1 * eps1);
    return g[r * C + j] * gs / std::sqrt(v);
  };
  std::vector<double> usq(static_cast<size_t>(B * R));
  for_rows(B * R, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      double uu = 0;
      for (int64_t j = 0; j < C; ++j) {
        const float u = u_at(r, j);
        uu += double(u) * u;
      }
      usq[size_t(r)] = uu;
    }
  });
  total = 0;
  for (double v : usq) total += v;
  const float step = alpha / std::max(1.f, float(std::sqrt(total / double(n))) / a.d), keep = 1.f - decay;
  const bool working = a.working.defined();
  for_rows(B * R, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < C; ++j) p[r * C + j] = p[r * C + j] * keep - step * u_at(r, j);
    }
    if (working) store(a.working.dtype(), p + r0 * C, (r1 - r0) * C, a.working.data(), r0 * C);
  });
}

void CpuBackend::muon_momentum(const MuonMomentumArgs& a) {
  const float* g = a.grads.ptr<float>();
  float* buf = a.buf.ptr<float>();
  float* out = a.out.ptr<float>();
  const int64_t n = a.grads.numel();
  float gs;
  const float none[1] = {0.f};
  if (!step_scalars(a, none, a.grad_scale, &gs)) return;
  const float mu = a.momentum;
  const bool nesterov = a.nesterov;
  const int64_t parts = num_parts(n);
  std::vector<double> partial(static_cast<size_t>(parts), 0.0);
  for_parts(n, parts, [&](int64_t part, int64_t b, int64_t e) {
    double acc = 0;
    for (int64_t i = b; i < e; ++i) {
      const float gi = g[i] * gs;
      const float bi = lerp(buf[i], gi, 1.f - mu);
      const float u = nesterov ? lerp(gi, bi, mu) : bi;
      buf[i] = bi, out[i] = u;
      acc += double(u) * u;
    }
    partial[size_t(part)] = acc;
  });
  double total = 0;
  for (double v : partial) total += v;
  const float denom = std::max(float(std::sqrt(total)), a.eps);
  for_blocks(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] /= denom;
  });
}

void CpuBackend::muon_update(const MuonUpdateArgs& a) {
  float* p = a.params.ptr<float>();
  const float* x = a.update.ptr<float>();
  const float host[3] = {a.lr, 0.f, a.decay};
  float gs;
  const float* h = step_scalars(a, host, 1.f, &gs);
  if (!h) return;
  const float step = h[0] * a.scale, keep = 1.f - h[2];
  const bool working = a.working.defined();
  for_blocks(a.params.numel(), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) p[i] = p[i] * keep - step * x[i];
    if (working) store(a.working.dtype(), p + i0, i1 - i0, a.working.data(), i0);
  });
}

namespace {

// bitsandbytes' blockwise quantization of one block of m or v (its pure-PyTorch definition, which
// its native CPU quantizer approximates): the len values' absmax (stored; a partial last block's
// floored at 1e-38, as bitsandbytes stores it) and each value's code, the number of the map's
// midpoints below x / absmax clamped to [-1, 1] (a full block multiplies by the reciprocal, a
// partial one divides, as bitsandbytes does).
void quantize_block(const float* x, int64_t len, const float* mid, uint8_t* codes, float* absmax) {
  float amax = 0.f;
  for (int64_t i = 0; i < len; ++i) amax = std::max(amax, std::fabs(x[i]));
  const bool full = len == 256;
  const float am = std::max(amax, 1e-38f), inv = 1.f / am;
  *absmax = full ? amax : am;
  for (int64_t i = 0; i < len; ++i) {
    const float s = std::min(1.f, std::max(-1.f, full ? x[i] * inv : x[i] / am));
    codes[i] = uint8_t(std::lower_bound(mid, mid + 255, s) - mid);
  }
}

}  // namespace

void CpuBackend::adamw8bit_update(const AdamW8bitArgs& a) {
  const int64_t n = a.params.numel();
  if (n == 0) return;
  float* p = a.params.ptr<float>();
  const float* g = a.grads.ptr<float>();
  const double bc1 = 1.0 - std::pow(double(a.beta1), double(a.step));
  const double bc2 = 1.0 - std::pow(double(a.beta2), double(a.step));
  const float host[3] = {float(double(a.lr) / bc1), float(std::sqrt(bc2)), a.lr * a.weight_decay};
  float gs;
  const float* h = step_scalars(a, host, a.grad_scale, &gs);
  if (!h) return;
  const float step_size = h[0], bc2_sqrt = h[1], keep = 1.f - h[2], b1 = a.beta1, b2 = a.beta2, eps = a.eps;
  const float c1 = a.beta1_complement > 0.f ? a.beta1_complement : 1.f - b1;
  const float c2 = a.beta2_complement > 0.f ? a.beta2_complement : 1.f - b2;
  const float* m_map = a.m_map.ptr<float>();
  const float* v_map = a.v_map.ptr<float>();
  float m_mid[255], v_mid[255];
  for (int i = 0; i < 255; ++i) m_mid[i] = (m_map[i] + m_map[i + 1]) / 2.f, v_mid[i] = (v_map[i] + v_map[i + 1]) / 2.f;
  // one code per byte, element i at byte i (the i32 words' little-endian bytes)
  uint8_t* mc = static_cast<uint8_t*>(a.m_codes.data());
  uint8_t* vc = static_cast<uint8_t*>(a.v_codes.data());
  float* m_absmax = a.m_absmax.ptr<float>();
  float* v_absmax = a.v_absmax.ptr<float>();
  const bool working = a.working.defined();
  ThreadPool::global().parallel_for((n + 255) / 256, 16, [&](int64_t b0, int64_t b1_) {
    float mv[256], vv[256];
    for (int64_t b = b0; b < b1_; ++b) {
      const int64_t i0 = b * 256, len = std::min<int64_t>(256, n - i0);
      for (int64_t k = 0; k < len; ++k) {
        const int64_t i = i0 + k;
        const float gi = g[i] * gs;
        float pi = p[i] * keep;
        const float mi = std::fma(c1, gi, b1 * (m_map[mc[i]] * m_absmax[b]));  // torch's add(alpha=) fuses
        const float vi = b2 * (v_map[vc[i]] * v_absmax[b]) + c2 * gi * gi;
        pi -= step_size * (mi / (std::sqrt(vi) / bc2_sqrt + eps));
        mv[k] = mi, vv[k] = vi, p[i] = pi;
      }
      quantize_block(mv, len, m_mid, mc + i0, m_absmax + b);
      quantize_block(vv, len, v_mid, vc + i0, v_absmax + b);
      if (working) store(a.working.dtype(), p + i0, len, a.working.data(), i0);
    }
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
