// SwiGLU with the LoRA's rank-r products of its outputs in the same pass, tried and not kept
// (dev/performance-history.md, 'SwiGLU and its rank-r products in one pass'): the forward's
// t = s A^T for the down projection, the backward's dt = s dg B for gate and up, each product
// taking s, dg or du from the registers that store it, where a skinny GEMM reads the (rows, F)
// array back. Two ways of moving the rows: in the products' fragment layout (swiglu_lora_kernel)
// and whole (swiglu_lora_rows_kernel). Both ran below the unfused pair (krnl's SwiGLU pass, then
// cuBLAS) at the train shapes; swiglu_lora_variants.cu times their launch shapes.
#pragma once
#include <algorithm>

#include "cuda/common.cuh"

namespace krnl::cuda::swiglu_lora {

constexpr int kWarps = 8;   // a block's warps; each takes every kWarps-th patch of its rows
constexpr int kPatch = 32;  // columns of a patch per 16 bytes a lane holds of a row

// A 16-bit dtype's bits to float and back, rounding as common.cuh's st().
template <bool BF>
__device__ __forceinline__ float unpack(uint32_t h) {
  return BF ? __uint_as_float(h << 16) : __half2float(__ushort_as_half(uint16_t(h)));
}
template <bool BF>
__device__ __forceinline__ uint32_t pack(float v) {
  return BF ? to_bf16_bits(v) : to_f16_bits(v);
}

// d (16 x 8, f32) += a (16 x 16) b (16 x 8), mma.sync's m16n8k16 fragments.
template <bool BF>
__device__ __forceinline__ void mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (BF) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// The packed output words of 8 elements (16 bytes of each input): SwiGLU's arithmetic, term for
// term as swiglu_forward and swiglu_backward (elementwise.cu) have it. in: g, u, or ds, g, u.
template <bool BF, bool BWD>
__device__ __forceinline__ void swiglu8(const uint4* in, uint32_t (&w)[2][4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    uint32_t o[2][2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int sh = 16 * b;
      if constexpr (BWD) {
        const float d = unpack<BF>((word(in[0], e) >> sh) & 0xffffu);
        const float g = unpack<BF>((word(in[1], e) >> sh) & 0xffffu);
        const float u = unpack<BF>((word(in[2], e) >> sh) & 0xffffu);
        const float sig = 1.f / (1.f + expf(-g));
        o[0][b] = pack<BF>(d * u * sig * (1.f + g * (1.f - sig)));
        o[1][b] = pack<BF>(d * g * sig);
      } else {
        const float g = unpack<BF>((word(in[0], e) >> sh) & 0xffffu);
        const float u = unpack<BF>((word(in[1], e) >> sh) & 0xffffu);
        o[0][b] = pack<BF>(g / (1.f + expf(-g)) * u);
        o[1][b] = 0;
      }
    }
    w[0][e] = o[0][0] | (o[0][1] << 16);
    w[1][e] = o[1][0] | (o[1][1] << 16);
  }
}

struct Rows {
  const uint16_t* in[3];  // (N, F) each: g, u (forward); ds, g, u (backward)
  uint16_t* out[2];       // (N, F): s (forward); dg, du (backward)
  const uint16_t* m[2];   // (R, F): the factors the rows multiply (down's A; B^T of gate and of up)
  uint16_t* t[2];         // (N, R) at row strides ld[k]
  int64_t ld[2];
  float scale[2];
  int64_t N, F;
  float* part = nullptr;  // (column groups, N, NO R) f32: where a grid splits the columns too (gridDim.y > 1)
};

// t[k] (16 rows from r0, R) = scale[k] * the sum over the block's warps of their accumulators, in
// warp order: each warp's partials go to red (kWarps, 16, NO R) first.
template <bool BF, int NO, int R>
__device__ __forceinline__ void sum_partials(const float (&acc)[NO][R / 8][4], float* red, const Rows& p, int64_t r0) {
  constexpr int PW = 16 * NO * R;
  const int lane = threadIdx.x % 32, rq = lane / 4, q = lane % 4;
  float* mine = red + (threadIdx.x / 32) * PW;
  // Accumulator (c0 c1) is row rq, columns 2q, 2q + 1 of its n tile; (c2 c3) row rq + 8.
#pragma unroll
  for (int k = 0; k < NO; ++k)
#pragma unroll
    for (int nt = 0; nt < R / 8; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* o = mine + (rq + 8 * h) * NO * R + k * R + nt * 8 + 2 * q;
        o[0] = acc[k][nt][2 * h];
        o[1] = acc[k][nt][2 * h + 1];
      }
  __syncthreads();
  for (int e = threadIdx.x; e < PW; e += blockDim.x) {
    const int rl = e / (NO * R), k = (e / R) % NO, n = e % R;
    const int64_t row = r0 + rl;
    if (row >= p.N) continue;
    float s = 0.f;
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) s += red[wi * PW + e];
    if (gridDim.y > 1)  // this block's column group: sum_groups finishes t
      p.part[(blockIdx.y * p.N + row) * NO * R + k * R + n] = s;
    else
      p.t[k][row * p.ld[k] + n] = uint16_t(pack<BF>(p.scale[k] * s));
  }
}

