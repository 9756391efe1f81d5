// Mixture-of-experts ops (op_list.h's notes): routing and its backward, the stable sort by expert,
// the gather, the weighted combine and its backward, and the grouped GEMMs. Expert ids, tokens,
// slots and offsets are written by earlier kernels of the same step: nothing here reads them on
// the host or waits for the stream, so every op records into a CUDA graph. The GPU trusts them
// (the CPU backend checks them); a kernel still never reads or writes outside a tensor for a bad
// one: an out-of-range id joins no expert, an out-of-range token or slot reads as NaN.
//
// Results are deterministic: no float atomics; every sum runs in an order fixed by the shapes.
//
// The grouped GEMMs (moe_gemm, moe_gemm_weight_grad) are tiled kernels whose index arithmetic
// lives in moe_tiles.cuh (checked on the host by tests/cuda_host/moe_tiles_check.cu). bf16 and
// f16 run on tensor cores (WMMA 16 x 16 x 16, f32 accumulation): 128 x 128 output tiles (64 x 128
// where experts average under 96 rows, or a row length is no multiple of 8; 128 x 32, 64 x 32 or
// 32 x 128 for a LoRA's r <= 32 columns or rows), steps of 32 over k, 8 warps, 16-byte loads and
// stores where every row length is a multiple of 8. Dense operands of 16-byte units go through
// shared memory in 4 stages that cp.async fills 3 steps ahead (one barrier a step); per-element
// or quantized ones double-buffered through registers. f32 runs
// on CUDA cores: 64 x 64 tiles, 4 x 4 outputs a thread (never TF32, as gemm.cu). moe_gemm's blocks
// take row tiles of one expert from a map that a one-block kernel builds from offsets on the
// device: ceil(P / BM) + E row tiles at most, the ones past the last exit at once. The kernels
// live in moe_gemm.cuh, which moe_quantized.cu includes too (moe_quantized_matmul).
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "moe_gemm.cuh"

namespace krnl::cuda {
namespace {

constexpr int kRowWarps = 8;  // route, route_backward, combine_backward: a warp a row (pair), 8 a block

__device__ __forceinline__ float qnan() { return __int_as_float(0x7fc00000); }

// ---- routing

// Row statistics of p = softmax(l) in f32, in every lane: m = max l, inv = 1 / sum exp(l - m).
__device__ __forceinline__ void row_softmax(DType dt, const void* logits, int64_t base, int E, int lane, float& m,
                                            float& inv) {
  float mx = -3.402823466e38f;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, ld(dt, logits, base + e));
  mx = warp_max(mx);
  float s = 0.f;
  for (int e = lane; e < E; e += 32) s += expf(ld(dt, logits, base + e) - mx);
  m = mx, inv = 1.f / warp_sum(s);
}

// p[e] of the row, the same value wherever it is formed.
__device__ __forceinline__ float prob(DType dt, const void* logits, int64_t base, int e, float m, float inv) {
  return expf(ld(dt, logits, base + e) - m) * inv;
}

// A warp a row. Pick k is the largest (key, -expert) strictly below pick k - 1 in that strict order
// (key = p, NaN as -1 below every p; a tie to the lower expert), as the CPU's partial_sort picks;
// the row's p are recomputed from the logits at each pass rather than kept (any E).
__global__ void moe_route_kernel(DType dt, const void* logits, int64_t N, int E, int K, int32_t* ids, float* weights,
                                 bool norm) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (t >= N) return;
  const int64_t base = t * E;
  float m, inv;
  row_softmax(dt, logits, base, E, lane, m, inv);
  float pk = __int_as_float(0x7f800000);  // the previous pick (+inf, -1): none yet
  int pe = -1;
  float sum = 0.f;
  for (int k = 0; k < K; ++k) {
    float bk = -__int_as_float(0x7f800000);  // below every key
    int be = 0x7fffffff;
    for (int e = lane; e < E; e += 32) {
      const float p = prob(dt, logits, base, e, m, inv), key = p == p ? p : -1.f;
      const bool below = key < pk || (key == pk && e > pe);
      if (below && (key > bk || (key == bk && e < be))) bk = key, be = e;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ok = __shfl_xor_sync(kFull, bk, o);
      const int oe = __shfl_xor_sync(kFull, be, o);
      if (ok > bk || (ok == bk && oe < be)) bk = ok, be = oe;
    }
    pk = bk, pe = be;  // K <= E: a candidate was left, so be is an expert
    const float p = prob(dt, logits, base, be, m, inv);
    sum += p;  // in pick order, as the CPU sums
    if (lane == 0) ids[t * K + k] = be, weights[t * K + k] = p;
  }
  if (norm && lane == 0)
    for (int k = 0; k < K; ++k) weights[t * K + k] = weights[t * K + k] / sum;
}

