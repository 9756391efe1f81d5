// mslcuda.h -- the parts of the Metal Shading Language standard library that krnl's compute
// kernels use, in CUDA, for .metal files rewritten by mslcuda/translate.py (address spaces and
// attributes dropped, `__device__` on every function, threadgroup variables as __shared__,
// function constants as compile-time values). Apple's SIMD-group is 32 threads, like a warp,
// and threads are numbered into SIMD-groups the way CUDA numbers them into warps (x fastest),
// so SIMD-group functions are warp shuffles and simdgroup_matrix 8x8 fragments live two
// elements per lane in Apple's lane layout.
//
// Fidelity choices (tools/mslcuda/README.md): half and bfloat arithmetic runs in float and
// rounds once per operation; SIMD-group collectives take every lane of the SIMD-group that
// exists (a partial last SIMD-group of a threadgroup takes its lanes), so a collective reached
// by only some lanes is a bug that synccheck reports; simdgroup_load/store do not synchronise
// the lanes (Metal needs a barrier between one lane's store and another's load, and so does this).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#define MSLD __device__ __forceinline__

// CUDA's own half and vector types (float4, uint3, ...) take MSL's names: the MSL ones are
// renamed for everything below, the kernels included.
#define half msl_half
#define float2 msl_float2
#define float3 msl_float3
#define float4 msl_float4
#define half2 msl_half2
#define half3 msl_half3
#define half4 msl_half4
#define bfloat2 msl_bfloat2
#define bfloat3 msl_bfloat3
#define bfloat4 msl_bfloat4
#define int2 msl_int2
#define int3 msl_int3
#define int4 msl_int4
#define uint2 msl_uint2
#define uint3 msl_uint3
#define uint4 msl_uint4
#define short2 msl_short2
#define short3 msl_short3
#define short4 msl_short4
#define ushort2 msl_ushort2
#define ushort3 msl_ushort3
#define ushort4 msl_ushort4
#define char2 msl_char2
#define char3 msl_char3
#define char4 msl_char4
#define uchar2 msl_uchar2
#define uchar3 msl_uchar3
#define uchar4 msl_uchar4
#define bool2 msl_bool2
#define bool3 msl_bool3
#define bool4 msl_bool4
#define long2 msl_long2
#define long3 msl_long3
#define long4 msl_long4
#define ulong2 msl_ulong2
#define ulong3 msl_ulong3
#define ulong4 msl_ulong4

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;  // 64 bits on Linux, as in MSL

// ------------------------------------------------------------------------------------------------
// half and bfloat: storage types with float arithmetic. Each operation on two of them rounds its
// float result once; mixed with float, the result is float (as in MSL).
// ------------------------------------------------------------------------------------------------
namespace mslcuda {
template <class Self, class Raw>
struct small_float {
  Raw v;
  small_float() = default;
  MSLD small_float(float f) : v(Self::from_float(f)) {}
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
  MSLD small_float(I i) : v(Self::from_float(float(i))) {}
  MSLD small_float(double d) : v(Self::from_float(float(d))) {}
  MSLD operator float() const { return Self::to_float(v); }
};
}  // namespace mslcuda

struct half : mslcuda::small_float<half, __half> {
  using small_float::small_float;
  half() = default;
  MSLD static __half from_float(float f) { return __float2half_rn(f); }
  MSLD static float to_float(__half h) { return __half2float(h); }
};
struct bfloat : mslcuda::small_float<bfloat, __nv_bfloat16> {
  using small_float::small_float;
  bfloat() = default;
  MSLD static __nv_bfloat16 from_float(float f) { return __float2bfloat16_rn(f); }
  MSLD static float to_float(__nv_bfloat16 h) { return __bfloat162float(h); }
};
static_assert(sizeof(half) == 2 && sizeof(bfloat) == 2, "16-bit floats");

namespace mslcuda {
template <class X> struct is_small_float : std::false_type {};
template <> struct is_small_float<half> : std::true_type {};
template <> struct is_small_float<bfloat> : std::true_type {};
template <class X>
constexpr bool is_scalar_v = std::is_arithmetic<X>::value || is_small_float<std::remove_cv_t<X>>::value;
}  // namespace mslcuda

