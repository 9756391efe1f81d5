"""Causal attention of one sequence over head-major q, k, v, forward and backward, two ways:

  fused         ops.attention_forward/backward: the scores never leave the chip; saves the output
                and the log-sum-exp of each query (CUDA with cuDNN, Metal's flash kernels; the CPU
                runs reference loops); packed segments and a sliding window where the device's
                capabilities list them
  materialised  S = Q K^T, P = softmax(S), O = P V as GEMMs in query row blocks; saves P

Query head h reads KV head h // g (g = H / Hk query heads per KV head, adjacent). gpt-oss's sinks
(H,) f32, one logit per query head in every softmax's denominator, change the forward only: the
saved lse (or P) holds them, and the sink's column has no value to take a gradient. Each forward
returns its saved state as a dataclass whose backward() runs the matching backward. A Batch holds
the rows of one call and picks the way each attends."""

from dataclasses import dataclass
from typing import Optional

from .. import _core

ops = _core.ops


@dataclass
class FusedSaved:
    q: _core.Tensor    # (H, T, D) rotated queries
    k: _core.Tensor    # (Hk, T, D) rotated keys
    v: _core.Tensor    # (Hk, T, D)
    out: _core.Tensor  # (H, T, D) the attention output
    lse: _core.Tensor  # (H, T) f32 log-sum-exp of each query's scaled scores
    scale: float
    segments: Optional[_core.Tensor] = None  # (T,) i32 packed samples' ids
    window: int = 0                          # sliding window (0: none)

    def backward(self, dout, dq, dk, dv):
        fused_backward(self, dout, dq, dk, dv)


@dataclass
class MaterialisedSaved:
    q: _core.Tensor  # (H, T, D) rotated queries
    k: _core.Tensor  # (Hk, T, D) rotated keys
    v: _core.Tensor  # (Hk, T, D)
    blocks: list     # [(r0, r1, P)]: P (H, r1 - r0, r1) the probabilities of query rows r0:r1
    scale: float

    def backward(self, dout, dq, dk, dv):
        materialised_backward(self, dout, dq, dk, dv)


@dataclass
class Batch:
    """The rows of one call: B sequences of T tokens, N = B T rows, and how to attend them."""
    B: int
    T: int
    positions: list                  # B of (T,) i32: rotary positions of each row
    segments: Optional[list] = None  # B of (T,) i32: packed samples' ids (attention stays inside)
    call_seed: Optional[object] = None  # dropout seed: an int or a (2,) i32 seed_offset tensor; None (eval): off
    fused: bool = False              # fused attention (ops.attention_forward/backward)
    fused_segments: bool = False     # ... also for packed rows (else those stay materialised)
    attn_block: int = 0              # query rows per materialised block (0: one block)
    window: int = 0                  # sliding window (0: none): the fused op's where it lists one, else materialised
    inv_freq: Optional[_core.Tensor] = None  # (D/2,) f32: this call's rotary frequencies (None: Heads')
    fused_window: bool = False       # the fused op takes a window (per-layer windows: gemma2, gpt_oss)
    token_major: bool = False        # the fused op takes token-major views (no head transposes)
    rope_positions: Optional[_core.Tensor] = None  # positions as one tensor: (T,) every row's, or (B, T)
    fused_sinks: bool = False        # the fused op takes attention sinks (gpt_oss)

    def fuses(self, packed, window, sinks=None):
        """Whether an attention of packed rows (or not), a window (0: none) and sinks (or None) takes
        the fused op: the call uses it and the device lists each feature."""
        return (self.fused and (not packed or self.fused_segments) and (not window or self.fused_window)
                and (sinks is None or self.fused_sinks))

    def attend(self, b, q, k, v, out, scale, window=None, sinks=None):
        """out (H, T, D) = attention of row b with the call's window (or a layer's own) and sinks
        (H,) f32 where given; returns its saved state."""
        seg = None if self.segments is None else self.segments[b]
        window = self.window if window is None else window
        if self.fuses(seg is not None, window, sinks):
            return fused_forward(q, k, v, out, scale, seg, window, sinks)
        return materialised_forward(q, k, v, out, scale, seg, self.attn_block, window, sinks)


def fused_forward(q, k, v, out, scale, segments=None, window=0, sinks=None):
    """out (H, T, D) = causal attention of q, k, v with the fused op; segments (T,) i32 keep
    each query in its sample, window > 0 limits it to the last `window` keys, sinks (H,) f32 join
    each softmax. Token-major (B, T, H, D) views attend B sequences at once (no segments)."""
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if q.ndim == 4 else (q.shape[0], q.shape[1])
    lse = q.device.empty(lse_shape, "f32")                                # (H, T) or (B, H, T)
    ops.attention_forward(q, k, v, out, lse, scale, segments, window, sinks)
    return FusedSaved(q, k, v, out, lse, scale, segments, window)


