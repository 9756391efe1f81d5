"""krnl.train.optim: the schedule against its formulas at awkward steps; AdamW over a FlatParams
against a float64 numpy AdamW (clipping, gradient accumulation, weight decay); the clipping
threshold; dynamic loss scaling (skip, halve, grow, counters); f32 NaN; state round trips."""

import math

import numpy as np
import pytest

import krnl
from krnl.train.optim import AdamW, LossScaler, Schedule
from krnl.models.params import FlatParams

SHAPES = {"layer0.A": (3, 17), "layer0.B": (33, 3), "bias": (5,)}


def make_flat(dev, dtype="f32", seed=0, shapes=SHAPES):
    fp = FlatParams(dev, shapes, compute_dtype=dtype)
    rng = np.random.default_rng(seed)
    fp.load({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()})
    return fp


def flat_of(t, n):
    return np.array(t.numpy()[:n], dtype=np.float64, copy=True)


def set_grads(fp, g):
    # Uploaded, not written through numpy(): that is a copy on devices whose memory is not
    # host-visible (cuda).
    krnl.ops.cast(fp.device.tensor(np.asarray(g, dtype=np.float32), "f32"), fp.grads[:fp.numel])


class NumpyAdamW:
    """float64 PyTorch AdamW with torch.nn.utils.clip_grad_norm_ semantics."""

    def __init__(self, p, lr_fn, betas=(0.9, 0.999), eps=1e-8, wd=0.0, max_norm=None):
        self.p = np.array(p, dtype=np.float64)
        self.m, self.v = np.zeros_like(self.p), np.zeros_like(self.p)
        self.lr_fn, self.betas, self.eps, self.wd, self.max_norm = lr_fn, betas, eps, wd, max_norm
        self.t = 0

    def step(self, g_sum, n):
        g = np.asarray(g_sum, dtype=np.float64) / n
        norm = float(np.sqrt(np.sum(g * g)))
        if self.max_norm is not None:
            g = g * min(1.0, self.max_norm / (norm + 1e-6))
        self.t += 1
        lr, (b1, b2) = self.lr_fn(self.t), self.betas
        self.p *= 1 - lr * self.wd
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        mhat, vhat = self.m / (1 - b1**self.t), self.v / (1 - b2**self.t)
        self.p -= lr * mhat / (np.sqrt(vhat) + self.eps)
        return norm


# ---- schedule


def test_schedule_cosine_values():
    s = Schedule(3e-4, warmup_steps=7, total_steps=23, kind="cosine", min_lr_ratio=0.1)
    lo = 3e-5
    for step in (1, 2, 6, 7, 8, 9, 15, 22, 23, 24, 1000):
        if step <= 7:
            ref = 3e-4 * step / 7
        else:
            prog = min(1.0, (step - 7) / 16)
            ref = lo + (3e-4 - lo) * 0.5 * (1 + math.cos(math.pi * prog))
        assert s.lr_at(step) == pytest.approx(ref, rel=1e-12), step
    assert s.lr_at(7) == pytest.approx(3e-4, rel=1e-15)  # warmup ends at the peak
    assert s.lr_at(23) == pytest.approx(lo, rel=1e-12)  # decay ends at the floor and stays
    assert s.lr_at(500) == pytest.approx(lo, rel=1e-12)
    assert s.lr_at(8) < s.lr_at(7)
    # Midpoint of the cosine: exactly halfway between peak and floor.
    s2 = Schedule(1.0, warmup_steps=0, total_steps=10, kind="cosine")
    assert s2.lr_at(5) == pytest.approx(0.5, abs=1e-15)
    assert s2.lr_at(1) == pytest.approx(0.5 * (1 + math.cos(math.pi / 10)), rel=1e-14)