// A warp a row, as the CPU: dp[e] = dprobs[e] + the pick terms of expert e in k order; norm: term k
// = (dw_k - sum_j dw_j w_j) / S with w_j = p_j / S; dlogits = p (dp - sum_e p dp).
__global__ void moe_route_bwd_kernel(DType dt, const void* logits, const int32_t* ids, const float* dweights,
                                     const float* dprobs, void* dlogits, int64_t N, int E, int K, bool norm) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (t >= N) return;
  const int64_t base = t * E;
  float m, inv;
  row_softmax(dt, logits, base, E, lane, m, inv);
  const int32_t* it = ids + t * K;
  const float* g = dweights + t * K;
  auto picked = [&](int k) {
    const int32_t e = it[k];
    return e >= 0 && e < E ? prob(dt, logits, base, e, m, inv) : qnan();
  };
  float S = 0.f, gw = 0.f;
  if (norm) {
    for (int k = 0; k < K; ++k) S += picked(k);
    for (int k = 0; k < K; ++k) gw += g[k] * (picked(k) / S);
  }
  auto dp = [&](int e) {
    float d = dprobs ? dprobs[e] : 0.f;
    for (int k = 0; k < K; ++k)
      if (it[k] == e) d += norm ? (g[k] - gw) / S : g[k];
    return d;
  };
  float pd = 0.f;
  for (int e = lane; e < E; e += 32) pd += prob(dt, logits, base, e, m, inv) * dp(e);
  pd = warp_sum(pd);  // every read of another lane's logit is above: dlogits may be logits
  for (int e = lane; e < E; e += 32) {
    const float p = prob(dt, logits, base, e, m, inv);
    st(dt, dlogits, base + e, p * (dp(e) - pd));
  }
}

// ---- the sort: a counting sort in three kernels. Warps take runs of kSortRun pairs in order
// (run r: pairs r kSortRun on); count_kernel counts each run's pairs per expert, scan_kernel turns
// the counts (runs, E) into each run's first position per expert (expert-major: expert e's pairs of
// run r follow those of runs < r) and writes offsets, place_kernel walks each run again in order,
// 32 pairs at a time, ranking equal experts by lane (__match_any_sync): pairs keep their (t, k)
// order inside an expert.

constexpr int kSortRun = 512;
constexpr int kSortMaxExperts = 12288;  // a block's shared counters: 48 KiB

// Pair j's expert, or -1 past the run's end or out of range (then it joins no expert).
__device__ __forceinline__ int pair_expert(const int32_t* ids, int64_t j, int64_t end, int E) {
  if (j >= end) return -1;
  const int32_t x = ids[j];
  return x >= 0 && x < E ? int(x) : -1;
}

