// mslsim_simd.h -- barriers, SIMD-group functions, simdgroup_matrix, atomics (part of mslsim.h)
#pragma once

namespace mslsim {
template <class T, class = void> struct decay_vec { using type = T; };
template <class T> struct decay_vec<T, std::enable_if_t<is_vecish_v<T>>> { using type = typename vtraits<T>::vec_t; };
template <class T> using decay_vec_t = typename decay_vec<std::remove_cv_t<std::remove_reference_t<T>>>::type;

namespace rt {
// Deposit this lane's value, wait until every live lane of the SIMD-group has done the same, return
// the slot buffer (double-buffered by the parity of the collective's sequence number).
template <class V> inline int simd_exchange(const V& v, const char* what, int kind, const char* file, int line) {
  static_assert(sizeof(V) <= SLOT_BYTES, "SIMD-group function on a type larger than 64 bytes");
  Lane* L = cur_lane;
  SimdState& s = L->g->simd[L->simd_group];
  const int b = int(L->simd_seq & 1);
  std::memcpy(s.slot[b][L->simd_lane], &v, sizeof(V));
  block(L, WAIT_SIMD, kind, what, file, line);
  cur_lane->simd_seq++;
  return b;
}
template <class V> inline V simd_slot(int b, uint32_t lane) {
  V r;
  std::memcpy((void*)&r, cur_lane->g->simd[cur_lane->simd_group].slot[b][lane], sizeof(V));
  return r;
}
inline const SimdState& simd_state() { return cur_lane->g->simd[cur_lane->simd_group]; }
inline bool lane_active(uint32_t lane) {
  const SimdState& s = simd_state();
  return lane < s.nlanes && (s.active >> lane & 1u);
}
// Apple's distribution of an 8x8 simdgroup_matrix over the 32 lanes: lane holds (row, col..col+1).
inline void sg_coord(uint32_t lane, int& row, int& col) {
  const int qid = int(lane >> 2);
  row = (qid & 4) + int((lane >> 1) & 3);
  col = ((qid & 2) << 1) + int((lane & 1) << 1);
}
}  // namespace rt
}  // namespace mslsim

namespace metal {

#define MSLSIM_SITE const char *_mslsim_file = __builtin_FILE(), int _mslsim_line = __builtin_LINE()
#define MSLSIM_AT _mslsim_file, _mslsim_line

enum class mem_flags : int {
  mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8, mem_object_data = 16
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags(int(a) & int(b)); }

inline void threadgroup_barrier(mem_flags = mem_flags::mem_none, MSLSIM_SITE) {
  mslsim::rt::block(mslsim::rt::cur_lane, mslsim::rt::WAIT_TG, mslsim::rt::K_TG_BARRIER, "threadgroup_barrier", MSLSIM_AT);
}
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none, MSLSIM_SITE) {
  mslsim::rt::block(mslsim::rt::cur_lane, mslsim::rt::WAIT_SIMD, mslsim::rt::K_SIMD_BARRIER, "simdgroup_barrier", MSLSIM_AT);
  mslsim::rt::cur_lane->simd_seq++;
}

