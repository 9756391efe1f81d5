"""The dense MLP of a Llama-family decoder layer (layer.py's), forward and backward over core ops:

    y = h + down(silu(gate(hn)) * up(hn))           hn = rmsnorm(h) n2
    (gemma2: GeGLU, and down's output RMS-normed by post_feedforward_layernorm before the sum)

N rows of C features, F the intermediate size. gate and up share their input: their LoRA runs
grouped (lora_group.py) or folded into the GEMMs' K (lora_fold.py) where that pays."""

from dataclasses import dataclass, replace
from typing import Optional

from .. import _core
from . import dora, gemma2, norm_remake
from .lora import LoraLinear, LoraSaved
from .lora_fold import Fold, norm_output
from .lora_group import GroupSaved, group_backward, group_forward, writes_all
from ..quant.qweight import linear, linear_grad

ops = _core.ops
Tensor = _core.Tensor


@dataclass
class Mlp:
    """y = h + down(silu(gate(hn)) * up(hn)), hn = rmsnorm(h) norm."""
    norm: Tensor        # (C,)
    gate: LoraLinear    # (F, C)
    up: LoraLinear      # (F, C)
    down: LoraLinear    # (C, F)
    eps: float
    post: Optional[Tensor] = None  # (C,) gemma2: post_feedforward_layernorm (also selects GeGLU)
    fold: Optional[Fold] = None    # gate and up's LoRA folded into their GEMMs' K (lora_fold.py)
    norm_grad: Optional[Tensor] = None  # (C,) f32 the norm's gradient where it trains (full.py)

    def grad_cols(self):
        """The columns the down projection's fold writes beside dy (LoraLinear.grad_cols)."""
        return self.down.grad_cols()


@dataclass
class MlpCache:
    rstd: Tensor        # (N,) f32 rmsnorm(h) norm's (hn itself is made again: norm_remake.py)
    g: Tensor           # (N, F) gate(hn)
    u: Tensor           # (N, F) up(hn)
    gate: Optional[LoraSaved]
    up: Optional[LoraSaved]
    down: Optional[LoraSaved]  # its xd None: a = silu(g) * u, recomputed where the backward reads it
    m: Optional[Tensor] = None        # (N, C) gemma2: down(a) before the post norm
    m_rstd: Optional[Tensor] = None   # (N,) f32 its rstd
    group: Optional[GroupSaved] = None  # gate and up's LoRA, grouped (lora_group.py)


def glu_forward(mlp, g, u, a):
    """a = silu(g) u, or gemma2's gelu_tanh(g) u: the forward's, and the backward's making it again."""
    (ops.swiglu_forward if mlp.post is None else ops.geglu_forward)(g, u, a)


def mlp_forward(mlp, h, call_seed=None, residual=None, out=None):
    """Returns y (N, C) = h + down(silu(gate(hn)) * up(hn)) (into out where given, but for
    gemma2's post norm) and what mlp_backward needs. With residual, h += residual first (in
    place, inside the norm: one pass over h fewer)."""
    d, dt = h.device, h.dtype
    N, C, F = h.shape[0], h.shape[1], mlp.gate.out
    lins = [mlp.gate, mlp.up]
    hw, hn = norm_output(mlp.fold, lins, call_seed, d, N, C, dt)          # (N, C) hn, in hw where the call folds
    rstd = d.empty((N,), "f32")                                           # (N,)
    ops.rmsnorm_forward(h, mlp.norm, hn, rstd, mlp.eps, residual=residual)
    g, u, a = d.empty((N, F), dt), d.empty((N, F), dt), d.empty((N, F), dt)  # (N, F) each
    if hw is not None:
        (gs, us), group = mlp.fold.forward(lins, hw, [g, u])
    else:
        first = writes_all(lins)                                          # LoRA first, W adds (lora_group.py)
        if not first:
            linear(hn, mlp.gate.W, g)
            linear(hn, mlp.up.W, u)
        (gs, us), group = group_forward(lins, hn, [g, u], call_seed, 0.0 if first else 1.0)
        if first:
            linear(hn, mlp.gate.W, g, 1.0)
            linear(hn, mlp.up.W, u, 1.0)
    g, u = dora.scale_outputs([mlp.gate], [gs], g), dora.scale_outputs([mlp.up], [us], u)
    gs, us = norm_remake.drop([gs, us], hn, mlp.fold if hw is not None else None)
    del hn, hw                                                            # made again in the backward
    glu_forward(mlp, g, u, a)
    y = d.empty((N, C), dt) if out is None or mlp.post is not None else out
    ds = mlp.down.forward(a, y, call_seed)
    m = mr = None
    if mlp.post is not None:                                              # gemma2: y = h + rmsnorm(m)
        m = y
        y, mr = gemma2.post_norm_forward(mlp.post, m, mlp.eps)
    ops.add(y, h, y)                                                      # y = h + mlp
    if ds is not None and ds.xd is a:  # down's backward reads a: made again from g and u there
        ds = replace(ds, xd=None)
    return y, MlpCache(rstd, g, u, gs, us, ds, m, mr, group)  # a and hn go here


def mlp_backward(mlp, h, cache, dy, dh_cols=0, out=None):
    """Returns dh (N, C + dh_cols) given dy (N, C), into out where given; LoRA gradients as the
    linears keep them. dh's gradient is its first C columns, the rest left for the o projection's
    fold; likewise dy may be (N, C + the down projection's grad_cols())."""
    d, dt = h.device, h.dtype
    N, C, F = h.shape[0], h.shape[1], mlp.gate.out
    dyv = dy[:, :C]
    da = d.empty((N, F), dt)
    dm = dy if mlp.post is None else gemma2.post_norm_backward(mlp.post, cache.m, cache.m_rstd, dyv)
    saved = cache.down
    if saved is not None and saved.xd is None:
        # down's input a, made again (one elementwise pass, the same bits) instead of held through
        # the step: N F less at the peak; released before dg and du, which take its place
        saved = replace(saved, xd=d.empty((N, F), dt))
        glu_forward(mlp, cache.g, cache.u, saved.xd)
    mlp.down.backward(dm, saved, da)
    del saved
    # dg over da, du over u: the op reads an element's inputs before it writes (op_list.h), and
    # neither is read after it: two (N, F) fewer at the step's peak (the cache is spent here)
    dg, du = da, cache.u
    (ops.swiglu_backward if mlp.post is None else ops.geglu_backward)(da, cache.g, cache.u, dg, du)
    lins, saves = [mlp.gate, mlp.up], [cache.gate, cache.up]
    hn = None
    if norm_remake.needed(saves, lins):
        hn, saves = norm_remake.remake(h, mlp.norm, mlp.eps, saves, lins)  # (N, C)
    for lin, dz in zip(lins, (dg, du)):
        if lin.gW is not None:                                            # full fine-tuning: W's own gradient
            lin.weight_grad(dz, hn)
    dora.backward_in_place(lins, [dg, du], saves)
    dhn = d.empty((N, C), dt)
    first = cache.group is not None and writes_all(lins)
    if first:
        group_backward(lins, [dg, du], saves, cache.group, dhn, 0.0)
    linear_grad(dg, mlp.gate.W, dhn, 1.0 if first else 0.0)
    linear_grad(du, mlp.up.W, dhn, 1.0)
    if not first:
        group_backward(lins, [dg, du], saves, cache.group, dhn)
    del hn, saves
    dh = d.empty((N, C + dh_cols), dt) if out is None else out
    ops.rmsnorm_backward(dhn, h, mlp.norm, cache.rstd, dh[:, :C], dw=mlp.norm_grad, residual=dyv)  # dh = its grad + dy
    return dh
