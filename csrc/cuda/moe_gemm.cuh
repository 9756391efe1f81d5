// The grouped GEMMs' kernels (moe.cu's moe_gemm and moe_gemm_weight_grad, moe_quantized.cu's
// moe_quantized_matmul), included by both files: the tile map, the tensor-core kernel (bf16, f16)
// and the CUDA-core one (f32), whose index arithmetic lives in moe_tiles.cuh (checked on the host by
// tests/cuda_host/moe_tiles_check.cu). moe.cu's head has the design. A kernel's BITS is 0 for a
// dense W_e, else the code width of a quantized one (moe::kMxfp4: mode mxfp4's E2M1 codes), whose
// B tiles moe_tiles.cuh's QuantTileLoader dequantizes as it loads them (no other change: A tiles,
// fragments and the epilogue are moe_gemm's).
#pragma once
#include <mma.h>

#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "moe_tiles.cuh"

namespace krnl::cuda {
namespace {  // each including file its own copy

using moe::BlockTile;
using moe::GemmParams;
using moe::Mode;
using moe::QuantParams;

#define KRNL_GRID_LOOP(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

constexpr unsigned kFull = 0xffffffffu;

inline bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16) return false;
  return true;
}

// map[t] = {expert, first row, rows} of row tile t of moe_gemm: each expert's rows offsets[e]:
// offsets[e + 1] in tiles of BM, expert by expert; {-1, 0, 0} past the last tile. One block: warp 0
// scans the experts' tile counts (lane l takes experts [l per, (l + 1) per)), then every thread
// marks the rest. Offsets are clamped into [0, P] (rising), so that bad ones cannot send a block
// outside x.
__global__ void moe_tile_map_kernel(const int32_t* offsets, int E, int P, int BM, int4* map, int T) {
  __shared__ int total;
  if (threadIdx.x < 32) {
    const int lane = int(threadIdx.x), per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
    auto range = [&](int e, int& lo, int& hi) {
      lo = min(max(offsets[e], 0), P);
      hi = min(max(offsets[e + 1], lo), P);
      return (hi - lo + BM - 1) / BM;
    };
    int mine = 0, lo, hi;
    for (int e = e0; e < e1; ++e) mine += range(e, lo, hi);
    int inc = mine;
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kFull, inc, o);
      if (lane >= o) inc += v;
    }
    int at = inc - mine;
    for (int e = e0; e < e1; ++e) {
      const int n = range(e, lo, hi);
      for (int j = 0; j < n; ++j, ++at)
        if (at < T) map[at] = make_int4(e, lo + j * BM, min(BM, hi - lo - j * BM), 0);
    }
    if (lane == 31) total = min(inc, T);
  }
  __syncthreads();
  for (int t = total + int(threadIdx.x); t < T; t += blockDim.x) map[t] = make_int4(-1, 0, 0, 0);
}

// out[o] = v (alpha and the empty-expert rule applied by the caller) + beta out[o].
__device__ __forceinline__ void put(DType odt, void* out, int64_t o, float v, float beta) {
  st(odt, out, o, beta != 0.f ? fmaf(beta, ld(odt, out, o), v) : v);
}

__device__ __forceinline__ void load8(DType dt, const void* p, int64_t i, float* v) {
  if (dt == DType::f32) {
    load_vec<false>(dt, p, i, v);
    load_vec<false>(dt, p, i + 4, v + 4);
  } else {
    load_vec<true>(dt, p, i, v);
  }
}
__device__ __forceinline__ void store8(DType dt, void* p, int64_t i, const float* v) {
  if (dt == DType::f32) {
    store_vec<false>(dt, p, i, v);
    store_vec<false>(dt, p, i + 4, v + 4);
  } else {
    store_vec<true>(dt, p, i, v);
  }
}

template <DType DT>
struct WmmaType;
template <>
struct WmmaType<DType::bf16> {
  using type = __nv_bfloat16;
};
template <>
struct WmmaType<DType::f16> {
  using type = __half;
};

