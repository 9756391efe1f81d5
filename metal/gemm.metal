// msl: 3.0 (krnl's floor; newest feature used: simdgroup_matrix, MSL 2.3)
// gemm: C = alpha * op(A) * op(B) + beta * C (metal/kargs.h GemmArgs), accumulated in fp32; A and
// B f32, f16 or bf16, C of the operand type or f32 (gemm_*_f16_f32, LoRA gradients). Variants: nn;
// nt (op(B) = B^T, B stored (N, K)); tn (op(A) = A^T, A stored (K, M)). Stored matrices are
// row-major with row strides lda/ldb/ldc; batch entry z = grid.z sits at element offsets
// z * stride_a/b/c (0 broadcasts one matrix to every batch entry).
// The grouped GEMMs of a mixture of experts (moe_gemm_*) share gemm_tile at the end of the file.
//
// Plain GEMM variants (the host picks one per shape class; `krnl tune` measures which wins on the
// user's GPU, today's tile32 without a measurement). Per K step of 16, with M N K FLOPs = 2 M N K:
//   tile32   gemm_{nn,nt,tn}_{f32,f16,f16_f32}: 32x32 tile, ONE SIMD-group (32 threads), 16
//            accumulators of 8x8 (32 floats per thread); threadgroup memory 4,864 bytes (operand
//            tiles, then the float result tile in the same bytes); device reads 1 element per 32
//            FLOPs; 8 fragment loads per 16 products. The result goes through threadgroup memory.
//   steel64  gemm_steel64_{nn,nt,tn}_{...}: 64x64 tile, 4 SIMD-groups (128 threads) of 32x32
//            sub-tiles, 16 accumulators each (32 floats per thread, as tile32); threadgroup memory
//            9,472 bytes f32, 4,736 half (operands only); device reads 1 element per 64 FLOPs (half
//            of tile32's); 4x fewer threadgroups, so small outputs fill fewer GPU cores. The
//            result is stored from the accumulators (2 adjacent elements per lane).
//   steel32  gemm_steel32_{nn,nt,tn}_{...}: 32x32 tile, 4 SIMD-groups (128 threads) of 16x16
//            sub-tiles, 4 accumulators each (8 floats per thread: more threadgroups per core);
//            threadgroup memory 4,864 bytes f32, 2,432 half; device reads as tile32, but 4x the
//            threads per tile (small and skinny outputs) and twice the fragment loads per product
//            (4 per 4). Result stored from the accumulators.
//   Every variant sums k in the same order (16-deep steps, 8-deep products) and applies alpha
//   and beta with the same fma; only the tiling differs.
//
// Dispatch geometry (dispatchThreadgroups):
//   gemm_{nn,nt,tn}_{f32,f16,f16_f32}: grid (ceil(N/32), ceil(M/32), batch), threads (32, 1, 1);
//     threadgroup (x, y) computes the 32x32 tile C[32y.., 32x..] with 4x4 simdgroup_float8x8
//     accumulators.
//   gemm_steel64_*: grid (ceil(N/64), ceil(M/64), batch), threads (128, 1, 1).
//   gemm_steel32_*: grid (ceil(N/32), ceil(M/32), batch), threads (128, 1, 1).
//   gemm_splitk_{nn,nt,tn}_{f32,f16}: grid (ceil(N/32), ceil(M/32), splits), threads (32, 1, 1);
//     z = split s sums k in [s * k_split, min(K, (s + 1) * k_split)) into the dense f32 partials
//     buffer(2) at s * M * N (row stride N). Batch is 1; alpha, beta, ldc, stride_* are unused.
//   gemm_reduce_{f32,f16}: 2-D, one thread per element at thread_position_in_grid = (n, m); any
//     threadgroup shape, e.g. threads (32, 8, 1) and grid (ceil(N/32), ceil(M/8), 1); threads
//     outside (N, M) return. C = alpha * sum_s partials[s] + beta * C, summed in s order.
// beta == 0 never reads C (it may hold NaN or garbage).
//
// Function constant 0, gemm_aligned (bool; unset = false): the host promises M, N multiples of the
// variant's tile (32, or 64 for steel64), K a multiple of 32, lda/ldb/ldc multiples of 4,
// 4-element aligned buffer offsets and batch strides (and, for the split-K kernels, k_split a
// multiple of 32). The kernels then drop every edge check and use
// vector loads and stores. Unset or false: any M, N, K >= 1 (K may be below the tile) and any
// strides; edge tiles are zero filled on the way in and bounds-checked on the way out.
//
// tile32: per K step of 16 the op(A) tile (32 x 16, [m][k]) and the op(B) tile (16 x 32, [k][n]) are
// staged in threadgroup memory, always in those orientations: operands stored the other way
// (A of tn, B of nt) are read along their contiguous dimension, 4 elements per read, and written
// transposed. Half operands go to simdgroup_half8x8 fragments that multiply into float
// accumulators (products of halves are exact in float); the result tile goes through a float
// staging tile (aliasing the operand tiles) so that edge tiles can be written element-wise, and
// half outputs are rounded once there. bfloat operands (the _bf16 kernels, behind KRNL_BF16:
// MSL 3.1, compiled only for GPUs with native bf16) take the same path with simdgroup_bfloat8x8
// fragments; their products are exact in float too.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
#include "kargs.h"
using namespace metal;

