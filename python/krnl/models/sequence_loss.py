"""Objectives of whole sequences over krnl's own forward and backward (preference training: DPO, ORPO
and SimPO, krnl.train.preference): each row's cross entropy (its target's negative log-probability;
0 where the target is -100) read on the host, and a backward in which each row's cross-entropy
gradient is scaled by dL / d(that row's loss), which the objective computes from them; a sample's
log-probability of its completion is minus the sum of its completion rows' losses.

A training call is two device steps with one host read between: the forward, each row's loss and its
gradient at the final norm (at scale 1); then, the weights known, those gradients scaled row by row
and the layers' backward. The reference policy of DPO is the model with its adapter off
(adapter_off: the LoRA B factors zeroed for the calls inside, so that every path computing a LoRA,
grouped or folded, adds nothing, and DoRA's scale off), never a second copy of the weights."""

from contextlib import contextmanager

import numpy as np

from .. import _core
from .config import IGNORE_INDEX
from .dora import off as dora_off
from .step_inputs import DeviceInputs

ops = _core.ops


@contextmanager
def adapter_off(model):
    """The base model for the calls inside: the compute copies of the LoRA B factors zeroed, restored
    (bit for bit) after. A full fine-tune keeps no base to switch to: a ValueError."""
    if model.lora_config.full:
        raise ValueError("[adapter_off] a full fine-tune trains the weights themselves: it holds no base model "
                         "beside them to switch to")
    p = model.lora_params
    flat = p.working if p.working is not None else p.params
    keep = model.dev.empty(tuple(flat.shape), flat.dtype)
    ops.cast(flat, keep)
    for k in (k for k in p.shapes if ".lora_B." in k):
        ops.fill(p.compute(k), 0.0)
    try:
        with dora_off(model.dora):  # DoRA's scale off too: B = 0 alone leaves m / ||W|| on the base
            yield model
    finally:
        ops.cast(keep, flat)


def row_losses(model, ids, targets):
    """(B, T) float64: each row's cross entropy of its target (0 where -100), forward only (no dropout)."""
    ids_t, shape, ia = model._ids(ids, "ids")
    tt, _ = model._targets(targets, shape)
    batch = model._batch(shape)
    B, T = shape
    rows = model.dev.empty((B * T,), "f32")

    def body():
        model._forward_logits_rows(ids_t, batch, lambda r0, r1, lg: ops.cross_entropy(lg, tt[r0:r1], rows[r0:r1],
                                                                                       None, IGNORE_INDEX))
        return rows

    return np.asarray(model._run(body).numpy(), np.float64).reshape(B, T)


def forward_backward_rows(model, ids, targets, weigh, loss_scale=1.0, first_row=None):
    """One training forward and backward of an objective of the rows' losses: weigh(losses (B, T)
    float64) returns (w (B, T), dL/d(each row's loss); anything else), and this returns that anything
    else. LoRA gradients accumulate, times loss_scale (dynamic loss scaling). first_row: the rows'
    first in a global batch of rows as long (a data-parallel rank's slice draws its dropout masks)."""
    host = model.prepare(ids, targets, loss_scale)
    if first_row is not None:
        host.first_row = int(first_row) * host.T
    if model.end_grads:  # the head's gradient is taken inside the loss, before the rows are weighed
        raise ValueError("[LlamaModel] a sequence-level objective weighs each row after the loss: it cannot train the "
                         "embeddings and head (train_embeddings); train the layers alone")
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
    w, out = weigh(np.asarray(rows_loss.numpy(), np.float64).reshape(B, T))
    w = (np.asarray(w, np.float64) * float(loss_scale)).astype(np.float32).reshape(N)
    with d.step():
        # each row's gradient times its sample's weight: a weighted gather of rows over identity slots
        scaled = d.empty(tuple(dxn.shape), dxn.dtype)
        ops.moe_combine(dxn, d.tensor(np.arange(N, dtype=np.int32).reshape(N, 1), "i32"),
                        d.tensor(w.reshape(N, 1), "f32"), scaled)
        model._trunk_backward(batch, [x, rstd, scaled], saved)
    return out


def skip_rows(model):
    """What a data-parallel rank without rows in a micro-batch does instead of forward_backward_rows:
    it draws the call's dropout seed all the same, so that every rank's seeds stay one process's."""
    model._call_seed += 1
