"""A norm's output made again in the backward instead of held through the step, as dense_mlp does
for a = silu(g) u.

A layer's xn = rmsnorm(x) n1 (q, k and v's input) and hn = rmsnorm(h) n2 (gate and up's, or the
router's and the experts') are read in the backward only by weight gradients: LoRA's dA = dt^T xn
and full fine-tuning's dW = dy^T xn. The norms' inputs x and h stay saved anyway (their own
backward reads them), so holding xn and hn costs two (N, C) buffers a layer, where making them
again costs one elementwise pass each: rmsnorm_forward of the same input, weight and eps gives the
same bits (a fused residual add stores the sum rounded and normalises that, as here). With LoRA
dropout each member reads its own drop(xn) (N, C) instead, which goes the same way: made again
from the remade xn with the member's mask (its seed; the backward's dx draws that mask again too)."""

from dataclasses import replace

from .. import _core

ops = _core.ops


def drop(saved, xn, fold=None):
    """A group's LoRA saves (LoraSaved or None each, their input xn) with xn and its dropped copies
    left out: xd None where it was xn or drop(xn) (a seed), for remake to fill. Where the group
    folded (fold: its lora_fold.Fold), every save's xd is a view of xn's wider buffer and its t
    columns of it: the t are copied into a buffer of their own (a product with the identity,
    exact), so that the wider buffer can go."""
    if fold is None:
        return [s if s is None or (s.xd is not xn and s.seed is None) else replace(s, xd=None) for s in saved]
    r = fold.eye.shape[0]
    t = xn.device.empty((xn.shape[0], len(saved) * r), xn.dtype)         # (N, G r)
    out = []
    for i, s in enumerate(saved):
        ops.gemm(s.t, fold.eye, t[:, i * r:(i + 1) * r])
        out.append(replace(s, xd=None, t=t[:, i * r:(i + 1) * r]))
    return out


def needed(saved, lins):
    """Whether the backward reads the norm output: a save that drop left without it, or a linear
    whose own weight trains (full fine-tuning reads xn for dW)."""
    return any(s is not None and s.xd is None for s in saved) or any(lin.gW is not None for lin in lins)


def remake(x, weight, eps, saved, lins):
    """(xn (N, C), the saves with their xd where drop took it out: xn, or drop(xn) with the mask of
    the save's seed and linear (lins, in the saves' order)): the norm output of x made again."""
    d, N = x.device, x.shape[0]
    xn, rstd = d.empty(tuple(x.shape), x.dtype), d.empty((N,), "f32")    # (N, C), (N,) f32
    ops.rmsnorm_forward(x, weight, xn, rstd, eps)
    del rstd
    out = []
    for s, lin in zip(saved, lins):
        if s is not None and s.xd is None:
            xd = xn
            if s.seed is not None:
                xd = d.empty(tuple(x.shape), x.dtype)                      # (N, C) drop(xn)
                lin._dropout(xn, xd, s.seed)
            s = replace(s, xd=xd)
        out.append(s)
    return xn, out
