"""Frozen linear weights held quantized (MLX's affine layout, krnl.quant.affine, or MXFP4,
krnl.quant.mxfp4) and the two products a
linear needs from any frozen weight, dense or quantized:

    linear(x, W, y)              y = x W^T            (forward)
    linear_grad(dy, W, dx, beta) dx = dy W + beta dx  (input gradient)

and the rows an embedding table gives (embed), dense or quantized.

A dense W is a (out, in) tensor and goes through ops.gemm; a QuantizedWeight through
ops.quantized_matmul, which never dequantizes it whole; a RowStack part by part."""

from dataclasses import dataclass

import numpy as np

from .. import _core
from . import affine, mxfp4

ops = _core.ops


@dataclass(frozen=True)
class QuantizedArray:
    """A weight (O, I) as a quantized file stores it, on the host: what readers of MLX folders and
    GGUF files hand the model in its weights dict, in place of a float array. w, scales and biases
    are anything np.asarray reads (numpy arrays, memory-mapped LazyTensors): codes (O, I * bits /
    32) int32 or uint32 in krnl.quant.affine's layout, scales and biases (O, I / group_size) float.
    scale_dtype names the dtype the file stores scales and biases in ("f32", "f16" or "bf16"):
    the model keeps them in its compute dtype only where that is the same dtype (or f32 compute),
    otherwise in f32, so that no scale is rounded. np.asarray(a, np.float32) dequantizes it whole
    (for what the model holds dense: embeddings, fuse). mode "mxfp4" (krnl.quant.mxfp4): bits 4,
    group_size 32, biases None, scales E8M0 bytes (uint8, as the files hold them) or their float
    powers of two; scale_dtype then names the float dtype they may be held in ("f32" or "bf16")."""
    w: object
    scales: object
    biases: object
    bits: int
    group_size: int
    scale_dtype: str = "f32"
    mode: str = "affine"

    def __post_init__(self):
        s = tuple(np.shape(self.scales))
        shape = (s[-2] if s else 0, np.shape(self.w)[-1] * 32 // self.bits)
        check_mode(self.mode, self.bits, self.group_size, self.biases)
        if self.mode == "mxfp4":
            mxfp4.check(shape)
        else:
            affine.check(shape, self.bits, self.group_size)
        if self.scale_dtype not in ("f32", "f16", "bf16"):
            raise ValueError(f"[quantize] scale_dtype must be f32, f16 or bf16, got {self.scale_dtype!r}")

    @property
    def shape(self):
        """(O, I); a mixture's experts (E, O I) with E experts' tables stacked."""
        w = np.shape(self.w)
        return tuple(int(n) for n in w[:-1]) + (int(w[-1]) * 32 // self.bits,)

    @property
    def ndim(self):
        return len(self.shape)

    def float_scales(self):
        """The scales as float32 (E8M0 bytes converted)."""
        return mxfp4.scales_as_float(self.scales) if self.mode == "mxfp4" else np.asarray(self.scales, np.float32)

    def dequantize(self):
        w, s = np.asarray(self.w), self.float_scales()
        if self.mode == "mxfp4":
            one = lambda e: mxfp4.dequantize(w[e], s[e])
        else:
            b = np.asarray(self.biases, np.float32)
            one = lambda e: affine.dequantize(w[e], s[e], b[e], self.bits, self.group_size)
        if w.ndim == 3:  # experts: each its own table
            return np.stack([one(e) for e in range(len(w))])
        return one(Ellipsis)

    def __array__(self, dtype=None, copy=None):
        a = self.dequantize()
        return a if dtype is None else a.astype(dtype, copy=False)


def check_mode(mode, bits, group_size, biases=None):
    """One-line errors for a mode and layout ops.quantized_matmul cannot take together."""
    if mode not in ("affine", "mxfp4"):
        raise ValueError(f"[quantize] mode must be 'affine' or 'mxfp4', got {mode!r}")
    if mode == "mxfp4" and ((bits, group_size) != (mxfp4.BITS, mxfp4.GROUP_SIZE) or biases is not None):
        raise ValueError(f"[quantize] mxfp4 takes bits 4, group_size 32 and no biases, got bits {bits}, "
                         f"group_size {group_size}{'' if biases is None else ' and biases'}")


def quantize_spec(quantize):
    """Quantize-on-load's (bits, group_size) or (bits, group_size, mode), checked: (bits, group_size)
    for mode affine (as checkpoints record it), (4, 32, "mxfp4") for mxfp4; None stays None."""
    if quantize is None:
        return None
    bits, group_size = int(quantize[0]), int(quantize[1])
    mode = quantize[2] if len(quantize) > 2 else "affine"
    check_mode(mode, bits, group_size)
    if mode == "mxfp4":
        return bits, group_size, mode
    affine.check((1, group_size), bits, group_size)
    return bits, group_size


def mxfp4_scale_dtype(dtype):
    """Where mxfp4's scales live on a device computing in dtype: f32 and bf16 hold every E8M0 power of
    two exactly, f16 does not (ops.quantized_matmul refuses f16 scales in mode mxfp4)."""
    return "f32" if dtype == "f16" else dtype


@dataclass(frozen=True)
class QuantizedWeight:
    w: _core.Tensor       # (out, in * bits / 32) i32 packed codes
    scales: _core.Tensor  # (out, in / group_size) compute dtype
    biases: object        # (out, in / group_size) _core.Tensor; None in mode mxfp4
    bits: int
    group_size: int
    mode: str = "affine"  # or "mxfp4" (ops.quantized_matmul's)

    @staticmethod
    def upload(device, arrays, dtype):
        """One QuantizedWeight from QuantizedArrays of the same layout stacked along rows (q, k and
        v into one projection). Scales and biases stay in the compute dtype where the file stores
        them in it (or the compute dtype is f32), otherwise in f32: no scale is rounded (mxfp4's
        powers of two: in the compute dtype but for f16)."""
        a0 = arrays[0]
        sdt = dtype if a0.scale_dtype == dtype or dtype == "f32" else "f32"
        cat = lambda get, dt: np.concatenate([np.asarray(get(a), dt) for a in arrays])
        w = device.tensor(cat(lambda a: np.ascontiguousarray(np.asarray(a.w)).view(np.int32), np.int32), "i32")
        if a0.mode == "mxfp4":
            s = device.tensor(cat(QuantizedArray.float_scales, np.float32), mxfp4_scale_dtype(dtype))
            return QuantizedWeight(w, s, None, a0.bits, a0.group_size, "mxfp4")
        return QuantizedWeight(w, device.tensor(cat(lambda a: a.scales, np.float32), sdt),
                               device.tensor(cat(lambda a: a.biases, np.float32), sdt), a0.bits, a0.group_size)

    @staticmethod
    def quantize(device, W, dtype, bits, group_size, mode="affine", what="W"):
        """W (out, in) float quantized as mx.quantize does (experts (E, out, in): each expert's
        table); scales and biases stored in dtype (mxfp4's scales: mxfp4_scale_dtype)."""
        check_mode(mode, bits, group_size)
        W = np.asarray(W, np.float32)
        if W.ndim not in (2, 3) or W.shape[-1] % group_size:
            raise ValueError(f"[quantize] {what} {tuple(W.shape)}: its input size must be a multiple of "
                             f"--q-group-size {group_size}")
        mx = mode == "mxfp4"
        quant = mxfp4.quantize if mx else lambda We: affine.quantize(We, bits, group_size)
        parts = [quant(We) for We in (W if W.ndim == 3 else [W])]
        w, s, *b = (np.stack(p) if W.ndim == 3 else p[0] for p in zip(*parts))
        if mx:
            s = device.tensor(mxfp4.e8m0_to_float(s), mxfp4_scale_dtype(dtype))
            return QuantizedWeight(device.tensor(w, "i32"), s, None, bits, group_size, mode)
        return QuantizedWeight(device.tensor(w, "i32"), device.tensor(s, dtype), device.tensor(b[0], dtype), bits,
                               group_size)

    @property
    def shape(self):
        """(out, in); experts' (E, out, in)."""
        return tuple(self.w.shape[:-1]) + (self.w.shape[-1] * 32 // self.bits,)

    @property
    def device(self):
        return self.w.device

    def __getitem__(self, rows):
        """Rows r0:r1 (whole quantization groups: a row's groups never span rows)."""
        b = None if self.biases is None else self.biases[rows]
        return QuantizedWeight(self.w[rows], self.scales[rows], b, self.bits, self.group_size, self.mode)

    def numpy(self):
        """The dequantized weight (out, in) (experts': (E, out, in)) float32, as the products see it."""
        b = None if self.biases is None else self.biases.numpy()
        return QuantizedArray(self.w.numpy(), self.scales.numpy(), b, self.bits, self.group_size,
                              mode=self.mode).dequantize()


class RowStack:
    """Frozen weights stacked along rows that cannot be one tensor: the q, k and v projections of
    a checkpoint that quantizes them differently (MLX's mixed-precision recipes). The products
    run per part on column blocks of the fused activations."""

    def __init__(self, parts):
        self.parts = list(parts)
        self.rows = [p.shape[0] for p in self.parts]
        self.starts = np.concatenate([[0], np.cumsum(self.rows)]).tolist()

    @property
    def shape(self):
        return (self.starts[-1], self.parts[0].shape[1])

    @property
    def device(self):
        return self.parts[0].device

    def __getitem__(self, rows):
        """The part whose rows are exactly r0:r1 (the layer slices q, k and v)."""
        i = self.starts.index(rows.start)
        if self.starts[i + 1] != rows.stop:
            raise IndexError(f"[RowStack] rows {rows.start}:{rows.stop} are not one part {self.starts}")
        return self.parts[i]

    def numpy(self):
        return np.concatenate([np.asarray(p.numpy(), np.float32) for p in self.parts])


def frozen_weight(device, arrays, dtype, quantize=None, what="W"):
    """The frozen weight of one projection made of `arrays` stacked along rows (float arrays or
    QuantizedArrays as a file holds them): dense in the compute dtype, quantized as the file
    has it, quantized on load where quantize = (bits, group_size) or (bits, group_size, mode)
    (mode "affine" or "mxfp4": (4, 32, "mxfp4")) is given and the file holds floats, or a RowStack
    where the parts cannot share one layout."""
    q = [isinstance(a, QuantizedArray) for a in arrays]
    if all(q) and len({(a.bits, a.group_size, a.scale_dtype, a.mode) for a in arrays}) == 1:
        return QuantizedWeight.upload(device, arrays, dtype)
    if any(q):
        return RowStack([frozen_weight(device, [a], dtype, quantize, what) for a in arrays])
    W = np.concatenate([np.asarray(a, np.float32) for a in arrays])
    if quantize is None:
        return device.tensor(W, dtype)
    return QuantizedWeight.quantize(device, W, dtype, *quantize, what=what)


def embed(ids, table, out):
    """out (n, C) = rows ids (n,) of an embedding table, dense or quantized."""
    if isinstance(table, QuantizedWeight):
        if table.mode != "affine":
            raise ValueError(f"[embed] a quantized embedding table must be affine, got {table.mode}")
        ops.quantized_embedding(ids, table.w, table.scales, table.biases, out, table.group_size, table.bits)
    else:
        ops.embedding_forward(ids, table, out)


def linear(x, W, y, beta=0.0):
    """y (rows, out) = x (rows, in) W^T + beta y."""
    if isinstance(W, RowStack):
        for p, r0, r1 in zip(W.parts, W.starts, W.starts[1:]):
            linear(x, p, y[:, r0:r1], beta)
    elif isinstance(W, QuantizedWeight):
        ops.quantized_matmul(x, W.w, W.scales, W.biases, y, True, W.group_size, W.bits, beta, W.mode)
    else:
        ops.gemm(x, W, y, trans_b=True, beta=beta)


def expert_matmul(x, W, offsets, out, transpose=True, beta=0.0):
    """ops.moe_gemm's out = x W_e^T (transpose) or x W_e, + beta out, over the experts W (E, O, I):
    a dense tensor, or a QuantizedWeight of (E, ...) tables."""
    if isinstance(W, QuantizedWeight):
        ops.moe_quantized_matmul(x, W.w, W.scales, W.biases, offsets, out, transpose, W.group_size, W.bits, beta,
                                 W.mode)
    else:
        ops.moe_gemm(x, W, offsets, out, transpose, 1.0, beta)


def linear_grad(dy, W, dx, beta=0.0):
    """dx (rows, in) = dy (rows, out) W + beta dx."""
    if isinstance(W, RowStack):
        for i, (p, r0, r1) in enumerate(zip(W.parts, W.starts, W.starts[1:])):
            linear_grad(dy[:, r0:r1], p, dx, beta if i == 0 else 1.0)
    elif isinstance(W, QuantizedWeight):
        ops.quantized_matmul(dy, W.w, W.scales, W.biases, dx, False, W.group_size, W.bits, beta, W.mode)
    else:
        ops.gemm(dy, W, dx, beta=beta)
