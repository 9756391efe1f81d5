// The "metal" device: executes the command buffers of MetalOps on an
// Apple GPU. Objective-C++ with ARC, macOS only, deliberately thin: the kernels, grids, offsets
// and arguments of every op (ops.cpp and the op files beside it), the cut of a step into command
// buffers, the ordering of host records and host writes, completion and failures
// (submission.cpp), and the choice of GPU and its dtypes (policy.cpp) are portable code that
// metal-sim runs in CI. This file turns those decisions into Metal calls. No Objective-C type
// leaves it (metal_device.h declares a function).
//
// Device choice: MTLCreateSystemDefaultDevice() can return nil in a command-line process that
// does not link CoreGraphics (CMakeLists.txt links it), so MTLCopyAllDevices() is asked too; the
// device registers only on a GPU that runs every kernel (Apple7 family: simdgroup matrices),
// otherwise krnl.devices() omits it and `krnl devices` prints the reason.
//
// A command buffer (MetalOps::submit): one serial compute encoder, so each dispatch sees every
// earlier one's writes (the op files mark no dispatch as independent: a concurrent encoder with a
// barrier before each would be the same thing said longer). Its completed handler reports to
// MetalOps (completion and failure, on a Metal thread); wait_submission waits for the command
// buffers themselves.
//
// Libraries and pipelines: every library of metal/ starts compiling on a background thread when
// the device is made; an op waits only for the one it needs (library_cache.h, portable and tested
// on Linux). Ops run without the GIL, so the library and pipeline caches lock themselves; no
// Metal call is made under either lock, and completion handlers take neither.
//
// Memory: every pool buffer is a shared-storage MTLBuffer (unified memory): raw_alloc returns its
// contents pointer and keeps pointer -> MTLBuffer, which binding uses. Memory wrapped from the
// host (Device.from_numpy) is bound through a no-copy MTLBuffer over the pages that hold it.
//
// Autorelease pools: Metal returns autoreleased objects (command buffers, encoders, errors). Each
// entry point drains its own pool; errors leave it as std::exception_ptr, rethrown after it is
// drained. Nothing here aborts the process.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "metal/library_cache.h"
#include "metal/metal_device.h"
#include "metal/metal_ops.h"
#include "metal/policy.h"

#if !__has_feature(objc_arc)
#error "csrc/metal/device.mm must be compiled with -fobjc-arc (CMakeLists.txt sets it)"
#endif

// Whether the SDK declares macOS 15's API (MTLLanguageVersion3_2, MTLCompileOptions.mathMode).
// Xcode 15's macOS 14 SDK, the oldest the build supports, does not: there the build leaves them
// out, and @available still guards them at run time where the SDK has them.
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
#define KRNL_SDK_MACOS15 1
#else
#define KRNL_SDK_MACOS15 0
#endif