def test_schedule_constant_and_linear():
    c = Schedule(0.02, warmup_steps=4, kind="constant")
    assert [c.lr_at(i) for i in (1, 2, 4, 5, 10**6)] == pytest.approx([0.005, 0.01, 0.02, 0.02, 0.02])
    lin = Schedule(1.0, warmup_steps=2, total_steps=12, kind="linear", min_lr_ratio=0.2)
    for step in (1, 2, 3, 7, 12, 13):
        ref = step / 2 if step <= 2 else 0.2 + 0.8 * (1 - min(1.0, (step - 2) / 10))
        assert lin.lr_at(step) == pytest.approx(ref, rel=1e-14), step
    # Warmup covering everything: decay phase empty, lr stays at the floor after it.
    w = Schedule(1.0, warmup_steps=5, total_steps=5, kind="cosine", min_lr_ratio=0.3)
    assert w.lr_at(5) == 1.0 and w.lr_at(6) == pytest.approx(0.3)


@pytest.mark.parametrize("kwargs, word", [
    (dict(lr=-1.0, total_steps=10), "lr"),
    (dict(lr=float("nan"), total_steps=10), "lr"),
    (dict(lr=1.0, warmup_steps=-1, total_steps=10), "warmup_steps"),
    (dict(lr=1.0, warmup_steps=2.5, total_steps=10), "warmup_steps"),
    (dict(lr=1.0, warmup_steps=11, total_steps=10), "total_steps"),
    (dict(lr=1.0, total_steps=0), "total_steps"),
    (dict(lr=1.0, kind="cosine"), "total_steps"),
    (dict(lr=1.0, total_steps=10, kind="exp"), "kind"),
    (dict(lr=1.0, total_steps=10, min_lr_ratio=1.5), "min_lr_ratio"),
])
def test_schedule_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Schedule(**kwargs)


def test_schedule_step_is_one_based_and_state_round_trip():
    s = Schedule(1e-3, warmup_steps=3, total_steps=30, kind="linear", min_lr_ratio=0.05)
    with pytest.raises(ValueError, match="1-based"):
        s.lr_at(0)
    t = Schedule(5.0, kind="constant")
    t.load_state_dict(s.state_dict())
    assert [t.lr_at(i) for i in range(1, 40)] == [s.lr_at(i) for i in range(1, 40)]


# ---- AdamW against numpy


