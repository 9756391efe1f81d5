"""W1 of DESIGN section 6: the KRNL MLP block with LoRA on gate and up, as explicit forward and
backward over core ops (llm.c style, no autograd tape).

    h = rmsnorm(x) * w_norm
    g = h Wg^T + s (h Ag^T) Bg^T        u = h Wu^T + s (h Au^T) Bu^T
    a = silu(g) * u                     y = x + a Wd^T
Frozen: w_norm, Wg, Wu, Wd (stored [out, in]). Trainable: Ag, Au (R, C), Bg, Bu (F, R), held as
views of one flat f32 buffer so one adamw_update covers them all.
"""

import numpy as np

from . import _core
from .params import FlatParams

ops = _core.ops

LORA_NAMES = ("Ag", "Bg", "Au", "Bu")


def w1_flops(T, C, F, R):
    """Matmul FLOPs of one step (forward, dX and LoRA gradients; no dW of frozen weights)."""
    base = 6 * 2 * T * C * F
    lora_fwd = 2 * (2 * T * R * C + 2 * T * F * R)
    lora_bwd = 2 * (2 * F * R * T + 2 * T * R * F + 2 * R * C * T + 2 * T * C * R)
    return base + lora_fwd + lora_bwd


def make_w1_params(T, C, F, R, seed=0):
    """Random frozen weights, LoRA factors (B small but non-zero so every path is exercised),
    input and cotangent, as float32 numpy arrays (the reference's initialisation)."""
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s)
    P = {
        "x": n(T, C),
        "dy": n(T, C) / np.sqrt(T * C),
        "w_norm": 1.0 + 0.1 * n(C),
        "Wg": n(F, C) / np.sqrt(C),
        "Wu": n(F, C) / np.sqrt(C),
        "Wd": n(C, F) / np.sqrt(F),
        "Ag": n(R, C) / np.sqrt(C),
        "Au": n(R, C) / np.sqrt(C),
        "Bg": 0.1 * n(F, R) / np.sqrt(R),
        "Bu": 0.1 * n(F, R) / np.sqrt(R),
    }
    return {k: v.astype(np.float32) for k, v in P.items()}


class MLPBlock:
    """The W1 block on one device. `dtype` is the compute dtype of activations and frozen
    weights; LoRA masters and gradients stay f32 (DESIGN section 4)."""

    def __init__(self, device, params, T, scale=2.0, eps=1e-5, dtype="f32"):
        self.dev, self.T, self.scale, self.eps, self.dtype = device, T, float(scale), float(eps), dtype
        self.C = params["Wg"].shape[1]
        self.F = params["Wg"].shape[0]
        self.R = params["Ag"].shape[0]
        d, C, F, R = device, self.C, self.F, self.R
        self.w_norm = d.tensor(params["w_norm"], dtype)
        self.Wg, self.Wu, self.Wd = (d.tensor(params[k], dtype) for k in ("Wg", "Wu", "Wd"))
        # LoRA masters, gradients and Adam moments: one flat f32 buffer each, views per factor.
        self.lora_params = FlatParams(d, {"Ag": (R, C), "Bg": (F, R), "Au": (R, C), "Bu": (F, R)}, dtype)
        self.lora_params.load({k: params[k] for k in LORA_NAMES})
        self.grads = {k: self.lora_params.grad(k) for k in LORA_NAMES}
        self.lora_w = {k: self.lora_params.compute(k) for k in LORA_NAMES}
        self._alloc()
        self.adam_step = 0

    def _alloc(self):
        d, T, C, F, R, dt = self.dev, self.T, self.C, self.F, self.R, self.dtype
        e = d.empty
        self.h, self.rstd = e((T, C), dt), e((T,), "f32")
        self.tg, self.tu = e((T, R), dt), e((T, R), dt)
        self.g, self.u, self.a = e((T, F), dt), e((T, F), dt), e((T, F), dt)
        self.y = e((T, C), dt)
        self.da, self.dg, self.du = e((T, F), dt), e((T, F), dt), e((T, F), dt)
        self.dtg, self.dtu = e((T, R), dt), e((T, R), dt)
        self.dh, self.dx = e((T, C), dt), e((T, C), dt)

    def forward(self, x):
        s, L = self.scale, self.lora_w
        ops.rmsnorm_forward(x, self.w_norm, self.h, self.rstd, self.eps)
        for W, A, B, t, out in ((self.Wg, L["Ag"], L["Bg"], self.tg, self.g),
                                (self.Wu, L["Au"], L["Bu"], self.tu, self.u)):
            ops.gemm(self.h, A, t, trans_b=True)                          # t = h A^T        (T, R)
            ops.gemm(self.h, W, out, trans_b=True)                        # h W^T            (T, F)
            ops.gemm(t, B, out, trans_b=True, alpha=s, beta=1.0)          # += s t B^T       (T, F)
        ops.swiglu_forward(self.g, self.u, self.a)
        ops.gemm(self.a, self.Wd, self.y, trans_b=True)                   # y = a Wd^T       (T, C)
        ops.add(self.y, x, self.y)                                        # residual
        return self.y

    def backward(self, x, dy):
        """Overwrites the LoRA gradients; returns dx."""
        s, L = self.scale, self.lora_w
        ops.gemm(dy, self.Wd, self.da)                                    # da = dy Wd       (T, F)
        ops.swiglu_backward(self.da, self.g, self.u, self.dg, self.du)
        first = True
        for W, A, B, t, dz, dt, gA, gB in ((self.Wg, L["Ag"], L["Bg"], self.tg, self.dg, self.dtg, "Ag", "Bg"),
                                           (self.Wu, L["Au"], L["Bu"], self.tu, self.du, self.dtu, "Au", "Bu")):
            ops.gemm(dz, t, self.grads[gB], trans_a=True, alpha=s)        # dB = s dz^T t    (F, R)
            ops.gemm(dz, B, dt, alpha=s)                                  # dt = s dz B      (T, R)
            ops.gemm(dt, self.h, self.grads[gA], trans_a=True)            # dA = dt^T h      (R, C)
            ops.gemm(dz, W, self.dh, beta=0.0 if first else 1.0)          # dh (+)= dz W     (T, C)
            ops.gemm(dt, A, self.dh, beta=1.0)                            # dh += dt A       (T, C)
            first = False
        ops.rmsnorm_backward(self.dh, x, self.w_norm, self.rstd, self.dx)
        ops.axpy(1.0, dy, self.dx)                                        # residual
        return self.dx

    def adamw(self, lr, weight_decay=0.0):
        self.adam_step += 1
        p = self.lora_params
        ops.adamw_update(p.params, p.grads, p.m, p.v, lr, weight_decay=weight_decay, step=self.adam_step,
                         working=p.working)