// Operators only for exact operand types (templates do not convert), so that half + float
// stays the built-in float + float and nothing is ambiguous.
#define MSLCUDA_SF_BINOP(OP)                                                                         \
  template <class A, std::enable_if_t<mslcuda::is_small_float<A>::value, int> = 0>                   \
  MSLD A operator OP(A a, A b) { return A(float(a) OP float(b)); }                                   \
  template <class A, class I,                                                                        \
            std::enable_if_t<mslcuda::is_small_float<A>::value && std::is_integral<I>::value, int> = 0> \
  MSLD A operator OP(A a, I b) { return A(float(a) OP float(b)); }                                   \
  template <class A, class I,                                                                        \
            std::enable_if_t<mslcuda::is_small_float<A>::value && std::is_integral<I>::value, int> = 0> \
  MSLD A operator OP(I a, A b) { return A(float(a) OP float(b)); }                                   \
  template <class A, class B, std::enable_if_t<mslcuda::is_small_float<A>::value, int> = 0>          \
  MSLD A& operator OP##=(A& a, B b) { return a = A(float(a) OP float(b)); }
MSLCUDA_SF_BINOP(+)
MSLCUDA_SF_BINOP(-)
MSLCUDA_SF_BINOP(*)
MSLCUDA_SF_BINOP(/)
#undef MSLCUDA_SF_BINOP
template <class A, std::enable_if_t<mslcuda::is_small_float<A>::value, int> = 0>
MSLD A operator-(A a) { return A(-float(a)); }

// ------------------------------------------------------------------------------------------------
// Vectors: vec<T, N> with .x .y .z .w (.r .g .b .a), MSL's sizes and alignments (a 3-vector is
// laid out as a 4-vector). No multi-component swizzles (.xy): a kernel that uses one fails to
// compile here, saying so.
// ------------------------------------------------------------------------------------------------
template <class T, int N> struct vec;
namespace mslcuda {
template <class X> struct vtraits { static constexpr int n = 0; };
template <class T, int N> struct vtraits<vec<T, N>> {
  static constexpr int n = N;
  using elem = T;
};
template <class X> constexpr int ncomp() {
  using D = std::remove_cv_t<std::remove_reference_t<X>>;
  return is_scalar_v<D> ? 1 : (vtraits<D>::n > 0 ? vtraits<D>::n : 1000);
}
template <class T, class A> MSLD void put(T* e, int& k, const A& a) {
  if constexpr (is_scalar_v<A>) {
    e[k++] = T(a);
  } else {
    for (int i = 0; i < vtraits<A>::n; ++i) e[k++] = T(a[i]);
  }
}
}  // namespace mslcuda

#define MSLCUDA_VEC_BODY(NN)                                                                           \
  static constexpr int size = NN;                                                                   \
  using value_type = T;                                                                             \
  vec() = default;                                                                                  \
  template <class S, std::enable_if_t<mslcuda::is_scalar_v<S>, int> = 0>                             \
  MSLD vec(S s) { for (int i = 0; i < NN; ++i) (*this)[i] = T(s); }                                 \
  template <class U, std::enable_if_t<!std::is_same<U, T>::value, int> = 0>                         \
  MSLD explicit vec(const vec<U, NN>& o) { for (int i = 0; i < NN; ++i) (*this)[i] = T(o[i]); }      \
  template <class A0, class A1, class... As,                                                        \
            std::enable_if_t<mslcuda::ncomp<A0>() + mslcuda::ncomp<A1>() + (0 + ... + mslcuda::ncomp<As>()) == NN, int> = 0> \
  MSLD vec(const A0& a0, const A1& a1, const As&... as) {                                           \
    int k = 0; mslcuda::put(&x, k, a0); mslcuda::put(&x, k, a1); (mslcuda::put(&x, k, as), ...);     \
  }                                                                                                 \
  MSLD T& operator[](int i) { return (&x)[i]; }                                                     \
  MSLD const T& operator[](int i) const { return (&x)[i]; }