// t[k] = scale[k] * the column groups' partials summed in group order.
template <bool BF, int NO, int R>
__global__ void sum_groups(Rows p, int groups) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < p.N * NO * R; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / (NO * R);
    const int k = int(i / R % NO), n = int(i % R);
    float s = 0.f;
    for (int g = 0; g < groups; ++g) s += p.part[g * p.N * NO * R + i];
    p.t[k][row * p.ld[k] + n] = uint16_t(pack<BF>(p.scale[k] * s));
  }
}

// Rows [16 b, 16 b + 16) of the op for block b; warp w takes the column patches w, w + kWarps, ...
// of kPatch CW columns. Lane (rq, q) = (lane / 4, lane % 4) holds rows rq and rq + 8 and the CW 8
// columns from kPatch CW pt + 8 CW q: a warp's loads and stores cover 16 CW bytes of each row.
// An m16n8k16 product's k step may take any 16 of the patch's columns where its A and B fragments
// agree: k step j of the lane's 16-byte piece cw gives lane q its columns 8 (CW q + cw) + 4j + (0, 1)
// as the pair (a0 a1) | (b0 b1) and + (2, 3) as (a4 a5) | (b2 b3), so the A fragments are the
// packed words the lane stores, and the B fragments the same words of a row of m. The warps' partial products are summed in a fixed order.
template <bool BF, bool BWD, int R, int CW, int MINB, bool PF, bool SPREAD = false>
__global__ void __launch_bounds__(kWarps * 32, MINB) swiglu_lora_kernel(Rows p) {
  constexpr int NO = BWD ? 2 : 1, NI = BWD ? 3 : 2, NT = R / 8;  // outputs, input arrays, n tiles
  constexpr int WIDTH = kPatch * CW;                               // a patch's columns
  extern __shared__ float red[];                                   // (kWarps, 16, NO R)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, rq = lane / 4, q = lane % 4;
  const int64_t r0 = int64_t(blockIdx.x) * 16, P = (p.F + WIDTH - 1) / WIDTH;
  float acc[NO][NT][4] = {};
  uint4 x[NI][2][CW], nx[NI][2][CW];  // this patch's inputs [array][row rq, rq + 8][16 bytes], the next one's

  auto load = [&](int64_t pt, uint4 (&v)[NI][2][CW]) {
#pragma unroll
    for (int i = 0; i < NI; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int cw = 0; cw < CW; ++cw) {
          const int64_t row = r0 + rq + 8 * h, c = pt * WIDTH + 8 * (CW * q + cw);
          v[i][h][cw] = row < p.N && c < p.F ? *reinterpret_cast<const uint4*>(p.in[i] + row * p.F + c)
                                             : make_uint4(0, 0, 0, 0);
        }
  };

  // SPREAD: blocks start at different patches (hashed), so that the rows in flight at once need not
  // all sit at one column offset, 28 KB apart at F = 14336.
  const int64_t first = SPREAD ? int64_t(((uint64_t(blockIdx.x) * 2654435761u) >> 7) % uint64_t(P)) : 0;
  auto at = [&](int64_t i) { return (i + first) % P; };  // the patch of a warp's i-th step
  if (PF && warp < P) load(at(warp), x);
  for (int64_t i = warp; i < P; i += kWarps) {
    const int64_t pt = at(i);
    if (PF && i + kWarps < P) load(at(i + kWarps), nx);  // in flight while this patch computes
    if (!PF) load(pt, x);
#pragma unroll
    for (int cw = 0; cw < CW; ++cw) {
      const int64_t c = pt * WIDTH + 8 * (CW * q + cw);
      uint4 mf[NO][NT];  // row nt 8 + rq of each factor, columns c..c+7
#pragma unroll
      for (int k = 0; k < NO; ++k)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mf[k][nt] = c < p.F ? *reinterpret_cast<const uint4*>(p.m[k] + (nt * 8 + rq) * p.F + c) : make_uint4(0, 0, 0, 0);
      uint32_t w[2][2][4];  // the outputs' packed words: [output][row rq, rq + 8][column pair]
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint4 in[NI];
#pragma unroll
        for (int i = 0; i < NI; ++i) in[i] = x[i][h][cw];
        uint32_t o[2][4];
        swiglu8<BF, BWD>(in, o);
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
          for (int e = 0; e < 4; ++e) w[k][h][e] = o[k][e];
        const int64_t row = r0 + rq + 8 * h;
        if (row < p.N && c < p.F)
#pragma unroll
          for (int k = 0; k < NO; ++k)
            *reinterpret_cast<uint4*>(p.out[k] + row * p.F + c) = make_uint4(w[k][h][0], w[k][h][1], w[k][h][2], w[k][h][3]);
      }
#pragma unroll
      for (int k = 0; k < NO; ++k)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t a[4] = {w[k][0][2 * j], w[k][1][2 * j], w[k][0][2 * j + 1], w[k][1][2 * j + 1]};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma<BF>(acc[k][nt], a, word(mf[k][nt], 2 * j), word(mf[k][nt], 2 * j + 1));
        }
    }
    if (PF)
