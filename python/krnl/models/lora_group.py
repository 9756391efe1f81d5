"""LoRA products of linears that read the same input, issued together (docs/architecture.md,
'LoRA groups'): q, k and v read xn, gate and up read hn.

Per linear i of a group of G with rank r, the forward t_i = x A_i^T and the backward's
dA_i = dt_i^T x and dx += dt_i A_i each pass over the whole input x (rows, in) or dx for a
product of r columns. With A_g = [A_1; ...; A_G] (G r, in) copied together once a call, each of
the three is one product of G r columns instead:

    t_g  = x A_g^T          (rows, G r)   t_i is its column block i
    dA_g = dt_g^T x         (G r, in) f32 dA_i is its row block i, added into gA_i
    dx  += dt_g A_g                       dt_g (rows, G r) gathers each s dy_i B_i

so x is read once instead of G times and dx read and written once, in fewer, larger GEMMs. Where
the members' A lie side by side in the model's FlatParams (lora.init_lora's layout), A_g is a view
of them and dA_g goes straight into their gradients (a Stack); elsewhere A_g is copied together
at each call and dA_g added into each gA_i. The
z += s t_i B_i^T and dB_i = s dy_i^T t_i products stay per linear (each has its own output), and
so does dA_i in the sample reduce order (krnl.models.sample_sums: each into its own slots). A
group whose members drop their inputs (dropout in training) or differ in rank or dtype runs
linear by linear, as LoraLinear does. KRNL_LORA_GROUPS=0 turns grouping off everywhere (to time
both on one machine). As LoraLinear.forward does, the rank-r products write the outputs first
where every member is adapted, and the caller adds the frozen product with beta 1."""

import os
from dataclasses import dataclass
from typing import Optional

from .. import _core
from .lora import LoraSaved, lora_first

ops = _core.ops


@dataclass
class GroupSaved:
    """What a grouped backward reads besides each member's LoraSaved."""
    A: _core.Tensor   # (G r, in) the members' A stacked, as the forward used them
    r: int
    gA: Optional[_core.Tensor] = None  # (G r, in) f32 their gradients as one view (a Stack's), or None


@dataclass(frozen=True)
class Stack:
    """The A factors of a group's members as one tensor, and their gradients as another: views of
    the FlatParams that holds them side by side (FlatParams.rows)."""
    A: _core.Tensor    # (G r, in) compute dtype
    gA: _core.Tensor   # (G r, in) f32
    tags: tuple        # the members' LoraLinear.tag, in order


def stack_of(params, names, tags):
    """The Stack of the parameters `names` (the members' A, in order), or None where they do not
    lie side by side."""
    views = params.rows(names)
    return None if views is None else Stack(views[0], views[1], tuple(tags))


def enabled():
    return os.environ.get("KRNL_LORA_GROUPS", "1") != "0"


def writes_all(lins):
    """Whether the members' LoRA products write their whole outputs first (lora.lora_first), the
    frozen product then added with beta 1: every member must be adapted, or its block would be
    left unwritten."""
    return lora_first() and all(lin.factors is not None for lin in lins)


def groupable(lins, call_seed):
    if len(lins) < 2 or not enabled():
        return False
    fs = [lin.factors for lin in lins]
    if any(f is None for f in fs):
        return False
    if call_seed is not None and any(lin.dropout > 0 for lin in lins):
        return False  # each member's own mask makes each t read its own drop(x)
    r, dt, inp = fs[0].A.shape[0], fs[0].A.dtype, lins[0].inp
    return all(f.A.shape[0] == r and f.A.dtype == dt and lin.inp == inp for f, lin in zip(fs, lins))


def stacked_A(lins):
    """(A_g (G r, in), r, gA_g or None): the members' Stack where they have one, else their A
    copied together (and no gA_g), as this call's group uses them."""
    A0 = lins[0].factors.A
    r, st = A0.shape[0], lins[0].stack
    if st is not None and st.tags == tuple(lin.tag for lin in lins) and all(lin.stack is st for lin in lins):
        return st.A, r, st.gA
    A = A0.device.empty((len(lins) * r, A0.shape[1]), A0.dtype)           # (G r, in)
    for i, lin in enumerate(lins):
        ops.scale(lin.factors.A, 1.0, A[i * r:(i + 1) * r])
    return A, r, None


def group_forward(lins, x, ys, call_seed=None, beta=1.0):
    """ys[i] = beta ys[i] + s_i drop(x) A_i^T B_i^T for each LoraLinear of lins (x (rows, in)
    their shared input; ys[i] may be column blocks of one output). Returns (one LoraSaved or None
    per member, the GroupSaved or None) for group_backward."""
    if not groupable(lins, call_seed):
        return [lin.lora_forward(x, y, call_seed, beta) for lin, y in zip(lins, ys)], None
    A, r, gA = stacked_A(lins)
    t = x.device.empty((x.shape[0], A.shape[0]), A.dtype)                 # (rows, G r)
    ops.gemm(x, A, t, trans_b=True)                                       # t_g = x A_g^T
    saved = []
    for i, (lin, y) in enumerate(zip(lins, ys)):
        ti = t[:, i * r:(i + 1) * r]                                      # (rows, r) column block
        ops.gemm(ti, lin.factors.B, y, trans_b=True, alpha=lin.scale, beta=beta)  # y (+)= s t_i B_i^T
        saved.append(LoraSaved(x, ti, None))
    return saved, GroupSaved(A, r, gA)


def group_backward(lins, dys, saved, group, dx, beta=1.0):
    """The LoRA gradients of each member from dys[i] (rows, out_i) and dx += sum_i drop(dt_i A_i),
    for the (saved, group) that group_forward returned; grouped, dx = beta dx + sum_i dt_i A_i.
    dx None: the gradients alone."""
    if group is None:
        for lin, dy, s in zip(lins, dys, saved):
            lin.lora_backward(dy, s, dx)
        return
    d, r, G = dys[0].device, group.r, len(lins)
    rows, x = dys[0].shape[0], saved[0].xd
    dt = d.empty((rows, G * r), group.A.dtype)                            # (rows, G r)
    sums = lins[0].sums  # the members share their model's SampleSums
    for i, (lin, dy, s) in enumerate(zip(lins, dys, saved)):
        f = lin.factors
        sums.weight_grad(dy, s.t, f.gB, lin.scale, lin.grad_beta)         # dB_i (+)= s dy_i^T t_i
        ops.gemm(dy, f.B, dt[:, i * r:(i + 1) * r], alpha=lin.scale)      # dt_i = s dy_i B_i
    if sums.samples:  # per sample into each member's own slots (sample_sums): one product per member
        for i, lin in enumerate(lins):
            sums.weight_grad(dt[:, i * r:(i + 1) * r], x, lin.factors.gA, 1.0, lin.grad_beta)  # dA_i += dt_i^T x
    elif group.gA is not None and len({lin.grad_beta for lin in lins}) == 1:
        ops.gemm(dt, x, group.gA, trans_a=True, beta=lins[0].grad_beta)   # gA_g (+)= dt_g^T x
    else:
        dA = d.empty((G * r, x.shape[1]), "f32")                          # (G r, in)
        ops.gemm(dt, x, dA, trans_a=True)                                 # dA_g = dt_g^T x
        for i, lin in enumerate(lins):
            gA, blk = lin.factors.gA, dA[i * r:(i + 1) * r]
            if lin.grad_beta == 0.0:
                ops.scale(blk, 1.0, gA)
            else:
                ops.axpy(1.0, blk, gA)
    if dx is not None:
        ops.gemm(dt, group.A, dx, beta=beta)                              # dx (+)= dt_g A_g
