#include "buffer_pool.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <stdexcept>
#include <string>

namespace krnl {

BufferPool::BufferPool(AllocFn alloc, FreeFn free, std::string owner)
    : alloc_fn_(std::move(alloc)), free_fn_(std::move(free)), owner_(std::move(owner)) {}

BufferPool::~BufferPool() {
  // Tensors may outlive a pool only at interpreter exit; the pool frees what it still holds.
  for (auto& kv : cache_)
    for (auto& b : kv.second) free_fn_(b.ptr, b.bytes);
  for (auto& r : retired_) free_fn_(r.buf.ptr, r.buf.bytes);
}

size_t BufferPool::exact_size(size_t bytes) { return std::max<size_t>(1, (bytes + 255) / 256) * 256; }

size_t BufferPool::class_size(size_t bytes) {
  if (bytes <= 4096) return exact_size(bytes);  // below 4 KiB the classes are the 256-byte steps
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
    if (j->buf.exact) {
      free_fn_(j->buf.ptr, j->buf.bytes);
      st_.reserved -= j->buf.bytes;
      continue;
    }
    st_.cached += j->buf.bytes;
    cache_[j->buf.bytes].push_back(j->buf);
  }
  retired_.erase(it, retired_.end());
}

Buffer BufferPool::acquire(size_t bytes, uint64_t completed_seq, bool exact) {
  const size_t cls = exact ? exact_size(bytes) : class_size(bytes);
  std::lock_guard<std::mutex> lk(mu_);
  collect_locked(completed_seq);
  Buffer b;
  auto it = exact ? cache_.end() : cache_.find(cls);
  if (it != cache_.end() && !it->second.empty()) {
    b = it->second.back();
    it->second.pop_back();
    b.busy = 0;
    st_.cached -= cls;
    st_.reuses++;
  } else {
    if (limit_ && st_.reserved + cls > limit_) {
      // Cached buffers are the pool's own to give back, as many as the request needs (the rest
      // serve later requests of their class: a capped step frees a few buffers, not its cache);
      // pending ones may still be read by the device and in-use ones are live tensors: those
      // count until released and completed.
      free_cached_locked(completed_seq, st_.reserved + cls - limit_);
      if (st_.reserved + cls > limit_)
        throw PoolLimitError(
            "[alloc] " + owner_ + ": a request of " + format_bytes(bytes) + " would take the pool to " +
            format_bytes(st_.reserved + cls) + ", past its limit of " + format_bytes(limit_) + " (" + limit_origin_ +
            "; " + format_bytes(st_.in_use) + " in use, " + format_bytes(waiting_locked(completed_seq)) +
            " waiting for the device); change it with KRNL_MAX_MEMORY or Device.set_memory_limit()");
    }
    void* p = alloc_fn_(cls);
    if (!p) {
      // Give cached memory back and retry once before reporting exhaustion.
      free_cached_locked(completed_seq);
      p = alloc_fn_(cls);
      if (!p) throw std::runtime_error("[alloc] out of memory allocating " + std::to_string(cls) + " bytes");
    }
    b.ptr = p;
    b.bytes = cls;
    b.exact = exact;
    b.id = next_id_++;
    st_.reserved += cls;
    st_.allocations++;
  }
  st_.in_use += cls;
  st_.peak_in_use = std::max(st_.peak_in_use, st_.in_use);
  st_.peak_reserved = std::max(st_.peak_reserved, st_.reserved);
  return b;
}

void BufferPool::release(const Buffer& b, uint64_t retire_seq, uint64_t completed_seq, bool reuse_now) {
  std::lock_guard<std::mutex> lk(mu_);
  st_.in_use -= b.bytes;
  if (b.exact && retire_seq <= completed_seq) {  // no other request could reuse it
    free_fn_(b.ptr, b.bytes);
    st_.reserved -= b.bytes;
  } else if (b.exact || (retire_seq > completed_seq && !reuse_now)) {
    retired_.push_back({b, retire_seq});
    st_.pending += b.bytes;
  } else {
    Buffer c = b;
    c.busy = retire_seq > completed_seq ? retire_seq : 0;
    cache_[b.bytes].push_back(c);
    st_.cached += b.bytes;
  }
}