// The tensor-core kernels' pieces. tc_step: warp's products over one step of the shared tiles as
// and bs (A row-major where stored [m][k], column-major where [k][m]; B column-major where stored
// [n][k]). tc_epilogue: each fragment through the warp's own 16 x 20 floats at smem (over the
// tiles, read no more), alpha and beta applied, into the output (VEC: 8 columns a lane).
template <class G, class WT, class T, class Acc>
__device__ __forceinline__ void tc_step(Acc (&acc)[WT::FM][WT::FN], const T* as, const T* bs, int warp) {
  namespace wmma = nvcuda::wmma;
  using ALayout = std::conditional_t<G::A_KM, wmma::col_major, wmma::row_major>;
  using BLayout = std::conditional_t<G::B_NK, wmma::col_major, wmma::row_major>;
#pragma unroll
  for (int kk = 0; kk < G::BK; kk += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, ALayout> af[WT::FM];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, BLayout> bf[WT::FN];
#pragma unroll
    for (int i = 0; i < WT::FM; ++i) wmma::load_matrix_sync(af[i], as + WT::a_frag(warp, i, kk), G::LDA);
#pragma unroll
    for (int j = 0; j < WT::FN; ++j) wmma::load_matrix_sync(bf[j], bs + WT::b_frag(warp, j, kk), G::LDB);
#pragma unroll
    for (int i = 0; i < WT::FM; ++i)
#pragma unroll
      for (int j = 0; j < WT::FN; ++j) wmma::mma_sync(acc[i][j], af[i], bf[j], acc[i][j]);
  }
}

template <class WT, bool VEC, class Acc>
__device__ __forceinline__ void tc_epilogue(Acc (&acc)[WT::FM][WT::FN], unsigned char* smem, int warp, int lane,
                                            const BlockTile& t, const GemmParams& p) {
  namespace wmma = nvcuda::wmma;
  float* scr = reinterpret_cast<float*>(smem) + warp * WT::EPI_FLOATS;
  const bool empty = t.kext == 0;  // weight_grad's expert without rows: beta out exactly
#pragma unroll
  for (int i = 0; i < WT::FM; ++i)
#pragma unroll
    for (int j = 0; j < WT::FN; ++j) {
      wmma::store_matrix_sync(scr, acc[i][j], WT::EPI_LD, wmma::mem_row_major);
      __syncwarp();
      const int fr = WT::frag_row(warp, i), fc = WT::frag_col(warp, j);
      if constexpr (VEC) {
        int r, c;
        WT::epi_vec(lane, r, c);
        // N a multiple of 8: the 8 columns lie all inside or all outside, as column c does
        const int64_t o = moe::out_index(t, p.N, fr + r, fc + c);
        if (o >= 0) {
          float v[8], old[8];
#pragma unroll
          for (int q = 0; q < 8; ++q) v[q] = empty ? 0.f : p.alpha * scr[r * WT::EPI_LD + c + q];
          if (p.beta != 0.f) {
            load8(p.odt, p.out, o, old);
#pragma unroll
            for (int q = 0; q < 8; ++q) v[q] = fmaf(p.beta, old[q], v[q]);
          }
          store8(p.odt, p.out, o, v);
        }
      } else {
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          int r, c;
          WT::epi_scalar(lane, q, r, c);
          const int64_t o = moe::out_index(t, p.N, fr + r, fc + c);
          if (o >= 0) put(p.odt, p.out, o, empty ? 0.f : p.alpha * scr[r * WT::EPI_LD + c], p.beta);
        }
      }
      __syncwarp();  // every lane's reads before the next fragment's store
    }
}

