"""Sums over a training step's rows in an order fixed by its samples (docs/distributed.md, 'The
sample reduce order'), so that data-parallel ranks reproduce one process's gradient bit for bit.

A LoRA step sums over rows only in its weight gradients (dA = dt^T x, dB = s dy^T t; B samples
of T rows each) and its loss sum. One GEMM over all B T rows sums in an order of the BLAS's
choosing, which a rank holding B / N of the samples cannot reproduce. In the sample order:

- each weight gradient is a batched GEMM of one entry per sample (K = T, never split over K)
  that adds into that sample's slot of a persistent f32 scratch (S, numel) laid out like the
  flat gradient: slot s gathers sample s's share of every LoRA weight, over the step's
  micro-batches and, for a fused projection's shared A, over its members, in one fixed order;
- once per step (finish, before the ranks' allreduce) the slots are added in a fixed pairwise
  tree over the sample index, node [lo, hi) = node [lo, mid) + node [mid, hi) with
  mid = lo + (hi - lo) // 2, and the root is added into the flat gradient;
- a call's loss sum is the same tree over its samples' row sums.

The tree's shape depends only on the sample count, so a rank holding samples [r B/N, (r+1) B/N)
of each global micro-batch (N a power of two) holds exactly a subtree's slots; for 2 ranks the
two subtrees are the root's children, and MPI's sum of the two (a + b, one correctly rounded f32
add whichever comes first) is one process's root. A node of 2^k samples runs as k levels of one
GEMM each (_levels: a pair's 1 a + 1 b rounds once, to a + b), fewer ops than 2^k - 1 adds.

The sums' terms must also have one process's bits: from reserve() to finish() the device computes
each GEMM in blocks of one sample's rows (Device.gemm_row_block; the CPU's single-threaded BLAS
calls, whose kernels a call's shape picks), and the loss's chunks keep samples whole (row_chunks),
so a row's bits do not depend on how many samples a process holds or on its thread count."""

import numpy as np

from .. import _core

ops = _core.ops
PAIRS = 8  # pairs a tree level's GEMM adds at most (a (8, 16) operand: 8 of its 16 columns are wasted work)


