// The "metal" device (DESIGN section 7): executes the Dispatch records of MetalOps (ops.cpp) on
// an Apple GPU. Objective-C++ with ARC, macOS only, deliberately thin: every decision about
// kernels, grids, offsets and arguments is made in portable code and tested on metal-sim; this
// file only turns records into Metal calls. No Objective-C type leaves this file (the class is
// local; metal_device.h declares a plain function).
//
// Submission model, per step (Backend::begin_step ... commit):
// - one command buffer from the device's one queue, with ONE compute encoder of
//   MTLDispatchTypeConcurrent. Serial semantics come from a buffer memory barrier before every
//   dispatch except the encoder's first and those marked Dispatch::concurrent;
// - a record with `host` set splits the step: the encoder is ended and its command buffer
//   committed, host() runs on this thread while the GPU works through what was encoded before
//   it (the GPU half of a row-split GEMM overlaps the CPU half), then the GPU is waited and a
//   new command buffer and encoder continue the step;
// - commit: endEncoding, a completion handler that advances the completed seq (the buffer
//   pool's recycling clock), commit. The step's last command buffer is kept for wait().
// A failed command buffer (GPU fault, timeout) is reported as a C++ exception
// "[metal] command buffer failed: ..." from wait(), or from the next commit if no wait saw it
// first; failures of the intermediate command buffers (host splits, profiling) are raised by
// the op that waited on them. Nothing here aborts the process.
//
// Memory: every pool buffer is a shared-storage MTLBuffer (unified memory): raw_alloc returns
// its contents pointer and keeps pointer -> MTLBuffer, which encode() uses to bind. Memory
// wrapped from the host (Device.from_numpy) is bound through a no-copy MTLBuffer over the pages
// that hold it.
//
// Autorelease pools: Metal returns autoreleased objects (command buffers, encoders, errors).
// Each entry point (begin_step, encode, commit, wait, alloc) drains its own pool; the objects a
// step needs across calls (command buffer, encoder) are held by strong references until commit
// or wait. A single pool spanning begin_step..commit is not used: pools are a per-thread stack,
// and a step's calls may come from different threads or be interleaved with other code's pools.
// Errors are carried out of each pool as std::exception_ptr and rethrown after it is drained.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
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

#include "metal/metal_device.h"
#include "metal/metal_ops.h"

#if !__has_feature(objc_arc)
#error "csrc/metal/device.mm must be compiled with -fobjc-arc (CMakeLists.txt sets it)"
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

// Completion state shared with the command buffers' handlers, which run on a Metal thread and
// may outlive a call: held by shared_ptr in each handler block.
struct Completion {
  std::atomic<uint64_t> completed{0};  // newest step known complete
  std::mutex mu;
  uint64_t failed_step = 0;  // first failure not yet raised (0: none)
  std::string failure;
  uint64_t raised_upto = 0;  // failures of steps up to here were already raised

  void complete(uint64_t seq) {
    uint64_t c = completed.load(std::memory_order_relaxed);
    while (c < seq && !completed.compare_exchange_weak(c, seq, std::memory_order_release)) {
    }
  }
  void fail(uint64_t seq, std::string msg) {
    std::lock_guard<std::mutex> lk(mu);
    if (seq <= raised_upto || failed_step != 0) return;
    failed_step = seq;
    failure = std::move(msg);
  }
  // The pending failure of a step <= upto, if any; it counts as raised from then on.
  bool take(uint64_t upto, uint64_t* step, std::string* msg) {
    std::lock_guard<std::mutex> lk(mu);
    if (failed_step == 0 || failed_step > upto) return false;
    *step = failed_step;
    *msg = std::move(failure);
    raised_upto = std::max(raised_upto, failed_step);
    failed_step = 0;
    failure.clear();
    return true;
  }
  // A failure of step `seq` found directly (wait): its handler must not raise it again.
  void mark_raised(uint64_t seq) {
    std::lock_guard<std::mutex> lk(mu);
    raised_upto = std::max(raised_upto, seq);
    if (failed_step != 0 && failed_step <= raised_upto) {
      failed_step = 0;
      failure.clear();
    }
  }
};

[[noreturn]] void raise_failure(const std::string& what, const std::string& msg) {
  throw std::runtime_error("[metal] command buffer failed: " + msg + " (" + what + ")");
}