// Tile geometry as enum constants (compile-time integers). Not program-scope `constant` variables:
// Apple's compiler treats those as memory, and the 16 accumulators then spill.
enum {
    GEMM_BM      = 32,                          // output rows per threadgroup
    GEMM_BN      = 32,                          // output columns per threadgroup
    GEMM_BK      = 16,                          // K step staged per iteration
    GEMM_THREADS = 32,                          // one SIMD-group
    GEMM_PAD     = 4,                           // staged-row padding: fewer bank conflicts on the
                                                // transposing writes, rows stay 4-element aligned
    GEMM_LDA_S   = GEMM_BK + GEMM_PAD,          // As [BM][LDA_S]: op(A) tile as [m][k]
    GEMM_LDB_S   = GEMM_BN + GEMM_PAD,          // Bs [BK][LDB_S]: op(B) tile as [k][n]
    GEMM_LDC_S   = GEMM_BN,                     // Cs [BM][BN]: float result tile
    GEMM_AS_ELEMS = GEMM_BM * GEMM_LDA_S,
    GEMM_BS_ELEMS = GEMM_BK * GEMM_LDB_S,
    // One float4 array holds either the operand tiles (counted as floats: the f32 worst case) or
    // the result tile: 4864 bytes.
    GEMM_SMEM_F4 = (GEMM_AS_ELEMS + GEMM_BS_ELEMS > GEMM_BM * GEMM_LDC_S
                        ? GEMM_AS_ELEMS + GEMM_BS_ELEMS : GEMM_BM * GEMM_LDC_S) / 4,
};

constant bool gemm_aligned [[function_constant(0)]];
// An unset function constant has no value: read it only when defined (unset = edge-checked path).
constant bool gemm_is_aligned = is_function_constant_defined(gemm_aligned) && gemm_aligned;

// Stages the R x C block at (r0, c0) of a row-major matrix (row stride ld; valid rows < rows,
// valid columns < cols, in absolute indices) into threadgroup memory: straight, dst[r * ldd + c],
// or transposed, dst[c * ldd + r]. Each lane moves 4 consecutive elements of a stored row per
// step (consecutive lanes cover consecutive 4-element groups, so device reads are coalesced):
// one vector read when aligned; otherwise 4 scalar reads, bounds-checked and zero filled on edge
// tiles (zeros add nothing to the dot products, and out-of-range rows/columns are never stored).
// NT threads share the work (lane: the thread's index in the threadgroup).
template <typename T, int R, int C, bool TRANSPOSE, int NT>
inline void gemm_stage(threadgroup T* dst, uint ldd, device const T* src, uint ld, uint r0, uint c0,
                       uint rows, uint cols, uint lane, bool aligned, bool full)
{
    typedef vec<T, 4> T4;
#pragma clang loop unroll(full)
    for (uint i = 0; i < R * C / 4 / NT; ++i) {
        const uint v = lane + i * NT;
        const uint r = v / (C / 4), c = (v % (C / 4)) * 4;
        device const T* p = src + (ulong)(r0 + r) * ld + (c0 + c);
        T4 x;
        if (aligned) {
            x = *(device const T4*)p;
        } else if (full) {
            x = T4(p[0], p[1], p[2], p[3]);
        } else {
            const bool row_ok = r0 + r < rows;
            for (uint j = 0; j < 4; ++j)
                x[j] = (row_ok && c0 + c + j < cols) ? p[j] : T(0);
        }
        if (TRANSPOSE) {
            for (uint j = 0; j < 4; ++j)
                dst[(c + j) * ldd + r] = x[j];
        } else {
            *(threadgroup T4*)(dst + r * ldd + c) = x;
        }
    }
}

