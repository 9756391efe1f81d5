// msl: 3.0 (krnl's floor; newest feature used: simd_sum, MSL 2.x)
// rmsnorm_forward: y[r, :] = x[r, :] * rstd[r] * w, rstd[r] = 1 / sqrt(mean(x[r, :]^2) + eps) (f32).
// One threadgroup per row (grid = rows), any threadgroup size up to 1024 (a multiple of 32 is
// best). Sum of squares in float: per-thread fma, simd_sum, then one partial per SIMD-group in
// threadgroup memory. Half operands are read and combined in float, rounded once on the store.
// y (and dy, dx in the backward) are x's dtype, or f32 from bf16 x with f32 w (the _yf32 and
// _dyf32 kernels). y and dx are written at a row stride (ldy, ldx): a LoRA fold has the norm
// write the first columns of a wider buffer (python/krnl/models/lora_fold.py); the rest is not touched.
// rmsnorm_backward: the same geometry (one threadgroup per row), the residual add fused.
// rmsnorm_backward_dw: 2-D threadgroups (tx, ty) with tx * ty <= 1024, grid (ceil(cols / tx), 1)
// or fewer (groups stride over column blocks): thread (i, j) owns column block + i and sums rows
// j, j + ty, ... in order; the ty partials are combined in j order. Deterministic for a given ty.
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

#define RMS_MAX_SIMDGROUPS 32  // 1024 threads / 32 lanes

