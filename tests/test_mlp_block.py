"""The W1 block (krnl.models.mlp_block.MLPBlock) against a float64 numpy forward and backward written
here, at a small awkward size; LoRA gradients also against central finite differences of
L = sum(y * dy) through the block's own forward; AdamW steps keep frozen weights bit-identical.

    h = rmsnorm(x) * w_norm
    g = h Wg^T + s (h Ag^T) Bg^T        u = h Wu^T + s (h Au^T) Bu^T
    a = silu(g) * u                     y = x + a Wd^T
"""

import numpy as np
import pytest

from krnl import ops
from krnl.models.mlp_block import LORA_NAMES, MLPBlock, make_w1_params

T, C, F, R = 33, 64, 96, 4
SCALE = 1.5
EPS = 1e-5
FROZEN = ("w_norm", "Wg", "Wu", "Wd")

# Tolerances, as max|got - ref| / max|ref| per output.
# f32: every op accumulates in f32 over at most K = 96 terms; the worst chains (dx through six
# GEMMs, SwiGLU and the RMSNorm backward) stay around 1e-6 of the output's scale. 2e-5 leaves
# headroom but would catch any wrong term (those are O(1e-2) and above).
# f16/bf16: activations and weights are stored in the compute dtype after every op, so each stored
# intermediate adds up to one unit roundoff u (f16 2^-11 = 4.9e-4, bf16 2^-8 = 3.9e-3) relative
# to its own scale. The longest stored chain (x -> h -> t -> g -> da -> dg -> dt -> dh -> dx) has
# about 8 roundings, so the worst case is ~8u (f16 3.9e-3, bf16 3.1e-2); the bounds are 2.5x
# (f16) and 2x (bf16) that. Inputs are rounded to the dtype before the reference sees them, so
# input quantisation is not part of the error.
RTOL = {"f32": 2e-5, "f16": 1e-2, "bf16": 6e-2}


def reference(P, s=SCALE, eps=EPS):
    """float64 forward and backward of the block with cotangent P['dy']."""
    P = {k: np.asarray(v, np.float64) for k, v in P.items()}
    x, dy, w = P["x"], P["dy"], P["w_norm"]
    Wg, Wu, Wd = P["Wg"], P["Wu"], P["Wd"]
    Ag, Bg, Au, Bu = P["Ag"], P["Bg"], P["Au"], P["Bu"]
    r = 1.0 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps)
    xh = x * r
    h = xh * w
    tg, tu = h @ Ag.T, h @ Au.T
    g = h @ Wg.T + s * (tg @ Bg.T)
    u = h @ Wu.T + s * (tu @ Bu.T)
    sig = 1.0 / (1.0 + np.exp(-g))
    silu = g * sig
    a = silu * u
    y = x + a @ Wd.T
    # backward
    da = dy @ Wd
    du = da * silu
    dg = da * u * (sig + g * sig * (1.0 - sig))  # d silu/dg = sig (1 + g (1 - sig))
    out = {"y": y}
    dh = np.zeros_like(h)
    for dz, t, A, B, W, nA, nB in ((dg, tg, Ag, Bg, Wg, "Ag", "Bg"), (du, tu, Au, Bu, Wu, "Au", "Bu")):
        out[nB] = s * dz.T @ t          # (F, R)
        dt = s * dz @ B                 # (T, R)
        out[nA] = dt.T @ h              # (R, C)
        dh += dz @ W + dt @ A
    dxh = dh * w
    out["dx"] = r * (dxh - xh * np.mean(dxh * xh, axis=1, keepdims=True)) + dy
    return out


def round_to(x, dtype):
    """float32 values rounded to `dtype` (round to nearest, ties to even), as float64."""
    x32 = np.ascontiguousarray(x, np.float32)
    if dtype == "f32":
        return x32.astype(np.float64)
    if dtype == "f16":
        return x32.astype(np.float16).astype(np.float64)
    u = x32.view(np.uint32).astype(np.uint64)
    lo = u & 0xFFFF0000
    rem = u & 0xFFFF
    up = (rem > 0x8000) | ((rem == 0x8000) & (((lo >> 16) & 1) == 1))
    return (lo + up.astype(np.uint64) * 0x10000).astype(np.uint32).view(np.float32).astype(np.float64)


