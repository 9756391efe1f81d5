"""The inputs of one training micro-batch, in two halves: what the host decides and checks
(HostInputs: ids, targets, their count, positions, segments, the dropout seed, the shape of the
attention) and the device tensors the step reads (DeviceInputs). Every per-call number a step
needs lives in a device tensor, not in an op's scalar argument, so the same recorded step
(Device.capture) replays for any batch of its shape once new contents are uploaded."""

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import _core
from .config import IGNORE_INDEX

SEED_MASK = 0x7FFFFFFFFFFFFFFF
SEED_STRIDE = 1000003  # call c's mask for the linear tagged t is seeded (c * SEED_STRIDE + t) & SEED_MASK


def seed_offset_words(call_seed, first_row=None):
    """(2,) int32: (call_seed * SEED_STRIDE) & SEED_MASK as (low, high) 32-bit words, the
    seed_offset of ops.dropout (which adds the linear's tag); (3,) with first_row, the global
    index of the call's first row (a data-parallel rank's slice draws the whole batch's masks)."""
    off = (int(call_seed) * SEED_STRIDE) & SEED_MASK
    words = [off & 0xFFFFFFFF, off >> 32] + ([] if first_row is None else [int(first_row)])
    return np.array(words, np.uint32).view(np.int32)


@dataclass
class HostInputs:
    """One micro-batch as the host holds it. ids and targets flat (N = B T); positions and
    segments (B, T) or None (positions 0..T-1 in every row; one segment per row)."""
    B: int
    T: int
    ids: Optional[np.ndarray]       # (N,) i32; None when the caller passed a device tensor
    targets: np.ndarray             # (N,) i32, -100 where ignored
    positions: Optional[np.ndarray]
    segments: Optional[np.ndarray]
    n_valid: int                    # targets that are not -100
    ce_scale: float                 # loss_scale / max(n_valid, 1): the loss gradient's factor
    call_seed: Optional[int]        # seeds the dropout masks; None (eval) turns dropout off
    window: int                     # sliding window this call attends with (0: none)
    long_rope: bool                 # the rotary frequencies of long positions (LongRoPE)
    first_row: Optional[int] = None  # token row of ids[0] in the global batch (krnl.train.dist.world), else None
    loss_scale: float = 1.0         # the loss gradient's factor before the mean (dynamic loss scaling)

    def key(self):
        """What a recorded step depends on besides the contents of its inputs."""
        return (self.B, self.T, self.positions is not None, self.segments is not None, self.window,
                self.long_rope, self.call_seed is not None)


@dataclass
class DeviceInputs:
    ids: _core.Tensor                     # (N,) i32
    targets: _core.Tensor                 # (N,) i32
    ce_scale: _core.Tensor                # (1,) f32
    seed_offset: Optional[_core.Tensor]   # (2,) i32, None without dropout
    positions: list                       # B of (T,) i32 (one tensor B times when rows share them)
    segments: Optional[list]              # B of (T,) i32
    rope_positions: Optional[_core.Tensor] = None  # the positions as one tensor: (T,) shared, or (B, T)
    loss_scale: Optional[_core.Tensor] = None  # (1,) f32: the load-balancing loss's gradient factor

    @classmethod
    def of(cls, dev, host, ids=None):
        """Fresh tensors holding `host` (ids: a device tensor to use instead of host.ids)."""
        B, T = host.B, host.T
        pos = host.positions
        every = dev.tensor(np.arange(T, dtype=np.int32) if pos is None else np.asarray(pos, np.int32), "i32")
        positions = [every] * B if pos is None else [every[b] for b in range(B)]  # rows: views of (B, T)
        seg = None if host.segments is None else [dev.tensor(host.segments[b], "i32") for b in range(B)]
        return cls(ids if ids is not None else dev.tensor(host.ids, "i32"), dev.tensor(host.targets, "i32"),
                   dev.tensor(np.array([host.ce_scale], np.float32), "f32"),
                   None if host.call_seed is None else
                   dev.tensor(seed_offset_words(host.call_seed, host.first_row), "i32"),
                   positions, seg, every, dev.tensor(np.array([host.loss_scale], np.float32), "f32"))

    def write(self, dev, host):
        """New contents from `host`, whose key() must equal the one these tensors were made for."""
        dev.upload(self.ids, host.ids)
        dev.upload(self.targets, host.targets)
        dev.upload(self.ce_scale, np.array([host.ce_scale], np.float32))
        dev.upload(self.loss_scale, np.array([host.loss_scale], np.float32))
        if self.seed_offset is not None:
            dev.upload(self.seed_offset, seed_offset_words(host.call_seed, host.first_row))
        if host.positions is not None:
            dev.upload(self.rope_positions, np.asarray(host.positions, np.int32))
        if host.segments is not None:
            for b in range(host.B):
                dev.upload(self.segments[b], host.segments[b])


