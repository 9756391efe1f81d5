// msl: 3.0 (krnl's floor; newest feature used: simd_max/simd_sum, MSL 2.x)
// softmax_causal_forward: P = causal softmax of scale * S over the last dim.
// S, P (rows, tk), rows = batch * tq; query row r sits at position q = r % tq + tk - tq and sees
// keys j <= q, only those with q - j < window where window > 0 (a sliding window), and with
// segments only keys of its own segment; with sinks (has_sinks) sinks[row / tq] joins the row's
// softmax as a column without a value (unscaled: P then sums to < 1). Masked entries are written as
// exact zeros; the row max (over visible keys) is subtracted before exp, so no infinity is ever
// produced or needed. One threadgroup per row (grid = rows), any threadgroup size up to 1024;
// max and sum in float via simd_max/simd_sum and one partial per SIMD-group in threadgroup
// memory. P may alias S: each element is read and then written by the same thread, and only
// after every thread has finished reading the row for the reductions.
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

#define SM_MAX_SIMDGROUPS 32             // 1024 threads / 32 lanes
#define SM_LOWEST (-3.402823466e+38f)    // -FLT_MAX: a finite seed for the max (fast math has no inf)

template <typename T>
kernel void softmax_causal_forward(device const T*       S    [[buffer(0)]],
                                   device T*             P    [[buffer(1)]],
                                   device const int*     seg  [[buffer(2)]],
                                   constant SoftmaxArgs& args [[buffer(3)]],
                                   device const float*   sinks [[buffer(4)]],
                                   uint row  [[threadgroup_position_in_grid]],
                                   uint tid  [[thread_position_in_threadgroup]],
                                   uint ntg  [[threads_per_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]],
                                   uint sg   [[simdgroup_index_in_threadgroup]],
                                   uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float part_max[SM_MAX_SIMDGROUPS];
    threadgroup float part_sum[SM_MAX_SIMDGROUPS];

    if (row >= args.rows) return;  // whole threadgroup: uniform, before any barrier
    const uint tk = args.tk;
    const uint q = row % args.tq + (tk - args.tq);  // keys 0..q are causally visible
    const uint lo = args.window > 0 && q >= args.window ? q - args.window + 1 : 0;  // and keys from lo on
    const bool use_seg = args.has_segments != 0;
    const int sq = use_seg ? seg[q] : 0;
    const float scale = args.scale;
    device const T* sr = S + (ulong)row * tk;
    device T*       pr = P + (ulong)row * tk;

    // row max over the visible keys (the diagonal is always visible, so it is finite)
    float m = SM_LOWEST;
    for (uint j = lo + tid; j <= q; j += ntg)
        if (!use_seg || seg[j] == sq) m = max(m, float(sr[j]));
    m = simd_max(m);
    if (lane == 0) part_max[sg] = m;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    m = part_max[0];
    for (uint s = 1; s < nsg; ++s) m = max(m, part_max[s]);
    const float sink = args.has_sinks != 0 ? sinks[row / args.tq] : 0.0f;
    if (args.has_sinks != 0) m = max(m, sink / scale);   // the unscaled sink joins the max, in S's units

    // sum of exp(scale * (s - m)) over the visible keys
    float sum = 0.0f;
    for (uint j = lo + tid; j <= q; j += ntg)
        if (!use_seg || seg[j] == sq) sum += exp(scale * (float(sr[j]) - m));
    sum = simd_sum(sum);
    if (lane == 0) part_sum[sg] = sum;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint s = 0; s < nsg; ++s) total += part_sum[s];  // same order in every thread
    if (args.has_sinks != 0) total += exp(sink - scale * m);
    const float inv = 1.0f / total;

    for (uint j = tid; j < tk; j += ntg) {
        const bool visible = j >= lo && j <= q && (!use_seg || seg[j] == sq);
        pr[j] = visible ? T(exp(scale * (float(sr[j]) - m)) * inv) : T(0.0f);
    }
}

template [[host_name("softmax_causal_forward_f32")]] [[kernel]]
decltype(softmax_causal_forward<float>) softmax_causal_forward<float>;
template [[host_name("softmax_causal_forward_f16")]] [[kernel]]
decltype(softmax_causal_forward<half>) softmax_causal_forward<half>;
#if KRNL_BF16
template [[host_name("softmax_causal_forward_bf16")]] [[kernel]]
decltype(softmax_causal_forward<bfloat>) softmax_causal_forward<bfloat>;
#endif

// softmax_backward: dS = P * (dP - rowsum(dP * P)) * scale over rows of length cols (any mask is
// already in P: masked entries are zeros there and stay zeros). One threadgroup per row
// (grid = rows), any threadgroup size up to 1024; the row dot in float via simd_sum and one
// partial per SIMD-group in threadgroup memory. dS may alias dP: every thread finishes reading
// the row for the dot before the barrier, and afterwards reads and writes only its own elements.
template <typename T>
kernel void softmax_backward(device const T*               P    [[buffer(0)]],
                             device const T*               dP   [[buffer(1)]],
                             device T*                     dS   [[buffer(2)]],
                             constant SoftmaxBackwardArgs& args [[buffer(3)]],
                             uint row  [[threadgroup_position_in_grid]],
                             uint tid  [[thread_position_in_threadgroup]],
                             uint ntg  [[threads_per_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint sg   [[simdgroup_index_in_threadgroup]],
                             uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float part_dot[SM_MAX_SIMDGROUPS];

    if (row >= args.rows) return;  // whole threadgroup: uniform, before any barrier
    const uint cols = args.cols;
    device const T* pr  = P + (ulong)row * cols;
    device const T* dpr = dP + (ulong)row * cols;
    device T*       dsr = dS + (ulong)row * cols;

    float d = 0.0f;
    for (uint j = tid; j < cols; j += ntg) d = fma(float(pr[j]), float(dpr[j]), d);
    d = simd_sum(d);
    if (lane == 0) part_dot[sg] = d;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float pd = 0.0f;
    for (uint s = 0; s < nsg; ++s) pd += part_dot[s];  // same order in every thread

    const float scale = args.scale;
    for (uint j = tid; j < cols; j += ntg)
        dsr[j] = T(float(pr[j]) * (float(dpr[j]) - pd) * scale);
}

template [[host_name("softmax_backward_f32")]] [[kernel]]
decltype(softmax_backward<float>) softmax_backward<float>;
template [[host_name("softmax_backward_f16")]] [[kernel]]
decltype(softmax_backward<half>) softmax_backward<half>;
#if KRNL_BF16
template [[host_name("softmax_backward_bf16")]] [[kernel]]
decltype(softmax_backward<bfloat>) softmax_backward<bfloat>;
#endif
