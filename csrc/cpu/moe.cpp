// Mixture-of-experts ops on the CPU (op_list.h's notes): the reference of the contract. Routing
// and the combine are row loops on the pool; the grouped GEMMs are one BLAS call per expert,
// experts side by side on the pool (single-threaded BLAS) where calls may fan out.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "blas.h"
#include "convert.h"
#include "core/ops.h"
#include "core/thread_pool.h"
#include "cpu_backend.h"

namespace krnl::cpu {

namespace {

// p (E,) = softmax(l) in f32, as moe_route and its backward both form it.
void softmax_row(const float* l, int64_t E, float* p) {
  float m = l[0];
  for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
  float s = 0.f;
  for (int64_t e = 0; e < E; ++e) s += (p[e] = std::exp(l[e] - m));
  const float inv = 1.f / s;
  for (int64_t e = 0; e < E; ++e) p[e] *= inv;
}

// Experts' row ranges from moe_sort's offsets, checked: rising from 0 to P.
std::vector<int64_t> expert_rows(const char* op, const Tensor& offsets, int64_t P) {
  const int32_t* o = offsets.ptr<int32_t>();
  const int64_t E = offsets.numel() - 1;
  std::vector<int64_t> r(size_t(E + 1));
  for (int64_t e = 0; e <= E; ++e) {
    r[size_t(e)] = o[e];
    if ((e == 0 && o[0] != 0) || (e > 0 && o[e] < o[e - 1]) || (e == E && o[E] != P))
      throw std::invalid_argument(std::string("[") + op + "] offsets must rise from 0 to " + std::to_string(P) +
                                  " (moe_sort's), got " + std::to_string(o[e]) + " at " + std::to_string(e));
  }
  return r;
}

// A whole tensor as f32: in place for f32, else converted into buf.
const float* f32_of(const Tensor& t, std::vector<float>& buf) {
  if (t.dtype() == DType::f32) return t.ptr<float>();
  buf.resize(size_t(t.numel()));
  load_all(t.dtype(), t.data(), 0, t.numel(), buf.data());
  return buf.data();
}

// An output as f32 for the BLAS: in place for f32, else a copy (holding out where beta reads it)
// that store() writes back in out's dtype.
struct F32Out {
  const Tensor& out;
  std::vector<float> buf;
  float* data;
  F32Out(const Tensor& o, float beta) : out(o), data(o.dtype() == DType::f32 ? o.ptr<float>() : nullptr) {
    if (data) return;
    buf.assign(size_t(out.numel()), 0.f);
    if (beta != 0.f) load_all(out.dtype(), out.data(), 0, out.numel(), buf.data());
    data = buf.data();
  }
  void store() {
    if (out.dtype() != DType::f32) store_all(out.dtype(), buf.data(), out.numel(), out.data(), 0);
  }
};

// fn(e) for every expert: side by side on the pool with single-threaded BLAS where calls fan out.
template <class F>
void each_expert(int64_t E, F&& fn) {
  if (!blas_fan_out()) {
    for (int64_t e = 0; e < E; ++e) fn(e);
    return;
  }
  BlasSingleThread one_thread;
  ThreadPool::global().parallel_for(E, 1, [&](int64_t b, int64_t end) {
    BlasSingleThreadHere here;
    for (int64_t e = b; e < end; ++e) fn(e);
  });
}

}  // namespace

void CpuBackend::moe_route(const Tensor& logits, const Tensor& ids, const Tensor& weights, bool norm) {
  const int64_t N = logits.size(0), E = logits.size(1), K = ids.size(1);
  const DType dt = logits.dtype();
  int32_t* id = ids.ptr<int32_t>();
  float* w = weights.ptr<float>();
  for_rows(N, E, [&](int64_t t0, int64_t t1) {
    float* buf = scratch(0, E);
    float* p = scratch(1, E);
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int64_t t = t0; t < t1; ++t) {
      softmax_row(view(dt, logits.data(), t * E, E, buf), E, p);
      for (int64_t e = 0; e < E; ++e) order[size_t(e)] = int32_t(e);
      // Descending p, a tie to the lower expert (NaN below every p): a strict order, so partial_sort's
      // pick is unique.
      auto key = [&](int32_t e) { return p[e] == p[e] ? p[e] : -1.f; };
      std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t b) {
        return key(a) > key(b) || (key(a) == key(b) && a < b);
      });
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += p[order[size_t(k)]];
      for (int64_t k = 0; k < K; ++k) {
        id[t * K + k] = order[size_t(k)];
        w[t * K + k] = norm ? p[order[size_t(k)]] / s : p[order[size_t(k)]];
      }
    }
  });
}

