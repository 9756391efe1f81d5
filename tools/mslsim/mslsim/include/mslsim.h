// mslsim.h -- CPU emulation of the parts of the Metal Shading Language standard library that
// compute kernels use.  A .metal file is first rewritten by mslsim (address spaces, attributes,
// threadgroup variables, function constants, kernel registry); the result includes this header and
// is compiled with g++ >= 12 (needs _Float16) as C++20 into a shared library.
//
// Execution model (see mslsim_runtime.h): every GPU thread is a fiber; all fibers of one
// threadgroup run cooperatively on one OS thread and switch only at threadgroup_barrier,
// simdgroup_barrier and SIMD-group collectives.  Threadgroups are spread over worker OS threads.
//
// mslsim_swizzles.inc is not kept in the tree: mslsim/swizzles.py writes it into the build cache.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if !defined(__FLT16_MAX__)
#error "mslsim needs a compiler with _Float16 support (g++ >= 12 or clang >= 15 on x86-64/aarch64)"
#endif

// ------------------------------------------------------------------------------------------------
// Scalars
// ------------------------------------------------------------------------------------------------
typedef _Float16 half;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

// bfloat (MSL 3.1): 16 bits, the top half of a float. g++ 12 has no arithmetic __bf16, so a
// class: float -> bfloat rounds to nearest even on the bits (NaN kept, made quiet), bfloat ->
// float is exact, and arithmetic runs in float and rounds once, as one bfloat operation on a GPU
// does. Construction from a number is explicit (kernels spell T(x)); reading is implicit, so
// bfloat mixed with float computes in float.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  explicit bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) bits = uint16_t((u >> 16) | 0x40u);  // NaN: sign and payload top, quiet
    else bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);             // RNE; overflow rounds to inf
  }
  template <class S, std::enable_if_t<std::is_arithmetic_v<S> || std::is_same_v<S, _Float16>, int> = 0>
  explicit bfloat(S s) : bfloat(float(s)) {}
  operator float() const {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  bfloat& operator+=(bfloat o) { return *this = bfloat(float(*this) + float(o)); }
  bfloat& operator-=(bfloat o) { return *this = bfloat(float(*this) - float(o)); }
  bfloat& operator*=(bfloat o) { return *this = bfloat(float(*this) * float(o)); }
  bfloat& operator/=(bfloat o) { return *this = bfloat(float(*this) / float(o)); }
};
inline bfloat operator+(bfloat a, bfloat b) { return bfloat(float(a) + float(b)); }
inline bfloat operator-(bfloat a, bfloat b) { return bfloat(float(a) - float(b)); }
inline bfloat operator*(bfloat a, bfloat b) { return bfloat(float(a) * float(b)); }
inline bfloat operator/(bfloat a, bfloat b) { return bfloat(float(a) / float(b)); }
inline bfloat operator-(bfloat a) { bfloat r = a; r.bits ^= 0x8000u; return r; }
static_assert(sizeof(bfloat) == 2 && std::is_trivially_copyable_v<bfloat>, "bfloat is 16 plain bits");

