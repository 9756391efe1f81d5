// The index arithmetic of the grouped GEMMs (moe_gemm.cuh's kernels, for moe.cu and
// moe_quantized.cu): tile geometry, the global-to-shared tile loaders (moe_quantized_matmul's
// dequantizing one included), the tensor-core fragments' places and the epilogue's, as __host__
// __device__ code, so that tests/cuda_host/moe_tiles_check.cu runs the very same arithmetic on the
// host (emulating what a block does with it) against a reference GEMM, where no GPU is at hand.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/dtype.h"

namespace krnl::cuda::moe {

#define KRNL_HD __host__ __device__ __forceinline__
#ifdef __CUDA_ARCH__
#define KRNL_UNROLL _Pragma("unroll")
#else
#define KRNL_UNROLL  // the host compiler's own choice (GCC warns on an unknown pragma)
#endif

// The three grouped GEMMs. Output tile (m, n) of C = A B over k:
// - linear:      C (rows of expert e, O) = x (rows, I) W_e^T; A = x rows [m][k], B = W_e (O, I) [n][k]
// - input_grad:  C (rows of expert e, I) = x (rows, O) W_e;   A = x rows [m][k], B = W_e (O, I) [k][n]
// - weight_grad: C = out[e] (M, N) = a_e^T b_e;                A = a_e (rows, M) [k][m], B = b_e (rows, N) [k][n]
// Each operand tile is copied as it lies in memory (a block of a row-major matrix), so every
// global read runs along a stored row.
enum class Mode { linear, input_grad, weight_grad };

// Tiles of BM x BN outputs over steps of BK; ES bytes an element. Shared rows get PAD elements
// (16 bytes) more than they hold: rows stay 16-byte aligned for vector stores and WMMA's ldm (a
// multiple of 8 16-bit elements), and successive rows start 4 banks apart.
template <Mode MODE, int BM_, int BN_, int BK_, int ES>
struct Geometry {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, PAD = 16 / ES;
  static constexpr bool A_KM = MODE == Mode::weight_grad;  // A tile stored [BK][BM] (k rows), else [BM][BK]
  static constexpr bool B_NK = MODE == Mode::linear;       // B tile stored [BN][BK], else [BK][BN]
  static constexpr int A_ROWS = A_KM ? BK : BM, A_COLS = A_KM ? BM : BK, LDA = A_COLS + PAD;
  static constexpr int B_ROWS = B_NK ? BN : BK, B_COLS = B_NK ? BK : BN, LDB = B_COLS + PAD;
  static constexpr int A_TILE = A_ROWS * LDA, B_TILE = B_ROWS * LDB;  // elements of one buffer
  // Element offsets of A(m, k) and B(k, n) in their tiles.
  static KRNL_HD int a_at(int m, int k) { return A_KM ? k * LDA + m : m * LDA + k; }
  static KRNL_HD int b_at(int k, int n) { return B_NK ? n * LDB + k : k * LDB + n; }
};

// Storage of one element: the bits of a 16-bit float, or a float.
template <int ES>
using Elem = std::conditional_t<ES == 2, uint16_t, float>;

// An R x C tile of a row-major matrix g (row stride ld elements) into shared memory of row stride
// LDS: tile element (r, c) = g[(row0 + r) ld + col0 + c] where row0 + r < row_lim and col0 + c <
// col_lim, else 0. NT threads; each keeps its share in registers from fetch (global loads in
// flight while the block computes on the other buffer) to commit (the shared stores).
// VEC: 16-byte units, for ld, col0 and col_lim multiples of the unit and g 16-byte aligned, so
// that a unit lies wholly inside or wholly outside the matrix (the grouped GEMMs' col_lim is ld).
template <int R, int C, int LDS, int ES, int NT, bool VEC>
struct TileLoader {
  using E = Elem<ES>;
  static constexpr int W = VEC ? 16 / ES : 1;  // elements a unit
  static_assert(C % W == 0 && (LDS * ES) % 16 == 0, "tile rows of whole, aligned units");
  static constexpr int UPR = C / W, NU = R * UPR, PER = (NU + NT - 1) / NT;
  using U = std::conditional_t<VEC, uint4, E>;
  U reg[PER];

  static KRNL_HD int unit_row(int u) { return u / UPR; }
  static KRNL_HD int unit_col(int u) { return (u % UPR) * W; }

