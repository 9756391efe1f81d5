"""gpt-oss's checkpoint layouts, read under the names and layouts ModelConfig.weight_shapes lists
(formats/experts.py holds the other mixtures'), and written back as stored:

  transformers   mlp.router.{weight,bias}; mlp.experts.gate_up_proj (E, C, 2F) with gate's and up's
                 columns interleaved (gate 2j, up 2j + 1), its bias (E, 2F) likewise, down_proj
                 (E, F, C) (each expert x W, not x W^T), down_proj_bias (E, C)
  krnl           mlp.gate.{weight,bias}; gate_up_proj (E, 2F, C) gate's rows then up's, its bias
                 (E, 2F) the same way, down_proj (E, C, F): the (out, in) of the other families

OpenAI's own checkpoints hold the two expert weights in MXFP4 (`*_blocks` (E, O, I / 32, 16) bytes
of 4-bit codes, `*_scales` (E, O, I / 32) E8M0 bytes, rows already (out, in), gate_up's rows
interleaved): read as QuantizedArrays in mode "mxfp4", never dequantized whole."""

import re

import numpy as np

from ..models.moe import ExpertHalves
from ..quant.qweight import QuantizedArray

_NAME = re.compile(r"(model\.layers\.\d+\.mlp\.)(router\.(weight|bias|scales|biases)|"
                   r"experts\.(gate_up_proj|gate_up_proj_bias|down_proj|gate_up_proj_blocks|down_proj_blocks))")


class Relaid:
    """A stored tensor read in krnl's layout (fn of the stored float32 array, or of its integers where
    raw), lazily like the LazyTensor it wraps; st_dtype is the stored one and .src the stored
    tensor, whose bytes a writer keeps where nothing changed."""

    def __init__(self, src, fn, shape, raw=False):
        self.src, self.fn, self.shape, self.raw = src, fn, tuple(shape), raw  # raw: integers as stored
        self.st_dtype, self.path = getattr(src, "st_dtype", None), getattr(src, "path", None)

    @property
    def ndim(self):
        return len(self.shape)

    def __array__(self, dtype=None, copy=None):
        a = np.ascontiguousarray(self.fn(np.asarray(self.src) if self.raw else np.asarray(self.src, np.float32)))
        return a if dtype is None else a.astype(dtype, copy=False)


def _halves(a):
    """(gate, up) of an array whose last axis interleaves them."""
    return a[..., 0::2], a[..., 1::2]


def _interleaved(a):
    """The inverse of _halves on a last axis of gate's then up's halves."""
    F = a.shape[-1] // 2
    out = np.empty_like(a)
    out[..., 0::2], out[..., 1::2] = a[..., :F], a[..., F:]
    return out


def _mxfp4(blocks, scales, rows):
    """A QuantizedArray (mode mxfp4) of the expert rows `rows` (a slice) of stored blocks (E, O, G, 16)
    and scales (E, O, G): each row's G 16-byte blocks are its codes, low nibble first."""
    E, O, G, _ = blocks.shape
    n = len(range(O)[rows])
    w = Relaid(blocks, lambda a: np.ascontiguousarray(a[:, rows]).reshape(E, n, G * 16).view(np.uint32),
               (E, n, G * 4), raw=True)
    s = Relaid(scales, lambda a: a[:, rows], (E, n, G), raw=True)
    return QuantizedArray(w, s, None, 4, 32, "bf16", "mxfp4")


def read_experts(tensors, config):
    """tensors with transformers' gpt-oss names and layouts turned into krnl's (module docstring); an
    MLX folder's router (quantized too) renamed, its experts left to experts.switch_experts."""
    if config.model_type != "gpt_oss":
        return tensors
    scales = {k: t for k, t in tensors.items() if k.endswith("_scales") and ".mlp.experts." in k}
    out = {}
    for name, t in ((k, t) for k, t in tensors.items() if not (k.endswith("_scales") and ".mlp.experts." in k)):
        m = _NAME.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        p, what = m.group(1), m.group(4)
        if m.group(3):                                                    # the router
            out[p + "gate." + m.group(3)] = t
        elif what.endswith("_blocks"):                                    # MXFP4, rows (out, in) already
            base = name[:-len("_blocks")]
            s = scales.pop(base + "_scales", None)
            if s is None or t.st_dtype != "U8" or s.st_dtype != "U8" or t.ndim != 4 or s.shape != t.shape[:3]:
                raise ValueError(f"[hf] {name} {t.st_dtype} {t.shape} with {base}_scales "
                                 f"{None if s is None else (s.st_dtype, s.shape)}: not MXFP4 blocks and scales")
            if what.startswith("gate_up"):
                out[base] = ExpertHalves(_mxfp4(t, s, slice(0, None, 2)), _mxfp4(t, s, slice(1, None, 2)))
            else:
                out[base] = _mxfp4(t, s, slice(None))
        elif what == "gate_up_proj":                                      # (E, C, 2F): halves (E, F, C) each
            E, C, F2 = t.shape
            out[name] = ExpertHalves(*(Relaid(t, lambda a, j=j: _halves(a)[j].transpose(0, 2, 1), (E, F2 // 2, C))
                                       for j in (0, 1)))
        elif what == "gate_up_proj_bias":
            out[name] = Relaid(t, lambda a: np.concatenate(_halves(a), axis=-1), t.shape)
        else:                                                             # down_proj (E, F, C)
            out[name] = Relaid(t, lambda a: a.transpose(0, 2, 1), (t.shape[0], t.shape[2], t.shape[1]))
    out.update(scales)  # scales without blocks: left for the caller's check to name
    return out


def stored_layout(config, name, shape):
    """(stored name, stored shape, krnl layout -> stored layout) of a weight krnl names `name`,
    or None where both agree (every family but gpt-oss)."""
    if config.model_type != "gpt_oss":
        return None
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.)(gate\.(weight|bias)|experts\.(gate_up_proj|gate_up_proj_bias|down_proj))",
                     name)
    if m is None:
        return None
    p, what = m.group(1), m.group(4)
    if m.group(3):
        return p + "router." + m.group(3), tuple(shape), lambda a: a
    if what == "gate_up_proj_bias":
        return name, tuple(shape), _interleaved
    E, O, I = shape
    if what == "gate_up_proj":
        return name, (E, I, O), lambda a: _interleaved(a.transpose(0, 2, 1))
    return name, (E, I, O), lambda a: np.ascontiguousarray(a.transpose(0, 2, 1))


def peft_rows(B, to_peft):
    """gate_up_proj's LoRA B (out 2F, r E) with its rows as PEFT holds them on gpt-oss (gate's and
    up's interleaved, to_peft) or as krnl does (gate's, then up's)."""
    if to_peft:
        return _interleaved(B.T).T
    return np.concatenate(_halves(B.T), axis=-1).T
