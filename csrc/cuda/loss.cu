// Embedding forward/backward and cross-entropy. Their id range checks are data-dependent: the
// ids are copied to the host (after the queued work that may have written them) and checked
// there, so a bad id raises ValueError at the call, with the CPU backend's message. A graph capture
// cannot read them (they change between replays): there the kernels' own guard writes NaN for an
// id out of range instead of reading outside the table.
#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.cuh"
#include "core/ops.h"

namespace krnl::cuda {
namespace {

// out[t] = table[id[t]]: whole rows of C elements of width W bytes.
template <class W>
__global__ void embedding_fwd_kernel(const int32_t* ids, const W* __restrict__ table, W* __restrict__ out, int64_t n,
                                     int64_t C, int64_t V, W nan) {
  const int64_t total = n * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / C, c = i % C;
    const int32_t id = ids[t];
    out[i] = id >= 0 && id < V ? table[int64_t(id) * C + c] : nan;
  }
}

// The same in 16-byte units, for rows of whole units on 16-byte aligned buffers: the per-element
// form's 2-byte moves and 64-bit divisions copied a W3 embedding (4096 x 4096 bf16) at 1.4 TB/s.
__global__ void embedding_fwd_vec_kernel(const int32_t* ids, const uint4* __restrict__ table, uint4* __restrict__ out,
                                         int64_t n, int64_t units, int64_t V, uint4 nan) {
  const int64_t total = n * units;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / units, c = i - t * units;
    const int32_t id = __ldg(ids + t);
    out[i] = id >= 0 && id < V ? table[int64_t(id) * units + c] : nan;
  }
}

// One block row per distinct id (blockIdx.x), columns across threads: the id's tokens are added
// in token order onto the existing row, exactly the CPU backend's summation order.
__global__ void embedding_bwd_kernel(const int32_t* uniq, const int32_t* offs, const int32_t* pos, DType dt,
                                     const void* dout, float* dtable, int64_t C) {
  const int64_t c = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const int64_t u = blockIdx.x;
  float* row = dtable + int64_t(uniq[u]) * C;
  float acc = row[c];
  for (int32_t k = offs[u]; k < offs[u + 1]; ++k) acc += ld(dt, dout, int64_t(pos[k]) * C + c);
  row[c] = acc;
}

// One block per row of logits: loss = logsumexp(x) - x[y]; dlogits (may alias logits) =
// scale * (softmax(x) - onehot(y)), scale times scale_by[0] where given (a per-step factor on the
// device, which a replayed graph reads afresh). Ignored rows get loss 0 and a zero gradient.
__global__ void cross_entropy_kernel(DType dt, const void* logits, const int32_t* targets, float* loss, void* dlogits,
                                     int64_t V, int32_t ignore_index, float scale, const float* scale_by) {
  __shared__ float sh[32];
  const int64_t t = blockIdx.x, base = t * V;
  const int32_t y = targets[t];
  if (y == ignore_index || y < 0 || y >= V) {  // out of range only in a replayed graph: NaN
    const float v = y == ignore_index ? 0.f : __int_as_float(0x7fc00000);
    if (threadIdx.x == 0) loss[t] = v;
    if (dlogits)
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) st(dt, dlogits, base + j, v);
    return;
  }
  float mx = -3.402823466e38f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, ld(dt, logits, base + j));
  mx = block_max(mx, sh);
  const float xt = ld(dt, logits, base + y);  // read before any thread writes the row
  float se = 0.f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) se += expf(ld(dt, logits, base + j) - mx);
  se = block_sum(se, sh);  // its barriers also order every read above before the writes below
  if (threadIdx.x == 0) loss[t] = mx + logf(se) - xt;
  if (!dlogits) return;
  const float inv = 1.f / se;
  if (scale_by) scale = scale * scale_by[0];  // the factor formed once, in f32
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float e = expf(ld(dt, logits, base + j) - mx) * inv;
    st(dt, dlogits, base + j, scale * (j == y ? e - 1.f : e));
  }
}

// A thread's U vectors of a row, at columns c0 + k step (none past V).
template <DType DT, int U, int VEC>
__device__ __forceinline__ void load_batch(const void* logits, int64_t base, int32_t c0, int32_t step, int32_t V,
                                           float (&v)[U][VEC]) {
#pragma unroll
  for (int k = 0; k < U; ++k)
    if (c0 + k * step < V) load_vec<DT != DType::f32>(DT, logits, base + c0 + k * step, v[k]);
}