void CpuBackend::moe_route_backward(const Tensor& logits, const Tensor& ids, const Tensor& dweights,
                                    const Tensor& dlogits, bool norm, const Tensor* dprobs) {
  const int64_t N = logits.size(0), E = logits.size(1), K = ids.size(1);
  ops::check_ids("moe_route_backward", "expert", "pair", ids.ptr<int32_t>(), N * K, E);
  const DType dt = logits.dtype();
  const int32_t* id = ids.ptr<int32_t>();
  const float* dw = dweights.ptr<float>();
  const float* bias = dprobs ? dprobs->ptr<float>() : nullptr;
  for_rows(N, E, [&](int64_t t0, int64_t t1) {
    float* buf = scratch(0, E);
    float* p = scratch(1, E);
    float* dp = scratch(2, E);
    for (int64_t t = t0; t < t1; ++t) {
      softmax_row(view(dt, logits.data(), t * E, E, buf), E, p);
      for (int64_t e = 0; e < E; ++e) dp[e] = bias ? bias[e] : 0.f;
      const int32_t* it = id + t * K;
      const float* g = dw + t * K;
      if (norm) {  // w_k = p_k / S: dp_k = (dw_k - sum_j dw_j w_j) / S
        float s = 0.f, gw = 0.f;
        for (int64_t k = 0; k < K; ++k) s += p[it[k]];
        for (int64_t k = 0; k < K; ++k) gw += g[k] * (p[it[k]] / s);
        for (int64_t k = 0; k < K; ++k) dp[it[k]] += (g[k] - gw) / s;
      } else {
        for (int64_t k = 0; k < K; ++k) dp[it[k]] += g[k];
      }
      float pd = 0.f;
      for (int64_t e = 0; e < E; ++e) pd += p[e] * dp[e];
      float* out = out_window(dt, dlogits.data(), t * E, buf);
      for (int64_t e = 0; e < E; ++e) out[e] = p[e] * (dp[e] - pd);
      flush(dt, out, E, dlogits.data(), t * E);
    }
  });
}

void CpuBackend::moe_sort(const Tensor& ids, const Tensor& tokens, const Tensor& slot, const Tensor& offsets) {
  const int64_t N = ids.size(0), K = ids.size(1), E = offsets.numel() - 1;
  ops::check_ids("moe_sort", "expert", "pair", ids.ptr<int32_t>(), N * K, E);
  const int32_t* id = ids.ptr<int32_t>();
  int32_t* off = offsets.ptr<int32_t>();
  int32_t* tok = tokens.ptr<int32_t>();
  int32_t* sl = slot.ptr<int32_t>();
  // A counting sort: pairs keep their (t, k) order inside an expert.
  std::vector<int32_t> next(size_t(E) + 1, 0);
  for (int64_t i = 0; i < N * K; ++i) ++next[size_t(id[i]) + 1];
  for (int64_t e = 0; e < E; ++e) next[size_t(e) + 1] += next[size_t(e)];
  std::copy(next.begin(), next.end(), off);
  for (int64_t i = 0; i < N * K; ++i) {
    const int32_t s = next[size_t(id[i])]++;
    sl[i] = s;
    tok[s] = int32_t(i / K);
  }
}

void CpuBackend::moe_gather(const Tensor& x, const Tensor& tokens, const Tensor& out) {
  gather_rows("moe_gather", "token", tokens, x, out);  // embedding_forward's rows, named as tokens
}

void CpuBackend::moe_combine(const Tensor& ys, const Tensor& slot, const Tensor* weights, const Tensor& out,
                             float beta) {
  const int64_t N = out.size(0), C = out.size(1), K = slot.size(1), P = ys.size(0);
  ops::check_ids("moe_combine", "slot", "pair", slot.ptr<int32_t>(), N * K, P);
  const DType dt = ys.dtype();
  const int32_t* sl = slot.ptr<int32_t>();
  const float* w = weights ? weights->ptr<float>() : nullptr;
  for_rows(N, C * K, [&](int64_t t0, int64_t t1) {
    float* acc = scratch(0, C);
    float* buf = scratch(1, C);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc, acc + C, 0.f);
      for (int64_t k = 0; k < K; ++k) {
        const float* y = view(dt, ys.data(), int64_t(sl[t * K + k]) * C, C, buf);
        const float a = w ? w[t * K + k] : 1.f;
        for (int64_t c = 0; c < C; ++c) acc[c] += a * y[c];
      }
      float* o = inout(dt, out.data(), t * C, beta == 0.f ? 0 : C, buf);
      for (int64_t c = 0; c < C; ++c) o[c] = beta == 0.f ? acc[c] : acc[c] + beta * o[c];
      flush(dt, o, C, out.data(), t * C);
    }
  });
}