// Block b, warp w: run r = b W + w (W warps a block) into shared counters sh[w][E], then to counts[r].
__global__ void moe_sort_count_kernel(const int32_t* ids, int64_t P, int E, int64_t R, int32_t* counts) {
  extern __shared__ int32_t sh[];
  const int W = int(blockDim.x >> 5), w = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  for (int i = threadIdx.x; i < W * E; i += blockDim.x) sh[i] = 0;
  __syncthreads();
  const int64_t r = int64_t(blockIdx.x) * W + w;
  if (r < R) {
    int32_t* c = sh + w * E;
    const int64_t end = min(P, (r + 1) * kSortRun);
    for (int64_t j0 = r * kSortRun; j0 < end; j0 += 32) {
      const int x = pair_expert(ids, j0 + lane, end, E);
      const unsigned peers = __match_any_sync(kFull, x < 0 ? E + lane : x);  // lanes without an expert alone
      if (x >= 0 && lane == __ffs(peers) - 1) c[x] += __popc(peers);
      __syncwarp();
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < W * E; i += blockDim.x) {
    const int64_t rr = int64_t(blockIdx.x) * W + i / E;
    if (rr < R) counts[rr * E + i % E] = sh[i];
  }
}

// One block: totals per expert, their exclusive scan (offsets), then counts[r][e] becomes the first
// position of run r's pairs of expert e.
__global__ void moe_sort_scan_kernel(int64_t R, int E, int32_t* counts, int32_t* offsets) {
  extern __shared__ int32_t tot[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t s = 0;
    for (int64_t r = 0; r < R; ++r) s += counts[r * E + e];
    tot[e] = s;
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // lane l scans experts [l per, (l + 1) per)
    const int lane = int(threadIdx.x), per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
    int32_t mine = 0;
    for (int e = e0; e < e1; ++e) mine += tot[e];
    int32_t inc = mine;
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t v = __shfl_up_sync(kFull, inc, o);
      if (lane >= o) inc += v;
    }
    int32_t run = inc - mine;
    for (int e = e0; e < e1; ++e) {
      const int32_t n = tot[e];
      tot[e] = run, offsets[e] = run;
      run += n;
    }
    if (lane == 31) offsets[E] = inc;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t run = tot[e];
    for (int64_t r = 0; r < R; ++r) {
      const int32_t n = counts[r * E + e];
      counts[r * E + e] = run;
      run += n;
    }
  }
}

// The runs of count_kernel again, from their first positions: slot[j] and tokens[slot[j]] = j / K.
__global__ void moe_sort_place_kernel(const int32_t* ids, int64_t P, int E, int K, int64_t R, const int32_t* first,
                                      int32_t* tokens, int32_t* slot) {
  extern __shared__ int32_t sh[];
  const int W = int(blockDim.x >> 5), w = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  for (int i = threadIdx.x; i < W * E; i += blockDim.x) {
    const int64_t rr = int64_t(blockIdx.x) * W + i / E;
    sh[i] = rr < R ? first[rr * E + i % E] : 0;
  }
  __syncthreads();
  const int64_t r = int64_t(blockIdx.x) * W + w;
  if (r >= R) return;
  int32_t* c = sh + w * E;
  const int64_t end = min(P, (r + 1) * kSortRun);
  for (int64_t j0 = r * kSortRun; j0 < end; j0 += 32) {
    const int64_t j = j0 + lane;
    const int x = pair_expert(ids, j, end, E);
    const unsigned peers = __match_any_sync(kFull, x < 0 ? E + lane : x);
    if (x >= 0) {
      const int32_t s = c[x] + __popc(peers & ((1u << lane) - 1u));  // after this run's earlier pairs of x
      slot[j] = s;
      if (s < P) tokens[s] = int32_t(j / K);
    } else if (j < end) {
      slot[j] = -1;  // an id out of range: no slot
    }
    __syncwarp();
    if (x >= 0 && lane == __ffs(peers) - 1) c[x] += __popc(peers);
    __syncwarp();
  }
}

// ---- gather: out[p] = x[tokens[p]], whole rows; a token out of range gives a NaN row.

__global__ void moe_gather_vec_kernel(const int32_t* tokens, const uint4* __restrict__ x, uint4* __restrict__ out,
                                      int64_t P, int64_t units, int64_t N, uint4 nan) {
  KRNL_GRID_LOOP(i, P * units) {
    const int64_t p = i / units, c = i - p * units;
    const int32_t t = __ldg(tokens + p);
    out[i] = t >= 0 && t < N ? x[int64_t(t) * units + c] : nan;
  }
}