  KRNL_HD void fetch(int tid, const E* g, int64_t ld, int64_t row0, int64_t col0, int64_t row_lim, int64_t col_lim) {
    KRNL_UNROLL
    for (int i = 0; i < PER; ++i) {
      const int u = tid + i * NT;
      if (NU % NT != 0 && u >= NU) break;
      const int64_t r = row0 + unit_row(u), c = col0 + unit_col(u);
      reg[i] = r < row_lim && c < col_lim ? *reinterpret_cast<const U*>(g + r * ld + c) : U{};
    }
  }
  KRNL_HD void commit(int tid, E* s) const {
    KRNL_UNROLL
    for (int i = 0; i < PER; ++i) {
      const int u = tid + i * NT;
      if (NU % NT != 0 && u >= NU) break;
      *reinterpret_cast<U*>(s + unit_row(u) * LDS + unit_col(u)) = reg[i];
    }
  }
  // fetch and commit in one, no registers between (VEC): on the GPU asynchronous 16-byte copies
  // (cp.async, zero-filled outside the matrix) that land while the block computes on other stages
  // of its tiles; the kernel groups and waits for them (cp_async_commit, cp_async_wait).
  KRNL_HD void copy(int tid, const E* g, int64_t ld, int64_t row0, int64_t col0, int64_t row_lim, int64_t col_lim,
                    E* s) const {
    static_assert(VEC, "16-byte units");
    KRNL_UNROLL
    for (int i = 0; i < PER; ++i) {
      const int u = tid + i * NT;
      if (NU % NT != 0 && u >= NU) break;
      const int64_t r = row0 + unit_row(u), c = col0 + unit_col(u);
      const bool in = r < row_lim && c < col_lim;
      E* dst = s + unit_row(u) * LDS + unit_col(u);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      // src-size 0 reads nothing and writes 16 zero bytes; g itself stands in as a valid address
      const unsigned sa = unsigned(__cvta_generic_to_shared(dst));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(in ? g + r * ld + c : g),
                   "r"(in ? 16 : 0));
#else
      *reinterpret_cast<U*>(dst) = in ? *reinterpret_cast<const U*>(g + r * ld + c) : U{};
#endif
    }
  }
};

// The copies this thread issued since the last commit, as one group; wait until at most N groups
// of this thread's are still in flight (a barrier then makes every thread's visible to all).
KRNL_HD void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
KRNL_HD void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ---- moe_quantized_matmul's B operand: W_e held as quantized_matmul's W (op_list.h), dequantized
// tile by tile as it is loaded, so that nothing but the shared tile is ever dequantized.

// A quantized W (E, O, I): codes w (E, O, words) u32, each row one little-endian bit stream of BITS
// a code (code j at bit j BITS; 3-, 5- and 6-bit codes straddle words); scales and biases (E, O,
// groups) in sdt (f32, bf16 or f16), experts s_stride and b_stride elements apart (rows of groups
// contiguous), group_size 1 << gs_log2. quant_operand moves the pointers to expert e. In mode
// mxfp4 (op_list.h) biases is null: W = s e2m1(q).
struct QuantParams {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  int64_t words, groups, s_stride, b_stride;
  int gs_log2;
  DType sdt;
};

// The loaders' and kernels' template int for a quantized W: the affine code width (2 to 8), or
// kMxfp4: 4-bit E2M1 codes times the group's scale, no biases (quantized_matmul's mode mxfp4).
constexpr int kMxfp4 = 16;
template <int Q>
constexpr int code_bits = Q == kMxfp4 ? 4 : Q;

// MXFP4's E2M1 code c (bit 3 the sign; bits 0-2, m, index 0, 0.5, 1, 1.5, 2, 3, 4, 6) built as a
// float's bits: m >= 2 is 2^((m >> 1) - 1) (1 + (m & 1) / 2), m = 1 is 0.5; no table in memory.
KRNL_HD float e2m1(uint32_t c) {
  const uint32_t m = c & 7u;
  const uint32_t mag = m < 2u ? m * (126u << 23) : ((126u + (m >> 1)) << 23) | ((m & 1u) << 22);
#ifdef __CUDA_ARCH__
  return __uint_as_float(mag | ((c & 8u) << 28));
#else
  return krnl::bits_f32(mag | ((c & 8u) << 28));
#endif
}

