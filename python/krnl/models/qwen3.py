"""Qwen3 (model_type "qwen3"): the Llama layer with an RMSNorm over each head of q and of k (weights
(D,), `self_attn.q_norm` / `k_norm`) between the projection and rotary; Gemma 3 adds the same
norms (with its (1 + w) weights, gemma2.py). Everything else of Qwen3 is Qwen2's (config.py); the
layer calls these where a Layer has q_norm (layer_heads.py), which keeps the head-major path: the
norm needs each head's rows whole before RoPE turns them."""

from .. import _core

ops = _core.ops


def qk_norm_forward(L, heads, H, Hk):
    """The per-head RMSNorm of q and k: head-major rows are contiguous, so each is one
    rmsnorm over (heads T, D) rows. Returns q (H, T, D), k (Hk, T, D) normed into a new buffer
    (heads keeps the inputs for backward) and their rstd (H T + Hk T,) f32."""
    d, dt, T, D = heads.device, heads.dtype, heads.shape[1], heads.shape[2]
    nq, nk = H * T, Hk * T
    qk = d.empty((H + Hk, T, D), dt)                                      # (H + Hk, T, D)
    rstd = d.empty((nq + nk,), "f32")                                     # (H T + Hk T,)
    ops.rmsnorm_forward(heads[:H].reshape(nq, D), L.q_norm, qk[:H].reshape(nq, D), rstd[:nq], L.eps)
    ops.rmsnorm_forward(heads[H:H + Hk].reshape(nk, D), L.k_norm, qk[H:].reshape(nk, D), rstd[nq:], L.eps)
    return qk[:H], qk[H:], rstd


def qk_norm_backward(L, heads, rstd, dqk, dheads, H, Hk):
    """dheads[:H + Hk] (pre-norm q and k gradients) from dqk (H + Hk, T, D), the gradients at the
    norms' outputs; the norm weights' gradients where they train (full fine-tuning, L.grads)."""
    T, D = heads.shape[1], heads.shape[2]
    nq, nk = H * T, Hk * T
    g = L.grads or {}
    ops.rmsnorm_backward(dqk[:H].reshape(nq, D), heads[:H].reshape(nq, D), L.q_norm, rstd[:nq],
                         dheads[:H].reshape(nq, D), dw=g.get("q_norm"))
    ops.rmsnorm_backward(dqk[H:].reshape(nk, D), heads[H:H + Hk].reshape(nk, D), L.k_norm, rstd[nq:],
                         dheads[H:H + Hk].reshape(nk, D), dw=g.get("k_norm"))