// One 32x32 output tile at (m0, n0) over k in [kb, ke): C = alpha * acc + beta * C (beta == 0:
// C is not read). The split-K partials use it with alpha = 1, beta = 0 (exactly acc).
template <typename T, typename TC, bool TA, bool TB>
inline void gemm_tile(device const T* A, device const T* B, device TC* C, uint M, uint N,
                      uint lda, uint ldb, uint ldc, uint kb, uint ke, float alpha, float beta,
                      uint m0, uint n0, uint lane, threadgroup float4* smem, bool aligned)
{
    threadgroup T*     As = (threadgroup T*)smem;
    threadgroup T*     Bs = As + GEMM_AS_ELEMS;
    threadgroup float* Cs = (threadgroup float*)smem;   // reused once the last K step is done

    simdgroup_float8x8 acc[4][4];
#pragma clang loop unroll(full)
    for (uint i = 0; i < 4; ++i)
#pragma clang loop unroll(full)
        for (uint j = 0; j < 4; ++j)
            acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

    const bool mn_full = m0 + GEMM_BM <= M && n0 + GEMM_BN <= N;
    for (uint k0 = kb; k0 < ke; k0 += GEMM_BK) {
        const bool full = mn_full && k0 + GEMM_BK <= ke;   // uniform over the SIMD-group
        if (TA)  // A stored (K, M): read along m, transpose into [m][k]
            gemm_stage<T, GEMM_BK, GEMM_BM, true, GEMM_THREADS>(As, GEMM_LDA_S, A, lda, k0, m0, ke, M, lane, aligned, full);
        else
            gemm_stage<T, GEMM_BM, GEMM_BK, false, GEMM_THREADS>(As, GEMM_LDA_S, A, lda, m0, k0, M, ke, lane, aligned, full);
        if (TB)  // B stored (N, K): read along k, transpose into [k][n]
            gemm_stage<T, GEMM_BN, GEMM_BK, true, GEMM_THREADS>(Bs, GEMM_LDB_S, B, ldb, n0, k0, N, ke, lane, aligned, full);
        else
            gemm_stage<T, GEMM_BK, GEMM_BN, false, GEMM_THREADS>(Bs, GEMM_LDB_S, B, ldb, k0, n0, ke, N, lane, aligned, full);
        threadgroup_barrier(mem_flags::mem_threadgroup);   // tiles complete before any lane reads them

#pragma clang loop unroll(full)
        for (uint kk = 0; kk < GEMM_BK; kk += 8) {
            simdgroup_matrix<T, 8, 8> a[4];
            simdgroup_matrix<T, 8, 8> b[4];
#pragma clang loop unroll(full)
            for (uint i = 0; i < 4; ++i)
                simdgroup_load(a[i], As + i * 8 * GEMM_LDA_S + kk, GEMM_LDA_S);
#pragma clang loop unroll(full)
            for (uint j = 0; j < 4; ++j)
                simdgroup_load(b[j], Bs + kk * GEMM_LDB_S + j * 8, GEMM_LDB_S);
#pragma clang loop unroll(full)
            for (uint i = 0; i < 4; ++i)
#pragma clang loop unroll(full)
                for (uint j = 0; j < 4; ++j)
                    simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
        }
        // every lane is done reading before the next step (or Cs) overwrites the tiles
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

#pragma clang loop unroll(full)
    for (uint i = 0; i < 4; ++i)
#pragma clang loop unroll(full)
        for (uint j = 0; j < 4; ++j)
            simdgroup_store(acc[i][j], Cs + i * 8 * GEMM_LDC_S + j * 8, GEMM_LDC_S);
    threadgroup_barrier(mem_flags::mem_threadgroup);   // each lane below reads elements others stored

    // Same arithmetic on both paths (explicit fma, no contraction choices left to the compiler),
    // so an aligned build is bit-identical to an unaligned one.
    const bool use_c = beta != 0.0f;
    if (aligned) {
        typedef vec<TC, 4> TC4;
#pragma clang loop unroll(full)
        for (uint i = 0; i < GEMM_BM * GEMM_BN / 4 / GEMM_THREADS; ++i) {
            const uint v = lane + i * GEMM_THREADS;
            const uint r = v / (GEMM_BN / 4), c = (v % (GEMM_BN / 4)) * 4;
            const float4 s = *(threadgroup const float4*)(Cs + r * GEMM_LDC_S + c);
            device TC4* p = (device TC4*)(C + (ulong)(m0 + r) * ldc + (n0 + c));
            *p = TC4(use_c ? fma(float4(alpha), s, float4(beta) * float4(*p)) : float4(alpha) * s);
        }
    } else if (n0 + lane < N) {
        // lane = column: consecutive lanes write consecutive elements of a row
        for (uint r = 0; r < GEMM_BM && m0 + r < M; ++r) {
            const float s = Cs[r * GEMM_LDC_S + lane];
            device TC* p = C + (ulong)(m0 + r) * ldc + (n0 + lane);
            *p = TC(use_c ? fma(alpha, s, beta * float(*p)) : alpha * s);
        }
    }
}

template <typename T, typename TC, bool TA, bool TB>
kernel void gemm_plain(device const T*     A    [[buffer(0)]],
                 device const T*     B    [[buffer(1)]],
                 device TC*          C    [[buffer(2)]],
                 constant GemmArgs&  args [[buffer(3)]],
                 uint3 tg   [[threadgroup_position_in_grid]],
                 uint  lane [[thread_index_in_simdgroup]])
{
    threadgroup float4 smem[GEMM_SMEM_F4];
    const ulong z = tg.z;
    gemm_tile<T, TC, TA, TB>(A + z * args.stride_a, B + z * args.stride_b, C + z * args.stride_c,
                             args.M, args.N, args.lda, args.ldb, args.ldc, 0, args.K, args.alpha, args.beta,
                             tg.y * GEMM_BM, tg.x * GEMM_BN, lane, smem, gemm_is_aligned);
}

template <typename T, bool TA, bool TB>
kernel void gemm_splitk(device const T*     A        [[buffer(0)]],
                        device const T*     B        [[buffer(1)]],
                        device float*       partials [[buffer(2)]],
                        constant GemmArgs&  args     [[buffer(3)]],
                        uint3 tg   [[threadgroup_position_in_grid]],
                        uint  lane [[thread_index_in_simdgroup]])
{
    threadgroup float4 smem[GEMM_SMEM_F4];
    const uint s  = tg.z;
    const uint kb = min(args.K, s * args.k_split);   // an empty slice writes zeros
    const uint ke = min(args.K, kb + args.k_split);
    gemm_tile<T, float, TA, TB>(A, B, partials + (ulong)s * args.M * args.N, args.M, args.N,
                                args.lda, args.ldb, args.N, kb, ke, 1.0f, 0.0f,
                                tg.y * GEMM_BM, tg.x * GEMM_BN, lane, smem, gemm_is_aligned);
}

template <typename TC>
kernel void gemm_reduce(device const float*      partials [[buffer(0)]],
                        device TC*               C        [[buffer(1)]],
                        constant GemmReduceArgs& args     [[buffer(2)]],
                        uint2 pos [[thread_position_in_grid]])
{
    const uint n = pos.x, m = pos.y;
    if (m >= args.M || n >= args.N) return;
    const ulong plane = (ulong)args.M * args.N;
    device const float* p = partials + (ulong)m * args.N + n;
    float acc = 0.0f;
    for (uint s = 0; s < args.splits; ++s)   // fixed s order: deterministic
        acc += p[s * plane];
    device TC* c = C + (ulong)m * args.ldc + n;
    *c = TC(args.beta != 0.0f ? fma(args.alpha, acc, args.beta * float(*c)) : args.alpha * acc);
}

template [[host_name("gemm_nn_f32")]]     [[kernel]] decltype(gemm_plain<float, float, false, false>) gemm_plain<float, float, false, false>;
template [[host_name("gemm_nt_f32")]]     [[kernel]] decltype(gemm_plain<float, float, false, true>)  gemm_plain<float, float, false, true>;
template [[host_name("gemm_tn_f32")]]     [[kernel]] decltype(gemm_plain<float, float, true, false>)  gemm_plain<float, float, true, false>;
template [[host_name("gemm_nn_f16")]]     [[kernel]] decltype(gemm_plain<half, half, false, false>)   gemm_plain<half, half, false, false>;
template [[host_name("gemm_nt_f16")]]     [[kernel]] decltype(gemm_plain<half, half, false, true>)    gemm_plain<half, half, false, true>;
template [[host_name("gemm_tn_f16")]]     [[kernel]] decltype(gemm_plain<half, half, true, false>)    gemm_plain<half, half, true, false>;
template [[host_name("gemm_nn_f16_f32")]] [[kernel]] decltype(gemm_plain<half, float, false, false>)  gemm_plain<half, float, false, false>;
template [[host_name("gemm_nt_f16_f32")]] [[kernel]] decltype(gemm_plain<half, float, false, true>)   gemm_plain<half, float, false, true>;
template [[host_name("gemm_tn_f16_f32")]] [[kernel]] decltype(gemm_plain<half, float, true, false>)   gemm_plain<half, float, true, false>;
#if KRNL_BF16  // MSL 3.1 on a GPU with native bf16 (the host compiles 3.1 there)
template [[host_name("gemm_nn_bf16")]]     [[kernel]] decltype(gemm_plain<bfloat, bfloat, false, false>) gemm_plain<bfloat, bfloat, false, false>;
template [[host_name("gemm_nt_bf16")]]     [[kernel]] decltype(gemm_plain<bfloat, bfloat, false, true>)  gemm_plain<bfloat, bfloat, false, true>;
template [[host_name("gemm_tn_bf16")]]     [[kernel]] decltype(gemm_plain<bfloat, bfloat, true, false>)  gemm_plain<bfloat, bfloat, true, false>;
template [[host_name("gemm_nn_bf16_f32")]] [[kernel]] decltype(gemm_plain<bfloat, float, false, false>)  gemm_plain<bfloat, float, false, false>;
template [[host_name("gemm_nt_bf16_f32")]] [[kernel]] decltype(gemm_plain<bfloat, float, false, true>)   gemm_plain<bfloat, float, false, true>;
template [[host_name("gemm_tn_bf16_f32")]] [[kernel]] decltype(gemm_plain<bfloat, float, true, false>)   gemm_plain<bfloat, float, true, false>;
#endif

template [[host_name("gemm_splitk_nn_f32")]] [[kernel]] decltype(gemm_splitk<float, false, false>) gemm_splitk<float, false, false>;
template [[host_name("gemm_splitk_nt_f32")]] [[kernel]] decltype(gemm_splitk<float, false, true>)  gemm_splitk<float, false, true>;
template [[host_name("gemm_splitk_tn_f32")]] [[kernel]] decltype(gemm_splitk<float, true, false>)  gemm_splitk<float, true, false>;
template [[host_name("gemm_splitk_nn_f16")]] [[kernel]] decltype(gemm_splitk<half, false, false>)  gemm_splitk<half, false, false>;
template [[host_name("gemm_splitk_nt_f16")]] [[kernel]] decltype(gemm_splitk<half, false, true>)   gemm_splitk<half, false, true>;
template [[host_name("gemm_splitk_tn_f16")]] [[kernel]] decltype(gemm_splitk<half, true, false>)   gemm_splitk<half, true, false>;
#if KRNL_BF16
template [[host_name("gemm_splitk_nn_bf16")]] [[kernel]] decltype(gemm_splitk<bfloat, false, false>) gemm_splitk<bfloat, false, false>;
template [[host_name("gemm_splitk_nt_bf16")]] [[kernel]] decltype(gemm_splitk<bfloat, false, true>)  gemm_splitk<bfloat, false, true>;
template [[host_name("gemm_splitk_tn_bf16")]] [[kernel]] decltype(gemm_splitk<bfloat, true, false>)  gemm_splitk<bfloat, true, false>;
#endif

template [[host_name("gemm_reduce_f32")]] [[kernel]] decltype(gemm_reduce<float>) gemm_reduce<float>;
template [[host_name("gemm_reduce_f16")]] [[kernel]] decltype(gemm_reduce<half>)  gemm_reduce<half>;
#if KRNL_BF16
template [[host_name("gemm_reduce_bf16")]] [[kernel]] decltype(gemm_reduce<bfloat>) gemm_reduce<bfloat>;
#endif

// ---- Multi-SIMD-group variants (steel32, steel64; the file comment says what each trades)

enum {
    STEEL_BK  = 16,   // K step staged per iteration, as in gemm_tile
    STEEL_PAD = 4,    // staged-row padding, as in gemm_tile
};

// One BM x BN output tile at (m0, n0) by WM x WN SIMD-groups, each owning a (BM/WM) x (BN/WN)
// sub-tile in 8x8 float accumulators; all 32 WM WN threads stage the operand tiles together.
// The result goes from the accumulators straight to C: each lane holds two adjacent elements of
// every 8x8 accumulator (thread_elements(), Apple's lane layout below), so no threadgroup tile
// is needed for C. Whole tiles store without checks (vector stores when aligned); ragged tiles
// check each element. k runs in the same order as gemm_tile (16-deep steps, two 8-deep
// products), and the epilogue is the same fma, so the sums are the same fp32 operations.
template <typename T, typename TC, bool TA, bool TB, int BM, int BN, int WM, int WN>
inline void gemm_steel_tile(device const T* A, device const T* B, device TC* C, uint M, uint N, uint K,
                            uint lda, uint ldb, uint ldc, float alpha, float beta, uint m0, uint n0,
                            uint tid, uint sg, uint lane, threadgroup T* As, threadgroup T* Bs, bool aligned)
{
    constexpr int NT = 32 * WM * WN;
    constexpr int SM = BM / WM, SN = BN / WN;    // a SIMD-group's sub-tile
    constexpr int FM = SM / 8, FN = SN / 8;      // its 8x8 accumulators
    constexpr int LDA_S = STEEL_BK + STEEL_PAD;  // As [BM][LDA_S]: op(A) tile as [m][k]
    constexpr int LDB_S = BN + STEEL_PAD;        // Bs [BK][LDB_S]: op(B) tile as [k][n]
    const uint sm = sg / WN, sn = sg % WN;

    simdgroup_float8x8 acc[FM][FN];
#pragma clang loop unroll(full)
    for (uint i = 0; i < FM; ++i)
#pragma clang loop unroll(full)
        for (uint j = 0; j < FN; ++j)
            acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

    const bool mn_full = m0 + BM <= M && n0 + BN <= N;
    for (uint k0 = 0; k0 < K; k0 += STEEL_BK) {
        const bool full = mn_full && k0 + STEEL_BK <= K;   // uniform over the threadgroup
        if (TA)  // A stored (K, M): read along m, transpose into [m][k]
            gemm_stage<T, STEEL_BK, BM, true, NT>(As, LDA_S, A, lda, k0, m0, K, M, tid, aligned, full);
        else
            gemm_stage<T, BM, STEEL_BK, false, NT>(As, LDA_S, A, lda, m0, k0, M, K, tid, aligned, full);
        if (TB)  // B stored (N, K): read along k, transpose into [k][n]
            gemm_stage<T, BN, STEEL_BK, true, NT>(Bs, LDB_S, B, ldb, n0, k0, N, K, tid, aligned, full);
        else
            gemm_stage<T, STEEL_BK, BN, false, NT>(Bs, LDB_S, B, ldb, k0, n0, K, N, tid, aligned, full);
        threadgroup_barrier(mem_flags::mem_threadgroup);   // tiles complete before any SIMD-group reads them

#pragma clang loop unroll(full)
        for (uint kk = 0; kk < STEEL_BK; kk += 8) {
            simdgroup_matrix<T, 8, 8> a[FM];
            simdgroup_matrix<T, 8, 8> b[FN];
#pragma clang loop unroll(full)
            for (uint i = 0; i < FM; ++i)
                simdgroup_load(a[i], As + (sm * SM + i * 8) * LDA_S + kk, LDA_S);
#pragma clang loop unroll(full)
            for (uint j = 0; j < FN; ++j)
                simdgroup_load(b[j], Bs + kk * LDB_S + sn * SN + j * 8, LDB_S);
#pragma clang loop unroll(full)
            for (uint i = 0; i < FM; ++i)
#pragma clang loop unroll(full)
                for (uint j = 0; j < FN; ++j)
                    simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
        }
        // every SIMD-group is done reading before the next step overwrites the tiles
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // Apple's distribution of an 8x8 simdgroup_matrix: lane holds row fr, columns fc and fc + 1.
    const uint q = lane / 4;
    const uint fr = (q & 4) + (lane / 2) % 4, fc = (q & 2) * 2 + (lane % 2) * 2;
    const bool use_c = beta != 0.0f;
#pragma clang loop unroll(full)
    for (uint i = 0; i < FM; ++i) {
        const uint m = m0 + sm * SM + i * 8 + fr;
#pragma clang loop unroll(full)
        for (uint j = 0; j < FN; ++j) {
            const uint n = n0 + sn * SN + j * 8 + fc;
            const float2 s = acc[i][j].thread_elements();
            device TC* p = C + (ulong)m * ldc + n;
            if (aligned) {  // n even, ldc and C's offset multiples of 4: 2-element aligned
                typedef vec<TC, 2> TC2;
                *(device TC2*)p = TC2(use_c ? fma(float2(alpha), s, float2(beta) * float2(*(device TC2*)p))
                                            : float2(alpha) * s);
            } else {
                for (uint e = 0; e < 2; ++e)
                    if (mn_full || (m < M && n + e < N))
                        p[e] = TC(use_c ? fma(alpha, s[e], beta * float(p[e])) : alpha * s[e]);
            }
        }
    }
}

// Grid (ceil(N/BN), ceil(M/BM), batch), threads (32 WM WN, 1, 1). The operand tiles are
// threadgroup arrays of T: half operands stage half the bytes of float ones.
template <typename T, typename TC, bool TA, bool TB, int BM, int BN, int WM, int WN>
kernel void gemm_steel(device const T*     A    [[buffer(0)]],
                       device const T*     B    [[buffer(1)]],
                       device TC*          C    [[buffer(2)]],
                       constant GemmArgs&  args [[buffer(3)]],
                       uint3 tg   [[threadgroup_position_in_grid]],
                       uint  tid  [[thread_index_in_threadgroup]],
                       uint  sg   [[simdgroup_index_in_threadgroup]],
                       uint  lane [[thread_index_in_simdgroup]])
{
    threadgroup T As[BM * (STEEL_BK + STEEL_PAD)];
    threadgroup T Bs[STEEL_BK * (BN + STEEL_PAD)];
    const ulong z = tg.z;
    gemm_steel_tile<T, TC, TA, TB, BM, BN, WM, WN>(
        A + z * args.stride_a, B + z * args.stride_b, C + z * args.stride_c, args.M, args.N, args.K,
        args.lda, args.ldb, args.ldc, args.alpha, args.beta, tg.y * BM, tg.x * BN, tid, sg, lane, As, Bs,
        gemm_is_aligned);
}

// steel64: 64x64 tile, 2x2 SIMD-groups of 32x32. steel32: 32x32 tile, 2x2 SIMD-groups of 16x16.
template [[host_name("gemm_steel64_nn_f32")]]   [[kernel]] decltype(gemm_steel<float, float, false, false, 64, 64, 2, 2>) gemm_steel<float, float, false, false, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_nt_f32")]]   [[kernel]] decltype(gemm_steel<float, float, false, true, 64, 64, 2, 2>) gemm_steel<float, float, false, true, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_tn_f32")]]   [[kernel]] decltype(gemm_steel<float, float, true, false, 64, 64, 2, 2>) gemm_steel<float, float, true, false, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_nn_f16")]]   [[kernel]] decltype(gemm_steel<half, half, false, false, 64, 64, 2, 2>) gemm_steel<half, half, false, false, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_nt_f16")]]   [[kernel]] decltype(gemm_steel<half, half, false, true, 64, 64, 2, 2>) gemm_steel<half, half, false, true, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_tn_f16")]]   [[kernel]] decltype(gemm_steel<half, half, true, false, 64, 64, 2, 2>) gemm_steel<half, half, true, false, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_nn_f16_f32")]] [[kernel]] decltype(gemm_steel<half, float, false, false, 64, 64, 2, 2>) gemm_steel<half, float, false, false, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_nt_f16_f32")]] [[kernel]] decltype(gemm_steel<half, float, false, true, 64, 64, 2, 2>) gemm_steel<half, float, false, true, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_tn_f16_f32")]] [[kernel]] decltype(gemm_steel<half, float, true, false, 64, 64, 2, 2>) gemm_steel<half, float, true, false, 64, 64, 2, 2>;
template [[host_name("gemm_steel32_nn_f32")]]   [[kernel]] decltype(gemm_steel<float, float, false, false, 32, 32, 2, 2>) gemm_steel<float, float, false, false, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_nt_f32")]]   [[kernel]] decltype(gemm_steel<float, float, false, true, 32, 32, 2, 2>) gemm_steel<float, float, false, true, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_tn_f32")]]   [[kernel]] decltype(gemm_steel<float, float, true, false, 32, 32, 2, 2>) gemm_steel<float, float, true, false, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_nn_f16")]]   [[kernel]] decltype(gemm_steel<half, half, false, false, 32, 32, 2, 2>) gemm_steel<half, half, false, false, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_nt_f16")]]   [[kernel]] decltype(gemm_steel<half, half, false, true, 32, 32, 2, 2>) gemm_steel<half, half, false, true, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_tn_f16")]]   [[kernel]] decltype(gemm_steel<half, half, true, false, 32, 32, 2, 2>) gemm_steel<half, half, true, false, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_nn_f16_f32")]] [[kernel]] decltype(gemm_steel<half, float, false, false, 32, 32, 2, 2>) gemm_steel<half, float, false, false, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_nt_f16_f32")]] [[kernel]] decltype(gemm_steel<half, float, false, true, 32, 32, 2, 2>) gemm_steel<half, float, false, true, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_tn_f16_f32")]] [[kernel]] decltype(gemm_steel<half, float, true, false, 32, 32, 2, 2>) gemm_steel<half, float, true, false, 32, 32, 2, 2>;

