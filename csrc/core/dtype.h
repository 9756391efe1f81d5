// Element types and the scalar conversions every backend shares.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace krnl {

enum class DType : uint8_t { f32 = 0, f16 = 1, bf16 = 2, i32 = 3 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::i32: return 4;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
  }
  return "?";
}

DType dtype_from_name(const std::string& name);  // accepts f32/float32, f16/float16, bf16/bfloat16, i32/int32

inline bool is_float(DType t) { return t != DType::i32; }

// Bit-exact IEEE conversions with round-to-nearest-even, written out so that the CPU backend,
// the simulator and the tests agree on every platform (no reliance on _Float16 support).
inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    // subnormal: value = man * 2^-24
    float v = float(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);       // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);      // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                      // below 2^-14: subnormal or zero
    // Add 0.5 (as a float) so the hardware's own round-to-nearest-even lands on the
    // subnormal half grid, then read the low mantissa bits.
    float r = bits_f32(a) + 0.5f;
    return uint16_t(sign | uint16_t(f32_bits(r) - 0x3f000000u));
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return uint16_t(sign | uint16_t(a >> 13));
}

}  // namespace krnl