template <class T> struct alignas(2 * sizeof(T)) vec<T, 2> {
  union { T x; T r; };
  union { T y; T g; };
  MSLCUDA_VEC_BODY(2)
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 3> {
  union { T x; T r; };
  union { T y; T g; };
  union { T z; T b; };
  MSLCUDA_VEC_BODY(3)
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 4> {
  union { T x; T r; };
  union { T y; T g; };
  union { T z; T b; };
  union { T w; T a; };
  MSLCUDA_VEC_BODY(4)
};
#undef MSLCUDA_VEC_BODY

#define MSLCUDA_VEC_BINOP(OP)                                                                        \
  template <class T, int N> MSLD vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {    \
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]); return r; }                    \
  template <class T, int N, class S, std::enable_if_t<mslcuda::is_scalar_v<S>, int> = 0>            \
  MSLD vec<T, N> operator OP(const vec<T, N>& a, S s) { return a OP vec<T, N>(s); }                 \
  template <class T, int N, class S, std::enable_if_t<mslcuda::is_scalar_v<S>, int> = 0>            \
  MSLD vec<T, N> operator OP(S s, const vec<T, N>& b) { return vec<T, N>(s) OP b; }                 \
  template <class T, int N, class B> MSLD vec<T, N>& operator OP##=(vec<T, N>& a, const B& b) {     \
    return a = a OP b; }
MSLCUDA_VEC_BINOP(+)
MSLCUDA_VEC_BINOP(-)
MSLCUDA_VEC_BINOP(*)
MSLCUDA_VEC_BINOP(/)
MSLCUDA_VEC_BINOP(%)
MSLCUDA_VEC_BINOP(&)
MSLCUDA_VEC_BINOP(|)
MSLCUDA_VEC_BINOP(^)
MSLCUDA_VEC_BINOP(<<)
MSLCUDA_VEC_BINOP(>>)
#undef MSLCUDA_VEC_BINOP
template <class T, int N> MSLD vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
  return r;
}
#define MSLCUDA_VEC_CMP(OP)                                                                          \
  template <class T, int N> MSLD vec<bool, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) { \
    vec<bool, N> r; for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i]; return r; }                    \
  template <class T, int N, class S, std::enable_if_t<mslcuda::is_scalar_v<S>, int> = 0>            \
  MSLD vec<bool, N> operator OP(const vec<T, N>& a, S s) { return a OP vec<T, N>(s); }
MSLCUDA_VEC_CMP(<)
MSLCUDA_VEC_CMP(>)
MSLCUDA_VEC_CMP(<=)
MSLCUDA_VEC_CMP(>=)
MSLCUDA_VEC_CMP(==)
MSLCUDA_VEC_CMP(!=)
#undef MSLCUDA_VEC_CMP

#define MSLCUDA_VEC_TYPES(T, NAME) \
  typedef vec<T, 2> NAME##2;       \
  typedef vec<T, 3> NAME##3;       \
  typedef vec<T, 4> NAME##4;
MSLCUDA_VEC_TYPES(float, float)
MSLCUDA_VEC_TYPES(half, half)
MSLCUDA_VEC_TYPES(bfloat, bfloat)
MSLCUDA_VEC_TYPES(int, int)
MSLCUDA_VEC_TYPES(uint, uint)
MSLCUDA_VEC_TYPES(short, short)
MSLCUDA_VEC_TYPES(ushort, ushort)
MSLCUDA_VEC_TYPES(char, char)
MSLCUDA_VEC_TYPES(uchar, uchar)
MSLCUDA_VEC_TYPES(bool, bool)
MSLCUDA_VEC_TYPES(long, long)
MSLCUDA_VEC_TYPES(ulong, ulong)
#undef MSLCUDA_VEC_TYPES

// ------------------------------------------------------------------------------------------------
// Math. Scalar float functions are CUDA's own (exp, log, sqrt, fma, max, min, ... take float in
// device code); MSL's vector forms, precise:: and fast:: namespaces and the rest are here.
// ------------------------------------------------------------------------------------------------
namespace metal {
// CUDA's scalar functions under metal:: too (metal::exp(x), as MLX-style kernels write): the same
// entities, so an unqualified call after `using namespace metal` is not ambiguous.
using ::abs;
using ::ceil;
using ::cos;
using ::exp;
using ::exp2;
using ::fabs;
using ::floor;
using ::fma;
using ::log;
using ::log2;
using ::max;
using ::min;
using ::pow;
using ::round;
using ::sin;
using ::sqrt;
using ::tanh;
using ::trunc;
#define MSLCUDA_VEC_MATH1(NAME, FN)                                                                  \
  template <class T, int N> MSLD vec<T, N> NAME(const vec<T, N>& a) {                               \
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(FN(float(a[i]))); return r; }
#define MSLCUDA_VEC_MATH2(NAME, FN)                                                                  \
  template <class T, int N> MSLD vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b) {           \
    vec<T, N> r; for (int i = 0; i < N; ++i) r[i] = T(FN(float(a[i]), float(b[i]))); return r; }