#if KRNL_BF16
// bf16 operands (MSL 3.1, native on Apple9+), accumulated in float like the others.
template [[host_name("gemm_steel64_nn_bf16")]]  [[kernel]] decltype(gemm_steel<bfloat, bfloat, false, false, 64, 64, 2, 2>) gemm_steel<bfloat, bfloat, false, false, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_nt_bf16")]]  [[kernel]] decltype(gemm_steel<bfloat, bfloat, false, true, 64, 64, 2, 2>) gemm_steel<bfloat, bfloat, false, true, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_tn_bf16")]]  [[kernel]] decltype(gemm_steel<bfloat, bfloat, true, false, 64, 64, 2, 2>) gemm_steel<bfloat, bfloat, true, false, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_nn_bf16_f32")]] [[kernel]] decltype(gemm_steel<bfloat, float, false, false, 64, 64, 2, 2>) gemm_steel<bfloat, float, false, false, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_nt_bf16_f32")]] [[kernel]] decltype(gemm_steel<bfloat, float, false, true, 64, 64, 2, 2>) gemm_steel<bfloat, float, false, true, 64, 64, 2, 2>;
template [[host_name("gemm_steel64_tn_bf16_f32")]] [[kernel]] decltype(gemm_steel<bfloat, float, true, false, 64, 64, 2, 2>) gemm_steel<bfloat, float, true, false, 64, 64, 2, 2>;
template [[host_name("gemm_steel32_nn_bf16")]]  [[kernel]] decltype(gemm_steel<bfloat, bfloat, false, false, 32, 32, 2, 2>) gemm_steel<bfloat, bfloat, false, false, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_nt_bf16")]]  [[kernel]] decltype(gemm_steel<bfloat, bfloat, false, true, 32, 32, 2, 2>) gemm_steel<bfloat, bfloat, false, true, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_tn_bf16")]]  [[kernel]] decltype(gemm_steel<bfloat, bfloat, true, false, 32, 32, 2, 2>) gemm_steel<bfloat, bfloat, true, false, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_nn_bf16_f32")]] [[kernel]] decltype(gemm_steel<bfloat, float, false, false, 32, 32, 2, 2>) gemm_steel<bfloat, float, false, false, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_nt_bf16_f32")]] [[kernel]] decltype(gemm_steel<bfloat, float, false, true, 32, 32, 2, 2>) gemm_steel<bfloat, float, false, true, 32, 32, 2, 2>;
template [[host_name("gemm_steel32_tn_bf16_f32")]] [[kernel]] decltype(gemm_steel<bfloat, float, true, false, 32, 32, 2, 2>) gemm_steel<bfloat, float, true, false, 32, 32, 2, 2>;
#endif