namespace mslsim {

template <class X>
inline constexpr bool is_scalar_v = std::is_arithmetic_v<X> || std::is_same_v<std::remove_cv_t<X>, _Float16> ||
                                    std::is_same_v<std::remove_cv_t<X>, bfloat>;

// ------------------------------------------------------------------------------------------------
// Vectors: vec<T,N> with .x/.y/.z/.w, .r/.g/.b/.a, all 2-4 component swizzles, MSL layout
// (size and alignment of a 3-vector are those of a 4-vector).
// ------------------------------------------------------------------------------------------------
template <class T, int N> struct vec;
template <class V, class T, int... I> struct swz;

template <class X> struct vtraits { static constexpr int n = 0; };
template <class T, int N> struct vtraits<vec<T, N>> {
  static constexpr int n = N;
  using elem = T;
  using vec_t = vec<T, N>;
};
template <class V, class T, int... I> struct vtraits<swz<V, T, I...>> {
  static constexpr int n = sizeof...(I);
  using elem = T;
  using vec_t = V;
};
template <class X> inline constexpr bool is_vecish_v = vtraits<std::remove_cv_t<std::remove_reference_t<X>>>::n > 0;
template <class X> constexpr int ncomp() {
  using D = std::remove_cv_t<std::remove_reference_t<X>>;
  if constexpr (is_scalar_v<D>) return 1;
  else return vtraits<D>::n > 0 ? vtraits<D>::n : 1000;
}

template <class V, class T, int... I> struct swz {
  static constexpr int M = sizeof...(I);
  T* p() { return reinterpret_cast<T*>(this); }
  const T* p() const { return reinterpret_cast<const T*>(this); }
  operator V() const { const T* q = p(); return V(q[I]...); }
  swz& operator=(const V& v) { T* q = p(); int k = 0; ((q[I] = v.e[k++]), ...); return *this; }
  swz& operator=(const swz& o) { return *this = V(o); }
  template <class S, std::enable_if_t<is_scalar_v<S>, int> = 0> swz& operator=(S s) { return *this = V(s); }
  T operator[](int i) const { const int idx[] = {I...}; return p()[idx[i]]; }
  swz& operator+=(const V& v) { return *this = V(*this) + v; }
  swz& operator-=(const V& v) { return *this = V(*this) - v; }
  swz& operator*=(const V& v) { return *this = V(*this) * v; }
  swz& operator/=(const V& v) { return *this = V(*this) / v; }
};

#define MSLSIM_VEC_COMMON(NN)                                                                            \
  static constexpr int size = NN;                                                                     \
  using value_type = T;                                                                               \
  vec() = default;                                                                                    \
  vec(const vec&) = default;                                                                          \
  vec& operator=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] = o.e[i]; return *this; }         \
  template <class S, std::enable_if_t<is_scalar_v<S>, int> = 0>                                       \
  vec(S s) { for (int i = 0; i < NN; ++i) e[i] = T(s); }                                              \
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>                                \
  explicit vec(const vec<U, NN>& o) { for (int i = 0; i < NN; ++i) e[i] = T(o.e[i]); }                \
  template <class V2, class U, int... J, std::enable_if_t<sizeof...(J) == NN && !std::is_same_v<U, T>, int> = 0> \
  explicit vec(const swz<V2, U, J...>& s) : vec(V2(s)) {}                                             \
  template <class A0, class A1, class... As,                                                          \
            std::enable_if_t<ncomp<A0>() + ncomp<A1>() + (0 + ... + ncomp<As>()) == NN, int> = 0>     \
  vec(const A0& a0, const A1& a1, const As&... as) {                                                  \
    int k = 0; put(k, a0); put(k, a1); (put(k, as), ...);                                             \
  }                                                                                                   \
  template <class A> void put(int& k, const A& a) {                                                   \
    if constexpr (is_scalar_v<A>) e[k++] = T(a);                                                      \
    else { typename vtraits<A>::vec_t v = a; for (int i = 0; i < vtraits<A>::n; ++i) e[k++] = T(v.e[i]); } \
  }                                                                                                   \
  T& operator[](int i) { return e[i]; }                                                               \
  const T& operator[](int i) const { return e[i]; }                                                   \
  vec& operator+=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] += o.e[i]; return *this; }       \
  vec& operator-=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] -= o.e[i]; return *this; }       \
  vec& operator*=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] *= o.e[i]; return *this; }       \
  vec& operator/=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] /= o.e[i]; return *this; }       \
  vec& operator%=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] %= o.e[i]; return *this; }       \
  vec& operator&=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] &= o.e[i]; return *this; }       \
  vec& operator|=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] |= o.e[i]; return *this; }       \
  vec& operator^=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] ^= o.e[i]; return *this; }       \
  vec& operator<<=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] <<= o.e[i]; return *this; }     \
  vec& operator>>=(const vec& o) { for (int i = 0; i < NN; ++i) e[i] >>= o.e[i]; return *this; }

