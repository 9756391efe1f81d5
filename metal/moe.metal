// msl: 3.0 (krnl's floor; newest feature used: simd_sum, MSL 2.x)
// Mixture of experts (csrc/core/op_list.h's notes; metal/kargs.h MoeRouteArgs, MoeSortArgs,
// MoeCombineArgs): routing, grouping by expert, the weighted combine and its backward. The
// grouped GEMMs sit in gemm.metal beside the tile they share; moe_gather is embedding.metal's
// embedding_forward.
//
// Ids, slot and tokens are written by earlier kernels of the same step, so no host has checked
// them: an index out of range never touches memory here. It reads as NaN where it is gathered
// (the combine's ys row, the combine backward's dweights), adds nothing to the route backward,
// and moe_sort gives its pair slot -1 and no position: a bad routing shows in the result.
// Every sum runs in a fixed order: the results do not depend on thread scheduling.
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

// A quiet NaN made from its bits, not by a float operation that fast math may assume away.
inline float moe_nan() { return as_type<float>(0x7fc00000u); }

// The rank of a probability in the top-k: p itself, a NaN below every probability. Tested on the
// bits: fast math may assume that no float is a NaN.
inline float moe_key(float p) { return (as_type<uint>(p) & 0x7fffffffu) > 0x7f800000u ? -1.0f : p; }

// A row's softmax as the CPU forms it: max, then the sum of exp(l - max) in expert order.
// p_e = exp(l_e - m) * inv is recomputed where needed: the same operations every time, so equal
// logits rank as equal probabilities.
template <typename T>
inline void moe_softmax(device const T* l, uint E, thread float& m, thread float& inv)
{
    m = float(l[0]);
    for (uint e = 1; e < E; ++e) m = max(m, float(l[e]));
    float s = 0.0f;
    for (uint e = 0; e < E; ++e) s += exp(float(l[e]) - m);
    inv = 1.0f / s;
}

// moe_route: ids (N, K) the K largest p of each row in descending order, a tie to the lower
// expert; weights (N, K) f32 their p, divided by their f32 sum (in k order) where norm.
// One thread per row (a grid-stride loop: any grid; e.g. 256 threads per threadgroup and
// min(ceil(N / 256), 1024) threadgroups): K passes over the row, each taking the best-ranked
// expert below the previous pick (no per-row storage; a router's E K operations per token are
// small beside the experts' GEMMs).
template <typename T>
kernel void moe_route(device const T*        logits  [[buffer(0)]],
                      device int*            ids     [[buffer(1)]],
                      device float*          weights [[buffer(2)]],
                      constant MoeRouteArgs& args    [[buffer(3)]],
                      uint gid [[thread_position_in_grid]],
                      uint gsz [[threads_per_grid]])
{
    const uint E = args.E, K = args.K;
    for (uint t = gid; t < args.N; t += gsz) {
        device const T* l = logits + (ulong)t * E;
        device int*     id = ids + (ulong)t * K;
        device float*   w = weights + (ulong)t * K;
        float m, inv;
        moe_softmax(l, E, m, inv);
        float prev = 0.0f;  // the previous pick's key and expert (none before k = 0)
        uint prev_e = 0;
        float sum = 0.0f;
        for (uint k = 0; k < K; ++k) {
            // the best (key, lowest expert) ranking after (prev, prev_e): one exists, as K <= E
            float best = -2.0f;
            uint best_e = 0;
            for (uint e = 0; e < E; ++e) {
                const float q = moe_key(exp(float(l[e]) - m) * inv);
                const bool after = k == 0 || q < prev || (q == prev && e > prev_e);
                if (after && q > best) {  // strict: the lowest expert of equal keys stays
                    best = q;
                    best_e = e;
                }
            }
            const float p = exp(float(l[best_e]) - m) * inv;
            id[k] = int(best_e);
            w[k] = p;
            sum += p;
            prev = best;
            prev_e = best_e;
        }
        if (args.norm != 0)
            for (uint k = 0; k < K; ++k) w[k] = w[k] / sum;
    }
}

