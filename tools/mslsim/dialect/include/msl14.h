// msl14.h -- the subset of the Metal Shading Language standard library that metal/*.metal uses,
// declared in plain C++14, for the dialect check (msl_dialect.py). MSL 3.x is C++14 with
// extensions; the simulator's shim (mslsim/include) is C++17/20 and would accept C++17 in a
// kernel, which Apple's compiler rejects. Compiled with -std=c++14 -fsyntax-only -nostdinc, so
// these are declarations only (nothing is linked or run) and the C++ standard library is absent,
// as in MSL.
//
// What the kernels use and its near siblings (the half overload, the fast:: twin), no more: a
// kernel that needs another MSL function fails here first ("undeclared identifier"); add it, with
// the MSL version that introduced it, from Apple's specification. Features newer than MSL 3.0 sit
// behind __METAL_VERSION__ (set from the file's `// msl: X.Y` line as Apple does: 3.1 -> 310), so
// a file that uses bfloat but declares 3.0 fails to compile here just as it would with
// `metal -std=metal3.0`.
#pragma once

#if !defined(__METAL_VERSION__)
#error "msl14.h: __METAL_VERSION__ is not set (msl_dialect.py sets it from the file's '// msl:' line)"
#elif __METAL_VERSION__ < 300 || __METAL_VERSION__ >= 400
#error "msl14.h covers MSL 3.x (C++14-based) only"
#endif

// ---- Address spaces and function qualifiers. Erased: C++14 has no address spaces, and this pass
// checks syntax and types, not where memory lives (mslsim's README lists that limit too).
// Attributes ([[buffer(0)]], [[kernel]], [[host_name("x")]], ...) are validated and blanked by
// msl_dialect.py before the compile.
#define device
#define constant
#define threadgroup
#define thread
#define kernel

// ---- Scalars (the specification's scalar types). half: _Float16 has MSL's arithmetic (clang on arm64,
// g++ >= 12 on x86-64). long/ulong are 64-bit as on Apple GPUs (the pass runs LP64).
typedef _Float16 half;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;
typedef unsigned long uint64_t;
typedef unsigned long size_t;
typedef long ptrdiff_t;

#if __METAL_VERSION__ >= 310
// bfloat: MSL 3.1 (macOS 14). A class here (C++14 compilers have no portable bf16 arithmetic):
// it converts to and from float, which is enough to type-check its uses.
#define __HAVE_BFLOAT__ 1
struct bfloat {
  bfloat() = default;
  bfloat(float);
  operator float() const;
  unsigned short bits_;  // 16 bits, as MSL's: sizeof and as_type<bfloat>(ushort) agree
};
#endif

namespace msl14_detail {
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <class T> struct identity { typedef T type; };  // a non-deduced parameter
template <class A, class B> struct is_same { static constexpr bool value = false; };
template <class A> struct is_same<A, A> { static constexpr bool value = true; };
template <class T> struct strip { typedef T type; };
template <class T> struct strip<const T> { typedef T type; };
template <class T> struct strip<volatile T> { typedef T type; };
template <class T> struct strip<const volatile T> { typedef T type; };

template <class T> struct is_scalar_raw { static constexpr bool value = false; };
#define MSL14_SCALAR(T) \
  template <> struct is_scalar_raw<T> { static constexpr bool value = true; };
MSL14_SCALAR(bool) MSL14_SCALAR(char) MSL14_SCALAR(signed char) MSL14_SCALAR(unsigned char)
MSL14_SCALAR(short) MSL14_SCALAR(unsigned short) MSL14_SCALAR(int) MSL14_SCALAR(unsigned int)
MSL14_SCALAR(long) MSL14_SCALAR(unsigned long) MSL14_SCALAR(half) MSL14_SCALAR(float)
#if __METAL_VERSION__ >= 310
MSL14_SCALAR(bfloat)
#endif
#undef MSL14_SCALAR
template <class T> struct is_scalar { static constexpr bool value = is_scalar_raw<typename strip<T>::type>::value; };
template <class T> struct is_float_scalar {
  typedef typename strip<T>::type U;
  static constexpr bool value = is_same<U, float>::value || is_same<U, half>::value
#if __METAL_VERSION__ >= 310
                                || is_same<U, bfloat>::value
#endif
      ;
};
}  // namespace msl14_detail

// ---- Vectors: metal::vec<T, N> (N = 2, 3, 4) and the <scalar>N typedefs. Components .x .y .z .w
// and operator[]; the kernels use no swizzles and no packed types, so neither is declared.
namespace metal {
template <class T, int N> struct vec;
}  // namespace metal