template <class T> struct alignas(2 * sizeof(T)) vec<T, 2> {
  union {
    T e[2];
    struct { T x, y; };
    struct { T r, g; };
#define MSLSIM_SWZ_N 2
#include "mslsim_swizzles.inc"
#undef MSLSIM_SWZ_N
  };
  MSLSIM_VEC_COMMON(2)
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 3> {
  union {
    T e[4];
    struct { T x, y, z; };
    struct { T r, g, b; };
#define MSLSIM_SWZ_N 3
#include "mslsim_swizzles.inc"
#undef MSLSIM_SWZ_N
  };
  MSLSIM_VEC_COMMON(3)
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 4> {
  union {
    T e[4];
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
#define MSLSIM_SWZ_N 4
#include "mslsim_swizzles.inc"
#undef MSLSIM_SWZ_N
  };
  MSLSIM_VEC_COMMON(4)
};
#undef MSLSIM_VEC_COMMON

// Result type of a binary vector operation: both operands vector-like of one type, or one scalar.
template <class A, class B, class = void> struct binop {};
template <class A, class B>
struct binop<A, B, std::enable_if_t<is_vecish_v<A> && is_vecish_v<B> &&
                                    std::is_same_v<typename vtraits<A>::vec_t, typename vtraits<B>::vec_t>>> {
  using type = typename vtraits<A>::vec_t;
};
template <class A, class B> struct binop<A, B, std::enable_if_t<is_vecish_v<A> && is_scalar_v<B>>> {
  using type = typename vtraits<A>::vec_t;
};
template <class A, class B> struct binop<A, B, std::enable_if_t<is_scalar_v<A> && is_vecish_v<B>>> {
  using type = typename vtraits<B>::vec_t;
};
template <class A, class B> using binop_t = typename binop<A, B>::type;

template <class R, class X> inline R as_vec(const X& x) {
  if constexpr (is_scalar_v<X>) return R(typename R::value_type(x));
  else return R(x);
}

#define MSLSIM_VBINOP(op)                                                                     \
  template <class A, class B, class R = binop_t<A, B>>                                     \
  inline R operator op(const A& a, const B& b) {                                           \
    R x = as_vec<R>(a), y = as_vec<R>(b), r;                                               \
    for (int i = 0; i < R::size; ++i) r.e[i] = typename R::value_type(x.e[i] op y.e[i]);   \
    return r;                                                                              \
  }
MSLSIM_VBINOP(+) MSLSIM_VBINOP(-) MSLSIM_VBINOP(*) MSLSIM_VBINOP(/) MSLSIM_VBINOP(%)
MSLSIM_VBINOP(&) MSLSIM_VBINOP(|) MSLSIM_VBINOP(^) MSLSIM_VBINOP(<<) MSLSIM_VBINOP(>>)
#undef MSLSIM_VBINOP
#define MSLSIM_VCMPOP(op)                                                                     \
  template <class A, class B, class R = binop_t<A, B>>                                     \
  inline vec<bool, R::size> operator op(const A& a, const B& b) {                          \
    R x = as_vec<R>(a), y = as_vec<R>(b);                                                  \
    vec<bool, R::size> r;                                                                  \
    for (int i = 0; i < R::size; ++i) r.e[i] = x.e[i] op y.e[i];                           \
    return r;                                                                              \
  }
MSLSIM_VCMPOP(==) MSLSIM_VCMPOP(!=) MSLSIM_VCMPOP(<) MSLSIM_VCMPOP(>) MSLSIM_VCMPOP(<=) MSLSIM_VCMPOP(>=)
MSLSIM_VCMPOP(&&) MSLSIM_VCMPOP(||)
#undef MSLSIM_VCMPOP
#define MSLSIM_VUNOP(op)                                                                      \
  template <class A, class R = typename vtraits<A>::vec_t>                                 \
  inline R operator op(const A& a) {                                                       \
    R x = a, r;                                                                            \
    for (int i = 0; i < R::size; ++i) r.e[i] = typename R::value_type(op x.e[i]);          \
    return r;                                                                              \
  }
MSLSIM_VUNOP(-) MSLSIM_VUNOP(+) MSLSIM_VUNOP(~) MSLSIM_VUNOP(!)
#undef MSLSIM_VUNOP

// packed_floatN etc.: no padding, element alignment.
template <class T, int N> struct packed_fields;
template <class T> struct packed_fields<T, 2> { union { T e[2]; struct { T x, y; }; struct { T r, g; }; }; };
template <class T> struct packed_fields<T, 3> { union { T e[3]; struct { T x, y, z; }; struct { T r, g, b; }; }; };
template <class T> struct packed_fields<T, 4> { union { T e[4]; struct { T x, y, z, w; }; struct { T r, g, b, a; }; }; };
template <class T, int N> struct packed_vec : packed_fields<T, N> {
  using packed_fields<T, N>::e;
  packed_vec() = default;
  packed_vec(const vec<T, N>& v) { for (int i = 0; i < N; ++i) e[i] = v.e[i]; }
  template <class... A, std::enable_if_t<sizeof...(A) == N, int> = 0> packed_vec(A... a) { T t[N] = {T(a)...}; for (int i = 0; i < N; ++i) e[i] = t[i]; }
  operator vec<T, N>() const { vec<T, N> v; for (int i = 0; i < N; ++i) v.e[i] = e[i]; return v; }
  T& operator[](int i) { return e[i]; }
  const T& operator[](int i) const { return e[i]; }
};

// Column-major matrices floatCxR: C columns of vec<T,R>.
template <class T, int C, int R> struct mat {
  vec<T, R> cols[C];
  mat() = default;
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
  explicit mat(const mat<U, C, R>& o) { for (int c = 0; c < C; ++c) cols[c] = vec<T, R>(o.cols[c]); }
  explicit mat(T d) { for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) cols[c].e[r] = (c == r) ? d : T(0); }
  template <class... V, std::enable_if_t<sizeof...(V) == C && C != 1, int> = 0> mat(const V&... v) : cols{vec<T, R>(v)...} {}
  vec<T, R>& operator[](int c) { return cols[c]; }
  const vec<T, R>& operator[](int c) const { return cols[c]; }
};
template <class T, int C, int R> inline vec<T, R> operator*(const mat<T, C, R>& m, const vec<T, C>& v) {
  vec<T, R> r(T(0));
  for (int c = 0; c < C; ++c) for (int i = 0; i < R; ++i) r.e[i] += m.cols[c].e[i] * v.e[c];
  return r;
}
template <class T, int C, int R> inline vec<T, C> operator*(const vec<T, R>& v, const mat<T, C, R>& m) {
  vec<T, C> r;
  for (int c = 0; c < C; ++c) { T s = T(0); for (int i = 0; i < R; ++i) s += v.e[i] * m.cols[c].e[i]; r.e[c] = s; }
  return r;
}
template <class T, int K, int C, int R> inline mat<T, C, R> operator*(const mat<T, K, R>& a, const mat<T, C, K>& b) {
  mat<T, C, R> m;
  for (int c = 0; c < C; ++c) m.cols[c] = a * b.cols[c];
  return m;
}

}  // namespace mslsim

