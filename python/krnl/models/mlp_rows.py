"""A checkpointed layer's dense MLP a block of rows at a time (layer.py), so that its (N, F)
buffers (gate, up, their product and gradients: four at the backward's peak) are never made
whole. The MLP is row-wise, so each block's forward and backward are the whole one's on those
rows; what sums over rows (the LoRA gradients) accumulates block by block.

Where a layer's cache is dropped (gradient checkpointing's forward, a forward without backward)
its MLP writes y block by block and keeps nothing; its recomputation in the backward only forms
h (the residual sum the MLP's norm would have made) and defers the MLP to mlp_rows.backward,
which makes each block's forward again and runs its backward at once. Both split the rows alike
(`rows`). Blocks hold at most LIMIT bytes of one (rows, F) buffer; below that, or where a
block's backward would not simply add up (DoRA's magnitudes, full fine-tuning's weights, the
sample-order sums, gemma2's post norm, gradients overwritten) or LoRA dropout would draw other
masks than the whole MLP's, the MLP runs whole as before."""

from dataclasses import dataclass

from .dense_mlp import Mlp, mlp_backward, mlp_forward

LIMIT = 64 << 20  # bytes of one (rows, F) buffer a block may hold


def block_rows(N, F, itemsize, limit=None):
    """Rows a block of N takes (N: one block): each (rows, F) within `limit` bytes, the blocks as
    nearly equal as can be (the last fewer rows short than there are blocks), so that they share
    one size class of the pool."""
    most = max(1, int(LIMIT if limit is None else limit) // (F * itemsize))
    blocks = -(-N // most)
    return -(-N // blocks)


def rows(mlp, N, dtype):
    """block_rows for a layer's MLP of N rows in dtype, or 0 where it runs whole (above)."""
    if type(mlp) is not Mlp or mlp.post is not None or mlp.norm_grad is not None:
        return 0
    for lin in (mlp.gate, mlp.up, mlp.down):
        if lin.dora is not None or lin.gW is not None or lin.sums.on or lin.grad_beta != 1.0 or lin.dropout:
            return 0
    n = block_rows(N, mlp.gate.out, 4 if dtype == "f32" else 2)
    return n if n < N else 0


@dataclass
class Deferred:
    """A recomputed layer's MLP cache: made again block by block in its backward."""
    rows: int
    call_seed: object


def forward(mlp, h, call_seed, residual, n):
    """y (N, C) of mlp_forward (h += residual first), n rows at a time, nothing kept."""
    N, C = h.shape
    y = h.device.empty((N, C), h.dtype)                                   # (N, C)
    for r0 in range(0, N, n):
        r1 = min(N, r0 + n)
        mlp_forward(mlp, h[r0:r1], call_seed, residual[r0:r1], out=y[r0:r1])
    return y


def backward(mlp, h, deferred, dy, dh_cols):
    """mlp_backward's dh (N, C + dh_cols) from dy, each block's forward made again first."""
    N, C = h.shape
    dh = h.device.empty((N, C + dh_cols), h.dtype)                        # (N, C + dh_cols)
    for r0 in range(0, N, deferred.rows):
        r1 = min(N, r0 + deferred.rows)
        y, cache = mlp_forward(mlp, h[r0:r1], deferred.call_seed)         # the block's y: not read
        del y
        mlp_backward(mlp, h[r0:r1], cache, dy[r0:r1], dh_cols, out=dh[r0:r1])
        del cache                                                         # before the next block's
    return dh
