// Size-class buffer pool. A buffer released while its submission may still be running is
// retired with that submission's seq and handed out again only once the backend reports
// completed_seq >= seq (docs/architecture.md, 'Memory'). Where every access is queue-ordered (CPU,
// CUDA, Metal) the backend releases it for reuse at once: cached, but not given back to the system
// (trim, the limit) before that seq completes, since submitted work may still read it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace krnl {

struct Buffer {
  void* ptr = nullptr;  // host pointer, or the backend's device handle
  size_t bytes = 0;     // bytes actually allocated: the class size, or exact_size
  uint64_t id = 0;      // allocation identity (stable across reuse), for tests and profiling
  uint64_t busy = 0;    // cached for reuse at once: submitted work may use it until this seq completes
  bool exact = false;   // acquired at its own size: never cached, given back once released and complete
};

// An allocation refused by the pool's limit (set_limit); Python sees RuntimeError.
struct PoolLimitError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct PoolStats {
  size_t in_use = 0;        // bytes held by live tensors
  size_t pending = 0;       // bytes released but waiting for their submission to complete
  size_t cached = 0;        // bytes free for reuse
  size_t reserved = 0;      // in_use + pending + cached: what the pool holds from the system
  size_t peak_in_use = 0;
  size_t peak_reserved = 0;
  uint64_t allocations = 0; // calls to the system allocator
  uint64_t reuses = 0;      // acquisitions served from the cache
};

class BufferPool {
 public:
  using AllocFn = std::function<void*(size_t)>;
  using FreeFn = std::function<void(void*, size_t)>;

  // owner: the device's name, for error messages.
  BufferPool(AllocFn alloc, FreeFn free, std::string owner = "pool");
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // Bytes actually reserved for a request: multiples of 256 below 4 KiB, then four classes per
  // power of two (2^k, 1.25, 1.5, 1.75 x 2^k), so waste stays under 25%.
  static size_t class_size(size_t bytes);
  // What an exact request reserves: its size in multiples of 256 bytes.
  static size_t exact_size(size_t bytes);

  // completed_seq: the newest submission known complete; retired buffers up to it are reusable.
  // exact: a buffer of exact_size(bytes) instead of the class, which no other request reuses: for
  // what a run holds throughout (a model's weights), where a class's rounding (up to 25%) buys
  // nothing. Released, it goes back to the system once its submission completes.
  Buffer acquire(size_t bytes, uint64_t completed_seq, bool exact = false);
  // Whether acquire(bytes) would reuse a cached buffer (the completed ones collected first).
  bool has_cached(size_t bytes, uint64_t completed_seq);
  // retire_seq: the submission that may still use the buffer (0 when none does). reuse_now: the
  // device runs every access in call order, so later work may have it before retire_seq completes.
  void release(const Buffer& b, uint64_t retire_seq, uint64_t completed_seq, bool reuse_now = false);
  // Bytes that only the device's completing work can free: pending, and cached ones it may still use.
  size_t waiting(uint64_t completed_seq) const;
  // Moves retired buffers whose submission has completed to the cache.
  void collect(uint64_t completed_seq);
  // Returns cached (not pending, not in use) memory to the system, but for buffers that work
  // after completed_seq may still use (reuse_now's).
  void trim(uint64_t completed_seq = UINT64_MAX);

  PoolStats stats() const;
  void reset_peak();

  // The most bytes the pool may hold from the system (reserved), 0 for none. An acquire that
  // would pass it first gives cached buffers back, then throws a one-line std::runtime_error
  // (PoolLimitError) naming the request, the limit and `origin` (where the number came from, e.g. "the GPU's
  // recommended working set"); in-use and pending buffers are untouched. Takes effect for later
  // allocations: memory already held above a lowered limit stays until released.
  void set_limit(size_t bytes, std::string origin);
  size_t limit() const;
  std::string limit_origin() const;

  // "1.5 GiB": byte counts in messages.
  static std::string format_bytes(size_t bytes);
  // A size as people write it: bytes, or a number with a binary suffix K, M, G or T (KiB, GB, ...
  // all mean powers of 1024), e.g. "24G", "1.5GiB", "800M"; "0", "off" and "none" mean no limit
  // (0). std::invalid_argument naming `what` (the setting it came from) otherwise.
  static size_t parse_size(const std::string& text, const std::string& what);

 private:
  void collect_locked(uint64_t completed_seq);
  size_t waiting_locked(uint64_t completed_seq) const;
  // Frees cached buffers the device is done with, the largest classes first, until `need` bytes
  // are given back (all of them by default).
  void free_cached_locked(uint64_t completed_seq, size_t need = SIZE_MAX);
  struct Retired {
    Buffer buf;
    uint64_t seq;
  };
  AllocFn alloc_fn_;
  FreeFn free_fn_;
  std::string owner_;
  size_t limit_ = 0;
  std::string limit_origin_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<Buffer>> cache_;  // class size -> reusable buffers (LIFO)
  std::vector<Retired> retired_;
  PoolStats st_;
  uint64_t next_id_ = 1;
};

}  // namespace krnl
