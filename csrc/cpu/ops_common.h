// Helpers shared by the CPU backend's op files (norm.cpp, elementwise.cpp, attention.cpp): a
// tensor's row count as rows of its last dimension.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace krnl::cpu {

// Row count of a tensor seen as (rows, cols), cols being its last dimension.
inline int64_t rows_of(const Tensor& t, int64_t cols) { return cols ? t.numel() / cols : 0; }

}  // namespace krnl::cpu
