#include "backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

namespace krnl {

Backend::Backend(std::string name) : name_(std::move(name)) {
  pool_ = std::make_unique<BufferPool>([this](size_t n) { return raw_alloc(n); },
                                       [this](void* p, size_t n) { raw_free(p, n); }, name_);
  // Read per device when it is made, so a bad value fails the device with its name.
  if (const char* env = std::getenv("KRNL_MAX_MEMORY"); env && *env) {
    pool_->set_limit(BufferPool::parse_size(env, "KRNL_MAX_MEMORY"), "set by KRNL_MAX_MEMORY");
    limit_chosen_ = true;
  }
}

void Backend::set_memory_limit(size_t bytes) {
  pool_->set_limit(bytes, "set by Device.set_memory_limit");
  limit_chosen_ = true;
}

void Backend::set_default_memory_limit(size_t bytes, const std::string& origin) {
  if (!limit_chosen_) pool_->set_limit(bytes, origin);
}

Backend::~Backend() = default;

Capabilities Backend::capabilities() const {
  Capabilities c;
  c.kind = name_.substr(0, name_.find(':'));
  c.dtypes = {DType::f32};
  c.host_visible = host_visible();
  c.synchronous = synchronous();
  c.queue_ordered = queue_ordered();
  c.fused_attention_token_major = token_major_attention();
  return c;
}

Tensor Backend::empty(const Shape& shape, DType dt) {
  int64_t n = 1;
  for (auto d : shape) {
    if (d < 0) throw std::invalid_argument("[empty] negative dimension in " + shape_str(shape));
    n *= d;
  }
  const size_t bytes = size_t(n) * dtype_size(dt);
  Buffer b;
  if (!capturing()) {
    try {
      b = pool_->acquire(bytes, completed_seq(), exact_sizes_);
    } catch (const PoolLimitError&) {
      // Buffers released under committed work come back once it completes: wait for it (as MLX
      // waits on scheduled work) and try once more. The open step's own cannot come back yet.
      if (completed_seq() >= last_committed_ || pool_->waiting(completed_seq()) == 0) throw;
      on_wait(last_committed_);
      b = pool_->acquire(bytes, completed_seq(), exact_sizes_);
    }
  } else {  // a buffer made while recording is baked into the graph: the arena's (backend.h)
    // A released buffer of its class first. While no graph lives yet, then the pool's cached one
    // of its class (the warm-up left them): a lone recording holds what its eager step did, where
    // best fit handed larger buffers to smaller requests and took 2.1 GiB more at the 1b bench
    // shape. Otherwise best fit, the smallest released buffer that holds it, so that graphs of
    // shorter lengths run in the temporaries of longer ones.
    const size_t cls = BufferPool::class_size(bytes);
    auto it = arena_.free.find(cls);
    if (it == arena_.free.end() && !(arena_.graphs == 0 && pool_->has_cached(cls, completed_seq())))
      it = arena_.free.lower_bound(cls);
    if (it != arena_.free.end()) {
      b = it->second;
      arena_.free.erase(it);
    } else {
      b = pool_->acquire(bytes, completed_seq());
      arena_.owned.insert(b.id);
      arena_.bytes += b.bytes;
    }
    arena_.recording.insert(b.id);
  }
  return Tensor(std::make_shared<Storage>(this, b), 0, shape, dt);
}

Tensor Backend::wrap(void* ptr, const Shape& shape, DType dt, std::function<void()> release) {
  if (!host_visible()) throw std::invalid_argument("[wrap] device " + name_ + " cannot wrap host memory");
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return Tensor(std::make_shared<Storage>(this, ptr, size_t(n) * dtype_size(dt), std::move(release)), 0, shape, dt);
}

void Backend::release_buffer(const Buffer& b) {
  if (arena_.owned.count(b.id)) {
    if (arena_.graphs > 0 || capturing()) {
      arena_.free.emplace(b.bytes, b);
      return;
    }
    arena_.owned.erase(b.id);  // the last graph is gone: back to the pool as any buffer
    arena_.bytes -= b.bytes;
  }
  // Inside an open step, ops of that step that read the buffer may not have run yet (seq = next
  // commit). Where every access is ordered on one queue (CPU: at once; CUDA: one stream; Metal:
  // one queue of serial encoders, host writes waiting for the work that binds their buffer) an op
  // that gets the buffer next runs after them, so it is free for reuse at once, though not for
  // giving back before seq completes: a step's pool stays near its live peak instead of holding
  // every temporary of the step (W2 on the CPU: 221 -> 200 MB for a 191 MB live peak; the 1B
  // shape at 2048 tokens on Metal, planned: 8.8 -> 4.7 GiB). A recording keeps the rule: its
  // buffers outlive it in the graph.
  const bool reuse_now = queue_ordered() && !capturing();
  const uint64_t seq = in_step_ ? last_committed_ + 1 : last_committed_;
  pool_->release(b, seq, completed_seq(), reuse_now);
}

void Backend::graph_released() {
  --arena_.graphs;
  settle_arena();
}

void Backend::settle_arena() {
  if (arena_.graphs > 0 || capturing()) return;
  // A replay may still run on the queue: the buffers retire with the newest step that may hold it.
  const uint64_t seq = last_committed_ + (in_step_ ? 1 : 0);
  for (auto& [size, b] : arena_.free) {
    arena_.owned.erase(b.id);
    arena_.bytes -= b.bytes;
    pool_->release(b, seq, completed_seq());
  }
  arena_.free.clear();
}

void Backend::upload(const Tensor& dst, const void* src) { std::memcpy(dst.data(), src, dst.nbytes()); }
void Backend::download(const Tensor& src, void* dst) { std::memcpy(dst, src.data(), src.nbytes()); }

void Backend::begin_step() {
  if (in_step_)
    throw std::runtime_error(capturing() ? "[step] a step was opened inside a graph capture on " + name_ +
                                               " (the captured call is one step already)"
                                         : "[step] a step is already open on " + name_ + " (steps do not nest)");
  in_step_ = true;
  on_begin_step();
}

uint64_t Backend::commit() {
  if (!in_step_) throw std::runtime_error("[step] commit without an open step on " + name_);
  if (capturing()) throw std::runtime_error("[step] commit inside a graph capture on " + name_);
  in_step_ = false;
  ++last_committed_;
  on_commit(last_committed_);
  return last_committed_;
}

void Backend::wait(uint64_t seq) {
  if (capturing())
    throw std::runtime_error("[wait] cannot wait for " + name_ + " inside a graph capture (the recorded work has not run)");
  if (seq > last_committed_)
    throw std::invalid_argument("[wait] seq " + std::to_string(seq) + " was never committed on " + name_);
  on_wait(seq);
}

uint64_t Backend::completed_seq() { return query_completed(); }

void Backend::not_implemented(const char* op) const {
  throw NotImplementedError(std::string("[") + op + "] not implemented on " + name_);
}

std::unique_ptr<Graph> Backend::capture(const std::function<void(bool)>&) { not_implemented("capture"); }

// The default of every op: the list's parameter names go unused here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#define KRNL_NOT_IMPLEMENTED(name, params) \
  void Backend::name params { not_implemented(#name); }
KRNL_OPS(KRNL_NOT_IMPLEMENTED)
#undef KRNL_NOT_IMPLEMENTED
#pragma GCC diagnostic pop

namespace {
struct Entry {
  std::string name;
  int priority;
  Backend* (*make)();
  Backend* dev = nullptr;
};
std::mutex& registry_mu() {
  static std::mutex m;
  return m;
}
std::vector<Entry>& registry() {
  static auto* r = new std::vector<Entry>();  // leaked: devices outlive every tensor
  return *r;
}
std::vector<std::pair<std::string, std::string>>& unavailable() {
  static auto* u = new std::vector<std::pair<std::string, std::string>>();
  return *u;
}
}  // namespace

void register_unavailable(const std::string& name, const std::string& reason) {
  std::lock_guard<std::mutex> lk(registry_mu());
  for (auto& [n, r] : unavailable())
    if (n == name) {
      r = reason;
      return;
    }
  unavailable().emplace_back(name, reason);
}

std::vector<std::pair<std::string, std::string>> unavailable_devices() {
  std::lock_guard<std::mutex> lk(registry_mu());
  return unavailable();
}

void register_device(const std::string& name, int priority, Backend* (*make)()) {
  std::lock_guard<std::mutex> lk(registry_mu());
  auto& r = registry();
  for (auto& e : r)
    if (e.name == name) return;
  r.push_back({name, priority, make});
  std::stable_sort(r.begin(), r.end(), [](const Entry& a, const Entry& b) { return a.priority > b.priority; });
}

std::vector<std::string> available_devices() {
  std::lock_guard<std::mutex> lk(registry_mu());
  std::vector<std::string> names;
  for (auto& e : registry()) names.push_back(e.name);
  return names;
}

Backend* get_device(const std::string& name) {
  std::lock_guard<std::mutex> lk(registry_mu());
  for (auto& e : registry()) {
    if (e.name == name) {
      if (!e.dev) e.dev = e.make();
      return e.dev;
    }
  }
  std::string known;
  for (auto& e : registry()) known += (known.empty() ? "" : ", ") + e.name;
  throw std::invalid_argument("[device] unknown device '" + name + "' (available: " + known + ")");
}

}  // namespace krnl
