// A step on an asynchronous Metal device, portable so that metal-sim runs exactly what device.mm
// runs: the step's GPU records are cut into command buffers by the CommandBufferPolicy; a host
// record (the CPU half of a row-split GEMM) starts once every earlier record has completed except
// its own GPU half, which runs alongside it; a host write (upload) waits for the encoded or
// running work that binds its buffer; a step is complete once its last command buffer is (one
// queue runs them in order); a failed command buffer is raised at the end of its step (wait, or
// the next commit) naming its first and last ops.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>
#include <stdexcept>

#include "metal/metal_ops.h"

namespace krnl::metal {

namespace {
std::string label(const Dispatch& d) { return d.op + " (" + d.kernel + ")"; }
}  // namespace

void MetalOps::encode(Dispatch&& d) {
  if (!in_step()) throw std::logic_error("[metal] " + d.op + ": dispatch outside a step");
  for (const BufferBinding& b : d.buffers) last_use_[b.base] = open_step_;
  if (keep_log_) log_.push_back(d);
  if (d.host) {
    run_host(d);
    return;
  }
  prepare(d);
  const double ms = estimate_ms(d, cb_policy_);
  open_.push_back(std::move(d));
  if (profiling()) {
    // The dispatch alone in a command buffer, waited, so that its GPU time is the op's (the
    // records before it belong to no profiled op and were flushed by the previous one).
    const uint64_t id = flush(true);
    wait_all();
    if (profiles_device_time()) {
      std::lock_guard<std::mutex> lk(done_mu_);
      add_device_ms(timed_ms_[id]);
      timed_ms_.erase(id);
    }
  } else if (cutter_.add(ms) && rules_.split_steps) {
    flush();
  }
}

size_t MetalOps::encode_blocks(int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols,
                               const std::function<Dispatch(int64_t, int64_t, int64_t, int64_t)>& block) {
  Dispatch whole = block(0, rows, 0, cols);
  const double budget = cb_policy_.max_dispatch_ms;
  if (estimate_ms(whole, cb_policy_) <= budget) {
    encode(std::move(whole));
    return 1;
  }
  const BlockPlan p = plan_blocks(rows, cols, tile_rows, tile_cols, budget, [&](int64_t r, int64_t c) {
    return estimate_ms(block(0, r, 0, c), cb_policy_);
  });
  for (int64_t i = 0; i < rows; i += p.rows)
    for (int64_t j = 0; j < cols; j += p.cols) encode(block(i, std::min(p.rows, rows - i), j, std::min(p.cols, cols - j)));
  return size_t(p.row_blocks * p.col_blocks);
}

uint64_t MetalOps::flush(bool timed) {
  cutter_.reset();
  if (open_.empty()) return 0;
  const uint64_t id = ++submitted_;
  {
    std::lock_guard<std::mutex> lk(done_mu_);
    pending_[id] = {open_step_, ++step_cbs_, timed, label(open_.front()), label(open_.back())};
  }
  if (keep_log_) cbs_.push_back(open_.size());
  std::vector<Dispatch> records;
  records.swap(open_);
  try {
    submit(id, std::move(records), timed);
  } catch (...) {
    // Nothing of it was committed: it counts as complete, without a failure of its own to raise
    // later (its error is the one raised now).
    submission_done(id, nullptr, 0);
    std::lock_guard<std::mutex> lk(done_mu_);
    timed_ms_.erase(id);
    throw;
  }
  return id;
}

void MetalOps::wait_all() {
  if (submitted_ > done_upto_.load(std::memory_order_acquire)) wait_submission(submitted_);
}

void MetalOps::run_host(Dispatch& d) {
  const auto t0 = std::chrono::steady_clock::now();
  if (rules_.host_after_earlier) {
    // Everything before the host record's own GPU half completes first ...
    const size_t own = std::min<size_t>(d.host_overlap, open_.size());
    std::vector<Dispatch> half(std::make_move_iterator(open_.end() - long(own)), std::make_move_iterator(open_.end()));
    open_.resize(open_.size() - own);
    flush();
    wait_all();
    open_ = std::move(half);
  }
  // ... then the half runs on the GPU while the host part runs here; later records start after both.
  flush();
  try {
    d.host();
  } catch (...) {
    wait_all();  // the GPU half still uses the op's buffers
    throw;
  }
  wait_all();
  if (profiling() && profiles_device_time())
    add_device_ms(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
}

void MetalOps::upload(const Tensor& dst, const void* src) {
  auto it = last_use_.find(dst.storage()->ptr());
  if (rules_.upload_in_order && it != last_use_.end() && it->second > completed_seq()) {
    const uint64_t step = it->second;
    if (in_step() && step == open_step_) {
      flush();  // records of the open step that bind it, not yet submitted
      wait_all();
    } else {
      on_wait(step);
    }
  }
  std::memcpy(dst.data(), src, dst.nbytes());
}

void MetalOps::on_begin_step() {
  open_step_ = last_committed() + 1;
  open_.clear();
  cutter_.reset();
  step_cbs_ = 0;
  log_.clear();
  cbs_.clear();
}

void MetalOps::on_commit(uint64_t seq) {
  // The step ends with its last submission; one that submitted nothing completes with whatever
  // was submitted before it. Recorded even when the last submit throws, so the step completes.
  struct End {
    MetalOps* self;
    uint64_t seq;
    ~End() {
      std::lock_guard<std::mutex> lk(self->done_mu_);
      self->step_ends_.emplace_back(seq, self->submitted_);
    }
  };
  {
    End end{this, seq};
    flush();
  }
  if (keep_log_) {
    last_log_.swap(log_);
    last_cbs_.swap(cbs_);
  }
  const uint64_t done = completed_seq();
  for (auto i = last_use_.begin(); i != last_use_.end();) i = i->second <= done ? last_use_.erase(i) : std::next(i);
  // A failure already reported (this step's or an earlier one's) is raised now, not later.
  raise_failures(seq);
}

void MetalOps::on_wait(uint64_t seq) {
  uint64_t last = 0;
  {
    std::lock_guard<std::mutex> lk(done_mu_);
    for (const auto& [step, sub] : step_ends_)
      if (step <= seq) last = sub;
  }
  if (last > done_upto_.load(std::memory_order_acquire)) wait_submission(last);
  raise_failures(seq);
}

uint64_t MetalOps::query_completed() {
  std::lock_guard<std::mutex> lk(done_mu_);
  const uint64_t done = done_upto_.load(std::memory_order_acquire);
  while (!step_ends_.empty() && step_ends_.front().second <= done) {
    completed_step_ = step_ends_.front().first;
    step_ends_.pop_front();
  }
  return completed_step_;
}

void MetalOps::submission_done(uint64_t id, const std::string* error, double gpu_ms) {
  std::lock_guard<std::mutex> lk(done_mu_);
  auto it = pending_.find(id);
  if (it == pending_.end()) return;  // reported already
  const Pending& p = it->second;
  if (error) {
    std::string where = "step " + std::to_string(p.step) + ", command buffer " + std::to_string(p.index) + ": ";
    where += p.first == p.last ? p.first : p.first + " .. " + p.last;
    failures_.push_back({p.step, "[metal] command buffer failed: " + *error + " (" + where + ")"});
  }
  if (p.timed) timed_ms_[id] = gpu_ms;
  pending_.erase(it);
  done_ahead_.insert(id);
  uint64_t upto = done_upto_.load(std::memory_order_relaxed);
  while (done_ahead_.erase(upto + 1)) ++upto;
  done_upto_.store(upto, std::memory_order_release);
}

void MetalOps::raise_failures(uint64_t upto_step) {
  std::string first;
  {
    std::lock_guard<std::mutex> lk(done_mu_);
    for (auto i = failures_.begin(); i != failures_.end();) {
      if (i->step > upto_step) {
        ++i;
        continue;
      }
      if (first.empty()) first = i->message;
      i = failures_.erase(i);
    }
  }
  if (!first.empty()) throw std::runtime_error(first);
}

}  // namespace krnl::metal
