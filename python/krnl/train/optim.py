"""Optimizer and learning-rate schedule (docs/architecture.md, 'Training numerics').

AdamW runs as ONE `adamw_update` over the flat f32 buffers of a `FlatParams` (masters, grads,
m, v laid out identically). Per optimizer step the device does, without waiting for the host: a
nonfinite check of the grads (only with loss scaling), `sumsq` of the grads for the global norm,
then one `adamw_update` that reads that norm and the step's numbers (learning rate, bias
corrections, 1 / (loss_scale * n_micro), max_norm: one (5,) tensor the host uploads first) from
device memory, multiplies its grad read by

    grad_scale = clip / (loss_scale * n_micro),   clip = min(1, max_norm / (norm + 1e-6))

with `norm` measured after unscaling (divided by loss_scale * n_micro), skips the update where
the flag is set or the norm is not finite, and the grads are zeroed. The host reads the norm and
the flag once the step is done (finish_step) and updates its counters and loss scale for the
next one: nothing in between waits for it, so the step's device work can be a replayed graph.

Skipped steps (dynamic loss scaling found inf/NaN) follow PyTorch's GradScaler: the parameter
update is skipped, so the Adam step count (bias correction) does NOT advance and m, v and the
masters stay bit-identical; the schedule DOES advance, exactly as with the usual PyTorch loop
`scaler.step(opt); scaler.update(); sched.step()` where the scheduler is stepped every
iteration. The schedule is therefore indexed by the iteration count (every call of `step`),
which is what a trainer's step counter, data position and checkpoints count as well. Skips are
counted in `LossScaler.skipped_steps` and reported by `step()`.
"""

import math

import numpy as np

from .. import _core

ops = _core.ops

_KINDS = ("cosine", "constant", "linear")


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"[Schedule] {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"[Schedule] {name} must be >= {minimum}, got {value}")
    return int(value)


