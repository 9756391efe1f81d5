"""The optimizer update ops beyond AdamW (test_ops.py has adamw_update): adamw_update's Adam form
(decoupled=False), sgd_update and lion_update against float64 numpy of their references'
updates (torch.optim.Adam, torch.optim.SGD, lion-pytorch), at awkward sizes, with their scalars
from the host and from the device (hyper, sq, flag: clipping and the skip), the working copy,
and their one-line errors."""

import math

import numpy as np
import pytest

import krnl
from krnl import ops

from conftest import FLOAT_DTYPES, SUBNORMAL, U32, assert_close_elementwise, empty_filled, read, to_dev

SIZES = [1, 31, 33, 127, 4099]
f32 = lambda x: float(np.float32(x))  # noqa: E731


def clip_ref(hyper, sq):
    """float64 grad scale of the device-scalar path: clip by the global norm sqrt(sq) * inv_denom."""
    inv_denom, max_norm = float(hyper[3]), float(hyper[4])
    norm = math.sqrt(sq) * inv_denom
    return (min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0) * inv_denom


def hyper_of(first3, inv_denom, max_norm):
    return np.array(list(first3) + [inv_denom, max_norm], np.float32)


# ---- references: one step in float64 from the previous state, each returning (params, state...)

def adam_ref(p, g, m, v, lr, b1, b2, eps, wd, step):
    """torch.optim.Adam (single-tensor path): L2 decay added to the gradient."""
    g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v) / math.sqrt(1 - b2**step) + eps
    return p - lr / (1 - b1**step) * m / denom, m, v


def sgd_ref(p, g, buf, lr, momentum, dampening, wd, nesterov, step):
    """torch.optim.SGD: L2 decay, buffer = g on the first step."""
    g = g + wd * p
    if momentum:
        buf = g.copy() if step == 1 else momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, buf


def lion_ref(p, g, m, lr, b1, b2, wd):
    """lion-pytorch's update: decay, the sign of the interpolation, then the moment."""
    p = p * (1 - lr * wd)
    c = b1 * m + (1 - b1) * g
    return p - lr * np.sign(c), b2 * m + (1 - b2) * g, c


# ---- Adam (adamw_update, decoupled=False)

@pytest.mark.parametrize("n", SIZES)
def test_adam_update(dev, n):
    """Steps 1..4 of torch's Adam with L2 weight decay strong enough to matter, from the host's
    scalars, each step from the device's previous state."""
    lr, b1, b2, eps, wd, gs = 1e-2, 0.9, 0.99, 1e-8, 0.3, 0.5
    rng = np.random.default_rng(70)
    params, m, v = to_dev(dev, rng.standard_normal(n)), dev.zeros((n,)), dev.zeros((n,))
    for step in range(1, 5):
        grads = to_dev(dev, rng.standard_normal(n))
        p0, m0, v0, g0 = read(params), read(m), read(v), read(grads)
        ops.adamw_update(params, grads, m, v, lr, b1, b2, eps, wd, step, gs, decoupled=False)
        rp, rm, rv = adam_ref(p0, g0 * f32(gs), m0, v0, f32(lr), f32(b1), f32(b2), f32(eps), f32(wd), step)
        g_mag = np.abs(g0 * gs) + np.abs(wd * p0)
        m_mag = np.abs(b1 * m0) + (1 - b1) * g_mag
        assert_close_elementwise(read(m), rm, 0.0, 8 * U32 * m_mag + SUBNORMAL["f32"], what=f"m step {step}")
        assert_close_elementwise(read(v), rv, 0.0, 16 * U32 * (b2 * v0 + g_mag**2) + SUBNORMAL["f32"],
                                 what=f"v step {step}")
        upd = lr / (1 - b1**step) * (m_mag + np.abs(rm)) / (np.sqrt(rv) / math.sqrt(1 - b2**step) + eps)
        assert_close_elementwise(read(params), rp, 0.0, 4 * U32 * np.abs(p0) + 64 * U32 * upd + SUBNORMAL["f32"],
                                 what=f"params step {step}")


