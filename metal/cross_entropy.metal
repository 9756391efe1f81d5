// msl: 3.0 (krnl's floor; newest feature used: simd_max/simd_sum, MSL 2.x)
// cross_entropy: per row r of logits (rows, V), with y = targets[r],
//   loss[r] = max + log(sum_j exp(x_j - max)) - x_y        (f32)
//   dlogits[r, j] = scale * (softmax_j - (j == y))        (only when write_grad != 0)
// with scale replaced by args.scale * scale_by[0] when args.scale_by != 0 (a device-resident
// per-step factor, e.g. 1 / tokens of the step, which a replayed step cannot take as a constant).
// Rows with y == ignore_index get loss 0 and (write_grad != 0) a zero gradient row. A target
// outside [0, V) (the host checks them, as the CPU backend does) is never read: loss is NaN, so
// a missed check shows in the loss sum, and the gradient gets no one-hot term.
//
// Geometry: one threadgroup per row, grid = (rows, 1, 1) threadgroups (extra ones return), any
// threadgroup size up to 1024 (a multiple of 32 is best), no threadgroup memory to set.
//
// One pass over the row: each thread keeps an online (max, sum of exp(x - max)) over its strided
// elements, rescaling its sum when the max grows, so every exp argument is <= 0 and large logits
// (1e4) cannot overflow. The pairs are merged with simd_max/simd_sum, then one pair per
// SIMD-group goes through threadgroup memory and every thread merges them in the same order.
// dlogits may alias logits: element j of a row is only ever read and written by thread
// j % threads (x_y for the loss too, by its owner, before that thread overwrites it), so no
// thread reads what another writes, whatever the device-memory ordering; the whole row is read
// for the reduction before the barrier, which orders the threadgroup partials.
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

#define CE_MAX_SIMDGROUPS 32             // 1024 threads / 32 lanes
#define CE_LOWEST (-3.402823466e+38f)    // -FLT_MAX: a finite "empty" max (fast math has no inf)

template <typename T>
kernel void cross_entropy(device const T*            logits  [[buffer(0)]],
                          device const int*          targets [[buffer(1)]],
                          device float*              loss    [[buffer(2)]],
                          device T*                  dlogits [[buffer(3)]],
                          constant CrossEntropyArgs& args    [[buffer(4)]],
                          device const float*        scale_by [[buffer(5)]],
                          uint row  [[threadgroup_position_in_grid]],
                          uint tid  [[thread_position_in_threadgroup]],
                          uint ntg  [[threads_per_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sg   [[simdgroup_index_in_threadgroup]],
                          uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float part_max[CE_MAX_SIMDGROUPS];
    threadgroup float part_sum[CE_MAX_SIMDGROUPS];

    if (row >= args.rows) return;  // whole threadgroup: uniform, before any barrier
    const uint V = args.V;
    const int y = targets[row];
    const bool grad = args.write_grad != 0;
    device const T* xr = logits + (ulong)row * V;
    device T*       dr = dlogits + (ulong)row * V;

    if (y == args.ignore_index) {  // uniform over the threadgroup: no barrier is skipped by some
        if (tid == 0) loss[row] = 0.0f;
        if (grad)
            for (uint j = tid; j < V; j += ntg) dr[j] = T(0.0f);  // +0, as the CPU's memset
        return;
    }
    const bool valid = uint(y) < V;  // negative targets wrap to huge values

    // per-thread online max / sum-exp, seeded with the thread's first element (no exp of the
    // empty max); threads without elements keep (CE_LOWEST, 0), which merges as nothing
    float m = CE_LOWEST, s = 0.0f;
    if (tid < V) {
        m = float(xr[tid]);
        s = 1.0f;
    }
    for (uint j = tid + ntg; j < V; j += ntg) {
        const float x = float(xr[j]);
        if (x > m) {
            s = s * exp(m - x) + 1.0f;
            m = x;
        } else {
            s += exp(x - m);
        }
    }

    // merge within the SIMD-group, then across SIMD-groups through threadgroup memory
    const float msg = simd_max(m);
    const float ssg = simd_sum(s > 0.0f ? s * exp(m - msg) : 0.0f);
    if (lane == 0) {
        part_max[sg] = msg;
        part_sum[sg] = ssg;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float mx = part_max[0];
    for (uint k = 1; k < nsg; ++k) mx = max(mx, part_max[k]);
    float se = 0.0f;
    for (uint k = 0; k < nsg; ++k)  // same order in every thread: identical mx, se everywhere
        se += part_sum[k] > 0.0f ? part_sum[k] * exp(part_max[k] - mx) : 0.0f;

    if (valid) {
        if (tid == uint(y) % ntg)  // x_y's owner: it reads x_y before it writes dlogits[y] below
            loss[row] = mx + log(se) - float(xr[y]);
    } else if (tid == 0) {
        loss[row] = as_type<float>(0x7fc00000u);  // quiet NaN by its bits: no float op for fast math to fold
    }
    if (!grad) return;

    const float inv = 1.0f / se;
    const float sc = args.scale_by != 0 ? args.scale * scale_by[0] : args.scale;  // formed once, in f32
    for (uint j = tid; j < V; j += ntg) {
        const float p = exp(float(xr[j]) - mx) * inv;
        dr[j] = T(sc * (int(j) == y ? p - 1.0f : p));
    }
}

template [[host_name("cross_entropy_f32")]] [[kernel]] decltype(cross_entropy<float>) cross_entropy<float>;
template [[host_name("cross_entropy_f16")]] [[kernel]] decltype(cross_entropy<half>)  cross_entropy<half>;
#if KRNL_BF16
template [[host_name("cross_entropy_bf16")]] [[kernel]] decltype(cross_entropy<bfloat>) cross_entropy<bfloat>;
#endif