// ---- SIMD-group reductions / scans / shuffles ---------------------------------------------------
namespace detail {
template <class V, class Op> inline V reduce(const V& v, Op op, uint32_t lo, uint32_t hi, const char* what, const char* f, int l) {
  const int b = mslsim::rt::simd_exchange(v, what, mslsim::rt::K_SIMD_COLLECTIVE, f, l);
  bool have = false; V acc = v;
  for (uint32_t i = lo; i < hi; ++i)
    if (mslsim::rt::lane_active(i)) { V x = mslsim::rt::simd_slot<V>(b, i); acc = have ? V(op(acc, x)) : x; have = true; }
  return acc;
}
template <class V, class Op> inline V scan(const V& v, Op op, bool inclusive, V identity, const char* what, const char* f, int l) {
  const int b = mslsim::rt::simd_exchange(v, what, mslsim::rt::K_SIMD_COLLECTIVE, f, l);
  const uint32_t me = mslsim::rt::cur_lane->simd_lane;
  V acc = identity;
  for (uint32_t i = 0; i < me; ++i) if (mslsim::rt::lane_active(i)) acc = V(op(acc, mslsim::rt::simd_slot<V>(b, i)));
  return inclusive ? V(op(acc, v)) : acc;
}
template <class V> inline V fetch(const V& v, int64_t src, const char* what, const char* f, int l) {
  const int b = mslsim::rt::simd_exchange(v, what, mslsim::rt::K_SIMD_COLLECTIVE, f, l);
  if (src < 0 || !mslsim::rt::lane_active(uint32_t(src))) return v;  // undefined on the GPU
  return mslsim::rt::simd_slot<V>(b, uint32_t(src));
}
struct add { template <class A> A operator()(const A& a, const A& b) const { return a + b; } };
struct mul { template <class A> A operator()(const A& a, const A& b) const { return a * b; } };
struct mn { template <class A> A operator()(const A& a, const A& b) const { return min(a, b); } };
struct mx { template <class A> A operator()(const A& a, const A& b) const { return max(a, b); } };
struct band { template <class A> A operator()(const A& a, const A& b) const { return a & b; } };
struct bor { template <class A> A operator()(const A& a, const A& b) const { return a | b; } };
struct bxor { template <class A> A operator()(const A& a, const A& b) const { return a ^ b; } };
inline uint32_t me() { return mslsim::rt::cur_lane->simd_lane; }
}  // namespace detail

