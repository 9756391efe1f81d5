// msl: 3.0 (krnl's floor; newest feature used: simdgroup_matrix, MSL 2.3)
// quantized_matmul: out (N, M) = x (N, K) op(W) + beta * out with W (O, I) quantized as MLX does
// (metal/kargs.h QuantizedMatmulArgs; csrc/core/op_list.h has the layout): each row's codes one
// little-endian bit stream of 32-bit words (3, 5 and 6 bits straddle words),
// W[o, j] = scales[o, j / gs] * q + biases[o, j / gs] (mode affine), or scales[o, j / 32] * e2m1(q)
// (mode mxfp4: 4-bit codes, groups of 32, no biases). x and out rows are args.ldx / args.ldo apart.
//   quantized_matmul_t_*:  transpose, out (N, O) = x (N, I) W^T  (a linear's forward)
//   quantized_matmul_n_*:  out (N, I) = x (N, O) W               (its input gradient)
//   quantized_matmul_tv_*: the `t` product for a few rows of x (generation; N <= 8 per row block)
//   quantized_embedding_*: out (n, C) = rows ids of the table W, dequantized
//   moe_quantized_matmul_{t,n}_*: the tiled `t` and `n` products per expert of a mixture (below)
// Names: quantized_matmul_{t,n,tv}_<x dtype>[_sf32]_b<bits> (quantized_embedding_<out dtype>...,
// moe_quantized_matmul_{t,n}_<x dtype>...), _mxfp4 in place of _b<bits> for mode mxfp4 (the same
// kernels, template MX: only the dequantization differs; its biases' buffer is bound, never read);
// _sf32 when scales and biases are f32 while x is 16-bit. x and out share a dtype; products
// accumulate in float, out rounds once.
//
// Blocks: a dispatch computes out's columns [m0, m0 + M) of the whole product (args.m0: rows of W
// in `t`, columns of W in `n`, where m0 must be a multiple of 8) with out bound at column m0;
// args.groups is the number of groups per W row of the whole W (scales' row stride). Rows of x
// and out are split by binding them at an offset. The host splits a product into such blocks to
// keep each dispatch under the GPU watchdog.
//
// Tiled form (quantized_matmul_{t,n}_*), after MLX's qmm_t / qmm_n: a threadgroup of 4 SIMD-groups
// (128 threads) computes a 32x32 tile of out, K in steps of 32. Per step every thread stages 8
// elements of the x tile (32 x 32, [n][k]) and dequantizes 8 consecutive codes of W (one or two
// 32-bit words, one scale and bias: 8 codes never cross a group) into the op(W) tile (32 x 32,
// [k][n], in x's dtype: 16-bit x rounds each dequantized weight once, as MLX does). Each
// SIMD-group multiplies a 16x16 quarter with 2x2 8x8 simdgroup_matrix products into float
// accumulators and stores them straight from its lanes. Threadgroup memory: 2 x 32 x 36 elements
// (9,216 bytes f32, 4,608 half). Grid (ceil(M / 32), ceil(N / 32), 1), threads (128, 1, 1).
// Any N, M, K: x tiles are zero filled past N and K, op(W) tiles past M and K, stores checked.
//
// Mixture of experts (moe_quantized_matmul_{t,n}_*; csrc/core/op_list.h's note, metal/kargs.h
// MoeQuantizedMatmulArgs): rows offsets[e]:offsets[e + 1] of x (P, K) times expert e's W_e, whose
// codes, scales and biases sit at e * stride_w and e * stride_s of w, scales and biases. The tiled
// form's threadgroup and tile (qmm_tile, shared with quantized_matmul_{t,n}: the same numbers as
// quantized_matmul on the expert's rows) on gemm.metal's moe_gemm tile map: the experts' row tiles
// (ceil(n_e / 32) each, in expert order) are numbered from 0 and threadgroup y takes tile0 + y,
// exiting past the last; sum ceil(n_e / 32) <= (P + 31 E) / 32 tiles cover every expert. offsets
// (moe_sort's, never seen by a host) are clamped into [0, P]. Grid (ceil(M / 32), row tiles, 1),
// threads (128, 1, 1); blocks by args.m0 (columns, out bound there) and args.tile0 (row tiles).
//
// Few-row form (quantized_matmul_tv_*), after MLX's qmv: 2 SIMD-groups (64 threads) per
// threadgroup, each owning 4 rows of W (4 output columns) and up to 8 rows of x (the row block).
// Lane l takes codes [8l, 8l + 8) of every 256 along K: each packed word is read once per row
// block (the row block's 8 x rows reuse it from registers), each x element once per SIMD-group;
// every lane's partial sums end in simd_sum. Grid (ceil(M / 8), ceil(N / 8), 1), threads (64, 1, 1).
//
// Bytes read per FLOP (device loads the kernel issues, 2 FLOPs per multiply-add; sx the size of an
// x element, ss of a scale, gs the group size; out's store not counted):
//   tiled:    sx / (2 * 32) + bits / (8 * 2 * 32) + 2 * ss / (2 * 32 * gs) per FLOP; f16 x, 4 bits,
//             gs 64: 0.031 + 0.008 + 0.001 = 0.040 (f32 x and scales: 0.072)
//   few-row:  W once per row block of R <= 8 rows: (bits / 8 + 2 ss / gs) / (2 R) + sx / (2 * 4);
//             at R = 1, f16, 4 bits, gs 64: 0.28 (W) + 0.25 (x, from cache: every SIMD-group reads it)
//   the naive kernel it replaces (one thread per output element): (sx + bits / 8 + 2 ss / gs) / 2
//             = 1.28 at f16, 4 bits, gs 64 (every output element read its whole row of x and of W)
//   dense GEMM (gemm.metal tile32, A and B both sx): 2 sx / (2 * 32) = 0.0625 at f16 (steel64: 0.031)
// Measured on metal-cuda (an H200 running this MSL, not a Mac): docs/performance.md,
// tools/mslcuda/qmm_timing.py.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
#include "kargs.h"
using namespace metal;

