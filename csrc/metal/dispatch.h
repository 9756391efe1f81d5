// The Metal backend's work as plain data (docs/architecture.md, 'The Metal backend'). The op files
// of csrc/metal (gemm.cpp, norm.cpp, attention.cpp, ...) turn each op into Dispatch records; an
// encoder executes them: the Objective-C++ layer on macOS (compute encoder calls) and the metal-sim
// test device everywhere else (tools/mslsim). Portable C++:
// nothing here knows about Objective-C, so all of the op logic runs in CI.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "metal/policy.h"

namespace krnl::metal {

// A buffer bound at [[buffer(index)]]: `base` is the pool buffer's pointer (on Apple GPUs the
// contents of a shared-storage MTLBuffer, which the encoder maps back to the MTLBuffer), bound
// at byte `offset` (head batching and views are offsets, never copies). `extent` is how many
// bytes from the offset the dispatch may touch: the simulator guards exactly that range.
struct BufferBinding {
  uint32_t index = 0;
  void* base = nullptr;
  size_t offset = 0;
  size_t extent = 0;
};

// A [[function_constant(index)]] value: specialises the pipeline (part of its cache key). Only
// bool constants exist (gemm's aligned-tile switch); another type comes with its first kernel.
struct FunctionConstant {
  uint32_t index = 0;
  bool value = false;
};

// Dispatches of a step run in call order, each seeing every earlier one's writes (device.mm
// encodes them serially; the simulator runs them one after another).
struct Dispatch {
  std::string op;       // the core op this dispatch implements (profiling, error messages)
  std::string library;  // the op family: metal/<library>.metal
  std::string kernel;   // [[host_name]] of the kernel
  std::vector<FunctionConstant> constants;
  std::vector<BufferBinding> buffers;
  uint32_t args_index = 0;    // the kargs.h struct is set as bytes at [[buffer(args_index)]]
  std::vector<uint8_t> args;
  std::array<uint32_t, 3> grid{1, 1, 1};     // threadgroups per grid (dispatchThreadgroups)
  std::array<uint32_t, 3> threads{1, 1, 1};  // threads per threadgroup
  // Host work between GPU dispatches (the CPU half of a row-split GEMM; submission.cpp). It
  // starts once every earlier record of the step has completed, except the last `host_overlap`
  // GPU records before it (its own GPU half), which run alongside it; later records start after
  // both.
  std::function<void()> host;
  uint32_t host_overlap = 0;
  double flops = 0;  // counted arithmetic, for the time estimates (policy.h)
  RateClass rate = RateClass::memory;  // the kind of kernel, whose rate the estimates take
  double bytes = 0;  // device memory it moves, where known; 0: the estimates take the bound extents

  template <class Args>
  void set_args(uint32_t index, const Args& a) {
    args_index = index;
    const auto* p = reinterpret_cast<const uint8_t*>(&a);
    args.assign(p, p + sizeof(Args));
  }
  void bind(uint32_t index, void* base, size_t offset, size_t extent) { buffers.push_back({index, base, offset, extent}); }
  void constant_bool(uint32_t index, bool v) { constants.push_back({index, v}); }
};

// Every op family in metal/ (one .metal file each): the sources the backend embeds and compiles.
// Both come from the table cmake/embed_metal.cmake generates from the files at build time
// (sources.cpp), so the list cannot drift from metal/.
const std::vector<std::string>& library_names();
// The MSL source of metal/<name>.metal with its `#include "..."` lines (kargs.h, rng.h) inlined,
// as the Metal backend compiles it at run time; std::invalid_argument for an unknown name.
std::string library_source(const std::string& name);
// The MSL version metal/<name>.metal needs, from its first line `// msl: X.Y` (checked by
// tools/mslsim/dialect), as major * 100 + minor (3.1 -> 301): the language version the host
// compiles the library with. std::invalid_argument for an unknown name.
uint32_t library_msl_version(const std::string& name);

}  // namespace krnl::metal