MSLCUDA_VEC_MATH1(exp, ::expf)
MSLCUDA_VEC_MATH1(exp2, ::exp2f)
MSLCUDA_VEC_MATH1(log, ::logf)
MSLCUDA_VEC_MATH1(log2, ::log2f)
MSLCUDA_VEC_MATH1(sqrt, ::sqrtf)
MSLCUDA_VEC_MATH1(rsqrt, ::rsqrtf)
MSLCUDA_VEC_MATH1(sin, ::sinf)
MSLCUDA_VEC_MATH1(cos, ::cosf)
MSLCUDA_VEC_MATH1(tanh, ::tanhf)
MSLCUDA_VEC_MATH1(abs, ::fabsf)
MSLCUDA_VEC_MATH1(fabs, ::fabsf)
MSLCUDA_VEC_MATH1(floor, ::floorf)
MSLCUDA_VEC_MATH1(ceil, ::ceilf)
MSLCUDA_VEC_MATH2(max, ::fmaxf)
MSLCUDA_VEC_MATH2(min, ::fminf)
MSLCUDA_VEC_MATH2(pow, ::powf)
#undef MSLCUDA_VEC_MATH1
#undef MSLCUDA_VEC_MATH2
template <class T, int N> MSLD vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = T(::fmaf(float(a[i]), float(b[i]), float(c[i])));
  return r;
}
template <class T, int N> MSLD T dot(const vec<T, N>& a, const vec<T, N>& b) {
  float s = 0.0f;
  for (int i = 0; i < N; ++i) s = ::fmaf(float(a[i]), float(b[i]), s);
  return T(s);
}
MSLD float rsqrt(float x) { return ::rsqrtf(x); }
MSLD float clamp(float x, float lo, float hi) { return ::fminf(::fmaxf(x, lo), hi); }
MSLD float saturate(float x) { return clamp(x, 0.0f, 1.0f); }
MSLD float select(float a, float b, bool c) { return c ? b : a; }
MSLD float mix(float a, float b, float t) { return ::fmaf(t, b - a, a); }
MSLD float sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }
MSLD bool isnan(float x) { return ::isnan(x); }
MSLD bool isinf(float x) { return ::isinf(x); }
MSLD bool isfinite(float x) { return ::isfinite(x); }
template <class T, int N> MSLD bool all(const vec<T, N>& a) {
  for (int i = 0; i < N; ++i) if (!a[i]) return false;
  return true;
}
template <class T, int N> MSLD bool any(const vec<T, N>& a) {
  for (int i = 0; i < N; ++i) if (a[i]) return true;
  return false;
}
// precise:: is IEEE (CUDA's defaults without fast math); fast:: takes the hardware intrinsics.
namespace precise {
MSLD float sqrt(float x) { return __fsqrt_rn(x); }
MSLD float divide(float a, float b) { return __fdiv_rn(a, b); }
MSLD float exp(float x) { return ::expf(x); }
MSLD float log(float x) { return ::logf(x); }
MSLD float sin(float x) { return ::sinf(x); }
MSLD float cos(float x) { return ::cosf(x); }
MSLD float tanh(float x) { return ::tanhf(x); }
MSLD float rsqrt(float x) { return 1.0f / __fsqrt_rn(x); }
}  // namespace precise
namespace fast {
MSLD float exp(float x) { return __expf(x); }
MSLD float exp2(float x) { return exp2f(x); }
MSLD float log(float x) { return __logf(x); }
MSLD float sin(float x) { return __sinf(x); }
MSLD float cos(float x) { return __cosf(x); }
MSLD float sqrt(float x) { return ::sqrtf(x); }
MSLD float rsqrt(float x) { return ::rsqrtf(x); }
MSLD float divide(float a, float b) { return __fdividef(a, b); }
MSLD float tanh(float x) { return ::tanhf(x); }
}  // namespace fast

// as_type: a bit cast between types of one size.
template <class To, class From> MSLD To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of one size");
  To t;
  memcpy(&t, &f, sizeof(To));
  return t;
}

