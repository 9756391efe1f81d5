#include "metal/policy.h"

#include <algorithm>

#include "metal/dispatch.h"

namespace krnl::metal {

bool gpu_usable(const GpuDescription& g, std::string* why) {
  if (g.apple_family >= 7) return true;
  if (why)
    *why = (g.name.empty() ? std::string("the GPU") : g.name) +
           " lacks the Apple7 GPU family (simdgroup matrices: an Apple M1 or later)";
  return false;
}

bool native_bf16(const GpuDescription& g) { return g.apple_family >= 9; }

std::vector<DType> compute_dtypes(const GpuDescription& g, bool bf16_kernels) {
  std::vector<DType> v{DType::f32, DType::f16};
  if (bf16_kernels && native_bf16(g)) v.push_back(DType::bf16);
  return v;
}

DType default_compute_dtype(const GpuDescription& g, bool bf16_kernels) {
  return bf16_kernels && native_bf16(g) ? DType::bf16 : DType::f16;
}

namespace {
std::string msl_name(uint32_t v) { return std::to_string(v / 100) + "." + std::to_string(v % 100); }

// The oldest macOS that compiles MSL v (3.0 came with macOS 13, 3.1 with 14, 3.2 with 15, 4.0 with
// 26), never below 14: the deployment target (pyproject.toml), so no older macOS runs krnl at all.
uint32_t macos_for(uint32_t v) { return std::max<uint32_t>(14, v >= 400 ? 26 : 13 + (v > 300 ? v - 300 : 0)); }
}  // namespace

DeviceChoice choose_device(const std::vector<GpuDescription>& candidates, uint32_t os_msl, uint32_t needed_msl) {
  DeviceChoice c;
  if (os_msl < needed_msl) {
    c.reason = "this macOS compiles Metal Shading Language " + (os_msl ? msl_name(os_msl) : std::string("below 3.0")) +
               ", the kernels need " + msl_name(needed_msl) + " (macOS " +
               std::to_string(macos_for(needed_msl)) + " or later)";
    return c;
  }
  if (candidates.empty()) {
    c.reason = "no Metal device (MTLCreateSystemDefaultDevice and MTLCopyAllDevices found none)";
    return c;
  }
  std::string why_not;
  for (size_t i = 0; i < candidates.size(); ++i) {
    std::string why;
    if (gpu_usable(candidates[i], &why)) {
      c.index = int(i);
      return c;
    }
    why_not += (why_not.empty() ? "" : "; ") + why;
  }
  c.reason = "no usable GPU: " + why_not;
  return c;
}

const char* rate_class_name(RateClass r) {
  switch (r) {
    case RateClass::memory: return "memory";
    case RateClass::gemm: return "gemm";
    case RateClass::attention: return "attention";
    case RateClass::quantized_tiled: return "quantized_tiled";
    case RateClass::quantized_rows: return "quantized_rows";
  }
  return "?";
}

double CommandBufferPolicy::gflops(RateClass r) const {
  switch (r) {
    case RateClass::memory: return 0;
    case RateClass::gemm: return peak_gflops * gemm_share;
    case RateClass::attention: return peak_gflops * attention_share;
    case RateClass::quantized_tiled: return peak_gflops * quantized_tiled_share;
    case RateClass::quantized_rows: return peak_gflops * quantized_rows_share;
  }
  return 0;
}

CommandBufferPolicy command_buffer_policy(const GpuDescription& g) {
  // The smallest Mac GPU of each family: an M1 with 7 cores (7 x 128 ALUs x 2 flops x 1.278 GHz,
  // 68 GB/s), an M2 or M3 with 8 (~2.8 TFLOP/s, 100 GB/s); bandwidth rounded down.
  CommandBufferPolicy p;
  if (g.apple_family >= 8) {
    p.peak_gflops = 2800;
    p.gbps = 90;
  }
  return p;
}

double estimate_ms(double flops, double bytes, RateClass r, const CommandBufferPolicy& p) {
  const double rate = p.gflops(r);
  return (rate > 0 ? flops / (rate * 1e6) : 0.0) + bytes / (p.gbps * 1e6);
}

double estimate_ms(const Dispatch& d, const CommandBufferPolicy& p) {
  double bytes = d.bytes;
  if (bytes <= 0)
    for (const BufferBinding& b : d.buffers) bytes += double(b.extent);
  return estimate_ms(d.flops, bytes, d.rate, p);
}

namespace {
// The largest k in [lo, hi] with fits(k), for a fits that holds at lo and, once false, stays
// false (the estimates are monotone): a binary search.
int64_t most_that_fit(int64_t lo, int64_t hi, const std::function<bool(int64_t)>& fits) {
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (fits(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}
// The largest multiple of `tile` in [tile, n] (n itself when n <= tile, or when all of n fits)
// whose estimate fits; one tile when none does.
int64_t largest_fit(int64_t n, int64_t tile, double budget, const std::function<double(int64_t)>& ms) {
  if (ms(n) <= budget || n <= tile) return n;
  if (ms(tile) > budget) return tile;
  return tile * most_that_fit(1, (n - 1) / tile, [&](int64_t k) { return ms(k * tile) <= budget; });
}
// Blocks of at most `size` over n, evened out: the same count, each a multiple of tile.
int64_t even_blocks(int64_t n, int64_t size, int64_t tile, int64_t* count) {
  *count = (n + size - 1) / size;
  const int64_t per = (n + *count - 1) / *count;
  const int64_t even = std::min(size, (per + tile - 1) / tile * tile);
  *count = (n + even - 1) / even;
  return even;
}
}  // namespace

BlockPlan plan_blocks(int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols, double budget,
                      const std::function<double(int64_t, int64_t)>& ms) {
  BlockPlan b;
  b.rows = rows, b.cols = cols;
  if (rows <= 0 || cols <= 0) return b;
  b.rows = largest_fit(rows, tile_rows, budget, [&](int64_t r) { return ms(r, cols); });
  if (ms(b.rows, cols) > budget) b.cols = largest_fit(cols, tile_cols, budget, [&](int64_t c) { return ms(b.rows, c); });
  b.rows = even_blocks(rows, b.rows, tile_rows, &b.row_blocks);
  b.cols = even_blocks(cols, b.cols, tile_cols, &b.col_blocks);
  return b;
}

std::vector<GridPart> plan_row_blocks(int64_t heads, int64_t rows, int64_t tile, double budget,
                                      const std::function<double(int64_t, int64_t, int64_t)>& ms) {
  std::vector<GridPart> parts;
  if (heads <= 0 || rows <= 0) return parts;
  if (ms(heads, 0, rows) <= budget) return {{0, heads, 0, rows}};
  if (ms(1, 0, rows) <= budget) {  // groups of whole heads, evened out
    int64_t count = 0;
    const int64_t most = most_that_fit(1, heads - 1, [&](int64_t h) { return ms(h, 0, rows) <= budget; });
    const int64_t per = even_blocks(heads, most, 1, &count);
    for (int64_t h = 0; h < heads; h += per) parts.push_back({h, std::min(per, heads - h), 0, rows});
    return parts;
  }
  const int64_t tiles = (rows + tile - 1) / tile;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t t0 = 0; t0 < tiles;) {  // the most tiles from t0 on that fit (at least one)
    const int64_t n = most_that_fit(1, tiles - t0, [&](int64_t k) {
      return ms(1, t0 * tile, std::min(rows, (t0 + k) * tile)) <= budget;
    });
    ranges.emplace_back(t0 * tile, std::min(rows, (t0 + n) * tile));
    t0 += n;
  }
  for (int64_t h = 0; h < heads; ++h)
    for (auto [r0, r1] : ranges) parts.push_back({h, 1, r0, r1 - r0});
  return parts;
}

bool CommandBufferCutter::add(double ms) {
  ++n_;
  ms_ += ms;
  if (n_ < p_.max_dispatches && ms_ < p_.max_ms) return false;
  reset();
  return true;
}

std::vector<size_t> plan_command_buffers(const CommandBufferPolicy& p, const std::vector<double>& ms) {
  CommandBufferCutter cut(p);
  std::vector<size_t> sizes;
  size_t open = 0;
  for (double t : ms) {
    ++open;
    if (cut.add(t)) {
      sizes.push_back(open);
      open = 0;
    }
  }
  if (open) sizes.push_back(open);
  return sizes;
}

}  // namespace krnl::metal
