"""The LoRA linear (docs/architecture.md, 'LoRA'), shared by the Llama model and the W1 block:

    y = x W^T + s (drop(x) A^T) B^T        W (out, in) frozen, A (r, in), B (out, r) trainable

A and B are views of one FlatParams (f32 masters and gradients, the compute dtype's working copy),
created here with PEFT's key names and initialisation; with DoRA (dora.py) a magnitude m per
output scales y, its own view there too."""

import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import _core
from . import dora
from .dora import DoraSaved
from .config import ALL_MODULES, lora_key, magnitude_key
from .moe_config import lora_shapes
from .phi3 import FUSED, MEMBER_OF
from .params import FlatParams
from ..quant.qweight import linear, linear_grad
from .sample_sums import ROWS
from .step_inputs import SEED_MASK, SEED_STRIDE

ops = _core.ops



def lora_first():
    """Whether an adapted linear writes its LoRA product first and adds the frozen product to it
    (LoraLinear.forward); KRNL_LORA_FIRST=0 restores the other order, to time both."""
    return os.environ.get("KRNL_LORA_FIRST", "1") != "0"


@dataclass(frozen=True)
class LoraFactors:
    """The trainable factors of one adapted linear and their gradients."""
    A: _core.Tensor   # (r, in)   compute dtype
    B: _core.Tensor   # (out, r)  compute dtype
    gA: _core.Tensor  # (r, in)   f32
    gB: _core.Tensor  # (out, r)  f32
    m: Optional[_core.Tensor] = None   # (out,) DoRA's magnitude, compute dtype (None: LoRA)
    gm: Optional[_core.Tensor] = None  # (out,) f32 its gradient


@dataclass
class LoraSaved:
    """What the LoRA backward reads from its forward."""
    xd: _core.Tensor    # (rows, in) drop(x); x itself without dropout
    t: _core.Tensor     # (rows, r)  drop(x) A^T
    seed: Optional[object]  # the call's dropout seed (an int, or a (2,) i32 seed_offset tensor), None without dropout
    dora: Optional[DoraSaved] = None  # DoRA's scale and unscaled output, where it scales this linear