// A scale or bias as float.
KRNL_HD float ld_param(DType dt, const void* p, int64_t i) {
  if (dt == DType::f32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
#ifdef __CUDA_ARCH__
  return dt == DType::bf16 ? __uint_as_float(uint32_t(h) << 16) : __half2float(__ushort_as_half(h));
#else
  return dt == DType::bf16 ? krnl::bf16_to_f32(h) : krnl::f16_to_f32(h);
#endif
}

// f rounded to nearest even in the 16-bit DT, as bits (dtype.h's conversions on the host).
template <DType DT>
KRNL_HD uint16_t round16(float f) {
  static_assert(DT == DType::bf16 || DT == DType::f16, "a 16-bit dtype");
#ifdef __CUDA_ARCH__
  if constexpr (DT == DType::bf16)
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  else
    return __half_as_ushort(__float2half_rn(f));
#else
  return DT == DType::bf16 ? krnl::f32_to_bf16(f) : krnl::f32_to_f16(f);
#endif
}

// The 32 bits of the stream hi:lo from bit sh (0 <= sh < 32) on.
KRNL_HD uint32_t funnel(uint32_t lo, uint32_t hi, int sh) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, uint32_t(sh));
#else
  return sh ? (lo >> sh) | (hi << (32 - sh)) : lo;
#endif
}

// An R x C tile of W_e (rows o from row0, codes j from col0; zero at o >= row_lim or j >= col_lim)
// into shared memory of row stride LDS, dequantized (s q + b in f32, rounded to a 16-bit DT) as
// DT's elements. The unit of work is a run of 16 codes of one row: group_size >= 16 and col0 is a
// multiple of 16 (of BK or BN), so a run lies in one group and, the row length I being a multiple
// of 16, wholly inside or outside the row. fetch loads each unit's code words, scale and bias into
// registers (in flight while the block computes on the other buffer); commit decodes and stores
// them. A run starts at bit j0 BITS of its row, j0 a multiple of 16: word-aligned for even BITS, at
// bit 0 or 16 of a word for odd. Either way it touches exactly NW = ceil(16 BITS / 32) words (odd
// BITS from bit 16: 16 (BITS + 1) bits, (BITS + 1) / 2 words), so it reads no word past its own
// last bit, hence none past the row, which ends on a word boundary. commit shifts the words into
// place (funnel) and takes the codes at fixed bit positions: registers throughout, no dynamic
// indexing. Q: the code width, or kMxfp4 (s e2m1(q): no biases are read).
template <int R, int C, int LDS, DType DT, int NT, int Q>
struct QuantTileLoader {
  static constexpr int BITS = code_bits<Q>;
  static constexpr bool MX = Q == kMxfp4;
  static constexpr int ES = DT == DType::f32 ? 4 : 2, RUN = 16;
  using E = Elem<ES>;
  static_assert(C % RUN == 0 && (LDS * ES) % 16 == 0, "tile rows of whole runs, 16-byte aligned");
  static constexpr int UPR = C / RUN, NU = R * UPR, PER = (NU + NT - 1) / NT;
  static constexpr int NW = (RUN * BITS + 31) / 32;  // words of a run
  static_assert(BITS % 2 == 0 || 16 + RUN * BITS <= 32 * NW, "an odd-BITS run from bit 16 fits in NW words");
  static constexpr uint32_t MASK = (1u << BITS) - 1u;
  uint32_t wr[PER][NW];
  float sc[PER], bi[PER];
  int sh[PER];

  static KRNL_HD int unit_row(int u) { return u / UPR; }
  static KRNL_HD int unit_col(int u) { return (u % UPR) * RUN; }

  // q: at expert e (quant_operand).
  KRNL_HD void fetch(int tid, const QuantParams& q, int64_t row0, int64_t col0, int64_t row_lim, int64_t col_lim) {
    KRNL_UNROLL
    for (int i = 0; i < PER; ++i) {
      const int u = tid + i * NT;
      if (NU % NT != 0 && u >= NU) break;
      const int64_t r = row0 + unit_row(u), j = col0 + unit_col(u);
      if (r < row_lim && j < col_lim) {
        const int64_t bit = j * BITS;
        const uint32_t* src = q.w + r * q.words + (bit >> 5);
        KRNL_UNROLL
        for (int k = 0; k < NW; ++k) wr[i][k] = src[k];
        sh[i] = int(bit & 31);
        const int64_t g = j >> q.gs_log2;
        sc[i] = ld_param(q.sdt, q.scales, r * q.groups + g);
        bi[i] = MX ? 0.f : ld_param(q.sdt, q.biases, r * q.groups + g);
      } else {  // zeros: 0 q + 0
        KRNL_UNROLL
        for (int k = 0; k < NW; ++k) wr[i][k] = 0;
        sh[i] = 0, sc[i] = 0.f, bi[i] = 0.f;
      }
    }
  }