@pytest.mark.parametrize("n_micro, max_norm, wd", [(1, None, 0.0), (3, None, 0.1), (4, 0.05, 0.01), (2, 1e3, 0.0)])
def test_adamw_matches_numpy(dev, n_micro, max_norm, wd):
    fp = make_flat(dev)
    n = fp.numel
    sched = Schedule(1e-2, warmup_steps=2, total_steps=6, kind="cosine", min_lr_ratio=0.1)
    opt = AdamW(fp, sched, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd, max_grad_norm=max_norm)
    ref = NumpyAdamW(flat_of(fp.params, n), sched.lr_at, betas=(0.8, 0.95), eps=1e-6, wd=wd, max_norm=max_norm)
    p0 = ref.p.copy()
    rng = np.random.default_rng(1)
    clipped = 0
    for step in range(1, 7):
        micro = [rng.standard_normal(n).astype(np.float32) * 0.1 * step for _ in range(n_micro)]
        g_sum = np.sum(np.array(micro, dtype=np.float32), axis=0)  # what accumulation leaves in grads
        set_grads(fp, g_sum)
        info = opt.step(accumulated_micro_batches=n_micro)
        norm = ref.step(g_sum, n_micro)
        clipped += max_norm is not None and norm > max_norm
        assert info["lr"] == pytest.approx(sched.lr_at(step), rel=1e-15)
        assert info["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert not info["skipped"] and info["loss_scale"] == 1.0
        assert np.all(flat_of(fp.grads, n) == 0), "grads must be zeroed after the step"
    got = flat_of(fp.params, n)
    # Compare the total update (~1e-2 per step), not the params (~1), so errors are visible; the
    # absolute slack is one f32 rounding of the params per step (an ulp of |p| ~ 3 is 2.4e-7).
    np.testing.assert_allclose(got - p0, ref.p - p0, rtol=2e-4, atol=6 * 2.0**-23 * np.max(np.abs(p0)))
    # The moments are running sums that may cancel: slack of a few f32 roundings of their scale.
    np.testing.assert_allclose(flat_of(opt.m, n), ref.m, rtol=1e-5, atol=1e-6 * np.max(np.abs(ref.m)))
    np.testing.assert_allclose(flat_of(opt.v, n), ref.v, rtol=1e-5, atol=1e-6 * np.max(ref.v))
    assert opt.adam_step == 6 and opt.iteration == 6
    if max_norm == 0.05:
        assert clipped == 6
    if max_norm == 1e3:
        assert clipped == 0


def test_clipping_kicks_in_exactly_above_max(dev):
    max_norm = 1.0
    rng = np.random.default_rng(2)
    d = rng.standard_normal(make_flat(dev).numel)
    d /= np.linalg.norm(d)
    b1 = 0.9
    for target, expect_clip in ((0.5, 1.0), (0.999, 1.0), (1.0 - 2e-6, 1.0), (1.01, 1.0 / (1.01 + 1e-6)),
                                (2.0, 1.0 / (2.0 + 1e-6))):
        fp = make_flat(dev)
        opt = AdamW(fp, Schedule(1e-3, kind="constant"), betas=(b1, 0.999), max_grad_norm=max_norm)
        g = (d * target).astype(np.float32)
        set_grads(fp, g)
        info = opt.step()
        assert info["grad_norm"] == pytest.approx(target, rel=1e-6)
        # First moment after one step = (1 - b1) * clip * g: reveals the clip factor exactly.
        m = flat_of(opt.m, fp.numel)
        np.testing.assert_allclose(m, (1 - b1) * expect_clip * g.astype(np.float64), rtol=1e-6, atol=1e-12)
        if expect_clip == 1.0:
            # Unclipped: bit-identical to an optimizer without clipping.
            fq = make_flat(dev)
            set_grads(fq, g)
            oq = AdamW(fq, Schedule(1e-3, kind="constant"), betas=(b1, 0.999))
            oq.step()
            assert np.array_equal(opt.m.numpy(), oq.m.numpy())
            assert np.array_equal(fp.params.numpy(), fq.params.numpy())


# ---- loss scaling


def test_loss_scaler_unit():
    s = LossScaler(True, init=64.0, growth_interval=3, factor=2.0, min_scale=16.0)
    assert s.scale == 64.0
    assert s.update(True) is True and s.scale == 32.0
    assert s.update(True) and s.scale == 16.0
    assert s.update(True) and s.scale == 16.0  # floor
    assert s.skipped_steps == 3
    assert [s.update(False) for _ in range(2)] == [False, False] and s.scale == 16.0
    s.update(False)
    assert s.scale == 32.0  # third clean step in a row grows
    s.update(False), s.update(False), s.update(True)  # a skip resets the clean-step count
    s.update(False), s.update(False)
    assert s.scale == 16.0
    s.update(False)
    assert s.scale == 32.0
    off = LossScaler(False)
    assert off.scale == 1.0 and off.update(True) is False and off.skipped_steps == 0
    t = LossScaler(True)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    with pytest.raises(ValueError, match="growth_interval"):
        LossScaler(True, growth_interval=0)


def test_f16_default_enables_scaling(dev):
    assert AdamW(make_flat(dev, "f16"), Schedule(1e-3, kind="constant")).loss_scale == 2.0**16
    if "bf16" in dev.capabilities()["dtypes"]:  # a device without bf16 kernels has no bf16 working copy
        assert AdamW(make_flat(dev, "bf16"), Schedule(1e-3, kind="constant")).loss_scale == 1.0
    assert AdamW(make_flat(dev, "f32"), Schedule(1e-3, kind="constant")).loss_scale == 1.0


def test_loss_scaling_skips_nonfinite_and_matches_unscaled(dev):
    fp = make_flat(dev, "f16")
    n = fp.numel
    sched = Schedule(1e-2, kind="constant")
    opt = AdamW(fp, sched, max_grad_norm=0.5)  # auto loss scaler, 2^16
    ref_fp = make_flat(dev, "f32")
    ref = AdamW(ref_fp, Schedule(1e-2, kind="constant"), max_grad_norm=0.5)
    rng = np.random.default_rng(3)
    g1, g2 = (rng.standard_normal(n).astype(np.float32) * 0.3 for _ in range(2))

    S = opt.loss_scale
    set_grads(fp, g1 * np.float32(S))
    info = opt.step()
    set_grads(ref_fp, g1)
    ref.step()
    assert not info["skipped"] and info["loss_scale"] == S
    assert info["grad_norm"] == pytest.approx(np.linalg.norm(g1.astype(np.float64)), rel=1e-6)

    before = {k: np.array(t.numpy(), copy=True) for k, t in
              (("p", fp.params), ("m", opt.m), ("v", opt.v), ("w", fp.working))}
    bad = g2 * np.float32(S)
    bad[7] = np.inf
    bad[11] = np.nan
    set_grads(fp, bad)
    info = opt.step()
    assert info["skipped"] and info["skipped_steps"] == 1 and opt.skipped_steps == 1
    assert opt.loss_scale == S / 2
    for k, t in (("p", fp.params), ("m", opt.m), ("v", opt.v), ("w", fp.working)):
        assert np.array_equal(before[k], t.numpy()), f"{k} changed on a skipped step"
    assert opt.adam_step == 1 and opt.iteration == 2  # Adam count held, schedule advanced
    assert np.all(flat_of(fp.grads, n) == 0), "a skipped step must still clear the grads"

    # Next clean step at the halved scale: unscaling by a power of two is exact, so it is
    # bit-identical to an f32 optimizer that never saw the bad step.
    set_grads(fp, g2 * np.float32(opt.loss_scale))
    info = opt.step()
    set_grads(ref_fp, g2)
    ref.step()
    assert not info["skipped"] and info["loss_scale"] == S / 2
    assert np.array_equal(fp.params.numpy(), ref_fp.params.numpy())
    assert np.array_equal(opt.m.numpy(), ref.m.numpy()) and np.array_equal(opt.v.numpy(), ref.v.numpy())
    # The f16 working copy is refreshed from the masters.
    assert np.array_equal(fp.working.numpy(), fp.params.numpy().astype(np.float16))


def test_loss_scale_grows_after_interval(dev):
    fp = make_flat(dev, "f16")
    opt = AdamW(fp, Schedule(1e-3, kind="constant"), loss_scaler=LossScaler(True, init=8.0, growth_interval=3))
    g = np.full(fp.numel, 0.01, np.float32)
    scales = []
    for i in range(7):
        if i == 4:
            bad = g * 8
            bad[0] = -np.inf
            set_grads(fp, bad)
        else:
            set_grads(fp, g * np.float32(opt.loss_scale))
        info = opt.step()
        scales.append(opt.loss_scale)
        assert info["skipped"] == (i == 4)
    # 3 clean -> 16; one more clean; skip -> 8; then 2 clean (no growth yet).
    assert scales == [8.0, 8.0, 16.0, 16.0, 8.0, 8.0, 8.0]
    assert opt.skipped_steps == 1 and opt.adam_step == 6


def test_f32_nan_raises_naming_step(dev):
    fp = make_flat(dev)
    opt = AdamW(fp, Schedule(1e-3, kind="constant"))
    g = np.full(fp.numel, 0.1, np.float32)
    for _ in range(2):
        set_grads(fp, g)
        opt.step()
    params = np.array(fp.params.numpy(), copy=True)
    g_bad = g.copy()
    g_bad[3] = np.nan
    set_grads(fp, g_bad)
    with pytest.raises(FloatingPointError, match="step 3"):
        opt.step()
    assert np.array_equal(params, fp.params.numpy())
    assert opt.adam_step == 2 and opt.iteration == 2


def test_bad_micro_batch_count(dev):
    opt = AdamW(make_flat(dev), Schedule(1e-3, kind="constant"))
    with pytest.raises(ValueError, match="accumulated_micro_batches"):
        opt.step(0)


# ---- state


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_state_dict_round_trip_continues_bit_identically(dev, dtype):
    sched_args = dict(lr=5e-3, warmup_steps=2, total_steps=9, kind="cosine", min_lr_ratio=0.1)
    scaler = (lambda: LossScaler(True, init=1024.0, growth_interval=2)) if dtype == "f16" else (lambda: None)
    fa = make_flat(dev, dtype)
    a = AdamW(fa, Schedule(**sched_args), weight_decay=0.05, max_grad_norm=0.3, loss_scaler=scaler())
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(fa.numel).astype(np.float32) for _ in range(8)]
    for g in grads[:4]:
        set_grads(fa, g * np.float32(a.loss_scale))
        a.step(2)
    state = a.state_dict()
    masters = fa.state()
    assert state["m"].dtype == np.float32 and state["m"].shape == (fa.numel,)

    fb = make_flat(dev, dtype, seed=99)  # different params, fresh optimizer, other settings
    b = AdamW(fb, Schedule(1.0, kind="constant"), loss_scaler=scaler())
    fb.load(masters)
    b.load_state_dict(state)
    assert b.loss_scale == a.loss_scale and b.iteration == 4
    for g in grads[4:]:
        for opt, fp in ((a, fa), (b, fb)):
            set_grads(fp, g * np.float32(opt.loss_scale))
            info = opt.step(2)
        assert info["lr"] == pytest.approx(Schedule(**sched_args).lr_at(opt.iteration))
    assert np.array_equal(fa.params.numpy(), fb.params.numpy())
    for t in ("m", "v"):
        assert np.array_equal(getattr(a, t).numpy(), getattr(b, t).numpy()), t
    assert a.state_dict()["step"] == b.state_dict()["step"] == 8


