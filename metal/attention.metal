// msl: 3.0 (krnl's floor; newest feature used: simdgroup_matrix, MSL 2.3)
// attention_forward / attention_backward: fused causal flash attention (docs/architecture.md,
// 'Attention'). q, o, dout, dq (Hq, T, D); k, v, dk, dv (Hk, T, D); query head h reads KV head
// h / (Hq / Hk); lse and delta (Hq, T) f32. Query i sees key j iff j <= i, and i - j < window where
// window > 0, and seg[i] == seg[j] where has_segments (metal/kargs.h AttentionArgs). With has_sinks
// the forward's softmax takes sinks[h] as a column without a value (seeding the running max and
// sum); its lse includes it, so the backward, from lse and delta, is the same. Operands f32 or
// f16 (bf16 under KRNL_BF16), products on 8x8 simdgroup matrices accumulating in float; P and
// dS are rounded to the operand type before their products, as in the forward of every flash
// attention. The scores never leave threadgroup memory.
//
// Kernels (D a template parameter, padded to DP = D rounded up to 8 in threadgroup memory, where
// the pad columns are zeros; tiles from AttnTile below, sized for f32 operands, the worst case):
//   (A dispatch over budget is issued as parts of its grid: threadgroup (x, y) then stands for row
//   block x + args.block0 of head y + args.head0; csrc/metal/policy.h plan_row_blocks.)
//   attention_forward_d<D>_<T>: grid (ceil(T / F_BQ), Hq), F_SG SIMD-groups of 8 query rows each.
//     Loops over key blocks of F_BK from the window's first block to the diagonal: S = Q K^T,
//     online softmax in float (4 lanes per row), O = diag(alpha) O + P V in registers; writes
//     O / l and lse = m + log(l). Stages Q (F_BQ, DP), K then V (F_BK, DP) in one buffer,
//     S (F_BQ, F_BK) f32, P (F_BQ, F_BK), and 8x8 f32 per SIMD-group (the row-scale diagonal, then
//     the output chunks). At D = 256, f32: 16 + 8 + 0.5 + 0.5 + 0.5 KiB = 25.5 KiB.
//   attention_backward_delta_<T>: one thread per row of (Hq * T): delta = rowsum(dout * o), f32.
//   attention_backward_dq_d<D>_<T>: grid (ceil(T / Q_BQ), Hq), Q_SG SIMD-groups of 8 query rows.
//     Per key block: V staged, dP = dO V^T; K staged in the same buffer, S = Q K^T,
//     P = exp(scale S - lse), dS = P (dP - delta), dQ += dS K; dq = scale dQ. Stages Q and dO
//     (Q_BQ, DP), K/V (Q_BK, DP), S and dP (Q_BQ, Q_BK) f32, dS (Q_BQ, Q_BK), 8x8 f32 per
//     SIMD-group. At D = 256 (Q_BQ = Q_BK = 8), f32: 8 + 8 + 8 + 0.25 * 4 KiB = 25 KiB.
//   attention_backward_dkv_d<D>_<T>: grid (ceil(T / K_BK), Hk), K_SG SIMD-groups of 8 keys. Loops
//     over the g query heads of its KV head and their query blocks of K_BQ from the block's first
//     key to its last key's window: S^T = K Q^T, P^T, dP^T = V dO^T, dS^T,
//     dV += P^T dO, dK += dS^T Q, all in registers; dk = scale dK. Each KV block is one
//     threadgroup's alone, so no float atomics. Stages K and V (K_BK, DP), Q and dO (K_BQ, DP),
//     S^T, dP^T (K_BK, K_BQ) f32, P^T, dS^T (K_BK, K_BQ), 8x8 f32 per SIMD-group. Where Q and dO
//     both staged would not fit (K_SHARE: D > 128) they take turns in one buffer, Q staged twice
//     per block. At D = 256 (K_BK = K_BQ = 8, shared), f32: 8 + 8 + 8 + 0.25 * 5 KiB = 25.3 KiB.
// Every tile size is a whole number of 8x8 fragments; rows past T are staged as zeros and masked.
// Blocks outside the causal band and the window are never visited. With packed segments each
// visited block first evaluates its mask (1/D of the block's products; segment ids need not be
// sorted) and is skipped when no query sees any key of it: most blocks below the diagonal when
// the samples are short. The byte counts above leave out 16 bytes of block flags.
// Registers: the forward and dq hold DB f32 accumulator fragments per SIMD-group, dk/dv 2 DB (at
// D = 256: 128 floats per thread), which may spill on an Apple GPU; none of this has run on one.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
#include "kargs.h"
using namespace metal;