namespace msl14_detail {
// Components a constructor argument contributes: 1 for a scalar, N for a vector, else invalid.
template <class X> struct ncomp { static constexpr int value = is_scalar<X>::value ? 1 : -100; };
template <class T, int N> struct ncomp<metal::vec<T, N>> { static constexpr int value = N; };
template <class T, int N> struct ncomp<const metal::vec<T, N>> { static constexpr int value = N; };
template <class... A> struct ncomp_sum { static constexpr int value = 0; };
template <class A, class... R> struct ncomp_sum<A, R...> {
  static constexpr int value = ncomp<A>::value + ncomp_sum<R...>::value;
};
}  // namespace msl14_detail

#define MSL14_VEC_MEMBERS(N)                                                                       \
  vec() = default;                                                                                 \
  vec(const vec&) = default;                                                                       \
  vec& operator=(const vec&) = default;                                                            \
  /* broadcast: float4 v = 0.0f, float4(alpha) */                                                  \
  template <class S, class = typename msl14_detail::enable_if<msl14_detail::is_scalar<S>::value>::type> \
  vec(S s);                                                                                        \
  /* element-type conversion is explicit: float4(h4) */                                           \
  template <class U, class = typename msl14_detail::enable_if<!msl14_detail::is_same<U, T>::value>::type> \
  explicit vec(vec<U, N> v);                                                                       \
  /* from scalars and smaller vectors whose components add up to N: float4(a, b, c, d) */         \
  template <class A0, class A1, class... As,                                                       \
            class = typename msl14_detail::enable_if<msl14_detail::ncomp_sum<A0, A1, As...>::value == N>::type> \
  vec(A0 a0, A1 a1, As... as);                                                                     \
  T& operator[](uint i);                                                                           \
  const T& operator[](uint i) const;                                                               \
  vec& operator+=(vec o);                                                                          \
  vec& operator-=(vec o);                                                                          \
  vec& operator*=(vec o);                                                                          \
  vec& operator/=(vec o);