// ---- Grouped GEMMs of a mixture of experts (moe_gemm, moe_gemm_weight_grad: csrc/core/op_list.h's
// notes; metal/kargs.h MoeGemmArgs), on gemm_tile: here rather than in moe.metal, so that one tile
// serves both (a library cannot call another's functions). Expert e's rows are rows
// offsets[e]:offsets[e + 1] of x (or of a and b). moe_sort wrote the offsets earlier in the step
// and no host has seen them, so they are clamped into [0, P]: wrong offsets give wrong rows, never
// an access out of range. Experts' row counts are ragged, so the tiles always take the
// edge-checked path (aligned false; gemm_aligned is not read).
//
// Dispatch geometry (threads (32, 1, 1), one SIMD-group per 32x32 tile as tile32):
//   moe_gemm_{nn,nt}_{f32,f16,bf16}: grid (ceil(N/32), row tiles, 1). The row tiles of all experts
//     in expert order (ceil(n_e / 32) each) are numbered from 0; threadgroup y takes tile0 + y and
//     exits past the last one: sum ceil(n_e / 32) <= (P + 31 E) / 32 tiles cover every expert.
//     nt: out = x W_e^T with W_e stored (N, K) (a linear); nn: out = x W_e, W_e stored (K, N).
//   moe_gemm_weight_grad_{f32,f16,f16_f32,bf16,bf16_f32}: grid (ceil(N/32), ceil(M/32), E); an
//     expert without rows sums nothing: out[e] = beta out[e] (0 where beta == 0).

