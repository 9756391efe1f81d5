"""Each optimizer holds exactly the state it reads (krnl.train.optimizers): the pool bytes
its construction reserves against the memory estimate's count (krnl.train.memory_resident's
optimizer_state), 8-bit AdamW's saving over AdamW from the shapes, no moment for plain SGD, and
states of the earlier layout (every state vector as long as the params) resuming bit for bit."""

import numpy as np
import pytest

import krnl
from krnl.models.params import FlatParams
from krnl.train.memory import class_size
from krnl.train.memory_resident import E, optimizer_state
from krnl.train.optim import OPTIMIZERS, SGD, AdamW, AdamW8bit, Muon, Schedule

from test_optim import set_grads

# Sizes chosen so that every buffer is a whole size class of the pool: the four 4096-element
# factors are quantized at MIN_8BIT, the two 2048-element ones (one 3-D: Muon's AdamW one) not.
SHAPES = {"l0.q.lora_A.weight": (16, 256), "l0.q.lora_B.weight": (256, 16), "l0.v.lora_A.weight": (16, 256),
          "l0.v.lora_B.weight": (256, 16), "l0.o.lora_A.weight": (8, 256), "l0.experts.lora_A.weight": (2, 8, 128)}
MIN_8BIT = 4096
SMALL = 2 * 256  # the base's (1,) f32 and i32: the norm and the inf/NaN flag, a class each


@pytest.fixture
def cpu1():
    """A CPU device of its own: no other test's buffers in its pool."""
    return krnl.device("cpu:1")


def flat_params(dev, shapes=SHAPES, seed=0):
    fp = FlatParams(dev, shapes)
    rng = np.random.default_rng(seed)
    fp.load({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()})
    return fp


def reserved_by(dev, make):
    """(what make() returns, the pool bytes its allocations reserved)."""
    dev.trim()  # no cached buffer for the optimizer's requests to take
    before = dev.pool_stats()["reserved"]
    out = make()
    return out, dev.pool_stats()["reserved"] - before


CASES = {"adamw": {}, "adam": {}, "sgd": {}, "sgd-momentum": dict(momentum=0.9), "lion": {}, "adafactor": {},
         "muon": {}, "adamw8bit": dict(min_8bit_size=MIN_8BIT)}


@pytest.mark.parametrize("case", CASES)
def test_resident_state_is_what_the_estimate_counts(cpu1, case):
    """The pool bytes an optimizer's construction reserves, and its state tensors themselves, are
    those optimizer_state lists for it (what krnl plan counts)."""
    kw = CASES[case]
    fp = flat_params(cpu1)
    opt, got = reserved_by(cpu1, lambda: OPTIMIZERS[case.split("-")[0]](fp, Schedule(1e-3, kind="constant"), **kw))
    state = optimizer_state(opt.name, SHAPES, kw.get("min_8bit_size", 4096), kw.get("momentum", 0.0))
    assert got == SMALL + sum(class_size(np.prod(s) * E[dt]) for s, dt in state), case
    tensors = [getattr(opt, a) for a in list(opt.state.values()) + ["m_map", "v_map"] if hasattr(opt, a)]
    assert sorted((tuple(t.shape), t.dtype) for t in tensors) == sorted(state)