// Geometry as enum constants, as gemm.metal does (program-scope `constant`s become memory).
enum {
    QMM_BM      = 32,               // out rows (rows of x) per threadgroup
    QMM_BN      = 32,               // out columns per threadgroup
    QMM_BK      = 32,               // K step staged per iteration
    QMM_THREADS = 128,              // 4 SIMD-groups, 2 x 2 over the tile
    QMM_CHUNK   = 8,                // elements a thread stages per step (x and W alike)
    QMM_PAD     = 4,                // staged-row padding (fewer bank conflicts on transposed writes)
    QMM_LDX     = QMM_BK + QMM_PAD, // Xs [BM][LDX]: the x tile as [n][k]
    QMM_LDW     = QMM_BN + QMM_PAD, // Ws [BK][LDW]: the op(W) tile as [k][n]
    QMV_SG      = 2,                // few-row form: SIMD-groups per threadgroup
    QMV_R       = 4,                // W rows (out columns) per SIMD-group
    QMV_N       = 8,                // x rows per row block
};

// Codes j .. j + 7 of a packed row (j a multiple of 8) as the low 8 * BITS bits of the result:
// they start at bit 8 * (j * BITS / 8 % 4) of word j * BITS / 32 and, for every width, end
// within the next word; that word is read only when they reach into it (never past the row).
template <int BITS>
inline ulong codes8(device const uint* row, uint j)
{
    const uint bit = j * BITS, wi = bit >> 5, sh = bit & 31u;
    ulong v = row[wi];
    if (sh + 8 * BITS > 32)
        v |= ulong(row[wi + 1]) << 32;
    return v >> sh;
}

template <int BITS>
inline float code_at(ulong v, uint e)
{
    return float(uint(v >> (e * BITS)) & ((1u << BITS) - 1u));
}

// MXFP4's E2M1 code c (bit 3 the sign; bits 0-2, m, index 0, 0.5, 1, 1.5, 2, 3, 4, 6) built as a
// float's bits: m >= 2 is 2^((m >> 1) - 1) (1 + (m & 1) / 2), m = 1 is 0.5; no table in memory.
inline float e2m1(uint c)
{
    const uint m = c & 7u;
    const uint mag = m < 2u ? m * (126u << 23) : ((126u + (m >> 1)) << 23) | ((m & 1u) << 22);
    return as_type<float>(mag | ((c & 8u) << 28));
}

// Code e of v (codes8's) as a weight: s q + b (affine) or s e2m1(q) (MX: mxfp4, b unused).
template <int BITS, bool MX>
inline float qweight(ulong v, uint e, float s, float b)
{
    if (MX)
        return s * e2m1(uint(v >> (e * 4)) & 15u);
    return fma(s, code_at<BITS>(v, e), b);
}