# ---- the host's checks of a call's rows (LlamaModel)

def id_array(ids, what):
    """(shape, (B, T) integer array, or None for a device tensor) of ids or targets."""
    if isinstance(ids, _core.Tensor):
        if ids.ndim != 2:
            raise ValueError(f"[LlamaModel] {what} must be (B, T), got {ids.shape}")
        return tuple(ids.shape), None
    a = np.asarray(ids)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"[LlamaModel] {what} must be a (B, T) integer array, got shape {a.shape} dtype {a.dtype}")
    return a.shape, a


def row_arrays(a, what, shape):
    """Checked (B, T) int32 rows of segments or positions (None passes through)."""
    if a is None:
        return None
    a = np.asarray(a)
    if a.ndim == 1:
        a = a[None, :]
    if a.shape != tuple(shape) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"[LlamaModel] {what} must be a {tuple(shape)} integer array like ids, "
                         f"got shape {a.shape} dtype {a.dtype}")
    return a.astype(np.int32)


def plan_rows(config, shape, segments=None, positions=None):
    """The host's half of a call's rows: (segments, positions) as checked (B, T) int32 arrays
    or None, and the sliding window it attends with (0: none)."""
    B, T = shape
    seg = row_arrays(segments, "segments", shape)
    pos = row_arrays(positions, "positions", shape)
    mp = config.max_position_embeddings
    if pos is not None:
        if pos.min() < 0 or pos.max() >= mp:
            raise ValueError(f"[LlamaModel] positions must lie in [0, {mp}) (max_position_embeddings), "
                             f"got [{pos.min()}, {pos.max()}]")
    elif T > mp:
        raise ValueError(f"[LlamaModel] sequence length {T} exceeds max_position_embeddings {mp}")
    sw, window = config.sliding_window, 0
    if sw is not None:
        span = T
        if seg is not None:  # the longest run of one segment bounds the attention span
            edges = np.concatenate([np.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
            run_starts = np.flatnonzero(np.concatenate([edges.reshape(-1), [True]]))
            span = int(np.diff(run_starts).max())
        if span > sw:  # the fused op where the device lists windows, else the materialised softmax's
            window = sw
    return seg, pos, window


def check_ids(a, what, allow_ignore, V):
    """Raises naming the values of ids (or targets) outside [0, V) (but -100 where allowed)."""
    if a is None:
        return
    bad = (a < 0) | (a >= V)
    if allow_ignore:
        bad &= a != IGNORE_INDEX
    if bad.any():
        raise ValueError(f"[LlamaModel] {what} holds values outside [0, {V})"
                         + (f" other than {IGNORE_INDEX}" if allow_ignore else "") + f": {np.unique(a[bad])[:8]}")


def target_array(targets, shape, dev, V):
    """(targets, a (B, T) array or device tensor of ids below V or ignore_index, as a checked
    array, the count that is not ignore_index); shape: the ids'. A device tensor is read, so not
    inside a step."""
    tshape, ta = id_array(targets, "targets")
    if tshape != shape:
        raise ValueError(f"[LlamaModel] targets shape {tshape} differs from ids shape {shape}")
    if ta is None:
        if dev.in_step:
            raise ValueError("[LlamaModel] targets given as a device tensor cannot be counted inside a step; "
                             "pass a numpy array")
        ta = np.asarray(targets.numpy())
    check_ids(ta, "targets", True, V)
    return ta, int((ta != IGNORE_INDEX).sum())
