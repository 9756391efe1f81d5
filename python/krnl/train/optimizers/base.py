"""What every optimizer over a FlatParams shares (docs/architecture.md, 'Training numerics').

An optimizer runs as ONE update op over the flat f32 buffers of a `FlatParams` (masters, grads and
its state vectors laid out identically; Adafactor, Muon and 8-bit AdamW loop over the parameters'
views). Each optimizer allocates only the state it reads (`moments`): a state vector laid out as
the params, or packed over the few parameters that need it (8-bit AdamW's small ones). Per
optimizer step the device does, without waiting for the host: a nonfinite check of the grads
(only with loss scaling), `sumsq` of the grads for the global norm, then the update, which reads
that norm and the step's numbers (one (5,) tensor the host uploads first: three of the
optimizer's own, e.g. AdamW's learning rate over its bias correction, then 1 / (loss_scale *
n_micro) and max_norm) from device memory, multiplies its grad read by

    grad_scale = clip / (loss_scale * n_micro),   clip = min(1, max_norm / (norm + 1e-6))

with `norm` measured after unscaling (divided by loss_scale * n_micro), skips the update where
the flag is set or the norm is not finite, and the grads are zeroed. The host reads the norm and
the flag once the step is done (finish_step) and updates its counters and loss scale for the
next one: nothing in between waits for it, so the step's device work can be a replayed graph.

Skipped steps (dynamic loss scaling found inf/NaN) follow PyTorch's GradScaler: the parameter
update is skipped, so the optimizer's step count (bias correction) does NOT advance and the state
and the masters stay bit-identical; the schedule DOES advance, exactly as with the usual PyTorch
loop `scaler.step(opt); scaler.update(); sched.step()` where the scheduler is stepped every
iteration. The schedule is therefore indexed by the iteration count (every call of `step`),
which is what a trainer's step counter, data position and checkpoints count as well. Skips are
counted in `LossScaler.skipped_steps` and reported by `step()`.
"""

import math

import numpy as np

from ... import _core
from .schedule import LossScaler, Schedule

ops = _core.ops
f32 = np.float32


