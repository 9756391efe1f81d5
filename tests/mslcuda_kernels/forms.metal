// msl: 3.1 (a test source of tests/test_mslcuda.py: the MSL forms mslcuda must translate)
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

constant bool use_bias [[function_constant(0)]];
constant bool has_scale [[function_constant(1)]];
constant bool bias_on = is_function_constant_defined(use_bias) && use_bias;
constant float weights[3] = {0.25, 0.5, 0.25};
constant int K = 3;

template <typename T, typename U = T> inline U twice(T x) { return U(x + x); }

template <typename T> inline T two();
template <> inline float two<float>() { return 2.0f; }
template <> inline half two<half>() { return 2.0h; }
#if __METAL_VERSION__ >= 310  // bfloat: MSL 3.1
template <> inline bfloat two<bfloat>() { return bfloat(2.0f); }
#endif

struct Acc {
    float s;
    void add(float x) { s += x; }
    float get() const { return s; }
};

static float tri(device const float* x, uint i)
{
    float s = 0;
#pragma clang loop unroll(full)
    for (int k = 0; k < K; ++k) s += weights[k] * x[i + k];
    return s;
}

template <typename T, typename Y = float>
kernel void forms(device const T*   x     [[buffer(0)]],
                  device Y*         y     [[buffer(1)]],
                  device atomic_int* cnt  [[buffer(2)]],
                  constant float&   scale [[buffer(3), function_constant(has_scale)]],
                  uint gid  [[thread_position_in_grid]],
                  uint2 tid [[thread_position_in_threadgroup]],
                  uint lane [[thread_index_in_simdgroup]],
                  uint sg   [[simdgroup_index_in_threadgroup]])
{
    threadgroup float buf[64];
    threadgroup T tile[64];
    Acc a{0.0f};
    a.add(float(x[gid]) * float(two<T>()) + twice(0.5f));
    buf[tid.x % 64] = a.get() + (bias_on ? 1.0 : 0.5);
    tile[tid.x % 64] = T(buf[tid.x % 64]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float v = simd_sum(buf[lane]) + simd_max(float(tile[lane])) + simd_shuffle_xor(buf[lane], 1)
            + simd_shuffle_down(buf[lane], 3) + simd_prefix_exclusive_sum(1.0f) + quad_sum(buf[lane]);
    if (simd_all(v == v) && simd_any(lane == 0)) atomic_fetch_add_explicit(cnt, 1, memory_order_relaxed);
    float4 f = float4(v, 1.0f, 2.0f, 3.0f);
    half4 h = half4(f);
    f = fma(f, float4(h), float4(0.5f)) + precise::sqrt(abs(v)) + fast::exp(-v);
    simdgroup_matrix<T, 8, 8> m;
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_load(m, tile, 8);
    simdgroup_multiply_accumulate(acc, m, m, acc);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_store(acc, buf, 8);
    y[gid] = dot(f, f) + tri((device const float*)y, 0) + 1.5h + (is_function_constant_defined(has_scale) ? scale : 1.0f)
           + float(as_type<ushort>(half(f.x)) & 1) + max(f.y, f.z) + clamp(f.w, 0.0f, 1.0f)
           + metal::exp(f.x) + metal::max(f.y, 1.0f) + metal::abs(f.z) + metal::fast::exp(f.w) + float(metal::min(gid, 3u))
           + metal::precise::divide(1.0f, f.x) + metal::sqrt(metal::fma(f.x, f.x, 1.0f)) + float(bfloat(f.y));
}

template [[host_name("forms_f32")]] [[kernel]] decltype(forms<float>) forms<float>;
template [[host_name("forms_f16")]] [[kernel]] decltype(forms<half>) forms<half>;
#if __METAL_VERSION__ >= 310  // bfloat: MSL 3.1
template [[host_name("forms_bf16")]] [[kernel]] decltype(forms<bfloat>) forms<bfloat>;
#endif

[[kernel]] void plain(device int* out [[buffer(0)]], uint3 pos [[threadgroup_position_in_grid]])
{
    out[pos.x + pos.y + pos.z] = K;
}