// The tensor-core kernel (bf16, f16) for per-element operands or a quantized B: moe_tiles.cuh's
// Geometry and WarpTiles. VEC: 16-byte operand and output units (the matrices' row lengths
// multiples of 8, 16-byte aligned; a quantized B's loads are its own). BITS > 0: B = W_e quantized
// (q), dequantized into the tiles in DT. Tiles double-buffered through registers (one barrier a step).
template <Mode MODE, DType DT, int BM, bool VEC, int BITS>
__global__ void __launch_bounds__(256) moe_gemm_tc_kernel(const GemmParams p, const QuantParams q) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  using G = moe::Geometry<MODE, BM, 128, 32, 2>;
  using WT = moe::WarpTiles<G>;
  using T = typename WmmaType<DT>::type;
  constexpr int kTileBytes = 2 * (G::A_TILE + G::B_TILE) * 2, kEpiBytes = 8 * WT::EPI_FLOATS * 4;
  static_assert((G::A_TILE * 2) % 32 == 0 && (G::B_TILE * 2) % 32 == 0, "WMMA's 32-byte aligned tiles");
  __shared__ __align__(128) unsigned char smem[kTileBytes > kEpiBytes ? kTileBytes : kEpiBytes];
  uint16_t* As = reinterpret_cast<uint16_t*>(smem);  // [2][A_TILE]
  uint16_t* Bs = As + 2 * G::A_TILE;                 // [2][B_TILE]
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;

  const BlockTile t = moe::block_tile<MODE, BM, G::BN>(p, blockIdx.x);
  if (!t.live) return;
  const uint16_t *A, *B;  // B: null for a quantized W_e (p.b)
  moe::operands<MODE>(p, t, A, B);
  [[maybe_unused]] const QuantParams qe = moe::quant_operand(q, t.e, MODE == Mode::linear ? p.N : p.K);
  moe::TileLoader<G::A_ROWS, G::A_COLS, G::LDA, 2, WT::NT, VEC> la;
  std::conditional_t<BITS == 0, moe::TileLoader<G::B_ROWS, G::B_COLS, G::LDB, 2, WT::NT, VEC>,
                     moe::QuantTileLoader<G::B_ROWS, G::B_COLS, G::LDB, DT, WT::NT, BITS>>
      lb;
  auto fetch = [&](int64_t k0) {
    if constexpr (BITS == 0)
      moe::fetch_step<MODE>(la, lb, tid, A, B, p, t, k0);
    else
      moe::fetch_step_q<MODE>(la, lb, tid, A, qe, p, t, k0);
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[WT::FM][WT::FN];
#pragma unroll
  for (int i = 0; i < WT::FM; ++i)
#pragma unroll
    for (int j = 0; j < WT::FN; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  const int64_t steps = (t.kext + G::BK - 1) / G::BK;  // the same in every thread: barriers below are uniform
  if (steps > 0) {
    fetch(0);
    la.commit(tid, As);
    lb.commit(tid, Bs);
    __syncthreads();
    for (int64_t s = 0; s < steps; ++s) {
      const int buf = int(s & 1);
      // Buffer buf ^ 1 was last read in step s - 1, before its closing barrier: the commit below
      // may overwrite it while other warps still read buf.
      if (s + 1 < steps) fetch((s + 1) * G::BK);
      tc_step<G, WT>(acc, reinterpret_cast<const T*>(As + buf * G::A_TILE),
                     reinterpret_cast<const T*>(Bs + buf * G::B_TILE), warp);
      if (s + 1 < steps) {
        la.commit(tid, As + (buf ^ 1) * G::A_TILE);
        lb.commit(tid, Bs + (buf ^ 1) * G::B_TILE);
      }
      __syncthreads();  // also: no warp reads the tiles any more once past the last
    }
  }
  tc_epilogue<WT, VEC>(acc, smem, warp, lane, t, p);
#else
  __trap();  // the host refuses 16-bit grouped GEMMs below compute capability 8.0
#endif
}

// The tensor-core kernel for dense operands of 16-byte units (bf16, f16; VEC): the same tiles,
// fragments and epilogue, the operand tiles in kStages shared buffers that cp.async fills
// kStages - 1 steps ahead of the one computed, so that a block keeps several steps' loads in
// flight with no registers holding them (the register-staged kernel above ran at about 100 TFLOP/s
// on an H100 at the MoE bench's sizes, bound by its one step of loads in flight). Dynamic shared
// memory: async_smem_bytes.
constexpr int kStages = 4;
template <class G, class WT>
constexpr int async_smem_bytes() {
  return std::max(kStages * (G::A_TILE + G::B_TILE) * 2, 8 * WT::EPI_FLOATS * 4);  // the tiles, or the epilogue's
}

template <Mode MODE, DType DT, int BM, int BN, int WARPS_M>
__global__ void __launch_bounds__(256, 2) moe_gemm_tc_async_kernel(const GemmParams p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  using G = moe::Geometry<MODE, BM, BN, 32, 2>;
  using WT = moe::WarpTiles<G, WARPS_M>;
  using T = typename WmmaType<DT>::type;
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* As = reinterpret_cast<uint16_t*>(smem);  // [kStages][A_TILE]
  uint16_t* Bs = As + kStages * G::A_TILE;           // [kStages][B_TILE]
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;

  const BlockTile t = moe::block_tile<MODE, BM, BN>(p, blockIdx.x);
  if (!t.live) return;
  const uint16_t *A, *B;
  moe::operands<MODE>(p, t, A, B);
  const moe::TileLoader<G::A_ROWS, G::A_COLS, G::LDA, 2, WT::NT, true> la{};
  const moe::TileLoader<G::B_ROWS, G::B_COLS, G::LDB, 2, WT::NT, true> lb{};
  const int64_t steps = (t.kext + G::BK - 1) / G::BK;  // the same in every thread: barriers below are uniform
  auto stage = [&](int64_t s) {  // step s's tiles into buffer s % kStages
    const int b = int(s % kStages);
    moe::copy_step<MODE>(la, lb, tid, A, B, p, t, s * G::BK, As + b * G::A_TILE, Bs + b * G::B_TILE);
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[WT::FM][WT::FN];
#pragma unroll
  for (int i = 0; i < WT::FM; ++i)
#pragma unroll
    for (int j = 0; j < WT::FN; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  // One group a step, empty past the last, so that "step s has landed" is always wait_group kStages - 2.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) stage(s);
    moe::cp_async_commit();
  }
  for (int64_t s = 0; s < steps; ++s) {
    moe::cp_async_wait<kStages - 2>();
    // Every thread's copies of step s visible; every warp past step s - 1, whose buffer the next
    // stage refills.
    __syncthreads();
    if (s + kStages - 1 < steps) stage(s + kStages - 1);
    moe::cp_async_commit();
    const int b = int(s % kStages);
    tc_step<G, WT>(acc, reinterpret_cast<const T*>(As + b * G::A_TILE), reinterpret_cast<const T*>(Bs + b * G::B_TILE),
                   warp);
  }
  moe::cp_async_wait<0>();
  __syncthreads();  // the epilogue's scratch lies over the tiles
  tc_epilogue<WT, true>(acc, smem, warp, lane, t, p);
#else
  __trap();  // as moe_gemm_tc_kernel's
#endif
}

// The CUDA-core kernel (f32): moe_tiles.cuh's Geometry (64 x 64 x 16) and ThreadTiles; BITS as the
// tensor-core kernel's.
template <Mode MODE, bool VEC, int BITS>
__global__ void __launch_bounds__(256) moe_gemm_f32_kernel(const GemmParams p, const QuantParams q) {
  using G = moe::Geometry<MODE, 64, 64, 16, 4>;
  using TT = moe::ThreadTiles;
  __shared__ __align__(16) float As[2 * G::A_TILE];
  __shared__ __align__(16) float Bs[2 * G::B_TILE];
  const int tid = int(threadIdx.x);
  const BlockTile t = moe::block_tile<MODE, G::BM, G::BN>(p, blockIdx.x);
  if (!t.live) return;
  const float *A, *B;
  moe::operands<MODE>(p, t, A, B);
  [[maybe_unused]] const QuantParams qe = moe::quant_operand(q, t.e, MODE == Mode::linear ? p.N : p.K);
  moe::TileLoader<G::A_ROWS, G::A_COLS, G::LDA, 4, TT::NT, VEC> la;
  std::conditional_t<BITS == 0, moe::TileLoader<G::B_ROWS, G::B_COLS, G::LDB, 4, TT::NT, VEC>,
                     moe::QuantTileLoader<G::B_ROWS, G::B_COLS, G::LDB, DType::f32, TT::NT, BITS>>
      lb;
  auto fetch = [&](int64_t k0) {
    if constexpr (BITS == 0)
      moe::fetch_step<MODE>(la, lb, tid, A, B, p, t, k0);
    else
      moe::fetch_step_q<MODE>(la, lb, tid, A, qe, p, t, k0);
  };
  float acc[TT::TM][TT::TN] = {};
  const int64_t steps = (t.kext + G::BK - 1) / G::BK;
  if (steps > 0) {
    fetch(0);
    la.commit(tid, As);
    lb.commit(tid, Bs);
    __syncthreads();
    for (int64_t s = 0; s < steps; ++s) {
      const int buf = int(s & 1);
      if (s + 1 < steps) fetch((s + 1) * G::BK);
      const float* as = As + buf * G::A_TILE;
      const float* bs = Bs + buf * G::B_TILE;
#pragma unroll
      for (int k = 0; k < G::BK; ++k) {
        float a[TT::TM], b[TT::TN];
#pragma unroll
        for (int i = 0; i < TT::TM; ++i) a[i] = as[G::a_at(TT::row(tid, i), k)];
#pragma unroll
        for (int j = 0; j < TT::TN; ++j) b[j] = bs[G::b_at(k, TT::col(tid, j))];
#pragma unroll
        for (int i = 0; i < TT::TM; ++i)
#pragma unroll
          for (int j = 0; j < TT::TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
      if (s + 1 < steps) {
        la.commit(tid, As + (buf ^ 1) * G::A_TILE);
        lb.commit(tid, Bs + (buf ^ 1) * G::B_TILE);
      }
      __syncthreads();
    }
  }
  const bool empty = t.kext == 0;
#pragma unroll
  for (int i = 0; i < TT::TM; ++i)
#pragma unroll
    for (int j = 0; j < TT::TN; ++j) {
      const int64_t o = moe::out_index(t, p.N, TT::row(tid, i), TT::col(tid, j));
      if (o >= 0) put(p.odt, p.out, o, empty ? 0.f : p.alpha * acc[i][j], p.beta);
    }
}

// beta * out (0 where beta == 0: out never read), the grouped GEMM with k = 0.
__global__ void moe_scale_kernel(DType dt, void* out, int64_t n, float beta) {
  KRNL_GRID_LOOP(i, n) st(dt, out, i, beta == 0.f ? 0.f : beta * ld(dt, out, i));
}

template <Mode MODE, DType DT, int BM, int BN, int WARPS_M>
void launch_async(const GemmParams& p, unsigned blocks, cudaStream_t s) {
  using G = moe::Geometry<MODE, BM, BN, 32, 2>;
  constexpr int bytes = async_smem_bytes<G, moe::WarpTiles<G, WARPS_M>>();
  auto* kernel = moe_gemm_tc_async_kernel<MODE, DT, BM, BN, WARPS_M>;
  // over the 48 KiB a launch gets unasked; a host-side setting, allowed while a graph records
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "moe_gemm");
  kernel<<<blocks, 256, bytes, s>>>(p);
}

// The cp.async kernel's tile shapes (bm x bn): 128 x 128 and 64 x 128 (moe_gemm's experts of few
// rows); for a LoRA's r <= 32 columns (bn 32) 128 x 32 and 64 x 32, and weight_grad's r <= 32
// rows 32 x 128, where a 128-wide tile would spend 4x and more of its products on zeros.
template <Mode MODE, DType DT>
void launch_async_tiles(const GemmParams& p, int bm, int bn, unsigned blocks, cudaStream_t s) {
  if (bn == 32) {
    if (bm == 128) return launch_async<MODE, DT, 128, 32, 8>(p, blocks, s);
    if constexpr (MODE != Mode::weight_grad) return launch_async<MODE, DT, 64, 32, 4>(p, blocks, s);
  }
  if constexpr (MODE == Mode::weight_grad) {
    if (bm == 32) return launch_async<MODE, DT, 32, 128, 1>(p, blocks, s);
  } else {
    if (bm == 64) return launch_async<MODE, DT, 64, 128, 2>(p, blocks, s);
  }
  launch_async<MODE, DT, 128, 128, 2>(p, blocks, s);
}

// bm: 128 or 64 with 16-byte units (weight_grad: 128; a dense W_e or weight_grad's operands: the
// cp.async kernel), 64 per element (fewer registers: the per-element loaders hold 4x the values).
// BITS, q: a quantized W_e (moe_quantized_matmul).
template <Mode MODE, DType DT, int BITS>
void launch_tc(const GemmParams& p, const QuantParams& q, int bm, int bn, bool vec, unsigned blocks, cudaStream_t s) {
  if (!vec) {
    moe_gemm_tc_kernel<MODE, DT, 64, false, BITS><<<blocks, 256, 0, s>>>(p, q);
  } else if constexpr (BITS == 0) {
    launch_async_tiles<MODE, DT>(p, bm, bn, blocks, s);
  } else if (bm == 64) {
    moe_gemm_tc_kernel<MODE, DT, 64, true, BITS><<<blocks, 256, 0, s>>>(p, q);
  } else {
    moe_gemm_tc_kernel<MODE, DT, 128, true, BITS><<<blocks, 256, 0, s>>>(p, q);
  }
}

// bm x bn: the tiles row_tiles or moe_gemm_weight_grad chose (bn 32 or bm 32: the cp.async
// kernel's narrow ones, for dense operands only).
template <Mode MODE, int BITS = 0>
void launch_gemm(const GemmParams& p, DType dt, int bm, int bn, bool vec, unsigned blocks, cudaStream_t s,
                 const QuantParams& q = QuantParams{}) {
  switch (dt) {
    case DType::bf16: return launch_tc<MODE, DType::bf16, BITS>(p, q, bm, bn, vec, blocks, s);
    case DType::f16: return launch_tc<MODE, DType::f16, BITS>(p, q, bm, bn, vec, blocks, s);
    default:
      if (vec)
        moe_gemm_f32_kernel<MODE, true, BITS><<<blocks, 256, 0, s>>>(p, q);
      else
        moe_gemm_f32_kernel<MODE, false, BITS><<<blocks, 256, 0, s>>>(p, q);
  }
}

void check_grid(int64_t blocks, const char* op) {
  if (blocks > int64_t(INT32_MAX))
    throw std::invalid_argument(std::string("[") + op + "] needs " + std::to_string(blocks) +
                                " blocks, over CUDA's 2^31 - 1");
}

// The row tiles of moe_gemm and moe_quantized_matmul (P rows of E experts, N output columns):
// rows of 128 where experts average 96 rows or more (tensor cores, 16-byte units), else of 64
// (less padding per expert); ceil(P / bm) + E row tiles cover every expert's rows, and map (T,)
// int4 {expert, first row, rows, 0} is built from offsets on the device. Columns in tiles of 128,
// or of 32 where N <= 32 and W_e is dense (dense: the cp.async kernel's narrow tiles).
struct RowTiles {
  int bm, bn;
  int64_t T, tiles_n, blocks;
  Tensor map;
};

RowTiles row_tiles(CudaBackend& dev, const Tensor& offsets, int64_t P, int64_t E, int64_t N, bool tc, bool vec,
                   bool dense, const char* op) {
  if (P > int64_t(INT32_MAX)) throw std::invalid_argument(std::string("[") + op + "] over 2^31 - 1 rows");
  RowTiles t;
  t.bm = tc && vec && P >= 96 * E ? 128 : 64;
  t.bn = tc ? (dense && vec && N <= 32 ? 32 : 128) : 64;
  t.T = (P + t.bm - 1) / t.bm + E;
  t.tiles_n = (N + t.bn - 1) / t.bn;
  t.blocks = t.T * t.tiles_n;
  check_grid(t.blocks, op);
  t.map = dev.scratch(4 * t.T, DType::i32);
  moe_tile_map_kernel<<<1, 256, 0, dev.stream()>>>(offsets.ptr<int32_t>(), int(E), int(P), t.bm,
                                                   reinterpret_cast<int4*>(t.map.data()), int(t.T));
  check_launch(op);
  return t;
}

}  // namespace
}  // namespace krnl::cuda