// Expert e's rows [x, y), clamped into [0, P].
inline uint2 moe_rows(device const int* offsets, uint e, uint P)
{
    const int lo = min(max(offsets[e], 0), int(P));
    return uint2(uint(lo), uint(min(max(offsets[e + 1], lo), int(P))));
}

template <typename T, bool TB>
kernel void moe_gemm(device const T*      X       [[buffer(0)]],
                     device const T*      W       [[buffer(1)]],
                     device T*            Out     [[buffer(2)]],
                     device const int*    offsets [[buffer(3)]],
                     constant MoeGemmArgs& args   [[buffer(4)]],
                     uint3 tg   [[threadgroup_position_in_grid]],
                     uint  lane [[thread_index_in_simdgroup]])
{
    threadgroup float4 smem[GEMM_SMEM_F4];
    // this threadgroup's expert and its row tile inside it (the same walk in every lane)
    uint g = args.tile0 + tg.y, e = 0;
    uint2 r = uint2(0, 0);
    for (; e < args.E; ++e) {
        r = moe_rows(offsets, e, args.P);
        const uint tiles = (r.y - r.x + GEMM_BM - 1) / GEMM_BM;
        if (g < tiles) break;
        g -= tiles;
    }
    if (e == args.E) return;  // past the last tile: the whole threadgroup, before any barrier
    gemm_tile<T, T, false, TB>(X + (ulong)r.x * args.lda, W + (ulong)e * args.stride_b, Out + (ulong)r.x * args.ldc,
                               r.y - r.x, args.N, args.lda, args.ldb, args.ldc, 0, args.K, args.alpha, args.beta,
                               g * GEMM_BM, tg.x * GEMM_BN, lane, smem, false);
}