#define MSLSIM_SIMD_REDUCE(name, op, quadname)                                                             \
  template <class T, class V = mslsim::decay_vec_t<T>> inline V name(const T& x, MSLSIM_SITE) {               \
    return detail::reduce(V(x), detail::op{}, 0, 32, #name, MSLSIM_AT);                                     \
  }                                                                                                     \
  template <class T, class V = mslsim::decay_vec_t<T>> inline V quadname(const T& x, MSLSIM_SITE) {           \
    const uint32_t q = detail::me() & ~3u;                                                              \
    return detail::reduce(V(x), detail::op{}, q, q + 4, #quadname, MSLSIM_AT);                              \
  }
MSLSIM_SIMD_REDUCE(simd_sum, add, quad_sum) MSLSIM_SIMD_REDUCE(simd_product, mul, quad_product)
MSLSIM_SIMD_REDUCE(simd_min, mn, quad_min) MSLSIM_SIMD_REDUCE(simd_max, mx, quad_max)
MSLSIM_SIMD_REDUCE(simd_and, band, quad_and) MSLSIM_SIMD_REDUCE(simd_or, bor, quad_or) MSLSIM_SIMD_REDUCE(simd_xor, bxor, quad_xor)
#undef MSLSIM_SIMD_REDUCE

template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_prefix_inclusive_sum(const T& x, MSLSIM_SITE) {
  return detail::scan(V(x), detail::add{}, true, V(0), "simd_prefix_inclusive_sum", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_prefix_exclusive_sum(const T& x, MSLSIM_SITE) {
  return detail::scan(V(x), detail::add{}, false, V(0), "simd_prefix_exclusive_sum", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_prefix_inclusive_product(const T& x, MSLSIM_SITE) {
  return detail::scan(V(x), detail::mul{}, true, V(1), "simd_prefix_inclusive_product", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_prefix_exclusive_product(const T& x, MSLSIM_SITE) {
  return detail::scan(V(x), detail::mul{}, false, V(1), "simd_prefix_exclusive_product", MSLSIM_AT);
}

template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_shuffle(const T& x, ushort lane, MSLSIM_SITE) {
  return detail::fetch(V(x), lane, "simd_shuffle", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_broadcast(const T& x, ushort lane, MSLSIM_SITE) {
  return detail::fetch(V(x), lane, "simd_broadcast", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_shuffle_xor(const T& x, ushort mask, MSLSIM_SITE) {
  return detail::fetch(V(x), int64_t(detail::me() ^ mask), "simd_shuffle_xor", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_shuffle_down(const T& x, ushort delta, MSLSIM_SITE) {
  const uint32_t s = detail::me() + delta;  // lanes past the end keep their own value
  return detail::fetch(V(x), s < mslsim::rt::simd_state().nlanes ? int64_t(s) : int64_t(-1), "simd_shuffle_down", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_shuffle_up(const T& x, ushort delta, MSLSIM_SITE) {
  const int64_t s = int64_t(detail::me()) - delta;
  return detail::fetch(V(x), s, "simd_shuffle_up", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_shuffle_rotate_down(const T& x, ushort delta, MSLSIM_SITE) {
  const uint32_t n = mslsim::rt::simd_state().nlanes;
  return detail::fetch(V(x), int64_t((detail::me() + delta) % n), "simd_shuffle_rotate_down", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_shuffle_rotate_up(const T& x, ushort delta, MSLSIM_SITE) {
  const uint32_t n = mslsim::rt::simd_state().nlanes;
  return detail::fetch(V(x), int64_t((detail::me() + n - delta % n) % n), "simd_shuffle_rotate_up", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V simd_broadcast_first(const T& x, MSLSIM_SITE) {
  const int b = mslsim::rt::simd_exchange(V(x), "simd_broadcast_first", mslsim::rt::K_SIMD_COLLECTIVE, MSLSIM_AT);
  for (uint32_t i = 0; i < 32; ++i) if (mslsim::rt::lane_active(i)) return mslsim::rt::simd_slot<V>(b, i);
  return V(x);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V quad_shuffle(const T& x, ushort lane, MSLSIM_SITE) {
  return detail::fetch(V(x), int64_t((detail::me() & ~3u) + (lane & 3u)), "quad_shuffle", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V quad_broadcast(const T& x, ushort lane, MSLSIM_SITE) {
  return detail::fetch(V(x), int64_t((detail::me() & ~3u) + (lane & 3u)), "quad_broadcast", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V quad_shuffle_xor(const T& x, ushort mask, MSLSIM_SITE) {
  return detail::fetch(V(x), int64_t(detail::me() ^ (mask & 3u)), "quad_shuffle_xor", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V quad_shuffle_down(const T& x, ushort delta, MSLSIM_SITE) {
  const uint32_t s = (detail::me() & 3u) + delta;
  return detail::fetch(V(x), s < 4 ? int64_t((detail::me() & ~3u) + s) : -1, "quad_shuffle_down", MSLSIM_AT);
}
template <class T, class V = mslsim::decay_vec_t<T>> inline V quad_shuffle_up(const T& x, ushort delta, MSLSIM_SITE) {
  const int64_t s = int64_t(detail::me() & 3u) - delta;
  return detail::fetch(V(x), s >= 0 ? int64_t(detail::me() & ~3u) + s : -1, "quad_shuffle_up", MSLSIM_AT);
}

struct simd_vote {
  typedef uint64_t vote_t;
  vote_t v = 0;
  constexpr simd_vote() = default;
  explicit constexpr simd_vote(vote_t x) : v(x) {}
  explicit constexpr operator vote_t() const { return v; }
  bool all() const { return v == mslsim::rt::simd_state().active; }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool pred, MSLSIM_SITE) {
  const int b = mslsim::rt::simd_exchange(pred, "simd_ballot", mslsim::rt::K_SIMD_COLLECTIVE, MSLSIM_AT);
  uint64_t m = 0;
  for (uint32_t i = 0; i < 32; ++i) if (mslsim::rt::lane_active(i) && mslsim::rt::simd_slot<bool>(b, i)) m |= 1ull << i;
  return simd_vote(m);
}
inline simd_vote simd_active_threads_mask(MSLSIM_SITE) { return simd_ballot(true, MSLSIM_AT); }
inline bool simd_all(bool pred, MSLSIM_SITE) { return uint64_t(simd_ballot(pred, MSLSIM_AT)) == mslsim::rt::simd_state().active; }
inline bool simd_any(bool pred, MSLSIM_SITE) { return uint64_t(simd_ballot(pred, MSLSIM_AT)) != 0; }
inline bool simd_is_first(MSLSIM_SITE) {
  const uint64_t m = uint64_t(simd_ballot(true, MSLSIM_AT));
  return m && uint32_t(__builtin_ctzll(m)) == detail::me();
}

// ---- simdgroup_matrix -------------------------------------------------------------------------
// Every lane holds a full copy of the 8x8 matrix, so load/multiply need no communication.  Stores
// write only the two elements that the lane owns on Apple GPUs; values written through
// thread_elements() are gathered from all lanes (a SIMD-group exchange) before the next use.
template <class T, int Cols, int Rows> struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "only 8x8 simdgroup matrices exist");
  alignas(16) T e[Rows][Cols];
  bool dist = false;  // thread_elements() was written: lanes' copies differ until gathered
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T d) {
    for (int r = 0; r < Rows; ++r) for (int c = 0; c < Cols; ++c) e[r][c] = r == c ? d : T(0);
  }
  mslsim::vec<T, 2>& thread_elements() {
    int r, c; mslsim::rt::sg_coord(mslsim::rt::cur_lane->simd_lane, r, c);
    dist = true;
    return *reinterpret_cast<mslsim::vec<T, 2>*>(&e[r][c]);
  }
  const mslsim::vec<T, 2>& thread_elements() const {
    int r, c; mslsim::rt::sg_coord(mslsim::rt::cur_lane->simd_lane, r, c);
    return *reinterpret_cast<const mslsim::vec<T, 2>*>(&e[r][c]);
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

namespace detail {
template <class T> inline void sg_gather(const simdgroup_matrix<T, 8, 8>& cm) {
  auto& m = const_cast<simdgroup_matrix<T, 8, 8>&>(cm);
  if (!m.dist) return;
  int r, c; mslsim::rt::sg_coord(me(), r, c);
  mslsim::vec<T, 2> mine(m.e[r][c], m.e[r][c + 1]);
  const int b = mslsim::rt::simd_exchange(mine, "simdgroup_matrix thread_elements() gather", mslsim::rt::K_SIMD_GATHER,
                                       __FILE__, __LINE__);
  for (uint32_t i = 0; i < 32; ++i) {
    if (!mslsim::rt::lane_active(i)) continue;
    mslsim::vec<T, 2> p = mslsim::rt::simd_slot<mslsim::vec<T, 2>>(b, i);
    mslsim::rt::sg_coord(i, r, c);
    m.e[r][c] = p.e[0]; m.e[r][c + 1] = p.e[1];
  }
  m.dist = false;
}
}  // namespace detail

template <class T, int Cols, int Rows = Cols>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  for (int r = 0; r < Rows; ++r) for (int c = 0; c < Cols; ++c) m.e[r][c] = value;
  return m;
}

// matrix_origin = (column, row) of the block's first element in the source; transposed loads read
// the block at that origin and transpose it.
template <class T, int C, int R>
inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const std::type_identity_t<T>* src, ulong elements_per_row = C,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  const T* base = src + matrix_origin.y * elements_per_row + matrix_origin.x;
  if (!transpose_matrix) {
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) d.e[r][c] = base[r * elements_per_row + c];
  } else {
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) d.e[r][c] = base[c * elements_per_row + r];
  }
  d.dist = false;
}
template <class T, int C, int R>
inline void simdgroup_store(const simdgroup_matrix<T, C, R>& a, std::type_identity_t<T>* dst, ulong elements_per_row = C,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  detail::sg_gather(a);
  T* base = dst + matrix_origin.y * elements_per_row + matrix_origin.x;
  int r, c; mslsim::rt::sg_coord(detail::me(), r, c);
  for (int j = c; j < c + 2; ++j) {
    if (!transpose_matrix) base[r * elements_per_row + j] = a.e[r][j];
    else base[j * elements_per_row + r] = a.e[r][j];
  }
}
template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c) {
  detail::sg_gather(a); detail::sg_gather(b); detail::sg_gather(c);
  // rows as 8-float GNU vectors: 64 broadcast-FMAs per 8x8x8 product (every lane does all of it)
  typedef float v8f __attribute__((vector_size(32)));
  v8f B[8], acc[8];
  for (int k = 0; k < 8; ++k)
    for (int j = 0; j < 8; ++j) { B[k][j] = float(b.e[k][j]); acc[k][j] = float(c.e[k][j]); }
  for (int r = 0; r < 8; ++r)
    for (int k = 0; k < 8; ++k) acc[r] += float(a.e[r][k]) * B[k];
  for (int r = 0; r < 8; ++r) for (int j = 0; j < 8; ++j) d.e[r][j] = TD(acc[r][j]);
  d.dist = false;
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a, const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)));
}

// ---- atomics -----------------------------------------------------------------------------------
enum memory_order { memory_order_relaxed = __ATOMIC_RELAXED, memory_order_acquire = __ATOMIC_ACQUIRE,
                    memory_order_release = __ATOMIC_RELEASE, memory_order_acq_rel = __ATOMIC_ACQ_REL,
                    memory_order_seq_cst = __ATOMIC_SEQ_CST };
template <class T> struct atomic { T __v; };
typedef atomic<int> atomic_int; typedef atomic<uint> atomic_uint; typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float; typedef atomic<ulong> atomic_ulong; typedef atomic<long> atomic_long;

template <class T> inline void atomic_store_explicit(volatile atomic<T>* o, T v, memory_order = memory_order_relaxed) { __atomic_store_n(&o->__v, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomic_load_explicit(const volatile atomic<T>* o, memory_order = memory_order_relaxed) { return __atomic_load_n(&o->__v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomic_exchange_explicit(volatile atomic<T>* o, T v, memory_order = memory_order_relaxed) { return __atomic_exchange_n(&o->__v, v, __ATOMIC_SEQ_CST); }
template <class T> inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, T* expected, T desired, memory_order = memory_order_relaxed, memory_order = memory_order_relaxed) {
  return __atomic_compare_exchange_n(&o->__v, expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
template <class T> inline bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* o, T* expected, T desired, memory_order = memory_order_relaxed, memory_order = memory_order_relaxed) {
  return __atomic_compare_exchange_n(&o->__v, expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
template <class T, class Op> inline T atomic_rmw_cas(volatile atomic<T>* o, Op op) {
  T old = __atomic_load_n(&o->__v, __ATOMIC_SEQ_CST);
  while (!__atomic_compare_exchange_n(&o->__v, &old, op(old), false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
  return old;
}
#define MSLSIM_ATOMIC_RMW(name, builtin, expr)                                                              \
  template <class T, class U> inline T atomic_fetch_##name##_explicit(volatile atomic<T>* o, U uv, memory_order = memory_order_relaxed) { \
    const T v = T(uv);                                                                                    \
    if constexpr (std::is_integral_v<T>) return builtin(&o->__v, v, __ATOMIC_SEQ_CST);                    \
    else return atomic_rmw_cas(o, [&](T old) { return T(expr); });                                       \
  }
MSLSIM_ATOMIC_RMW(add, __atomic_fetch_add, old + v) MSLSIM_ATOMIC_RMW(sub, __atomic_fetch_sub, old - v)
MSLSIM_ATOMIC_RMW(and, __atomic_fetch_and, old) MSLSIM_ATOMIC_RMW(or, __atomic_fetch_or, old) MSLSIM_ATOMIC_RMW(xor, __atomic_fetch_xor, old)
#undef MSLSIM_ATOMIC_RMW
template <class T, class U> inline T atomic_fetch_min_explicit(volatile atomic<T>* o, U v, memory_order = memory_order_relaxed) {
  return atomic_rmw_cas(o, [&](T old) { return T(v) < old ? T(v) : old; });
}
template <class T, class U> inline T atomic_fetch_max_explicit(volatile atomic<T>* o, U v, memory_order = memory_order_relaxed) {
  return atomic_rmw_cas(o, [&](T old) { return old < T(v) ? T(v) : old; });
}

}  // namespace metal