bool BufferPool::has_cached(size_t bytes, uint64_t completed_seq) {
  std::lock_guard<std::mutex> lk(mu_);
  collect_locked(completed_seq);
  auto it = cache_.find(class_size(bytes));
  return it != cache_.end() && !it->second.empty();
}

size_t BufferPool::waiting_locked(uint64_t completed_seq) const {
  size_t n = st_.pending;
  for (const auto& kv : cache_)
    for (const Buffer& b : kv.second) n += b.busy > completed_seq ? b.bytes : 0;
  return n;
}

size_t BufferPool::waiting(uint64_t completed_seq) const {
  std::lock_guard<std::mutex> lk(mu_);
  return waiting_locked(completed_seq);
}

void BufferPool::collect(uint64_t completed_seq) {
  std::lock_guard<std::mutex> lk(mu_);
  collect_locked(completed_seq);
}

void BufferPool::free_cached_locked(uint64_t completed_seq, size_t need) {
  size_t freed = 0;
  for (auto it = cache_.end(); it != cache_.begin() && freed < need;) {
    --it;  // classes from the largest down
    auto& bufs = it->second;
    // the device's busy ones first, in their order; the free ones behind them, the last released last
    std::stable_partition(bufs.begin(), bufs.end(), [&](const Buffer& b) { return b.busy > completed_seq; });
    while (!bufs.empty() && bufs.back().busy <= completed_seq && freed < need) {
      free_fn_(bufs.back().ptr, bufs.back().bytes);
      st_.reserved -= bufs.back().bytes;
      st_.cached -= bufs.back().bytes;
      freed += bufs.back().bytes;
      bufs.pop_back();
    }
    if (bufs.empty()) it = cache_.erase(it);  // the next larger class, or end(): --it goes on below
  }
}

void BufferPool::trim(uint64_t completed_seq) {
  std::lock_guard<std::mutex> lk(mu_);
  free_cached_locked(completed_seq);
}

void BufferPool::set_limit(size_t bytes, std::string origin) {
  std::lock_guard<std::mutex> lk(mu_);
  limit_ = bytes;
  limit_origin_ = bytes ? std::move(origin) : std::string();
}

size_t BufferPool::limit() const {
  std::lock_guard<std::mutex> lk(mu_);
  return limit_;
}

std::string BufferPool::limit_origin() const {
  std::lock_guard<std::mutex> lk(mu_);
  return limit_origin_;
}

size_t BufferPool::parse_size(const std::string& text, const std::string& what) {
  std::string t;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) t += char(std::tolower(static_cast<unsigned char>(c)));
  if (t == "off" || t == "none") return 0;
  const auto bad = [&] {
    return std::invalid_argument("[" + what + "] cannot read '" + text +
                                 "' as a size: give bytes or a number with K, M, G or T (powers of 1024), "
                                 "e.g. 24G, or 'off' for no limit");
  };
  size_t digits = 0;
  while (digits < t.size() && (std::isdigit(static_cast<unsigned char>(t[digits])) || t[digits] == '.')) ++digits;
  if (digits == 0) throw bad();
  char* end = nullptr;
  const std::string num = t.substr(0, digits);
  const double v = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size() || !std::isfinite(v)) throw bad();
  std::string unit = t.substr(digits);
  if (unit.size() > 1 && unit.back() == 'b') unit.pop_back();  // "gb", "gib" -> "g", "gi"
  if (unit.size() > 1 && unit.back() == 'i') unit.pop_back();
  double scale = 1;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "k") scale = 1024.0;
  else if (unit == "m") scale = 1024.0 * 1024;
  else if (unit == "g") scale = 1024.0 * 1024 * 1024;
  else if (unit == "t") scale = 1024.0 * 1024 * 1024 * 1024;
  else throw bad();
  const double bytes = v * scale;
  if (bytes >= 18446744073709551615.0) throw bad();
  return size_t(bytes);
}

std::string BufferPool::format_bytes(size_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
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
