"""One decoder layer of the Llama family, forward and backward over core ops (llm.c style):

    xn = rmsnorm(x) n1
    q|k|v = xn Wqkv^T (+ b) (+ LoRA per block)    heads (qwen3: rmsnorm of each q and k head; olmoe: of q, k), rotary
    h = x + o_proj(attention(q, k, v))
    y = h + down(silu(gate(hn)) * up(hn))           hn = rmsnorm(h) n2 (dense_mlp.py; a mixture of experts': moe.py)
    (gemma2, gemma2.py: both sums' second terms RMS-normed first, GeGLU, its own attention)

N = B T rows of C features; H query heads and Hk key/value heads of D features. A Layer holds the
frozen weights and the LoRA linears, a Batch the rows of one call, a LayerCache what backward reads."""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .. import _core
from . import dora, full, gemma2, mlp_rows, norm_remake, olmoe
from .layer_heads import heads_backward, heads_forward
from .gemma2 import GemmaAttn
from .config import ALL_MODULES, ATTN_MODULES, QKV_MODULES, lora_key
from .lora import LoraLinear, LoraSaved, dropout_tag, module_factors
from .lora_fold import Fold, norm_output, rows_for_A, wanted as fold_wanted
from .lora_group import GroupSaved, group_backward, group_forward, stack_of, writes_all
from .moe import MoeMlp, build_moe, moe_backward, moe_forward
from .dense_mlp import Mlp, MlpCache, mlp_backward, mlp_forward
from ..quant.qweight import frozen_weight, linear, linear_grad

ops = _core.ops
Tensor = _core.Tensor


@dataclass(frozen=True)
class Heads:
    """The attention head layout, shared by every layer."""
    H: int              # query heads
    Hk: int             # key/value heads
    D: int              # features per head
    inv_freq: Tensor    # (D/2,) f32 rotary inverse frequencies
    # LongRoPE scales cos and sin by this factor; rotated q and k meet only in q.k, so the
    # attention scale carries its square instead (exact up to rounding).
    rope_factor: float = 1.0

    @property
    def g(self):
        return self.H // self.Hk  # query heads per KV head, adjacent

    @property
    def scale(self):
        return self.rope_factor ** 2 / math.sqrt(self.D)

    def freqs(self, batch):
        """The rotary inverse frequencies of a call: the batch's own (LongRoPE) or the layer's."""
        return self.inv_freq if batch.inv_freq is None else batch.inv_freq


class Ones:
    """A (rows, 1) column of ones in the compute dtype, grown on demand: adds a bias as a GEMM."""

    def __init__(self, device, dtype):
        self.dev, self.dtype, self.col = device, dtype, None

    def __call__(self, rows):
        if self.col is None or self.col.shape[0] < rows:
            self.col = self.dev.tensor(np.ones((rows, 1), np.float32), self.dtype)
        return self.col[:rows]


