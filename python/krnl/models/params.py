"""Trainable parameters as one flat f32 buffer (docs/architecture.md, 'LoRA'): the masters and
their gradients are two flat tensors laid out identically, so one optimizer update, one sumsq and
one nonfinite cover every parameter. Each named parameter is a view by offset. An optimizer
allocates the state vectors it needs itself (`zeros`), laid out as the params or packed over the
few parameters that need them (`layout`). A compute-dtype working copy (f16/bf16) is refreshed by
the optimizer step."""

import numpy as np

from .. import _core

ops = _core.ops


class Layout:
    """Named shapes packed one after another in order: {name: (offset, size)} and `numel`."""

    def __init__(self, shapes):
        self.shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        self.offsets, n = {}, 0
        for k, shape in self.shapes.items():
            size = int(np.prod(shape)) if shape else 1
            self.offsets[k] = (n, size)
            n += size
        self.numel = n

    def view(self, flat, name):
        """`name`'s view of a flat buffer of this layout."""
        off, size = self.offsets[name]
        return flat[off:off + size].reshape(self.shapes[name])


class FlatParams(Layout):
    def __init__(self, device, shapes, compute_dtype="f32"):
        """shapes: {name: shape} in layout order."""
        super().__init__(shapes)
        self.device, self.compute_dtype = device, compute_dtype
        n = self.numel
        self.params, self.grads = (device.zeros((max(n, 1),), "f32") for _ in range(2))
        self.working = device.zeros((max(n, 1),), compute_dtype) if compute_dtype != "f32" else None

    def layout(self, names):
        """The Layout of the parameters `names` packed in this layout's order (a state vector over
        only some of them: 8-bit AdamW's small ones, Muon's AdamW ones)."""
        names = set(names)
        return Layout({k: s for k, s in self.shapes.items() if k in names})

    def zeros(self, layout=None):
        """A zeroed f32 buffer of `layout` (default: laid out as the params), e.g. an optimizer's
        moment; its views by name are layout.view(buffer, name)."""
        n = (self if layout is None else layout).numel
        return self.device.zeros((max(n, 1),), "f32")

    def master(self, name):
        """The f32 master of `name` (what the optimizer updates)."""
        return self.view(self.params, name)

    def grad(self, name):
        """The f32 gradient of `name` (accumulated across micro-batches)."""
        return self.view(self.grads, name)

    def compute(self, name):
        """`name` in the compute dtype: the working copy, or the master in f32 training."""
        return self.view(self.working if self.working is not None else self.params, name)

    def rows(self, names):
        """(compute, grad) views of the 2-D parameters `names` stacked by rows, (sum of their rows,
        cols), where they lie side by side in this order with one column count; else None."""
        shapes = [self.shapes[k] for k in names]
        if any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes):
            return None
        return self.joined(names, (sum(s[0] for s in shapes), shapes[0][1]))

    def joined(self, names, shape):
        """(compute, grad) views, of `shape`, of the parameters `names` as one tensor, where they lie
        side by side in this order; else None."""
        spans = [self.offsets[k] for k in names]
        if any(o + n != nxt for (o, n), (nxt, _) in zip(spans, spans[1:])):
            return None
        off, size = spans[0][0], sum(n for _, n in spans)
        flat = self.working if self.working is not None else self.params
        return flat[off:off + size].reshape(shape), self.grads[off:off + size].reshape(shape)

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
