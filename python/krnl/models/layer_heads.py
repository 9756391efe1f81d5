"""A decoder layer's attention between its projections (layer.py): from q, k and v, the column
blocks of the qkv projection (N, NH D), to the attention output att (N, H D), and back, two ways:

  token-major  q, k and v stay columns of qkv, as (B, T, heads, D) views: RoPE turns q and k in
               place and one fused call attends every row (where the device takes such views,
               capabilities' fused_attention.token_major)
  head-major   per row b, one transpose makes its heads head-major, turning q and k by RoPE on the
               way (after Qwen3's per-head norms, which come first); the row's attention (fused,
               materialised, Gemma's or a caller's own) runs; a transpose brings the output back

LayerCache.attn holds the saved attention states: one of every row, or one per row."""

from typing import Callable, Optional

from .. import _core
from . import gemma2
from .qwen3 import qk_norm_backward, qk_norm_forward
from .attention import fused_forward

ops = _core.ops


def window_of(L, batch):
    """The sliding window layer L attends with: its own (gpt_oss's per layer) or the call's."""
    return batch.window if L.window is None else L.window


def token_major(L, batch, attend: Optional[Callable]):
    """Whether a call attends token-major: the fused op on a device that takes the views, rows
    without packed segments (a window or sinks only where the op takes them), no per-head norm
    between the projection and RoPE (Qwen3), no Gemma scores (soft-capping) and no caller's own attend."""
    return (batch.token_major and batch.rope_positions is not None and batch.segments is None
            and batch.fuses(False, window_of(L, batch), L.sinks) and attend is None and L.q_norm is None
            and L.gemma is None)


def heads_forward(L, batch, qkv, att, attend: Optional[Callable] = None):
    """att (N, H D) from qkv (N, NH D). attend(b, q, k, v, out) runs the attention of row b
    (default: Gemma's or batch.attend) and returns its saved state. Returns (saved states, Qwen3's
    (heads, rstd) per row or None, whether the call went token-major)."""
    d, dt, hd = qkv.device, qkv.dtype, L.heads
    B, T, H, Hk, D = batch.B, batch.T, hd.H, hd.Hk, hd.D
    NH = H + 2 * Hk
    if token_major(L, batch, attend):
        q4, o4 = qkv.reshape(B, T, NH, D), att.reshape(B, T, H, D)      # views (B, T, heads, D)
        ops.rope(q4[:, :, :H + Hk], batch.rope_positions, hd.freqs(batch), token_major=True)
        s = fused_forward(q4[:, :, :H], q4[:, :, H:H + Hk], q4[:, :, H + Hk:], o4, hd.scale, None,
                          window_of(L, batch), L.sinks)
        return [s], None, True
    if attend is None and L.gemma is not None:
        attend = lambda b, q, k, v, out: gemma2.attend(L.gemma, batch, b, q, k, v, out)
    elif attend is None:
        attend = lambda b, q, k, v, out: batch.attend(b, q, k, v, out, hd.scale, L.window, L.sinks)
    saved, qk_saved = [], ([] if L.q_norm is not None else None)
    for b in range(B):
        r = slice(b * T, (b + 1) * T)
        heads = d.empty((NH, T, D), dt)                                   # (NH, T, D)
        turn = H + Hk if qk_saved is None else 0
        ops.transpose_heads(qkv[r].reshape(T, NH, D), heads, batch.positions[b], hd.freqs(batch), turn)
        q, k, v = heads[:H], heads[H:H + Hk], heads[H + Hk:]             # (H, T, D), (Hk, T, D) x2
        if qk_saved is not None:
            q, k, rstd = qk_norm_forward(L, heads, H, Hk)
            qk_saved.append((heads, rstd))
            ops.rope(q, batch.positions[b], hd.freqs(batch))
            ops.rope(k, batch.positions[b], hd.freqs(batch))
        oh = d.empty((H, T, D), dt)                                       # (H, T, D)
        saved.append(attend(b, q, k, v, oh))
        ops.transpose_heads(oh, att[r].reshape(T, H, D))
    return saved, qk_saved, False


def heads_backward(L, batch, cache, datt, dqkv):
    """dqkv (N, NH D) from datt (N, H D) through the states heads_forward saved in cache."""
    d, dt, hd = datt.device, datt.dtype, L.heads
    B, T, H, Hk, D = batch.B, batch.T, hd.H, hd.Hk, hd.D
    NH = H + 2 * Hk
    if cache.token_major:  # gradients land as columns of dqkv, then the inverse RoPE turns dq, dk
        d4 = dqkv.reshape(B, T, NH, D)
        cache.attn[0].backward(datt.reshape(B, T, H, D), d4[:, :, :H], d4[:, :, H:H + Hk], d4[:, :, H + Hk:])
        ops.rope(d4[:, :, :H + Hk], batch.rope_positions, hd.freqs(batch), -1.0, token_major=True)
        return
    for b, saved in enumerate(cache.attn):
        r = slice(b * T, (b + 1) * T)
        doh = d.empty((H, T, D), dt)                                      # (H, T, D)
        ops.transpose_heads(datt[r].reshape(T, H, D), doh)
        dheads = d.empty((NH, T, D), dt)                                  # (NH, T, D)
        dq, dk, dv = dheads[:H], dheads[H:H + Hk], dheads[H + Hk:]
        if cache.qk is not None:  # q/k gradients land after the norms, then flow through them
            dqk = d.empty((H + Hk, T, D), dt)                             # (H + Hk, T, D)
            dq, dk = dqk[:H], dqk[H:]
        saved.backward(doh, dq, dk, dv)
        turn = H + Hk                                                     # the inverse RoPE on the way back
        if cache.qk is not None:
            ops.rope(dq, batch.positions[b], hd.freqs(batch), -1.0)
            ops.rope(dk, batch.positions[b], hd.freqs(batch), -1.0)
            qk_norm_backward(L, *cache.qk[b], dqk, dheads, H, Hk)
            turn = 0
        ops.transpose_heads(dheads, dqkv[r].reshape(T, NH, D), batch.positions[b], hd.freqs(batch), turn, -1.0, 0)
