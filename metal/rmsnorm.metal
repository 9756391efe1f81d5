// rmsnorm_forward: y[r, :] = x[r, :] * rstd[r] * w, rstd[r] = 1 / sqrt(mean(x[r, :]^2) + eps) (f32).
// One threadgroup per row (grid = rows), any threadgroup size up to 1024 (a multiple of 32 is
// best). Sum of squares in float: per-thread fma, simd_sum, then one partial per SIMD-group in
// threadgroup memory. Half operands are read and combined in float, rounded once on the store.
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

#define RMS_MAX_SIMDGROUPS 32  // 1024 threads / 32 lanes

template <typename T>
kernel void rmsnorm_forward(device const T*       x    [[buffer(0)]],
                            device const T*       w    [[buffer(1)]],
                            device T*             y    [[buffer(2)]],
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
    threadgroup float partial[RMS_MAX_SIMDGROUPS];

    if (row >= args.rows) return;  // whole threadgroup: uniform, before any barrier
    const uint cols = args.cols;
    device const T* xr = x + (ulong)row * cols;
    device T*       yr = y + (ulong)row * cols;
    const bool vec4 = (cols & 3) == 0;  // rows then start 4-element aligned

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
        device const T4* w4 = (device const T4*)w;
        device T4*       y4 = (device T4*)yr;
        for (uint i = tid; i < cols / 4; i += ntg)
            y4[i] = T4(float4(x4[i]) * inv * float4(w4[i]));
    } else {
        for (uint i = tid; i < cols; i += ntg)
            yr[i] = T(float(xr[i]) * inv * float(w[i]));
    }
}

template [[host_name("rmsnorm_forward_f32")]] [[kernel]] decltype(rmsnorm_forward<float>) rmsnorm_forward<float>;
template [[host_name("rmsnorm_forward_f16")]] [[kernel]] decltype(rmsnorm_forward<half>)  rmsnorm_forward<half>;

// rmsnorm_backward: dx[r, :] = rstd[r] * (g - xhat * mean(g * xhat)), g = dy[r, :] * w,
// xhat = x[r, :] * rstd[r], with rstd the forward's (rows,) f32 output. dw (the sum over rows of
// dy * xhat) is NOT computed here: it is a cross-row reduction, left to a separate kernel.
// One threadgroup per row (grid = rows), any threadgroup size up to 1024. dot(g, x) in float:
// per-thread fma, simd_sum, one partial per SIMD-group in threadgroup memory, summed in the same
// order by every thread. dx may alias dy: every thread finishes reading the row for the
// reduction before the barrier, and afterwards reads and writes only its own elements.
template <typename T>
kernel void rmsnorm_backward(device const T*               dy   [[buffer(0)]],
                             device const T*               x    [[buffer(1)]],
                             device const T*               w    [[buffer(2)]],
                             device const float*           rstd [[buffer(3)]],
                             device T*                     dx   [[buffer(4)]],
                             constant RmsnormBackwardArgs& args [[buffer(5)]],
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
    device const T* dyr = dy + (ulong)row * cols;
    device const T* xr  = x + (ulong)row * cols;
    device T*       dxr = dx + (ulong)row * cols;
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

    for (uint i = tid; i < cols; i += ntg) {
        const float g = float(dyr[i]) * float(w[i]);
        dxr[i] = T(inv * (g - float(xr[i]) * inv * m));
    }
}

template [[host_name("rmsnorm_backward_f32")]] [[kernel]] decltype(rmsnorm_backward<float>) rmsnorm_backward<float>;
template [[host_name("rmsnorm_backward_f16")]] [[kernel]] decltype(rmsnorm_backward<half>)  rmsnorm_backward<half>;