def test_adam_update_device_scalars_equal_scalar_path(dev):
    """Adam's hyper holds weight_decay itself as its decay; without clipping the device path is
    the scalar path with grad_scale = inv_denom bit for bit."""
    n, lr, wd, inv_denom = 1027, 3e-3, 0.1, np.float32(1 / 8)
    rng = np.random.default_rng(71)
    p_init = rng.standard_normal(n)
    pa, pb, ma, mb, va, vb = (to_dev(dev, p_init) if i < 2 else dev.zeros((n,)) for i in range(6))
    sq = dev.zeros((1,))
    for step in (1, 2, 3):
        grads = to_dev(dev, rng.standard_normal(n) * 8)
        ops.sumsq(grads, sq)
        ops.adamw_update(pa, grads, ma, va, lr, weight_decay=wd, step=step, grad_scale=float(inv_denom),
                         decoupled=False)
        b1, b2 = float(np.float32(0.9)), float(np.float32(0.999))
        hyper = hyper_of([f32(lr) / (1 - b1**step), math.sqrt(1 - b2**step), wd], inv_denom, 0.0)
        ops.adamw_update(pb, grads, mb, vb, 0.0, hyper=to_dev(dev, hyper), sq=sq, decoupled=False)
        for a, b in ((pa, pb), (ma, mb), (va, vb)):
            np.testing.assert_array_equal(read(a, np.float32), read(b, np.float32))


# ---- SGD

SGD_CASES = {  # momentum, dampening, weight_decay, nesterov
    "plain": (0.0, 0.0, 0.0, False),
    "decay": (0.0, 0.0, 0.2, False),
    "momentum": (0.9, 0.0, 0.01, False),
    "dampening": (0.8, 0.3, 0.0, False),
    "nesterov": (0.9, 0.0, 0.05, True),
}


@pytest.mark.parametrize("case", SGD_CASES)
@pytest.mark.parametrize("n", SIZES)
def test_sgd_update(dev, n, case):
    """Steps 1..4 of torch's SGD from the host's scalars; the first step starts the buffer as the
    gradient (no dampening)."""
    momentum, dampening, wd, nesterov = SGD_CASES[case]
    lr, gs = 0.05, 2.0
    rng = np.random.default_rng(72)
    params = to_dev(dev, rng.standard_normal(n))
    buf = empty_filled(dev, (n,), "f32") if momentum else None  # NaN: step 1 must not read it
    for step in range(1, 5):
        grads = to_dev(dev, rng.standard_normal(n))
        p0, g0 = read(params), read(grads)
        b0 = read(buf) if momentum else None
        ops.sgd_update(params, grads, buf, lr, momentum, dampening, wd, nesterov, step, gs)
        rp, rb = sgd_ref(p0, g0 * gs, b0, f32(lr), f32(momentum), f32(dampening), f32(wd), nesterov, step)
        g_mag = np.abs(g0 * gs) + np.abs(wd * p0)
        mag = g_mag
        if momentum:
            b_mag = g_mag if step == 1 else momentum * np.abs(b0) + g_mag
            assert_close_elementwise(read(buf), rb, 0.0, 8 * U32 * b_mag + SUBNORMAL["f32"], what=f"buf step {step}")
            mag = g_mag + b_mag
        assert_close_elementwise(read(params), rp, 0.0, 4 * U32 * np.abs(p0) + 16 * U32 * lr * mag
                                 + SUBNORMAL["f32"], what=f"params step {step}")


# ---- Lion

@pytest.mark.parametrize("wd", [0.0, 0.5])
@pytest.mark.parametrize("n", SIZES)
def test_lion_update(dev, n, wd):
    """Steps 1..4 of lion-pytorch's update from the host's scalars. The sign of an interpolation
    within rounding of 0 may go either way: such elements are judged by the decay alone."""
    lr, b1, b2, gs = 1e-2, 0.9, 0.99, 0.25
    rng = np.random.default_rng(73)
    params, m = to_dev(dev, rng.standard_normal(n)), dev.zeros((n,))
    for step in range(1, 5):
        grads = to_dev(dev, rng.standard_normal(n))
        p0, m0, g0 = read(params), read(m), read(grads)
        ops.lion_update(params, grads, m, lr, b1, b2, wd, gs)
        rp, rm, c = lion_ref(p0, g0 * gs, m0, f32(lr), f32(b1), f32(b2), f32(wd))
        mag = np.abs(b1 * m0) + np.abs(g0 * gs)
        assert_close_elementwise(read(m), rm, 0.0, 8 * U32 * mag + SUBNORMAL["f32"], what=f"m step {step}")
        near = np.abs(c) <= 8 * U32 * mag
        tol = 4 * U32 * np.abs(p0) + 4 * U32 * lr + np.where(near, 1.01 * lr, 0.0)
        assert_close_elementwise(read(params), rp, 0.0, tol + SUBNORMAL["f32"], what=f"params step {step}")


