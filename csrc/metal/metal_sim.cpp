#include "metal/metal_sim.h"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace krnl::metal {
namespace {

using Clock = std::chrono::steady_clock;

SimExecutor& executor() {
  static SimExecutor e;
  return e;
}

// metal-cuda's executor, memory and GPU family (register_metal_cuda).
struct CudaConfig {
  SimExecutor executor;
  SimMemory memory;
  int apple_family = 9;
};
CudaConfig& cuda_config() {
  static CudaConfig c;
  return c;
}

enum class Lag { none, wait, delay };

class SimBackend final : public MetalOps {
 public:
  SimBackend() : MetalOps("metal-sim", metal_sim_gpu()), executor_(executor()) {
    keep_step_log(true);
    worker_ = std::thread([this] { run(); });
  }
  SimBackend(const std::string& name, GpuDescription gpu, SimExecutor executor, SimMemory memory)
      : MetalOps(name, std::move(gpu)), executor_(std::move(executor)), memory_(memory), lag_(Lag::none) {
    keep_step_log(true);
    worker_ = std::thread([this] { run(); });
  }

  void set_lag(Lag lag, double max_ms, uint64_t seed) {
    drain();
    std::lock_guard<std::mutex> lk(mu_);
    lag_ = lag;
    max_ms_ = max_ms;
    rng_ = seed;
  }

  void stand_for(const GpuDescription& g) {
    drain();
    set_gpu(g);
  }

  void shutdown() {
    drain();
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

 protected:
  void submit(uint64_t id, std::vector<Dispatch>&& records, bool) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) throw std::runtime_error("[" + name() + "] the device was shut down");
      queue_.push_back({id, std::move(records), Clock::now() + next_delay()});
    }
    cv_.notify_all();
  }

  void wait_submission(uint64_t id) override {
    std::unique_lock<std::mutex> lk(mu_);
    release_ = std::max(release_, id);
    cv_.notify_all();
    // The executor is Python and takes the GIL: a caller that waits while holding it would wait
    // forever. Every binding that can wait releases it; this turns a missed one into an error.
    if (!cv_.wait_for(lk, std::chrono::minutes(5), [&] { return ran_ >= id; }))
      throw std::runtime_error("[" + name() + "] command buffer " + std::to_string(id) +
                               " did not complete in 5 minutes (a wait while holding the GIL?)");
  }

  void* raw_alloc(size_t bytes) override {
    if (memory_.alloc) {  // the executor's memory fills new buffers itself
      void* p = memory_.alloc(bytes);
      if (!p) throw std::bad_alloc();
      return p;
    }
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0xFF, bytes);  // NaN in every float type: unwritten outputs show in tests
    return p;
  }
  void raw_free(void* p, size_t) override {
    if (memory_.free)
      memory_.free(p);
    else
      std::free(p);
  }

 private:
  struct Item {
    uint64_t id;
    std::vector<Dispatch> records;
    Clock::time_point due;
  };

  void drain() {
    uint64_t last = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!queue_.empty()) last = queue_.back().id;
    }
    if (last) wait_submission(last);
  }

  Clock::duration next_delay() {
    if (lag_ != Lag::delay) return Clock::duration::zero();
    rng_ += 0x9E3779B97F4A7C15ull;  // splitmix64: a seeded, platform-independent sequence
    uint64_t z = rng_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double ms = max_ms_ * double(z >> 11) / double(1ull << 53);
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(ms));
  }

  bool ready(const Item& it) const {
    return lag_ == Lag::none || release_ >= it.id || (lag_ == Lag::delay && Clock::now() >= it.due);
  }

  // The worker: one command buffer at a time, in commit order, as one queue runs them.
  void run() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      while (!stop_ && (queue_.empty() || !ready(queue_.front()))) {
        if (!queue_.empty() && lag_ == Lag::delay)
          cv_.wait_until(lk, queue_.front().due);
        else
          cv_.wait(lk);
      }
      if (queue_.empty()) return;  // stopped, nothing left
      Item it = std::move(queue_.front());
      queue_.pop_front();
      lk.unlock();
      std::string error;
      bool failed = false;
      try {
        // Host work between GPU dispatches is MetalOps' (run_host): a command buffer holds none.
        executor_(it.records);
      } catch (const std::exception& e) {
        failed = true;
        error = e.what();
      } catch (...) {
        failed = true;
        error = "unknown error";
      }
      submission_done(it.id, failed ? &error : nullptr, 0);
      lk.lock();
      ran_ = it.id;
      cv_.notify_all();
    }
  }

  SimExecutor executor_;
  SimMemory memory_;  // null functions: host memory
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  uint64_t release_ = 0;  // waited for: runs now in every mode
  uint64_t ran_ = 0;      // completed and reported
  bool stop_ = false;
  Lag lag_ = Lag::wait;
  double max_ms_ = 0;
  uint64_t rng_ = 0;
  std::thread worker_;  // lives as long as the device: until metal_sim_shutdown()
};

