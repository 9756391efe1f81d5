// A small fixed thread pool for elementwise and reduction loops. The calling thread takes a
// share of the work, so parallel_for on a 1-thread pool is a plain loop.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace krnl {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // total threads including the caller
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Calls fn(begin, end) over [0, n) in chunks of at least `grain`; returns when all are done.
  // The first exception thrown by any chunk is rethrown here.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // The process-wide pool: KRNL_NUM_THREADS, else the hardware's thread count.
  static ThreadPool& global();

 private:
  void worker_loop(int index);
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 0, nchunks_ = 0;
  int64_t next_ = 0, done_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::mutex run_mu_;  // one parallel_for at a time
};

}  // namespace krnl
