// Embedding forward/backward and cross-entropy on the CPU; their ids and targets are checked here
// (the data-dependent errors).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "convert.h"
#include "core/ops.h"
#include "cpu_backend.h"
#include "vmath.h"

namespace krnl::cpu {

// ---- embedding

void gather_rows(const char* op, const char* what, const Tensor& ids, const Tensor& table, const Tensor& out) {
  const int64_t V = table.size(0), C = table.size(1), n = ids.numel();
  ops::check_ids(op, what, "position", ids.ptr<int32_t>(), n, V);
  const int32_t* id = ids.ptr<int32_t>();
  const size_t row_bytes = size_t(C) * dtype_size(table.dtype());
  const char* src = static_cast<const char*>(table.data());
  char* dst = static_cast<char*>(out.data());
  for_rows(n, C, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) std::memcpy(dst + size_t(t) * row_bytes, src + size_t(id[t]) * row_bytes, row_bytes);
  });
}

void CpuBackend::embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out) {
  gather_rows("embedding_forward", "id", ids, table, out);
}

void CpuBackend::embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  const int64_t V = dtable.size(0), C = dtable.size(1), n = ids.numel();
  ops::check_ids("embedding_backward", "id", "position", ids.ptr<int32_t>(), n, V);
  if (n == 0 || C == 0) return;
  const int32_t* id = ids.ptr<int32_t>();
  float* tab = dtable.ptr<float>();
  const DType dt = dout.dtype();
  // Threads own column ranges and walk tokens in order: no races on repeated ids, and each
  // element sums in token order as a serial loop would.
  const int64_t grain = std::max<int64_t>(64, kGrainElems / n);
  ThreadPool::global().parallel_for(C, grain, [&](int64_t c0, int64_t c1) {
    float* buf = scratch(0, c1 - c0);
    for (int64_t t = 0; t < n; ++t) {
      const float* g = view(dt, dout.data(), t * C + c0, c1 - c0, buf);
      float* row = tab + int64_t(id[t]) * C + c0;
      for (int64_t c = 0; c < c1 - c0; ++c) row[c] += g[c];
    }
  });
}

// ---- loss

void CpuBackend::cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& loss,
                               const Tensor* dlogits, int32_t ignore_index, float scale, const Tensor* scale_by) {
  const int64_t T = logits.size(0), V = logits.size(1);
  if (scale_by) scale = scale * scale_by->ptr<float>()[0];  // the factor formed once, in f32
  ops::check_ids("cross_entropy", "target", "row", targets.ptr<int32_t>(), T, V, &ignore_index);
  const int32_t* tg = targets.ptr<int32_t>();
  float* lo = loss.ptr<float>();
  const DType dt = logits.dtype();
  for_rows(T, V, [&](int64_t t0, int64_t t1) {
    float* buf = scratch(0, V);
    for (int64_t t = t0; t < t1; ++t) {
      const int32_t y = tg[t];
      if (y == ignore_index) {
        lo[t] = 0.f;
        if (dlogits) std::memset(at(dt, dlogits->data(), t * V), 0, size_t(V) * dtype_size(dt));  // +0 is all-zero bits
        continue;
      }
      const float* xr = view(dt, logits.data(), t * V, V, buf);
      float mx, se;
      max_sumexp(xr, V, mx, se);  // one pass, online max and sum-exp
      const float xt = xr[y];     // read before dlogits (which may alias logits) is written
      lo[t] = mx + std::log(se) - xt;
      if (!dlogits) continue;
      const float inv = 1.f / se;
      float* o = out_window(dt, dlogits->data(), t * V, buf);  // same scratch: elementwise in place
      for (int64_t j = 0; j < V; ++j) o[j] = xr[j] - mx;
      exp_inplace(o, V);
      const float ey = o[y];
      for (int64_t j = 0; j < V; ++j) o[j] = scale * (o[j] * inv);
      o[y] = scale * (ey * inv - 1.f);
      flush(dt, o, V, dlogits->data(), t * V);
    }
  });
}

}  // namespace krnl::cpu
