// Tensor: a typed, shaped window (byte offset + strides) onto one pooled buffer of one device.
// Ops require contiguous row-major tensors; strided views exist so that slicing a column range
// is representable and rejected by ops with a clear error instead of silently misread.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "dtype.h"

namespace krnl {

class Backend;

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "(512, 2048)"

// One allocation. Pooled storage goes back to its device's pool (retired on the current
// submission) when the last tensor viewing it dies; external storage (zero-copy numpy) runs
// its release callback instead.
class Storage {
 public:
  Storage(Backend* dev, Buffer buf);
  Storage(Backend* dev, void* ptr, size_t bytes, std::function<void()> release);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* ptr() const { return buf_.ptr; }
  size_t bytes() const { return buf_.bytes; }
  uint64_t id() const { return buf_.id; }
  Backend* device() const { return dev_; }
  bool external() const { return static_cast<bool>(release_); }

 private:
  Backend* dev_;
  Buffer buf_;
  std::function<void()> release_;
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<Storage> s, size_t offset, Shape shape, DType dt);

  bool defined() const { return static_cast<bool>(storage_); }
  Backend* device() const { return storage_ ? storage_->device() : nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }  // in elements
  int64_t dim() const { return int64_t(shape_.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  size_t offset() const { return offset_; }  // bytes
  bool is_contiguous() const;
  // Elements from one row to the next, the tensor seen as (rows, last dimension): that dimension
  // when contiguous, else the leading stride of a row-strided 2-D view (ops.cpp's Check::rows).
  int64_t row_stride() const { return is_contiguous() ? size(-1) : strides_[0]; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  // Host address of the first element: valid only on host-visible devices.
  void* data() const { return static_cast<char*>(storage_->ptr()) + offset_; }
  template <class T> T* ptr() const { return static_cast<T*>(data()); }

  // Views share storage. reshape: contiguous tensors (-1 infers one dimension), or one dimension
  // of a view split in two (explicit sizes).
  Tensor reshape(const Shape& shape) const;
  Tensor slice(int64_t dim, int64_t start, int64_t stop) const;  // stop exclusive
  Tensor select(int64_t dim, int64_t index) const;                // drops dimension `dim`
  Tensor transpose() const;                                       // last two dims (strided)

  std::string describe() const;  // "f16 (31, 64) on cpu"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;
  Shape shape_, strides_;
  DType dtype_ = DType::f32;
};

}  // namespace krnl