template <class T> struct numeric_limits;
template <> struct numeric_limits<float> {
  MSLD static constexpr float max() { return 3.402823466e+38f; }
  MSLD static constexpr float lowest() { return -3.402823466e+38f; }
  MSLD static constexpr float min() { return 1.175494351e-38f; }
  MSLD static constexpr float epsilon() { return 1.1920929e-07f; }
  MSLD static float infinity() { return __int_as_float(0x7f800000); }
  MSLD static float quiet_NaN() { return __int_as_float(0x7fc00000); }
};

// ------------------------------------------------------------------------------------------------
// Barriers and SIMD-groups
// ------------------------------------------------------------------------------------------------
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8 };
MSLD constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }
// Every thread of the threadgroup, device and threadgroup memory both ordered (as Metal's with
// both flags: __syncthreads orders global memory within the block too).
MSLD void threadgroup_barrier(mem_flags) { __syncthreads(); }
}  // namespace metal

namespace mslcuda {
MSLD uint linear_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
MSLD uint lane() { return linear_tid() & 31u; }
// The lanes of this thread's SIMD-group that exist: all 32 but in a partial last one.
MSLD uint sg_mask() {
  const uint n = blockDim.x * blockDim.y * blockDim.z, first = linear_tid() & ~31u;
  return n - first >= 32 ? 0xffffffffu : (1u << (n - first)) - 1u;
}
template <class T> MSLD T shfl(uint mask, T v, uint src) {
  constexpr int W = (sizeof(T) + 3) / 4;
  uint w[W] = {};
  memcpy(w, &v, sizeof(T));
  for (int i = 0; i < W; ++i) w[i] = __shfl_sync(mask, w[i], int(src));
  T r;
  memcpy(&r, w, sizeof(T));
  return r;
}
// Every lane gets op over the lanes of the SIMD-group in a fixed order: a butterfly when all 32
// exist (every lane then computes the same value), lane order otherwise.
template <class T, class Op> MSLD T reduce(T x, Op op) {
  const uint m = sg_mask();
  if (m == 0xffffffffu) {
    for (uint o = 16; o; o >>= 1) x = op(x, shfl(m, x, lane() ^ o));
    return x;
  }
  T acc = shfl(m, x, 0);
  for (uint l = 1; l < 32 && ((m >> l) & 1u); ++l) acc = op(acc, shfl(m, x, l));
  return acc;
}
}  // namespace mslcuda

