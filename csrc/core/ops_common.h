// What the op entry points share (ops.cpp defines it; each family's entry points are in
// ops_<family>.cpp, as the backends split theirs): Check, the validation of one call, and run,
// which runs a validated call. The core's own: backends include ops.h.
#pragma once
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "ops.h"

namespace krnl::ops {

// Validation of one op call: every failure names the op and the argument.
struct Check {
  const char* op;
  Backend* dev = nullptr;

  [[noreturn]] void fail(const std::string& msg) const;

  const Tensor& tensor(const char* name, const Tensor& x);
  // Defined and on the op's device; layout checked by the caller.
  const Tensor& tensor_any(const char* name, const Tensor& x);
  void dtype(const char* name, const Tensor& x, std::initializer_list<DType> ok);
  void floating(const char* name, const Tensor& x) { dtype(name, x, {DType::f32, DType::f16, DType::bf16}); }
  void same_dtype(const char* name, const Tensor& x, const char* ref_name, const Tensor& ref);
  void shape(const char* name, const Tensor& x, const Shape& want);
  void numel(const char* name, const Tensor& x, int64_t want);
  // A token-major (B, T, H, D) view on a device that takes one: rows of D contiguous, the other
  // strides positive and disjoint (no two elements share an address).
  const Tensor& token_major(const char* name, const Tensor& x);
  // Contiguous, or a row-strided 2-D view (a column block of a wider buffer).
  const Tensor& rows(const char* name, const Tensor& x);
  void rank_at_least(const char* name, const Tensor& x, int64_t r);
};

// The bytes of the given tensors (null or undefined ones count 0), for the profiler's records.
double nbytes(std::initializer_list<const Tensor*> ts);

// Runs a validated op: inside the open step, or as a one-op step; timed when profiling.
template <class F>
void run(Check& c, const std::string& shape, double flops, double bytes, DType dt, F&& body) {
  Backend* dev = c.dev;
  const bool implicit = !dev->in_step();
  if (implicit) dev->begin_step();
  try {
    if (!dev->profiling()) {
      body();
    } else {
      dev->take_device_ms();  // device time not reported inside an op belongs to none
      auto t0 = std::chrono::steady_clock::now();
      body();
      auto t1 = std::chrono::steady_clock::now();
      // One record per op: the host time of the call, or the device's own time of the op's work
      // where it measures it (Backend::profiles_device_time: Metal's GPU time per dispatch).
      const double ms = dev->profiles_device_time() ? dev->take_device_ms()
                                                    : std::chrono::duration<double, std::milli>(t1 - t0).count();
      dev->add_record({c.op, shape, dtype_name(dt), ms, flops, bytes});
    }
  } catch (...) {
    if (implicit) {  // close the one-op step; the op's own error is the one to report
      try {
        dev->commit();
      } catch (...) {
      }
    }
    throw;
  }
  // Outside the try: a failing commit (an asynchronous device's execution error) reaches the caller.
  if (implicit) dev->commit();
}

}  // namespace krnl::ops
