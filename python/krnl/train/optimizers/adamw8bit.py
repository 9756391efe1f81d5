"""8-bit AdamW as bitsandbytes' AdamW8bit runs it (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"): m and v of each parameter of at least `min_8bit_size` elements held as
8-bit codes into its dynamic maps (signed for m, unsigned for v) with an f32 absmax per block of
256; smaller parameters keep f32 moments, as bitsandbytes keeps them, packed in two small buffers
(no f32 moment of a quantized parameter is held). One `adamw8bit_update` per quantized parameter,
`adamw_update` for the others."""

import math

import numpy as np

from .base import f32, ops
from .elementwise import AdamW

BLOCK = 256


def _linspace(start, end, steps):
    """torch.linspace in float32 as its CPU kernel forms it: from the start over the first half,
    from the end over the rest, each a single rounding of start + step i."""
    start, end = np.float32(start), np.float32(end)
    step = (end - start) / np.float32(steps - 1)
    return np.array([float(start) + float(step) * i if i < steps // 2 else float(end) - float(step) * (steps - 1 - i)
                     for i in range(steps)], np.float32)


def dynamic_map(signed, exponent_bits=7, total_bits=8):
    """bitsandbytes' dynamic quantization map (its create_dynamic_map): for each exponent e of
    10^-6 .. 10^0, the midpoints of an even split of [0.1, 1] scaled by 10^e (fewer points for
    smaller exponents), negated too where signed; then 0 and 1, zeros to 256 entries, sorted."""
    data, fraction_bits = [], total_bits - 1
    extra = 2 ** (fraction_bits - exponent_bits) - 1
    for i in range(exponent_bits):
        k = 2 ** (i + fraction_bits - exponent_bits + (0 if signed else 1)) + 1
        b = _linspace(0.1, 1.0, k)
        means = (b[:-1] + b[1:]) / np.float32(2)
        scaled = np.float32(10.0 ** (i - exponent_bits + 1)) * means
        data += scaled.tolist() + ((-scaled).tolist() if signed else [])
    if extra > 0:  # fraction bits beyond the exponents' (none with the defaults), at the largest exponent
        b = _linspace(0.1, 1.0, extra + 1)
        means = (b[:-1] + b[1:]) / np.float32(2)
        data += means.tolist() + ((-means).tolist() if signed else [])
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    return np.array(sorted(data), np.float32)


class AdamW8bit(AdamW):
    """bitsandbytes' AdamW8bit (decoupled weight decay; percentile clipping and max_unorm off, as
    its defaults are). Its codes and block scales live in buffers of its own; the f32 moments of
    the small parameters in self.m and v, which cover only those."""

    name = "adamw8bit"
    state = {"m": "m", "v": "v", "m_codes": "m_codes", "v_codes": "v_codes", "m_absmax": "m_absmax",
             "v_absmax": "v_absmax"}

    def __init__(self, flat_params, schedule, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=None,
                 loss_scaler=None, lr_ratio=None, min_8bit_size=4096):
        self.min_8bit_size = int(min_8bit_size)  # before AdamW's __init__, whose allocate() reads it
        super().__init__(flat_params, schedule, betas, eps, weight_decay, max_grad_norm, loss_scaler, lr_ratio)

    def allocate(self):
        dev = self.flat.device
        self.m_map, self.v_map = dev.tensor(dynamic_map(True), "f32"), dev.tensor(dynamic_map(False), "f32")
        self._layout(self.min_8bit_size)

    def _layout(self, min_8bit_size):
        """The quantized parameters and their zeroed codes and block scales, each parameter's
        blocks whole (its codes start on a block's first word); zeroed f32 moments of the others."""
        self.min_8bit_size = int(min_8bit_size)
        self.blocks, words, blocks = {}, 0, 0  # name -> (first word, words, first block, blocks)
        for k, (_, size) in self.flat.offsets.items():
            if size >= self.min_8bit_size:
                nb = -(-size // BLOCK)
                self.blocks[k] = (words, -(-size // 4), blocks, nb)
                words, blocks = words + nb * BLOCK // 4, blocks + nb
        dev = self.flat.device
        self.m_codes, self.v_codes = (dev.zeros((max(words, 1),), "i32") for _ in range(2))
        self.m_absmax, self.v_absmax = (dev.zeros((max(blocks, 1),), "f32") for _ in range(2))
        small = [k for k in self.flat.shapes if k not in self.blocks]
        self.moments("m", small)
        self.moments("v", small)

    def numbers(self, t, lr):
        # As bitsandbytes forms them from its double betas: bias corrections, and the decay's factor
        # 1 - lr * weight_decay, which 1 - this number gives back exactly in f32.
        b1, b2 = self.betas
        return lr / (1.0 - b1**t), math.sqrt(1.0 - b2**t), 1.0 - float(f32(1.0 - lr * self.weight_decay))

    def update(self, hyper):
        flat, (b1, b2) = self.flat, self.betas
        c1, c2 = float(f32(1.0 - b1)), float(f32(1.0 - b2))
        for k in flat.shapes:
            kw = self._device_scalars(self.group_hyper(hyper, self.group(k)))
            if k not in self.blocks:
                ops.adamw_update(flat.master(k), flat.grad(k), self.view("m", k), self.view("v", k), 0.0, b1, b2,
                                 self.eps, 0.0, 1, 1.0, self.working(k), **kw)
                continue
            w0, words, k0, blocks = self.blocks[k]
            ops.adamw8bit_update(flat.master(k).reshape(-1), flat.grad(k).reshape(-1), self.m_codes[w0:w0 + words],
                                 self.v_codes[w0:w0 + words], self.m_absmax[k0:k0 + blocks],
                                 self.v_absmax[k0:k0 + blocks], self.m_map, self.v_map, 0.0, b1, b2, self.eps, 0.0, 1,
                                 1.0, None if flat.working is None else self.working(k).reshape(-1), **kw,
                                 beta1_complement=c1, beta2_complement=c2)

    def options(self):
        return dict(super().options(), min_8bit_size=self.min_8bit_size)

    def set_options(self, saved):
        super().set_options(saved)
        if int(saved["min_8bit_size"]) != self.min_8bit_size:  # another layout of the codes
            self._layout(saved["min_8bit_size"])