// cross_entropy_kernel in 16-byte vectors where the row allows them, the dtype a compile-time
// constant (DT: the per-element dtype switches and both 16-bit conversions made the kernel
// ALU-bound). One read keeps each thread's running max and its sum of exponentials rescaled to
// it, a second writes. Each thread issues U loads before using any. exp(v - m) as
// exp2((v - m) log2 e): v - m is exact where it matters (near the max), so only the product
// rounds. On the H200 a (1024, 32000) bf16 chunk, recorded and replayed, took 90-100 us with the
// per-element dtype tests and expf, 74-80 us like this (dev/cuda/head_loss_probe.py);
// dev/cuda/ce_probe.cu compares the designs (256 threads and 8 loads a thread beat 1024
// threads and one, and a row held in registers).
template <DType DT>
__global__ void cross_entropy_vec_kernel(const void* logits, const int32_t* targets, float* loss, void* dlogits,
                                         int32_t V, int32_t ignore_index, float scale, const float* scale_by) {
  constexpr bool W16 = DT != DType::f32;
  constexpr int VEC = W16 ? 8 : 4, U = 8;
  constexpr float kLog2e = 1.4426950408889634f;
  __shared__ float sh[32];
  const int64_t base = int64_t(blockIdx.x) * V;
  const int32_t y = targets[blockIdx.x], step = int32_t(blockDim.x) * VEC;
  const bool skip = y == ignore_index || y < 0 || y >= V;
  float mx = -3.402823466e38f, se = 0.f;
  for (int32_t c0 = int32_t(threadIdx.x) * VEC; c0 < V; c0 += U * step) {
    float v[U][VEC];
    load_batch<DT>(logits, base, c0, step, V, v);
    float m = mx;
#pragma unroll
    for (int k = 0; k < U; ++k)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (c0 + k * step < V) m = fmaxf(m, v[k][e]);
    se *= exp2f((mx - m) * kLog2e);
    mx = m;
#pragma unroll
    for (int k = 0; k < U; ++k)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (c0 + k * step < V) se += exp2f((v[k][e] - m) * kLog2e);
  }
  const float xt = skip ? 0.f : ld(DT, logits, base + y);  // before the barriers that precede any write
  const float m = block_max(mx, sh);
  se = block_sum(se * exp2f((mx - m) * kLog2e), sh);  // a thread with no element: 0 * exp(-huge) = 0
  const float bad = y == ignore_index ? 0.f : __int_as_float(0x7fc00000);
  if (threadIdx.x == 0) loss[blockIdx.x] = skip ? bad : m + logf(se) - xt;
  if (!dlogits) return;
  const float inv = 1.f / se, s = scale_by ? scale * scale_by[0] : scale;
  for (int32_t c0 = int32_t(threadIdx.x) * VEC; c0 < V; c0 += U * step) {
    float v[U][VEC];
    load_batch<DT>(logits, base, c0, step, V, v);
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int32_t c = c0 + k * step;
      if (c >= V) continue;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float p = exp2f((v[k][e] - m) * kLog2e) * inv;
        v[k][e] = skip ? bad : s * (c + e == y ? p - 1.f : p);
      }
      store_vec<W16>(DT, dlogits, base + c, v[k]);
    }
  }
}

}  // namespace

void CudaBackend::embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out) {
  OpTimer timer(this);
  const int64_t V = table.size(0), C = table.size(1), n = ids.numel();
  if (!capturing())
    ops::check_ids("embedding_forward", "id", "position", read_i32(ids.data(), n, "embedding_forward").data(), n, V);
  if (n == 0 || C == 0) return;
  const int64_t row = C * int64_t(dtype_size(table.dtype()));
  const uint32_t nan32 = dtype_size(table.dtype()) == 4 ? 0x7fc00000u
                         : table.dtype() == DType::bf16 ? 0x7fc07fc0u : 0x7e007e00u;  // a NaN in every element
  if (row % 16 == 0 && reinterpret_cast<uintptr_t>(table.data()) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out.data()) % 16 == 0) {
    embedding_fwd_vec_kernel<<<grid_for(n * (row / 16)), kThreads, 0, stream_>>>(
        ids.ptr<int32_t>(), static_cast<const uint4*>(table.data()), static_cast<uint4*>(out.data()), n, row / 16, V,
        make_uint4(nan32, nan32, nan32, nan32));
  } else if (dtype_size(table.dtype()) == 4)
    embedding_fwd_kernel<uint32_t><<<grid_for(n * C), kThreads, 0, stream_>>>(
        ids.ptr<int32_t>(), table.ptr<uint32_t>(), out.ptr<uint32_t>(), n, C, V, nan32);
  else
    embedding_fwd_kernel<uint16_t><<<grid_for(n * C), kThreads, 0, stream_>>>(
        ids.ptr<int32_t>(), table.ptr<uint16_t>(), out.ptr<uint16_t>(), n, C, V, uint16_t(nan32));
  check_launch("embedding_forward");
}