// ------------------------------------------------------------------------------------------------
// MSL type names (global, like the builtin types of MSL)
// ------------------------------------------------------------------------------------------------
#define MSLSIM_VEC_NAMES(T, name)                                                              \
  typedef mslsim::vec<T, 2> name##2; typedef mslsim::vec<T, 3> name##3; typedef mslsim::vec<T, 4> name##4; \
  typedef mslsim::packed_vec<T, 2> packed_##name##2; typedef mslsim::packed_vec<T, 3> packed_##name##3; \
  typedef mslsim::packed_vec<T, 4> packed_##name##4;
MSLSIM_VEC_NAMES(float, float) MSLSIM_VEC_NAMES(_Float16, half) MSLSIM_VEC_NAMES(int, int) MSLSIM_VEC_NAMES(uint, uint)
MSLSIM_VEC_NAMES(short, short) MSLSIM_VEC_NAMES(ushort, ushort) MSLSIM_VEC_NAMES(char, char) MSLSIM_VEC_NAMES(uchar, uchar)
MSLSIM_VEC_NAMES(bool, bool) MSLSIM_VEC_NAMES(long, long) MSLSIM_VEC_NAMES(ulong, ulong)
MSLSIM_VEC_NAMES(bfloat, bfloat)
#undef MSLSIM_VEC_NAMES
#define MSLSIM_MAT_NAMES(T, name)                                                                        \
  typedef mslsim::mat<T, 2, 2> name##2x2; typedef mslsim::mat<T, 2, 3> name##2x3; typedef mslsim::mat<T, 2, 4> name##2x4; \
  typedef mslsim::mat<T, 3, 2> name##3x2; typedef mslsim::mat<T, 3, 3> name##3x3; typedef mslsim::mat<T, 3, 4> name##3x4; \
  typedef mslsim::mat<T, 4, 2> name##4x2; typedef mslsim::mat<T, 4, 3> name##4x3; typedef mslsim::mat<T, 4, 4> name##4x4;
MSLSIM_MAT_NAMES(float, float) MSLSIM_MAT_NAMES(_Float16, half)
#undef MSLSIM_MAT_NAMES

#include "mslsim_runtime.h"

// as_type<T>(x) is a language-level builtin in MSL (usable without `using namespace metal`)
template <class To, class From> inline To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To t; std::memcpy((void*)&t, (const void*)&f, sizeof(To)); return t;
}

