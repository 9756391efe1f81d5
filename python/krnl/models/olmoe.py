"""OLMoE (model_type "olmoe"): a mixture of experts (moe.py) whose attention normalises the whole q
projection of a token (RMSNorm over H D, weights (H D,)) and the whole k (over Hk D) before RoPE,
where Qwen3 normalises each head (qwen3.py). q and k are column blocks of the fused q|k|v output
(N, NH D), rows apart: two head transposes make each one contiguous, the norm writes back into
its columns, and the raw blocks stay for the backward. The layer calls these where a Layer has
qk_full (layer.py)."""

from .. import _core

ops = _core.ops


def _blocks(L):
    H, Hk = L.heads.H, L.heads.Hk
    return ((0, H, L.qk_full[0]), (H, H + Hk, L.qk_full[1]))


def _columns(x, h0, h1, D, out):
    """out (N, (h1 - h0) D) = heads h0:h1 of x (NH, N, D), the heads side by side."""
    ops.transpose_heads(x[h0:h1], out.reshape(out.shape[0], h1 - h0, D), heads_axis=0)


def qk_full_norm_forward(L, qkv):
    """q and k of qkv (N, NH D) RMS-normed in place; returns [(raw (N, h D), rstd (N,) f32)] of q, k."""
    d, dt, N, D = qkv.device, qkv.dtype, qkv.shape[0], L.heads.D
    NH = qkv.shape[1] // D
    heads = d.empty((NH, N, D), dt)                                        # (NH, N, D)
    ops.transpose_heads(qkv.reshape(N, NH, D), heads)
    saved = []
    for h0, h1, w in _blocks(L):
        raw, rstd = d.empty((N, (h1 - h0) * D), dt), d.empty((N,), "f32")  # (N, h D), (N,)
        _columns(heads, h0, h1, D, raw)
        ops.rmsnorm_forward(raw, w, qkv[:, h0 * D:h1 * D], rstd, L.eps)
        saved.append((raw, rstd))
    return saved


def qk_full_norm_backward(L, saved, dqkv):
    """dqkv's q and k columns (gradients at the norms' outputs) turned into the raw projections'
    gradients, in place; the norm weights' gradients where they train (full fine-tuning, L.grads)."""
    d, dt, N, D = dqkv.device, dqkv.dtype, dqkv.shape[0], L.heads.D
    NH = dqkv.shape[1] // D
    dheads = d.empty((NH, N, D), dt)
    ops.transpose_heads(dqkv.reshape(N, NH, D), dheads)
    g = L.grads or {}
    for (h0, h1, w), (raw, rstd), name in zip(_blocks(L), saved, ("q_norm", "k_norm")):
        dy = d.empty((N, (h1 - h0) * D), dt)
        _columns(dheads, h0, h1, D, dy)
        ops.rmsnorm_backward(dy, raw, w, rstd, dqkv[:, h0 * D:h1 * D], dw=g.get(name))