template <class W>
__global__ void moe_gather_kernel(const int32_t* tokens, const W* __restrict__ x, W* __restrict__ out, int64_t P,
                                  int64_t C, int64_t N, W nan) {
  KRNL_GRID_LOOP(i, P * C) {
    const int64_t p = i / C, c = i - p * C;
    const int32_t t = tokens[p];
    out[i] = t >= 0 && t < N ? x[int64_t(t) * C + c] : nan;
  }
}

// ---- combine: out[t] = beta out[t] + sum over k in order of w[t, k] ys[slot[t, k]], in f32.

// VEC consecutive columns a thread (C a multiple of VEC, 16-byte aligned rows); V = 1: one.
template <bool W16, int V>
__global__ void moe_combine_kernel(DType dt, const void* ys, const int32_t* slot, const float* w, void* out, int64_t N,
                                   int64_t C, int K, int64_t P, float beta) {
  const int64_t units = C / V;
  KRNL_GRID_LOOP(i, N * units) {
    const int64_t t = i / units, c = (i - t * units) * V;
    float acc[V];
#pragma unroll
    for (int q = 0; q < V; ++q) acc[q] = 0.f;
    for (int k = 0; k < K; ++k) {
      const int32_t s = slot[t * K + k];
      const float a = w ? w[t * K + k] : 1.f;
      float y[V];
      if (s < 0 || s >= P) {
#pragma unroll
        for (int q = 0; q < V; ++q) y[q] = qnan();
      } else if constexpr (V == 1) {
        y[0] = ld(dt, ys, int64_t(s) * C + c);
      } else {
        load_vec<W16>(dt, ys, int64_t(s) * C + c, y);
      }
#pragma unroll
      for (int q = 0; q < V; ++q) acc[q] = fmaf(a, y[q], acc[q]);
    }
    if (beta != 0.f) {  // beta == 0 never reads out
      float o[V];
      if constexpr (V == 1)
        o[0] = ld(dt, out, t * C + c);
      else
        load_vec<W16>(dt, out, t * C + c, o);
#pragma unroll
      for (int q = 0; q < V; ++q) acc[q] = fmaf(beta, o[q], acc[q]);
    }
    if constexpr (V == 1)
      st(dt, out, t * C + c, acc[0]);
    else
      store_vec<W16>(dt, out, t * C + c, acc);
  }
}

// A warp a pair (t, k) = pair: dys[s] = w dout[t] and dweights = dout[t] . ys[s] (lane partial sums
// in column order, then the warp's fixed tree), s = slot[pair]. dys may be ys: each element of ys is
// read by the thread that then writes it.
template <bool W16, int V>
__global__ void moe_combine_bwd_kernel(DType dt, const void* dout, const void* ys, const int32_t* slot, const float* w,
                                       void* dys, float* dweights, int64_t NK, int K, int64_t C, int64_t P) {
  const int lane = threadIdx.x & 31;
  const int64_t pair = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (pair >= NK) return;
  const int64_t t = pair / K;
  const int32_t s = slot[pair];
  const bool bad = s < 0 || s >= P;
  const float a = w[pair];
  float d = 0.f;
  for (int64_t c = int64_t(lane) * V; c < C; c += 32 * V) {
    float g[V], y[V];
    if constexpr (V == 1) {
      g[0] = ld(dt, dout, t * C + c);
      if (!bad) y[0] = ld(dt, ys, int64_t(s) * C + c);
    } else {
      load_vec<W16>(dt, dout, t * C + c, g);
      if (!bad) load_vec<W16>(dt, ys, int64_t(s) * C + c, y);
    }
    if (bad) continue;
#pragma unroll
    for (int q = 0; q < V; ++q) {
      d = fmaf(g[q], y[q], d);
      g[q] *= a;
    }
    if constexpr (V == 1)
      st(dt, dys, int64_t(s) * C + c, g[0]);
    else
      store_vec<W16>(dt, dys, int64_t(s) * C + c, g);
  }
  d = warp_sum(d);
  if (lane == 0) dweights[pair] = bad ? qnan() : d;
}