def fused_backward(saved, dout, dq, dk, dv):
    """dq (H, T, D), dk, dv (Hk, T, D) from dout (H, T, D)."""
    s = saved
    ops.attention_backward(s.q, s.k, s.v, s.out, dout, s.lse, dq, dk, dv, s.scale, s.segments, s.window)


def row_blocks(T, block, segments=None):
    """Query row blocks of causal attention: (r0, r1) pairs covering [0, T). nb blocks leave
    (nb - 1) / (2 nb) of the score matrix uncomputed; block 0 and packed segments (their
    softmax wants square scores) take one block."""
    if segments is not None or not block or T <= block:
        return [(0, T)]
    return [(r0, min(T, r0 + block)) for r0 in range(0, T, block)]


def qrows(x, Hk, s, r0, r1):
    """Rows r0:r1 of query head s of every KV head's group, from x (H, T, cols) with the g
    query heads of a KV head adjacent: a (Hk, r1 - r0, cols) view."""
    g, T = x.shape[0] // Hk, x.shape[1]
    if g == 1:
        return x[:, r0:r1]
    return x.reshape(Hk, g * T, x.shape[2])[:, s * T + r0:s * T + r1]


def materialised_forward(q, k, v, out, scale, segments: Optional[_core.Tensor] = None, block=0, window=0,
                         sinks=None):
    """out (H, T, D) = causal attention of q, k, v through materialised scores, in query row
    blocks of `block` rows (0: one block); segments (T,) i32 keep each query in its sample,
    window > 0 limits it to the last `window` keys (the zeros it leaves in P carry the mask
    into the backward), sinks (H,) f32 join each softmax."""
    d, dt = q.device, q.dtype
    H, T = q.shape[0], q.shape[1]
    Hk = k.shape[0]
    g = H // Hk
    blocks = []
    for r0, r1 in row_blocks(T, block, segments):
        # Causal: queries r0:r1 see keys :r1 only, so the block's scores are (H, n, r1); the
        # key blocks above the diagonal are never computed.
        P = d.empty((H, r1 - r0, r1), dt)
        for s in range(g):
            ops.gemm(qrows(q, Hk, s, r0, r1), k[:, :r1], qrows(P, Hk, s, 0, r1 - r0),
                     trans_b=True, batch=Hk)                              # S = Q K^T
        # in place: P = softmax(S); row i of the block is query r0 + i (= i + r1 - (r1 - r0)), which
        # the op's window measures from
        ops.softmax_causal_forward(P, P, scale, segments, window=window, sinks=sinks)
        for s in range(g):
            ops.gemm(qrows(P, Hk, s, 0, r1 - r0), v[:, :r1], qrows(out, Hk, s, r0, r1), batch=Hk)
        blocks.append((r0, r1, P))
    return MaterialisedSaved(q, k, v, blocks, scale)


def materialised_backward(saved, dout, dq, dk, dv):
    """dq (H, T, D), dk, dv (Hk, T, D) from dout (H, T, D) and the saved probability blocks."""
    q, k, v = saved.q, saved.k, saved.v
    d, dt, H, Hk = q.device, q.dtype, q.shape[0], k.shape[0]
    g = H // Hk
    # Last row block first: it reaches every key, so its dK and dV write all T rows (beta 0)
    # and the earlier blocks accumulate into their shorter key ranges.
    first = True
    for r0, r1, P in reversed(saved.blocks):
        n = r1 - r0
        dS = d.empty((H, n, r1), dt)
        for s in range(g):
            ops.gemm(qrows(dout, Hk, s, r0, r1), v[:, :r1], qrows(dS, Hk, s, 0, n),
                     trans_b=True, batch=Hk)                              # dP = dO V^T
        ops.softmax_backward(P, dS, dS, saved.scale)                      # in place: dS from dP
        for s in range(g):
            beta = 0.0 if first else 1.0
            Pq, dSq, dOq = qrows(P, Hk, s, 0, n), qrows(dS, Hk, s, 0, n), qrows(dout, Hk, s, r0, r1)
            ops.gemm(Pq, dOq, dv[:, :r1], trans_a=True, beta=beta, batch=Hk)          # dV (+)= P^T dO
            ops.gemm(dSq, k[:, :r1], qrows(dq, Hk, s, r0, r1), batch=Hk)              # dQ = dS K
            ops.gemm(dSq, qrows(q, Hk, s, r0, r1), dk[:, :r1], trans_a=True, beta=beta,
                     batch=Hk)                                                        # dK (+)= dS^T Q
            first = False
