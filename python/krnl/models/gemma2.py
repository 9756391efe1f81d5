"""Gemma 2's pieces on top of the Llama layer (layer.py calls them where a Layer has `gemma`):

    h = x + rmsnorm(o_proj(attn(q, k, v))) post_attention_layernorm
    y = h + rmsnorm(down(gelu_tanh(gate(hn)) * up(hn))) post_feedforward_layernorm,  hn = rmsnorm(h) pre_ff
    attention: scale query_pre_attn_scalar ** -0.5, scores soft-capped (cap tanh(S / cap)) before
    the mask and softmax, a sliding window on the layers layer_types marks
    x0 = embed(ids) * sqrt(C) (rounded to the compute dtype, as transformers does), logits soft-capped

Every RMSNorm weight w scales by (1 + w): the frozen copies the layers hold have it folded in at
load, in f32 whatever the compute dtype (rmsnorm takes f32 weights; transformers multiplies by
1 + w in f32 before rounding), and `fuse` reads the files again, so it writes the original w. The fused attention op has no
soft-capping, so a layer with attn_softcap always takes the materialised path."""

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .. import _core
from . import gemma3
from .attention import materialised_forward, fused_forward, qrows, row_blocks

ops = _core.ops
Tensor = _core.Tensor


@dataclass(frozen=True)
class GemmaAttn:
    """One layer's Gemma 2 attention settings and its post-attention norm."""
    post_attn: Tensor   # (C,) post_attention_layernorm, (1 + w) folded
    scale: float        # query_pre_attn_scalar ** -0.5
    softcap: float      # attention logit cap (0: none)
    window: int         # sliding window (0: full attention)


def norm_weight(w):
    """Gemma's RMSNorm multiplies by (1 + w), in f32 as transformers does: the folded f32 weight."""
    return np.float32(1.0) + np.asarray(w, np.float32)


def layer_parts(i, c, weights, device, heads):
    """What Gemma's layer i holds beyond the Llama layer's projections, as {field: value}: its four
    norms with (1 + w) folded into f32 copies (input, pre_ff, post_ff and, in `attn`, the
    post-attention one), its attention settings (GemmaAttn), Gemma 3's q/k norms (else None), and
    `heads`: on Gemma 3's sliding layers a copy turning by the local rotary frequencies."""
    p, g = f"model.layers.{i}.", c.gemma
    norm = lambda name: device.tensor(norm_weight(weights[p + name]), "f32")  # (C,) or (D,) f32, (1 + w)
    if g.get("local_theta") is not None and c.layer_windows[i]:
        heads = replace(heads, inv_freq=device.tensor(gemma3.local_inv_freq(g["local_theta"], c.head_dim), "f32"))
    qk = c.qk_norm
    return {"heads": heads, "input": norm("input_layernorm.weight"), "pre_ff": norm("pre_feedforward_layernorm.weight"),
            "post_ff": norm("post_feedforward_layernorm.weight"),
            "q_norm": norm("self_attn.q_norm.weight") if qk else None,
            "k_norm": norm("self_attn.k_norm.weight") if qk else None,
            "attn": GemmaAttn(norm("post_attention_layernorm.weight"), g["attn_scale"], g["attn_softcap"],
                              c.layer_windows[i])}


def embed_scale(config, dtype):
    """sqrt(hidden_size) rounded to the compute dtype (transformers' normalizer), or None."""
    return round_to(config.hidden_size ** 0.5, dtype) if config.gemma else None


def round_to(x, dtype):
    """x (a float) rounded to the compute dtype f32, f16 or bf16, as a float."""
    f = np.float32(x)
    if dtype == "f16":
        return float(np.float16(f))
    if dtype == "bf16":
        b = np.array([f], np.float32).view(np.uint32)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)  # round to nearest even
        return float(b.view(np.float32)[0])
    return float(f)


@dataclass
class SoftcapSaved:
    """The materialised attention's saved state with soft-capped scores."""
    q: Tensor        # (H, T, D) rotated queries
    k: Tensor        # (Hk, T, D) rotated keys
    v: Tensor        # (Hk, T, D)
    blocks: list     # [(r0, r1, Y, P)]: Y the capped scores, P the probabilities (H, r1 - r0, r1)
    scale: float
    cap: float

    def backward(self, dout, dq, dk, dv):
        softcap_attention_backward(self, dout, dq, dk, dv)