namespace metal {
// Size and alignment as in MSL: a 3-vector is laid out as a 4-vector.
template <class T> struct alignas(2 * sizeof(T)) vec<T, 2> {
  T x, y;
  MSL14_VEC_MEMBERS(2)
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 3> {
  T x, y, z;
  MSL14_VEC_MEMBERS(3)
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 4> {
  T x, y, z, w;
  MSL14_VEC_MEMBERS(4)
};
#undef MSL14_VEC_MEMBERS

// Elementwise operators: vector op vector of the same type, or with a scalar on either side.
#define MSL14_VEC_BINOP(op)                                                                        \
  template <class T, int N> vec<T, N> operator op(vec<T, N> a, vec<T, N> b);                       \
  template <class T, int N, class S,                                                               \
            class = typename msl14_detail::enable_if<msl14_detail::is_scalar<S>::value>::type>     \
  vec<T, N> operator op(vec<T, N> a, S b);                                                         \
  template <class T, int N, class S,                                                               \
            class = typename msl14_detail::enable_if<msl14_detail::is_scalar<S>::value>::type>     \
  vec<T, N> operator op(S a, vec<T, N> b);
MSL14_VEC_BINOP(+) MSL14_VEC_BINOP(-) MSL14_VEC_BINOP(*) MSL14_VEC_BINOP(/)
#undef MSL14_VEC_BINOP
template <class T, int N> vec<T, N> operator-(vec<T, N> a);
}  // namespace metal

#define MSL14_VEC_TYPEDEFS(T)       \
  typedef metal::vec<T, 2> T##2;    \
  typedef metal::vec<T, 3> T##3;    \
  typedef metal::vec<T, 4> T##4;
MSL14_VEC_TYPEDEFS(bool) MSL14_VEC_TYPEDEFS(char) MSL14_VEC_TYPEDEFS(uchar)
MSL14_VEC_TYPEDEFS(short) MSL14_VEC_TYPEDEFS(ushort) MSL14_VEC_TYPEDEFS(int) MSL14_VEC_TYPEDEFS(uint)
MSL14_VEC_TYPEDEFS(long) MSL14_VEC_TYPEDEFS(ulong) MSL14_VEC_TYPEDEFS(half) MSL14_VEC_TYPEDEFS(float)
#if __METAL_VERSION__ >= 310
MSL14_VEC_TYPEDEFS(bfloat)
#endif
#undef MSL14_VEC_TYPEDEFS

namespace metal {
// ---- Common and math functions, float and half, scalar or vector.
template <class T>
typename msl14_detail::enable_if<msl14_detail::is_scalar<T>::value, T>::type max(T a, T b);
template <class T>
typename msl14_detail::enable_if<msl14_detail::is_scalar<T>::value, T>::type min(T a, T b);
template <class T, int N> vec<T, N> max(vec<T, N> a, vec<T, N> b);
template <class T, int N> vec<T, N> min(vec<T, N> a, vec<T, N> b);

float exp(float x);
half exp(half x);
float log(float x);
half log(half x);
float sqrt(float x);
half sqrt(half x);
float sin(float x);
half sin(half x);
float cos(float x);
half cos(half x);
float fma(float a, float b, float c);
half fma(half a, half b, half c);
template <class T, int N> vec<T, N> exp(vec<T, N> x);
template <class T, int N> vec<T, N> log(vec<T, N> x);
template <class T, int N> vec<T, N> sqrt(vec<T, N> x);
template <class T, int N> vec<T, N> fma(vec<T, N> a, vec<T, N> b, vec<T, N> c);
template <class T, int N> T dot(vec<T, N> a, vec<T, N> b);

// precise:: and fast:: select the accuracy of the float versions.
namespace precise {
float exp(float x);
float log(float x);
float sqrt(float x);
float sin(float x);
float cos(float x);
float divide(float x, float y);
}  // namespace precise
namespace fast {
float exp(float x);
float log(float x);
float sqrt(float x);
float sin(float x);
float cos(float x);
float divide(float x, float y);
}  // namespace fast

// as_type<T>(x): reinterprets the bits; the sizes must match.
template <class T, class U, class = typename msl14_detail::enable_if<sizeof(T) == sizeof(U)>::type>
T as_type(U x);

// ---- Synchronization.
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

// ---- SIMD-group functions: the reductions and votes the kernels use.
template <class T>
typename msl14_detail::enable_if<msl14_detail::is_scalar<T>::value, T>::type simd_sum(T x);
template <class T>
typename msl14_detail::enable_if<msl14_detail::is_scalar<T>::value, T>::type simd_max(T x);
bool simd_any(bool x);
template <class T>
typename msl14_detail::enable_if<msl14_detail::is_scalar<T>::value, T>::type simd_shuffle_xor(T x, ushort mask);

// ---- Atomics: device or threadgroup atomic_int/atomic_uint, relaxed order only.
enum memory_order { memory_order_relaxed };
template <class T> struct atomic {
  static_assert(msl14_detail::is_same<T, int>::value || msl14_detail::is_same<T, uint>::value,
                "MSL atomics here: atomic_int and atomic_uint");
  T value_;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
template <class T>
void atomic_store_explicit(volatile atomic<T>* object, typename msl14_detail::identity<T>::type desired,
                           memory_order order);

// ---- Function constants: constant T name [[function_constant(i)]]; whether the
// host set it is a compile-time boolean.
template <class T> bool is_function_constant_defined(const T& name);

// ---- SIMD-group matrices: 8x8 tiles of float or half (bfloat from 3.1), loaded from
// and stored to device or threadgroup memory. MSL 2.3 (Apple7 GPUs and later).
template <class T, int Cols, int Rows> struct simdgroup_matrix {
  static_assert(msl14_detail::is_float_scalar<T>::value, "simdgroup_matrix holds float or half (bfloat from MSL 3.1)");
  static_assert(Cols == 8 && Rows == 8, "simdgroup_matrix is 8x8");
  // The two elements this lane holds (row (q & 4) + (lane / 2) % 4 with q = lane / 4, columns
  // (q & 2) * 2 + (lane % 2) * 2 and the next one).
  vec<T, 2>& thread_elements();
  const vec<T, 2>& thread_elements() const;
  T elements_[2];
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
#if __METAL_VERSION__ >= 310
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
#endif
template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value);
template <class T, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const typename msl14_detail::identity<T>::type* src,
                    ulong elements_per_row = Cols, ulong2 matrix_origin = 0, bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_store(simdgroup_matrix<T, Cols, Rows> a, typename msl14_detail::identity<T>::type* dst,
                     ulong elements_per_row = Cols, ulong2 matrix_origin = 0, bool transpose_matrix = false);
// d = a * b + c; the operands may differ in element type (half tiles into float accumulators).
template <class TD, class TA, class TB, class TC, int K, int M, int L>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, K, M>& d, simdgroup_matrix<TA, L, M> a,
                                   simdgroup_matrix<TB, K, L> b, simdgroup_matrix<TC, K, M> c);
}  // namespace metal