namespace krnl::metal {
namespace {

std::string text(NSString* s) {
  const char* c = s ? [s UTF8String] : nullptr;
  return c ? std::string(c) : std::string();
}

std::string describe(NSError* e) {
  if (!e) return "no error description";
  std::string d = text([e localizedDescription]);
  return d.empty() ? "no error description" : d;
}

NSString* ns(const std::string& s) { return [NSString stringWithUTF8String:s.c_str()]; }

// Runs f inside an autorelease pool; an exception leaves only after the pool is drained (an
// exception unwinding through @autoreleasepool would leave the pool on the thread's stack).
template <class F>
void pooled(F&& f) {
  std::exception_ptr error;
  @autoreleasepool {
    try {
      f();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// What the policy functions need to know of a GPU.
GpuDescription describe_gpu(id<MTLDevice> d) {
  GpuDescription g;
  g.name = text([d name]);
  if (@available(macOS 14.0, *)) {
    if ([d supportsFamily:MTLGPUFamilyApple9]) g.apple_family = 9;
  }
  if (g.apple_family == 0 && [d supportsFamily:MTLGPUFamilyApple8]) g.apple_family = 8;
  if (g.apple_family == 0 && [d supportsFamily:MTLGPUFamilyApple7]) g.apple_family = 7;
  g.mac2 = [d supportsFamily:MTLGPUFamilyMac2];
  g.unified_memory = [d hasUnifiedMemory];
  g.low_power = [d isLowPower];
  g.removable = [d isRemovable];
  g.working_set = [d recommendedMaxWorkingSetSize];
  return g;
}

// The newest Metal Shading Language this build can ask this macOS to compile (major * 100 +
// minor): 3.1 on macOS 14, the oldest it runs on (the deployment target); 3.2 on macOS 15 where
// the SDK could name it.
uint32_t os_msl_version() {
#if KRNL_SDK_MACOS15
  if (@available(macOS 15.0, *)) return 302;
#endif
  return 301;
}

// The newest MSL any kernel declares (each metal/*.metal says which it needs on its first line).
uint32_t needed_msl_version() {
  uint32_t v = 0;
  for (const std::string& name : library_names()) v = std::max(v, library_msl_version(name));
  return v;
}

// The compiler's language version for a library that declares MSL v (choose_device has checked
// that this macOS compiles the newest one declared).
void set_language_version(MTLCompileOptions* options, uint32_t v) {
#if KRNL_SDK_MACOS15
  if (v >= 302) {
    if (@available(macOS 15.0, *)) {
      options.languageVersion = MTLLanguageVersion3_2;
      return;
    }
  }
#endif
  options.languageVersion = v >= 301 ? MTLLanguageVersion3_1 : MTLLanguageVersion3_0;
}

class MetalBackend final : public MetalOps {
 public:
  MetalBackend(id<MTLDevice> device, const GpuDescription& gpu) : MetalOps("metal", gpu), device_(device) {
    queue_ = [device_ newCommandQueue];
    if (!queue_) throw std::runtime_error("[metal] could not create a command queue on " + text([device_ name]));
    page_ = size_t(sysconf(_SC_PAGESIZE));
    // Every library compiles in the background from now on (library_cache.h): the first step
    // finds them ready or waits only for those it needs.
    libraries_ = std::make_unique<LibraryCache<id<MTLLibrary>>>(
        library_names(), [this](const std::string& name) {
          id<MTLLibrary> lib = nil;
          pooled([&] { lib = compile_library(name); });  // its own pool: it may run on the background thread
          return lib;
        });
    libraries_->start_background();
  }

  // Devices live until exit (core/backend.cpp's registry); this is for completeness.
  ~MetalBackend() override {
    libraries_->stop();
    @autoreleasepool {
      for (auto& [sub, cb] : inflight_) [cb waitUntilCompleted];
      inflight_.clear();
    }
  }

  bool profiles_device_time() const override { return true; }

  std::map<std::string, double> compile_libraries() override { return libraries_->compile_all("compile_libraries"); }

  // At exit: the background compile stops before the statics it reads are destroyed.
  void stop_compiling() { libraries_->stop(); }

  Capabilities capabilities() const override {
    Capabilities c = MetalOps::capabilities();
    c.kind = "metal";
    c.gemm_tuning = true;  // a real GPU: its GEMM variants are worth timing (krnl tune)
    return c;
  }

 protected:
  // Builds (or finds) the record's pipeline and checks its limits while the op that asked for it
  // is still on the stack, so that a kernel that does not compile fails that op.
  void prepare(const Dispatch& d) override {
    pooled([&] {
      if (d.grid[0] == 0 || d.grid[1] == 0 || d.grid[2] == 0) return;
      id<MTLComputePipelineState> ps = pipeline(d);
      const uint64_t threads = uint64_t(d.threads[0]) * d.threads[1] * d.threads[2];
      if (threads == 0 || threads > [ps maxTotalThreadsPerThreadgroup])
        throw std::invalid_argument("[metal] " + d.op + ": kernel " + d.kernel + " takes at most " +
                                    std::to_string([ps maxTotalThreadsPerThreadgroup]) +
                                    " threads per threadgroup, the dispatch asks for " + std::to_string(threads));
      // Threadgroup arrays are declared in the kernels (no dispatch sets a length at run time).
      const uint64_t tg_bytes = [ps staticThreadgroupMemoryLength];
      if (tg_bytes > [device_ maxThreadgroupMemoryLength])
        throw std::invalid_argument("[metal] " + d.op + ": kernel " + d.kernel + " needs " + std::to_string(tg_bytes) +
                                    " bytes of threadgroup memory, the device has " +
                                    std::to_string([device_ maxThreadgroupMemoryLength]));
      if (d.args.size() > 4096)  // setBytes is for small data; kargs.h structs are tens of bytes
        throw std::invalid_argument("[metal] " + d.op + ": argument struct of " + std::to_string(d.args.size()) +
                                    " bytes is over setBytes' 4 KiB");
    });
  }

  void submit(uint64_t sub, std::vector<Dispatch>&& records, bool /*timed: GPU times are always read*/) override {
    pooled([&] {
      id<MTLCommandBuffer> cb = [queue_ commandBuffer];
      if (!cb) throw std::runtime_error("[metal] could not create a command buffer");
      id<MTLComputeCommandEncoder> enc = [cb computeCommandEncoderWithDispatchType:MTLDispatchTypeSerial];
      if (!enc) throw std::runtime_error("[metal] could not create a compute encoder");
      try {
        for (const Dispatch& d : records) encode_gpu(enc, d);
      } catch (...) {
        [enc endEncoding];  // an encoder must be ended before it is released; the buffer is never committed
        throw;
      }
      [enc endEncoding];
      // Plain locals, so that the block holds copies (it runs after this call has returned).
      MetalOps* self = this;
      const uint64_t number = sub;
      [cb addCompletedHandler:^(id<MTLCommandBuffer> b) {
        report(self, number, b);
      }];
      [cb commit];
      std::lock_guard<std::mutex> lk(inflight_mu_);
      inflight_[sub] = cb;
      // Reported ones need no wait: drop them (a command buffer retains every buffer it binds).
      inflight_.erase(inflight_.begin(), inflight_.upper_bound(submissions_done()));
    });
  }

  // (Parameters are not named `id`: that is Objective-C's object type.)
  void wait_submission(uint64_t upto) override {
    pooled([&] {
      // One queue runs its command buffers in commit order: every one up to `upto` is waited, so
      // that each is reported (its handler may run a little later; reports are idempotent).
      std::vector<std::pair<uint64_t, id<MTLCommandBuffer>>> todo;
      {
        std::lock_guard<std::mutex> lk(inflight_mu_);
        auto end = inflight_.upper_bound(upto);
        todo.assign(inflight_.begin(), end);
        inflight_.erase(inflight_.begin(), end);
      }
      for (auto& [sub, cb] : todo) {
        [cb waitUntilCompleted];
        report(this, sub, cb);
      }
    });
  }

  void* raw_alloc(size_t bytes) override {
    void* p = nullptr;
    pooled([&] {
      // Shared storage: CPU and GPU see the same memory (unified memory on Apple silicon).
      id<MTLBuffer> b = [device_ newBufferWithLength:std::max<size_t>(bytes, 1) options:MTLResourceStorageModeShared];
      if (!b) throw std::bad_alloc();
      p = [b contents];
      std::lock_guard<std::mutex> lk(buffers_mu_);
      buffers_[p] = b;
    });
    return p;
  }

  // The pool frees a buffer only once the steps that used it have completed; a command buffer
  // also retains what it binds, so the release can never pull memory from under the GPU.
  void raw_free(void* p, size_t) override {
    pooled([&] {
      std::lock_guard<std::mutex> lk(buffers_mu_);
      buffers_.erase(p);
    });
  }

 private:
  static void report(MetalOps* self, uint64_t sub, id<MTLCommandBuffer> cb) {
    const double ms = ([cb GPUEndTime] - [cb GPUStartTime]) * 1e3;
    if ([cb status] == MTLCommandBufferStatusError) {
      const std::string error = describe([cb error]);
      self->submission_done(sub, &error, ms);
    } else {
      self->submission_done(sub, nullptr, ms);
    }
  }

  // Encodes one GPU dispatch (prepared when it was recorded); an empty grid has nothing to run.
  void encode_gpu(id<MTLComputeCommandEncoder> enc, const Dispatch& d) {
    if (d.grid[0] == 0 || d.grid[1] == 0 || d.grid[2] == 0) return;
    [enc setComputePipelineState:pipeline(d)];
    for (const BufferBinding& b : d.buffers) {
      NSUInteger offset = 0;
      id<MTLBuffer> buf = buffer_for(d, b, &offset);
      [enc setBuffer:buf offset:offset atIndex:b.index];
    }
    if (!d.args.empty()) [enc setBytes:d.args.data() length:d.args.size() atIndex:d.args_index];
    [enc dispatchThreadgroups:MTLSizeMake(d.grid[0], d.grid[1], d.grid[2])
        threadsPerThreadgroup:MTLSizeMake(d.threads[0], d.threads[1], d.threads[2])];
  }

  // The MTLBuffer behind a binding and the byte offset to bind it at.
  id<MTLBuffer> buffer_for(const Dispatch& d, const BufferBinding& b, NSUInteger* offset) {
    {
      std::lock_guard<std::mutex> lk(buffers_mu_);
      auto it = buffers_.find(b.base);
      if (it != buffers_.end()) {
        *offset = b.offset;
        return it->second;
      }
    }
    // Host memory wrapped into a tensor (not from raw_alloc): a no-copy buffer over the whole
    // pages that hold the bound range. The command buffer retains it until it completes; the
    // memory itself stays the wrapping tensor's.
    const uintptr_t addr = reinterpret_cast<uintptr_t>(b.base);
    const uintptr_t start = addr / page_ * page_;
    const uintptr_t end = (addr + b.offset + std::max<size_t>(b.extent, 1) + page_ - 1) / page_ * page_;
    id<MTLBuffer> buf = [device_ newBufferWithBytesNoCopy:reinterpret_cast<void*>(start)
                                                   length:NSUInteger(end - start)
                                                  options:MTLResourceStorageModeShared
                                              deallocator:nil];
    if (!buf)
      throw std::runtime_error("[metal] " + d.op + ": buffer(" + std::to_string(b.index) +
                               ") is host memory the device cannot map; copy it to the device (Device.tensor)");
    *offset = NSUInteger(addr - start + b.offset);
    return buf;
  }

  // Runs on the background thread or an op's (LibraryCache); throws the compiler's log.
  id<MTLLibrary> compile_library(const std::string& name) {
    const std::string source = library_source(name);  // embedded at build time (sources.cpp)
    MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
    // The version the file declares, or MSL 3.1 where the GPU runs bf16 natively: 3.1 turns on
    // KRNL_BF16 (metal/kargs.h), behind which the _bf16 kernels sit, so they exist exactly where
    // capabilities() offer bf16 (an M3 runs macOS 14 or later, which compiles 3.1).
    uint32_t msl = library_msl_version(name);
    if (native_bf16(gpu())) msl = std::max<uint32_t>(msl, 301);
    set_language_version(options, msl);
    // IEEE semantics: fast math lets the compiler assume no NaN/Inf, which would break the
    // non-finite gradient check and the -inf masking of the softmax kernels. mathMode replaces
    // fastMathEnabled (deprecated from macOS 15) where both the SDK and the OS have it.
#if KRNL_SDK_MACOS15
    if (@available(macOS 15.0, *)) {
      options.mathMode = MTLMathModeSafe;
    } else {
      options.fastMathEnabled = NO;
    }
#else
    options.fastMathEnabled = NO;
#endif
    NSError* error = nil;
    id<MTLLibrary> lib = [device_ newLibraryWithSource:ns(source) options:options error:&error];
    if (!lib) throw std::runtime_error(describe(error));
    return lib;
  }

  // Pipelines by kernel and function-constant values (a specialisation is a separate pipeline).
  id<MTLComputePipelineState> pipeline(const Dispatch& d) {
    std::string key = d.kernel;
    for (const FunctionConstant& c : d.constants)
      key += "|" + std::to_string(c.index) + ":" + (c.value ? "1" : "0");
    {
      // Ops run without the GIL, so two threads may ask at once; the lock covers the map only
      // (never a Metal call): a twin built meanwhile is dropped below.
      std::lock_guard<std::mutex> lk(pipelines_mu_);
      auto it = pipelines_.find(key);
      if (it != pipelines_.end()) return it->second;
    }

    id<MTLLibrary> lib = libraries_->get(d.library, d.op);
    NSError* error = nil;
    id<MTLFunction> fn = nil;
    if (d.constants.empty()) {
      fn = [lib newFunctionWithName:ns(d.kernel)];
    } else {
      MTLFunctionConstantValues* values = [[MTLFunctionConstantValues alloc] init];
      for (const FunctionConstant& c : d.constants)
        [values setConstantValue:&c.value type:MTLDataTypeBool atIndex:c.index];
      fn = [lib newFunctionWithName:ns(d.kernel) constantValues:values error:&error];
    }
    if (!fn)
      throw std::runtime_error("[metal] " + d.op + ": kernel " + d.kernel + " not found in library " + d.library +
                               (error ? ": " + describe(error) : std::string()));
    id<MTLComputePipelineState> ps = [device_ newComputePipelineStateWithFunction:fn error:&error];
    if (!ps)
      throw std::runtime_error("[metal] " + d.op + ": pipeline of kernel " + d.kernel + " failed: " + describe(error));
    std::lock_guard<std::mutex> lk(pipelines_mu_);
    return pipelines_.emplace(std::move(key), ps).first->second;
  }

  id<MTLDevice> device_;
  id<MTLCommandQueue> queue_;
  size_t page_ = 16384;
  std::mutex inflight_mu_;
  std::map<uint64_t, id<MTLCommandBuffer>> inflight_;  // committed, not yet waited
  std::unique_ptr<LibraryCache<id<MTLLibrary>>> libraries_;  // locks itself
  std::mutex pipelines_mu_;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
  std::mutex buffers_mu_;  // raw_alloc/raw_free run under the pool's lock, encoding under none
  std::unordered_map<void*, id<MTLBuffer>> buffers_;
};

// The GPU register_metal_backend chose, and its description.
id<MTLDevice> g_device = nil;
GpuDescription g_gpu;
MetalBackend* g_backend = nullptr;  // once made (devices live until exit)

Backend* make_metal_backend() {
  pooled([&] { g_backend = new MetalBackend(g_device, g_gpu); });
  std::atexit([] { g_backend->stop_compiling(); });
  return g_backend;
}

}  // namespace

void register_metal_backend() {
  pooled([&] {
    std::vector<id<MTLDevice>> devices;
    id<MTLDevice> preferred = MTLCreateSystemDefaultDevice();
    if (preferred) devices.push_back(preferred);
    NSArray<id<MTLDevice>>* all = MTLCopyAllDevices();
    for (NSUInteger i = 0; all && i < [all count]; ++i) {
      id<MTLDevice> d = [all objectAtIndex:i];
      if (!preferred || [d registryID] != [preferred registryID]) devices.push_back(d);
    }
    std::vector<GpuDescription> described;
    for (id<MTLDevice> d : devices) described.push_back(describe_gpu(d));
    const DeviceChoice choice = choose_device(described, os_msl_version(), needed_msl_version());
    if (choice.index < 0) {
      register_unavailable("metal", choice.reason);
      return;
    }
    g_device = devices[size_t(choice.index)];
    g_gpu = described[size_t(choice.index)];
    register_device("metal", 100, &make_metal_backend);
  });
}

}  // namespace krnl::metal