# ---- every op's device scalars: clipping, the skip, the working copy

def run_op(op, dev, n, params, grads, state, hyper=None, sq=None, flag=None, working=None, step=1):
    """One call of `op` ('adam', 'sgd', 'lion') with fixed hyperparameters; host lr 0.1."""
    kw = dict(working=working, hyper=hyper, sq=sq, flag=flag)
    if op == "adam":
        ops.adamw_update(params, grads, state[0], state[1], 0.1, 0.9, 0.99, 1e-8, 0.1, step, 1.0, decoupled=False,
                         **kw)
    elif op == "sgd":
        ops.sgd_update(params, grads, state[0], 0.1, 0.9, 0.1, 0.1, False, step, 1.0, **kw)
    else:
        ops.lion_update(params, grads, state[0], 0.1, 0.9, 0.99, 0.1, 1.0, **kw)


def host_numbers(op, step, lr=0.1):
    """hyper[0:3] equal to the host scalars of run_op at `step`."""
    if op == "adam":
        b1, b2 = float(np.float32(0.9)), float(np.float32(0.99))
        return [f32(lr) / (1 - b1**step), math.sqrt(1 - b2**step), 0.1]
    if op == "sgd":
        return [lr, 0.0, 1.0] if step == 1 else [lr, 0.9, np.float32(1) - np.float32(0.1)]
    return [lr, np.float32(lr) * np.float32(0.1), 0.0]


OPS = ["adam", "sgd", "lion"]