class FlatOptimizer:
    """The common half of krnl's optimizers: clipping, gradient accumulation (grads summed over n
    micro-batches, divided by n here), dynamic loss scaling, counters and state. A subclass names
    itself (`name`, the --optimizer value), its state vectors (`state`: {state_dict key: its
    attribute}, allocated by itself, those over parameters by `moments`), the first three numbers of
    its hyper tensor (`numbers`) and its update op (`update`), and its own hyperparameters
    (`options`, `set_options`).

    loss_scaler=None: dynamic loss scaling is enabled exactly when the compute dtype is f16."""

    name = None
    rows = 1  # rows of five in the hyper tensor per parameter group (Muon: its AdamW's too)
    state = {}  # {state_dict key: this optimizer's attribute holding that device tensor}

    def __init__(self, flat_params, schedule, weight_decay=0.0, max_grad_norm=None, loss_scaler=None,
                 lr_ratio=None):
        who = type(self).__name__
        if not isinstance(schedule, Schedule):
            raise TypeError(f"[{who}] schedule must be a krnl.train.optim.Schedule, got {type(schedule).__name__}")
        if not (float(weight_decay) >= 0):
            raise ValueError(f"[{who}] weight_decay must be >= 0, got {weight_decay}")
        if max_grad_norm is not None and not (float(max_grad_norm) > 0 and math.isfinite(float(max_grad_norm))):
            raise ValueError(f"[{who}] max_grad_norm must be None or finite and > 0, got {max_grad_norm}")
        if lr_ratio is not None and not (float(lr_ratio) > 0 and math.isfinite(float(lr_ratio))):
            raise ValueError(f"[{who}] lr_ratio (LoRA+) must be None or finite and > 0, got {lr_ratio}")
        self.flat, self.schedule = flat_params, schedule
        self.lr_ratio = None if lr_ratio is None else float(lr_ratio)
        self.weight_decay = float(weight_decay)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        if loss_scaler is None:
            loss_scaler = LossScaler(enabled=flat_params.compute_dtype == "f16")
        self.scaler = loss_scaler
        self.iteration = 0  # calls of step(): the schedule position
        self.adam_step = 0  # applied updates: the optimizer's own step count (bias correction, first step)
        dev = flat_params.device
        self._sq = dev.zeros((1,), "f32")
        self._flag = dev.zeros((1,), "i32")
        self.layouts = {}  # attribute -> the Layout of a state vector over parameters (moments())

    def moments(self, attr, names=None):
        """Allocates self.<attr>: a zeroed f32 state vector over the parameters `names` packed in
        layout order, or over all of them (None: laid out as the params, sliced as they are)."""
        layout = self.flat if names is None else self.flat.layout(names)
        self.layouts[attr] = layout
        setattr(self, attr, self.flat.zeros(layout))

    def view(self, attr, name):
        """Parameter `name`'s view of the state vector self.<attr>."""
        return self.layouts[attr].view(getattr(self, attr), name)

    @property
    def loss_scale(self):
        """The factor the caller applies to the loss gradient (1.0 without loss scaling)."""
        return self.scaler.scale

    @property
    def skipped_steps(self):
        return self.scaler.skipped_steps

    # ---- LoRA+ (Hayou et al. 2024, PEFT's create_loraplus_optimizer): the B factors at lr * lr_ratio

    @property
    def hyper_size(self):
        """The hyper tensor's length: `rows` rows of five per parameter group."""
        return 5 * self.rows * (2 if self.lr_ratio else 1)

    def group(self, name):
        """A parameter's group: 1 for a LoRA B factor under LoRA+ (PEFT's groupB: lr * lr_ratio, the
        same weight decay; krnl adapts no embeddings and has no bias among its factors, so PEFT's
        other groups have no members here), else 0."""
        return int(bool(self.lr_ratio) and ".lora_B." in name)

    def group_hyper(self, hyper, group):
        """The group's part of the hyper tensor: its rows of five."""
        b = 5 * self.rows * group
        return hyper[b:b + 5 * self.rows]

    def runs(self, hyper):
        """(slice of the flat buffers, its group's hyper rows) over stretches of one group, in layout
        order: the whole buffer in one without LoRA+."""
        out = []
        for k, (off, size) in self.flat.offsets.items():
            g = self.group(k)
            if out and out[-1][0] == g and out[-1][2] == off:
                out[-1][2] = off + size
            elif size:
                out.append([g, off, off + size])
        return [(slice(a, b), self.group_hyper(hyper, g)) for g, a, b in out]

    def working(self, part):
        """The working copy's part (a slice, or a parameter's name), None in f32 training."""
        flat = self.flat
        if flat.working is None:
            return None
        return flat.compute(part) if isinstance(part, str) else flat.working[part]

    def _check_betas(self, betas):
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"[{type(self).__name__}] betas must be in [0, 1), got {tuple(betas)}")
        return b1, b2

    # ---- a subclass's part

    def numbers(self, t, lr):
        """hyper[0:3] of update t (1-based) at learning rate lr, formed as the op's scalar path does."""
        raise NotImplementedError

    def update(self, hyper):
        """Queues the update op reading hyper, self._sq and (with loss scaling) self._flag."""
        raise NotImplementedError

    def options(self):
        """The optimizer's own hyperparameters, JSON values (state_dict's "hyper")."""
        return {}

    def set_options(self, saved):
        pass

    # ---- the step

    def step(self, accumulated_micro_batches=1):
        """One optimizer step over the grads accumulated since the last one; zeroes them.
        Returns {lr, grad_norm (unscaled, before clipping), skipped, loss_scale (the one these
        grads were computed with), step (iteration), skipped_steps}."""
        self.queue_step(accumulated_micro_batches)
        return self.finish_step()

    def hyper(self, accumulated_micro_batches=1):
        """(hyper_size,) f32 numpy: the update's `hyper` for the next step (see queue_step)."""
        n = accumulated_micro_batches
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"[{type(self).__name__}.step] accumulated_micro_batches must be an integer >= 1, "
                             f"got {n!r}")
        t, lr = self.adam_step + 1, self.schedule.lr_at(self.iteration + 1)
        self._pending = (int(n), self.scaler.scale, lr)
        scales = (1.0, self.lr_ratio) if self.lr_ratio else (1.0,)
        nums = [x for s in scales for x in self.numbers(t, lr * s)]
        tail = [1.0 / (self.scaler.scale * n), self.max_grad_norm or 0.0]
        # one row of five per group of three numbers (Muon's second row: its AdamW's)
        return np.array(sum((nums[i:i + 3] + tail for i in range(0, len(nums), 3)), []), np.float32)

    def queue_ops(self, hyper):
        """The device's half of a step, reading its numbers from the f32 tensor `hyper`
        (hyper()): the inf/NaN flag (with loss scaling), the squared gradient norm, the update
        (skipped on the device when the flag is set or the norm is not finite; clipped by the
        norm there) and zeroed grads. Reads nothing on the host: a recording replays it."""
        if self.scaler.enabled:
            ops.fill(self._flag, 0.0)
            ops.nonfinite(self.flat.grads, self._flag)
        ops.sumsq(self.flat.grads, self._sq)
        self.update(hyper)
        ops.fill(self.flat.grads, 0.0)

    def _device_scalars(self, hyper):
        """The update op's keyword arguments of the device-resident scalars."""
        return {"hyper": hyper, "sq": self._sq, "flag": self._flag if self.scaler.enabled else None}

    def queue_step(self, accumulated_micro_batches=1):
        """Queues one step (its own submission) without waiting; finish_step() reads its outcome."""
        dev = self.flat.device
        if dev.in_step:
            raise RuntimeError(f"[{type(self).__name__}.step] called inside an open step: commit the backward first")
        hyper = dev.tensor(self.hyper(accumulated_micro_batches), "f32")
        with dev.step():
            self.queue_ops(hyper)

    def finish_step(self):
        """Waits for the queued step, reads its two numbers (the step's one host read) and
        advances the host's counters and loss scale; returns queue_step's info (step())."""
        n, loss_scale, lr = self._pending
        iteration = self.iteration + 1
        scaling = self.scaler.enabled
        sq = float(self._sq.numpy()[0])
        found = bool(self._flag.numpy()[0]) if scaling else not math.isfinite(sq)
        denom = loss_scale * n
        norm = math.sqrt(sq) / denom if math.isfinite(sq) else float("inf")
        if found and not scaling:  # the device skipped the update: the masters are intact
            raise FloatingPointError(f"[{type(self).__name__}.step] step {iteration}: gradients hold inf or NaN, or "
                                     f"their squared norm overflowed float32 (f32 training has no loss scaling; "
                                     f"lower the learning rate or enable clipping)")
        # Overflow of the f32 sum of squares with finite grads also counts as overflow under scaling.
        found = found or not math.isfinite(sq)
        skipped = self.scaler.update(found)
        self.iteration = iteration
        if not skipped:
            self.adam_step += 1
        return {"lr": lr, "grad_norm": norm, "skipped": skipped, "loss_scale": loss_scale,
                "step": iteration, "skipped_steps": self.scaler.skipped_steps}

    # ---- state

    def state_dict(self):
        """The state vectors (numpy copies, f32 or i32, by `state`'s keys), counters, schedule, scaler,
        the hyperparameters and the parameter layout (names and shapes) for load-time checks."""
        out = {key: np.array(t.numpy()[:size], copy=True) for key, (t, size, _) in self._vectors().items()}
        out.update({
            "optimizer": self.name,
            "step": self.adam_step,
            "iteration": self.iteration,
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            "hyper": dict(self.options(), weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm,
                          loraplus_lr_ratio=self.lr_ratio),
            # (name, shape) pairs: order matters (the flat layout) and survives JSON key sorting.
            "layout": [[k, list(s)] for k, s in self.flat.shapes.items()],
        })
        return out

    def _vectors(self):
        """{state_dict key: (its device tensor, the length saved, its Layout over the parameters or
        None for a vector of the optimizer's own layout)}."""
        out = {}
        for key, attr in self.state.items():
            t, layout = getattr(self, attr), self.layouts.get(attr)
            out[key] = (t, layout.numel if layout else t.shape[0], layout)
        return out

    def _gather(self, a, order, layout):
        """The parameters of `layout` from a vector saved over the parameters `order` ({name: shape}
        in its order): another order of the same ones (an earlier krnl's layout, A and B
        interleaved), or all of them where `layout` covers fewer (an earlier krnl kept every state
        vector as long as the params: 8-bit AdamW's and Muon's v)."""
        at, off = {}, 0
        for k, shape in order.items():
            size = int(np.prod(shape)) if shape else 1
            at[k], off = a[off:off + size], off + size
        out = np.empty(layout.numel, a.dtype)
        for k, (o, size) in layout.offsets.items():
            out[o:o + size] = at[k]
        return out

    def load_state_dict(self, state):
        who, n = f"{type(self).__name__}.load_state_dict", self.flat.numel
        saved = state.get("optimizer", "adamw")  # states before the choice of optimizer are AdamW's
        if saved != self.name:
            raise ValueError(f"[{who}] the state is {saved}'s, this optimizer is {self.name}")
        layout = state.get("layout")
        theirs = ours = None
        if layout is not None:
            ours = {k: list(s) for k, s in self.flat.shapes.items()}
            theirs = {k: [int(d) for d in s] for k, s in layout}
            if theirs != ours:
                diff = [f"{k}: state {theirs.get(k)} vs params {ours.get(k)}"
                        for k in list(dict.fromkeys(list(theirs) + list(ours))) if theirs.get(k) != ours.get(k)]
                raise ValueError(f"[{who}] optimizer state is for a different parameter layout: "
                                 + "; ".join(diff[:5]) + (" ..." if len(diff) > 5 else ""))
        hyper = state.get("hyper")
        if hyper is not None:  # first: SGD's momentum says whether a buffer is saved
            self.set_options(hyper)
            self.weight_decay, ratio = float(hyper["weight_decay"]), hyper.get("loraplus_lr_ratio")
            self.lr_ratio = None if ratio is None else float(ratio)
            mg = hyper["max_grad_norm"]
            self.max_grad_norm = None if mg is None else float(mg)
        arrays, vectors = {}, self._vectors()
        order = theirs or {k: list(s) for k, s in self.flat.shapes.items()}  # the saved order (else ours)
        for key, (t, size, layout) in vectors.items():
            if key not in state:
                raise ValueError(f"[{who}] the state has no {key} (a {self.name} of these options needs one)")
            a = np.asarray(state[key])
            full = layout is not None and size != n and a.shape == (n,)  # an earlier krnl's full-length vector
            if a.shape != (size,) and not full:
                raise ValueError(f"[{who}] {key} has shape {a.shape}, these parameters need ({size},)")
            a = np.ascontiguousarray(a, dtype=np.int32 if t.dtype == "i32" else np.float32)
            if layout is not None:
                src = order if full else {k: s for k, s in order.items() if k in layout.offsets}
                if list(src) != list(layout.offsets):
                    a = self._gather(a, src, layout)
            arrays[key] = a
        step, iteration = int(state["step"]), int(state["iteration"])
        if step < 0 or iteration < step:
            raise ValueError(f"[{who}] inconsistent counters: step {step}, iteration {iteration}")
        self.schedule.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        dev = self.flat.device
        sources = {key: dev.tensor(a, vectors[key][0].dtype) for key, a in arrays.items() if a.size}
        with dev.step():
            for key, src in sources.items():
                t, size, _ = vectors[key]
                ops.cast(src, t[0:size])
        self.adam_step, self.iteration = step, iteration