void CpuBackend::moe_combine_backward(const Tensor& dout, const Tensor& ys, const Tensor& slot, const Tensor& weights,
                                      const Tensor& dys, const Tensor& dweights) {
  const int64_t N = dout.size(0), C = dout.size(1), K = slot.size(1), P = ys.size(0);
  ops::check_ids("moe_combine_backward", "slot", "pair", slot.ptr<int32_t>(), N * K, P);
  const DType dt = ys.dtype();
  const int32_t* sl = slot.ptr<int32_t>();
  const float* w = weights.ptr<float>();
  float* dw = dweights.ptr<float>();
  for_rows(N, C * K, [&](int64_t t0, int64_t t1) {
    float* g = scratch(0, C);
    float* buf = scratch(1, C);
    for (int64_t t = t0; t < t1; ++t) {
      load(dt, dout.data(), t * C, C, g);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t s = sl[t * K + k];
        const float* y = view(dt, ys.data(), s * C, C, buf);
        float d = 0.f;
        for (int64_t c = 0; c < C; ++c) d += g[c] * y[c];
        dw[t * K + k] = d;
        float* o = out_window(dt, dys.data(), s * C, buf);
        for (int64_t c = 0; c < C; ++c) o[c] = w[t * K + k] * g[c];
        flush(dt, o, C, dys.data(), s * C);
      }
    }
  });
}

void CpuBackend::moe_gemm(const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& out, bool transpose,
                          float alpha, float beta) {
  const int64_t P = x.size(0), E = w.size(0), O = w.size(1), I = w.size(2);
  const int64_t in = x.size(1), on = out.size(1);
  const std::vector<int64_t> r = expert_rows("moe_gemm", offsets, P);
  std::vector<float> xb, wb;
  const float* xf = f32_of(x, xb);
  const float* wf = f32_of(w, wb);
  F32Out f32out(out, beta);
  float* of = f32out.data;
  each_expert(E, [&](int64_t e) {
    const int64_t r0 = r[size_t(e)], n = r[size_t(e) + 1] - r0;
    if (n == 0 || on == 0) return;
    float* o = of + r0 * on;
    if (in == 0) {  // an empty sum: beta out (beta == 0 never reads out)
      for (int64_t i = 0; i < n * on; ++i) o[i] = beta == 0.f ? 0.f : beta * o[i];
      return;
    }
    // transpose: (n, I) x W_e^T, W_e stored (O, I); else (n, O) x W_e.
    sgemm(false, transpose, n, on, in, alpha, xf + r0 * in, in, wf + e * O * I, I, beta, o, on);
  });
  f32out.store();
}

void CpuBackend::moe_gemm_weight_grad(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& out,
                                      float alpha, float beta) {
  const int64_t P = a.size(0), M = a.size(1), N = b.size(1), E = out.size(0);
  const std::vector<int64_t> r = expert_rows("moe_gemm_weight_grad", offsets, P);
  std::vector<float> ab, bb;
  const float* af = f32_of(a, ab);
  const float* bf = f32_of(b, bb);
  F32Out f32out(out, beta);
  float* of = f32out.data;
  each_expert(E, [&](int64_t e) {
    const int64_t r0 = r[size_t(e)], n = r[size_t(e) + 1] - r0;
    float* o = of + e * M * N;
    if (n == 0) {
      for (int64_t i = 0; i < M * N; ++i) o[i] = beta == 0.f ? 0.f : beta * o[i];
      return;
    }
    if (M && N) sgemm(true, false, M, N, n, alpha, af + r0 * M, M, bf + r0 * N, N, beta, o, N);
  });
  f32out.store();
}

// Expert by expert through quantized_matmul on views: the same tiles and numerics as a dense
// model's quantized linears.
void CpuBackend::moe_quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases,
                                      const Tensor& offsets, const Tensor& out, bool transpose, int64_t group_size,
                                      int64_t bits, float beta, int64_t mode) {
  const std::vector<int64_t> r = expert_rows("moe_quantized_matmul", offsets, x.size(0));
  for (int64_t e = 0; e + 1 < int64_t(r.size()); ++e) {
    if (r[size_t(e) + 1] == r[size_t(e)]) continue;
    const Tensor be = biases ? biases->select(0, e) : Tensor();  // none in mode mxfp4
    quantized_matmul(x.slice(0, r[size_t(e)], r[size_t(e) + 1]), w.select(0, e), scales.select(0, e),
                     biases ? &be : nullptr, out.slice(0, r[size_t(e)], r[size_t(e) + 1]), transpose, group_size, bits,
                     beta, mode);
  }
}

}  // namespace krnl::cpu
