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

CommandBufferPolicy command_buffer_policy(const GpuDescription& g) {
  // Rates of the smallest Mac GPU of each family (M1 7-core, M2/M3 8-core), rounded down.
  CommandBufferPolicy p;
  if (g.apple_family >= 8) {
    p.gflops = 2500;
    p.gbps = 90;
  }
  return p;
}

double estimate_ms(const Dispatch& d, const CommandBufferPolicy& p) {
  double bytes = 0;
  for (const BufferBinding& b : d.buffers) bytes += double(b.extent);
  return d.flops / (p.gflops * 1e6) + bytes / (p.gbps * 1e6);
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