def softcap_attention_forward(q, k, v, out, scale, cap, segments=None, block=0, window=0):
    """out (H, T, D) = causal attention with Y = cap tanh(scale Q K^T / cap) as the scores, the
    materialised path (attention.materialised_forward) with the capped scores kept for backward."""
    d, dt = q.device, q.dtype
    H, Hk = q.shape[0], k.shape[0]
    g = H // Hk
    blocks = []
    for r0, r1 in row_blocks(q.shape[1], block, segments):
        Y = d.empty((H, r1 - r0, r1), dt)                                 # (H, n, r1)
        for s in range(g):
            ops.gemm(qrows(q, Hk, s, r0, r1), k[:, :r1], qrows(Y, Hk, s, 0, r1 - r0),
                     alpha=scale, trans_b=True, batch=Hk)                 # S = scale Q K^T
        ops.softcap(Y, cap, Y)                                            # in place: Y = cap tanh(S / cap)
        P = d.empty((H, r1 - r0, r1), dt)
        ops.softmax_causal_forward(Y, P, 1.0, segments, window=window)
        for s in range(g):
            ops.gemm(qrows(P, Hk, s, 0, r1 - r0), v[:, :r1], qrows(out, Hk, s, r0, r1), batch=Hk)
        blocks.append((r0, r1, Y, P))
    return SoftcapSaved(q, k, v, blocks, scale, cap)


def softcap_attention_backward(saved, dout, dq, dk, dv):
    """dq (H, T, D), dk, dv (Hk, T, D) from dout (H, T, D): dS = softcap'(Y) softmax'(dP), then
    the GEMMs of attention.materialised_backward with the scale as their alpha."""
    q, k, v = saved.q, saved.k, saved.v
    d, dt, H, Hk = q.device, q.dtype, q.shape[0], k.shape[0]
    g = H // Hk
    first = True  # the last row block reaches every key: its dK and dV write all rows (beta 0)
    for r0, r1, Y, P in reversed(saved.blocks):
        n = r1 - r0
        dS = d.empty((H, n, r1), dt)                                      # (H, n, r1)
        for s in range(g):
            ops.gemm(qrows(dout, Hk, s, r0, r1), v[:, :r1], qrows(dS, Hk, s, 0, n),
                     trans_b=True, batch=Hk)                              # dP = dO V^T
        ops.softmax_backward(P, dS, dS, 1.0)                              # dY from dP
        ops.softcap_backward(dS, Y, saved.cap, dS)                        # dS from dY (S scaled)
        for s in range(g):
            beta = 0.0 if first else 1.0
            Pq, dSq, dOq = qrows(P, Hk, s, 0, n), qrows(dS, Hk, s, 0, n), qrows(dout, Hk, s, r0, r1)
            ops.gemm(Pq, dOq, dv[:, :r1], trans_a=True, beta=beta, batch=Hk)                   # dV (+)= P^T dO
            ops.gemm(dSq, k[:, :r1], qrows(dq, Hk, s, r0, r1), alpha=saved.scale, batch=Hk)   # dQ = s dS K
            ops.gemm(dSq, qrows(q, Hk, s, r0, r1), dk[:, :r1], alpha=saved.scale, trans_a=True, beta=beta,
                     batch=Hk)                                                                 # dK (+)= s dS^T Q
            first = False


def attend(ga, batch, b, q, k, v, out):
    """A Gemma layer's attention of row b: soft-capped scores take the materialised path (the
    fused op has no soft-capping); otherwise the fused op where the batch uses it and, for a
    windowed layer, the device lists the window (Batch.fused_window)."""
    seg = None if batch.segments is None else batch.segments[b]
    if ga.softcap:
        return softcap_attention_forward(q, k, v, out, ga.scale, ga.softcap, seg, batch.attn_block, ga.window)
    if batch.fuses(seg is not None, ga.window):
        return fused_forward(q, k, v, out, ga.scale, seg, ga.window)
    return materialised_forward(q, k, v, out, ga.scale, seg, batch.attn_block, ga.window)


def post_norm_forward(w, a, eps):
    """(rmsnorm(a) w, rstd): Gemma's norm after the attention or the MLP, before the residual add."""
    d, dt, N, C = a.device, a.dtype, a.shape[0], a.shape[1]
    an, rstd = d.empty((N, C), dt), d.empty((N,), "f32")                 # (N, C), (N,)
    ops.rmsnorm_forward(a, w, an, rstd, eps)
    return an, rstd


def post_norm_backward(w, a, rstd, dy):
    """da (N, C) from dy, the gradient at the norm's output (w frozen)."""
    da = a.device.empty(tuple(a.shape), a.dtype)
    ops.rmsnorm_backward(dy, a, w, rstd, da)
    return da


def cap_logits(cap, logits):
    """In place: logits = cap tanh(logits / cap) (final_logit_softcapping; cap 0: none)."""
    if cap:
        ops.softcap(logits, cap, logits)


def cap_logits_backward(cap, logits, dlogits):
    """In place: dlogits through the soft-capping, from the capped logits."""
    if cap:
        ops.softcap_backward(dlogits, logits, cap, dlogits)