// moe_route_backward: dlogits (N, E) = p (dp - p . dp) per row, dp_e = dprobs[e] (or 0) plus the
// gradient of each weight whose expert is e, added in k order; with norm the weights are
// p_k / S, so their gradient reaches p_k as (dweights_k - sum_j dweights_j w_j) / S. An id
// outside [0, E) adds nothing. One thread per row (geometry as moe_route).
template <typename T>
kernel void moe_route_backward(device const T*        logits   [[buffer(0)]],
                               device const int*      ids      [[buffer(1)]],
                               device const float*    dweights [[buffer(2)]],
                               device T*              dlogits  [[buffer(3)]],
                               device const float*    dprobs   [[buffer(4)]],
                               constant MoeRouteArgs& args     [[buffer(5)]],
                               uint gid [[thread_position_in_grid]],
                               uint gsz [[threads_per_grid]])
{
    const uint E = args.E, K = args.K;
    const bool norm = args.norm != 0, bias = args.has_dprobs != 0;
    for (uint t = gid; t < args.N; t += gsz) {
        device const T*     l = logits + (ulong)t * E;
        device const int*   id = ids + (ulong)t * K;
        device const float* g = dweights + (ulong)t * K;
        device T*           out = dlogits + (ulong)t * E;
        float m, inv;
        moe_softmax(l, E, m, inv);
        float s = 1.0f, gw = 0.0f;  // dp_k = (g_k - gw) / s; without norm, g_k
        if (norm) {
            s = 0.0f;
            for (uint k = 0; k < K; ++k)
                if (uint(id[k]) < E) s += exp(float(l[id[k]]) - m) * inv;
            for (uint k = 0; k < K; ++k)
                if (uint(id[k]) < E) gw += g[k] * ((exp(float(l[id[k]]) - m) * inv) / s);
        }
        // Two passes over the experts, forming dp_e afresh in each (the same sum both times):
        // p . dp first, then the output, which may be written only once that sum is complete.
        float pd = 0.0f;
        for (uint pass = 0; pass < 2; ++pass) {
            for (uint e = 0; e < E; ++e) {
                float dp = bias ? dprobs[e] : 0.0f;
                for (uint k = 0; k < K; ++k)
                    if (uint(id[k]) == e) dp += norm ? (g[k] - gw) / s : g[k];
                const float p = exp(float(l[e]) - m) * inv;
                if (pass == 0)
                    pd += p * dp;
                else
                    out[e] = T(p * (dp - pd));
            }
        }
    }
}