// Blocks of a warp-a-row kernel for n rows.
unsigned warp_rows_grid(int64_t n) { return unsigned((n + kRowWarps - 1) / kRowWarps); }

}  // namespace

void CudaBackend::moe_route(const Tensor& logits, const Tensor& ids, const Tensor& weights, bool norm) {
  OpTimer timer(this);
  const int64_t N = logits.size(0), E = logits.size(1), K = ids.size(1);
  if (N == 0) return;
  check_grid(N / kRowWarps + 1, "moe_route");
  moe_route_kernel<<<warp_rows_grid(N), 32 * kRowWarps, 0, stream_>>>(
      logits.dtype(), logits.data(), N, int(E), int(K), ids.ptr<int32_t>(), weights.ptr<float>(), norm);
  check_launch("moe_route");
}

void CudaBackend::moe_route_backward(const Tensor& logits, const Tensor& ids, const Tensor& dweights,
                                     const Tensor& dlogits, bool norm, const Tensor* dprobs) {
  OpTimer timer(this);
  const int64_t N = logits.size(0), E = logits.size(1), K = ids.size(1);
  if (N == 0) return;
  check_grid(N / kRowWarps + 1, "moe_route_backward");
  moe_route_bwd_kernel<<<warp_rows_grid(N), 32 * kRowWarps, 0, stream_>>>(
      logits.dtype(), logits.data(), ids.ptr<int32_t>(), dweights.ptr<float>(),
      dprobs ? dprobs->ptr<float>() : nullptr, dlogits.data(), N, int(E), int(K), norm);
  check_launch("moe_route_backward");
}

void CudaBackend::moe_sort(const Tensor& ids, const Tensor& tokens, const Tensor& slot, const Tensor& offsets) {
  OpTimer timer(this);
  const int64_t K = ids.size(1), P = ids.numel(), E = offsets.numel() - 1;
  if (E > kSortMaxExperts)
    throw std::invalid_argument("[moe_sort] " + std::to_string(E) + " experts: the CUDA sort takes at most " +
                                std::to_string(kSortMaxExperts));
  if (P > int64_t(INT32_MAX)) throw std::invalid_argument("[moe_sort] over 2^31 - 1 pairs");
  const int64_t R = (P + kSortRun - 1) / kSortRun;               // runs of pairs, a warp each
  const int W = int(std::min<int64_t>(8, kSortMaxExperts / E));  // warps a block: W E counters in 48 KiB
  const int64_t blocks = (R + W - 1) / W;
  Tensor counts = scratch(std::max<int64_t>(1, R * E), DType::i32);  // (R, E): counts, then first positions
  int32_t* c = counts.ptr<int32_t>();
  const size_t sh = size_t(W) * size_t(E) * 4;
  if (R > 0) {
    moe_sort_count_kernel<<<unsigned(blocks), 32 * W, sh, stream_>>>(ids.ptr<int32_t>(), P, int(E), R, c);
    check_launch("moe_sort");
  }
  moe_sort_scan_kernel<<<1, 256, size_t(E) * 4, stream_>>>(R, int(E), c, offsets.ptr<int32_t>());
  check_launch("moe_sort");
  if (R > 0) {
    moe_sort_place_kernel<<<unsigned(blocks), 32 * W, sh, stream_>>>(ids.ptr<int32_t>(), P, int(E), int(K), R, c,
                                                                     tokens.ptr<int32_t>(), slot.ptr<int32_t>());
    check_launch("moe_sort");
  }
}