namespace metal {
MSLD void simdgroup_barrier(mem_flags) { __syncwarp(mslcuda::sg_mask()); }
template <class T> MSLD T simd_sum(T x) { return mslcuda::reduce(x, [](T a, T b) { return T(a + b); }); }
template <class T> MSLD T simd_product(T x) { return mslcuda::reduce(x, [](T a, T b) { return T(a * b); }); }
template <class T> MSLD T simd_max(T x) { return mslcuda::reduce(x, [](T a, T b) { return b > a ? b : a; }); }
template <class T> MSLD T simd_min(T x) { return mslcuda::reduce(x, [](T a, T b) { return b < a ? b : a; }); }
template <class T> MSLD T simd_and(T x) { return mslcuda::reduce(x, [](T a, T b) { return T(a & b); }); }
template <class T> MSLD T simd_or(T x) { return mslcuda::reduce(x, [](T a, T b) { return T(a | b); }); }
template <class T> MSLD T simd_xor(T x) { return mslcuda::reduce(x, [](T a, T b) { return T(a ^ b); }); }
MSLD bool simd_any(bool x) { return __any_sync(mslcuda::sg_mask(), x); }
MSLD bool simd_all(bool x) { return __all_sync(mslcuda::sg_mask(), x); }
template <class T> MSLD T simd_broadcast(T x, ushort lane) { return mslcuda::shfl(mslcuda::sg_mask(), x, lane); }
template <class T> MSLD T simd_broadcast_first(T x) { return mslcuda::shfl(mslcuda::sg_mask(), x, __ffs(mslcuda::sg_mask()) - 1); }
template <class T> MSLD T simd_shuffle(T x, ushort lane) { return mslcuda::shfl(mslcuda::sg_mask(), x, lane); }
template <class T> MSLD T simd_shuffle_xor(T x, ushort m) { return mslcuda::shfl(mslcuda::sg_mask(), x, mslcuda::lane() ^ m); }
// Lanes past the end keep their own value, as Metal's do.
template <class T> MSLD T simd_shuffle_down(T x, ushort d) {
  const uint l = mslcuda::lane() + d;
  const T y = mslcuda::shfl(mslcuda::sg_mask(), x, l & 31u);
  return l < 32 && ((mslcuda::sg_mask() >> l) & 1u) ? y : x;
}
template <class T> MSLD T simd_shuffle_up(T x, ushort d) {
  const uint l = mslcuda::lane();
  const T y = mslcuda::shfl(mslcuda::sg_mask(), x, (l - d) & 31u);
  return l >= d ? y : x;
}
template <class T> MSLD T simd_prefix_exclusive_sum(T x) {
  T acc = T(0), r = T(0);
  const uint m = mslcuda::sg_mask(), me = mslcuda::lane();
  for (uint l = 0; l < 32 && ((m >> l) & 1u); ++l) {
    if (l == me) r = acc;
    acc = T(acc + mslcuda::shfl(m, x, l));
  }
  return r;
}
template <class T> MSLD T simd_prefix_inclusive_sum(T x) { return T(simd_prefix_exclusive_sum(x) + x); }
MSLD vec<uint, 2> simd_ballot(bool x) { return vec<uint, 2>(__ballot_sync(mslcuda::sg_mask(), x), 0u); }
// quad-groups: 4 consecutive lanes
template <class T> MSLD T quad_sum(T x) {
  const uint m = mslcuda::sg_mask(), b = mslcuda::lane() & ~3u;
  return T(T(mslcuda::shfl(m, x, b) + mslcuda::shfl(m, x, b + 1)) + T(mslcuda::shfl(m, x, b + 2) + mslcuda::shfl(m, x, b + 3)));
}
template <class T> MSLD T quad_shuffle(T x, ushort l) { return mslcuda::shfl(mslcuda::sg_mask(), x, (mslcuda::lane() & ~3u) + l); }
template <class T> MSLD T quad_broadcast(T x, ushort l) { return quad_shuffle(x, l); }
template <class T> MSLD T quad_shuffle_xor(T x, ushort m) { return mslcuda::shfl(mslcuda::sg_mask(), x, mslcuda::lane() ^ m); }

// ------------------------------------------------------------------------------------------------
// simdgroup_matrix<T, 8, 8>: two elements per lane, in Apple's layout (the one MLX's steel GEMM
// relies on through thread_elements()): lane l holds row (q & 4) + (l / 2) % 4, columns
// c and c + 1 with c = (q & 2) * 2 + (l % 2) * 2, q = l / 4. The SIMD-group's 32 lanes must all
// take part (Metal requires the same).
// ------------------------------------------------------------------------------------------------
template <class T, int C, int R> struct simdgroup_matrix {
  static_assert(C == 8 && R == 8, "mslcuda emulates 8x8 simdgroup matrices only");
  vec<T, 2> e;
  MSLD vec<T, 2>& thread_elements() { return e; }
  MSLD const vec<T, 2>& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

MSLD uint sgm_row(uint l) { return ((l >> 2) & 4u) + ((l >> 1) & 3u); }
MSLD uint sgm_col(uint l) { return ((l >> 2) & 2u) * 2u + (l & 1u) * 2u; }
MSLD uint sgm_lane(uint r, uint c) {  // the lane holding (r, c), c even
  return ((r & 4u) << 2) | ((c & 4u) << 1) | ((r & 3u) << 1) | ((c >> 1) & 1u);
}

template <class T, int C, int R> MSLD simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, C, R> m;
  m.e = vec<T, 2>(v);
  return m;
}
template <class T, class S, int C, int R>
MSLD void simdgroup_load(simdgroup_matrix<T, C, R>& d, const S* src, ulong elements_per_row = 8,
                         vec<ulong, 2> origin = vec<ulong, 2>(0ul), bool transpose = false) {
  const uint l = mslcuda::lane(), r = sgm_row(l), c = sgm_col(l);
  const S* p = src + origin[1] * elements_per_row + origin[0];
  if (!transpose) {
    d.e[0] = T(p[r * elements_per_row + c]);
    d.e[1] = T(p[r * elements_per_row + c + 1]);
  } else {
    d.e[0] = T(p[c * elements_per_row + r]);
    d.e[1] = T(p[(c + 1) * elements_per_row + r]);
  }
}
template <class T, class S, int C, int R>
MSLD void simdgroup_store(const simdgroup_matrix<T, C, R>& m, S* dst, ulong elements_per_row = 8,
                          vec<ulong, 2> origin = vec<ulong, 2>(0ul), bool transpose = false) {
  const uint l = mslcuda::lane(), r = sgm_row(l), c = sgm_col(l);
  S* p = dst + origin[1] * elements_per_row + origin[0];
  if (!transpose) {
    p[r * elements_per_row + c] = S(m.e[0]);
    p[r * elements_per_row + c + 1] = S(m.e[1]);
  } else {
    p[c * elements_per_row + r] = S(m.e[0]);
    p[(c + 1) * elements_per_row + r] = S(m.e[1]);
  }
}
// d = a * b + c, each product and sum in float (the GPU's matrix unit accumulates in float);
// rounded once into d's type.
template <class TD, class TA, class TB, class TC>
MSLD void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                        const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c) {
  const uint l = mslcuda::lane(), r = sgm_row(l), col = sgm_col(l);
  float acc0 = float(c.e[0]), acc1 = float(c.e[1]);
#pragma unroll
  for (uint k = 0; k < 8; k += 2) {
    const vec<TA, 2> ak = mslcuda::shfl(0xffffffffu, a.e, sgm_lane(r, k));        // A[r][k], A[r][k+1]
    const vec<TB, 2> b0 = mslcuda::shfl(0xffffffffu, b.e, sgm_lane(k, col));      // B[k][col], B[k][col+1]
    const vec<TB, 2> b1 = mslcuda::shfl(0xffffffffu, b.e, sgm_lane(k + 1, col));  // B[k+1][col..]
    acc0 = ::fmaf(float(ak[0]), float(b0[0]), acc0);
    acc1 = ::fmaf(float(ak[0]), float(b0[1]), acc1);
    acc0 = ::fmaf(float(ak[1]), float(b1[0]), acc0);
    acc1 = ::fmaf(float(ak[1]), float(b1[1]), acc1);
  }
  d.e[0] = TD(acc0);
  d.e[1] = TD(acc1);
}
template <class TD, class TA, class TB>
MSLD void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                             const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0.0f)));
}

