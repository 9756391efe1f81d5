"""The learning-rate schedule and dynamic loss scaling that every optimizer of
krnl.train.optimizers shares."""

import math

import numpy as np

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


