#include "tensor.h"

#include <algorithm>
#include <stdexcept>

#include "backend.h"

namespace krnl {

std::string shape_str(const Shape& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r += ", ";
    r += std::to_string(s[i]);
  }
  if (s.size() == 1) r += ",";
  return r + ")";
}

Storage::Storage(Backend* dev, Buffer buf) : dev_(dev), buf_(buf) {}
Storage::Storage(Backend* dev, void* ptr, size_t bytes, std::function<void()> release)
    : dev_(dev), release_(std::move(release)) {
  buf_.ptr = ptr;
  buf_.bytes = bytes;
}
Storage::~Storage() {
  if (release_)
    release_();
  else
    dev_->release_buffer(buf_);
}

static Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    s *= shape[i];
  }
  return st;
}

Tensor::Tensor(std::shared_ptr<Storage> s, size_t offset, Shape shape, DType dt)
    : storage_(std::move(s)), offset_(offset), shape_(std::move(shape)), dtype_(dt) {
  strides_ = contiguous_strides(shape_);
}

int64_t Tensor::size(int64_t d) const {
  if (d < 0) d += dim();
  if (d < 0 || d >= dim()) throw std::out_of_range("[tensor] dimension out of range for " + describe());
  return shape_[size_t(d)];
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (auto v : shape_) n *= v;
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t s = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != s) return false;
    s *= shape_[i];
  }
  return true;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (!is_contiguous()) {
    // Splitting one dimension of a strided view in two is still a view: rows of a column block,
    // (B T, n) -> (B, T, n), or a column block's columns, (S, m n) -> (S, m, n).
    size_t d = 0;
    while (d < shape_.size() && d < shape.size() && shape[d] == shape_[d]) ++d;
    const bool split = d < shape_.size() && shape.size() == shape_.size() + 1 && shape[d] > 0 && shape[d + 1] > 0 &&
                       shape[d] * shape[d + 1] == shape_[d] &&
                       std::equal(shape.begin() + long(d) + 2, shape.end(), shape_.begin() + long(d) + 1);
    if (!split)
      throw std::invalid_argument("[reshape] tensor is not contiguous (a view can only split one dimension in two): " +
                                  describe());
    Tensor t = *this;
    t.shape_ = shape;
    t.strides_.insert(t.strides_.begin() + long(d), shape[d + 1] * strides_[d]);
    return t;
  }
  Shape out = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      if (infer >= 0) throw std::invalid_argument("[reshape] more than one -1 in " + shape_str(shape));
      infer = int64_t(i);
    } else if (out[i] < 0) {
      throw std::invalid_argument("[reshape] negative dimension in " + shape_str(shape));
    } else {
      known *= out[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel() % known) throw std::invalid_argument("[reshape] cannot infer -1 for " + shape_str(shape) + " from " + describe());
    out[size_t(infer)] = numel() / known;
    known *= out[size_t(infer)];
  }
  if (known != numel())
    throw std::invalid_argument("[reshape] " + shape_str(shape) + " does not hold " + std::to_string(numel()) + " elements of " + describe());
  Tensor t = *this;
  t.shape_ = out;
  t.strides_ = contiguous_strides(out);
  return t;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t stop) const {
  if (d < 0) d += dim();
  if (d < 0 || d >= dim()) throw std::invalid_argument("[slice] dimension out of range for " + describe());
  int64_t n = shape_[size_t(d)];
  if (start < 0) start += n;
  if (stop < 0) stop += n;
  start = std::max<int64_t>(0, std::min(start, n));
  stop = std::max(start, std::min(stop, n));
  Tensor t = *this;
  t.offset_ += size_t(start * strides_[size_t(d)]) * dtype_size(dtype_);
  t.shape_[size_t(d)] = stop - start;
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  if (d < 0) d += dim();
  if (d < 0 || d >= dim()) throw std::invalid_argument("[select] dimension out of range for " + describe());
  int64_t n = shape_[size_t(d)];
  if (index < 0) index += n;
  if (index < 0 || index >= n) throw std::out_of_range("[select] index out of range for " + describe());
  Tensor t = *this;
  t.offset_ += size_t(index * strides_[size_t(d)]) * dtype_size(dtype_);
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::transpose() const {
  if (dim() < 2) throw std::invalid_argument("[transpose] needs at least 2 dimensions: " + describe());
  Tensor t = *this;
  std::swap(t.shape_[t.shape_.size() - 1], t.shape_[t.shape_.size() - 2]);
  std::swap(t.strides_[t.strides_.size() - 1], t.strides_[t.strides_.size() - 2]);
  return t;
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  std::string r = std::string(dtype_name(dtype_)) + " " + shape_str(shape_);
  if (!is_contiguous()) r += " non-contiguous";
  return r + " on " + device()->name();
}

}  // namespace krnl

namespace krnl {

DType dtype_from_name(const std::string& n) {
  if (n == "f32" || n == "float32") return DType::f32;
  if (n == "f16" || n == "float16") return DType::f16;
  if (n == "bf16" || n == "bfloat16") return DType::bf16;
  if (n == "i32" || n == "int32") return DType::i32;
  throw std::invalid_argument("[dtype] unknown dtype '" + n + "' (use f32, f16, bf16 or i32)");
}

}  // namespace krnl