@pytest.mark.parametrize("max_norm", ["off", "inactive", "active"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [31, 4099])
def test_optim_update_device_scalars(dev, op, n, max_norm):
    """hyper, sq and flag in place of the host's scalars: without clipping the scalar path with
    grad_scale = inv_denom bit for bit (params, state, an f16 working copy); with clipping the
    scalar path at the float64 clip factor, to f32 rounding."""
    inv_denom = np.float32(1 / 6)
    rng = np.random.default_rng(74)
    p_init = rng.standard_normal(n)
    a = [to_dev(dev, p_init), dev.zeros((n,)), dev.zeros((n,)), empty_filled(dev, (n,), "f16")]
    b = [to_dev(dev, p_init), dev.zeros((n,)), dev.zeros((n,)), empty_filled(dev, (n,), "f16")]
    sq, flag = dev.zeros((1,)), dev.zeros((1,), "i32")
    for step in (1, 2, 3):
        grads = to_dev(dev, rng.standard_normal(n) * 6)
        ops.sumsq(grads, sq)
        norm = math.sqrt(float(read(sq)[0])) * float(inv_denom)
        mx = {"off": 0.0, "inactive": 10 * norm, "active": 0.5 * norm}[max_norm]
        hyper = hyper_of(host_numbers(op, step), inv_denom, mx)
        gs = clip_ref(hyper, float(read(sq)[0]))
        if op == "sgd":
            ops.sgd_update(a[0], grads, a[1], 0.1, 0.9, 0.1, 0.1, False, step, gs if mx else float(inv_denom), a[3])
        elif op == "adam":
            ops.adamw_update(a[0], grads, a[1], a[2], 0.1, 0.9, 0.99, 1e-8, 0.1, step, gs if mx else float(inv_denom),
                             a[3], decoupled=False)
        else:
            ops.lion_update(a[0], grads, a[1], 0.1, 0.9, 0.99, 0.1, gs if mx else float(inv_denom), a[3])
        run_op(op, dev, n, b[0], grads, b[1:3], to_dev(dev, hyper), sq, flag, b[3], step=99)
        for i, what in enumerate(("params", "state", "state2", "working")):
            got, want = read(b[i]), read(a[i])
            if max_norm != "active":
                np.testing.assert_array_equal(got, want, err_msg=f"{op} {what} step {step}")
            elif op != "lion":  # Lion's sign hides the scale; its m shows it
                assert_close_elementwise(got, want, 1e-5, 1e-6, what=f"{op} {what} step {step}")


@pytest.mark.parametrize("why", ["flag", "sq_inf", "sq_nan"])
@pytest.mark.parametrize("op", OPS)
def test_optim_update_device_scalars_skip(dev, op, why):
    """flag[0] != 0 or a non-finite sq[0]: nothing is written; a clean call then updates."""
    n = 127
    rng = np.random.default_rng(75)
    params, grads = to_dev(dev, rng.standard_normal(n)), to_dev(dev, rng.standard_normal(n))
    state = [to_dev(dev, rng.uniform(0.1, 1.0, n)) for _ in range(2)]
    working = empty_filled(dev, (n,), "f32", 7.0)
    sq = to_dev(dev, np.array([{"flag": 4.0, "sq_inf": np.inf, "sq_nan": np.nan}[why]], np.float32))
    flag = to_dev(dev, np.array([1 if why == "flag" else 0], np.int32), "i32")
    hyper = to_dev(dev, hyper_of(host_numbers(op, 2), 0.5, 1.0))
    before = [read(t) for t in [params, working] + state]
    run_op(op, dev, n, params, grads, state, hyper, sq, flag, working)
    for t, b in zip([params, working] + state, before):
        np.testing.assert_array_equal(read(t), b, err_msg=f"{op} wrote on a skipped step ({why})")
    run_op(op, dev, n, params, grads, state, hyper, to_dev(dev, np.array([4.0], np.float32)), dev.zeros((1,), "i32"),
           working)
    assert not np.array_equal(read(params), before[0])


@pytest.mark.parametrize("wdt", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_optim_update_working_copy(dev, op, wdt):
    """`working` receives the updated params rounded to its dtype."""
    n = 1027
    rng = np.random.default_rng(76)
    params, grads = to_dev(dev, rng.standard_normal(n) * 10.0), to_dev(dev, rng.standard_normal(n))
    state = [dev.zeros((n,)), dev.zeros((n,))]
    working = empty_filled(dev, (n,), wdt)
    for step in (1, 2):
        run_op(op, dev, n, params, grads, state, working=working, step=step)
        want = np.array(params.numpy(), copy=True)
        np.testing.assert_array_equal(read(working), read(to_dev(dev, want, wdt)), err_msg=f"step {step}")


def test_optim_update_bad_calls(dev):
    """One-line errors naming the op and what is wrong."""
    z = lambda n, dt="f32": dev.zeros((n,), dt)  # noqa: E731
    cases = [
        ("sgd_update", lambda: ops.sgd_update(z(4), z(4), None, 0.1, momentum=0.9), "buf is required"),
        ("sgd_update", lambda: ops.sgd_update(z(4), z(4), z(5), 0.1, momentum=0.9), "buf"),
        ("sgd_update", lambda: ops.sgd_update(z(4), z(4), z(4), 0.1, nesterov=True), "nesterov"),
        ("sgd_update", lambda: ops.sgd_update(z(4), z(4), None, 0.1, step=0), "step is 1-based"),
        ("sgd_update", lambda: ops.sgd_update(z(4), z(4, "f16"), None, 0.1), "grads"),
        ("sgd_update", lambda: ops.sgd_update(z(4), z(4), None, 0.1, hyper=z(5)), "sq is required"),
        ("lion_update", lambda: ops.lion_update(z(4), z(4), z(3), 0.1), "m"),
        ("lion_update", lambda: ops.lion_update(z(4), z(4), z(4), 0.1, beta1=1.0), "betas"),
        ("lion_update", lambda: ops.lion_update(z(4), z(4), z(4), 0.1, hyper=z(4), sq=z(1)), "hyper"),
        ("adamw_update", lambda: ops.adamw_update(z(4), z(4), z(4), z(4), 0.1, decoupled=False, flag=z(1, "i32")),
         "flag is only read with hyper"),
    ]
    for op, call, what in cases:
        with pytest.raises(ValueError, match=rf"^\[{op}\] .*{what}"):
            call()
    other = krnl.device("cpu:1" if dev.name == "cpu" else "cpu")
    with pytest.raises(ValueError, match=r"^\[lion_update\] m is on"):
        ops.lion_update(z(4), z(4), other.zeros((4,)), 0.1)


# ---- Adafactor

def adafactor_ref(p, g, row, col, rho, w, decay, eps1, eps2, d):
    """torch.optim.Adafactor's step (single-tensor path) in float64 for p (B, R, C), row (B, R),
    col (B, C); w = 1 - beta2_t, decay = lr * weight_decay."""
    alpha = max(eps2, np.sqrt(np.mean(p * p))) * rho
    p = p * (1 - decay)
    lerp = lambda a, b: a + w * (b - a)  # noqa: E731
    row = lerp(row, np.mean(g * g, axis=-1))
    col = lerp(col, np.mean(g * g, axis=-2))
    v = row[..., :, None] * col[..., None, :] / np.maximum(np.mean(row, axis=-1), eps1)[..., None, None]
    u = g / np.sqrt(np.maximum(v, eps1 * eps1))
    return p - alpha / max(1.0, np.sqrt(np.mean(u * u)) / d) * u, row, col


ADA_SHAPES = [(1, 1), (1, 31), (33, 1), (31, 33), (127, 4), (3, 5, 7), (2, 2, 3, 5), (48, 96)]


@pytest.mark.parametrize("shape", ADA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_adafactor_update(dev, shape):
    """Steps 1..4 with torch's schedule of rho and 1 - beta2_t, weight decay and a grad scale; half
    the gradient rows tiny so eps1's floor and the update clipping both show."""
    R, C = shape[-2], shape[-1]
    B = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    rng = np.random.default_rng(77)
    params = to_dev(dev, rng.standard_normal(shape))
    row, col = dev.zeros((B * R,)), dev.zeros((B * C,))
    lr, wd, gs = 0.05, 0.1, 0.5
    for t in range(1, 5):
        g = rng.standard_normal(shape)
        g[..., ::2, :] *= 1e-4 * t
        grads = to_dev(dev, g)
        p0, g0, r0, c0 = read(params), read(grads), read(row).reshape(B, R), read(col).reshape(B, C)
        rho, w, decay = min(lr, t**-0.5), float(t) ** -0.8, f32(lr) * f32(wd)
        ops.adafactor_update(params, grads, row, col, rho, w, decay, grad_scale=gs)
        rp, rr, rc = adafactor_ref(p0.reshape(B, R, C), g0.reshape(B, R, C) * gs, r0, c0, f32(rho), f32(w), f32(decay),
                                   f32(np.finfo(np.float32).eps), f32(1e-3), 1.0)
        assert_close_elementwise(read(row), rr.reshape(-1), 1e-5, 1e-30, what=f"row step {t}")
        assert_close_elementwise(read(col), rc.reshape(-1), 1e-5, 1e-30, what=f"col step {t}")
        step = np.max(np.abs(rp - p0.reshape(B, R, C) * (1 - decay)))
        assert_close_elementwise(read(params).reshape(-1), rp.reshape(-1), 0.0,
                                 8 * U32 * np.abs(p0.reshape(-1)) + 1e-4 * step + 1e-12,
                                 what=f"params step {t}")


def test_adafactor_update_device_scalars(dev):
    """hyper [rho, 1 - beta2_t, decay, inv_denom, max_norm]: without clipping bit for bit the
    scalar path at grad_scale = inv_denom; the skip writes nothing; an f16 working copy."""
    shape, inv_denom = (31, 33), np.float32(0.25)
    rng = np.random.default_rng(78)
    p_init = rng.standard_normal(shape)
    a = [to_dev(dev, p_init), dev.zeros((31,)), dev.zeros((33,)), empty_filled(dev, shape, "f16")]
    b = [to_dev(dev, p_init), dev.zeros((31,)), dev.zeros((33,)), empty_filled(dev, shape, "f16")]
    sq, flag = dev.zeros((1,)), dev.zeros((1,), "i32")
    for t in (1, 2, 3):
        grads = to_dev(dev, rng.standard_normal(shape) * 4)
        ops.sumsq(grads, sq)
        nums = [min(0.01, t**-0.5), float(t) ** -0.8, 1e-3]
        ops.adafactor_update(a[0], grads, a[1], a[2], *nums, grad_scale=float(inv_denom), working=a[3])
        ops.adafactor_update(b[0], grads, b[1], b[2], 9.0, 0.5, 0.5, working=b[3], sq=sq, flag=flag,
                             hyper=to_dev(dev, hyper_of(nums, inv_denom, 0.0)))
        for x, y in zip(a, b):
            np.testing.assert_array_equal(read(x), read(y), err_msg=f"step {t}")
    np.testing.assert_array_equal(read(b[3]), read(to_dev(dev, read(b[0]), "f16")))
    before = [read(x) for x in b]
    ops.fill(flag, 1.0)
    ops.adafactor_update(b[0], grads, b[1], b[2], 0.0, working=b[3], sq=sq, flag=flag,
                         hyper=to_dev(dev, hyper_of(nums, inv_denom, 0.0)))
    for x, y in zip(b, before):
        np.testing.assert_array_equal(read(x), y, err_msg="written on a skipped step")


def test_adafactor_update_bad_calls(dev):
    z = lambda *s: dev.zeros(s)  # noqa: E731
    cases = [(lambda: ops.adafactor_update(z(6), z(6), z(1), z(6), 0.1), "2 dims"),
             (lambda: ops.adafactor_update(z(2, 3), z(3, 2), z(2), z(3), 0.1), "grads"),
             (lambda: ops.adafactor_update(z(2, 3), z(2, 3), z(3), z(3), 0.1), "row"),
             (lambda: ops.adafactor_update(z(2, 2, 3), z(2, 2, 3), z(4), z(3), 0.1), "col"),
             (lambda: ops.adafactor_update(z(2, 3), z(2, 3), z(2), z(3), 0.1, beta2t=1.5), "beta2t")]
    for call, what in cases:
        with pytest.raises(ValueError, match=rf"^\[adafactor_update\] .*{what}"):
            call()


# ---- Muon's two ops

def muon_momentum_ref(g, buf, mu, nesterov, eps):
    """torch.optim.Muon's momentum and the Newton-Schulz iteration's normalised start, float64."""
    buf = buf + (1 - mu) * (g - buf)
    u = g + mu * (buf - g) if nesterov else buf
    return buf, u / max(np.linalg.norm(u), eps), max(np.linalg.norm(u), eps)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_muon_momentum(dev, n, nesterov):
    """Steps 1..3 from the host's scalars; out is written whole (prefilled NaN)."""
    mu, gs = 0.95, 0.5
    rng = np.random.default_rng(79)
    buf = dev.zeros((n,))
    for step in range(1, 4):
        grads, out = to_dev(dev, rng.standard_normal(n)), empty_filled(dev, (n,), "f32")
        g0, b0 = read(grads), read(buf)
        ops.muon_momentum(grads, buf, out, mu, nesterov, 1e-7, gs)
        rb, ru, norm = muon_momentum_ref(g0 * gs, b0, f32(mu), nesterov, 1e-7)
        mag = np.abs(b0) + np.abs(g0 * gs)
        assert_close_elementwise(read(buf), rb, 0.0, 8 * U32 * mag + SUBNORMAL["f32"], what=f"buf step {step}")
        # each element a few roundings of its terms, then the norm's (a sum of n squares) error
        assert_close_elementwise(read(out), ru, 0.0, 8 * U32 * mag / norm + (4 + n**0.5) * U32 * np.abs(ru) + 1e-30,
                                 what=f"out step {step}")
    tiny = dev.zeros((n,))
    out = empty_filled(dev, (n,), "f32")
    ops.muon_momentum(dev.zeros((n,)), tiny, out, mu, nesterov, 1e-7)
    np.testing.assert_array_equal(read(out), np.zeros(n))  # a zero update stays zero (eps floor)


@pytest.mark.parametrize("n", SIZES)
def test_muon_update(dev, n):
    """params * (1 - decay) - lr * scale * update, host scalars and device scalars alike (bit for
    bit), the working copy, and the skip."""
    rng = np.random.default_rng(80)
    p_init, x = rng.standard_normal(n), to_dev(dev, rng.standard_normal(n))
    a, b = to_dev(dev, p_init), to_dev(dev, p_init)
    wa, wb = empty_filled(dev, (n,), "bf16"), empty_filled(dev, (n,), "bf16")
    ops.muon_update(a, x, 0.02, 0.002, 1.5, wa)
    want = np.float32(p_init) * (np.float32(1) - np.float32(0.002)) - np.float32(np.float32(0.02) * np.float32(1.5)) \
        * np.float32(read(x))
    assert_close_elementwise(read(a), want, 0.0, 2 * U32 * (np.abs(p_init) + 0.03 * np.abs(read(x))) + 1e-30,
                             what="params")
    sq, flag = to_dev(dev, np.array([4.0], np.float32)), dev.zeros((1,), "i32")
    hyper = to_dev(dev, hyper_of([0.02, 0.0, 0.002], 1.0, 0.0))
    ops.muon_update(b, x, 9.0, 0.5, 1.5, wb, hyper=hyper, sq=sq, flag=flag)
    np.testing.assert_array_equal(read(a), read(b))
    np.testing.assert_array_equal(read(wa), read(wb))
    ops.fill(flag, 1.0)
    ops.muon_update(b, x, 9.0, 0.5, 1.5, wb, hyper=hyper, sq=sq, flag=flag)
    np.testing.assert_array_equal(read(a), read(b))


def test_muon_device_scalars_and_skip(dev):
    """muon_momentum's grad scale from hyper, sq (clipping) and flag: as the host's at the float64
    clip factor; a non-finite step writes neither buf nor out."""
    n = 1027
    rng = np.random.default_rng(81)
    grads = to_dev(dev, rng.standard_normal(n) * 3)
    sq, flag = dev.zeros((1,)), dev.zeros((1,), "i32")
    ops.sumsq(grads, sq)
    hyper = hyper_of([0.0, 0.0, 0.0], 0.5, 1.0)
    gs = clip_ref(hyper, float(read(sq)[0]))
    ba, bb = to_dev(dev, rng.standard_normal(n)), None
    bb = to_dev(dev, read(ba))
    oa, ob = dev.zeros((n,)), dev.zeros((n,))
    ops.muon_momentum(grads, ba, oa, 0.9, True, 1e-7, gs)
    ops.muon_momentum(grads, bb, ob, 0.9, True, 1e-7, 7.0, hyper=to_dev(dev, hyper), sq=sq, flag=flag)
    assert_close_elementwise(read(bb), read(ba), 1e-6, 1e-7, what="buf")
    assert_close_elementwise(read(ob), read(oa), 1e-6, 1e-8, what="out")
    before = [read(bb), read(ob)]
    ops.fill(flag, 1.0)
    ops.muon_momentum(grads, bb, ob, 0.9, True, 1e-7, 7.0, hyper=to_dev(dev, hyper), sq=sq, flag=flag)
    np.testing.assert_array_equal(read(bb), before[0])
    np.testing.assert_array_equal(read(ob), before[1])
    with pytest.raises(ValueError, match=r"^\[muon_momentum\] .*out"):
        ops.muon_momentum(grads, bb, dev.zeros((n - 1,)))
    with pytest.raises(ValueError, match=r"^\[muon_momentum\] momentum"):
        ops.muon_momentum(grads, bb, ob, 1.0)
    with pytest.raises(ValueError, match=r"^\[muon_update\] update"):
        ops.muon_update(bb, dev.zeros((3,)), 0.1)


# ---- 8-bit AdamW (bitsandbytes' blockwise quantized moments)

def maps():
    from krnl.train.optimizers.adamw8bit import dynamic_map

    return dynamic_map(True), dynamic_map(False)


def codes_of(words, n):
    return np.asarray(words).view(np.uint8)[:n].astype(np.int64)


def quantize_ref(x, code):
    """bitsandbytes' pure-PyTorch quantize_blockwise in float64 on the f32 values: per block of 256
    the absmax and the number of midpoints below x / absmax (a partial block's absmax floored)."""
    mid = (code[:-1].astype(np.float64) + code[1:]) / 2
    n = x.size
    codes, absmax = np.empty(n, np.int64), np.empty(-(-n // 256))
    for b in range(absmax.size):
        blk = x[b * 256:(b + 1) * 256].astype(np.float64)
        am = np.max(np.abs(blk))
        absmax[b] = am if blk.size == 256 else max(am, 1e-38)
        codes[b * 256:(b + 1) * 256] = np.searchsorted(mid, np.clip(blk / max(am, 1e-38), -1, 1), side="left")
    return codes, absmax


def dequant(codes, absmax, code):
    return code[codes].astype(np.float64) * np.repeat(absmax, 256)[:codes.size]


@pytest.mark.parametrize("n", SIZES + [768])
def test_adamw8bit_update(dev, n):
    """Steps 1..4 against float64 from the device's previous (dequantized) state: the params; m and
    v requantized as bitsandbytes defines it (absmax per block, the nearest map entry), codes equal
    but where the f32 and float64 values fall on either side of a midpoint (then adjacent)."""
    lr, b1, b2, eps, wd, gs = 1e-2, 0.9, 0.999, 1e-8, 0.1, 0.5
    mmap, vmap = maps()
    words, blocks = -(-n // 4), -(-n // 256)
    rng = np.random.default_rng(82)
    params = to_dev(dev, rng.standard_normal(n))
    mc, vc = dev.zeros((words,), "i32"), dev.zeros((words,), "i32")
    ma, va = dev.zeros((blocks,)), dev.zeros((blocks,))
    dm, dv = to_dev(dev, mmap), to_dev(dev, vmap)
    for step in range(1, 5):
        g = rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 0, n)
        grads = to_dev(dev, g)
        p0, g0 = read(params), read(grads) * f32(gs)
        m0 = dequant(codes_of(mc.numpy(), n), read(ma), mmap)
        v0 = dequant(codes_of(vc.numpy(), n), read(va), vmap)
        ops.adamw8bit_update(params, grads, mc, vc, ma, va, dm, dv, lr, b1, b2, eps, wd, step, gs)
        m = f32(b1) * m0 + (1 - f32(b1)) * g0
        v = f32(b2) * v0 + (1 - f32(b2)) * g0 * g0
        denom = np.sqrt(v) / math.sqrt(1 - f32(b2) ** step) + eps
        rp = p0 * (1 - f32(lr) * f32(wd)) - f32(lr) / (1 - f32(b1) ** step) * m / denom
        upd = f32(lr) / (1 - f32(b1) ** step) * (np.abs(m) + np.abs(m0) + np.abs(g0)) / denom
        assert_close_elementwise(read(params), rp, 0.0, 4 * U32 * np.abs(p0) + 64 * U32 * upd, what=f"params {step}")
        for what, words_t, absmax_t, ref, code in (("m", mc, ma, m, mmap), ("v", vc, va, v, vmap)):
            want, want_absmax = quantize_ref(ref, code)
            got = codes_of(words_t.numpy(), n)
            assert_close_elementwise(read(absmax_t), want_absmax, 1e-5, 1e-30, what=f"{what} absmax step {step}")
            assert np.max(np.abs(got - want)) <= 1 and np.mean(got == want) >= 0.99, f"{what} codes step {step}"
    assert np.all(np.asarray(mc.numpy()).view(np.uint8)[n:4 * words] == 0), "bytes past n written"


def test_adamw8bit_update_device_scalars_and_skip(dev):
    """hyper, sq and flag: without clipping bit for bit the scalar path at grad_scale = inv_denom
    (params, codes, absmax, an f16 working copy); a non-finite step writes nothing."""
    n, lr, wd, inv_denom = 1000, 3e-3, 0.05, np.float32(0.25)
    mmap, vmap = maps()
    rng = np.random.default_rng(83)
    p_init = rng.standard_normal(n)
    sides = []
    for _ in range(2):
        sides.append([to_dev(dev, p_init), dev.zeros((250,), "i32"), dev.zeros((250,), "i32"), dev.zeros((4,)),
                      dev.zeros((4,)), empty_filled(dev, (n,), "f16")])
    a, b = sides
    dm, dv = to_dev(dev, mmap), to_dev(dev, vmap)
    sq, flag = dev.zeros((1,)), dev.zeros((1,), "i32")
    for step in (1, 2, 3):
        grads = to_dev(dev, rng.standard_normal(n) * 4)
        ops.sumsq(grads, sq)
        ops.adamw8bit_update(a[0], grads, a[1], a[2], a[3], a[4], dm, dv, lr, 0.9, 0.999, 1e-8, wd, step,
                             float(inv_denom), a[5])
        b1, b2 = float(np.float32(0.9)), float(np.float32(0.999))
        hyper = hyper_of([f32(lr) / (1 - b1**step), math.sqrt(1 - b2**step), np.float32(lr) * np.float32(wd)],
                         inv_denom, 0.0)
        ops.adamw8bit_update(b[0], grads, b[1], b[2], b[3], b[4], dm, dv, 9.0, 0.9, 0.999, 1e-8, 9.0, 99, 9.0, b[5],
                             hyper=to_dev(dev, hyper), sq=sq, flag=flag)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x.numpy()), np.asarray(y.numpy()), err_msg=f"step {step}")
    before = [np.array(x.numpy(), copy=True) for x in b]
    ops.fill(flag, 1.0)
    ops.adamw8bit_update(b[0], grads, b[1], b[2], b[3], b[4], dm, dv, 9.0, working=b[5], hyper=to_dev(dev, hyper),
                         sq=sq, flag=flag)
    for x, y in zip(b, before):
        np.testing.assert_array_equal(np.asarray(x.numpy()), y, err_msg="written on a skipped step")
    bad = [(dict(m_codes=dev.zeros((249,), "i32")), "m_codes"), (dict(v_absmax=dev.zeros((3,))), "v_absmax"),
           (dict(m_map=dev.zeros((255,))), "m_map"), (dict(v_codes=dev.zeros((250,))), "v_codes")]
    for kw, what in bad:
        args = dict(params=b[0], grads=grads, m_codes=b[1], v_codes=b[2], m_absmax=b[3], v_absmax=b[4], m_map=dm,
                    v_map=dv, lr=0.1)
        args.update(kw)
        with pytest.raises(ValueError, match=rf"^\[adamw8bit_update\] {what}"):
            ops.adamw8bit_update(**args)
