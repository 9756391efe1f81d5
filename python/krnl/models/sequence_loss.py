"""Sequence-level objectives over krnl's own forward and backward (preference training: DPO, ORPO and
SimPO, krnl.train.preference): each sample's summed log-probability of its targets, over the rows
the cross entropy covers, and a backward in which each row's cross-entropy gradient is scaled by its
sample's weight, dL / d(sum of the sample's row losses), which the objective computes on the host
from the forward's sums:

    logp_b = -sum over t of CE(b, t)        (targets -100 ignored; n_b counts the others)

A training call is two device steps with one host read between: the forward, each row's loss and its
gradient at the final norm (at scale 1); then, the weights known, those gradients scaled row by row
and the layers' backward. The reference policy of DPO is the model with its adapter off
(adapter_off: the LoRA B factors zeroed for the calls inside, so that every path computing a LoRA,
grouped or folded, adds nothing), never a second copy of the weights."""

from contextlib import contextmanager

import numpy as np

from .. import _core
from .config import IGNORE_INDEX
from .step_inputs import DeviceInputs

ops = _core.ops


@contextmanager
def adapter_off(model):
    """The base model for the calls inside: the compute copies of the LoRA B factors zeroed, restored
    (bit for bit) after."""
    p = model.lora_params
    flat = p.working if p.working is not None else p.params
    keep = model.dev.empty(tuple(flat.shape), flat.dtype)
    ops.cast(flat, keep)
    for k in (k for k in p.shapes if ".lora_B." in k):
        ops.fill(p.compute(k), 0.0)
    try:
        yield model
    finally:
        ops.cast(keep, flat)


def _sample_sums(model, rows_loss, B, T):
    """(B, 1) f32: each sample's sum of its T row losses."""
    out = model.dev.empty((B, 1), "f32")
    ops.gemm(rows_loss.reshape(B, T), model._ones(T), out)
    return out


def _counts(targets):
    t = np.asarray(targets)
    return (t.reshape(t.shape[0], -1) != IGNORE_INDEX).sum(axis=1)


def sequence_logps(model, ids, targets):
    """(logp (B,) float64, n (B,)): each sample's summed log-probability of its targets (B, T) and their
    count, forward only (no dropout)."""
    ids_t, shape, ia = model._ids(ids, "ids")
    tt, _ = model._targets(targets, shape)
    batch = model._batch(shape)
    B, T = shape
    rows = model.dev.empty((B * T,), "f32")

    def body():
        model._forward_logits_rows(ids_t, batch, lambda r0, r1, lg: ops.cross_entropy(lg, tt[r0:r1], rows[r0:r1],
                                                                                       None, IGNORE_INDEX))
        return _sample_sums(model, rows, B, T)

    sums = model._run(body)
    return -np.asarray(sums.numpy()[:, 0], np.float64), _counts(targets)


def forward_backward_sequences(model, ids, targets, weigh, loss_scale=1.0):
    """One training forward and backward of a sequence-level objective: weigh(logp (B,) float64, n (B,))
    returns (w (B,) the loss's gradient with respect to each sample's summed row losses, -dL/dlogp_b;
    anything else the caller wants back), which this returns second. LoRA gradients accumulate, times
    loss_scale (dynamic loss scaling)."""
    host = model.prepare(ids, targets, loss_scale)
    if model.sums.on:
        raise ValueError("[LlamaModel] a sequence-level objective weighs each sample after the forward, which the "
                         "sample reduce order (--reduce-order sample) does not take; use the default order")
    B, T, _, _, window, long_rope, _ = host.key()
    d, N = model.dev, B * T
    inputs = DeviceInputs.of(d, host)
    with d.step():
        batch = model._batch_of(B, T, inputs.positions, inputs.segments, inputs.seed_offset, window, long_rope,
                                inputs.rope_positions)
        x, xn, rstd, saved = model._trunk_forward(inputs.ids, batch, keep=True)
        if model.router_stats:
            model.router_stats.backward(inputs.loss_scale)
        rows_loss, dxn = model._head_backward(xn, inputs.targets, None, B, T)
        sums = _sample_sums(model, rows_loss, B, T)
    w, out = weigh(-np.asarray(sums.numpy()[:, 0], np.float64), _counts(host.targets.reshape(B, T)))
    w = np.repeat(np.asarray(w, np.float64) * float(loss_scale), T).astype(np.float32)
    with d.step():
        # each row's gradient times its sample's weight: a weighted gather of rows over identity slots
        scaled = d.empty(tuple(dxn.shape), dxn.dtype)
        ops.moe_combine(dxn, d.tensor(np.arange(N, dtype=np.int32).reshape(N, 1), "i32"),
                        d.tensor(w.reshape(N, 1), "f32"), scaled)
        model._trunk_backward(batch, x, rstd, saved, scaled)
    return out
