"""W1 (docs/performance.md, 'Workloads'): the KRNL MLP block with LoRA on gate and up, as explicit forward and
backward over core ops (llm.c style, no autograd tape).

    h = rmsnorm(x) * w_norm
    g = h Wg^T + s (h Ag^T) Bg^T        u = h Wu^T + s (h Au^T) Bu^T
    a = silu(g) * u                     y = x + a Wd^T
Frozen: w_norm, Wg, Wu, Wd (stored [out, in]). Trainable: Ag, Au (R, C), Bg, Bu (F, R), held as
views of one flat f32 buffer so one adamw_update covers them all.
"""

import numpy as np

from .. import _core
from .dense_mlp import Mlp, mlp_backward, mlp_forward
from .lora import LoraFactors, LoraLinear
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
    """The W1 block on one device: layer.py's MLP with LoRA on gate and up (lora.LoraLinear, each
    backward overwriting the gradients) and a frozen down projection. `dtype` is the compute
    dtype of activations and frozen weights; LoRA masters and gradients stay f32 (docs/architecture.md,
    'Training numerics'). T is the number of rows of x."""

    def __init__(self, device, params, T, scale=2.0, eps=1e-5, dtype="f32"):
        self.dev, self.T, self.scale, self.eps, self.dtype = device, T, float(scale), float(eps), dtype
        self.C = params["Wg"].shape[1]
        self.F = params["Wg"].shape[0]
        self.R = params["Ag"].shape[0]
        d, C, F, R = device, self.C, self.F, self.R
        self.w_norm = d.tensor(params["w_norm"], dtype)                  # (C,)
        self.Wg, self.Wu, self.Wd = (d.tensor(params[k], dtype) for k in ("Wg", "Wu", "Wd"))
        # LoRA masters, gradients and Adam moments: one flat f32 buffer each, views per factor.
        self.lora_params = FlatParams(d, {"Ag": (R, C), "Bg": (F, R), "Au": (R, C), "Bu": (F, R)}, dtype)
        self.lora_params.load({k: params[k] for k in LORA_NAMES})
        self.m, self.v = self.lora_params.zeros(), self.lora_params.zeros()
        self.grads = {k: self.lora_params.grad(k) for k in LORA_NAMES}
        self.lora_w = {k: self.lora_params.compute(k) for k in LORA_NAMES}

        def lora(W, a, b):
            f = LoraFactors(self.lora_w[a], self.lora_w[b], self.grads[a], self.grads[b])
            return LoraLinear(W, f, self.scale, accumulate_grads=False)

        self.mlp = Mlp(self.w_norm, lora(self.Wg, "Ag", "Bg"), lora(self.Wu, "Au", "Bu"), LoraLinear(self.Wd), self.eps)
        self.y = self.dx = self._cache = None  # (T, C) output and input gradient of the last call
        self.adam_step = 0

    def forward(self, x):
        """y (T, C) = x + down(silu(gate(h)) * up(h)), h = rmsnorm(x) w_norm."""
        self.y, self._cache = mlp_forward(self.mlp, x)
        return self.y

    def backward(self, x, dy):
        """Overwrites the LoRA gradients; returns dx (T, C)."""
        self.dx = mlp_backward(self.mlp, x, self._cache, dy)
        return self.dx

    def adamw(self, lr, weight_decay=0.0):
        self.adam_step += 1
        p = self.lora_params
        ops.adamw_update(p.params, p.grads, self.m, self.v, lr, weight_decay=weight_decay, step=self.adam_step,
                         working=p.working)