class MetalBackend final : public MetalOps {
 public:
  explicit MetalBackend(id<MTLDevice> device) : MetalOps("metal"), device_(device) {
    queue_ = [device_ newCommandQueue];
    if (!queue_) throw std::runtime_error("[metal] could not create a command queue on " + text([device_ name]));
    page_ = size_t(sysconf(_SC_PAGESIZE));
  }

  // Devices live until exit (core/backend.cpp's registry); this is for completeness.
  ~MetalBackend() override {
    @autoreleasepool {
      if (enc_) [enc_ endEncoding];  // an encoder must be ended before it is released
      if (cb_) [cb_ commit];
      for (auto& [seq, cb] : inflight_) [cb waitUntilCompleted];
      if (cb_) [cb_ waitUntilCompleted];
      enc_ = nil;
      cb_ = nil;
      inflight_.clear();
    }
  }

  bool profiles_device_time() const override { return true; }

 protected:
  void on_begin_step() override {
    pooled([&] { open_encoder(); });
  }

  void encode(Dispatch&& d) override {
    pooled([&] {
      if (!cb_) throw std::logic_error("[metal] " + d.op + ": dispatch outside a step");
      if (d.host) {
        run_host(d);
      } else if (!profiling()) {
        encode_gpu(d);
      } else {
        // Profiling: the dispatch alone in a command buffer, waited, so GPUEndTime -
        // GPUStartTime is its GPU time (core/ops.cpp records it as the op's time). Work
        // encoded earlier in the step is flushed first, untimed: it belongs to no profiled op.
        if (encoded_ > 0) wait_checked(split(), "earlier work of the step", "");
        if (!encode_gpu(d)) return;
        id<MTLCommandBuffer> cb = split();
        wait_checked(cb, d.op, d.kernel);
        add_device_ms(([cb GPUEndTime] - [cb GPUStartTime]) * 1e3);
      }
    });
  }

  void on_commit(uint64_t seq) override {
    pooled([&] {
      id<MTLCommandBuffer> cb = cb_;
      [enc_ endEncoding];
      enc_ = nil;
      cb_ = nil;
      // Plain locals, so that the block holds copies (it runs after this call has returned).
      std::shared_ptr<Completion> done = done_;
      const uint64_t step_seq = seq;
      [cb addCompletedHandler:^(id<MTLCommandBuffer> b) {
        if ([b status] == MTLCommandBufferStatusError) done->fail(step_seq, describe([b error]));
        done->complete(step_seq);
      }];
      [cb commit];
      inflight_[seq] = cb;
      // Steps whose handler has run need no wait: drop them (and their buffers' references).
      const uint64_t c = done_->completed.load(std::memory_order_acquire);
      inflight_.erase(inflight_.begin(), inflight_.upper_bound(c));
      // A failure seen since the last wait is raised now; this step's own comes later.
      uint64_t step = 0;
      std::string msg;
      if (done_->take(UINT64_MAX, &step, &msg)) raise_failure("step " + std::to_string(step), msg);
    });
  }

  void on_wait(uint64_t seq) override {
    pooled([&] {
      // One queue runs its command buffers in commit order; every step up to seq is waited so
      // that a failure of any of them is seen here.
      uint64_t failed = 0;
      std::string msg;
      while (!inflight_.empty() && inflight_.begin()->first <= seq) {
        auto [s, cb] = *inflight_.begin();
        inflight_.erase(inflight_.begin());
        [cb waitUntilCompleted];
        done_->complete(s);  // the handler may run a little later: the pool need not wait for it
        if ([cb status] == MTLCommandBufferStatusError && failed == 0) {
          failed = s;
          msg = describe([cb error]);
        }
      }
      if (failed != 0) {
        done_->mark_raised(failed);
        raise_failure("step " + std::to_string(failed), msg);
      }
      uint64_t step = 0;
      if (done_->take(seq, &step, &msg)) raise_failure("step " + std::to_string(step), msg);
    });
  }