def _loss64(P, s=SCALE, eps=EPS):
    return float(np.sum(reference(P, s, eps)["y"] * np.asarray(P["dy"], np.float64)))


def _params(seed=0):
    return make_w1_params(T, C, F, R, seed=seed)


def _quantised(P, dtype):
    """What the device holds: every input rounded to the compute dtype (LoRA working copies too)."""
    return {k: round_to(v, dtype) for k, v in P.items()}


def _run(dev, P, dtype):
    blk = MLPBlock(dev, P, T, scale=SCALE, eps=EPS, dtype=dtype)
    x = dev.tensor(P["x"], dtype)
    dy = dev.tensor(P["dy"], dtype)
    with dev.step():
        blk.forward(x)
        blk.backward(x, dy)
    got = {"y": np.array(blk.y.numpy(), np.float64), "dx": np.array(blk.dx.numpy(), np.float64)}
    for k in LORA_NAMES:
        g = blk.grads[k].numpy()
        assert g.dtype == np.float32  # LoRA gradients stay f32 whatever the compute dtype
        got[k] = np.array(g, np.float64)
    return blk, x, dy, got


def _rel_err(got, ref):
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def test_reference_matches_its_own_finite_differences():
    # The oracle's backward, checked in float64 against central differences of its forward, so a
    # failure below points at the block, not at the test.
    P = {k: v.astype(np.float64) for k, v in _params(1).items()}
    ref = reference(P)
    rng = np.random.default_rng(5)
    h = 1e-6
    for k in LORA_NAMES + ("x",):
        grad = ref[k if k != "x" else "dx"]
        for _ in range(3):
            idx = tuple(int(rng.integers(0, n)) for n in P[k].shape)
            Pp = dict(P)
            Pp[k] = P[k].copy()
            Pp[k][idx] += h
            Lp = _loss64(Pp)
            Pp[k][idx] -= 2 * h
            Lm = _loss64(Pp)
            fd = (Lp - Lm) / (2 * h)
            assert fd == pytest.approx(grad[idx], rel=1e-6, abs=1e-9), (k, idx)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_block_matches_float64_reference(dev, dtype):
    P = _params(0)
    _blk, _x, _dy, got = _run(dev, P, dtype)
    ref = reference(_quantised(P, dtype))
    tol = RTOL[dtype]
    for k in ("y", "dx") + LORA_NAMES:
        assert got[k].shape == ref[k].shape, k
        assert np.all(np.isfinite(got[k])), k
        err = _rel_err(got[k], ref[k])
        assert err <= tol, f"{dtype} {k}: max error {err:.3e} of max|ref| > {tol:.1e}"