template <typename T, typename TC>
kernel void moe_gemm_weight_grad(device const T*      A       [[buffer(0)]],
                                 device const T*      B       [[buffer(1)]],
                                 device TC*           Out     [[buffer(2)]],
                                 device const int*    offsets [[buffer(3)]],
                                 constant MoeGemmArgs& args   [[buffer(4)]],
                                 uint3 tg   [[threadgroup_position_in_grid]],
                                 uint  lane [[thread_index_in_simdgroup]])
{
    threadgroup float4 smem[GEMM_SMEM_F4];
    const uint2 r = moe_rows(offsets, tg.z, args.P);
    // a_e^T b_e: a_e stored (n_e, M) is op(A) transposed (tn), summed over the expert's rows
    gemm_tile<T, TC, true, false>(A + (ulong)r.x * args.lda, B + (ulong)r.x * args.ldb, Out + (ulong)tg.z * args.stride_c,
                                  args.M, args.N, args.lda, args.ldb, args.ldc, 0, r.y - r.x, args.alpha, args.beta,
                                  tg.y * GEMM_BM, tg.x * GEMM_BN, lane, smem, false);
}

template [[host_name("moe_gemm_nn_f32")]] [[kernel]] decltype(moe_gemm<float, false>) moe_gemm<float, false>;
template [[host_name("moe_gemm_nt_f32")]] [[kernel]] decltype(moe_gemm<float, true>)  moe_gemm<float, true>;
template [[host_name("moe_gemm_nn_f16")]] [[kernel]] decltype(moe_gemm<half, false>)  moe_gemm<half, false>;
template [[host_name("moe_gemm_nt_f16")]] [[kernel]] decltype(moe_gemm<half, true>)   moe_gemm<half, true>;
template [[host_name("moe_gemm_weight_grad_f32")]]     [[kernel]] decltype(moe_gemm_weight_grad<float, float>) moe_gemm_weight_grad<float, float>;
template [[host_name("moe_gemm_weight_grad_f16")]]     [[kernel]] decltype(moe_gemm_weight_grad<half, half>)   moe_gemm_weight_grad<half, half>;
template [[host_name("moe_gemm_weight_grad_f16_f32")]] [[kernel]] decltype(moe_gemm_weight_grad<half, float>)  moe_gemm_weight_grad<half, float>;
#if KRNL_BF16
template [[host_name("moe_gemm_nn_bf16")]] [[kernel]] decltype(moe_gemm<bfloat, false>) moe_gemm<bfloat, false>;
template [[host_name("moe_gemm_nt_bf16")]] [[kernel]] decltype(moe_gemm<bfloat, true>)  moe_gemm<bfloat, true>;
template [[host_name("moe_gemm_weight_grad_bf16")]]     [[kernel]] decltype(moe_gemm_weight_grad<bfloat, bfloat>) moe_gemm_weight_grad<bfloat, bfloat>;
template [[host_name("moe_gemm_weight_grad_bf16_f32")]] [[kernel]] decltype(moe_gemm_weight_grad<bfloat, float>)  moe_gemm_weight_grad<bfloat, float>;
#endif
