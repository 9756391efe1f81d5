// The optimizer ops' entry points: AdamW (and Adam, and 8-bit AdamW), SGD, Lion, Adafactor and
// Muon's two (with their device-resident scalars), sumsq and the non-finite flag.
#include <initializer_list>
#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "ops_common.h"

namespace krnl::ops {

namespace {

// The f32 state vectors of an update (each of params' length), the working copy and the
// device-resident scalars, checked alike for every optimizer op.
void check_update(Check& c, const std::initializer_list<std::pair<const char*, const Tensor*>>& flat,
                  const Tensor& working, const Tensor& hyper, const Tensor& sq, const Tensor& flag) {
  const int64_t n = flat.begin()->second->numel();
  for (auto [name, t] : flat) {
    c.tensor(name, *t);
    c.dtype(name, *t, {DType::f32});
    c.numel(name, *t, n);
  }
  if (working.defined()) {
    c.tensor("working", working);
    c.floating("working", working);
    c.numel("working", working, n);
  }
  if (hyper.defined()) {
    c.tensor("hyper", hyper);
    c.shape("hyper", hyper, {5});
    c.dtype("hyper", hyper, {DType::f32});
    if (!sq.defined()) c.fail("sq is required with hyper (the global norm comes from it)");
  } else if (sq.defined() || flag.defined()) {
    c.fail(std::string(sq.defined() ? "sq" : "flag") + " is only read with hyper; pass hyper too");
  }
  if (sq.defined()) {
    c.tensor("sq", sq);
    c.shape("sq", sq, {1});
    c.dtype("sq", sq, {DType::f32});
  }
  if (flag.defined()) {
    c.tensor("flag", flag);
    c.shape("flag", flag, {1});
    c.dtype("flag", flag, {DType::i32});
  }
}

bool in_unit(float x) { return x >= 0 && x < 1; }

}  // namespace

void adamw_update(const AdamWArgs& a) {
  Check c{"adamw_update"};
  check_update(c, {{"params", &a.params}, {"grads", &a.grads}, {"m", &a.m}, {"v", &a.v}}, a.working, a.hyper, a.sq,
               a.flag);
  if (!a.hyper.defined() && a.step < 1) c.fail("step is 1-based, got " + std::to_string(a.step));
  if (!in_unit(a.beta1) || !in_unit(a.beta2)) c.fail("betas must be in [0, 1)");
  if (!(a.eps > 0)) c.fail("eps must be > 0");
  const int64_t n = a.params.numel();
  run(c, "n=" + std::to_string(n), 16.0 * double(n), nbytes({&a.params, &a.grads, &a.m, &a.v}) * 1.75, DType::f32,
      [&] { c.dev->adamw_update(a); });
}

void sgd_update(const SgdUpdateArgs& a) {
  Check c{"sgd_update"};
  const bool momentum = a.momentum != 0.f;
  if (momentum && !a.buf.defined()) c.fail("buf is required with momentum");
  if (momentum) {
    check_update(c, {{"params", &a.params}, {"grads", &a.grads}, {"buf", &a.buf}}, a.working, a.hyper, a.sq, a.flag);
  } else {
    check_update(c, {{"params", &a.params}, {"grads", &a.grads}}, a.working, a.hyper, a.sq, a.flag);
  }
  if (!a.hyper.defined() && a.step < 1) c.fail("step is 1-based, got " + std::to_string(a.step));
  if (!(a.momentum >= 0)) c.fail("momentum must be >= 0");
  if (a.nesterov && (!momentum || a.dampening != 0.f)) c.fail("nesterov needs momentum > 0 and dampening 0");
  const int64_t n = a.params.numel();
  run(c, "n=" + std::to_string(n), 8.0 * double(n), nbytes({&a.params, &a.grads}) * (momentum ? 2.5 : 1.5), DType::f32,
      [&] { c.dev->sgd_update(a); });
}

void lion_update(const LionUpdateArgs& a) {
  Check c{"lion_update"};
  check_update(c, {{"params", &a.params}, {"grads", &a.grads}, {"m", &a.m}}, a.working, a.hyper, a.sq, a.flag);
  if (!in_unit(a.beta1) || !in_unit(a.beta2)) c.fail("betas must be in [0, 1)");
  const int64_t n = a.params.numel();
  run(c, "n=" + std::to_string(n), 10.0 * double(n), nbytes({&a.params, &a.grads, &a.m}) * 1.67, DType::f32,
      [&] { c.dev->lion_update(a); });
}

void adafactor_update(const AdafactorUpdateArgs& a) {
  Check c{"adafactor_update"};
  check_update(c, {{"params", &a.params}, {"grads", &a.grads}}, a.working, a.hyper, a.sq, a.flag);
  const Shape& s = a.params.shape();
  if (s.size() < 2) c.fail("params must have >= 2 dims (its second moment is factored over the last two)");
  c.shape("grads", a.grads, s);
  const int64_t C = s.back(), R = s[s.size() - 2], B = a.params.numel() / std::max<int64_t>(R * C, 1);
  for (auto [name, t, len] : {std::tuple<const char*, const Tensor*, int64_t>{"row", &a.row, B * R}, {"col", &a.col, B * C}}) {
    c.tensor(name, *t);
    c.dtype(name, *t, {DType::f32});
    c.numel(name, *t, len);
  }
  if (!(a.eps1 > 0) || !(a.eps2 >= 0) || !(a.d > 0)) c.fail("eps1 and d must be > 0, eps2 >= 0");
  if (!(a.beta2t >= 0 && a.beta2t <= 1)) c.fail("beta2t (the second moment's lerp weight) must be in [0, 1]");
  const int64_t n = a.params.numel();
  run(c, shape_str(s), 12.0 * double(n), nbytes({&a.params, &a.grads}) * 2.5, DType::f32,
      [&] { c.dev->adafactor_update(a); });
}

void muon_momentum(const MuonMomentumArgs& a) {
  Check c{"muon_momentum"};
  check_update(c, {{"grads", &a.grads}, {"buf", &a.buf}, {"out", &a.out}}, Tensor(), a.hyper, a.sq, a.flag);
  if (!(a.momentum >= 0 && a.momentum < 1)) c.fail("momentum must be in [0, 1)");
  if (!(a.eps > 0)) c.fail("eps must be > 0");
  const int64_t n = a.grads.numel();
  run(c, "n=" + std::to_string(n), 8.0 * double(n), nbytes({&a.grads, &a.buf, &a.out}) * 1.7, DType::f32,
      [&] { c.dev->muon_momentum(a); });
}

void muon_update(const MuonUpdateArgs& a) {
  Check c{"muon_update"};
  check_update(c, {{"params", &a.params}, {"update", &a.update}}, a.working, a.hyper, a.sq, a.flag);
  const int64_t n = a.params.numel();
  run(c, "n=" + std::to_string(n), 4.0 * double(n), nbytes({&a.params, &a.update}) * 1.5, DType::f32,
      [&] { c.dev->muon_update(a); });
}

void adamw8bit_update(const AdamW8bitArgs& a) {
  Check c{"adamw8bit_update"};
  check_update(c, {{"params", &a.params}, {"grads", &a.grads}}, a.working, a.hyper, a.sq, a.flag);
  const int64_t n = a.params.numel(), words = (n + 3) / 4, blocks = (n + 255) / 256;
  for (auto [name, t, len, dt] : {std::tuple<const char*, const Tensor*, int64_t, DType>{"m_codes", &a.m_codes, words, DType::i32},
                                  {"v_codes", &a.v_codes, words, DType::i32}, {"m_absmax", &a.m_absmax, blocks, DType::f32},
                                  {"v_absmax", &a.v_absmax, blocks, DType::f32}, {"m_map", &a.m_map, 256, DType::f32},
                                  {"v_map", &a.v_map, 256, DType::f32}}) {
    c.tensor(name, *t);
    c.dtype(name, *t, {dt});
    c.numel(name, *t, len);
  }
  if (!a.hyper.defined() && a.step < 1) c.fail("step is 1-based, got " + std::to_string(a.step));
  if (!in_unit(a.beta1) || !in_unit(a.beta2)) c.fail("betas must be in [0, 1)");
  if (!(a.eps > 0)) c.fail("eps must be > 0");
  run(c, "n=" + std::to_string(n), 40.0 * double(n), nbytes({&a.params, &a.grads}) * 1.75, DType::f32,
      [&] { c.dev->adamw8bit_update(a); });
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