// moe_sort: pair i = (t, k) goes to position slot[i] = offsets[e] + (pairs of expert e before
// i), tokens[slot[i]] = t, offsets (E + 1,) the experts' starts: a stable counting sort by ONE
// threadgroup of T threads (threads (T, 1, 1), grid (1, 1, 1)), thread j owning the contiguous
// pairs [j c, (j + 1) c) with c = ceil(P / T), and counts (T, E) u32 in device memory its
// per-expert counts. The counts of each expert become, over the threads in order, each thread's
// first position inside the expert: pairs keep their (t, k) order within an expert whatever the
// schedule. A pair whose expert is outside [0, E) gets slot -1 and no position; the positions
// they leave over (from offsets[E] to P) get token -1.
[[host_name("moe_sort_i32")]]
kernel void moe_sort(device const int*     ids     [[buffer(0)]],
                     device int*           tokens  [[buffer(1)]],
                     device int*           slot    [[buffer(2)]],
                     device int*           offsets [[buffer(3)]],
                     device uint*          counts  [[buffer(4)]],
                     constant MoeSortArgs& args    [[buffer(5)]],
                     uint tid [[thread_position_in_threadgroup]],
                     uint ntg [[threads_per_threadgroup]])
{
    const uint P = args.P, K = args.K, E = args.E;
    const uint chunk = (P + ntg - 1) / ntg;
    const uint i0 = min(P, tid * chunk), i1 = min(P, i0 + chunk);
    device uint* mine = counts + (ulong)tid * E;
    for (uint e = 0; e < E; ++e) mine[e] = 0;
    for (uint i = i0; i < i1; ++i) {
        const uint e = uint(ids[i]);  // a negative id wraps past E
        if (e < E) ++mine[e];
    }
    threadgroup_barrier(mem_flags::mem_device);

    // expert e (one thread each): its counts become the threads' starts inside it, its total
    // goes to offsets[e + 1]
    for (uint e = tid; e < E; e += ntg) {
        uint run = 0;
        for (uint j = 0; j < ntg; ++j) {
            device uint* c = counts + (ulong)j * E + e;
            const uint n = *c;
            *c = run;
            run += n;
        }
        offsets[e + 1] = int(run);
    }
    threadgroup_barrier(mem_flags::mem_device);
    if (tid == 0) {  // the totals' running sum: E additions
        offsets[0] = 0;
        for (uint e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    }
    threadgroup_barrier(mem_flags::mem_device);

    for (uint i = i0; i < i1; ++i) {
        const uint e = uint(ids[i]);
        if (e < E) {
            const uint s = uint(offsets[e]) + mine[e]++;
            slot[i] = int(s);
            tokens[s] = int(i / K);
        } else {
            slot[i] = -1;
        }
    }
    for (uint s = uint(offsets[E]) + tid; s < P; s += ntg) tokens[s] = -1;
}

// moe_combine: out (N, C) = beta out + sum over k in order of weights[t, k] ys[slot[t, k]] (each
// weight 1 without weights), accumulated in f32; beta == 0 never reads out. One thread per output
// element (a grid-stride loop over N C: any grid, e.g. as moe_route's over N C).
template <typename T>
kernel void moe_combine(device const T*          ys      [[buffer(0)]],
                        device const int*        slot    [[buffer(1)]],
                        device const float*      weights [[buffer(2)]],
                        device T*                out     [[buffer(3)]],
                        constant MoeCombineArgs& args    [[buffer(4)]],
                        uint gid [[thread_position_in_grid]],
                        uint gsz [[threads_per_grid]])
{
    const uint C = args.C, K = args.K, P = args.P;
    const uint total = args.N * C;  // the host keeps it within 32 bits
    const float beta = args.beta;
    for (uint i = gid; i < total; i += gsz) {
        const uint t = i / C, c = i - t * C;
        float acc = 0.0f;
        for (uint k = 0; k < K; ++k) {
            const uint s = uint(slot[t * K + k]);
            const float y = s < P ? float(ys[(ulong)s * C + c]) : moe_nan();
            acc += (args.has_weights != 0 ? weights[t * K + k] : 1.0f) * y;
        }
        out[i] = T(beta == 0.0f ? acc : acc + beta * float(out[i]));
    }
}

// moe_combine_backward: for each pair (t, k) with s = slot[t, k]: dys[s] = weights[t, k] dout[t]
// and dweights[t, k] = dout[t] . ys[s] (f32). One SIMD-group per pair (threads (256, 1, 1): 8
// pairs at a time per threadgroup, any grid; a grid-stride loop over the N K pairs, uniform over
// each SIMD-group): its lanes take every 32nd column, and simd_sum adds their partial dots in
// its fixed order. dys may be ys: each element is read before the same lane overwrites it.
template <typename T>
kernel void moe_combine_backward(device const T*          dout     [[buffer(0)]],
                                 device const T*          ys       [[buffer(1)]],
                                 device const int*        slot     [[buffer(2)]],
                                 device const float*      weights  [[buffer(3)]],
                                 device T*                dys      [[buffer(4)]],
                                 device float*            dweights [[buffer(5)]],
                                 constant MoeCombineArgs& args     [[buffer(6)]],
                                 uint tg   [[threadgroup_position_in_grid]],
                                 uint ngrp [[threadgroups_per_grid]],
                                 uint sg   [[simdgroup_index_in_threadgroup]],
                                 uint nsg  [[simdgroups_per_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]])
{
    const uint C = args.C, K = args.K, P = args.P, pairs = args.N * K;
    for (uint i = tg * nsg + sg; i < pairs; i += ngrp * nsg) {
        const uint t = i / K, s = uint(slot[i]);
        const bool ok = s < P;
        const float w = weights[i];
        device const T* g = dout + (ulong)t * C;
        float d = 0.0f;
        if (ok) {
            device const T* y = ys + (ulong)s * C;
            device T*       dy = dys + (ulong)s * C;
            for (uint c = lane; c < C; c += 32) {
                const float gc = float(g[c]);
                d += gc * float(y[c]);
                dy[c] = T(w * gc);
            }
        }
        d = simd_sum(d);
        if (lane == 0) dweights[i] = ok ? d : moe_nan();
    }
}

template [[host_name("moe_route_f32")]] [[kernel]] decltype(moe_route<float>) moe_route<float>;
template [[host_name("moe_route_f16")]] [[kernel]] decltype(moe_route<half>) moe_route<half>;
template [[host_name("moe_route_backward_f32")]] [[kernel]] decltype(moe_route_backward<float>) moe_route_backward<float>;
template [[host_name("moe_route_backward_f16")]] [[kernel]] decltype(moe_route_backward<half>) moe_route_backward<half>;
template [[host_name("moe_combine_f32")]] [[kernel]] decltype(moe_combine<float>) moe_combine<float>;
template [[host_name("moe_combine_f16")]] [[kernel]] decltype(moe_combine<half>) moe_combine<half>;
template [[host_name("moe_combine_backward_f32")]] [[kernel]]
decltype(moe_combine_backward<float>) moe_combine_backward<float>;
template [[host_name("moe_combine_backward_f16")]] [[kernel]]
decltype(moe_combine_backward<half>) moe_combine_backward<half>;
#if KRNL_BF16
template [[host_name("moe_route_bf16")]] [[kernel]] decltype(moe_route<bfloat>) moe_route<bfloat>;
template [[host_name("moe_route_backward_bf16")]] [[kernel]] decltype(moe_route_backward<bfloat>) moe_route_backward<bfloat>;
template [[host_name("moe_combine_bf16")]] [[kernel]] decltype(moe_combine<bfloat>) moe_combine<bfloat>;
template [[host_name("moe_combine_backward_bf16")]] [[kernel]]
decltype(moe_combine_backward<bfloat>) moe_combine_backward<bfloat>;
#endif