class LoraLinear:
    """y = x W^T (+ s drop(x) A^T B^T). Without factors it is the frozen linear alone. Gradients
    accumulate into gA, gB (beta 1: the caller zeros them, micro-batches add up) unless
    accumulate_grads is False, where each backward overwrites them. sums: the model's
    sample_sums.SampleSums (the gradients' sums over rows in the sample order when on), or None.
    Wk: W's own buffer (out + r, in) with rows for A after W's, where the backward folds
    (lora_fold.py; W is then Wk[:out]). stack: the A factors of this linear's group as one tensor
    (lora_group.Stack), where they lie side by side. dora: a dora.Dora where DoRA scales the output.
    gW: where W itself trains (full fine-tuning), its gradient, accumulated as the factors' are."""

    def __init__(self, W, factors=None, scale=1.0, dropout=0.0, tag=0, accumulate_grads=True, sums=None, Wk=None,
                 stack=None, dora=None, gW=None):
        self.W = W                        # (out, in) frozen: a compute-dtype tensor or a QuantizedWeight
        self.gW = gW                      # (out, in) f32: W's gradient where W itself trains (full.py), else None
        self.Wk = Wk                      # (out + r, in) or None
        self.stack = stack                # lora_group.Stack of this linear's group, or None
        self.out, self.inp = W.shape
        self.factors = factors            # LoraFactors or None
        self.scale = float(scale)
        self.dropout = float(dropout)
        self.tag = tag                    # tells this linear's dropout masks from the others'
        self.grad_beta = 1.0 if accumulate_grads else 0.0
        self.sums = sums if sums is not None else ROWS
        self.dora = dora

    def seed(self, call_seed):
        """The dropout seed of this linear in the call numbered call_seed."""
        return (call_seed * SEED_STRIDE + self.tag) & SEED_MASK

    def _dropout(self, x, out, call_seed):
        """out = drop(x) with this linear's mask in the call `call_seed`: an int, or the (2,) i32
        device tensor of step_inputs.seed_offset_words (a recorded step replays with new seeds)."""
        if isinstance(call_seed, _core.Tensor):
            ops.dropout(x, out, self.dropout, self.tag, seed_offset=call_seed)
        else:
            ops.dropout(x, out, self.dropout, self.seed(call_seed))

    def forward(self, x, y, call_seed=None):
        """y = x W^T + LoRA, x (rows, in), y (rows, out); returns what backward needs. call_seed
        None (eval) turns dropout off."""
        if dora.active(self):  # the products into z, scaled into y (dora.py)
            z = y.device.empty(tuple(y.shape), y.dtype)
            saved = self.products(x, z, call_seed)
            dora.scale_outputs([self], [saved], z, y)
            return saved
        return self.products(x, y, call_seed)

    def products(self, x, y, call_seed=None):
        """y = x W^T + s drop(x) A^T B^T, unscaled; returns what backward needs."""
        if self.gW is not None:  # full fine-tuning: no factors; the backward reads x
            linear(x, self.W, y)
            return LoraSaved(x, None, None)
        if self.factors is not None and lora_first():
            # The rank-r product writes y and the frozen one adds to it (beta 1, read under its
            # arithmetic): one pass over y fewer than the other order's read-modify-write.
            saved = self.lora_forward(x, y, call_seed, beta=0.0)
            linear(x, self.W, y, beta=1.0)
            return saved
        linear(x, self.W, y)                                              # y = x W^T
        return self.lora_forward(x, y, call_seed)

    def lora_forward(self, x, y, call_seed=None, beta=1.0):
        """y = beta y + s drop(x) A^T B^T (y may be a column block of a fused output)."""
        f = self.factors
        if f is None:
            return None
        d, dt, rows = self.W.device, f.A.dtype, x.shape[0]
        xd, seed = x, None
        if self.dropout > 0 and call_seed is not None:
            seed = call_seed
            xd = d.empty((rows, self.inp), dt)
            self._dropout(x, xd, seed)
        t = d.empty((rows, f.A.shape[0]), dt)
        ops.gemm(xd, f.A, t, trans_b=True)                                # t = drop(x) A^T   (rows, r)
        ops.gemm(t, f.B, y, trans_b=True, alpha=self.scale, beta=beta)    # y (+)= s t B^T
        return LoraSaved(xd, t, seed)

    def grad_cols(self):
        """The columns a caller leaves after dy's for this linear's backward fold (0: it does not fold)."""
        return 0 if self.Wk is None else self.Wk.shape[0] - self.out

    def backward(self, dy, saved, dx, accumulate=False):
        """dx (+)= dy W + drop(dt A); the LoRA gradients from dy (rows, out), or from the first out
        columns of dy (rows, out + grad_cols()), whose others the fold writes."""
        if saved is not None and saved.dora is not None:  # dz = c dy beside the same columns; dy stays
            dz = dy.device.empty(tuple(dy.shape), dy.dtype)
            dora.backward(self, dy[:, :self.out], saved.dora, dz[:, :self.out])
            dy = dz
        if self.gW is not None:
            self.weight_grad(dy, saved.xd)
        if dy.shape[1] > self.out:
            if self.Wk is not None and saved is not None and saved.seed is None:
                return self._fold_backward(dy, saved, dx, accumulate)
            dy = dy[:, :self.out]
        if self.factors is not None and saved.seed is None and lora_first():  # as forward, for dx
            self.lora_backward(dy, saved, dx, beta=1.0 if accumulate else 0.0)
            linear_grad(dy, self.W, dx, 1.0)
            return
        linear_grad(dy, self.W, dx, 1.0 if accumulate else 0.0)           # dx (+)= dy W
        self.lora_backward(dy, saved, dx)

    def _fold_backward(self, dyw, saved, dx, accumulate):
        """The LoRA gradients and dx (+)= [dy | dt] [W ; A] = dy W + dt A in one GEMM, dt = s dy B
        written beside dy in dyw (rows, out + r): where the rank-r product would otherwise write
        dx and the frozen one read it back (docs/architecture.md, 'LoRA folded into K')."""
        f, o = self.factors, self.out
        self.lora_backward(dyw[:, :o], saved, None, dt=dyw[:, o:o + f.A.shape[0]])  # the gradients; dt beside dy
        ops.scale(f.A, 1.0, self.Wk[o:])                                  # A's rows, as this call's A
        ops.gemm(dyw, self.Wk, dx, beta=1.0 if accumulate else 0.0)       # dx (+)= [dy | dt] [W ; A]

    def weight_grad(self, dy, x):
        """gW (+)= dy^T x, W's own gradient (full fine-tuning), from dy (rows, out) and x (rows, in)."""
        self.sums.weight_grad(dy, x, self.gW, 1.0, self.grad_beta)

    def lora_backward(self, dy, saved, dx, beta=1.0, dt=None):
        """LoRA gradients from dy (possibly a column block) and dx += drop(dt A); without dropout
        dx = beta dx + dt A; dx None: the gradients alone. dt: where s dy B goes (rows, r), e.g.
        the columns beside dy that the backward fold reads; a new tensor if None."""
        f = self.factors
        if f is None:
            return
        d, cdt, rows = self.W.device, f.A.dtype, dy.shape[0]
        s, gbeta = self.scale, self.grad_beta
        self.sums.weight_grad(dy, saved.t, f.gB, s, gbeta)                # dB (+)= s dy^T t    (out, r)
        if dt is None:
            dt = d.empty((rows, f.A.shape[0]), cdt)
        ops.gemm(dy, f.B, dt, alpha=s)                                    # dt = s dy B         (rows, r)
        self.sums.weight_grad(dt, saved.xd, f.gA, 1.0, gbeta)             # dA (+)= dt^T drop(x) (r, in)
        if dx is None:
            return
        if saved.seed is not None:
            tmp, tmp2 = d.empty((rows, self.inp), cdt), d.empty((rows, self.inp), cdt)
            ops.gemm(dt, f.A, tmp)
            self._dropout(tmp, tmp2, saved.seed)                         # same mask as forward
            ops.axpy(1.0, tmp2, dx)
        else:
            ops.gemm(dt, f.A, dx, beta=beta)                              # dx (+)= dt A


