"""Adafactor (Shazeer & Stern 2018, as torch.optim.Adafactor runs it): one `adafactor_update` per
parameter, its second moment factored into a row and a column vector over the last two dims."""

import numpy as np

from .base import FlatOptimizer, ops

EPS1 = float(np.finfo(np.float32).eps)  # torch's eps1=None: the parameters' dtype's eps


class Adafactor(FlatOptimizer):
    """torch.optim.Adafactor: relative step rho_t = min(lr, 1 / sqrt(t)) (relative_step=False: the
    schedule's lr itself), the update scaled by max(eps2, rms(param)), second-moment decay
    1 - t^beta2_decay, the update's rms clipped at d, decoupled weight decay lr * weight_decay.
    Parameters need >= 2 dims (LoRA factors all have); the moments live in one buffer of their own,
    each parameter's rows then its columns."""

    name = "adafactor"
    state = {"factors": "factors"}

    def __init__(self, flat_params, schedule, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, relative_step=True,
                 weight_decay=0.0, max_grad_norm=None, loss_scaler=None, lr_ratio=None):
        super().__init__(flat_params, schedule, weight_decay, max_grad_norm, loss_scaler, lr_ratio)
        if not float(beta2_decay) <= 0:
            raise ValueError(f"[Adafactor] beta2_decay must be <= 0, got {beta2_decay}")
        eps1, eps2 = eps
        if not ((eps1 is None or float(eps1) > 0) and float(eps2) >= 0 and float(d) > 0):
            raise ValueError(f"[Adafactor] eps1 and d must be > 0 and eps2 >= 0, got eps {tuple(eps)}, d {d}")
        flat_1d = [k for k, s in flat_params.shapes.items() if len(s) < 2]
        if flat_1d:
            raise ValueError(f"[Adafactor] parameters of fewer than 2 dims cannot be factored: {flat_1d[:3]}")
        self.beta2_decay, self.d, self.relative_step = float(beta2_decay), float(d), bool(relative_step)
        self.eps1, self.eps2 = EPS1 if eps1 is None else float(eps1), float(eps2)
        self.spans, off = {}, 0  # name -> (row offset, rows, col offset, cols) in self.factors
        for k, shape in flat_params.shapes.items():
            lead = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
            rows, cols = lead * shape[-2], lead * shape[-1]
            self.spans[k] = (off, rows, off + rows, cols)
            off += rows + cols
        self.factors = flat_params.device.zeros((max(off, 1),), "f32")

    def numbers(self, t, lr):
        rho = min(lr, 1.0 / t**0.5) if self.relative_step else lr
        return rho, float(t) ** self.beta2_decay, np.float32(lr) * np.float32(self.weight_decay)

    def update(self, hyper):
        flat, kw = self.flat, self._device_scalars(hyper)
        for k, (r0, rows, c0, cols) in self.spans.items():
            kw["hyper"] = self.group_hyper(hyper, self.group(k))
            ops.adafactor_update(flat.master(k), flat.grad(k), self.factors[r0:r0 + rows], self.factors[c0:c0 + cols],
                                 0.0, 1.0, 0.0, self.eps1, self.eps2, self.d, 1.0, self.working(k), **kw)

    def options(self):
        return {"beta2_decay": self.beta2_decay, "eps": [self.eps1, self.eps2], "d": self.d,
                "relative_step": self.relative_step}

    def set_options(self, saved):
        self.beta2_decay, self.d = float(saved["beta2_decay"]), float(saved["d"])
        self.eps1, self.eps2 = (float(e) for e in saved["eps"])
        self.relative_step = bool(saved["relative_step"])