// W: the weight's dtype (f32 weights may scale f16/bf16 activations); Y: y's (x's, or f32)
template <typename T, typename W, typename Y = T>
kernel void rmsnorm_forward(device const T*       x    [[buffer(0)]],
                            device const W*       w    [[buffer(1)]],
                            device Y*             y    [[buffer(2)]],
                            device float*         rstd [[buffer(3)]],
                            constant RmsnormArgs& args [[buffer(4)]],
                            uint row  [[threadgroup_position_in_grid]],
                            uint tid  [[thread_position_in_threadgroup]],
                            uint ntg  [[threads_per_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg   [[simdgroup_index_in_threadgroup]],
                            uint nsg  [[simdgroups_per_threadgroup]])
{
    using T4 = vec<T, 4>;
    using Y4 = vec<Y, 4>;
    threadgroup float partial[RMS_MAX_SIMDGROUPS];

    if (row >= args.rows) return;  // whole threadgroup: uniform, before any barrier
    const uint cols = args.cols;
    device const T* xr = x + (ulong)row * cols;
    device Y*       yr = y + (ulong)row * args.ldy;
    const bool vec4 = args.vec4 != 0;  // the host checked cols, ldy and both offsets

    float ss = 0.0f;
    if (vec4) {
        device const T4* x4 = (device const T4*)xr;
        for (uint i = tid; i < cols / 4; i += ntg) {
            const float4 v = float4(x4[i]);
            ss += dot(v, v);
        }
    } else {
        for (uint i = tid; i < cols; i += ntg) {
            const float v = float(xr[i]);
            ss = fma(v, v, ss);
        }
    }
    ss = simd_sum(ss);
    if (lane == 0) partial[sg] = ss;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint s = 0; s < nsg; ++s) total += partial[s];  // same order in every thread
    const float inv = 1.0f / precise::sqrt(total / float(cols) + args.eps);
    if (tid == 0) rstd[row] = inv;

    if (vec4) {
        device const T4* x4 = (device const T4*)xr;
        device const vec<W, 4>* w4 = (device const vec<W, 4>*)w;
        device Y4*       y4 = (device Y4*)yr;
        for (uint i = tid; i < cols / 4; i += ntg)
            y4[i] = Y4(float4(x4[i]) * inv * float4(w4[i]));
    } else {
        for (uint i = tid; i < cols; i += ntg)
            yr[i] = Y(float(xr[i]) * inv * float(w[i]));
    }
}

template [[host_name("rmsnorm_forward_f32")]] [[kernel]] decltype(rmsnorm_forward<float, float>) rmsnorm_forward<float, float>;
template [[host_name("rmsnorm_forward_f16")]] [[kernel]] decltype(rmsnorm_forward<half, half>)   rmsnorm_forward<half, half>;
template [[host_name("rmsnorm_forward_f16_wf32")]] [[kernel]] decltype(rmsnorm_forward<half, float>) rmsnorm_forward<half, float>;
#if KRNL_BF16
template [[host_name("rmsnorm_forward_bf16")]] [[kernel]] decltype(rmsnorm_forward<bfloat, bfloat>) rmsnorm_forward<bfloat, bfloat>;
template [[host_name("rmsnorm_forward_bf16_wf32")]] [[kernel]] decltype(rmsnorm_forward<bfloat, float>) rmsnorm_forward<bfloat, float>;
template [[host_name("rmsnorm_forward_bf16_wf32_yf32")]] [[kernel]] decltype(rmsnorm_forward<bfloat, float, float>) rmsnorm_forward<bfloat, float, float>;
#endif

// rmsnorm_backward: dx[r, :] = rstd[r] * (g - xhat * mean(g * xhat)) (+ residual[r, :]),
// g = dy[r, :] * w, xhat = x[r, :] * rstd[r], with rstd the forward's (rows,) f32 output. The
// residual is added to dx rounded to its dtype, as a separate axpy would (and the CPU backend
// does), saving that pass over dx. dw (the sum over rows of dy * xhat) is NOT computed here: it
// is a cross-row reduction, left to a separate kernel.
// One threadgroup per row (grid = rows), any threadgroup size up to 1024. dot(g, x) in float:
// per-thread fma, simd_sum, one partial per SIMD-group in threadgroup memory, summed in the same
// order by every thread. dx may alias dy (contiguous dx) or the residual (the same row stride):
// every thread finishes reading the row for the reduction before the barrier, and afterwards
// reads and writes only its own elements.
template <typename T, typename W, typename G = T>  // G: dy's and dx's dtype (x's, or f32)
kernel void rmsnorm_backward(device const G*               dy   [[buffer(0)]],
                             device const T*               x    [[buffer(1)]],
                             device const W*               w    [[buffer(2)]],
                             device const float*           rstd [[buffer(3)]],
                             device G*                     dx   [[buffer(4)]],
                             constant RmsnormBackwardArgs& args [[buffer(5)]],
                             device const G*               res  [[buffer(6)]],
                             uint row  [[threadgroup_position_in_grid]],
                             uint tid  [[thread_position_in_threadgroup]],
                             uint ntg  [[threads_per_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint sg   [[simdgroup_index_in_threadgroup]],
                             uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float partial[RMS_MAX_SIMDGROUPS];

    if (row >= args.rows) return;  // whole threadgroup: uniform, before any barrier
    const uint cols = args.cols;
    device const G* dyr = dy + (ulong)row * cols;
    device const T* xr  = x + (ulong)row * cols;
    device G*       dxr = dx + (ulong)row * args.ldx;
    const float inv = rstd[row];

    float gx = 0.0f;  // sum of g * x over the row
    for (uint i = tid; i < cols; i += ntg)
        gx = fma(float(dyr[i]) * float(w[i]), float(xr[i]), gx);
    gx = simd_sum(gx);
    if (lane == 0) partial[sg] = gx;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint s = 0; s < nsg; ++s) total += partial[s];  // same order in every thread
    const float m = total * inv / float(cols);            // mean(g * xhat)

    device const G* rr = res + (ulong)row * args.ldr;  // dy's row when there is no residual
    for (uint i = tid; i < cols; i += ntg) {
        const float g = float(dyr[i]) * float(w[i]);
        // inv * (g - xhat * m) ending in an fma: no compiler may contract the residual add below
        // into it, so f32 dx + residual rounds twice, as an axpy after the norm does
        const float d = fma(-(float(xr[i]) * inv * m), inv, g * inv);
        dxr[i] = args.has_residual ? G(float(G(d)) + float(rr[i])) : G(d);
    }
}

template [[host_name("rmsnorm_backward_f32")]] [[kernel]] decltype(rmsnorm_backward<float, float>) rmsnorm_backward<float, float>;
template [[host_name("rmsnorm_backward_f16")]] [[kernel]] decltype(rmsnorm_backward<half, half>)   rmsnorm_backward<half, half>;
template [[host_name("rmsnorm_backward_f16_wf32")]] [[kernel]] decltype(rmsnorm_backward<half, float>) rmsnorm_backward<half, float>;
#if KRNL_BF16
template [[host_name("rmsnorm_backward_bf16")]] [[kernel]] decltype(rmsnorm_backward<bfloat, bfloat>) rmsnorm_backward<bfloat, bfloat>;
template [[host_name("rmsnorm_backward_bf16_wf32")]] [[kernel]] decltype(rmsnorm_backward<bfloat, float>) rmsnorm_backward<bfloat, float>;
template [[host_name("rmsnorm_backward_bf16_wf32_dyf32")]] [[kernel]] decltype(rmsnorm_backward<bfloat, float, float>) rmsnorm_backward<bfloat, float, float>;
#endif

// rmsnorm_backward_dw: dw[c] += sum_r dy[r, c] * x[r, c] * rstd[r] (dw f32, accumulated like the
// CPU backend's). A cross-row reduction, so a fixed order instead of atomics: each column's rows
// are split into ty strided strands summed in row order, then the strands are added in strand
// order by thread j == 0. Adjacent threads (i) read adjacent columns of a row: coalesced. The
// explicit fma leaves the compiler no contraction choice, so the sum is reproducible.
template <typename T, typename G = T>  // G: dy's dtype
kernel void rmsnorm_backward_dw(device const G*               dy   [[buffer(0)]],
                                device const T*               x    [[buffer(1)]],
                                device const float*           rstd [[buffer(2)]],
                                device float*                 dw   [[buffer(3)]],
                                constant RmsnormBackwardArgs& args [[buffer(4)]],
                                uint  group [[threadgroup_position_in_grid]],
                                uint  ngrp  [[threadgroups_per_grid]],
                                uint2 tid   [[thread_position_in_threadgroup]],
                                uint2 ntg   [[threads_per_threadgroup]])
{
    threadgroup float partial[1024];  // [j][i], one per thread

    const uint rows = args.rows, cols = args.cols;
    // c0 is the same for the whole threadgroup, so every thread runs the same iterations and
    // reaches the same barriers.
    for (uint c0 = group * ntg.x; c0 < cols; c0 += ngrp * ntg.x) {
        const uint c = c0 + tid.x;
        float s = 0.0f;
        if (c < cols) {
            for (uint r = tid.y; r < rows; r += ntg.y) {
                const ulong k = (ulong)r * cols + c;
                s = fma(float(dy[k]), float(x[k]) * rstd[r], s);
            }
        }
        partial[tid.y * ntg.x + tid.x] = s;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid.y == 0 && c < cols) {
            float total = partial[tid.x];
            for (uint j = 1; j < ntg.y; ++j) total += partial[j * ntg.x + tid.x];
            dw[c] += total;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // partial is reused by the next block
    }
}

template [[host_name("rmsnorm_backward_dw_f32")]] [[kernel]] decltype(rmsnorm_backward_dw<float>) rmsnorm_backward_dw<float>;
template [[host_name("rmsnorm_backward_dw_f16")]] [[kernel]] decltype(rmsnorm_backward_dw<half>)  rmsnorm_backward_dw<half>;
#if KRNL_BF16
template [[host_name("rmsnorm_backward_dw_bf16")]] [[kernel]] decltype(rmsnorm_backward_dw<bfloat>) rmsnorm_backward_dw<bfloat>;
template [[host_name("rmsnorm_backward_dw_bf16_dyf32")]] [[kernel]] decltype(rmsnorm_backward_dw<bfloat, float>) rmsnorm_backward_dw<bfloat, float>;
#endif