// ------------------------------------------------------------------------------------------------
// namespace metal: math, relational, geometric, type traits, limits
// ------------------------------------------------------------------------------------------------
namespace metal {
using ::half; using ::bfloat; using ::uint; using ::ushort; using ::uchar; using ::ulong;
using ::float2; using ::float3; using ::float4; using ::half2; using ::half3; using ::half4;
using ::int2; using ::int3; using ::int4; using ::uint2; using ::uint3; using ::uint4;
template <class T, int N> using vec = mslsim::vec<T, N>;
template <class T, int C, int R> using matrix = mslsim::mat<T, C, R>;
template <class T, size_t N> using array = std::array<T, N>;
using std::abs;  // int/long/float/double abs: the very functions that the global namespace already has, so
                 // that `abs(x)` is not ambiguous under `using namespace metal`

// type traits (MSL's metal:: versions; half counts as floating point)
using std::enable_if; using std::enable_if_t; using std::conditional; using std::conditional_t;
using std::is_same; using std::is_same_v; using std::is_integral; using std::is_integral_v;
using std::is_signed; using std::is_signed_v; using std::is_unsigned; using std::is_unsigned_v;
using std::remove_cv; using std::remove_cv_t; using std::remove_reference; using std::remove_reference_t;
using std::make_unsigned; using std::make_unsigned_t; using std::make_signed; using std::make_signed_t;
using std::integral_constant; using std::true_type; using std::false_type; using std::is_const;
using std::decay; using std::decay_t; using std::is_pointer; using std::is_pointer_v;
using std::is_convertible; using std::is_convertible_v; using std::is_base_of; using std::is_base_of_v;
using std::remove_pointer; using std::remove_pointer_t; using std::add_const; using std::add_const_t;
using std::is_void; using std::is_void_v; using std::is_class; using std::is_class_v; using std::is_const_v;
using std::is_reference; using std::is_reference_v; using std::remove_cvref; using std::remove_cvref_t;
using std::declval; using std::forward; using std::move; using std::bool_constant; using std::integer_sequence;
using std::make_integer_sequence; using std::index_sequence; using std::make_index_sequence;
template <class T> using uniform = T;  // MSL's uniform<T> marks a threadgroup-uniform value
template <class T> constexpr T make_uniform(T v) { return v; }
template <class T> struct is_floating_point
    : std::integral_constant<bool, std::is_floating_point_v<T> || std::is_same_v<std::remove_cv_t<T>, _Float16> ||
                                       std::is_same_v<std::remove_cv_t<T>, bfloat>> {};
template <class T> inline constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T> struct is_arithmetic : std::integral_constant<bool, mslsim::is_scalar_v<T>> {};
template <class T> inline constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T> struct is_scalar : std::integral_constant<bool, mslsim::is_scalar_v<T>> {};
template <class T> inline constexpr bool is_scalar_v = is_scalar<T>::value;
template <class T> struct is_vector : std::integral_constant<bool, mslsim::is_vecish_v<T>> {};
template <class T> inline constexpr bool is_vector_v = is_vector<T>::value;

template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <> struct numeric_limits<half> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, has_infinity = true;
  static constexpr int digits = 11;
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(0.0009765625f); }
  static constexpr half infinity() { return __builtin_inff16(); }
  static constexpr half quiet_NaN() { return __builtin_nanf16(""); }
  static constexpr half denorm_min() { return half(5.960464477539063e-08f); }
};

// --- floating point functions: scalar float/half + float2..4/half2..4 (non-templates, so that
// --- swizzles and scalars convert implicitly just as in MSL) -------------------------------------
#define MSLSIM_V1(T, name)                                                                              \
  inline mslsim::vec<T, 2> name(mslsim::vec<T, 2> v) { return mslsim::vec<T, 2>(name(v.e[0]), name(v.e[1])); } \
  inline mslsim::vec<T, 3> name(mslsim::vec<T, 3> v) { return mslsim::vec<T, 3>(name(v.e[0]), name(v.e[1]), name(v.e[2])); } \
  inline mslsim::vec<T, 4> name(mslsim::vec<T, 4> v) {                                                     \
    return mslsim::vec<T, 4>(name(v.e[0]), name(v.e[1]), name(v.e[2]), name(v.e[3]));                   \
  }