template <int BITS>
inline float dequant(device const uint* w, uint words, uint o, uint j, float s, float b)
{
    constexpr uint MASK = (1u << BITS) - 1u;
    device const uint* row = w + o * words;
    const uint bit = j * BITS, wi = bit >> 5, sh = bit & 31u;
    uint q = row[wi] >> sh;
    if (32 % BITS != 0 && sh + BITS > 32)  // only widths that do not divide 32 straddle words
        q |= row[wi + 1] << (32 - sh);
    return s * float(q & MASK) + b;
}

// One 32x32 tile of the tiled form at out row n0 and column c0 of a block of N rows and M columns
// (x and out at the block's first row, out at its column m0; W, scales and biases whole), K in
// steps of 32: quantized_matmul's kernel and moe_quantized_matmul's (one expert's rows and W) both
// run it. Xs, Ws: the kernel's threadgroup tiles. tid, sg, lane: the thread's indices. MX: mode
// mxfp4 (qweight).
template <typename T, typename S, int BITS, bool MX, bool TRANSPOSE>
inline void qmm_tile(device const T* x, device const uint* w, device const S* scales, device const S* biases,
                     device T* out, uint N, uint M, uint K, uint words, uint gs, uint G, uint ldx, uint ldo,
                     uint m0, float beta, uint n0, uint c0, uint tid, uint sg, uint lane,
                     threadgroup T* Xs, threadgroup T* Ws)
{
    const uint sm = sg / 2, sn = sg % 2;                  // this SIMD-group's 16x16 quarter
    // What this thread stages: row r, elements [c, c + 8) of a 32-wide row of each tile
    const uint r = tid / (QMM_BK / QMM_CHUNK), c = (tid % (QMM_BK / QMM_CHUNK)) * QMM_CHUNK;

    simdgroup_float8x8 acc[2][2];
#pragma clang loop unroll(full)
    for (uint i = 0; i < 2; ++i)
#pragma clang loop unroll(full)
        for (uint j = 0; j < 2; ++j)
            acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

    const bool n_full = n0 + QMM_BM <= N;
    for (uint k0 = 0; k0 < K; k0 += QMM_BK) {
        // x tile [n][k]: row n0 + r, k0 + c ..; zeros past N and K
        {
            device const T* p = x + (ulong)(n0 + r) * ldx + (k0 + c);
            threadgroup T* d = Xs + r * QMM_LDX + c;
            if (n_full && k0 + QMM_BK <= K) {
#pragma clang loop unroll(full)
                for (uint e = 0; e < QMM_CHUNK; ++e)
                    d[e] = p[e];
            } else {
                const bool row_ok = n0 + r < N;
#pragma clang loop unroll(full)
                for (uint e = 0; e < QMM_CHUNK; ++e)
                    d[e] = (row_ok && k0 + c + e < K) ? p[e] : T(0);
            }
        }
        // op(W) tile [k][n]: 8 codes of one W row, dequantized in float, stored in T
        {
            // t: W row (out column) c0 + r, its elements k0 + c ..; n: W row k0 + r, columns c0 + c ..
            const uint o = TRANSPOSE ? m0 + c0 + r : k0 + r;
            const uint j = TRANSPOSE ? k0 + c : m0 + c0 + c;
            // t: K is I, a multiple of the group size, so a chunk is all in or all out; n: a chunk
            // starting inside the block lies inside W's row (I a multiple of 16, m0 of 8), and
            // columns past M only reach out columns that are never stored
            const bool ok = TRANSPOSE ? (c0 + r < M && k0 + c < K) : (k0 + r < K && c0 + c < M);
            float s = 0.0f, b = 0.0f;
            ulong v = 0;
            if (ok) {
                v = codes8<BITS>(w + (ulong)o * words, j);
                const uint g = o * G + j / gs;
                s = float(scales[g]), b = MX ? 0.0f : float(biases[g]);
            }
#pragma clang loop unroll(full)
            for (uint e = 0; e < QMM_CHUNK; ++e) {
                const T wv = T(ok ? qweight<BITS, MX>(v, e, s, b) : 0.0f);
                if (TRANSPOSE)
                    Ws[(c + e) * QMM_LDW + r] = wv;
                else
                    Ws[r * QMM_LDW + c + e] = wv;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);   // tiles complete before any SIMD-group reads them

#pragma clang loop unroll(full)
        for (uint kk = 0; kk < QMM_BK; kk += 8) {
            simdgroup_matrix<T, 8, 8> a[2];
            simdgroup_matrix<T, 8, 8> bm[2];
#pragma clang loop unroll(full)
            for (uint i = 0; i < 2; ++i)
                simdgroup_load(a[i], Xs + (sm * 16 + i * 8) * QMM_LDX + kk, QMM_LDX);
#pragma clang loop unroll(full)
            for (uint j = 0; j < 2; ++j)
                simdgroup_load(bm[j], Ws + kk * QMM_LDW + sn * 16 + j * 8, QMM_LDW);
#pragma clang loop unroll(full)
            for (uint i = 0; i < 2; ++i)
#pragma clang loop unroll(full)
                for (uint j = 0; j < 2; ++j)
                    simdgroup_multiply_accumulate(acc[i][j], a[i], bm[j], acc[i][j]);
        }
        // every SIMD-group is done reading before the next step overwrites the tiles
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // Apple's distribution of an 8x8 simdgroup_matrix: lane holds row fr, columns fc and fc + 1
    // (as gemm.metal's steel kernels store). beta == 0 never reads out (it may hold NaN).
    const uint q = lane / 4;
    const uint fr = (q & 4) + (lane / 2) % 4, fc = (q & 2) * 2 + (lane % 2) * 2;
    const bool use_out = beta != 0.0f;
#pragma clang loop unroll(full)
    for (uint i = 0; i < 2; ++i) {
        const uint n = n0 + sm * 16 + i * 8 + fr;
#pragma clang loop unroll(full)
        for (uint j = 0; j < 2; ++j) {
            const uint m = c0 + sn * 16 + j * 8 + fc;
            const float2 s = acc[i][j].thread_elements();
            device T* p = out + (ulong)n * ldo + m;
            for (uint e = 0; e < 2; ++e)
                if (n < N && m + e < M)
                    p[e] = T(use_out ? fma(beta, float(p[e]), s[e]) : s[e]);
        }
    }
}

template <typename T, typename S, int BITS, bool MX, bool TRANSPOSE>
kernel void quantized_matmul(device const T*    x      [[buffer(0)]],
                             device const uint* w      [[buffer(1)]],
                             device const S*    scales [[buffer(2)]],
                             device const S*    biases [[buffer(3)]],
                             device T*          out    [[buffer(4)]],
                             constant QuantizedMatmulArgs& args [[buffer(5)]],
                             uint3 tg   [[threadgroup_position_in_grid]],
                             uint  tid  [[thread_index_in_threadgroup]],
                             uint  sg   [[simdgroup_index_in_threadgroup]],
                             uint  lane [[thread_index_in_simdgroup]])
{
    threadgroup T Xs[QMM_BM * QMM_LDX];
    threadgroup T Ws[QMM_BK * QMM_LDW];
    qmm_tile<T, S, BITS, MX, TRANSPOSE>(x, w, scales, biases, out, args.N, args.M, args.K, args.words, args.group_size,
                                    args.groups, args.ldx, args.ldo, args.m0, args.beta, tg.y * QMM_BM,
                                    tg.x * QMM_BN, tid, sg, lane, Xs, Ws);
}

// Expert e's rows [x, y) of moe_quantized_matmul, clamped into [0, P] (gemm.metal's moe_rows; a
// library cannot call another's functions): offsets come from moe_sort on the GPU and no host has
// seen them, so wrong ones give wrong rows, never an access out of range.
inline uint2 qmm_moe_rows(device const int* offsets, uint e, uint P)
{
    const int lo = min(max(offsets[e], 0), int(P));
    return uint2(uint(lo), uint(min(max(offsets[e + 1], lo), int(P))));
}

// moe_quantized_matmul (the file comment): threadgroup (x, y) finds row tile tile0 + y among the
// experts' row tiles (ceil(n_e / 32) each, in expert order; the same walk in every thread) and
// runs quantized_matmul's tile on its expert's rows and W_e; past the last tile it exits, the
// whole threadgroup before any barrier.
template <typename T, typename S, int BITS, bool MX, bool TRANSPOSE>
kernel void moe_quantized_matmul(device const T*    x       [[buffer(0)]],
                                 device const uint* w       [[buffer(1)]],
                                 device const S*    scales  [[buffer(2)]],
                                 device const S*    biases  [[buffer(3)]],
                                 device T*          out     [[buffer(4)]],
                                 device const int*  offsets [[buffer(5)]],
                                 constant MoeQuantizedMatmulArgs& args [[buffer(6)]],
                                 uint3 tg   [[threadgroup_position_in_grid]],
                                 uint  tid  [[thread_index_in_threadgroup]],
                                 uint  sg   [[simdgroup_index_in_threadgroup]],
                                 uint  lane [[thread_index_in_simdgroup]])
{
    threadgroup T Xs[QMM_BM * QMM_LDX];
    threadgroup T Ws[QMM_BK * QMM_LDW];
    uint g = args.tile0 + tg.y, e = 0;
    uint2 r = uint2(0, 0);
    for (; e < args.E; ++e) {
        r = qmm_moe_rows(offsets, e, args.P);
        const uint tiles = (r.y - r.x + QMM_BM - 1) / QMM_BM;
        if (g < tiles) break;
        g -= tiles;
    }
    if (e == args.E) return;
    const ulong sw = (ulong)e * args.stride_w, ss = (ulong)e * args.stride_s;
    qmm_tile<T, S, BITS, MX, TRANSPOSE>(x + (ulong)r.x * args.ldx, w + sw, scales + ss, biases + ss,
                                    out + (ulong)r.x * args.ldo, r.y - r.x, args.M, args.K, args.words,
                                    args.group_size, args.groups, args.ldx, args.ldo, args.m0, args.beta,
                                    g * QMM_BM, tg.x * QMM_BN, tid, sg, lane, Xs, Ws);
}

// The few-row form of quantized_matmul_t (the file comment). Rows of W past M and x rows past the
// row block contribute zeros; every lane reaches every simd_sum (uniform control flow).
template <typename T, typename S, int BITS, bool MX>
kernel void quantized_matmul_rows(device const T*    x      [[buffer(0)]],
                                  device const uint* w      [[buffer(1)]],
                                  device const S*    scales [[buffer(2)]],
                                  device const S*    biases [[buffer(3)]],
                                  device T*          out    [[buffer(4)]],
                                  constant QuantizedMatmulArgs& args [[buffer(5)]],
                                  uint3 tg   [[threadgroup_position_in_grid]],
                                  uint  sg   [[simdgroup_index_in_threadgroup]],
                                  uint  lane [[thread_index_in_simdgroup]])
{
    const uint M = args.M, K = args.K, gs = args.group_size, G = args.groups;
    const uint c0 = (tg.x * QMV_SG + sg) * QMV_R;          // this SIMD-group's first out column
    const uint n0 = tg.y * QMV_N, rows = min(uint(QMV_N), args.N - n0);
    float acc[QMV_N][QMV_R];
#pragma clang loop unroll(full)
    for (uint n = 0; n < QMV_N; ++n)
#pragma clang loop unroll(full)
        for (uint i = 0; i < QMV_R; ++i)
            acc[n][i] = 0.0f;

    // K (= I) is a multiple of the group size: a lane's 8 codes are all inside the row and in one
    // group. Loops over n and i are unrolled so that acc stays in registers.
    for (uint k = lane * QMM_CHUNK; k < K; k += 32 * QMM_CHUNK) {
        float wf[QMV_R][QMM_CHUNK];   // the 8 weights of each of this SIMD-group's W rows
#pragma clang loop unroll(full)
        for (uint i = 0; i < QMV_R; ++i) {
            ulong v = 0;
            float s = 0.0f, b = 0.0f;
            if (c0 + i < M) {
                const uint o = args.m0 + c0 + i;
                v = codes8<BITS>(w + (ulong)o * args.words, k);
                s = float(scales[o * G + k / gs]), b = MX ? 0.0f : float(biases[o * G + k / gs]);
            }
#pragma clang loop unroll(full)
            for (uint e = 0; e < QMM_CHUNK; ++e)
                wf[i][e] = qweight<BITS, MX>(v, e, s, b);
        }
#pragma clang loop unroll(full)
        for (uint n = 0; n < QMV_N; ++n) {
            if (n < rows) {
                device const T* xr = x + (ulong)(n0 + n) * args.ldx + k;
#pragma clang loop unroll(full)
                for (uint e = 0; e < QMM_CHUNK; ++e) {
                    const float xe = float(xr[e]);
#pragma clang loop unroll(full)
                    for (uint i = 0; i < QMV_R; ++i)
                        acc[n][i] = fma(xe, wf[i][e], acc[n][i]);
                }
            }
        }
    }

    const bool use_out = args.beta != 0.0f;
#pragma clang loop unroll(full)
    for (uint n = 0; n < QMV_N; ++n)
#pragma clang loop unroll(full)
        for (uint i = 0; i < QMV_R; ++i) {
            const float total = simd_sum(acc[n][i]);
            if (lane == 0 && n < rows && c0 + i < M) {
                device T* p = out + (ulong)(n0 + n) * args.ldo + c0 + i;
                *p = T(use_out ? fma(args.beta, float(*p), total) : total);
            }
        }
}

// quantized_embedding: out[t, c] = the dequantized table[ids[t], c]; one thread per output element
// (grid-stride, any grid). Ids are checked on the host; one outside [0, V) still reads nothing
// out of range and writes NaN (so a missed check shows).
template <typename T, typename S, int BITS>
kernel void quantized_embedding(device const int*   ids    [[buffer(0)]],
                                device const uint*  w      [[buffer(1)]],
                                device const S*     scales [[buffer(2)]],
                                device const S*     biases [[buffer(3)]],
                                device T*           out    [[buffer(4)]],
                                constant QuantizedEmbeddingArgs& args [[buffer(5)]],
                                uint gid [[thread_position_in_grid]],
                                uint gsz [[threads_per_grid]])
{
    const uint C = args.C, G = C / args.group_size, total = args.n * C;
    for (uint i = gid; i < total; i += gsz) {
        const uint t = i / C, c = i - t * C;
        const int id = ids[t];
        if (uint(id) < args.V) {
            const uint g = uint(id) * G + c / args.group_size;
            out[i] = T(dequant<BITS>(w, args.words, uint(id), c, float(scales[g]), float(biases[g])));
        } else {
            out[i] = T(as_type<float>(0x7fc00000u));
        }
    }
}

// The products of one layout (SUFFIX: "_b<bits>" or "_mxfp4"); quantized_embedding is affine's only.
#define QMM_PRODUCTS(T, S, NAME, SUFFIX, BITS, MX)                                                           \
    template [[host_name("quantized_matmul_t_" NAME SUFFIX)]] [[kernel]]                                 \
    decltype(quantized_matmul<T, S, BITS, MX, true>) quantized_matmul<T, S, BITS, MX, true>;              \
    template [[host_name("quantized_matmul_n_" NAME SUFFIX)]] [[kernel]]                                 \
    decltype(quantized_matmul<T, S, BITS, MX, false>) quantized_matmul<T, S, BITS, MX, false>;            \
    template [[host_name("quantized_matmul_tv_" NAME SUFFIX)]] [[kernel]]                                \
    decltype(quantized_matmul_rows<T, S, BITS, MX>) quantized_matmul_rows<T, S, BITS, MX>;                \
    template [[host_name("moe_quantized_matmul_t_" NAME SUFFIX)]] [[kernel]]                             \
    decltype(moe_quantized_matmul<T, S, BITS, MX, true>) moe_quantized_matmul<T, S, BITS, MX, true>;      \
    template [[host_name("moe_quantized_matmul_n_" NAME SUFFIX)]] [[kernel]]                             \
    decltype(moe_quantized_matmul<T, S, BITS, MX, false>) moe_quantized_matmul<T, S, BITS, MX, false>;

#define QMM_KERNEL(T, S, NAME, BITS)                                                                         \
    QMM_PRODUCTS(T, S, NAME, "_b" #BITS, BITS, false)                                                        \
    template [[host_name("quantized_embedding_" NAME "_b" #BITS)]] [[kernel]]                           \
    decltype(quantized_embedding<T, S, BITS>) quantized_embedding<T, S, BITS>;

#define QMM_KERNELS(T, S, NAME)                                                                              \
    QMM_KERNEL(T, S, NAME, 2) QMM_KERNEL(T, S, NAME, 3) QMM_KERNEL(T, S, NAME, 4)                           \
    QMM_KERNEL(T, S, NAME, 5) QMM_KERNEL(T, S, NAME, 6) QMM_KERNEL(T, S, NAME, 8)

QMM_KERNELS(float, float, "f32")
QMM_KERNELS(half, half, "f16")
QMM_KERNELS(half, float, "f16_sf32")

// mxfp4: scales f32, or bf16 with bf16 x; never f16 (it cannot hold E8M0's powers of two)
QMM_PRODUCTS(float, float, "f32", "_mxfp4", 4, true)
QMM_PRODUCTS(half, float, "f16_sf32", "_mxfp4", 4, true)

#if KRNL_BF16
// bf16 activations (MSL 3.1, native on Apple9+), scales in bf16 or f32, accumulated in float.
QMM_KERNELS(bfloat, bfloat, "bf16")
QMM_KERNELS(bfloat, float, "bf16_sf32")
QMM_PRODUCTS(bfloat, bfloat, "bf16", "_mxfp4", 4, true)
QMM_PRODUCTS(bfloat, float, "bf16_sf32", "_mxfp4", 4, true)
#endif