  KRNL_HD void commit(int tid, E* s) const {
    KRNL_UNROLL
    for (int i = 0; i < PER; ++i) {
      const int u = tid + i * NT;
      if (NU % NT != 0 && u >= NU) break;
      uint32_t a[NW];  // the run's bits from bit 0 of a[0]
      KRNL_UNROLL
      for (int k = 0; k < NW; ++k) {
        if constexpr (BITS % 2 == 0)
          a[k] = wr[i][k];  // runs of even BITS start word-aligned
        else
          a[k] = funnel(wr[i][k], k + 1 < NW ? wr[i][k + 1] : 0u, sh[i]);
      }
      float v[RUN];
      KRNL_UNROLL
      for (int c = 0; c < RUN; ++c) {
        const int b = c * BITS, wi = b >> 5, o = b & 31;
        uint32_t x = a[wi] >> o;
        if (o + BITS > 32) x |= a[wi + 1] << (32 - o);  // a code across two words
        if constexpr (MX)
          v[c] = sc[i] * e2m1(x);
        else
          v[c] = fmaf(sc[i], float(x & MASK), bi[i]);
      }
      uint4* dst = reinterpret_cast<uint4*>(s + unit_row(u) * LDS + unit_col(u));  // 32- or 64-byte aligned
      if constexpr (ES == 4) {
        KRNL_UNROLL
        for (int k = 0; k < RUN / 4; ++k) {
          uint4 p;
          p.x = float_bits(v[4 * k]), p.y = float_bits(v[4 * k + 1]), p.z = float_bits(v[4 * k + 2]),
          p.w = float_bits(v[4 * k + 3]);
          dst[k] = p;
        }
      } else {
        uint32_t pk[RUN / 2];
        KRNL_UNROLL
        for (int k = 0; k < RUN / 2; ++k)
          pk[k] = uint32_t(round16<DT>(v[2 * k])) | uint32_t(round16<DT>(v[2 * k + 1])) << 16;
        KRNL_UNROLL
        for (int k = 0; k < RUN / 8; ++k) dst[k] = make_uint4(pk[4 * k], pk[4 * k + 1], pk[4 * k + 2], pk[4 * k + 3]);
      }
    }
  }

 private:
  static KRNL_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    return krnl::f32_bits(f);
#endif
  }
};

// The tensor-core kernels: 8 warps as WARPS_M (m) x 8 / WARPS_M (n), each WM x WN outputs in 16 x
// 16 fragments (2 x 4 in the wide tiles; a narrow tile's 32 columns or rows take 8 x 1 or 1 x 8).
template <class G, int WARPS_M = 2>
struct WarpTiles {
  static constexpr int NT = 256, WARPS_N = 8 / WARPS_M, WM = G::BM / WARPS_M, WN = G::BN / WARPS_N;
  static constexpr int FM = WM / 16, FN = WN / 16;
  static_assert(WARPS_M * WARPS_N == 8 && WM % 16 == 0 && WN % 16 == 0 && G::BK % 16 == 0,
                "8 warps of whole 16 x 16 x 16 fragments");
  // Offsets in the tiles of fragment i of A (rows m) and j of B (columns n) at step kk, for warp w;
  // A row-major where stored [m][k] (A(i, k) at i LDA + k), column-major where [k][m]; B row-major
  // where stored [k][n], column-major where [n][k]: load_matrix_sync with ldm LDA or LDB.
  static KRNL_HD int a_frag(int w, int i, int kk) { return G::a_at((w / WARPS_N) * WM + i * 16, kk); }
  static KRNL_HD int b_frag(int w, int j, int kk) { return G::b_at(kk, (w % WARPS_N) * WN + j * 16); }
  // The fragment's (row, col) origin in the block's tile.
  static KRNL_HD int frag_row(int w, int i) { return (w / WARPS_N) * WM + i * 16; }
  static KRNL_HD int frag_col(int w, int j) { return (w % WARPS_N) * WN + j * 16; }
  // A fragment stored (store_matrix_sync, row-major) in a warp's 16 x EPI_LD floats of shared
  // memory; element (r, c) at r EPI_LD + c. EPI_LD a multiple of 4 (WMMA's ldm for float), not of 32.
  static constexpr int EPI_LD = 20, EPI_FLOATS = 16 * EPI_LD;
  // The epilogue's share of a fragment: VEC, lane takes 8 consecutive columns of row lane / 2;
  // else element q (of 8) of a lane is (r, c) = (i / 16, i % 16) for i = 32 q + lane, so that a
  // warp's store covers two rows of 16 contiguous elements.
  static KRNL_HD void epi_vec(int lane, int& r, int& c) { r = lane >> 1, c = (lane & 1) * 8; }
  static KRNL_HD void epi_scalar(int lane, int q, int& r, int& c) {
    const int i = 32 * q + lane;
    r = i >> 4, c = i & 15;
  }
};