#define ATTN_LOWEST (-3.402823466e+38f)   // -FLT_MAX: a finite seed for the max (fast math has no inf)

// Tile geometry per head size, as enum constants (compile-time integers; see gemm.metal).
template <typename T, int D>
struct AttnTile {
    enum {
        DP = (D + 7) / 8 * 8,                   // padded head size
        DB = DP / 8,                            // 8-column fragments across a row
        ES = sizeof(T),
        F_SG = DP <= 128 ? 4 : 2,               // forward: SIMD-groups, query rows, keys per block
        F_BQ = 8 * F_SG,
        F_BK = DP <= 64 ? 32 : (DP <= 128 ? 16 : 8),
        F_BYTES = F_BQ * F_BK * 4 + F_SG * 256 + 16 + (F_BQ * DP + F_BK * DP + F_BQ * F_BK) * ES,
        Q_SG = DP <= 64 ? 4 : (DP <= 128 ? 2 : 1),   // dq: SIMD-groups, query rows, keys per block
        Q_BQ = 8 * Q_SG,
        Q_BK = DP <= 128 ? 16 : 8,
        Q_BYTES = 2 * Q_BQ * Q_BK * 4 + Q_SG * 256 + 16 + (2 * Q_BQ * DP + Q_BK * DP + Q_BQ * Q_BK) * ES,
        K_SG = DP <= 128 ? 2 : 1,               // dk, dv: SIMD-groups, keys, query rows per block
        K_BK = 8 * K_SG,
        K_BQ = DP <= 64 ? 16 : 8,
        K_SHARE = DP > 128 ? 1 : 0,             // Q and dO take turns in one buffer
        K_BYTES = 2 * K_BK * K_BQ * 4 + K_SG * 256 + 16 +
                  (2 * K_BK * DP + (2 - K_SHARE) * K_BQ * DP + 2 * K_BK * K_BQ) * ES,
    };
    static_assert(F_BYTES <= 32768 && Q_BYTES <= 32768 && K_BYTES <= 32768, "32 KiB of threadgroup memory");
};

// Stages rows [r0, r0 + R) of a (n, D) matrix into dst (R, DP); rows past n and pad columns are
// zeros, so that they add nothing to any product.
template <typename T, int D, int R>
inline void attn_stage(threadgroup T* dst, device const T* src, uint r0, uint n, uint tid, uint ntg)
{
    enum { DP = (D + 7) / 8 * 8 };
    for (uint e = tid; e < R * DP; e += ntg) {
        const uint r = e / DP, c = e % DP;
        dst[e] = (r0 + r < n && c < D) ? src[(ulong)(r0 + r) * D + c] : T(0.0f);
    }
}

// Query i sees key j (the op contract); i past n sees nothing.
inline bool attn_visible(uint i, uint j, uint n, uint window, device const int* seg, bool use_seg)
{
    return i < n && j <= i && (window == 0 || i - j < window) && (!use_seg || seg[i] == seg[j]);
}

// Whether any query of [i0, i0 + R) sees any key of [j0, j0 + C). Every thread of the threadgroup
// calls it (after a barrier that follows the previous call's reads) and gets the same answer.
template <int R, int C>
inline bool attn_block_visible(uint i0, uint j0, uint n, uint window, device const int* seg, bool use_seg,
                               threadgroup uint* flags, uint tid, uint ntg, uint lane, uint sg, uint nsg)
{
    bool any = false;
    for (uint e = tid; e < R * C && !any; e += ntg)
        any = attn_visible(i0 + e / C, j0 + e % C, n, window, seg, use_seg);
    any = simd_any(any);
    if (lane == 0) flags[sg] = any ? 1u : 0u;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    bool keep = false;
    for (uint s = 0; s < nsg; ++s) keep = keep || flags[s] != 0u;
    return keep;
}