def test_eight_bit_adamw_holds_no_f32_moment_of_a_quantized_parameter(cpu1):
    """AdamW8bit reserves less than AdamW by the two f32 moments of its quantized parameters less
    their codes (a byte each per moment), block scales and two maps; f32 moments stay only for
    the small parameters."""
    fp = flat_params(cpu1)
    sizes = {k: int(np.prod(s)) for k, s in SHAPES.items()}
    quantized = sum(n for n in sizes.values() if n >= MIN_8BIT)
    small = fp.numel - quantized
    assert quantized and small
    adamw, full = reserved_by(cpu1, lambda: AdamW(fp, Schedule(1e-3, kind="constant")))
    del adamw
    eight, reserved = reserved_by(cpu1, lambda: AdamW8bit(fp, Schedule(1e-3, kind="constant"), min_8bit_size=MIN_8BIT))
    f32_moments = 2 * 4 * quantized
    codes_and_scales = 2 * quantized + 2 * 4 * (quantized // 256) + 2 * 4 * 256
    assert full - reserved == f32_moments - codes_and_scales
    assert full - reserved > 0.7 * f32_moments
    assert eight.m.shape == eight.v.shape == (small,)
    assert eight.state_dict()["m"].shape == (small,)


def test_plain_sgd_allocates_no_moment(cpu1):
    fp = flat_params(cpu1)
    sgd, got = reserved_by(cpu1, lambda: SGD(fp, Schedule(1e-3, kind="constant")))
    assert got == SMALL and sgd.m is None and set(sgd.state_dict()) & {"buf", "m", "v"} == set()
    assert not hasattr(fp, "m") and not hasattr(fp, "v")
    momentum, got = reserved_by(cpu1, lambda: SGD(fp, Schedule(1e-3, kind="constant"), momentum=0.9))
    assert got == SMALL + class_size(4 * fp.numel) and momentum.m.shape == (fp.numel,)


def earlier_layout(opt, state):
    """`state` as krnl saved it before each optimizer held its own state: m and v as long as the
    params, zero over the parameters the optimizer does not keep them for."""
    out = dict(state)
    for key in ("m", "v"):
        full = np.zeros(opt.flat.numel, np.float32)
        for k, (o, size) in opt.layouts[key].offsets.items():
            full[opt.flat.offsets[k][0]:opt.flat.offsets[k][0] + size] = state[key][o:o + size]
        out[key] = full
    return out


@pytest.mark.parametrize("case", ["adamw8bit", "muon"])
def test_a_state_of_the_earlier_layout_resumes_bit_for_bit(cpu1, case):
    kw, cls = CASES[case], OPTIMIZERS[case]
    fa = flat_params(cpu1)
    a = cls(fa, Schedule(1e-2, kind="constant"), weight_decay=0.05, **kw)
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(fa.numel).astype(np.float32) for _ in range(6)]
    for g in grads[:3]:
        set_grads(fa, g)
        a.step()
    state = earlier_layout(a, a.state_dict())
    assert state["v"].shape == (fa.numel,) and a.state_dict()["v"].shape != (fa.numel,)
    fb = flat_params(cpu1, seed=9)
    fb.load(fa.state())
    b = cls(fb, Schedule(1e-2, kind="constant"), **kw)
    b.load_state_dict(state)
    for g in grads[3:]:
        for opt, fp in ((a, fa), (b, fb)):
            set_grads(fp, g)
            opt.step()
    assert np.array_equal(fa.params.numpy(), fb.params.numpy())
    sa, sb = a.state_dict(), b.state_dict()
    assert all(np.array_equal(sa[k], sb[k]) for k in a.state)


def test_a_packed_state_saved_in_another_order_moves_by_name(cpu1):
    """Muon's v covers only its AdamW parameters: saved in an earlier order of the parameters, each
    one's moments still land on its own offsets."""
    shapes = dict(reversed(list(SHAPES.items())))
    fa, fb = flat_params(cpu1), flat_params(cpu1, shapes)
    a, b = Muon(fa, Schedule(1e-2, kind="constant")), Muon(fb, Schedule(1e-2, kind="constant"))
    g = np.random.default_rng(8).standard_normal(fa.numel).astype(np.float32)
    set_grads(fa, g)
    a.step()
    fb.load(fa.state())
    b.load_state_dict(a.state_dict())
    by_name = {k: g[o:o + n] for k, (o, n) in fa.offsets.items()}
    for opt, fp in ((a, fa), (b, fb)):
        set_grads(fp, np.concatenate([by_name[k] for k in fp.offsets]))
        opt.step()
    sa, sb = fa.state(), fb.state()
    assert all(np.array_equal(sa[k], sb[k]) for k in SHAPES)
    assert all(np.array_equal(a.view("v", k).numpy(), b.view("v", k).numpy()) for k in a.others)
