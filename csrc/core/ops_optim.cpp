// The optimizer ops' entry points: AdamW (with its device-resident scalars), sumsq and the
// non-finite flag.
#include <string>
#include <utility>

#include "ops_common.h"

namespace krnl::ops {

void adamw_update(const AdamWArgs& a) {
  Check c{"adamw_update"};
  c.tensor("params", a.params), c.tensor("grads", a.grads), c.tensor("m", a.m), c.tensor("v", a.v);
  const int64_t n = a.params.numel();
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"params", &a.params}, {"grads", &a.grads}, {"m", &a.m}, {"v", &a.v}}) {
    c.dtype(name, *t, {DType::f32});
    c.numel(name, *t, n);
  }
  if (a.working.defined()) {
    c.tensor("working", a.working);
    c.floating("working", a.working);
    c.numel("working", a.working, n);
  }
  if (a.hyper.defined()) {
    c.tensor("hyper", a.hyper);
    c.shape("hyper", a.hyper, {5});
    c.dtype("hyper", a.hyper, {DType::f32});
    if (!a.sq.defined()) c.fail("sq is required with hyper (the global norm comes from it)");
  } else if (a.sq.defined() || a.flag.defined()) {
    c.fail(std::string(a.sq.defined() ? "sq" : "flag") + " is only read with hyper; pass hyper too");
  }
  if (a.sq.defined()) {
    c.tensor("sq", a.sq);
    c.shape("sq", a.sq, {1});
    c.dtype("sq", a.sq, {DType::f32});
  }
  if (a.flag.defined()) {
    c.tensor("flag", a.flag);
    c.shape("flag", a.flag, {1});
    c.dtype("flag", a.flag, {DType::i32});
  }
  if (!a.hyper.defined() && a.step < 1) c.fail("step is 1-based, got " + std::to_string(a.step));
  if (!(a.beta1 >= 0 && a.beta1 < 1) || !(a.beta2 >= 0 && a.beta2 < 1)) c.fail("betas must be in [0, 1)");
  if (!(a.eps > 0)) c.fail("eps must be > 0");
  run(c, "n=" + std::to_string(n), 16.0 * double(n), nbytes({&a.params, &a.grads, &a.m, &a.v}) * 1.75, DType::f32,
      [&] { c.dev->adamw_update(a); });
}

void sumsq(const Tensor& x, const Tensor& out) {
  Check c{"sumsq"};
  c.tensor("x", x), c.tensor("out", out);
  c.floating("x", x);
  c.numel("out", out, 1);
  c.dtype("out", out, {DType::f32});
  run(c, shape_str(x.shape()), 2.0 * double(x.numel()), nbytes({&x}), x.dtype(), [&] { c.dev->sumsq(x, out); });
}

void nonfinite(const Tensor& x, const Tensor& flag) {
  Check c{"nonfinite"};
  c.tensor("x", x), c.tensor("flag", flag);
  c.floating("x", x);
  c.numel("flag", flag, 1);
  c.dtype("flag", flag, {DType::i32});
  run(c, shape_str(x.shape()), double(x.numel()), nbytes({&x}), x.dtype(), [&] { c.dev->nonfinite(x, flag); });
}

}  // namespace krnl::ops