void CudaBackend::moe_gather(const Tensor& x, const Tensor& tokens, const Tensor& out) {
  OpTimer timer(this);
  const int64_t N = x.size(0), C = x.size(1), P = tokens.numel();
  if (P == 0 || C == 0) return;
  const int64_t row = C * int64_t(dtype_size(x.dtype()));
  const uint32_t nan32 = dtype_size(x.dtype()) == 4 ? 0x7fc00000u
                         : x.dtype() == DType::bf16 ? 0x7fc07fc0u : 0x7e007e00u;  // a NaN in every element
  if (row % 16 == 0 && aligned16({x.data(), out.data()})) {
    moe_gather_vec_kernel<<<grid_for(P * (row / 16)), kThreads, 0, stream_>>>(
        tokens.ptr<int32_t>(), static_cast<const uint4*>(x.data()), static_cast<uint4*>(out.data()), P, row / 16, N,
        make_uint4(nan32, nan32, nan32, nan32));
  } else if (dtype_size(x.dtype()) == 4) {
    moe_gather_kernel<uint32_t><<<grid_for(P * C), kThreads, 0, stream_>>>(
        tokens.ptr<int32_t>(), x.ptr<uint32_t>(), out.ptr<uint32_t>(), P, C, N, nan32);
  } else {
    moe_gather_kernel<uint16_t><<<grid_for(P * C), kThreads, 0, stream_>>>(
        tokens.ptr<int32_t>(), x.ptr<uint16_t>(), out.ptr<uint16_t>(), P, C, N, uint16_t(nan32));
  }
  check_launch("moe_gather");
}

void CudaBackend::moe_combine(const Tensor& ys, const Tensor& slot, const Tensor* weights, const Tensor& out,
                              float beta) {
  OpTimer timer(this);
  const int64_t N = out.size(0), C = out.size(1), K = slot.size(1), P = ys.size(0);
  if (N == 0 || C == 0) return;
  const DType dt = ys.dtype();
  const float* w = weights ? weights->ptr<float>() : nullptr;
  const int32_t* sl = slot.ptr<int32_t>();
  if (vectorizable(dt, C, {ys.data(), out.data()})) {
    const int64_t units = N * (C / vec_width(dt));
    if (dt == DType::f32)
      moe_combine_kernel<false, 4><<<grid_for(units), kThreads, 0, stream_>>>(dt, ys.data(), sl, w, out.data(), N, C,
                                                                             int(K), P, beta);
    else
      moe_combine_kernel<true, 8><<<grid_for(units), kThreads, 0, stream_>>>(dt, ys.data(), sl, w, out.data(), N, C,
                                                                            int(K), P, beta);
  } else {
    moe_combine_kernel<false, 1><<<grid_for(N * C), kThreads, 0, stream_>>>(dt, ys.data(), sl, w, out.data(), N, C,
                                                                           int(K), P, beta);
  }
  check_launch("moe_combine");
}

void CudaBackend::moe_combine_backward(const Tensor& dout, const Tensor& ys, const Tensor& slot, const Tensor& weights,
                                       const Tensor& dys, const Tensor& dweights) {
  OpTimer timer(this);
  const int64_t N = dout.size(0), C = dout.size(1), K = slot.size(1), P = ys.size(0), NK = N * K;
  if (NK == 0) return;
  check_grid(NK / kRowWarps + 1, "moe_combine_backward");
  const DType dt = ys.dtype();
  const unsigned grid = warp_rows_grid(NK);
#define KRNL_CB(W16, V)                                                                                              \
  moe_combine_bwd_kernel<W16, V><<<grid, 32 * kRowWarps, 0, stream_>>>(dt, dout.data(), ys.data(),                   \
                                                                        slot.ptr<int32_t>(), weights.ptr<float>(), \
                                                                        dys.data(), dweights.ptr<float>(), NK,      \
                                                                        int(K), C, P)
  if (vectorizable(dt, C, {dout.data(), ys.data(), dys.data()})) {
    if (dt == DType::f32)
      KRNL_CB(false, 4);
    else
      KRNL_CB(true, 8);
  } else {
    KRNL_CB(false, 1);
  }
#undef KRNL_CB
  check_launch("moe_combine_backward");
}