#define MSLSIM_F1(name, expr)                                                                           \
  inline float name(float x) { return expr; }                                                        \
  inline half name(half hx) { return half(name(float(hx))); }                                        \
  inline float name(double dx) { return name(float(dx)); }                                           \
  MSLSIM_V1(float, name) MSLSIM_V1(half, name)
MSLSIM_F1(exp, std::exp(x)) MSLSIM_F1(exp2, std::exp2(x)) MSLSIM_F1(exp10, std::pow(10.0f, x))
MSLSIM_F1(log, std::log(x)) MSLSIM_F1(log2, std::log2(x)) MSLSIM_F1(log10, std::log10(x))
MSLSIM_F1(sqrt, std::sqrt(x)) MSLSIM_F1(rsqrt, 1.0f / std::sqrt(x)) MSLSIM_F1(cbrt, std::cbrt(x))
MSLSIM_F1(sin, std::sin(x)) MSLSIM_F1(cos, std::cos(x)) MSLSIM_F1(tan, std::tan(x))
MSLSIM_F1(asin, std::asin(x)) MSLSIM_F1(acos, std::acos(x)) MSLSIM_F1(atan, std::atan(x))
MSLSIM_F1(sinh, std::sinh(x)) MSLSIM_F1(cosh, std::cosh(x)) MSLSIM_F1(tanh, std::tanh(x))
MSLSIM_F1(asinh, std::asinh(x)) MSLSIM_F1(acosh, std::acosh(x)) MSLSIM_F1(atanh, std::atanh(x))
MSLSIM_F1(sinpi, std::sin(x * 3.14159265358979f)) MSLSIM_F1(cospi, std::cos(x * 3.14159265358979f))
MSLSIM_F1(floor, std::floor(x)) MSLSIM_F1(ceil, std::ceil(x)) MSLSIM_F1(round, std::round(x))
MSLSIM_F1(rint, std::nearbyint(x)) MSLSIM_F1(trunc, std::trunc(x)) MSLSIM_F1(fabs, std::fabs(x))
MSLSIM_F1(fract, std::fmin(x - std::floor(x), 0x1.fffffep-1f))
inline half abs(half x) { return half(std::fabs(float(x))); }
MSLSIM_V1(float, abs) MSLSIM_V1(half, abs)
MSLSIM_F1(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
MSLSIM_F1(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (std::isnan(x) ? 0.0f : x))))
#undef MSLSIM_F1

#define MSLSIM_V2(T, name)                                                                              \
  inline mslsim::vec<T, 2> name(mslsim::vec<T, 2> a, mslsim::vec<T, 2> b) {                                   \
    return mslsim::vec<T, 2>(name(a.e[0], b.e[0]), name(a.e[1], b.e[1]));                               \
  }                                                                                                  \
  inline mslsim::vec<T, 3> name(mslsim::vec<T, 3> a, mslsim::vec<T, 3> b) {                                   \
    return mslsim::vec<T, 3>(name(a.e[0], b.e[0]), name(a.e[1], b.e[1]), name(a.e[2], b.e[2]));         \
  }                                                                                                  \
  inline mslsim::vec<T, 4> name(mslsim::vec<T, 4> a, mslsim::vec<T, 4> b) {                                   \
    return mslsim::vec<T, 4>(name(a.e[0], b.e[0]), name(a.e[1], b.e[1]), name(a.e[2], b.e[2]), name(a.e[3], b.e[3])); \
  }
#define MSLSIM_F2(name, expr)                                                                           \
  inline float name(float x, float y) { return expr; }                                               \
  inline half name(half hx, half hy) { return half(name(float(hx), float(hy))); }                    \
  inline float name(double dx, double dy) { return name(float(dx), float(dy)); }                     \
  MSLSIM_V2(float, name) MSLSIM_V2(half, name)
MSLSIM_F2(pow, std::pow(x, y)) MSLSIM_F2(powr, std::pow(x, y)) MSLSIM_F2(fmod, std::fmod(x, y))
MSLSIM_F2(atan2, std::atan2(x, y)) MSLSIM_F2(copysign, std::copysign(x, y)) MSLSIM_F2(fdim, std::fdim(x, y))
MSLSIM_F2(fmin, std::fmin(x, y)) MSLSIM_F2(fmax, std::fmax(x, y)) MSLSIM_F2(step, (y < x ? 0.0f : 1.0f))
MSLSIM_F2(divide, x / y)
#undef MSLSIM_F2

