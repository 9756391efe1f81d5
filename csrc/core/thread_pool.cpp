#include "thread_pool.h"

#include <algorithm>
#include <cstdlib>

namespace krnl {

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < std::max(1, threads); ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int) {
  uint64_t seen = 0;
  for (;;) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_work_.wait(lk, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    while (next_ < nchunks_) {
      int64_t c = next_++;
      lk.unlock();
      int64_t b = c * chunk_, e = std::min(n_, b + chunk_);
      try {
        (*fn_)(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> g(mu_);
        if (!error_) error_ = std::current_exception();
      }
      lk.lock();
      if (++done_ == nchunks_) cv_done_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_chunks = std::max<int64_t>(1, (n + grain - 1) / grain);
  const int64_t nchunks = std::min<int64_t>(max_chunks, int64_t(size()) * 4);
  if (nchunks == 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> run(run_mu_);
  std::unique_lock<std::mutex> lk(mu_);
  fn_ = &fn;
  n_ = n;
  chunk_ = (n + nchunks - 1) / nchunks;
  nchunks_ = (n + chunk_ - 1) / chunk_;
  next_ = 0;
  done_ = 0;
  error_ = nullptr;
  ++generation_;
  cv_work_.notify_all();
  while (next_ < nchunks_) {
    int64_t c = next_++;
    lk.unlock();
    int64_t b = c * chunk_, e = std::min(n_, b + chunk_);
    try {
      fn(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> g(mu_);
      if (!error_) error_ = std::current_exception();
    }
    lk.lock();
    ++done_;
  }
  cv_done_.wait(lk, [&] { return done_ == nchunks_; });
  fn_ = nullptr;
  auto err = error_;
  error_ = nullptr;
  lk.unlock();
  if (err) std::rethrow_exception(err);
}

ThreadPool& ThreadPool::global() {
  static ThreadPool* pool = [] {
    int n = int(std::thread::hardware_concurrency());
    if (const char* e = std::getenv("KRNL_NUM_THREADS")) n = std::atoi(e);
    return new ThreadPool(std::max(1, n));  // leaked: workers must outlive static destructors
  }();
  return *pool;
}

}  // namespace krnl