class SampleSums:
    """A model's sums over rows. `on`: the sample order (the trainer's reduce order "sample");
    `samples`: the sample count of the call being run (0: rows at once), set by the model per
    call and read by its LoRA linears' backward; `flat`: the FlatParams whose gradient the slots
    mirror (None: no trainable parameters to sum)."""

    def __init__(self, flat=None, on=False):
        self.flat, self.on = flat, bool(on)
        self.samples = 0
        self.slots = None  # (S, numel) f32, zero between steps
        self.filling = False  # the slots hold a step's sums that finish() has not taken yet
        self._places = {}  # (buffer, byte offset, shape) of a gradient view -> its (S, m, n) view of the slots
        self._pair = {}    # (device, g) -> (g, 2 g) f32: a tree level's GEMM operand (_levels)
        self._ones = {}    # (device, T) -> (T, 1) f32 ones: a sample's row sum
        self._device = None  # the device whose gemm_row_block reserve() set, until finish()

    def reserve(self, samples, T, device):
        """Before a training call of `samples` samples of T rows (outside any recording: what it
        allocates persists): the slots of that many samples, the tree's pair matrices and the
        loss's ones. Returns the count that the call's sums use (0 when off)."""
        if not self.on:
            return 0
        S = int(samples)
        for g in (1, 2, 4, PAIRS):
            self._pairs(device, g)
        self._row_ones(device, int(T))
        self._row_ones(device, S)  # vector_grad's
        if self.flat is not None and (self.slots is None or self.slots.shape[0] != S):
            if self.filling:
                raise ValueError(f"[SampleSums] a micro-batch of {S} samples in a step whose micro-batches have "
                                 f"{self.slots.shape[0]}: the sample order needs one batch size a step")
            self.slots, self._places = device.zeros((S, max(self.flat.numel, 1)), "f32"), {}  # (S, numel)
        self.filling = self.flat is not None
        # Every GEMM of the call in blocks of one sample's rows (the CPU's; Device.gemm_row_block),
        # so a row's bits do not depend on how many samples this process holds.
        device.gemm_row_block, self._device = int(T), device
        return S

    def begin(self, samples):
        """A training call of `samples` samples starts (reserve() ran): the count its sums use."""
        self.samples = int(samples) if self.on else 0
        if self.samples and self.flat is not None and (self.slots is None or self.slots.shape[0] != self.samples):
            raise ValueError(f"[SampleSums] a call of {self.samples} samples without reserve({self.samples})")
        return self.samples

    # -- the tree ---------------------------------------------------------------------------

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
        """F (n, E), n a power of two: its adjacent pairs added, then theirs, down to one (E,).
        A level is one GEMM per 2 g rows, g = min(n / 2, PAIRS): the (g, 2 g) matrix with ones
        at (i, 2i) and (i, 2i+1) times those rows. Each output adds its pair's two products
        (exact) and exact zeros, which change no finite sum: it is F[2i] + F[2i+1], rounded once
        (a non-finite element stays non-finite, in its own column only)."""
        n, E = F.shape
        d = F.device
        while n > 1:
            g = min(n // 2, PAIRS)
            out = d.empty((n // 2, E), "f32")                             # (n/2, E) pair i = F[2i] + F[2i+1]
            ops.gemm(self._pairs(d, g), F.reshape(n // (2 * g), 2 * g, E), out.reshape(n // (2 * g), g, E),
                     batch=n // (2 * g), stride_a=0, split_k=1)
            F, n = out, n // 2
        return F[0]

    def _pairs(self, d, g):
        """The (g, 2 g) f32 matrix that adds adjacent pairs of rows (made outside any recording by
        reserve() for the sizes a step uses)."""
        if (d, g) not in self._pair:
            m = np.zeros((g, 2 * g), np.float32)
            m[np.arange(g), 2 * np.arange(g)] = m[np.arange(g), 2 * np.arange(g) + 1] = 1.0
            self._pair[(d, g)] = d.tensor(m, "f32")
        return self._pair[(d, g)]

    # -- the sums ---------------------------------------------------------------------------

    def _per_sample(self, a, b, C, alpha, beta, S):
        """C[s] = beta C[s] + alpha a_s^T b_s, one batched GEMM entry per sample s of a (rows, m),
        b (rows, n) (either may be a column block)."""
        rows, m, n = a.shape[0], a.shape[1], b.shape[1]
        if S < 1 or rows % S or b.shape[0] != rows:
            raise ValueError(f"[sample_sum] {rows} and {b.shape[0]} rows do not split into {S} samples")
        T = rows // S
        ops.gemm(a.reshape(S, T, m), b.reshape(S, T, n), C, trans_a=True, alpha=alpha, beta=beta, batch=S,
                 split_k=1)

    def sample_sum(self, a, b, alpha=1.0, samples=None):
        """alpha a^T b (m, n) f32 summed per sample in the fixed tree, for a (rows, m), b (rows, n)
        whose rows are `samples` (default: the call's) samples of rows / samples rows each."""
        S = self.samples if samples is None else int(samples)
        P = a.device.empty((max(S, 1), a.shape[1], b.shape[1]), "f32")   # (S, m, n) one product per sample
        self._per_sample(a, b, P, alpha, 0.0, S)
        return self.tree_sum(P)

    def row_chunks(self, B, T, most):
        """(chunk, spans): B samples of T rows in chunks of at most `most` rows (the loss's
        logits), the largest chunk's rows and each chunk's [r0, r1). In the sample order a chunk
        holds whole samples, each a block of the CPU's GEMMs, or where a sample is longer than
        `most` a piece of one at a fixed offset from its start: a row's chunk is the same in a
        rank as in one process."""
        N = B * T
        chunk = min(N, int(most))
        if self.samples and chunk < T:
            return chunk, [(s * T + c, s * T + min(T, c + chunk)) for s in range(B) for c in range(0, T, chunk)]
        if self.samples:
            chunk -= chunk % T
        return chunk, [(r0, min(N, r0 + chunk)) for r0 in range(0, N, chunk)]

    def _row_ones(self, d, T):
        if (d, T) not in self._ones:
            self._ones[(d, T)] = d.tensor(np.ones((T, 1), np.float32), "f32")
        return self._ones[(d, T)]

    def loss_sum(self, rows_loss):
        """(1,) f32: the call's rows_loss (rows,) summed per sample (row sums), then in the tree."""
        d, S = rows_loss.device, self.samples
        T = rows_loss.shape[0] // S
        P = d.empty((S, 1, 1), "f32")                                     # (S, 1, 1) each sample's sum
        ops.gemm(rows_loss.reshape(S, T, 1), self._row_ones(d, T), P, trans_a=True, batch=S, stride_b=0, split_k=1)
        return self.tree_sum(P).reshape(1)

    def weight_grad(self, a, b, g, alpha=1.0, beta=1.0):
        """g = beta g + alpha a^T b, a linear's weight gradient over the rows of a (rows, m) and
        b (rows, n), g (m, n) f32 a view of the flat gradient: one GEMM over all rows (samples
        0), or per sample into g's place in the slots (beta must be 1: gradients accumulate;
        finish() adds the slots' tree into g)."""
        if not self.samples:
            ops.gemm(a, b, g, trans_a=True, alpha=alpha, beta=beta)
            return
        if beta != 1.0 or self.flat is None:
            raise ValueError("[weight_grad] the sample order needs accumulated gradients (beta 1) that are views "
                             "of the model's flat gradient")
        self._per_sample(a, b, self._place(g), alpha, 1.0, self.samples)

    def vector_grad(self, P, g, beta=1.0):
        """g (n,) = beta g + the sum of P's rows: P (1, n) over all rows (samples 0), or one row per
        sample (S, n), added into g's place in the slots in the sample order (beta 1), as
        weight_grad adds its products (a DoRA magnitude's gradient, dora.py)."""
        if not self.samples:
            if beta:
                ops.axpy(1.0, P[0], g)
            else:
                ops.scale(P[0], 1.0, g)
            return
        self.weight_grad(self._row_ones(P.device, self.samples), P, g.reshape(1, g.shape[0]), 1.0, beta)

    def _place(self, g):
        """The (S, m, n) view of the slots where g (m, n), a view of the flat gradient, sits."""
        key = (g.buffer_id, g.offset, tuple(g.shape))
        if key not in self._places:
            off, (m, n) = (g.offset - self.flat.grads.offset) // 4, g.shape
            if not (g.buffer_id == self.flat.grads.buffer_id and g.is_contiguous() and 0 <= off
                    and off + m * n <= self.flat.numel):
                raise ValueError(f"[weight_grad] g {tuple(g.shape)} is not a view of the flat gradient")
            self._places[key] = self.slots[:, off:off + m * n].reshape(self.slots.shape[0], m, n)
        return self._places[key]

    def finish(self):
        """After a step's micro-batches (before the ranks' allreduce): the flat gradient += the
        slots' tree, and the slots zeroed for the next step; the device's GEMMs unblocked. Nothing
        while off."""
        if self._device is not None:
            self._device.gemm_row_block, self._device = 0, None
        if not self.on or self.slots is None:
            return
        n = self.flat.numel
        if n == 0:
            return
        root = self.tree_sum(self.slots)                                  # (numel,)
        ops.axpy(1.0, root, self.flat.grads[:n])
        ops.fill(self.slots, 0.0)
        self.filling = False


ROWS = SampleSums()  # never on: what a linear without its model's SampleSums uses