#define MSLSIM_V3(T, name)                                                                              \
  inline mslsim::vec<T, 2> name(mslsim::vec<T, 2> a, mslsim::vec<T, 2> b, mslsim::vec<T, 2> c) {                 \
    return mslsim::vec<T, 2>(name(a.e[0], b.e[0], c.e[0]), name(a.e[1], b.e[1], c.e[1]));               \
  }                                                                                                  \
  inline mslsim::vec<T, 3> name(mslsim::vec<T, 3> a, mslsim::vec<T, 3> b, mslsim::vec<T, 3> c) {                 \
    return mslsim::vec<T, 3>(name(a.e[0], b.e[0], c.e[0]), name(a.e[1], b.e[1], c.e[1]), name(a.e[2], b.e[2], c.e[2])); \
  }                                                                                                  \
  inline mslsim::vec<T, 4> name(mslsim::vec<T, 4> a, mslsim::vec<T, 4> b, mslsim::vec<T, 4> c) {                 \
    return mslsim::vec<T, 4>(name(a.e[0], b.e[0], c.e[0]), name(a.e[1], b.e[1], c.e[1]), name(a.e[2], b.e[2], c.e[2]), \
                          name(a.e[3], b.e[3], c.e[3]));                                             \
  }
#define MSLSIM_F3(name, expr)                                                                           \
  inline float name(float x, float y, float z) { return expr; }                                      \
  inline half name(half hx, half hy, half hz) { return half(name(float(hx), float(hy), float(hz))); }\
  inline float name(double dx, double dy, double dz) { return name(float(dx), float(dy), float(dz)); } \
  MSLSIM_V3(float, name) MSLSIM_V3(half, name)
MSLSIM_F3(fma, std::fma(x, y, z)) MSLSIM_F3(mix, x + (y - x) * z)
MSLSIM_F3(smoothstep, ([&] { float t = std::fmin(std::fmax((z - x) / (y - x), 0.0f), 1.0f); return t * t * (3.0f - 2.0f * t); })())
#undef MSLSIM_F3

// min/max/clamp for float, half and all integer types (+ vectors)
#define MSLSIM_MINMAX(T)                                                                                \
  inline T min(T x, T y) { return y < x ? y : x; }                                                   \
  inline T max(T x, T y) { return x < y ? y : x; }                                                   \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }                                    \
  MSLSIM_V2(T, min) MSLSIM_V2(T, max) MSLSIM_V3(T, clamp)
MSLSIM_MINMAX(int) MSLSIM_MINMAX(uint) MSLSIM_MINMAX(short) MSLSIM_MINMAX(ushort) MSLSIM_MINMAX(char) MSLSIM_MINMAX(uchar)
MSLSIM_MINMAX(long) MSLSIM_MINMAX(ulong)
#undef MSLSIM_MINMAX
inline float min(float x, float y) { return std::fmin(x, y); }
inline float max(float x, float y) { return std::fmax(x, y); }
inline float clamp(float x, float lo, float hi) { return std::fmin(std::fmax(x, lo), hi); }
inline half min(half x, half y) { return half(std::fmin(float(x), float(y))); }
inline half max(half x, half y) { return half(std::fmax(float(x), float(y))); }
inline half clamp(half x, half lo, half hi) { return min(max(x, lo), hi); }
MSLSIM_V2(float, min) MSLSIM_V2(float, max) MSLSIM_V3(float, clamp) MSLSIM_V2(half, min) MSLSIM_V2(half, max) MSLSIM_V3(half, clamp)
#define MSLSIM_IABS(T, U)                                                                               \
  inline U abs(T x) { return U(x < 0 ? -x : x); }                                                    \
  inline U absdiff(T x, T y) { return U(x > y ? x - y : y - x); }
MSLSIM_IABS(short, ushort) MSLSIM_IABS(char, uchar)
inline uint abs(uint x) { return x; }
#undef MSLSIM_IABS
inline uint popcount(uint x) { return uint(__builtin_popcount(x)); }
inline uint clz(uint x) { return x ? uint(__builtin_clz(x)) : 32u; }
inline uint ctz(uint x) { return x ? uint(__builtin_ctz(x)) : 32u; }
inline int mulhi(int x, int y) { return int((int64_t(x) * int64_t(y)) >> 32); }
inline uint mulhi(uint x, uint y) { return uint((uint64_t(x) * uint64_t(y)) >> 32); }
#undef MSLSIM_V1
#undef MSLSIM_V2
#undef MSLSIM_V3

