// Small kernels exercising language features of the emulation (not performance-relevant).
#include <metal_stdlib>
using namespace metal;

struct Out { float4 v; uint2 u; half2 h; };

constant int  fc_mode [[function_constant(3)]];
constant bool fc_has_mode = is_function_constant_defined(fc_mode);

// vectors, swizzles, half literals, math, as_type
kernel void vec_ops(device const float4* in  [[buffer(0)]],
                    device float4*       out [[buffer(1)]],
                    device uint*         bits [[buffer(2)]],
                    uint gid [[thread_position_in_grid]])
{
    float4 a = in[gid];
    float4 b = a.wzyx;                 // swizzle read
    b.xy = a.zw * 2.0f;                // swizzle write, vector * scalar
    b.zw += float2(1.0f, 2.0f);
    half h = 1.5h;
    half4 hv = half4(a);
    hv.x = hv.x * h + 0.25h;
    float3 c = cross(a.xyz, float3(0, 0, 1));
    float d = dot(a, b) + length(c);
    float4 r = float4(b.xy, float(hv.x), d);
    r = select(r, -r, r < float4(0.0f));        // abs via select
    r.w = clamp(r.w, -100.0f, 100.0f) + fast::exp2(1.0f) + precise::rsqrt(4.0f) + max(1.0f, 2.0f) + fma(2.0f, 3.0f, 1.0f);
    if (fc_has_mode && fc_mode == 2) r.w += 1000.0f;
    out[gid] = r;
    bits[gid] = as_type<uint>(a.x);
}

// SIMD-group functions
kernel void simd_ops(device const float* in [[buffer(0)]],
                     device float*       out [[buffer(1)]],
                     uint gid  [[thread_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]])
{
    float v = in[gid];
    out[gid * 8 + 0] = simd_sum(v);
    out[gid * 8 + 1] = simd_max(v);
    out[gid * 8 + 2] = simd_min(v);
    out[gid * 8 + 3] = simd_prefix_exclusive_sum(v);
    out[gid * 8 + 4] = simd_shuffle_down(v, 3);
    out[gid * 8 + 5] = simd_broadcast(v, 5);
    out[gid * 8 + 6] = quad_sum(v);
    out[gid * 8 + 7] = float(uint64_t(simd_ballot(v > 0.0f)) & 0xFFFFu) + (simd_is_first() ? 0.5f : 0.0f);
}

// early exit of some lanes before a SIMD collective is legal (inactive lanes don't take part)
kernel void early_exit_sum(device const float* in [[buffer(0)]],
                           device float*       out [[buffer(1)]],
                           constant uint&      n   [[buffer(2)]],
                           uint gid [[thread_position_in_grid]])
{
    if (gid >= n) return;
    out[gid] = simd_sum(in[gid]);
}

// atomics on device and threadgroup memory; dynamic threadgroup memory; 2-D builtins; dispatchThreads
kernel void atomics_2d(device atomic_uint* counter [[buffer(0)]],
                       device uint*        grid_ids [[buffer(1)]],
                       threadgroup uint*   scratch [[threadgroup(0)]],
                       uint2 pos  [[thread_position_in_grid]],
                       uint2 tpg  [[threads_per_grid]],
                       uint2 tptg [[threads_per_threadgroup]],
                       uint  tidx [[thread_index_in_threadgroup]])
{
    threadgroup atomic_uint local_count;
    if (tidx == 0) atomic_store_explicit(&local_count, 0u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    atomic_fetch_add_explicit(&local_count, 1u, memory_order_relaxed);
    scratch[tidx] = pos.x + pos.y * tpg.x;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint nthreads = tptg.x * tptg.y;
    grid_ids[scratch[(tidx + 1) % nthreads]] = atomic_load_explicit(&local_count, memory_order_relaxed);
    if (tidx == 0) atomic_fetch_add_explicit(counter, nthreads, memory_order_relaxed);
}

// simdgroup_matrix filled through thread_elements() (MLX style), multiplied, stored transposed
kernel void sgmat_elements(device const float* A [[buffer(0)]],
                           device const float* B [[buffer(1)]],
                           device float*       C [[buffer(2)]],
                           ushort lane [[thread_index_in_simdgroup]])
{
    const short qid = lane / 4;
    const short row = (qid & 4) + ((lane / 2) % 4);
    const short col = (qid & 2) * 2 + (lane % 2) * 2;
    simdgroup_float8x8 a, b, c;
    a.thread_elements()[0] = A[row * 8 + col];
    a.thread_elements()[1] = A[row * 8 + col + 1];
    simdgroup_load(b, B, 8);
    simdgroup_multiply(c, a, b);
    simdgroup_store(c, C, 8, ulong2(0, 0), true);
}

// vector predicates (isnan/isinf/signbit on float4) under a host name that differs from the function's
[[host_name("predicates")]] kernel void predicates_impl(device const float4* in  [[buffer(0)]],
                                                        device float4*       out [[buffer(1)]],
                                                        uint gid [[thread_position_in_grid]])
{
    const float4 v = in[gid];
    out[gid] = select(float4(0.0f), float4(1.0f), isnan(v)) + select(float4(0.0f), float4(2.0f), isinf(v))
             + select(float4(0.0f), float4(4.0f), signbit(v));
}

#if __METAL_VERSION__ >= 310  // bfloat: MSL 3.1
// bfloat (MSL 3.1): float -> bfloat rounding, bfloat -> float, bfloat arithmetic (one rounding per
// operation), bfloat4 and a simdgroup_bfloat8x8 product into float accumulators.
kernel void bfloat_ops(device const float*  x    [[buffer(0)]],
                       device ushort*       bits [[buffer(1)]],   // (n, 3): bfloat(x), bfloat(x) + bfloat(y), bfloat4 * 2
                       device float*        back [[buffer(2)]],   // (n,): float(bfloat(x))
                       uint gid [[thread_position_in_grid]])
{
    const bfloat a = bfloat(x[2 * gid]), b = bfloat(x[2 * gid + 1]);
    const bfloat4 v = bfloat4(a, b, a, b) * bfloat4(2.0f);
    bits[3 * gid]     = as_type<ushort>(a);
    bits[3 * gid + 1] = as_type<ushort>(bfloat(a + b));
    bits[3 * gid + 2] = as_type<ushort>(bfloat(v.y));
    back[gid] = float(a);
}

kernel void sgmat_bfloat(device const bfloat* A [[buffer(0)]],
                         device const bfloat* B [[buffer(1)]],
                         device float*        C [[buffer(2)]],
                         ushort lane [[thread_index_in_simdgroup]])
{
    simdgroup_bfloat8x8 a, b;
    simdgroup_float8x8 c = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
    simdgroup_load(a, A, 8);
    simdgroup_load(b, B, 8);
    simdgroup_multiply_accumulate(c, a, b, c);
    simdgroup_store(c, C, 8);
}
#endif
