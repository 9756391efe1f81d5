"""A mixture of experts' weights and LoRA as files hold them (models/moe.py computes with them):
checkpoints per expert (transformers' save_pretrained, Mixtral's w1/w2/w3) or mlx-lm's and
llama.cpp's 3-D experts, read under the fused names ModelConfig.weight_shapes lists and written
back the way the source had them; and the experts' LoRA in PEFT's layout (target_parameters)."""

import re

import numpy as np

from ..models.moe import ExpertHalves
from ..models.moe_config import switch_module
from ..quant import affine
from ..quant.qweight import QuantizedArray
from ..io.safetensors_io import FLOAT_DTYPES

_PER_EXPERT = {  # family: (block name, {our fused name: the stored names of an expert's pieces})
    "qwen3_moe": ("mlp", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),
    "olmoe": ("mlp", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),
    "mixtral": ("block_sparse_moe", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
}


class StackedTensor:
    """Experts' per-expert tensors read as one (E, out, in) array (gate_up: gate's rows, then up's),
    lazily like the LazyTensors it holds (`parts[e]`: the pieces of expert e)."""

    def __init__(self, parts):
        self.parts = parts
        first = parts[0][0]
        rows = sum(p.shape[0] for p in parts[0])
        self.shape = (len(parts), rows, first.shape[1])
        self.st_dtype, self.path = first.st_dtype, first.path

    @property
    def ndim(self):
        return 3

    def __array__(self, dtype=None, copy=None):
        a = np.stack([np.concatenate([np.asarray(p, np.float32) for p in ps]) for ps in self.parts])
        return a if dtype is None else a.astype(dtype, copy=False)


class Joined:
    """Tensors (E, n_j) read as one (E, sum n_j) array, lazily (gpt-oss's gate and up biases)."""

    def __init__(self, parts):
        self.parts, self.st_dtype = parts, getattr(parts[0], "st_dtype", None)
        self.path = getattr(parts[0], "path", None)  # GGUF's are arrays
        self.shape, self.ndim = (parts[0].shape[0], sum(p.shape[1] for p in parts)), 2

    def __array__(self, dtype=None, copy=None):
        a = np.concatenate([np.asarray(p, np.float32) for p in self.parts], axis=1)
        return a if dtype is None else a.astype(dtype, copy=False)


def stored_array(w, s, b, I, where):
    """The QuantizedArray of a module MLX stores quantized: codes w (..., O, I bits / 32) U32 with
    scales (..., O, I / group_size) and biases like them (affine), or U8 E8M0 scales and no biases
    (mxfp4); bits and group size follow from the shapes. A ValueError names what does not fit, by
    the module's path `where`."""
    if w.st_dtype not in ("U32", "I32") or w.ndim != s.ndim or w.shape[:-1] != s.shape[:-1]:
        raise ValueError(f"{where}.weight: codes {w.st_dtype} {w.shape} and scales {s.st_dtype} {s.shape} are not a "
                         "quantized weight's (U32 codes, scales of the same rows)")
    words, groups = w.shape[-1], s.shape[-1]
    if s.st_dtype == "U8":  # a microscaling mode: mxfp4 is the one krnl computes with
        if b is not None or words * 8 != I or groups * 32 != I:
            raise ValueError(f"{where}.scales: U8 scales {s.shape} with codes {w.shape}{' and biases' if b is not None else ''}"
                             f" are no MXFP4 of {I} inputs (4 bits, groups of 32); krnl reads MLX's affine and "
                             "mxfp4 modes")
        return QuantizedArray(w, s, None, 4, 32, "f32", "mxfp4")
    if s.st_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{where}.scales: {s.st_dtype} scales; krnl reads affine scales in F32, F16 or BF16")
    if b is None or b.shape != s.shape or b.st_dtype != s.st_dtype:
        raise ValueError(f"{where}.biases: {'missing' if b is None else (b.st_dtype, b.shape)} (expected "
                         f"{s.st_dtype} {s.shape} like the scales)")
    bits, gs = words * 32 // I if I else 0, I // groups if groups else 0
    if words * 32 != bits * I or bits not in affine.BITS or gs * groups != I or gs not in affine.GROUP_SIZES:
        raise ValueError(f"{where}.weight: codes {w.shape} and scales {s.shape} do not quantize {I} inputs at bits "
                         f"{affine.BITS} and group sizes {affine.GROUP_SIZES}")
    return QuantizedArray(w, s, b, bits, gs, FLOAT_DTYPES[s.st_dtype])


def switch_experts(tensors, config, where):
    """tensors with mlx-lm's experts (`mlp.switch_mlp.{gate,up,down}_proj`, gpt-oss's `mlp.experts.*`,
    (E, O, I) each, float or quantized with `.scales` and `.biases` (E, O, I / group_size); gpt-oss's
    `.bias` (E, O) too) under the fused names; a quantized triple's bits and group size follow from
    its shapes, as for MLX's linears."""
    if not config.moe:
        return tensors
    out, bad, sw = dict(tensors), [], switch_module(config)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        got, bias = {}, {n: out.pop(f"{p}{sw}.{n}.bias", None) for n in ("gate_proj", "up_proj", "down_proj")}
        if bias["gate_proj"] is not None and bias["up_proj"] is not None:
            out[p + "experts.gate_up_proj_bias"] = Joined([bias["gate_proj"], bias["up_proj"]])
        if bias["down_proj"] is not None:
            out[p + "experts.down_proj_bias"] = bias["down_proj"]
        for n in ("gate_proj", "up_proj", "down_proj"):
            w, s, b = (out.pop(f"{p}{sw}.{n}.{k}", None) for k in ("weight", "scales", "biases"))
            if w is None:
                continue
            I = config.hidden_size if n != "down_proj" else config.moe["expert_size"]
            if s is None:  # float, or (GGUF) a QuantizedArray already
                got[n] = w
                continue
            try:
                got[n] = stored_array(w, s, b, I, f"{p}{sw}.{n}")
            except ValueError as e:
                bad.append(str(e))
        if "gate_proj" in got and "up_proj" in got:
            out[p + "experts.gate_up_proj"] = ExpertHalves(got["gate_proj"], got["up_proj"])
        if "down_proj" in got:
            out[p + "experts.down_proj"] = got["down_proj"]
    if bad:
        raise ValueError(f"[hf] {where}: " + "; ".join(bad))
    return out


def stacked_experts(tensors, config):
    """tensors with a mixture of experts' per-expert weights (transformers' save_pretrained; Mixtral's
    block_sparse_moe w1/w2/w3) replaced by the fused names ModelConfig.weight_shapes lists. Fused
    checkpoints pass through; a layer missing an expert's piece is left for the caller's check to name."""
    if not config.moe or config.model_type not in _PER_EXPERT:
        return tensors
    block, pieces = _PER_EXPERT[config.model_type]
    out = dict(tensors)
    E = config.moe["experts"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.{block}."
        router = out.pop(p + "gate.weight", None)
        if router is not None:
            out[f"model.layers.{i}.mlp.gate.weight"] = router
        for fused, names in pieces.items():
            keys = [[f"{p}experts.{e}.{n}.weight" for n in names] for e in range(E)]
            if all(k in out for ks in keys for k in ks):
                out[f"model.layers.{i}.mlp.experts.{fused}"] = StackedTensor([[out.pop(k) for k in ks] for ks in keys])
    return out


def expert_pieces(config, name, array):
    """[(stored name, (out, in) array)] of a fused expert weight as `config`'s family stores it per
    expert (the inverse of stacked_experts, for writing folders the way transformers does)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)", name)
    if m is None or config.model_type not in _PER_EXPERT:
        return [(name, array)]
    block, pieces = _PER_EXPERT[config.model_type]
    p = f"model.layers.{m.group(1)}.{block}."
    if m.group(3) is None:
        return [(p + "gate.weight", array)]
    names, a = pieces[m.group(3)], np.asarray(array, np.float32)
    rows = a.shape[1] // len(names)
    return [(f"{p}experts.{e}.{n}.weight", a[e, j * rows:(j + 1) * rows]) for e in range(a.shape[0])
            for j, n in enumerate(names)]


def merged_experts(W32, A, B, scale):
    """W (E, out, in) + s B_e A_e per expert in float32, the factors as the model holds them."""
    B = np.asarray(B, np.float32)
    if B.ndim == 4:  # gate_up_proj: gate's rows, then up's
        B = np.concatenate([B[0], B[1]], axis=1)
    return (W32 + np.float32(scale) * np.einsum("eor,eri->eoi", B, np.asarray(A, np.float32))).astype(np.float32)


def stored_name(config, weights, name):
    """The name a weight goes back under: a router beside experts read per expert, its family's
    per-expert name (Mixtral's block_sparse_moe.gate); any other weight, its own."""
    if config.moe and name.endswith(".mlp.gate.weight"):
        if isinstance(weights.get(name[:-len("gate.weight")] + "experts.down_proj"), StackedTensor):
            return expert_pieces(config, name, None)[0][0]
    return name


class Pieces:
    """The parts split(get()) of one weight a writer stores as several tensors (an expert's pieces,
    gate_up's halves): made once for its `uses` calls of take(j) (default: one per part) and
    dropped after the last, so that a fused weight is computed once, not once per part."""

    def __init__(self, get, split, uses=None):
        self.get, self.split, self.uses, self.parts, self.left = get, split, uses, None, 0

    def take(self, j):
        if self.parts is None:
            self.parts = self.split(self.get())
            self.left = self.uses or len(self.parts)
        a, self.left = self.parts[j], self.left - 1
        if self.left == 0:
            self.parts = None
        return a


# ---- the experts' LoRA in PEFT's layout (target_parameters on the fused expert weights)

def peft_expert_keys(i, modules):
    """{module: (PEFT key of A, of B)} of layer i's expert modules among `modules`. PEFT wraps the
    experts' parameters in their declaration order (gate_up_proj, then down_proj), each wrapper
    around the last: all but the outermost sit under one more `base_layer.` per wrapper above."""
    mods = [m for m in ("gate_up_proj", "down_proj") if m in modules]
    p = f"base_model.model.model.layers.{i}.mlp.experts."
    return {m: tuple(p + "base_layer." * (len(mods) - 1 - j) + f"lora_{f}.weight" for f in "AB")
            for j, m in enumerate(mods)}


def peft_factors(A, B):
    """PEFT's (E r, in) A and (out, r E) B (column j E + e: rank j of expert e) of factors held as
    A (E, r, in) and B (E, out, r) or gate_up_proj's (2, E, F, r)."""
    A, B = np.asarray(A, np.float32), np.asarray(B, np.float32)
    if B.ndim == 4:
        B = np.concatenate([B[0], B[1]], axis=1)                          # (E, 2F, r): gate's rows, then up's
    E, out, r = B.shape
    return A.reshape(E * r, A.shape[2]), np.ascontiguousarray(B.transpose(1, 2, 0).reshape(out, r * E))


def held_factors(A, B, E, fused_gate_up):
    """The inverse of peft_factors for E experts."""
    A, B = np.asarray(A, np.float32), np.asarray(B, np.float32)
    r = A.shape[0] // E
    out = B.shape[0]
    Bh = np.ascontiguousarray(B.reshape(out, r, E).transpose(2, 0, 1))   # (E, out, r)
    if fused_gate_up:
        Bh = np.stack([Bh[:, :out // 2], Bh[:, out // 2:]])
    return np.ascontiguousarray(A.reshape(E, r, A.shape[1])), np.ascontiguousarray(Bh)
