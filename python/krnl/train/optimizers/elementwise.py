"""The optimizers whose update is one elementwise op over the flat buffers: AdamW and Adam
(`adamw_update`), SGD (`sgd_update`) and Lion (`lion_update`). Each matches its reference's
update order (torch.optim.AdamW, Adam, SGD; lion-pytorch's Lion) with f32 arithmetic, and holds
only the moments it reads, laid out as the params: AdamW's m and v, Lion's m, SGD's momentum
buffer where it has momentum."""

import math

from .base import FlatOptimizer, f32, ops


class AdamW(FlatOptimizer):
    """PyTorch's AdamW (decoupled weight decay, eps outside the sqrt, bias-corrected)."""

    name = "adamw"
    state = {"m": "m", "v": "v"}
    decoupled = True

    def __init__(self, flat_params, schedule, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=None,
                 loss_scaler=None, lr_ratio=None):
        super().__init__(flat_params, schedule, weight_decay, max_grad_norm, loss_scaler, lr_ratio)
        self.betas = self._check_betas(betas)
        if not (float(eps) > 0):
            raise ValueError(f"[{type(self).__name__}] eps must be > 0, got {eps}")
        self.eps = float(eps)
        self.allocate()

    def allocate(self):
        self.moments("m")
        self.moments("v")

    def numbers(self, t, lr):
        # As the scalar adamw_update forms them: f32 lr and betas, bias corrections in double.
        lr32, b1, b2 = f32(lr), float(f32(self.betas[0])), float(f32(self.betas[1]))
        decay = lr32 * f32(self.weight_decay) if self.decoupled else f32(self.weight_decay)
        return float(lr32) / (1.0 - b1**t), math.sqrt(1.0 - b2**t), decay

    def update(self, hyper):
        flat, (b1, b2) = self.flat, self.betas
        for s, h in self.runs(hyper):
            ops.adamw_update(flat.params[s], flat.grads[s], self.m[s], self.v[s], 0.0, b1, b2, self.eps, 0.0, 1, 1.0,
                             self.working(s), decoupled=self.decoupled, **self._device_scalars(h))

    def options(self):
        return {"betas": list(self.betas), "eps": self.eps}

    def set_options(self, saved):
        self.betas = tuple(float(b) for b in saved["betas"])
        self.eps = float(saved["eps"])


class Adam(AdamW):
    """PyTorch's Adam: weight decay as L2, added to the (clipped) gradient before the moments."""

    name = "adam"
    decoupled = False


class SGD(FlatOptimizer):
    """PyTorch's SGD: L2 weight decay, momentum (the buffer starts as the first gradient),
    dampening and Nesterov momentum. Its buffer (self.m) exists only with momentum."""

    name = "sgd"

    def __init__(self, flat_params, schedule, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0,
                 max_grad_norm=None, loss_scaler=None, lr_ratio=None):
        super().__init__(flat_params, schedule, weight_decay, max_grad_norm, loss_scaler, lr_ratio)
        if not (float(momentum) >= 0):
            raise ValueError(f"[SGD] momentum must be >= 0, got {momentum}")
        if nesterov and (float(momentum) <= 0 or float(dampening) != 0):
            raise ValueError("[SGD] nesterov needs momentum > 0 and dampening 0")
        self.momentum, self.dampening, self.nesterov = float(momentum), float(dampening), bool(nesterov)
        self.m = None
        self.allocate()

    def allocate(self):
        """The momentum buffer where there is momentum (a loaded state may bring or drop it)."""
        if self.momentum and self.m is None:
            self.moments("m")
        elif not self.momentum:
            self.m = None
            self.layouts.pop("m", None)

    @property
    def state(self):
        return {"buf": "m"} if self.momentum else {}

    def numbers(self, t, lr):
        if t == 1:  # the buffer starts as the gradient
            return lr, 0.0, 1.0
        return lr, self.momentum, f32(1.0) - f32(self.dampening)

    def update(self, hyper):
        flat = self.flat
        for s, h in self.runs(hyper):
            ops.sgd_update(flat.params[s], flat.grads[s], self.m[s] if self.momentum else None, 0.0, self.momentum,
                           self.dampening, self.weight_decay, self.nesterov, 1, 1.0, self.working(s),
                           **self._device_scalars(h))

    def options(self):
        return {"momentum": self.momentum, "dampening": self.dampening, "nesterov": self.nesterov}

    def set_options(self, saved):
        self.momentum, self.dampening = float(saved["momentum"]), float(saved["dampening"])
        self.nesterov = bool(saved["nesterov"])
        self.allocate()


class Lion(FlatOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"; lion-pytorch's
    update): the sign of an interpolated momentum, decoupled weight decay. Its one moment:
    self.m."""

    name = "lion"
    state = {"m": "m"}

    def __init__(self, flat_params, schedule, betas=(0.9, 0.99), weight_decay=0.0, max_grad_norm=None,
                 loss_scaler=None, lr_ratio=None):
        super().__init__(flat_params, schedule, weight_decay, max_grad_norm, loss_scaler, lr_ratio)
        self.betas = self._check_betas(betas)
        self.moments("m")

    def numbers(self, t, lr):
        return lr, f32(lr) * f32(self.weight_decay), 0.0

    def update(self, hyper):
        flat, (b1, b2) = self.flat, self.betas
        for s, h in self.runs(hyper):
            ops.lion_update(flat.params[s], flat.grads[s], self.m[s], 0.0, b1, b2, 0.0, 1.0, self.working(s),
                            **self._device_scalars(h))

    def options(self):
        return {"betas": list(self.betas)}

    def set_options(self, saved):
        self.betas = tuple(float(b) for b in saved["betas"])