// The CUDA-core kernel (f32, and 16-bit dtypes on GPUs without bf16 tensor cores): 256 threads as
// 16 x 16, thread (tx, ty) computes rows ty + 16 i and columns tx + 16 j (i, j < 4) of a 64 x 64
// tile: a warp reads two A values (broadcasts) and 16 consecutive B columns.
struct ThreadTiles {
  static constexpr int NT = 256, TM = 4, TN = 4;
  static KRNL_HD int row(int tid, int i) { return (tid >> 4) + 16 * i; }
  static KRNL_HD int col(int tid, int j) { return (tid & 15) + 16 * j; }
};

// A grouped GEMM's operands and scalars, as its kernels take them.
struct GemmParams {
  const void* a;  // moe_gemm: x (P, K); weight_grad: a (P, M)
  const void* b;  // moe_gemm: w (E, O, I); weight_grad: b (P, N)
  void* out;      // moe_gemm: (P, N); weight_grad: (E, M, N)
  const int4* map;           // moe_gemm's row tiles (moe_tile_map_kernel): {expert, first row, rows, 0}
  const int32_t* offsets;    // moe_sort's (E + 1,)
  int64_t P, M, N, K, b_stride, tiles_m, tiles_n;  // M: weight_grad's rows of out[e]; K: moe_gemm's
  DType odt;
  float alpha, beta;
};

// A block's output tile: rows [m0, m0 + BM) of a matrix of row_lim rows at out_base (row stride
// N), columns [n0, n0 + BN); the a operand from its row row0 (moe_gemm: x's rows of the tile;
// weight_grad: the expert's first row of a and b); kext values of k. live: false for a moe_gemm
// block past the last row tile.
struct BlockTile {
  int64_t e, row0, row_lim, m0, n0, kext, out_base;
  bool live;
};

// Block b's tile. moe_gemm: row tile b / tiles_n (map[]; expert -1 past the last) and column tile
// b % tiles_n, so that the blocks of one row tile run side by side and share its rows of x (and
// an expert's row tiles follow each other, sharing W_e in L2). weight_grad: expert b / (tiles_m
// tiles_n), then row and column tiles; offsets clamped into [0, P], so that bad ones (never
// checked on the GPU) cannot send a block outside a or b.
template <Mode MODE, int BM, int BN>
KRNL_HD BlockTile block_tile(const GemmParams& p, int64_t b) {
  BlockTile t{};
  if constexpr (MODE != Mode::weight_grad) {
    const int4 tm = p.map[b / p.tiles_n];
    t.live = tm.x >= 0;
    t.e = tm.x, t.row0 = tm.y, t.row_lim = tm.z, t.m0 = 0, t.n0 = (b % p.tiles_n) * BN, t.kext = p.K;
    t.out_base = t.row0 * p.N;
  } else {
    const int64_t per = p.tiles_m * p.tiles_n, rem = b % per, e = b / per;
    int64_t lo = p.offsets[e], hi = p.offsets[e + 1];
    lo = lo < 0 ? 0 : (lo > p.P ? p.P : lo);
    hi = hi < lo ? lo : (hi > p.P ? p.P : hi);
    t.live = true;
    t.e = e, t.row0 = lo, t.row_lim = p.M, t.m0 = (rem / p.tiles_n) * BM, t.n0 = (rem % p.tiles_n) * BN;
    t.kext = hi - lo, t.out_base = e * p.M * p.N;
  }
  return t;
}