SimBackend* g_sim = nullptr;   // set when the device is first used (the registry creates it)
SimBackend* g_cuda = nullptr;  // metal-cuda's, likewise

}  // namespace

GpuDescription metal_sim_gpu(int apple_family) {
  GpuDescription g;
  g.name = "metal-sim (tools/mslsim on the CPU, standing for an Apple" + std::to_string(apple_family) + " GPU)";
  g.apple_family = apple_family;
  g.unified_memory = true;
  return g;
}

void register_metal_sim(SimExecutor e) {
  if (!e) throw std::invalid_argument("[metal-sim] the executor must be callable");
  executor() = std::move(e);
  register_device("metal-sim", -100, []() -> Backend* { return g_sim = new SimBackend(); });
}

void register_metal_cuda(SimExecutor e, SimMemory memory, int apple_family) {
  if (!e) throw std::invalid_argument("[metal-cuda] the executor must be callable");
  if (!memory.alloc || !memory.free) throw std::invalid_argument("[metal-cuda] alloc and free must be given");
  if (apple_family < 7) throw std::invalid_argument("[metal-cuda] the kernels need the Apple7 family or later");
  cuda_config() = {std::move(e), memory, apple_family};
  register_device("metal-cuda", -100, []() -> Backend* {
    const CudaConfig& c = cuda_config();
    GpuDescription g = metal_sim_gpu(c.apple_family);
    g.name = "metal-cuda (tools/mslcuda on an NVIDIA GPU, standing for an Apple" + std::to_string(c.apple_family) + " GPU)";
    return g_cuda = new SimBackend("metal-cuda", g, c.executor, c.memory);
  });
}

void metal_sim_set_lag(const std::string& mode, double max_ms, uint64_t seed) {
  Lag lag;
  if (mode == "none")
    lag = Lag::none;
  else if (mode == "wait")
    lag = Lag::wait;
  else if (mode == "delay")
    lag = Lag::delay;
  else
    throw std::invalid_argument("[metal-sim] lag must be 'none', 'wait' or 'delay', got '" + mode + "'");
  if (!(max_ms >= 0)) throw std::invalid_argument("[metal-sim] max_ms must be >= 0");
  static_cast<SimBackend*>(get_device("metal-sim"))->set_lag(lag, max_ms, seed);
}

void metal_sim_set_gpu(int apple_family, uint64_t working_set) {
  if (apple_family < 7 || apple_family > 9)
    throw std::invalid_argument("[metal-sim] apple_family must be 7, 8 or 9 (the families the policy knows), got " +
                                std::to_string(apple_family));
  GpuDescription g = metal_sim_gpu(apple_family);
  g.working_set = working_set;
  static_cast<SimBackend*>(get_device("metal-sim"))->stand_for(g);
}

void metal_sim_shutdown() {
  if (g_sim) g_sim->shutdown();
  if (g_cuda) g_cuda->shutdown();
}

}  // namespace krnl::metal
