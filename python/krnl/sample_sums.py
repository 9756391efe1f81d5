"""Sums over a training call's rows in an order fixed by its samples (docs/distributed.md, 'The
sample reduce order'), so that data-parallel ranks reproduce one process's gradient bit for bit.

A LoRA step sums over rows only in its weight gradients (dA = dt^T x, dB = s dy^T t; B samples
of T rows each) and its loss sum. One GEMM over all B T rows sums in an order of the BLAS's
choosing, which a rank holding B / N of the samples cannot reproduce. With the sample order each
sample's product is one entry of a batched GEMM (K = T, never split over K) into an f32 scratch
(S, m, n), and the entries are added in a fixed pairwise tree over the sample index: node
[lo, hi) = node [lo, mid) + node [mid, hi), mid = lo + (hi - lo) // 2. The tree's shape depends
only on the sample count, so a rank holding samples [r B/N, (r+1) B/N) of a global batch (N a
power of two) computes exactly a subtree of one process's tree; for 2 ranks the two subtrees are
the root's children, and MPI's sum of the two (a + b, exact and commutative in f32) is one
process's root.

A node of 2^k samples is the adjacent pairs added level by level, k levels of one batched GEMM
each ([1 1] times each pair: 1 a + 1 b rounds once, to a + b), instead of 2^k - 1 adds: the
per-op cost is what the tree adds to a small model's step."""

import numpy as np

from . import _core

ops = _core.ops


class SampleSums:
    """Whether a model's training calls sum over samples (`on`, the trainer's reduce order
    "sample"), and the sample count of the call being run (`samples`, 0: rows at once), which the
    model sets per call and its LoRA linears read in their backward."""

    def __init__(self, on=False):
        self.on = bool(on)
        self.samples = 0
        self._pair = {}  # device -> (1, 2) f32 ones: the level GEMMs' left operand

    def begin(self, samples):
        """A training call of `samples` samples starts: the count the backward's sums use."""
        self.samples = int(samples) if self.on else 0
        return self.samples

    def tree_sum(self, P):
        """The sum of P[0], ..., P[S-1] (P (S, ...) f32, contiguous) added in the fixed tree, as a
        fresh tensor of P[0]'s shape or a view of P."""
        S = P.shape[0]
        return self._node(P.reshape(S, -1), 0, S).reshape(*P.shape[1:])

    def _node(self, F, lo, hi):
        """Node [lo, hi) of the tree over the rows of F (S, E): an (E,) tensor."""
        n = hi - lo
        if n & (n - 1) == 0:  # a power of two: level by level
            return self._levels(F[lo:hi])
        mid = lo + n // 2
        left, right = self._node(F, lo, mid), self._node(F, mid, hi)
        out = F.device.empty((F.shape[1],), "f32")
        ops.add(left, right, out)
        return out

    def _levels(self, F):
        """F (n, E), n a power of two: its adjacent pairs added, then theirs, down to one (E,)."""
        n, E = F.shape
        d = F.device
        if d not in self._pair:
            self._pair[d] = d.tensor(np.ones((1, 2), np.float32), "f32")
        while n > 1:
            out = d.empty((n // 2, 1, E), "f32")                          # (n/2, 1, E)
            ops.gemm(self._pair[d], F.reshape(n // 2, 2, E), out, batch=n // 2, stride_a=0, split_k=1)
            F, n = out.reshape(n // 2, E), n // 2                         # pair i = F[2i] + F[2i+1]
        return F[0]

    def sample_sum(self, a, b, alpha=1.0, samples=None):
        """alpha a^T b (m, n) f32 for a (rows, m), b (rows, n) whose rows are `samples` (default:
        the call's) samples of rows / samples rows each (a and b may be column blocks): one
        product per sample, added in the fixed tree."""
        S = self.samples if samples is None else int(samples)
        rows, m, n = a.shape[0], a.shape[1], b.shape[1]
        if S < 1 or rows % S or b.shape[0] != rows:
            raise ValueError(f"[sample_sum] {rows} and {b.shape[0]} rows do not split into {S} samples")
        T = rows // S
        P = a.device.empty((S, m, n), "f32")                              # (S, m, n) one product per sample
        ops.gemm(a.reshape(S, T, m), b.reshape(S, T, n), P, trans_a=True, alpha=alpha, batch=S,
                 split_k=1)                                               # P[s] = alpha a_s^T b_s
        return self.tree_sum(P)

    def weight_grad(self, a, b, g, alpha=1.0, beta=0.0):
        """g = beta g + alpha a^T b, a linear's weight gradient summed over the rows of a (rows, m)
        and b (rows, n) into g (m, n) f32: one GEMM over all rows (samples 0), or per sample in
        the fixed tree (sample_sum), then added into g (beta 0 or 1)."""
        if not self.samples:
            ops.gemm(a, b, g, trans_a=True, alpha=alpha, beta=beta)
            return
        if beta not in (0.0, 1.0):
            raise ValueError(f"[weight_grad] beta must be 0 or 1 with samples, got {beta}")
        root = self.sample_sum(a, b, alpha)
        if beta == 0.0:
            ops.scale(root, 1.0, g)
        else:
            ops.axpy(1.0, root, g)


ROWS = SampleSums()  # never on: what a linear without its model's SampleSums uses