// ------------------------------------------------------------------------------------------------
// Atomics (relaxed: the only order MSL has)
// ------------------------------------------------------------------------------------------------
enum memory_order { memory_order_relaxed };
template <class T> struct mslcuda_atomic { T v; };
typedef mslcuda_atomic<int> atomic_int;
typedef mslcuda_atomic<uint> atomic_uint;
typedef mslcuda_atomic<float> atomic_float;
template <class T> MSLD void atomic_store_explicit(mslcuda_atomic<T>* a, T v, memory_order) { atomicExch(&a->v, v); }
template <class T> MSLD T atomic_load_explicit(mslcuda_atomic<T>* a, memory_order) {
  return *reinterpret_cast<volatile T*>(&a->v);
}
template <class T> MSLD T atomic_exchange_explicit(mslcuda_atomic<T>* a, T v, memory_order) { return atomicExch(&a->v, v); }
template <class T> MSLD T atomic_fetch_add_explicit(mslcuda_atomic<T>* a, T v, memory_order) { return atomicAdd(&a->v, v); }
template <class T> MSLD T atomic_fetch_sub_explicit(mslcuda_atomic<T>* a, T v, memory_order) { return atomicSub(&a->v, v); }
template <class T> MSLD T atomic_fetch_max_explicit(mslcuda_atomic<T>* a, T v, memory_order) { return atomicMax(&a->v, v); }
template <class T> MSLD T atomic_fetch_min_explicit(mslcuda_atomic<T>* a, T v, memory_order) { return atomicMin(&a->v, v); }
template <class T> MSLD T atomic_fetch_or_explicit(mslcuda_atomic<T>* a, T v, memory_order) { return atomicOr(&a->v, v); }
template <class T> MSLD T atomic_fetch_and_explicit(mslcuda_atomic<T>* a, T v, memory_order) { return atomicAnd(&a->v, v); }
template <class T>
MSLD bool atomic_compare_exchange_weak_explicit(mslcuda_atomic<T>* a, T* expected, T desired, memory_order, memory_order) {
  const T old = atomicCAS(&a->v, *expected, desired);
  const bool ok = old == *expected;
  *expected = old;
  return ok;
}
}  // namespace metal