void CudaBackend::embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  OpTimer timer(this);
  const int64_t V = dtable.size(0), C = dtable.size(1), n = ids.numel();
  if (capturing())
    throw std::runtime_error("[embedding_backward] plans its deterministic sum from the ids on the host, "
                             "so it cannot be recorded in a graph capture");
  std::vector<int32_t> id = read_i32(ids.data(), n, "embedding_backward");
  ops::check_ids("embedding_backward", "id", "position", id.data(), n, V);
  if (n == 0 || C == 0) return;
  // Group token positions by id, keeping token order within each id (stable sort).
  std::vector<int32_t> pos(static_cast<size_t>(n));
  std::iota(pos.begin(), pos.end(), 0);
  std::stable_sort(pos.begin(), pos.end(), [&](int32_t a, int32_t b) { return id[size_t(a)] < id[size_t(b)]; });
  std::vector<int32_t> uniq, offs;
  for (int64_t k = 0; k < n; ++k) {
    const int32_t v = id[size_t(pos[size_t(k)])];
    if (uniq.empty() || uniq.back() != v) {
      uniq.push_back(v);
      offs.push_back(int32_t(k));
    }
  }
  offs.push_back(int32_t(n));
  const int64_t U = int64_t(uniq.size());
  // One upload of [uniq (U) | offs (U + 1) | pos (n)].
  std::vector<int32_t> packed;
  packed.reserve(size_t(2 * U + 1 + n));
  packed.insert(packed.end(), uniq.begin(), uniq.end());
  packed.insert(packed.end(), offs.begin(), offs.end());
  packed.insert(packed.end(), pos.begin(), pos.end());
  Tensor plan = scratch(int64_t(packed.size()), DType::i32);
  upload(plan, packed.data());
  const int32_t* d = plan.ptr<int32_t>();
  dim3 grid(unsigned(U), unsigned((C + kThreads - 1) / kThreads));
  embedding_bwd_kernel<<<grid, kThreads, 0, stream_>>>(d, d + U, d + 2 * U + 1, dout.dtype(), dout.data(),
                                                       dtable.ptr<float>(), C);
  check_launch("embedding_backward");
}

void CudaBackend::cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& loss, const Tensor* dlogits,
                                int32_t ignore_index, float scale, const Tensor* scale_by) {
  OpTimer timer(this);
  const int64_t T = logits.size(0), V = logits.size(1);
  if (!capturing())
    ops::check_ids("cross_entropy", "target", "row", read_i32(targets.data(), T, "cross_entropy").data(), T, V,
                    &ignore_index);
  if (T == 0) return;
  if (vectorizable(logits.dtype(), V, {logits.data(), dlogits ? dlogits->data() : logits.data()}) && V < (1ll << 30)) {
#define KRNL_CE(DT)                                                                                              \
  cross_entropy_vec_kernel<DT><<<unsigned(T), std::min(row_threads(V / vec_width(DT)), 256), 0, stream_>>>(        \
      logits.data(), targets.ptr<int32_t>(), loss.ptr<float>(), dlogits ? dlogits->data() : nullptr, int32_t(V), \
      ignore_index, scale, scale_by ? scale_by->ptr<float>() : nullptr)
    switch (logits.dtype()) {
      case DType::bf16: KRNL_CE(DType::bf16); break;
      case DType::f16: KRNL_CE(DType::f16); break;
      default: KRNL_CE(DType::f32); break;
    }
#undef KRNL_CE
    check_launch("cross_entropy");
    return;
  }
  cross_entropy_kernel<<<unsigned(T), std::min(row_threads(V), 1024), 0, stream_>>>(
      logits.dtype(), logits.data(), targets.ptr<int32_t>(), loss.ptr<float>(), dlogits ? dlogits->data() : nullptr, V,
      ignore_index, scale, scale_by ? scale_by->ptr<float>() : nullptr);
  check_launch("cross_entropy");
}

}  // namespace krnl::cuda
