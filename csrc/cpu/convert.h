// Load/store layer of the CPU ops: every op computes in float on a row or a block and converts
// at the edges with these, so each op is written once for f32, f16 and bf16. f32 data is used in
// place (no copy); f16 uses F16C where the compiler targets it, with results bit-identical to the
// scalar round-to-nearest-even conversions of dtype.h.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "core/dtype.h"
#include "core/thread_pool.h"

namespace krnl::cpu {

// ---- bulk conversions per storage type

template <DType D>
struct Elem;

template <>
struct Elem<DType::f32> {  // memmove: callers may pass the same buffer (e.g. working == params)
  static void load(const void* src, float* dst, int64_t n) { std::memmove(dst, src, size_t(n) * 4); }
  static void store(const float* src, void* dst, int64_t n) { std::memmove(dst, src, size_t(n) * 4); }
};

template <>
struct Elem<DType::bf16> {
  static void load(const void* src, float* dst, int64_t n) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  }
  static void store(const float* src, void* dst, int64_t n) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  }
};

template <>
struct Elem<DType::f16> {
  static void load(const void* src, float* dst, int64_t n) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int64_t i = 0;
#if defined(__F16C__)
    const __m128i mag = _mm_set1_epi16(0x7fff), inf = _mm_set1_epi16(0x7c00);
    for (; i + 8 <= n; i += 8) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      // The hardware quiets signalling NaNs, the scalar path keeps them: NaN groups go scalar.
      if (_mm_movemask_epi8(_mm_cmpgt_epi16(_mm_and_si128(h, mag), inf))) {
        for (int64_t j = i; j < i + 8; ++j) dst[j] = f16_to_f32(s[j]);
        continue;
      }
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  }
  static void store(const float* src, void* dst, int64_t n) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
      __m256 v = _mm256_loadu_ps(src + i);
      // The hardware keeps NaN payload bits, the scalar path writes the canonical quiet NaN.
      if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
        for (int64_t j = i; j < i + 8; ++j) d[j] = f32_to_f16(src[j]);
        continue;
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < n; ++i) d[i] = f32_to_f16(src[i]);
  }
};

// ---- runtime-dtype wrappers; base + off addresses element `off` of a tensor of dtype dt

inline const char* at(DType dt, const void* base, int64_t off) {
  return static_cast<const char*>(base) + size_t(off) * dtype_size(dt);
}
inline char* at(DType dt, void* base, int64_t off) { return static_cast<char*>(base) + size_t(off) * dtype_size(dt); }

inline void load(DType dt, const void* base, int64_t off, int64_t n, float* dst) {
  const char* p = at(dt, base, off);
  switch (dt) {
    case DType::f16: Elem<DType::f16>::load(p, dst, n); break;
    case DType::bf16: Elem<DType::bf16>::load(p, dst, n); break;
    default: Elem<DType::f32>::load(p, dst, n); break;
  }
}

inline void store(DType dt, const float* src, int64_t n, void* base, int64_t off) {
  char* p = at(dt, base, off);
  switch (dt) {
    case DType::f16: Elem<DType::f16>::store(src, p, n); break;
    case DType::bf16: Elem<DType::bf16>::store(src, p, n); break;
    default: Elem<DType::f32>::store(src, p, n); break;
  }
}

// Read-only window: f32 in place, other dtypes converted into scratch (n floats).
inline const float* view(DType dt, const void* base, int64_t off, int64_t n, float* scratch) {
  if (dt == DType::f32) return reinterpret_cast<const float*>(at(dt, base, off));
  load(dt, base, off, n, scratch);
  return scratch;
}

// Write window: f32 in place, other dtypes computed into scratch and written back by flush().
inline float* out_window(DType dt, void* base, int64_t off, float* scratch) {
  return dt == DType::f32 ? reinterpret_cast<float*>(at(dt, base, off)) : scratch;
}
// Read-modify-write window: like out_window, but holding the current values.
inline float* inout(DType dt, void* base, int64_t off, int64_t n, float* scratch) {
  if (dt == DType::f32) return reinterpret_cast<float*>(at(dt, base, off));
  load(dt, base, off, n, scratch);
  return scratch;
}
inline void flush(DType dt, const float* win, int64_t n, void* base, int64_t off) {
  if (dt != DType::f32) store(dt, win, n, base, off);
}

// Per-thread scratch rows, grown on demand and kept: ops run back to back on the same threads.
// A slot is owned by one call frame at a time; kernels use distinct slots for distinct rows.
inline float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> bufs[6];
  std::vector<float>& b = bufs[slot];
  if (int64_t(b.size()) < n) b.resize(size_t(n));
  return b.data();
}

// ---- loops over the global pool (never nested: the pool runs one parallel_for at a time)

constexpr int64_t kBlock = 1024;          // elements per conversion block (fits L1 with 4 operands)
constexpr int64_t kGrainElems = 1 << 15;  // below this many elements a loop stays on the caller

// fn(begin, end) over [0, n) in blocks of at most kBlock elements.
template <class F>
void for_blocks(int64_t n, F&& fn) {
  ThreadPool::global().parallel_for(n, kGrainElems, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; i += kBlock) fn(i, std::min(e, i + kBlock));
  });
}

// fn(begin_row, end_row) over rows of `cols` elements each.
template <class F>
void for_rows(int64_t rows, int64_t cols, F&& fn) {
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, cols));
  ThreadPool::global().parallel_for(rows, grain, [&](int64_t b, int64_t e) { fn(b, e); });
}

// Splits [0, n) into `parts` fixed ranges and calls fn(part, begin, end) for each, in parallel.
// Per-part partial results reduced in part order are deterministic whatever the thread count.
template <class F>
void for_parts(int64_t n, int64_t parts, F&& fn) {
  ThreadPool::global().parallel_for(parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) fn(p, n * p / parts, n * (p + 1) / parts);
  });
}

// Part count for a deterministic reduction over n items of `cost` elements each: one part per
// kGrainElems elements, at most 64 (enough for any CPU we target; fixed so results do not move
// with KRNL_NUM_THREADS).
inline int64_t num_parts(int64_t n, int64_t cost = 1) {
  const int64_t work = n * std::max<int64_t>(1, cost);
  return std::max<int64_t>(1, std::min<int64_t>({64, n, work / kGrainElems}));
}

// Parallel whole-range conversions (gemm operands).
inline void load_all(DType dt, const void* base, int64_t off, int64_t n, float* dst) {
  for_blocks(n, [&](int64_t b, int64_t e) { load(dt, base, off + b, e - b, dst + b); });
}
inline void store_all(DType dt, const float* src, int64_t n, void* base, int64_t off) {
  for_blocks(n, [&](int64_t b, int64_t e) { store(dt, src + b, e - b, base, off + b); });
}

// Lane-parallel float dot product: fixed order (so deterministic) and vectorisable.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) acc[i & 7] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// Lane-parallel float sum, fixed order like dot().
inline float sum(const float* a, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l];
  for (; i < n; ++i) acc[i & 7] += a[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

}  // namespace krnl::cpu