class Schedule:
    """Learning rate per 1-based step: linear warmup lr*s/warmup for s <= warmup_steps, then
    `kind`: cosine (or linear) decay from lr to lr*min_lr_ratio over the remaining
    total_steps - warmup_steps steps (held at the minimum past total_steps), or constant lr."""

    def __init__(self, lr, warmup_steps=0, total_steps=None, kind="cosine", min_lr_ratio=0.0):
        self._configure(lr, warmup_steps, total_steps, kind, min_lr_ratio)

    def _configure(self, lr, warmup_steps, total_steps, kind, min_lr_ratio):
        try:
            lr_f = float(lr)
        except (TypeError, ValueError):
            raise ValueError(f"[Schedule] lr must be a number, got {lr!r}") from None
        if not math.isfinite(lr_f) or lr_f < 0:
            raise ValueError(f"[Schedule] lr must be finite and >= 0, got {lr!r}")
        warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        if kind not in _KINDS:
            raise ValueError(f"[Schedule] kind must be one of {_KINDS}, got {kind!r}")
        if total_steps is not None:
            total_steps = _check_int("total_steps", total_steps, 1)
            if total_steps < warmup_steps:
                raise ValueError(f"[Schedule] total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")
        elif kind != "constant":
            raise ValueError(f"[Schedule] total_steps is required for kind={kind!r}")
        try:
            ratio = float(min_lr_ratio)
        except (TypeError, ValueError):
            raise ValueError(f"[Schedule] min_lr_ratio must be a number, got {min_lr_ratio!r}") from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"[Schedule] min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
        self.lr, self.warmup_steps, self.total_steps = lr_f, warmup_steps, total_steps
        self.kind, self.min_lr_ratio = kind, ratio

    def lr_at(self, step):
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise ValueError(f"[Schedule.lr_at] step is 1-based, got {step!r}")
        step = int(step)
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        decay = self.total_steps - self.warmup_steps
        progress = 1.0 if decay == 0 else min(1.0, (step - self.warmup_steps) / decay)
        lo = self.lr * self.min_lr_ratio
        if self.kind == "cosine":
            return lo + (self.lr - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return lo + (self.lr - lo) * (1.0 - progress)

    def state_dict(self):
        return {"lr": self.lr, "warmup_steps": self.warmup_steps, "total_steps": self.total_steps,
                "kind": self.kind, "min_lr_ratio": self.min_lr_ratio}

    def load_state_dict(self, state):
        self._configure(state["lr"], state["warmup_steps"], state["total_steps"], state["kind"], state["min_lr_ratio"])

    def __repr__(self):
        return (f"Schedule(lr={self.lr}, warmup_steps={self.warmup_steps}, total_steps={self.total_steps}, "
                f"kind={self.kind!r}, min_lr_ratio={self.min_lr_ratio})")


class LossScaler:
    """Dynamic loss scaling (docs/architecture.md, 'Training numerics'): the caller multiplies the loss gradient by
    `scale`; on inf/NaN grads the step is skipped and the scale divided by `factor` (not below
    min_scale); after `growth_interval` consecutive clean steps it is multiplied by `factor`.
    Disabled, `scale` is 1 and `update` never skips."""

    def __init__(self, enabled, init=2.0**16, growth_interval=2000, factor=2.0, min_scale=1.0):
        init, factor, min_scale = float(init), float(factor), float(min_scale)
        if not (math.isfinite(init) and init > 0):
            raise ValueError(f"[LossScaler] init must be finite and > 0, got {init}")
        if not (math.isfinite(factor) and factor > 1):
            raise ValueError(f"[LossScaler] factor must be > 1, got {factor}")
        if not (math.isfinite(min_scale) and 0 < min_scale <= init):
            raise ValueError(f"[LossScaler] min_scale must be in (0, init], got {min_scale}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, (int, np.integer)) or growth_interval < 1:
            raise ValueError(f"[LossScaler] growth_interval must be an integer >= 1, got {growth_interval!r}")
        self.enabled = bool(enabled)
        self._scale = init
        self.growth_interval, self.factor, self.min_scale = int(growth_interval), factor, min_scale
        self.clean_steps = 0  # consecutive clean steps since the last change of scale
        self.skipped_steps = 0

    @property
    def scale(self):
        return self._scale if self.enabled else 1.0

    def update(self, found_nonfinite):
        """Records one step's outcome; returns True when the step must be skipped."""
        if not self.enabled:
            return False
        if found_nonfinite:
            self._scale = max(self._scale / self.factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return True
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self._scale *= self.factor
            self.clean_steps = 0
        return False

    def state_dict(self):
        return {"enabled": self.enabled, "scale": self._scale, "growth_interval": self.growth_interval,
                "factor": self.factor, "min_scale": self.min_scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state):
        self.enabled = bool(state["enabled"])
        self._scale = float(state["scale"])
        self.growth_interval, self.factor = int(state["growth_interval"]), float(state["factor"])
        self.min_scale = float(state["min_scale"])
        self.clean_steps, self.skipped_steps = int(state["clean_steps"]), int(state["skipped_steps"])


class AdamW:
    """PyTorch AdamW over a FlatParams' flat buffers, with global-norm clipping, gradient
    accumulation (grads summed over n micro-batches, divided by n here) and dynamic loss scaling.

    loss_scaler=None: dynamic loss scaling is enabled exactly when the compute dtype is f16."""

    def __init__(self, flat_params, schedule, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 max_grad_norm=None, loss_scaler=None):
        if not isinstance(schedule, Schedule):
            raise TypeError(f"[AdamW] schedule must be a krnl.train.optim.Schedule, got {type(schedule).__name__}")
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"[AdamW] betas must be in [0, 1), got {tuple(betas)}")
        if not (float(eps) > 0):
            raise ValueError(f"[AdamW] eps must be > 0, got {eps}")
        if not (float(weight_decay) >= 0):
            raise ValueError(f"[AdamW] weight_decay must be >= 0, got {weight_decay}")
        if max_grad_norm is not None and not (float(max_grad_norm) > 0 and math.isfinite(float(max_grad_norm))):
            raise ValueError(f"[AdamW] max_grad_norm must be None or finite and > 0, got {max_grad_norm}")
        self.flat, self.schedule = flat_params, schedule
        self.betas, self.eps, self.weight_decay = (b1, b2), float(eps), float(weight_decay)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        if loss_scaler is None:
            loss_scaler = LossScaler(enabled=flat_params.compute_dtype == "f16")
        self.scaler = loss_scaler
        self.iteration = 0  # calls of step(): the schedule position
        self.adam_step = 0  # applied updates: the bias-correction step
        dev = flat_params.device
        self._sq = dev.zeros((1,), "f32")
        self._flag = dev.zeros((1,), "i32")

    @property
    def loss_scale(self):
        """The factor the caller applies to the loss gradient (1.0 without loss scaling)."""
        return self.scaler.scale

    @property
    def skipped_steps(self):
        return self.scaler.skipped_steps

    def step(self, accumulated_micro_batches=1):
        """One optimizer step over the grads accumulated since the last one; zeroes them.
        Returns {lr, grad_norm (unscaled, before clipping), skipped, loss_scale (the one these
        grads were computed with), step (iteration), skipped_steps}."""
        self.queue_step(accumulated_micro_batches)
        return self.finish_step()

    def hyper(self, accumulated_micro_batches=1):
        """(5,) f32 numpy: adamw_update's `hyper` for the next step (see queue_step)."""
        n = accumulated_micro_batches
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"[AdamW.step] accumulated_micro_batches must be an integer >= 1, got {n!r}")
        t, lr = self.adam_step + 1, self.schedule.lr_at(self.iteration + 1)
        self._pending = (int(n), self.scaler.scale, lr)
        # As the scalar adamw_update forms them: f32 lr and betas, bias corrections in double.
        f32 = np.float32
        lr32, b1, b2 = f32(lr), float(f32(self.betas[0])), float(f32(self.betas[1]))
        return np.array([float(lr32) / (1.0 - b1**t), math.sqrt(1.0 - b2**t), lr32 * f32(self.weight_decay),
                         1.0 / (self.scaler.scale * n), self.max_grad_norm or 0.0], np.float32)

    def queue_ops(self, hyper):
        """The device's half of a step, reading its numbers from the (5,) f32 tensor `hyper`
        (hyper()): the inf/NaN flag (with loss scaling), the squared gradient norm, the update
        (skipped on the device when the flag is set or the norm is not finite; clipped by the
        norm there) and zeroed grads. Reads nothing on the host: a recording replays it."""
        flat = self.flat
        if self.scaler.enabled:
            ops.fill(self._flag, 0.0)
            ops.nonfinite(flat.grads, self._flag)
        ops.sumsq(flat.grads, self._sq)
        b1, b2 = self.betas
        ops.adamw_update(flat.params, flat.grads, flat.m, flat.v, 0.0, b1, b2, self.eps, 0.0, 1, 1.0, flat.working,
                         hyper=hyper, sq=self._sq, flag=self._flag if self.scaler.enabled else None)
        ops.fill(flat.grads, 0.0)

    def queue_step(self, accumulated_micro_batches=1):
        """Queues one step (its own submission) without waiting; finish_step() reads its outcome."""
        dev = self.flat.device
        if dev.in_step:
            raise RuntimeError("[AdamW.step] called inside an open step: commit the backward first")
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
            raise FloatingPointError(f"[AdamW.step] step {iteration}: gradients hold inf or NaN, or their squared "
                                     f"norm overflowed float32 (f32 training has no loss scaling; lower the "
                                     f"learning rate or enable clipping)")
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
        """m, v (float32 numpy copies of the flat moments), counters, schedule, scaler, the
        hyperparameters and the parameter layout (names and shapes) for load-time checks."""
        n = self.flat.numel
        return {
            "m": np.array(self.flat.m.numpy()[:n], dtype=np.float32, copy=True),
            "v": np.array(self.flat.v.numpy()[:n], dtype=np.float32, copy=True),
            "step": self.adam_step,
            "iteration": self.iteration,
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            "hyper": {"betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
                      "max_grad_norm": self.max_grad_norm},
            # (name, shape) pairs: order matters (the flat layout) and survives JSON key sorting.
            "layout": [[k, list(s)] for k, s in self.flat.shapes.items()],
        }

    def _in_our_order(self, flat, theirs):
        """A flat moment saved in another order of the same parameters (an earlier krnl's layout,
        A and B interleaved), moved parameter by parameter into this one's."""
        at, off = {}, 0
        for k, shape in theirs.items():
            size = int(np.prod(shape)) if shape else 1
            at[k], off = flat[off:off + size], off + size
        out = np.empty_like(flat)
        for k, (o, size) in self.flat.offsets.items():
            out[o:o + size] = at[k]
        return out

    def load_state_dict(self, state):
        n = self.flat.numel
        layout = state.get("layout")
        theirs = None
        if layout is not None:
            ours = {k: list(s) for k, s in self.flat.shapes.items()}
            theirs = {k: [int(d) for d in s] for k, s in layout}
            if theirs != ours:
                diff = [f"{k}: state {theirs.get(k)} vs params {ours.get(k)}"
                        for k in list(dict.fromkeys(list(theirs) + list(ours))) if theirs.get(k) != ours.get(k)]
                raise ValueError("[AdamW.load_state_dict] optimizer state is for a different parameter layout: "
                                 + "; ".join(diff[:5]) + (" ..." if len(diff) > 5 else ""))
        arrays = {}
        for key in ("m", "v"):
            a = np.asarray(state[key])
            if a.shape != (n,):
                raise ValueError(f"[AdamW.load_state_dict] {key} has shape {a.shape}, these parameters need ({n},)")
            a = np.ascontiguousarray(a, dtype=np.float32)
            if theirs is not None and list(theirs) != list(ours):
                a = self._in_our_order(a, theirs)
            arrays[key] = a
        step, iteration = int(state["step"]), int(state["iteration"])
        if step < 0 or iteration < step:
            raise ValueError(f"[AdamW.load_state_dict] inconsistent counters: step {step}, iteration {iteration}")
        self.schedule.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        hyper = state.get("hyper")
        if hyper is not None:
            self.betas = tuple(float(b) for b in hyper["betas"])
            self.eps, self.weight_decay = float(hyper["eps"]), float(hyper["weight_decay"])
            mg = hyper["max_grad_norm"]
            self.max_grad_norm = None if mg is None else float(mg)
        dev = self.flat.device
        if n:
            src_m, src_v = dev.tensor(arrays["m"], "f32"), dev.tensor(arrays["v"], "f32")
            with dev.step():
                ops.scale(src_m, 1.0, self.flat.m[0:n])
                ops.scale(src_v, 1.0, self.flat.v[0:n])
        self.adam_step, self.iteration = step, iteration
