// Bulk exp for the softmax, loss and SwiGLU loops: scalar expf costs ~4 ns an element and
// dominates those ops, an 8-wide AVX/FMA polynomial is several times faster. Within a few ulp
// of expf; below exp(-103.97) it gives +0 and above exp(88.72) +inf, like expf; NaN stays NaN.
// Other targets use std::exp.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#define KRNL_VEXP 1
#endif

namespace krnl::cpu {

#if defined(KRNL_VEXP)
// Cephes expf: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for an exact product), a
// degree-5 polynomial for e^r - 1 - r, times 2^n built in the exponent bits.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.72283935546875f), lo = _mm256_set1_ps(-103.97207708f);
  const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));  // constant first: a NaN x passes through
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n for n in [-150, 128] as 2^h * 2^(n-h), h = n/2: both factors are normal floats, and
  // the last product rounds once into the subnormal range as expf does. AVX1 has no 256-bit
  // integer ops, hence the two 128-bit halves.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m128i bias = _mm_set1_epi32(127);
  const __m128i n0 = _mm256_castsi256_si128(ni), n1 = _mm256_extractf128_si256(ni, 1);
  const __m128i h0 = _mm_srai_epi32(n0, 1), h1 = _mm_srai_epi32(n1, 1);
  auto pow2 = [&](__m128i a, __m128i b) {
    a = _mm_slli_epi32(_mm_add_epi32(a, bias), 23);
    b = _mm_slli_epi32(_mm_add_epi32(b, bias), 23);
    return _mm256_castsi256_ps(_mm256_insertf128_si256(_mm256_castsi128_si256(a), b, 1));
  };
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, pow2(h0, h1)), pow2(_mm_sub_epi32(n0, h0), _mm_sub_epi32(n1, h1)));
  y = _mm256_andnot_ps(under, y);
  return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}
#endif

// x[i] = exp(x[i]) for i < n.
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(KRNL_VEXP)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {  // tail through a padded vector so every element gets the same function
    float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = i; j < n; ++j) t[j - i] = x[j];
    _mm256_storeu_ps(t, exp8(_mm256_loadu_ps(t)));
    for (int64_t j = i; j < n; ++j) x[j] = t[j - i];
  }
#else
  for (; i < n; ++i) x[i] = std::exp(x[i]);
#endif
}

// One pass over x[0..n), n >= 1: the maximum m and s = sum exp(x - m) (online rescaling, in
// 8 interleaved lanes combined in a fixed order).
inline void max_sumexp(const float* x, int64_t n, float& m_out, float& s_out) {
  float m[8] = {}, s[8] = {};
  int64_t lanes = n < 8 ? n : 8, i = lanes;
  for (int64_t l = 0; l < lanes; ++l) m[l] = x[l], s[l] = 1.f;
#if defined(KRNL_VEXP)
  if (lanes == 8) {
    __m256 vm = _mm256_loadu_ps(m), vs = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i), nm = _mm256_max_ps(vm, v);
      vs = _mm256_fmadd_ps(vs, exp8(_mm256_sub_ps(vm, nm)), exp8(_mm256_sub_ps(v, nm)));
      vm = nm;
    }
    _mm256_storeu_ps(m, vm);
    _mm256_storeu_ps(s, vs);
  }
#endif
  for (; i < n; ++i) {
    const int l = int(i & 7);
    if (x[i] > m[l]) {
      s[l] = s[l] * std::exp(m[l] - x[i]) + 1.f;
      m[l] = x[i];
    } else {
      s[l] += std::exp(x[i] - m[l]);
    }
  }
  float mx = m[0];
  for (int64_t l = 1; l < lanes; ++l) mx = mx > m[l] ? mx : m[l];
  float sum = 0.f;
  for (int64_t l = 0; l < lanes; ++l) sum += s[l] * std::exp(m[l] - mx);
  m_out = mx;
  s_out = sum;
}

}  // namespace krnl::cpu
