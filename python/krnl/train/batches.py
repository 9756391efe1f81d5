"""Batches from tokenized samples: packing (several samples per row, each in its own attention
segment), padding, and the batch sources the trainer draws from (next(), state(), load_state()).
These sit below both data.py, which reads samples from files, and trainer.py, which consumes
batches, so that neither has to import the other."""

import bisect
from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100


class DataError(ValueError):
    pass


class Batches:
    """Deterministic shuffled batches of rows of (ids, targets) and, for packed rows, their
    (segments, positions) (pack); the position (epoch, index) is all that is needed to
    continue the same sequence. next() gives (ids, targets) or (ids, targets, segments, positions)."""

    def __init__(self, ids, targets, batch_size, seed, segments=None, positions=None):
        ids, targets = np.asarray(ids, np.int32), np.asarray(targets, np.int32)
        if ids.shape != targets.shape or ids.ndim != 2:
            raise ValueError(f"[data] ids {ids.shape} and targets {targets.shape} must be equal 2-D shapes")
        if (segments is None) != (positions is None):
            raise ValueError("[data] segments and positions come together (packed rows)")
        if segments is not None:
            segments, positions = np.asarray(segments, np.int32), np.asarray(positions, np.int32)
            if segments.shape != ids.shape or positions.shape != ids.shape:
                raise ValueError(f"[data] segments {segments.shape} and positions {positions.shape} must have the "
                                 f"shape of ids {ids.shape}")
        if len(ids) < batch_size:
            raise ValueError(f"[data] {len(ids)} samples are fewer than one batch of {batch_size}")
        self.ids, self.targets, self.batch_size, self.seed = ids, targets, batch_size, seed
        self.segments, self.positions = segments, positions
        self.epoch, self.index = 0, 0
        self._order = None

    def _perm(self):
        if self._order is None:
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.ids))
        return self._order

    def next(self):
        per_epoch = len(self.ids) // self.batch_size
        if self.index >= per_epoch:
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        rows = self._perm()[self.index * self.batch_size:(self.index + 1) * self.batch_size]
        self.index += 1
        if self.segments is not None:
            return self.ids[rows], self.targets[rows], self.segments[rows], self.positions[rows]
        return self.ids[rows], self.targets[rows]

    def state(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, s):
        self.epoch, self.index, self._order = int(s["epoch"]), int(s["index"]), None


@dataclass
class Packed:
    ids: np.ndarray        # (R, T) int32
    targets: np.ndarray    # (R, T) int32, -100 where ignored (padding, masked tokens, sample ends)
    segments: np.ndarray   # (R, T) int32: index of the sample within its row; padding one past the last
    positions: np.ndarray  # (R, T) int32: restart at 0 at each sample (and in the padding)
    rows: list             # per row, the indices of its samples in order


def pack(samples, seq_len, pad_id=0):
    """Packs samples (each at most seq_len tokens) into rows of seq_len tokens, best-fit
    decreasing. A token attends only to tokens of its own sample (segments), its position restarts
    at each sample, and the last token of a sample predicts nothing."""
    lens = [len(s) for s in samples]
    if any(n > seq_len for n in lens):
        raise DataError(f"[data] a sample of {max(lens)} tokens does not fit rows of {seq_len}")
    order = sorted(range(len(samples)), key=lambda i: (-lens[i], i))
    caps, rows = [], []   # caps: sorted (room left, row)
    for i in order:
        k = bisect.bisect_left(caps, (lens[i], -1))
        if k < len(caps):
            room, r = caps.pop(k)
        else:
            room, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(i)
        room -= lens[i]
        if room > 0:
            bisect.insort(caps, (room, r))
    R = len(rows)
    ids = np.full((R, seq_len), pad_id, np.int32)
    tg = np.full((R, seq_len), IGNORE_INDEX, np.int32)
    seg = np.zeros((R, seq_len), np.int32)
    pos = np.zeros((R, seq_len), np.int32)
    for r, members in enumerate(rows):
        t = 0
        for j, i in enumerate(members):
            n = lens[i]
            ids[r, t:t + n] = samples[i].ids
            tg[r, t:t + n] = samples[i].targets()
            seg[r, t:t + n] = j
            pos[r, t:t + n] = np.arange(n)
            t += n
        seg[r, t:] = len(members)
        pos[r, t:] = np.arange(seq_len - t)
    return Packed(ids, tg, seg, pos, rows)


def pad_batch(samples, pad_id=0, pad_to=1):
    """(ids, targets) (B, T) of samples right-padded to the longest (rounded up to pad_to)."""
    T = max(len(s) for s in samples)
    T = -(-T // pad_to) * pad_to
    ids = np.full((len(samples), T), pad_id, np.int32)
    tg = np.full((len(samples), T), IGNORE_INDEX, np.int32)
    for b, s in enumerate(samples):
        ids[b, :len(s)] = s.ids
        tg[b, :len(s)] = s.targets()
    return ids, tg


class LengthSortedBatches:
    """Batches of samples of similar length (consecutive in length order), padded to the longest
    of the batch; the batch order is shuffled each epoch, deterministically from (seed, epoch).
    Same interface as Batches: next(), state(), load_state()."""

    def __init__(self, samples, batch_size, seed, pad_id=0, pad_to=1, where="<data>"):
        if len(samples) < batch_size:
            raise DataError(f"[data] {where}: {len(samples)} samples are fewer than one batch of {batch_size}")
        self.samples, self.batch_size, self.seed = samples, int(batch_size), seed
        self.pad_id, self.pad_to = pad_id, pad_to
        self.order = sorted(range(len(samples)), key=lambda i: (len(samples[i]), i))
        self.n_batches = len(samples) // batch_size   # the incomplete last batch is left out
        self.epoch, self.index = 0, 0
        self._perm = None

    def _batch_order(self):
        if self._perm is None:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_batches)
        return self._perm

    def next(self):
        if self.index >= self.n_batches:
            self.epoch, self.index, self._perm = self.epoch + 1, 0, None
        b = int(self._batch_order()[self.index])
        self.index += 1
        rows = self.order[b * self.batch_size:(b + 1) * self.batch_size]
        return pad_batch([self.samples[i] for i in rows], self.pad_id, self.pad_to)

    def state(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, s):
        self.epoch, self.index, self._perm = int(s["epoch"]), int(s["index"]), None