#pragma unroll
      for (int i = 0; i < NI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int cw = 0; cw < CW; ++cw) x[i][h][cw] = nx[i][h][cw];
  }

  sum_partials<BF, NO, R>(acc, red, p, r0);
}

// The same op with rows read and written whole. Block b takes rows [16 b, 16 b + 16); warp w the
// tiles of kTile columns w, w + kWarps, ... A tile's rows go as a plain elementwise pass moves
// them (16 bytes a lane, kTile / 8 lanes a row: 256 or 128 contiguous bytes an instruction), G
// instructions' loads at once; the outputs are also written to the warp's tile in shared memory, from which each lane then
// reads swiglu_lora_kernel's fragment layout (rows rq and rq + 8, 16 bytes at 8q of each 32-column
// patch) for the products.
// KT: a tile's columns (64 or 128), kLd its shared row stride: 64 bytes past a multiple of 128, so
// that the fragment reads do not conflict. Where the grid has column groups (gridDim.y), group y
// takes the tiles y, y + groups, ... and leaves its partial products for sum_groups.
template <bool BF, bool BWD, int R, int MINB, int G, int KT = 128>
__global__ void __launch_bounds__(kWarps * 32, MINB) swiglu_lora_rows_kernel(Rows p) {
  constexpr int kTile = KT, kLd = KT + 32;
  constexpr int NO = BWD ? 2 : 1, NI = BWD ? 3 : 2, NT = R / 8;
  extern __shared__ float red[];  // the warps' tiles (kWarps, NO, 16, kLd) 16-bit; then (kWarps, 16, NO R) f32
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, rq = lane / 4, q = lane % 4;
  constexpr int LPR = kTile / 8, RPI = 32 / LPR;       // as a row loader: lanes a row, rows an instruction
  const int sub = lane / LPR, c8 = 8 * (lane % LPR);  // row RPI g + sub, columns c8..c8+7
  uint16_t* tile = reinterpret_cast<uint16_t*>(red) + warp * NO * 16 * kLd;
  const int64_t r0 = int64_t(blockIdx.x) * 16, P = (p.F + kTile - 1) / kTile;
  float acc[NO][NT][4] = {};
  for (int64_t pt = blockIdx.y + int64_t(gridDim.y) * warp; pt < P; pt += int64_t(gridDim.y) * kWarps) {
    const int64_t c0 = pt * kTile;
    const bool cok = c0 + c8 < p.F;
#pragma unroll
    for (int g0 = 0; g0 < 16 / RPI; g0 += G) {
      uint4 x[G][NI];
#pragma unroll
      for (int gi = 0; gi < G; ++gi) {
        const int64_t row = r0 + RPI * (g0 + gi) + sub;
#pragma unroll
        for (int i = 0; i < NI; ++i)
          x[gi][i] = row < p.N && cok ? *reinterpret_cast<const uint4*>(p.in[i] + row * p.F + c0 + c8)
                                      : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int gi = 0; gi < G; ++gi) {
        uint32_t o[2][4];
        swiglu8<BF, BWD>(x[gi], o);
        const int rl = RPI * (g0 + gi) + sub;
        const int64_t row = r0 + rl;
#pragma unroll
        for (int k = 0; k < NO; ++k) {
          const uint4 v = make_uint4(o[k][0], o[k][1], o[k][2], o[k][3]);
          if (row < p.N && cok) *reinterpret_cast<uint4*>(p.out[k] + row * p.F + c0 + c8) = v;
          *reinterpret_cast<uint4*>(tile + (k * 16 + rl) * kLd + c8) = v;
        }
      }
    }
    __syncwarp();
#pragma unroll
    for (int c32 = 0; c32 < kTile / 32; ++c32) {
      const int64_t c = c0 + 32 * c32 + 8 * q;
#pragma unroll
      for (int k = 0; k < NO; ++k) {
        const uint4 a0 = *reinterpret_cast<const uint4*>(tile + (k * 16 + rq) * kLd + 32 * c32 + 8 * q);
        const uint4 a1 = *reinterpret_cast<const uint4*>(tile + (k * 16 + rq + 8) * kLd + 32 * c32 + 8 * q);
        uint4 mf[NT];  // row nt 8 + rq of factor k, columns c..c+7
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mf[nt] = c < p.F ? *reinterpret_cast<const uint4*>(p.m[k] + (nt * 8 + rq) * p.F + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t a[4] = {word(a0, 2 * j), word(a1, 2 * j), word(a0, 2 * j + 1), word(a1, 2 * j + 1)};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma<BF>(acc[k][nt], a, word(mf[nt], 2 * j), word(mf[nt], 2 * j + 1));
        }
      }
    }
    __syncwarp();  // the tile is read before the next one overwrites it
  }
  __syncthreads();  // every warp is done with the tiles, whose memory the partials take

  sum_partials<BF, NO, R>(acc, red, p, r0);
}

