#include "metal/metal_sim.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace krnl::metal {
namespace {

SimExecutor& executor() {
  static SimExecutor e;
  return e;
}

std::vector<Dispatch>& last_step() {
  static std::vector<Dispatch> v;
  return v;
}

class SimBackend : public MetalOps {
 public:
  SimBackend() : MetalOps("metal-sim") {}

 protected:
  // Like a command buffer: nothing of a step runs before commit, so code that reads a result
  // inside its step sees stale memory here as it would on a GPU.
  void encode(Dispatch&& d) override { queue_.push_back(std::move(d)); }
  void on_begin_step() override { queue_.clear(); }
  void on_commit(uint64_t seq) override {
    std::vector<Dispatch> step;
    step.swap(queue_);
    // The executor may throw (a kernel fault): the step then counts as completed, so the pool
    // can recycle its buffers and the device stays usable for the next step.
    struct Done {
      SimBackend* self;
      uint64_t seq;
      ~Done() { self->completed_ = seq; }
    } done{this, seq};
    last_step() = step;
    for (size_t i = 0; i < step.size();) {
      // Host work (the CPU half of a row split) runs between the GPU dispatches around it.
      size_t j = i;
      while (j < step.size() && !step[j].host) ++j;
      if (j > i) executor()(std::vector<Dispatch>(step.begin() + long(i), step.begin() + long(j)));
      if (j < step.size()) step[j].host();
      i = j + 1;
    }
  }
  uint64_t query_completed() override { return completed_; }

  void* raw_alloc(size_t bytes) override {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0xFF, bytes);  // NaN in every float type: unwritten outputs show in tests
    return p;
  }
  void raw_free(void* p, size_t) override { std::free(p); }

 private:
  std::vector<Dispatch> queue_;
  uint64_t completed_ = 0;
};

Backend* make_sim() { return new SimBackend(); }

}  // namespace

void register_metal_sim(SimExecutor e) {
  if (!e) throw std::invalid_argument("[metal-sim] the executor must be callable");
  executor() = std::move(e);
  register_device("metal-sim", -100, &make_sim);
}

const std::vector<Dispatch>& metal_sim_last_step() { return last_step(); }

}  // namespace krnl::metal