@dataclass
class Layer:
    heads: Heads
    eps: float
    n1: Tensor                  # (C,) input_layernorm
    # q, k and v share their input: their weights live in one (QKV, C) buffer, QKV = (H + 2 Hk) D,
    # so the projection is one GEMM and one head transpose instead of three of each (fewer
    # dispatches for GPU backends; on the 2-core CPU with OpenBLAS the time is the same,
    # measured). q/k/v_proj's W are row ranges of it, their outputs column blocks.
    qkv: Tensor                 # (QKV, C); a QuantizedWeight (or RowStack) on a quantized base
    qkv_bias: Optional[Tensor]  # (1, QKV)
    ones: Ones
    q_proj: LoraLinear
    k_proj: LoraLinear
    v_proj: LoraLinear
    o_proj: LoraLinear          # (C, H D)
    mlp: Mlp                    # or a MoeMlp (qwen3_moe, mixtral)
    q_norm: Optional[Tensor] = None  # (D,) qwen3: RMSNorm of every query head (None: no q/k norm)
    k_norm: Optional[Tensor] = None  # (D,) ... and of every key head
    gemma: Optional[GemmaAttn] = None  # gemma2's attention settings and post-attention norm
    qkv_fold: Optional[Fold] = None    # q, k and v's LoRA folded into the projection's K (lora_fold.py)
    qk_full: Optional[tuple] = None    # olmoe: RMSNorm weights over the whole q (H D,) and k (Hk D,)
    o_bias: Optional[Tensor] = None    # (1, C) o_proj's bias (attention_bias but in qwen2)
    window: Optional[int] = None       # gpt_oss: the layer's own sliding window (0: full; None: the call's)
    sinks: Optional[Tensor] = None     # (H,) f32 gpt_oss: attention sinks
    grads: Optional[dict] = None       # full fine-tuning (full.py): {attribute: f32 gradient} of what trains,
                                       # of n1, q_norm, k_norm, qkv (QKV, C) where one view, qkv_bias, o_bias

    def linears(self):
        """{HF module name: LoraLinear} (a mixture of experts' experts are no linears)."""
        m = self.mlp
        out = {"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj, "o_proj": self.o_proj}
        if isinstance(m, Mlp):
            out.update({"gate_proj": m.gate, "up_proj": m.up, "down_proj": m.down})
        return out

    def qkv_blocks(self):
        """(linear, c0, c1): q, k and v with their column block of the fused projection."""
        q, k = self.q_proj.out, self.k_proj.out
        return [(self.q_proj, 0, q), (self.k_proj, q, q + k), (self.v_proj, q + k, q + 2 * k)]

    def frozen(self):
        """{name: tensor} of the frozen weights (the q/k/v weights inside qkv)."""
        out = {"n1": self.n1, "n2": self.mlp.norm, "qkv": self.qkv}
        out.update({k: t for k, t in (("qkv_bias", self.qkv_bias), ("o_bias", self.o_bias), ("sinks", self.sinks))
                    if t is not None})
        if self.q_norm is not None:
            out.update(q_norm=self.q_norm, k_norm=self.k_norm)
        if self.gemma is not None:
            out.update(post_attn=self.gemma.post_attn, post_mlp=self.mlp.post)
        out.update({m: lin.W for m, lin in self.linears().items() if m not in QKV_MODULES})
        return {**out, **self.mlp.frozen()} if isinstance(self.mlp, MoeMlp) else out


@dataclass
class LayerCache:
    r1: Tensor          # (N,) f32 rmsnorm(x) n1's (xn itself is made again: norm_remake.py)
    qkv: list           # LoraSaved (or None) of q, k, v
    attn: list          # B saved attention states (attention.FusedSaved / MaterialisedSaved)
    qk: Optional[list]  # qwen3: B of (heads (NH, T, D) before the q/k norms, rstd (H T + Hk T,) f32)
    o: Optional[LoraSaved]
    h: Tensor           # (N, C) x + attention
    mlp: MlpCache
    a: Optional[Tensor] = None       # (N, C) gemma2: o_proj's output before the post norm
    a_rstd: Optional[Tensor] = None  # (N,) f32 its rstd
    qkv_group: Optional[GroupSaved] = None  # q, k and v's LoRA, grouped (lora_group.py)
    token_major: bool = False        # attn holds one state of every row (views of qkv and att)
    qk_full: Optional[list] = None   # olmoe: (raw (N, h D), rstd) of q and k before their norms


def build_layer(i, config, weights, device, dtype, heads, ones, lora_config, lora_params, adapted, quantize=None,
                sums=None, switch=None, trained=None):
    """Layer i from HF-named float32 weights, uploaded in the compute dtype (the seven projections
    quantized where quantize = (bits, group_size)); the LoRA factors of the (layer, module) pairs
    in adapted are views of lora_params; sums: the model's SampleSums, shared by its linears;
    switch: the model's dora.Switch where its adapted linears are DoRA's; trained: a full.Trained
    whose tensors replace the uploads (full fine-tuning; adapted is then empty)."""
    c, p = config, f"model.layers.{i}."
    grads = {}  # the Layer's name of a trained tensor -> its gradient (None: its linears hold them)
    trained_grads = lambda: {k: g for k, g in grads.items() if g is not None} or None  # noqa: E731

    def up(names, shape=None, attr=None):  # attr: the Layer's name of it, for its gradient where it trains
        if trained is not None and any(trained.has(k) for k in names):
            t, grads[attr] = full.tensor(trained, names, lambda k: up([k], shape))
            return t if shape is None or isinstance(t, list) else t.reshape(1, t.shape[-1])
        a = np.concatenate([np.asarray(weights[k], np.float32) for k in names])
        return device.tensor(a if shape is None else a.reshape(shape), dtype)

    def up_linear(names):  # a projection's weight: dense, quantized as stored, or quantized on load
        return frozen_weight(device, [weights[k] for k in names], dtype, quantize, what=names[0])

    mods = ATTN_MODULES if c.moe else ALL_MODULES  # a mixture's experts: moe.build_moe
    key = {m: f"{p}{'self_attn' if m in ATTN_MODULES else 'mlp'}.{m}.weight" for m in mods}
    fs = {m: module_factors(c, lora_params, adapted, i, m) for m in mods}
    folds, Ws, Wks = {}, {}, {}

    def fold(mods, outputs, blocks):  # a group's weights widened for the fold (lora_fold.py), or nothing
        arrays = [weights[key[m]] for m in mods]
        if not c.gemma and not c.fused_projections and fold_wanted(device, quantize, arrays, [fs[m] for m in mods]):
            r = fs[mods[0]].A.shape[0]
            folds[mods[0]], ws = Fold.upload(device, dtype, [[weights[key[m]] for m in o] for o in outputs], blocks, r)
            Ws.update(zip([o[0] for o in outputs], ws))

    for m in ("o_proj", "down_proj")[:1 if c.moe else 2]:  # their backward folds (LoraLinear._fold_backward)
        if not c.gemma and fold_wanted(device, quantize, [weights[key[m]]], [fs[m]]):
            Wks[m], Ws[m] = rows_for_A(device, dtype, weights[key[m]], fs[m].A.shape[0])

    rows = [c.module_shape(m)[0] for m in QKV_MODULES]
    fold(QKV_MODULES, [QKV_MODULES], [(0, sum(rows[:k]), sum(rows[:k + 1])) for k in range(3)])
    F = c.module_shape("gate_proj")[0]
    if not c.moe:
        fold(("gate_proj", "up_proj"), [("gate_proj",), ("up_proj",)], [(0, 0, F), (1, 0, F)])
    qkv_names = [key[m] for m in QKV_MODULES]
    if trained is not None and any(trained.has(k) for k in qkv_names):
        qkv, grads["qkv"] = full.tensor(trained, qkv_names, lambda k: up_linear([k]))
    else:
        qkv = Ws["q_proj"] if "q_proj" in Ws else up_linear(qkv_names)
    qkv_bias = up([f"{p}self_attn.{m}.bias" for m in QKV_MODULES], (1, -1), "qkv_bias") if c.attention_bias else None
    stacks = {}
    for group in (QKV_MODULES, ("gate_proj", "up_proj")):  # the groups' A read as one tensor (lora_group.Stack)
        if all((i, m) in adapted for m in group) and not c.fused_projections:
            st = stack_of(lora_params, [lora_key(i, m, "A") for m in group], [dropout_tag(c, i, m) for m in group])
            stacks.update(dict.fromkeys(group, st))
    lin, r0 = {}, 0
    for m in mods:
        if m in QKV_MODULES:
            n = c.module_shape(m)[0]
            W, r0 = qkv[r0:r0 + n], r0 + n
        elif trained is not None and trained.has(key[m]):
            W = trained.weight(key[m])
        else:
            W = Ws[m] if m in Ws else up_linear([key[m]])
        dr = dora.Dora(switch, W) if switch is not None and fs[m] is not None else None
        gW = trained.grad(key[m]) if trained is not None and trained.has(key[m]) else None
        lin[m] = LoraLinear(W, fs[m], lora_config.scale, lora_config.dropout, tag=dropout_tag(c, i, m),
                            sums=sums, Wk=Wks.get(m), stack=stacks.get(m), dora=dr, gW=gW)
    eps = c.rms_norm_eps
    o_bias = up([p + "self_attn.o_proj.bias"], (1, -1), "o_bias") if c.o_proj_bias else None
    if c.gemma:
        L = build_gemma_layer(i, c, weights, device, heads, ones, qkv, qkv_bias, lin)
        L.o_bias, L.grads = o_bias, trained_grads()
        return L
    if c.moe:
        mlp = build_moe(i, c, weights, device, dtype, lora_config, lora_params, adapted, sums, quantize, ones)
        if trained is not None and trained.has(p + "post_attention_layernorm.weight"):
            mlp.norm = up([p + "post_attention_layernorm.weight"], attr="n2")
    else:
        mlp = Mlp(up([p + "post_attention_layernorm.weight"], attr="n2"), lin["gate_proj"], lin["up_proj"],
                  lin["down_proj"], eps, fold=folds.get("gate_proj"))
    mlp.norm_grad = grads.pop("n2", None)
    norms = (up([p + "self_attn.q_norm.weight"], attr="q_norm"), up([p + "self_attn.k_norm.weight"], attr="k_norm")) \
        if c.qk_norm or c.qk_full_norm else (None, None)
    qk_full, (qn, kn) = (norms, (None, None)) if c.qk_full_norm else (None, norms)  # olmoe's over all heads
    sinks = device.tensor(np.asarray(weights[p + "self_attn.sinks"], np.float32), "f32") if c.attention_sinks else None
    n1 = up([p + "input_layernorm.weight"], attr="n1")
    return Layer(heads, eps, n1, qkv, qkv_bias, ones,
                 lin["q_proj"], lin["k_proj"], lin["v_proj"], lin["o_proj"], mlp, qn, kn, qkv_fold=folds.get("q_proj"),
                 qk_full=qk_full, o_bias=o_bias, window=c.layer_windows[i] if c.layer_windows and not c.gemma else None,
                 sinks=sinks, grads=trained_grads())


def build_gemma_layer(i, c, weights, device, heads, ones, qkv, qkv_bias, lin):
    """Gemma's layer: the Llama layer's projections with the parts gemma2.layer_parts gives."""
    g = gemma2.layer_parts(i, c, weights, device, heads)
    mlp = Mlp(g["pre_ff"], lin["gate_proj"], lin["up_proj"], lin["down_proj"], c.rms_norm_eps, g["post_ff"])
    return Layer(g["heads"], c.rms_norm_eps, g["input"], qkv, qkv_bias, ones, lin["q_proj"], lin["k_proj"],
                 lin["v_proj"], lin["o_proj"], mlp, g["q_norm"], g["k_norm"], gemma=g["attn"])


def qkv_forward(L, xn, call_seed=None, xw=None):
    """q|k|v (N, QKV) = xn Wqkv^T (+ 1 b) (+ LoRA into each column block); also (the LoRA saves, their
    group). xw (N, C + 3 r): xn's buffer where the call folds (qkv_fold; lora_fold.py)."""
    N, blocks = xn.shape[0], L.qkv_blocks()
    qkv = xn.device.empty((N, L.qkv.shape[0]), xn.dtype)
    lins, ys = [b[0] for b in blocks], [qkv[:, c0:c1] for _, c0, c1 in blocks]
    first = xw is None and writes_all(lins)                               # LoRA first (lora_group.py)
    scaled = any(dora.active(lin) for lin in lins)                        # DoRA: the bias after its scale
    if xw is not None:
        out = L.qkv_fold.forward(lins, xw, [qkv])
    else:
        if first:
            out = group_forward(lins, xn, ys, call_seed, 0.0)
        linear(xn, L.qkv, qkv, 1.0 if first else 0.0)
    if L.qkv_bias is not None and not scaled:
        full.add_bias(L, qkv)
    if xw is None and not first:
        out = group_forward(lins, xn, ys, call_seed)
    if scaled:
        qkv = dora.scale_outputs(lins, out[0], qkv)
        if L.qkv_bias is not None:
            full.add_bias(L, qkv)
    return qkv, out


def layer_forward(L, x, batch, attend: Optional[Callable] = None, need_cache=True, need_y=True):
    """Returns (y, cache) for x (N, C). attend(b, q, k, v, out) runs the attention of row b
    (default: Gemma's or batch.attend, layer_heads.py) and returns its saved state. need_cache
    False (a checkpointed layer's forward, or one without backward) or need_y False (its
    recomputation, y None then): the dense MLP may run in blocks of rows (mlp_rows.py), its
    cache a Deferred one."""
    d, dt, hd = x.device, x.dtype, L.heads
    B, T, H, Hk, D = batch.B, batch.T, hd.H, hd.Hk, hd.D
    N, C, NH = B * T, x.shape[1], H + 2 * Hk
    xw, xn = norm_output(L.qkv_fold, [b[0] for b in L.qkv_blocks()], batch.call_seed, d, N, C, dt)  # (N, C) xn
    r1 = d.empty((N,), "f32")                                             # (N,)
    ops.rmsnorm_forward(x, L.n1, xn, r1, L.eps)
    qkv, (qkv_saved, qkv_group) = qkv_forward(L, xn, batch.call_seed, xw)  # (N, NH D)
    qkv_saved = norm_remake.drop(qkv_saved, xn, L.qkv_fold if xw is not None else None)
    del xn, xw                                                            # made again in the backward
    full = olmoe.qk_full_norm_forward(L, qkv) if L.qk_full is not None else None
    att = d.empty((N, H * D), dt)                                         # (N, H D)
    saved, qk_saved, tm = heads_forward(L, batch, qkv, att, attend)
    h = d.empty((N, C), dt)                                               # (N, C)
    o_saved = L.o_proj.forward(att, h, batch.call_seed)
    if L.o_bias is not None:
        ops.gemm(L.ones(N), L.o_bias, h, beta=1.0)
    a = ar = None
    if L.gemma is not None:                                               # gemma2: h = x + rmsnorm(attn)
        a = h
        h, ar = gemma2.post_norm_forward(L.gemma.post_attn, a, L.eps)
    rows = 0 if need_cache and need_y else mlp_rows.rows(L.mlp, N, dt)
    if rows and not need_y:                                               # the MLP made in the backward
        ops.add(h, x, h)                                                  # h = x + attn, as its norm does
        y, mlp_cache = None, mlp_rows.Deferred(rows, batch.call_seed)
    elif rows:
        y, mlp_cache = mlp_rows.forward(L.mlp, h, batch.call_seed, x, rows), None
    else:
        ff = moe_forward if isinstance(L.mlp, MoeMlp) else mlp_forward
        y, mlp_cache = ff(L.mlp, h, batch.call_seed, residual=x)          # h = x + attn, then its norm
    return y, LayerCache(r1, qkv_saved, saved, qk_saved, o_saved, h, mlp_cache, a, ar, qkv_group, tm, full)


def layer_backward(L, x, cache, dy, batch, need_dx=True, dx_cols=0):
    """Returns dx (N, C + dx_cols) given dy (N, C), the gradient at the layer output; with need_dx
    False (the first layer, whose input is the frozen embeddings') only the LoRA gradients, and
    None. As in mlp_backward, dx's gradient is its first C columns (the rest left for the down
    projection's fold of the layer below) and dy may be wider."""
    d, dt, hd = x.device, x.dtype, L.heads
    B, T, H, Hk, D = batch.B, batch.T, hd.H, hd.Hk, hd.D
    N, C, NH = B * T, x.shape[1], H + 2 * Hk
    ff = moe_backward if isinstance(L.mlp, MoeMlp) else mlp_backward
    if isinstance(cache.mlp, mlp_rows.Deferred):
        ff = mlp_rows.backward
    dhw = ff(L.mlp, cache.h, cache.mlp, dy, L.o_proj.grad_cols() if L.gemma is None else 0)
    dh = dhw[:, :C]                                                       # (N, C)
    datt = d.empty((N, H * D), dt)                                        # (N, H D)
    da = dhw if L.gemma is None else gemma2.post_norm_backward(L.gemma.post_attn, cache.a, cache.a_rstd, dh)
    L.o_proj.backward(da, cache.o, datt)
    dqkv = d.empty((N, NH * D), dt)                                       # (N, NH D)
    heads_backward(L, batch, cache, datt, dqkv)
    if cache.qk_full is not None:
        olmoe.qk_full_norm_backward(L, cache.qk_full, dqkv)
    need_dx = need_dx or bool(L.grads and "n1" in L.grads)               # the norm's gradient needs dxn
    dxn = d.empty((N, C), dt) if need_dx else None                        # (N, C)
    lins, dys = [b[0] for b in L.qkv_blocks()], [dqkv[:, c0:c1] for _, c0, c1 in L.qkv_blocks()]
    xn, saves = None, cache.qkv
    if norm_remake.needed(saves, lins):                                  # (a trained q|k|v: each gW is set)
        xn, saves = norm_remake.remake(x, L.n1, L.eps, saves, lins)       # (N, C)
    if L.grads is not None:
        full.layer_grads(L, xn, dqkv, dys, da[:, :C])
    dora.backward_in_place(lins, dys, saves)
    first = cache.qkv_group is not None and writes_all(lins)              # LoRA first (lora_group.py)
    if first:
        group_backward(lins, dys, saves, cache.qkv_group, dxn, 0.0)
    if not need_dx:
        if not first:
            group_backward(lins, dys, saves, cache.qkv_group, None)
        return None
    linear_grad(dqkv, L.qkv, dxn, 1.0 if first else 0.0)                  # dxn (+)= dq|dk|dv Wqkv
    if not first:
        group_backward(lins, dys, saves, cache.qkv_group, dxn)
    del xn, saves
    dx = d.empty((N, C + dx_cols), dt)
    ops.rmsnorm_backward(dxn, x, L.n1, cache.r1, dx[:, :C], dw=L.grads and L.grads.get("n1"),
                         residual=dh)                                     # dx = norm's gradient + dh
    return dx
