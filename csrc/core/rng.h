// Counter-based random numbers shared by every backend: a dropout mask bit is a pure function of
// (seed, flat element index), so forward and backward (and CPU and GPU) agree without storing it.
// Portable on purpose: no platform headers, usable from CUDA device code.
#pragma once
#ifndef __METAL_VERSION__
#include <cstdint>
#endif

#if defined(__CUDACC__)
#define KRNL_HD __host__ __device__
#else
#define KRNL_HD
#endif

namespace krnl {

// splitmix64 finaliser: a full-avalanche bijection of 64 bits.
KRNL_HD inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The mask seed of a call whose per-step part comes from a device tensor (dropout's seed_offset,
// a uint64 as two i32 words): seed + offset wrapping mod 2^64, then the top bit cleared, as the
// host forms its seeds, so both ways of passing one seed give the same mask.
KRNL_HD inline uint64_t dropout_seed(uint64_t seed, uint32_t offset_lo, uint32_t offset_hi) {
  return (seed + (uint64_t(offset_lo) | (uint64_t(offset_hi) << 32))) & 0x7FFFFFFFFFFFFFFFull;
}

// The index of element 0 of a call whose x is rows first_row.. of a larger batch with rows of
// `width` elements (dropout's seed_offset (3,)): a data-parallel rank's slice then draws the
// mask that the whole batch's call draws for those rows.
KRNL_HD inline uint64_t dropout_base(uint32_t first_row, uint64_t width) { return uint64_t(first_row) * width; }

// 32 uniform bits for element `index` of the stream `seed`.
KRNL_HD inline uint32_t dropout_hash(uint64_t seed, uint64_t index) {
  return uint32_t(splitmix64(seed ^ (index * 0x9E3779B97F4A7C15ull)) >> 32);
}

// Drop threshold for probability p in [0, 1): p * 2^32 is exact in float (power-of-two scale),
// and truncating it needs no double, which Metal lacks.
KRNL_HD inline uint64_t dropout_threshold(float p) { return uint64_t(p * 4294967296.0f); }

// An element is kept iff its hash is at or above the threshold: P(keep) = 1 - p.
KRNL_HD inline bool dropout_keep(uint64_t seed, uint64_t index, float p) {
  return uint64_t(dropout_hash(seed, index)) >= dropout_threshold(p);
}

}  // namespace krnl