def lora_param_shapes(config, lora_config):
    """({PEFT key: shape} in FlatParams' layout order, the set of adapted (layer, module) pairs).
    Layer by layer, a layer's A factors in module order, then its B factors (then DoRA's magnitudes):
    the A of linears that share an input (q, k, v; gate, up) lie side by side, so their group reads
    them, and writes their gradients, as one tensor (lora_group). krnl.train.memory counts the same
    shapes."""
    r = lora_config.r
    adapted, shapes = set(), {}
    for i in lora_config.adapted_layers(config):
        mods = [m for m in config.lora_modules() if m in lora_config.target_modules]
        for m in mods:
            shapes[lora_key(i, m, "A")] = lora_shapes(config, m, r)[0]
            adapted.add((i, m))
        for m in mods:
            shapes[lora_key(i, m, "B")] = lora_shapes(config, m, r)[1]
        for m in mods if lora_config.use_dora else ():
            shapes[magnitude_key(i, m)] = lora_shapes(config, m, r)[1][:1]
    return shapes, adapted


def init_lora(device, config, lora_config, dtype, seed):
    """The LoRA factors of a model as one FlatParams (lora_param_shapes' layout), initialised as
    PEFT does (A uniform, B zero, DoRA's magnitudes 1 until the model sets ||W_o||); also the set of
    adapted (layer, module) pairs."""
    shapes, adapted = lora_param_shapes(config, lora_config)
    params = FlatParams(device, shapes, dtype)
    rng = np.random.default_rng(seed)
    init = {}
    for k, shp in shapes.items():
        if ".lora_A." in k:   # PEFT: kaiming_uniform_(a=sqrt(5)) => U(-1/sqrt(in), 1/sqrt(in))
            b = 1.0 / math.sqrt(shp[-1])
            init[k] = rng.uniform(-b, b, size=shp).astype(np.float32)
        elif k.endswith(".lora_magnitude_vector"):
            init[k] = np.ones(shp, np.float32)
        else:
            init[k] = np.zeros(shp, np.float32)
    if shapes:
        params.load(init)
    return params, adapted


def factors(params, layer, module):
    """The LoraFactors of (layer, module) in params (with its magnitude where DoRA has one)."""
    kA, kB, km = lora_key(layer, module, "A"), lora_key(layer, module, "B"), magnitude_key(layer, module)
    m, gm = (params.compute(km), params.grad(km)) if km in params.shapes else (None, None)
    return LoraFactors(params.compute(kA), params.compute(kB), params.grad(kA), params.grad(kB), m, gm)


def module_factors(config, params, adapted, layer, module):
    """The LoraFactors of projection `module` of a layer, None when not adapted. A member of a
    fused projection (phi3: q_proj of qkv_proj) shares the fused A and its gradient (the
    members' dA add up into it, so its linears must accumulate gradients, as the model's do)
    and takes its row block of B (and of DoRA's magnitude): LoRA on the fused module."""
    fused = MEMBER_OF.get(module) if config.fused_projections else None
    if fused is None:
        return factors(params, layer, module) if (layer, module) in adapted else None
    if (layer, fused) not in adapted:
        return None
    f, r0 = factors(params, layer, fused), 0
    for m in FUSED[fused]:
        n = config.module_shape(m)[0]
        if m == module:
            rows = lambda t: None if t is None else t[r0:r0 + n]  # noqa: E731
            return LoraFactors(f.A, rows(f.B), f.gA, rows(f.gB), rows(f.m), rows(f.gm))
        r0 += n
    raise AssertionError(module)


def dropout_tag(config, layer, module):
    """The tag of a projection's dropout masks: members of a fused projection share one, so
    they drop the same inputs as the fused module's single mask does."""
    if config.fused_projections:
        module = FUSED.get(MEMBER_OF.get(module), (module,))[0]
    return layer * len(ALL_MODULES) + ALL_MODULES.index(module)