// Operand bases: A at the tile's first row, B at expert e's matrix (moe_gemm) or first row.
template <Mode MODE, class E>
KRNL_HD void operands(const GemmParams& p, const BlockTile& t, const E*& A, const E*& B) {
  constexpr bool FWD = MODE != Mode::weight_grad;
  A = static_cast<const E*>(p.a) + t.row0 * (FWD ? p.K : p.M);
  B = static_cast<const E*>(p.b) + (FWD ? t.e * p.b_stride : t.row0 * p.N);
}

// One step's operand windows (k0: the step's first k): fa and fb take (g, ld, row0, col0, row_lim,
// col_lim) of TileLoader's fetch for A and B.
template <Mode MODE, class E, class FA, class FB>
KRNL_HD void step_windows(const E* A, const E* B, const GemmParams& p, const BlockTile& t, int64_t k0, FA&& fa,
                          FB&& fb) {
  if constexpr (MODE == Mode::linear) {  // A = x rows [m][k] (ld K); B = W_e (O = N, I = K) [n][k]
    fa(A, p.K, 0, k0, t.row_lim, p.K);
    fb(B, p.K, t.n0, k0, p.N, p.K);
  } else if constexpr (MODE == Mode::input_grad) {  // B = W_e (O = K, I = N) [k][n]
    fa(A, p.K, 0, k0, t.row_lim, p.K);
    fb(B, p.N, k0, t.n0, p.K, p.N);
  } else {  // A = a_e (rows, M) [k][m], B = b_e (rows, N) [k][n]
    fa(A, p.M, k0, t.m0, t.kext, p.M);
    fb(B, p.N, k0, t.n0, t.kext, p.N);
  }
}

// One step's operand tiles into the loaders' registers, for thread tid.
template <Mode MODE, class LA, class LB, class E>
KRNL_HD void fetch_step(LA& la, LB& lb, int tid, const E* A, const E* B, const GemmParams& p, const BlockTile& t,
                        int64_t k0) {
  step_windows<MODE>(
      A, B, p, t, k0, [&](auto... w) { la.fetch(tid, w...); }, [&](auto... w) { lb.fetch(tid, w...); });
}

// One step's operand tiles straight into the shared tiles as and bs (TileLoader's copy), for thread tid.
template <Mode MODE, class LA, class LB, class E>
KRNL_HD void copy_step(const LA& la, const LB& lb, int tid, const E* A, const E* B, const GemmParams& p,
                       const BlockTile& t, int64_t k0, E* as, E* bs) {
  step_windows<MODE>(
      A, B, p, t, k0, [&](auto... w) { la.copy(tid, w..., as); }, [&](auto... w) { lb.copy(tid, w..., bs); });
}

// W_e's codes, scales and biases: q at expert e of O rows.
KRNL_HD QuantParams quant_operand(const QuantParams& q, int64_t e, int64_t O) {
  const int64_t es = q.sdt == DType::f32 ? 4 : 2;
  QuantParams r = q;
  r.w = q.w + e * O * q.words;
  r.scales = static_cast<const char*>(q.scales) + e * q.s_stride * es;
  if (q.biases) r.biases = static_cast<const char*>(q.biases) + e * q.b_stride * es;  // none in mode mxfp4
  return r;
}

// fetch_step for moe_quantized_matmul (linear or input_grad): B's tile window is the dense one,
// over W_e's rows o and codes j (q at expert e).
template <Mode MODE, class LA, class LQ, class E>
KRNL_HD void fetch_step_q(LA& la, LQ& lq, int tid, const E* A, const QuantParams& q, const GemmParams& p,
                          const BlockTile& t, int64_t k0) {
  static_assert(MODE != Mode::weight_grad, "moe_gemm's modes");
  la.fetch(tid, A, p.K, 0, k0, t.row_lim, p.K);
  if constexpr (MODE == Mode::linear)  // W_e (O = N, I = K): rows n, codes k
    lq.fetch(tid, q, t.n0, k0, p.N, p.K);
  else  // W_e (O = K, I = N): rows k, codes n
    lq.fetch(tid, q, k0, t.n0, p.K, p.N);
}

// The output element of tile-relative (r, c) (r from the tile's m0), or -1 outside the output.
KRNL_HD int64_t out_index(const BlockTile& t, int64_t N, int64_t r, int64_t c) {
  const int64_t row = t.m0 + r, col = t.n0 + c;
  return row < t.row_lim && col < N ? t.out_base + row * N + col : -1;
}

#undef KRNL_UNROLL
#undef KRNL_HD

}  // namespace krnl::cuda::moe