def test_load_state_dict_rejects_other_layout(dev):
    a = AdamW(make_flat(dev), Schedule(1e-3, kind="constant"))
    other = make_flat(dev, shapes={"layer0.A": (3, 17), "layer0.B": (32, 3), "bias": (5,)})
    b = AdamW(other, Schedule(1e-3, kind="constant"))
    with pytest.raises(ValueError, match="layer0.B"):
        b.load_state_dict(a.state_dict())
    state = a.state_dict()
    del state["layout"]
    with pytest.raises(ValueError, match=r"m has shape"):
        b.load_state_dict(state)


def test_load_state_dict_moves_an_earlier_order_by_name(dev):
    """A state saved with the same parameters in another order (an earlier krnl laid out each
    module's A then its B; now a layer's A come first) continues bit for bit as if saved in this
    order: each parameter's moments move to its own offsets."""
    shapes = dict(reversed(list(SHAPES.items())))
    rng = np.random.default_rng(6)
    fa, fb = make_flat(dev), make_flat(dev, shapes=shapes)
    a, b = (AdamW(f, Schedule(1e-2, kind="constant"), weight_decay=0.05) for f in (fa, fb))
    g = rng.standard_normal(fa.numel).astype(np.float32)
    set_grads(fa, g)
    a.step(1)
    fb.load(fa.state())
    b.load_state_dict(a.state_dict())
    assert not np.array_equal(a.m.numpy()[:fa.numel], b.m.numpy()[:fb.numel])  # the orders differ
    for opt, fp in ((a, fa), (b, fb)):
        by_name = {k: g[o:o + n] for k, (o, n) in fa.offsets.items()}
        set_grads(fp, np.concatenate([by_name[k] for k in fp.offsets]))
        opt.step(1)
    sa, sb = fa.state(), fb.state()
    assert all(np.array_equal(sa[k], sb[k]) for k in SHAPES)
