"""Trainable parameters as one flat f32 buffer (docs/architecture.md, 'LoRA'): the masters, their
gradients and the Adam moments are four flat tensors laid out identically, so one adamw_update,
one sumsq and one nonfinite cover every parameter. Each named parameter is a view by offset.
A compute-dtype working copy (f16/bf16) is refreshed by the optimizer step.

With `split_rows` on (StepRunner of one process) the LoRA backward sums each weight gradient
over the first and the second half of a micro-batch's rows separately, into `grads` and
`grads_hi`, and fold_grads() adds the two once a step: the sums and the one addition that two
data-parallel ranks compute (docs/distributed.md), so one process's f32 gradient does not
depend on how many ranks would share its batch and 2 ranks reproduce it bit for bit."""

import numpy as np

from . import _core

ops = _core.ops


class FlatParams:
    def __init__(self, device, shapes, compute_dtype="f32"):
        """shapes: {name: shape} in layout order."""
        self.device, self.compute_dtype = device, compute_dtype
        self.shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        self.offsets, n = {}, 0
        for k, shape in self.shapes.items():
            size = int(np.prod(shape)) if shape else 1
            self.offsets[k] = (n, size)
            n += size
        self.numel = n
        self.params, self.grads, self.m, self.v = (device.zeros((max(n, 1),), "f32") for _ in range(4))
        self.grads_hi = None  # (n,) f32: the second halves' gradients while split_rows is on
        self.split_rows = False
        self.working = device.zeros((max(n, 1),), compute_dtype) if compute_dtype != "f32" else None

    def _view(self, flat, name):
        off, size = self.offsets[name]
        return flat[off:off + size].reshape(self.shapes[name])

    def master(self, name):
        """The f32 master of `name` (what the optimizer updates)."""
        return self._view(self.params, name)

    def grad(self, name):
        """The f32 gradient of `name` (accumulated across micro-batches)."""
        return self._view(self.grads, name)

    def compute(self, name):
        """`name` in the compute dtype: the working copy, or the master in f32 training."""
        return self._view(self.working if self.working is not None else self.params, name)

    def load(self, values):
        """Sets masters from {name: array} (every name) and refreshes the working copy."""
        missing = set(self.shapes) - set(values)
        if missing:
            raise KeyError(f"[FlatParams.load] missing parameters: {sorted(missing)}")
        flat = np.empty(self.numel, np.float32)
        for k, (off, size) in self.offsets.items():
            v = np.asarray(values[k], np.float32)
            if v.shape != self.shapes[k]:
                raise ValueError(f"[FlatParams.load] {k} has shape {v.shape}, expected {self.shapes[k]}")
            flat[off:off + size] = v.reshape(-1)
        # Uploaded and copied on the device: a numpy() view is a private copy on devices whose
        # memory is not host-visible (cuda), so writing through it would be lost there.
        ops.cast(self.device.tensor(flat, "f32"), self.params[:self.numel])
        self.refresh_working()

    def state(self):
        """{name: float32 array copy} of the masters."""
        flat = self.params.numpy()
        return {k: flat[off:off + size].reshape(self.shapes[k]).copy() for k, (off, size) in self.offsets.items()}

    def refresh_working(self):
        if self.working is not None:
            ops.cast(self.params, self.working)

    def zero_grads(self):
        ops.fill(self.grads, 0.0)
        if self.grads_hi is not None:
            ops.fill(self.grads_hi, 0.0)

    def grad_hi(self, name):
        """The f32 gradient of `name` over the second half of the rows (split_rows), or None."""
        return self._view(self.grads_hi, name) if self.grads_hi is not None else None

    def set_split_rows(self, on):
        """Turns the half-batch gradient sums on or off (allocating grads_hi once); LoraFactors
        made before read the flag and buffer through this object."""
        if on and self.grads_hi is None:
            self.grads_hi = self.device.zeros((max(self.numel, 1),), "f32")
        self.split_rows = bool(on)

    def fold_grads(self):
        """grads += grads_hi, then grads_hi = 0: the step's gradient over all rows (split_rows)."""
        if self.split_rows:
            ops.axpy(1.0, self.grads_hi, self.grads)
            ops.fill(self.grads_hi, 0.0)