// scalar overloads constrained to scalars: otherwise isnan(float4) is ambiguous with the vector ones
#define MSLSIM_SPRED(name) \
  template <class T, std::enable_if_t<mslsim::is_scalar_v<T>, int> = 0> inline bool name(T x) { return std::name(float(x)); }
MSLSIM_SPRED(isnan) MSLSIM_SPRED(isinf) MSLSIM_SPRED(isfinite) MSLSIM_SPRED(signbit)
#undef MSLSIM_SPRED
#define MSLSIM_VPRED(name)                                                                              \
  template <class A, class V = typename mslsim::vtraits<A>::vec_t> inline mslsim::vec<bool, V::size> name(const A& a) { \
    V v = a; mslsim::vec<bool, V::size> r; for (int i = 0; i < V::size; ++i) r.e[i] = name(v.e[i]); return r;     \
  }
MSLSIM_VPRED(isnan) MSLSIM_VPRED(isinf) MSLSIM_VPRED(isfinite) MSLSIM_VPRED(signbit)
#undef MSLSIM_VPRED

// relational
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <class A, std::enable_if_t<mslsim::is_vecish_v<A>, int> = 0> inline bool all(const A& a) {
  typename mslsim::vtraits<A>::vec_t v = a; for (int i = 0; i < v.size; ++i) if (!v.e[i]) return false; return true;
}
template <class A, std::enable_if_t<mslsim::is_vecish_v<A>, int> = 0> inline bool any(const A& a) {
  typename mslsim::vtraits<A>::vec_t v = a; for (int i = 0; i < v.size; ++i) if (v.e[i]) return true; return false;
}
template <class T, std::enable_if_t<mslsim::is_scalar_v<T>, int> = 0> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class A, class B, class C, class R = mslsim::binop_t<A, B>> inline R select(const A& a, const B& b, const C& c) {
  R x = a, y = b, r;
  if constexpr (mslsim::is_scalar_v<C>) return c ? y : x;
  else {
    mslsim::vec<bool, R::size> m = c;
    for (int i = 0; i < R::size; ++i) r.e[i] = m.e[i] ? y.e[i] : x.e[i];
    return r;
  }
}

// geometric
template <class A, class B, class R = mslsim::binop_t<A, B>> inline typename R::value_type dot(const A& a, const B& b) {
  R x = a, y = b; typename R::value_type s = 0; for (int i = 0; i < R::size; ++i) s += x.e[i] * y.e[i]; return s;
}
template <class A, class R = typename mslsim::vtraits<A>::vec_t> inline typename R::value_type length_squared(const A& a) { return dot(R(a), R(a)); }
template <class A, class R = typename mslsim::vtraits<A>::vec_t> inline typename R::value_type length(const A& a) {
  return typename R::value_type(std::sqrt(float(dot(R(a), R(a)))));
}
template <class A, class R = typename mslsim::vtraits<A>::vec_t> inline R normalize(const A& a) { R v = a; return v / length(v); }
template <class A, class B, class R = mslsim::binop_t<A, B>> inline typename R::value_type distance(const A& a, const B& b) { return length(R(a) - R(b)); }
inline float3 cross(float3 a, float3 b) { return float3(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x); }
inline half3 cross(half3 a, half3 b) { return half3(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x); }

using ::as_type;

// fast:: / precise:: variants resolve to the same (accurate) implementations.
namespace fast { using namespace ::metal; }
namespace precise { using namespace ::metal; }

// matrices
template <class T, int C, int R> inline mslsim::mat<T, R, C> transpose(const mslsim::mat<T, C, R>& m) {
  mslsim::mat<T, R, C> t; for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) t.cols[r].e[c] = m.cols[c].e[r]; return t;
}

}  // namespace metal

#ifndef MAXFLOAT
#define MAXFLOAT 3.402823466e+38f
#endif
#define HUGE_VALH __builtin_inff16()
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif
#define M_PI_F 3.14159265358979323846264338327950288f
#define M_PI_H ((half)3.14159265358979323846264338327950288f)
#define M_E_F 2.71828182845904523536028747135266250f
#define M_LN2_F 0.693147180559945309417232121458176568f
#define M_LOG2E_F 1.44269504088896340735992468100189214f
#define M_SQRT2_F 1.41421356237309504880168872420969808f
#define M_SQRT1_2_F 0.707106781186547524400844362104849039f

#include "mslsim_simd.h"
