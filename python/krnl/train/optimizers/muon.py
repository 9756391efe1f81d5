"""Muon (Keller Jordan 2024; torch.optim.Muon's update): the Nesterov momentum of each 2-D
parameter orthogonalised by a quintic Newton-Schulz iteration, AdamW for the parameters of other
shapes (an expert's 3-D factors). Per 2-D parameter: `muon_momentum` (the momentum and the
iteration's normalised start), the iteration as gemm calls, `muon_update`; the rest one
`adamw_update` each, from the hyper tensor's second row."""

import math

from .base import FlatOptimizer, f32, ops

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch's and Keller Jordan's: the quintic's a, b, c


def lr_ratio(shape, adjust_lr_fn):
    """torch.optim.Muon's learning-rate adjustment for an (A, B) parameter."""
    A, B = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, A / B))
    return 0.2 * math.sqrt(max(A, B))  # "match_rms_adamw" (Moonshot's)


class Muon(FlatOptimizer):
    """torch.optim.Muon over the 2-D parameters (its buffer in self.m), f32 throughout (torch runs
    the iteration in bf16); the others take PyTorch's AdamW at the same learning rate and weight
    decay with `betas` and `adam_eps`, its moments in self.m and in self.v, which covers only them."""

    name = "muon"
    rows = 2
    state = {"m": "m", "v": "v"}

    def __init__(self, flat_params, schedule, momentum=0.95, nesterov=True, ns_coefficients=NS_COEFFICIENTS,
                 ns_steps=5, eps=1e-7, adjust_lr_fn=None, betas=(0.9, 0.999), adam_eps=1e-8, weight_decay=0.0,
                 max_grad_norm=None, loss_scaler=None, lr_ratio=None):
        super().__init__(flat_params, schedule, weight_decay, max_grad_norm, loss_scaler, lr_ratio)
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"[Muon] momentum must be in [0, 1), got {momentum}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"[Muon] adjust_lr_fn must be original or match_rms_adamw, got {adjust_lr_fn!r}")
        if not 0 < int(ns_steps) < 100 or len(ns_coefficients) != 3 or not float(eps) > 0:
            raise ValueError("[Muon] ns_steps must be in [1, 100), ns_coefficients three numbers, eps > 0")
        self.momentum, self.nesterov, self.eps = float(momentum), bool(nesterov), float(eps)
        self.ns_coefficients, self.ns_steps = tuple(float(c) for c in ns_coefficients), int(ns_steps)
        self.adjust_lr_fn, self.betas, self.adam_eps = adjust_lr_fn, self._check_betas(betas), float(adam_eps)
        self.matrices = [k for k, s in flat_params.shapes.items() if len(s) == 2]
        self.others = [k for k, s in flat_params.shapes.items() if len(s) != 2]
        self.moments("m")
        self.moments("v", self.others)

    def numbers(self, t, lr):
        lr32, b1, b2 = f32(lr), float(f32(self.betas[0])), float(f32(self.betas[1]))
        decay = lr32 * f32(self.weight_decay)
        return [lr, 0.0, decay, float(lr32) / (1.0 - b1**t), math.sqrt(1.0 - b2**t), decay]

    def orthogonalise(self, X, dev):
        """X (R, C) replaced by the Newton-Schulz iteration's result, as torch forms it (on X^T when
        R > C): A = X X^T, B = b A + c A A, X = a X + B X, ns_steps times."""
        R, C = X.shape
        tall, (a, b, c) = R > C, self.ns_coefficients
        k = min(R, C)
        A, Bm, Y = dev.empty((k, k), "f32"), dev.empty((k, k), "f32"), dev.empty((R, C), "f32")
        for _ in range(self.ns_steps):
            ops.gemm(X, X, A, trans_a=tall, trans_b=not tall)  # the Gram matrix of X's shorter side
            ops.scale(A, b, Bm)
            ops.gemm(A, A, Bm, alpha=c, beta=1.0)
            ops.scale(X, a, Y)
            if tall:  # (B X^T)^T = X B^T
                ops.gemm(X, Bm, Y, trans_b=True, beta=1.0)
            else:
                ops.gemm(Bm, X, Y, beta=1.0)
            X, Y = Y, X
        return X

    def update(self, hyper):
        flat, kw = self.flat, self._device_scalars(hyper)
        for k in self.matrices:
            first = dict(kw, hyper=self.group_hyper(hyper, self.group(k))[0:5])
            X = flat.device.empty(flat.shapes[k], "f32")
            ops.muon_momentum(flat.grad(k), self.view("m", k), X, self.momentum, self.nesterov, self.eps, 1.0,
                              **first)
            X = self.orthogonalise(X, flat.device)
            ops.muon_update(flat.master(k), X, 0.0, 0.0, lr_ratio(flat.shapes[k], self.adjust_lr_fn), self.working(k),
                            **first)
        b1, b2 = self.betas
        for k in self.others:
            second = dict(kw, hyper=self.group_hyper(hyper, self.group(k))[5:10])
            ops.adamw_update(flat.master(k), flat.grad(k), self.view("m", k), self.view("v", k), 0.0, b1, b2,
                             self.adam_eps, 0.0, 1, 1.0, self.working(k), **second)

    def options(self):
        return {"momentum": self.momentum, "nesterov": self.nesterov, "ns_coefficients": list(self.ns_coefficients),
                "ns_steps": self.ns_steps, "eps": self.eps, "adjust_lr_fn": self.adjust_lr_fn,
                "betas": list(self.betas), "adam_eps": self.adam_eps}

    def set_options(self, saved):
        self.momentum, self.nesterov, self.eps = float(saved["momentum"]), bool(saved["nesterov"]), float(saved["eps"])
        self.ns_coefficients, self.ns_steps = tuple(saved["ns_coefficients"]), int(saved["ns_steps"])
        self.adjust_lr_fn, self.betas = saved["adjust_lr_fn"], tuple(saved["betas"])
        self.adam_eps = float(saved["adam_eps"])