  uint64_t query_completed() override { return done_->completed.load(std::memory_order_acquire); }

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
  void open_encoder() {
    cb_ = [queue_ commandBuffer];
    if (!cb_) throw std::runtime_error("[metal] could not create a command buffer");
    enc_ = [cb_ computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
    if (!enc_) throw std::runtime_error("[metal] could not create a compute encoder");
    encoded_ = 0;
  }

  // Ends and commits the open command buffer, opens the next one for the rest of the step, and
  // returns the committed one (not waited).
  id<MTLCommandBuffer> split() {
    id<MTLCommandBuffer> cb = cb_;
    [enc_ endEncoding];
    enc_ = nil;
    cb_ = nil;
    [cb commit];
    open_encoder();
    return cb;
  }

  void wait_checked(id<MTLCommandBuffer> cb, const std::string& op, const std::string& kernel) {
    [cb waitUntilCompleted];
    if ([cb status] == MTLCommandBufferStatusError)
      raise_failure(kernel.empty() ? op : op + ", kernel " + kernel, describe([cb error]));
  }

  // Host work between GPU dispatches: everything encoded before it is committed and runs on the
  // GPU while host() runs here; the step continues in a new command buffer once both are done.
  void run_host(Dispatch& d) {
    const auto t0 = std::chrono::steady_clock::now();
    id<MTLCommandBuffer> cb = split();
    try {
      d.host();
    } catch (...) {
      [cb waitUntilCompleted];  // the GPU half still uses the op's buffers
      throw;
    }
    wait_checked(cb, d.op, d.kernel);
    // Profiling has already run and timed the GPU half alone, so this is the host call's time.
    if (profiling()) add_device_ms(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }

  // Encodes one GPU dispatch into the open encoder; false when there is nothing to run.
  bool encode_gpu(const Dispatch& d) {
    if (d.grid[0] == 0 || d.grid[1] == 0 || d.grid[2] == 0) return false;
    id<MTLComputePipelineState> ps = pipeline(d);
    const uint64_t threads = uint64_t(d.threads[0]) * d.threads[1] * d.threads[2];
    if (threads == 0 || threads > [ps maxTotalThreadsPerThreadgroup])
      throw std::invalid_argument("[metal] " + d.op + ": kernel " + d.kernel + " takes at most " +
                                  std::to_string([ps maxTotalThreadsPerThreadgroup]) +
                                  " threads per threadgroup, the dispatch asks for " + std::to_string(threads));
    uint64_t tg_bytes = [ps staticThreadgroupMemoryLength];
    for (const auto& [index, bytes] : d.threadgroup_memory) tg_bytes += (uint64_t(bytes) + 15) / 16 * 16;
    if (tg_bytes > [device_ maxThreadgroupMemoryLength])
      throw std::invalid_argument("[metal] " + d.op + ": kernel " + d.kernel + " needs " + std::to_string(tg_bytes) +
                                  " bytes of threadgroup memory, the device has " +
                                  std::to_string([device_ maxThreadgroupMemoryLength]));
    if (d.args.size() > 4096)  // setBytes is for small data; kargs.h structs are tens of bytes
      throw std::invalid_argument("[metal] " + d.op + ": argument struct of " + std::to_string(d.args.size()) +
                                  " bytes is over setBytes' 4 KiB");

    if (encoded_ > 0 && !d.concurrent) [enc_ memoryBarrierWithScope:MTLBarrierScopeBuffers];
    [enc_ setComputePipelineState:ps];
    for (const BufferBinding& b : d.buffers) {
      NSUInteger offset = 0;
      id<MTLBuffer> buf = buffer_for(d, b, &offset);
      [enc_ setBuffer:buf offset:offset atIndex:b.index];
    }
    if (!d.args.empty()) [enc_ setBytes:d.args.data() length:d.args.size() atIndex:d.args_index];
    // Threadgroup memory lengths must be multiples of 16 bytes; rounding up only adds padding.
    for (const auto& [index, bytes] : d.threadgroup_memory)
      [enc_ setThreadgroupMemoryLength:(NSUInteger(bytes) + 15) / 16 * 16 atIndex:index];
    [enc_ dispatchThreadgroups:MTLSizeMake(d.grid[0], d.grid[1], d.grid[2])
         threadsPerThreadgroup:MTLSizeMake(d.threads[0], d.threads[1], d.threads[2])];
    ++encoded_;
    return true;
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

  id<MTLLibrary> library(const std::string& name) {
    auto it = libraries_.find(name);
    if (it != libraries_.end()) return it->second;
    const std::string source = library_source(name);  // embedded at build time (sources.cpp)
    MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
    if (@available(macOS 14.0, *)) options.languageVersion = MTLLanguageVersion3_1;  // the kernels are MSL 3.1
    // IEEE semantics: fast math lets the compiler assume no NaN/Inf, which would break the
    // non-finite gradient check and the -inf masking of the softmax kernels.
    options.fastMathEnabled = NO;
    NSError* error = nil;
    id<MTLLibrary> lib = [device_ newLibraryWithSource:ns(source) options:options error:&error];
    if (!lib)
      throw std::runtime_error("[metal] compiling library " + name + " (metal/" + name + ".metal) failed:\n" +
                               describe(error));
    libraries_.emplace(name, lib);
    return lib;
  }

  // Pipelines by kernel and function-constant values (a specialisation is a separate pipeline).
  id<MTLComputePipelineState> pipeline(const Dispatch& d) {
    std::string key = d.kernel;
    for (const FunctionConstant& c : d.constants)
      key += "|" + std::to_string(c.index) + ":" + std::to_string(int(c.type)) + ":" + std::to_string(c.bits);
    auto it = pipelines_.find(key);
    if (it != pipelines_.end()) return it->second;

    id<MTLLibrary> lib = library(d.library);
    NSError* error = nil;
    id<MTLFunction> fn = nil;
    if (d.constants.empty()) {
      fn = [lib newFunctionWithName:ns(d.kernel)];
    } else {
      MTLFunctionConstantValues* values = [[MTLFunctionConstantValues alloc] init];
      for (const FunctionConstant& c : d.constants) {
        switch (c.type) {
          case FunctionConstant::Type::Bool: {
            const bool v = c.bits != 0;
            [values setConstantValue:&v type:MTLDataTypeBool atIndex:c.index];
            break;
          }
          case FunctionConstant::Type::UInt: {
            const uint32_t v = c.bits;
            [values setConstantValue:&v type:MTLDataTypeUInt atIndex:c.index];
            break;
          }
          case FunctionConstant::Type::Float: {
            float v;
            std::memcpy(&v, &c.bits, sizeof v);
            [values setConstantValue:&v type:MTLDataTypeFloat atIndex:c.index];
            break;
          }
        }
      }
      fn = [lib newFunctionWithName:ns(d.kernel) constantValues:values error:&error];
    }
    if (!fn)
      throw std::runtime_error("[metal] " + d.op + ": kernel " + d.kernel + " not found in library " + d.library +
                               (error ? ": " + describe(error) : std::string()));
    id<MTLComputePipelineState> ps = [device_ newComputePipelineStateWithFunction:fn error:&error];
    if (!ps)
      throw std::runtime_error("[metal] " + d.op + ": pipeline of kernel " + d.kernel + " failed: " + describe(error));
    pipelines_.emplace(std::move(key), ps);
    return ps;
  }

  id<MTLDevice> device_;
  id<MTLCommandQueue> queue_;
  size_t page_ = 16384;
  // The open step: command buffer and its encoder (nil outside a step).
  id<MTLCommandBuffer> cb_;
  id<MTLComputeCommandEncoder> enc_;
  size_t encoded_ = 0;  // dispatches in enc_: the first needs no barrier
  // Committed steps not yet known complete: the step's last command buffer, for wait().
  std::map<uint64_t, id<MTLCommandBuffer>> inflight_;
  std::shared_ptr<Completion> done_ = std::make_shared<Completion>();
  std::unordered_map<std::string, id<MTLLibrary>> libraries_;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
  std::mutex buffers_mu_;  // raw_alloc/raw_free run under the pool's lock, encode under none
  std::unordered_map<void*, id<MTLBuffer>> buffers_;
};

Backend* make_metal_backend() {
  Backend* b = nullptr;
  pooled([&] {
    id<MTLDevice> device = MTLCreateSystemDefaultDevice();
    if (!device) throw std::runtime_error("[metal] no Metal device");
    b = new MetalBackend(device);
  });
  return b;
}

}  // namespace

void register_metal_backend() {
  // The kernels are MSL 3.1, which the Metal compiler of macOS 14 and later accepts: on older
  // systems the device is not offered at all (the CPU stays the default) rather than failing at
  // the first op.
  if (@available(macOS 14.0, *)) {
  } else {
    return;
  }
  bool present = false;
  @autoreleasepool {
    present = MTLCreateSystemDefaultDevice() != nil;
  }
  if (present) register_device("metal", 100, &make_metal_backend);
}

}  // namespace krnl::metal