def test_block_lora_gradients_match_finite_differences(dev):
    """Central differences of L = sum(y * dy), with y from the block's own f32 forward on the
    device, at random coordinates and at each factor's largest-gradient coordinate."""
    P = _params(2)
    blk, x, dy, got = _run(dev, P, "f32")
    dy64 = np.asarray(P["dy"], np.float64)
    flat = blk.lora_params.params
    n = flat.numel
    master = np.concatenate([P[k].reshape(-1) for k in LORA_NAMES]).astype(np.float32)
    pristine = dev.tensor(master, "f32")
    offsets, off = {}, 0
    for k in LORA_NAMES:
        offsets[k] = off
        off += P[k].size
    assert off == n

    def loss_with(flat_index, delta):
        """L with master[flat_index] += delta (through axpy on the device), and the step taken."""
        onehot = np.zeros(n, np.float32)
        onehot[flat_index] = 1.0
        e = dev.tensor(onehot, "f32")
        with dev.step():
            ops.scale(pristine, 1.0, flat)       # restore the unperturbed parameters
            ops.axpy(delta, e, flat)             # perturb one coordinate
            y = blk.forward(x)
        actual = float(np.float32(master[flat_index]) + np.float32(delta)) - float(master[flat_index])
        return float(np.sum(np.asarray(y.numpy(), np.float64) * dy64)), actual

    rng = np.random.default_rng(6)
    eps = 2e-3
    for k in LORA_NAMES:
        g = got[k]
        scale_k = float(np.max(np.abs(g)))
        assert scale_k > 1e-4, f"degenerate gradient for {k}"
        coords = [np.unravel_index(int(np.argmax(np.abs(g))), g.shape)]
        coords += [tuple(int(rng.integers(0, d)) for d in g.shape) for _ in range(3)]
        for idx in coords:
            fi = offsets[k] + int(np.ravel_multi_index(idx, g.shape))
            Lp, hp = loss_with(fi, eps)
            Lm, hm = loss_with(fi, -eps)
            fd = (Lp - Lm) / (hp - hm)
            # f32 forward noise in L is ~1e-7 absolute, i.e. ~3e-5 after dividing by 2*eps;
            # truncation error is O(eps^2) ~ 1e-6 relative.
            assert abs(fd - g[idx]) <= 2e-3 * scale_k + 1e-3 * abs(g[idx]), \
                f"{k}{idx}: finite difference {fd:.6e} vs gradient {g[idx]:.6e}"
    # the parameters are back where they were
    ops.scale(pristine, 1.0, flat)
    assert np.array_equal(flat.numpy(), master)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_backward_overwrites_gradients(dev, dtype):
    P = _params(3)
    blk, x, dy, got = _run(dev, P, dtype)
    with dev.step():
        blk.forward(x)
        blk.backward(x, dy)
    for k in LORA_NAMES:
        again = np.array(blk.grads[k].numpy(), np.float64)
        assert np.array_equal(again, got[k]), f"{k}: a second identical backward changed the gradient"


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).copy()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_adamw_steps_train_only_lora(dev, dtype):
    P = _params(4)
    blk = MLPBlock(dev, P, T, scale=SCALE, eps=EPS, dtype=dtype)
    x = dev.tensor(P["x"], dtype)
    dy = dev.tensor(P["dy"], dtype)
    frozen0 = {k: _bits(getattr(blk, k).numpy()) for k in FROZEN}
    x0 = _bits(x.numpy())
    master0 = np.array(blk.lora_params.params.numpy(), np.float32)
    lr = 1e-2
    grads1 = None
    for step in range(3):
        with dev.step():
            blk.forward(x)
            blk.backward(x, dy)
        if step == 0:
            grads1 = np.array(blk.lora_params.grads.numpy(), np.float64)
        blk.adamw(lr)
        if step == 0:
            # PyTorch AdamW, first step, no decay: p -= lr * g / (|g| + eps) = lr * sign(g)
            delta = np.array(blk.lora_params.params.numpy(), np.float64) - master0
            big = np.abs(grads1) > 1e-4
            assert big.mean() > 0.9
            assert np.all(np.abs(delta[big] + lr * np.sign(grads1[big])) <= 1e-4 * lr + 1e-6)
    for k in FROZEN:
        assert np.array_equal(_bits(getattr(blk, k).numpy()), frozen0[k]), f"frozen {k} changed"
    assert np.array_equal(_bits(x.numpy()), x0)
    master = np.array(blk.lora_params.params.numpy(), np.float32)
    for k in LORA_NAMES:
        lo = blk.lora_params.master(k)
        now = np.array(lo.numpy(), np.float32)
        assert now.shape == P[k].shape
        assert np.mean(now != P[k]) > 0.9, f"{k} barely changed"
    assert blk.adam_step == 3
    assert not np.array_equal(master, master0)
    if dtype != "f32":
        # the working copy in the compute dtype is the updated master, rounded to nearest even
        work = np.array(blk.lora_params.working.numpy(), np.float64)
        assert np.array_equal(work, round_to(master, dtype))
        for k in LORA_NAMES:
            assert np.array_equal(np.array(blk.lora_w[k].numpy(), np.float64), round_to(blk.lora_params.master(k).numpy(), dtype))