// groups > 1: p.part holds (groups, N, NO R) f32.
template <bool BF, bool BWD, int R, int MINB, int G, int KT = 128>
void launch_rows(const Rows& p, cudaStream_t stream, const char* op, int groups = 1) {
  constexpr int NO = BWD ? 2 : 1;
  const size_t smem = std::max(size_t(kWarps) * 16 * NO * R * sizeof(float), size_t(kWarps) * NO * 16 * (KT + 32) * 2);
  auto kernel = swiglu_lora_rows_kernel<BF, BWD, R, MINB, G, KT>;
  if (smem > 48 * 1024) check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), op);
  kernel<<<dim3(unsigned((p.N + 15) / 16), unsigned(groups)), kWarps * 32, smem, stream>>>(p);
  if (groups > 1) sum_groups<BF, NO, R><<<unsigned((p.N * NO * R + 255) / 256), 256, 0, stream>>>(p, groups);
  check_launch(op);
}

template <bool BF, bool BWD, int R, int CW, int MINB, bool PF, bool SPREAD = false>
void launch(const Rows& p, cudaStream_t stream, const char* op) {
  constexpr int NO = BWD ? 2 : 1;
  const size_t smem = size_t(kWarps) * 16 * NO * R * sizeof(float);
  auto kernel = swiglu_lora_kernel<BF, BWD, R, CW, MINB, PF, SPREAD>;
  if (smem > 48 * 1024) check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), op);
  kernel<<<unsigned((p.N + 15) / 16), kWarps * 32, smem, stream>>>(p);
  check_launch(op);
}

}  // namespace krnl::cuda::swiglu_lora