void CudaBackend::require_tensor_cores(const char* op) const {
  if (std::atoi(compute_capability_.c_str()) < 8)
    throw std::runtime_error(std::string("[") + op + "] bf16 and f16 need compute capability 8.0 or later (this GPU: " +
                             compute_capability_ + ")");
}

void CudaBackend::moe_gemm(const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& out, bool transpose,
                           float alpha, float beta) {
  OpTimer timer(this);
  const int64_t P = x.size(0), E = w.size(0), O = w.size(1), I = w.size(2);
  const int64_t K = transpose ? I : O, N = transpose ? O : I;
  const DType dt = x.dtype();
  if (P == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: beta out over every row (moe_sort's offsets cover them all)
    moe_scale_kernel<<<grid_for(P * N), kThreads, 0, stream_>>>(dt, out.data(), P * N, beta);
    check_launch("moe_gemm");
    return;
  }
  const bool tc = dt != DType::f32;
  if (tc) require_tensor_cores("moe_gemm");
  const int64_t unit = 16 / int64_t(dtype_size(dt));
  const bool vec = K % unit == 0 && N % unit == 0 && aligned16({x.data(), w.data(), out.data()});
  const RowTiles t = row_tiles(*this, offsets, P, E, N, tc, vec, true, "moe_gemm");
  GemmParams p{x.data(), w.data(), out.data(), reinterpret_cast<const int4*>(t.map.data()), offsets.ptr<int32_t>(),
               P, 0, N, K, O * I, 0, t.tiles_n, dt, alpha, beta};
  if (transpose)
    launch_gemm<Mode::linear>(p, dt, t.bm, t.bn, vec, unsigned(t.blocks), stream_);
  else
    launch_gemm<Mode::input_grad>(p, dt, t.bm, t.bn, vec, unsigned(t.blocks), stream_);
  check_launch("moe_gemm");
}

void CudaBackend::moe_gemm_weight_grad(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& out,
                                       float alpha, float beta) {
  OpTimer timer(this);
  const int64_t P = a.size(0), M = a.size(1), N = b.size(1), E = out.size(0);
  const DType dt = a.dtype();
  if (M == 0 || N == 0) return;
  const bool tc = dt != DType::f32;
  if (tc) require_tensor_cores("moe_gemm_weight_grad");
  if (P > int64_t(INT32_MAX)) throw std::invalid_argument("[moe_gemm_weight_grad] over 2^31 - 1 rows");
  const int64_t unit = 16 / int64_t(dtype_size(dt));
  // bf16/f16: units of 8, so the tensor-core epilogue's 8-column groups hold for an f32 out too.
  const bool vec = M % unit == 0 && N % unit == 0 && aligned16({a.data(), b.data(), out.data()});
  int bm = tc && vec ? 128 : 64, bn = tc ? 128 : 64;
  if (tc && vec && N <= 32)  // a LoRA's r columns (gB_e = dy_e^T xa_e): narrow tiles
    bn = 32;
  else if (tc && vec && M <= 32)  // r rows (gA_e = dxa_e^T x_e)
    bm = 32;
  const int64_t tiles_m = (M + bm - 1) / bm, tiles_n = (N + bn - 1) / bn, blocks = E * tiles_m * tiles_n;
  check_grid(blocks, "moe_gemm_weight_grad");
  // Every block writes its tile, an expert without rows included (beta out).
  GemmParams p{a.data(), b.data(), out.data(), nullptr, offsets.ptr<int32_t>(), P, M, N, 0, 0, tiles_m, tiles_n,
               out.dtype(), alpha, beta};
  launch_gemm<Mode::weight_grad>(p, dt, bm, bn, vec, unsigned(blocks), stream_);
  check_launch("moe_gemm_weight_grad");
}

}  // namespace krnl::cuda
