#include "buffer_pool.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace krnl {

BufferPool::BufferPool(AllocFn alloc, FreeFn free)
    : alloc_fn_(std::move(alloc)), free_fn_(std::move(free)) {}

BufferPool::~BufferPool() {
  // Tensors may outlive a pool only at interpreter exit; the pool frees what it still holds.
  for (auto& kv : cache_)
    for (auto& b : kv.second) free_fn_(b.ptr, b.bytes);
  for (auto& r : retired_) free_fn_(r.buf.ptr, r.buf.bytes);
}

size_t BufferPool::class_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes <= 4096) return (bytes + 255) / 256 * 256;
  size_t p = 4096;
  while (p * 2 < bytes) p *= 2;  // p < bytes <= 2p
  for (size_t q = 1; q <= 4; ++q) {
    size_t c = p + p / 4 * q;
    if (c >= bytes) return c;
  }
  return 2 * p;
}

void BufferPool::collect_locked(uint64_t completed_seq) {
  auto it = std::partition(retired_.begin(), retired_.end(),
                           [&](const Retired& r) { return r.seq > completed_seq; });
  for (auto j = it; j != retired_.end(); ++j) {
    st_.pending -= j->buf.bytes;
    st_.cached += j->buf.bytes;
    cache_[j->buf.bytes].push_back(j->buf);
  }
  retired_.erase(it, retired_.end());
}

Buffer BufferPool::acquire(size_t bytes, uint64_t completed_seq) {
  const size_t cls = class_size(bytes);
  std::lock_guard<std::mutex> lk(mu_);
  collect_locked(completed_seq);
  Buffer b;
  auto it = cache_.find(cls);
  if (it != cache_.end() && !it->second.empty()) {
    b = it->second.back();
    it->second.pop_back();
    st_.cached -= cls;
    st_.reuses++;
  } else {
    void* p = alloc_fn_(cls);
    if (!p) {
      // Give cached memory back and retry once before reporting exhaustion.
      for (auto& kv : cache_)
        for (auto& c : kv.second) free_fn_(c.ptr, c.bytes);
      st_.reserved -= st_.cached;
      st_.cached = 0;
      cache_.clear();
      p = alloc_fn_(cls);
      if (!p) throw std::runtime_error("[alloc] out of memory allocating " + std::to_string(cls) + " bytes");
    }
    b.ptr = p;
    b.bytes = cls;
    b.id = next_id_++;
    st_.reserved += cls;
    st_.allocations++;
  }
  st_.in_use += cls;
  st_.peak_in_use = std::max(st_.peak_in_use, st_.in_use);
  st_.peak_reserved = std::max(st_.peak_reserved, st_.reserved);
  return b;
}

void BufferPool::release(const Buffer& b, uint64_t retire_seq, uint64_t completed_seq) {
  std::lock_guard<std::mutex> lk(mu_);
  st_.in_use -= b.bytes;
  if (retire_seq > completed_seq) {
    retired_.push_back({b, retire_seq});
    st_.pending += b.bytes;
  } else {
    cache_[b.bytes].push_back(b);
    st_.cached += b.bytes;
  }
}

void BufferPool::collect(uint64_t completed_seq) {
  std::lock_guard<std::mutex> lk(mu_);
  collect_locked(completed_seq);
}

void BufferPool::trim() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& kv : cache_)
    for (auto& b : kv.second) free_fn_(b.ptr, b.bytes);
  st_.reserved -= st_.cached;
  st_.cached = 0;
  cache_.clear();
}

PoolStats BufferPool::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return st_;
}

void BufferPool::reset_peak() {
  std::lock_guard<std::mutex> lk(mu_);
  st_.peak_in_use = st_.in_use;
  st_.peak_reserved = st_.reserved;
}

}  // namespace krnl