// One SIMD-group: out (8, N) f32 (row stride ldo) = A (8, DP) B^T with B (N, DP), both staged.
template <typename T, int DB, int N>
inline void attn_abt(threadgroup float* out, uint ldo, threadgroup const T* A, threadgroup const T* B, uint ld)
{
    for (uint c = 0; c < N / 8; ++c) {
        simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (uint d = 0; d < DB; ++d) {
            simdgroup_matrix<T, 8, 8> a;
            simdgroup_matrix<T, 8, 8> b;
            simdgroup_load(a, A + d * 8, ld);
            simdgroup_load(b, B + c * 8 * ld + d * 8, ld, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(acc, a, b, acc);
        }
        simdgroup_store(acc, out + c * 8, ldo);
    }
}

// One SIMD-group: acc[DB] (8, DP) += A (8, K) B with A row stride lda, B (K, DP) staged.
template <typename T, int DB, int K>
inline void attn_ab(thread simdgroup_float8x8* acc, threadgroup const T* A, uint lda, threadgroup const T* B, uint ldb)
{
    for (uint c = 0; c < K / 8; ++c) {
        simdgroup_matrix<T, 8, 8> a;
        simdgroup_load(a, A + c * 8, lda);
        for (uint j = 0; j < DB; ++j) {
            simdgroup_matrix<T, 8, 8> b;
            simdgroup_load(b, B + c * 8 * ldb + j * 8, ldb);
            simdgroup_multiply_accumulate(acc[j], a, b, acc[j]);
        }
    }
}

// One SIMD-group writes its 8 rows of acc[DB] (times `scale`) to rows r0.. of dst (n, D), through
// an 8x8 f32 chunk of threadgroup memory; rows past n and pad columns are not written.
template <typename T, int D, int DB>
inline void attn_store_rows(device T* dst, thread simdgroup_float8x8* acc, float scale, threadgroup float* chunk,
                            uint r0, uint n, uint lane)
{
    for (uint j = 0; j < DB; ++j) {
        simdgroup_barrier(mem_flags::mem_threadgroup);   // every lane has read the previous chunk
        simdgroup_store(acc[j], chunk, 8);
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (uint e = lane; e < 64; e += 32) {
            const uint r = r0 + e / 8, c = j * 8 + e % 8;
            if (r < n && c < D)
                dst[(ulong)r * D + c] = T(chunk[e] * scale);
        }
    }
}

template <typename T, int D>
kernel void attention_forward(device const T*         q    [[buffer(0)]],
                              device const T*         k    [[buffer(1)]],
                              device const T*         v    [[buffer(2)]],
                              device T*               o    [[buffer(3)]],
                              device float*           lse  [[buffer(4)]],
                              device const int*       seg  [[buffer(5)]],
                              constant AttentionArgs& args [[buffer(6)]],
                              device const float*     sinks [[buffer(7)]],
                              uint2 tg   [[threadgroup_position_in_grid]],
                              uint  tid  [[thread_index_in_threadgroup]],
                              uint  lane [[thread_index_in_simdgroup]],
                              uint  sg   [[simdgroup_index_in_threadgroup]])
{
    typedef AttnTile<T, D> Tile;
    enum { DP = Tile::DP, DB = Tile::DB, BQ = Tile::F_BQ, BK = Tile::F_BK, NT = 32 * Tile::F_SG };
    threadgroup float4 smem[Tile::F_BYTES / 16];
    threadgroup float* s_s  = (threadgroup float*)smem;          // (BQ, BK) scores
    threadgroup float* d_s  = s_s + BQ * BK;                     // (F_SG, 8, 8) diagonal, then output chunks
    threadgroup uint*  f_s  = (threadgroup uint*)(d_s + Tile::F_SG * 64);  // (4,) block flags
    threadgroup T*     q_s  = (threadgroup T*)(f_s + 4);         // (BQ, DP)
    threadgroup T*     kv_s = q_s + BQ * DP;                     // (BK, DP) K, then V
    threadgroup T*     p_s  = kv_s + BK * DP;                    // (BQ, BK) probabilities

    const uint n = args.T, window = args.window, h = tg.y + args.head0, hk = h / (args.Hq / args.Hk);
    const bool use_seg = args.has_segments != 0;
    const float scale = args.scale;
    const uint q0 = (tg.x + args.block0) * BQ;
    device const T* kh = k + (ulong)hk * n * D;
    device const T* vh = v + (ulong)hk * n * D;
    // keys of the block: up to its last query (causal), from its first query's window
    const uint k_end = min(n, q0 + BQ);
    const uint k_begin = (window > 0 && q0 + 1 > window) ? (q0 + 1 - window) / BK * BK : 0;

    attn_stage<T, D, BQ>(q_s, q + (ulong)h * n * D, q0, n, tid, NT);
    threadgroup float* diag = d_s + sg * 64;
    for (uint e = lane; e < 64; e += 32) diag[e] = 0.0f;        // off-diagonal zeros stay

    const uint r = lane / 4, cl = lane % 4;   // this lane's row of its SIMD-group's 8, column phase
    const uint qi = q0 + sg * 8 + r;
    threadgroup float* srow = s_s + sg * 8 * BK;
    threadgroup T*     prow = p_s + sg * 8 * BK;
    float m = ATTN_LOWEST, l = 0.0f;          // running max and sum of this lane's row
    if (args.has_sinks != 0) m = sinks[h], l = 1.0f;   // the sink's column: exp(sink - m) = 1
    simdgroup_float8x8 acc[DB];
    for (uint j = 0; j < DB; ++j) acc[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        threadgroup_barrier(mem_flags::mem_threadgroup);   // every SIMD-group is done with V
        if (use_seg && !attn_block_visible<BQ, BK>(q0, k0, n, window, seg, use_seg, f_s, tid, NT, lane, sg, Tile::F_SG))
            continue;
        attn_stage<T, D, BK>(kv_s, kh, k0, n, tid, NT);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        attn_abt<T, DB, BK>(srow, BK, q_s + sg * 8 * DP, kv_s, DP);
        threadgroup_barrier(mem_flags::mem_threadgroup);   // every SIMD-group is done with K
        attn_stage<T, D, BK>(kv_s, vh, k0, n, tid, NT);

        float bm = ATTN_LOWEST;
        for (uint c = cl; c < BK; c += 4)
            if (attn_visible(qi, k0 + c, n, window, seg, use_seg)) bm = max(bm, scale * srow[r * BK + c]);
        bm = max(bm, simd_shuffle_xor(bm, 1));
        bm = max(bm, simd_shuffle_xor(bm, 2));
        const float mn = max(m, bm);
        float sum = 0.0f;
        for (uint c = cl; c < BK; c += 4) {
            const float p = attn_visible(qi, k0 + c, n, window, seg, use_seg) ? exp(scale * srow[r * BK + c] - mn) : 0.0f;
            sum += p;
            prow[r * BK + c] = T(p);
        }
        sum += simd_shuffle_xor(sum, 1);
        sum += simd_shuffle_xor(sum, 2);
        const float alpha = exp(m - mn);   // 0 when the row saw its first key just now
        l = l * alpha + sum;
        m = mn;
        if (cl == 0) diag[r * 9] = alpha;
        threadgroup_barrier(mem_flags::mem_threadgroup);   // V staged; P and the diagonal written

        simdgroup_float8x8 dg;
        simdgroup_load(dg, diag, 8);
        for (uint j = 0; j < DB; ++j) simdgroup_multiply_accumulate(acc[j], dg, acc[j], make_filled_simdgroup_matrix<float, 8, 8>(0.0f));
        attn_ab<T, DB, BK>(acc, prow, BK, kv_s, DP);
    }

    simdgroup_barrier(mem_flags::mem_threadgroup);   // every lane has loaded the last diagonal
    if (cl == 0) diag[r * 9] = l > 0.0f ? 1.0f / l : 0.0f;   // rows past T saw nothing
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 dg;
    simdgroup_load(dg, diag, 8);
    for (uint j = 0; j < DB; ++j) simdgroup_multiply_accumulate(acc[j], dg, acc[j], make_filled_simdgroup_matrix<float, 8, 8>(0.0f));
    attn_store_rows<T, D, DB>(o + (ulong)h * n * D, acc, 1.0f, diag, q0 + sg * 8, n, lane);
    if (cl == 0 && qi < n) lse[(ulong)h * n + qi] = m + log(l);
}

// delta[row] = sum_d dout[row, d] * o[row, d] over rows = Hq * T (args.Hq * args.T), in float.
template <typename T>
kernel void attention_backward_delta(device const T*         o     [[buffer(0)]],
                                     device const T*         dout  [[buffer(1)]],
                                     device float*           delta [[buffer(2)]],
                                     constant AttentionArgs& args  [[buffer(3)]],
                                     uint row [[thread_position_in_grid]])
{
    if (row >= args.Hq * args.T) return;
    const uint D = args.D;
    float s = 0.0f;
    for (uint d = 0; d < D; ++d) s = fma(float(dout[(ulong)row * D + d]), float(o[(ulong)row * D + d]), s);
    delta[row] = s;
}

template <typename T, int D>
kernel void attention_backward_dq(device const T*         q     [[buffer(0)]],
                                  device const T*         k     [[buffer(1)]],
                                  device const T*         v     [[buffer(2)]],
                                  device const T*         dout  [[buffer(3)]],
                                  device const float*     lse   [[buffer(4)]],
                                  device const float*     delta [[buffer(5)]],
                                  device const int*       seg   [[buffer(6)]],
                                  device T*               dq    [[buffer(7)]],
                                  constant AttentionArgs& args  [[buffer(8)]],
                                  uint2 tg   [[threadgroup_position_in_grid]],
                                  uint  tid  [[thread_index_in_threadgroup]],
                                  uint  lane [[thread_index_in_simdgroup]],
                                  uint  sg   [[simdgroup_index_in_threadgroup]])
{
    typedef AttnTile<T, D> Tile;
    enum { DP = Tile::DP, DB = Tile::DB, BQ = Tile::Q_BQ, BK = Tile::Q_BK, NT = 32 * Tile::Q_SG };
    threadgroup float4 smem[Tile::Q_BYTES / 16];
    threadgroup float* s_s  = (threadgroup float*)smem;          // (BQ, BK) scores
    threadgroup float* dp_s = s_s + BQ * BK;                     // (BQ, BK) dO V^T
    threadgroup float* c_s  = dp_s + BQ * BK;                    // (Q_SG, 8, 8) output chunks
    threadgroup uint*  f_s  = (threadgroup uint*)(c_s + Tile::Q_SG * 64);  // (4,) block flags
    threadgroup T*     q_s  = (threadgroup T*)(f_s + 4);         // (BQ, DP)
    threadgroup T*     do_s = q_s + BQ * DP;                     // (BQ, DP)
    threadgroup T*     kv_s = do_s + BQ * DP;                    // (BK, DP) V, then K
    threadgroup T*     ds_s = kv_s + BK * DP;                    // (BQ, BK) P (dP - delta)

    const uint n = args.T, window = args.window, h = tg.y + args.head0, hk = h / (args.Hq / args.Hk);
    const bool use_seg = args.has_segments != 0;
    const float scale = args.scale;
    const uint q0 = (tg.x + args.block0) * BQ;
    device const T* kh = k + (ulong)hk * n * D;
    device const T* vh = v + (ulong)hk * n * D;
    const uint k_end = min(n, q0 + BQ);
    const uint k_begin = (window > 0 && q0 + 1 > window) ? (q0 + 1 - window) / BK * BK : 0;

    attn_stage<T, D, BQ>(q_s, q + (ulong)h * n * D, q0, n, tid, NT);
    attn_stage<T, D, BQ>(do_s, dout + (ulong)h * n * D, q0, n, tid, NT);

    const uint r = lane / 4, cl = lane % 4;
    const uint qi = q0 + sg * 8 + r;
    const float lse_i = qi < n ? lse[(ulong)h * n + qi] : 0.0f;
    const float delta_i = qi < n ? delta[(ulong)h * n + qi] : 0.0f;
    threadgroup float* srow  = s_s + sg * 8 * BK;
    threadgroup float* dprow = dp_s + sg * 8 * BK;
    threadgroup T*     dsrow = ds_s + sg * 8 * BK;
    simdgroup_float8x8 acc[DB];
    for (uint j = 0; j < DB; ++j) acc[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        threadgroup_barrier(mem_flags::mem_threadgroup);   // every SIMD-group is done with K
        if (use_seg && !attn_block_visible<BQ, BK>(q0, k0, n, window, seg, use_seg, f_s, tid, NT, lane, sg, Tile::Q_SG))
            continue;
        attn_stage<T, D, BK>(kv_s, vh, k0, n, tid, NT);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        attn_abt<T, DB, BK>(dprow, BK, do_s + sg * 8 * DP, kv_s, DP);
        threadgroup_barrier(mem_flags::mem_threadgroup);   // every SIMD-group is done with V
        attn_stage<T, D, BK>(kv_s, kh, k0, n, tid, NT);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        attn_abt<T, DB, BK>(srow, BK, q_s + sg * 8 * DP, kv_s, DP);
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (uint c = cl; c < BK; c += 4) {
            const uint e = r * BK + c;
            const float p = attn_visible(qi, k0 + c, n, window, seg, use_seg) ? exp(scale * srow[e] - lse_i) : 0.0f;
            dsrow[e] = T(p * (dprow[e] - delta_i));
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
        attn_ab<T, DB, BK>(acc, dsrow, BK, kv_s, DP);
    }
    attn_store_rows<T, D, DB>(dq + (ulong)h * n * D, acc, scale, c_s + sg * 64, q0 + sg * 8, n, lane);
}

template <typename T, int D>
kernel void attention_backward_dkv(device const T*         q     [[buffer(0)]],
                                   device const T*         k     [[buffer(1)]],
                                   device const T*         v     [[buffer(2)]],
                                   device const T*         dout  [[buffer(3)]],
                                   device const float*     lse   [[buffer(4)]],
                                   device const float*     delta [[buffer(5)]],
                                   device const int*       seg   [[buffer(6)]],
                                   device T*               dk    [[buffer(7)]],
                                   device T*               dv    [[buffer(8)]],
                                   constant AttentionArgs& args  [[buffer(9)]],
                                   uint2 tg   [[threadgroup_position_in_grid]],
                                   uint  tid  [[thread_index_in_threadgroup]],
                                   uint  lane [[thread_index_in_simdgroup]],
                                   uint  sg   [[simdgroup_index_in_threadgroup]])
{
    typedef AttnTile<T, D> Tile;
    enum { DP = Tile::DP, DB = Tile::DB, BK = Tile::K_BK, BQ = Tile::K_BQ, NT = 32 * Tile::K_SG };
    threadgroup float4 smem[Tile::K_BYTES / 16];
    threadgroup float* s_s  = (threadgroup float*)smem;          // (BK, BQ) K Q^T
    threadgroup float* dp_s = s_s + BK * BQ;                     // (BK, BQ) V dO^T
    threadgroup float* c_s  = dp_s + BK * BQ;                    // (K_SG, 8, 8) output chunks
    threadgroup uint*  f_s  = (threadgroup uint*)(c_s + Tile::K_SG * 64);  // (4,) block flags
    threadgroup T*     k_s  = (threadgroup T*)(f_s + 4);         // (BK, DP)
    threadgroup T*     v_s  = k_s + BK * DP;                     // (BK, DP)
    threadgroup T*     p_s  = v_s + BK * DP;                     // (BK, BQ) P^T
    threadgroup T*     ds_s = p_s + BK * BQ;                     // (BK, BQ) dS^T
    threadgroup T*     q_s  = ds_s + BK * BQ;                    // (BQ, DP)
    threadgroup T*     do_s = Tile::K_SHARE ? q_s : q_s + BQ * DP;  // (BQ, DP)

    const uint n = args.T, window = args.window, hk = tg.y + args.head0, g = args.Hq / args.Hk;
    const bool use_seg = args.has_segments != 0;
    const float scale = args.scale;
    const uint k0 = (tg.x + args.block0) * BK;
    attn_stage<T, D, BK>(k_s, k + (ulong)hk * n * D, k0, n, tid, NT);
    attn_stage<T, D, BK>(v_s, v + (ulong)hk * n * D, k0, n, tid, NT);
    // queries of the block: from its first key (causal) to its last key's window
    const uint q_begin = k0 / BQ * BQ;
    const uint q_end = window > 0 ? min(n, k0 + BK - 1 + window) : n;

    const uint r = lane / 4, cl = lane % 4;   // this lane's key of its SIMD-group's 8, column phase
    const uint kj = k0 + sg * 8 + r;
    threadgroup float* srow  = s_s + sg * 8 * BQ;
    threadgroup float* dprow = dp_s + sg * 8 * BQ;
    threadgroup T*     prow  = p_s + sg * 8 * BQ;
    threadgroup T*     dsrow = ds_s + sg * 8 * BQ;
    simdgroup_float8x8 dk_acc[DB];
    simdgroup_float8x8 dv_acc[DB];
    for (uint j = 0; j < DB; ++j) {
        dk_acc[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        dv_acc[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }

    for (uint h = hk * g; h < hk * g + g; ++h) {
        device const T*     qh = q + (ulong)h * n * D;
        device const T*     doh = dout + (ulong)h * n * D;
        device const float* lse_h = lse + (ulong)h * n;
        device const float* delta_h = delta + (ulong)h * n;
        for (uint i0 = q_begin; i0 < q_end; i0 += BQ) {
            threadgroup_barrier(mem_flags::mem_threadgroup);   // every SIMD-group is done with Q and dO
            if (use_seg && !attn_block_visible<BQ, BK>(i0, k0, n, window, seg, use_seg, f_s, tid, NT, lane, sg, Tile::K_SG))
                continue;
            attn_stage<T, D, BQ>(q_s, qh, i0, n, tid, NT);
            if (!Tile::K_SHARE) attn_stage<T, D, BQ>(do_s, doh, i0, n, tid, NT);
            threadgroup_barrier(mem_flags::mem_threadgroup);
            attn_abt<T, DB, BQ>(srow, BQ, k_s + sg * 8 * DP, q_s, DP);
            if (Tile::K_SHARE) {
                threadgroup_barrier(mem_flags::mem_threadgroup);   // every SIMD-group is done with Q
                attn_stage<T, D, BQ>(do_s, doh, i0, n, tid, NT);
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }
            attn_abt<T, DB, BQ>(dprow, BQ, v_s + sg * 8 * DP, do_s, DP);
            simdgroup_barrier(mem_flags::mem_threadgroup);
            for (uint c = cl; c < BQ; c += 4) {
                const uint e = r * BQ + c, i = i0 + c;
                const float p = attn_visible(i, kj, n, window, seg, use_seg) ? exp(scale * srow[e] - lse_h[i]) : 0.0f;
                prow[e] = T(p);
                dsrow[e] = T(p == 0.0f ? 0.0f : p * (dprow[e] - delta_h[i]));
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            attn_ab<T, DB, BQ>(dv_acc, prow, BQ, do_s, DP);
            if (Tile::K_SHARE) {
                threadgroup_barrier(mem_flags::mem_threadgroup);   // every SIMD-group is done with dO
                attn_stage<T, D, BQ>(q_s, qh, i0, n, tid, NT);
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }
            attn_ab<T, DB, BQ>(dk_acc, dsrow, BQ, q_s, DP);
        }
    }
    attn_store_rows<T, D, DB>(dk + (ulong)hk * n * D, dk_acc, scale, c_s + sg * 64, k0 + sg * 8, n, lane);
    attn_store_rows<T, D, DB>(dv + (ulong)hk * n * D, dv_acc, 1.0f, c_s + sg * 64, k0 + sg * 8, n, lane);
}

// Head sizes: the common ones (64, 80, 96, 128, 256) and the small ones of the tests and the tiny
// models (4, 8, 16, 32). Keep csrc/metal/attention.cpp's kAttentionHeadDims in step.
#define ATTN_KERNELS(T, S, D)                                                                          \
    template [[host_name("attention_forward_d" #D "_" #S)]] [[kernel]]                                 \
    decltype(attention_forward<T, D>) attention_forward<T, D>;                                         \
    template [[host_name("attention_backward_dq_d" #D "_" #S)]] [[kernel]]                             \
    decltype(attention_backward_dq<T, D>) attention_backward_dq<T, D>;                                 \
    template [[host_name("attention_backward_dkv_d" #D "_" #S)]] [[kernel]]                            \
    decltype(attention_backward_dkv<T, D>) attention_backward_dkv<T, D>;
#define ATTN_ALL_SIZES(T, S)                                                                           \
    ATTN_KERNELS(T, S, 4) ATTN_KERNELS(T, S, 8) ATTN_KERNELS(T, S, 16) ATTN_KERNELS(T, S, 32)          \
    ATTN_KERNELS(T, S, 64) ATTN_KERNELS(T, S, 80) ATTN_KERNELS(T, S, 96) ATTN_KERNELS(T, S, 128)       \
    ATTN_KERNELS(T, S, 256)                                                                            \
    template [[host_name("attention_backward_delta_" #S)]] [[kernel]]                                  \
    decltype(attention_backward_delta<T>) attention_backward_delta<T>;

ATTN_ALL_SIZES(float, f32)
ATTN_ALL_SIZES(half, f16)

// bf16 where the language has bfloat (MSL 3.1: the host compiles this library with 3.1 on GPUs
// with native bf16): the same kernels, bfloat operands and float accumulation.
#if KRNL_BF16
ATTN_ALL_SIZES(bfloat, bf16)
#endif