// ------------------------------------------------------------------------------------------------
// Kernel entry: the dispatch's buffers and builtins, converted to each parameter's type.
// ------------------------------------------------------------------------------------------------
namespace mslcuda {
constexpr int kMaxBuffers = 31;  // Metal's buffer argument table
constexpr int kMaxArgs = 512;    // set-bytes limit of this executor
struct LaunchParams {
  void* buf[kMaxBuffers];
  uint args_index;
  alignas(16) unsigned char args[kMaxArgs];
};
// A bound buffer: a pointer parameter takes its address, a reference parameter its contents.
struct BufArg {
  void* p;
  template <class T> MSLD operator T*() const { return static_cast<T*>(p); }
  template <class T, std::enable_if_t<!std::is_pointer<T>::value, int> = 0> MSLD operator T&() const {
    return *static_cast<T*>(p);
  }
};
MSLD BufArg buffer(const LaunchParams& lp, uint i) {
  return BufArg{i == lp.args_index ? const_cast<unsigned char*>(lp.args) : lp.buf[i]};
}
// A builtin: converts to uint, uint2 or uint3 (and the ushort forms) as the parameter asks.
struct Builtin {
  uint x, y, z;
  MSLD operator uint() const { return x; }
  MSLD operator ushort() const { return ushort(x); }
  MSLD operator int() const { return int(x); }
  MSLD operator vec<uint, 2>() const { return vec<uint, 2>(x, y); }
  MSLD operator vec<uint, 3>() const { return vec<uint, 3>(x, y, z); }
  MSLD operator vec<ushort, 2>() const { return vec<ushort, 2>(ushort(x), ushort(y)); }
  MSLD operator vec<ushort, 3>() const { return vec<ushort, 3>(ushort(x), ushort(y), ushort(z)); }
};
MSLD Builtin b_thread_position_in_grid() {
  return {blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y, blockIdx.z * blockDim.z + threadIdx.z};
}
MSLD Builtin b_thread_position_in_threadgroup() { return {threadIdx.x, threadIdx.y, threadIdx.z}; }
MSLD Builtin b_threadgroup_position_in_grid() { return {blockIdx.x, blockIdx.y, blockIdx.z}; }
MSLD Builtin b_threadgroups_per_grid() { return {gridDim.x, gridDim.y, gridDim.z}; }
MSLD Builtin b_threads_per_threadgroup() { return {blockDim.x, blockDim.y, blockDim.z}; }
MSLD Builtin b_dispatch_threads_per_threadgroup() { return b_threads_per_threadgroup(); }
MSLD Builtin b_threads_per_grid() { return {gridDim.x * blockDim.x, gridDim.y * blockDim.y, gridDim.z * blockDim.z}; }
MSLD Builtin b_thread_index_in_threadgroup() { return {linear_tid(), 0, 0}; }
MSLD Builtin b_thread_index_in_simdgroup() { return {lane(), 0, 0}; }
MSLD Builtin b_simdgroup_index_in_threadgroup() { return {linear_tid() / 32u, 0, 0}; }
MSLD Builtin b_simdgroups_per_threadgroup() { return {(blockDim.x * blockDim.y * blockDim.z + 31u) / 32u, 0, 0}; }
MSLD Builtin b_dispatch_simdgroups_per_threadgroup() { return b_simdgroups_per_threadgroup(); }
MSLD Builtin b_threads_per_simdgroup() { return {32u, 0, 0}; }
MSLD Builtin b_thread_execution_width() { return {32u, 0, 0}; }
MSLD Builtin b_thread_index_in_quadgroup() { return {linear_tid() & 3u, 0, 0}; }
MSLD Builtin b_quadgroup_index_in_threadgroup() { return {linear_tid() / 4u, 0, 0}; }
MSLD Builtin b_quadgroups_per_threadgroup() { return {(blockDim.x * blockDim.y * blockDim.z + 3u) / 4u, 0, 0}; }
MSLD Builtin b_dispatch_quadgroups_per_threadgroup() { return b_quadgroups_per_threadgroup(); }
}  // namespace mslcuda

using namespace metal;
