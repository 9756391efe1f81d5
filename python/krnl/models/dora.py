"""DoRA (PEFT's use_dora, mlx-lm's fine_tune_type dora; Liu et al. 2024): an adapted linear's output
scaled per output o by c_o = m_o / ||W_o + s B_o A||, m (out,) a trainable magnitude,

    z = x W^T + s drop(x) A^T B^T        y = c * z (per column)        (a bias goes on after)

The norm is a constant to the backward (PEFT detaches it, the paper's section 4.3), so the linear's
LoRA backward runs as before on dz = c * dy, and dm = sum over rows of dy * z / ||W + s B A||.
Magnitudes start at ||W_o||: the adapted model starts as the base.

The norm never forms W + s B A (out, in): per output o,

    ||W_o + s B_o A||^2 = ||W_o||^2 + 2 s B_o . (A W_o^T) + s^2 B_o (A A^T) B_o^T

with ||W_o||^2 fixed (the weight as the device holds it: rounded to the compute dtype, or
dequantized), the rest from Q = A W^T + (s / 2) A A^T B^T (r, out): a product of r rows with W
(quantized_matmul for a quantized one) and one of r x r, each call (ops.dora_norm finishes it). A
generation holds each linear's scale over its calls (held()), where nothing trains.

Dropout as mlx-lm applies it: the frozen product reads x, the LoRA product drop(x), and c scales
both. PEFT's DoRA computes x W^T + (c - 1) drop(x) W^T + c s drop(x) A^T B^T instead (another frozen
product per linear; the same in expectation over the masks); without dropout the two are one."""

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .. import _core
from .config import magnitude_key
from .phi3 import FUSED
from ..quant.qweight import QuantizedWeight, linear

ops = _core.ops


@dataclass
class DoraSaved:
    """What a DoRA linear's backward reads from its forward."""
    z: _core.Tensor    # (rows, out) the linear's output before the scale (a column block of q|k|v's)
    c: _core.Tensor    # (out,) f32 m / norm
    rn: _core.Tensor   # (out,) f32 1 / norm


class Switch:
    """What a model's DoRA linears share: on (False inside sequence_loss.adapter_off and for serve's
    base model, where B = 0 leaves the base only without the scale), a unit scale for the members
    of a group that DoRA leaves alone, and the linears, whose scales held() keeps."""

    def __init__(self, device, widest):
        self.on, self.hold = True, False
        self.unit = device.tensor(np.ones(max(widest, 1), np.float32), "f32")
        self.linears = []

    def release(self):
        """Drops the held scales (the parameters changed, or hold ends)."""
        for d in self.linears:
            d.held = None


class Dora:
    """The DoRA state of one adapted linear: its rows' squared norms ||W_o||^2 (out,) on the device
    and ||W_o|| on the host (the magnitudes' start)."""

    def __init__(self, switch, W):
        rows = np.asarray(W.numpy(), np.float32)
        w2 = np.sum(np.square(rows, dtype=np.float64), axis=1).astype(np.float32)
        self.switch, self.held = switch, None
        self.w2 = W.device.tensor(w2, "f32")
        self.norm = np.sqrt(w2)  # f32, rounded as ops.dora_norm rounds it: B = 0 then gives c = 1
        switch.linears.append(self)


def active(lin):
    return lin.factors is not None and lin.dora is not None and lin.dora.switch.on


def scale(lin):
    """(c, rn) (out,) f32 of a DoRA linear for this call (ops.dora_norm), or the ones held()."""
    d = lin.dora
    if d.held is not None:
        return d.held
    f, W, s = lin.factors, lin.W, lin.scale
    dev, r = W.device, f.A.shape[0]
    Q = dev.empty((r, lin.out), "f32")                                     # Q = A W^T  (r, out)
    if isinstance(W, QuantizedWeight) and f.A.dtype != "f32":  # quantized_matmul writes A's dtype
        P = dev.empty((r, lin.out), f.A.dtype)
        linear(f.A, W, P)
        ops.cast(P, Q)
    else:
        linear(f.A, W, Q)
    G = dev.empty((r, r), f.A.dtype)
    ops.gemm(f.A, f.A, G, trans_b=True)                                    # G = A A^T  (r, r)
    ops.gemm(G, f.B, Q, trans_b=True, alpha=s / 2, beta=1.0)               # Q += (s/2) G B^T
    c, rn = dev.empty((lin.out,), "f32"), dev.empty((lin.out,), "f32")
    ops.dora_norm(d.w2, f.B, Q, f.m, 2 * s, c, rn)
    if d.switch.hold:
        d.held = (c, rn)
    return c, rn


def scale_outputs(lins, saved, z, y=None):
    """y = z with each DoRA linear's columns scaled by its c, for linears whose outputs lie side by side
    in z (rows, sum of out) in order (q | k | v; one linear), their saves `saved` (LoraSaved or None
    each) given a DoraSaved; y a new tensor where None. z itself where no member has DoRA on."""
    on = [active(lin) for lin in lins]
    if not any(on):
        return z
    y = z.device.empty(tuple(z.shape), z.dtype) if y is None else y
    unit, c0 = next(lin.dora.switch for lin, a in zip(lins, on) if a).unit, 0
    for lin, s, a in zip(lins, saved, on):
        zb, yb, c0 = z[:, c0:c0 + lin.out], y[:, c0:c0 + lin.out], c0 + lin.out
        if a:
            c, rn = scale(lin)
            ops.scale_columns(zb, c, yb)
            s.dora = DoraSaved(zb, c, rn)
        else:
            ops.scale_columns(zb, unit[:lin.out], yb)
    return y


def backward(lin, dy, ds, dz):
    """dz = c * dy (dz may be dy, both (rows, out), possibly column blocks) and the magnitude's
    gradient from it, added into (or, where the linear overwrites its gradients, set as) gm."""
    S = lin.sums.samples or 1  # the sample order sums per sample (sample_sums.py)
    dc = dy.device.empty((S, lin.out), "f32")
    ops.scale_columns_backward(dy, ds.z, ds.c, dz, dc)                    # dc = sum over rows of dy * z
    ops.scale_columns(dc, ds.rn, dc)                                      # dm = dc / norm
    lin.sums.vector_grad(dc, lin.factors.gm, lin.grad_beta)


def backward_in_place(lins, dys, saved):
    """dys[i] = c_i * dys[i] for each DoRA member (their gradients given): buffers only the
    linears' own backward reads (a group's, after its activation's backward)."""
    for lin, dy, s in zip(lins, dys, saved):
        if s is not None and s.dora is not None:
            backward(lin, dy, s.dora, dy)


def magnitudes(config, layers, adapted):
    """{PEFT magnitude key: ||W_o|| (out,)} of the adapted modules, a fused one's (phi3) from its
    members' rows in order: the magnitudes that make each DoRA linear start as its base."""
    out = {}
    for i, m in sorted(adapted):
        lins = layers[i].linears()
        members = FUSED.get(m, (m,)) if config.fused_projections else (m,)
        out[magnitude_key(i, m)] = np.concatenate([lins[k].dora.norm for k in members])
    return out


@contextmanager
def held(switch):
    """Each DoRA linear computes its scale once inside and reuses it (generation: no parameter
    changes); nothing without DoRA (switch None)."""
    if switch is None:
        yield
        return
    was, switch.hold = switch.hold, True
    try:
        yield
    finally:
        switch.hold = was
        if not was:
            switch.release()


@contextmanager
def off(switch):
    """No DoRA scale inside (with every B zeroed: the base model), nothing without DoRA."""
    if switch is None:
        yield
        return
    switch.on = False
    try:
        yield
    finally:
        switch.on = True
