"""MLX quantized model folders (docs/architecture.md, 'Models, adapters and data'): what
`mlx_lm.convert -q` writes, an HF folder whose config.json has

    "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                     "model.layers.0.self_attn.v_proj": {"group_size": 64, "bits": 6, "mode": "affine"}, ...}

(duplicated as "quantization_config"; keys that are module paths override the default for that
module, false leaves it unquantized) and, for each module stored quantized, `<m>.weight` (U32,
codes packed as krnl.quant.affine lays them out), `<m>.scales` and `<m>.biases` (O, I / group_size) in
the model's dtype. Which modules are quantized is what the file holds: like mlx-lm's loader, a
module with `<m>.scales` is quantized and its bits and group size follow from the shapes.

Read side: `quantization(cfg)` parses the config, `read_quantized` turns the stored triples into
QuantizedArray values of the weights dict. Write side: `quantized_items` gives the three tensors
of a module quantized as mx.quantize does, for krnl.formats.hf.write_sharded."""

import re

import numpy as np

from ..quant import affine
from ..models.config import module_part
from ..models.moe_config import switch_module
from ..quant import mxfp4
from ..quant.qweight import QuantizedArray, quantize_spec
from .experts import Pieces, stored_array
from ..io.safetensors_io import FLOAT_DTYPES, ST_DTYPES, encode, f32_to_bf16

SCALE_DTYPES = FLOAT_DTYPES  # affine scales and biases: a float dtype
FLOAT_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def module_paths(config):
    """The modules MLX may store quantized in a model of ModelConfig `config` (its Linear and
    Embedding layers), in checkpoint order."""
    out = ["model.embed_tokens"]
    for i in range(config.num_hidden_layers):
        mods = [m for m in config.lora_modules() if not config.moe or module_part(m) == "self_attn"]
        out += [f"model.layers.{i}.{module_part(m)}.{m}" for m in mods]
        if config.moe:  # a mixture's router (its experts are 3-D: experts.switch_experts)
            out.append(f"model.layers.{i}.mlp.gate")
    if not config.tie_word_embeddings:
        out.append("lm_head")
    return out


def _layout(d, where):
    """(bits, group_size) of a quantization dict, refusing modes other than affine and mxfp4 (whose
    modules read_quantized tells by their U8 scales)."""
    mode = d.get("mode", "affine")
    if mode not in ("affine", "mxfp4"):
        raise ValueError(f"[hf] {where}: quantization mode {mode!r} is not supported; krnl reads MLX's affine "
                         f"quantization (integer codes with scales and biases) and mxfp4")
    try:
        return int(d["bits"]), int(d["group_size"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"[hf] {where}: quantization needs integer bits and group_size, got {d}") from None


def quantization(cfg, source="config.json"):
    """None for a float model, else {"bits", "group_size", "overrides": {module path: (bits,
    group_size) or False}} from the config dict of an MLX quantized folder. One-line errors for
    what krnl cannot read: other modes (mxfp4, nvfp4, mxfp8) and other quantizers' configs."""
    q = cfg.get("quantization")
    if q is None:
        q = cfg.get("quantization_config")
        if q is None:
            return None
        if isinstance(q, dict) and q.get("quant_method") == "mxfp4":
            return None  # gpt-oss's MXFP4 experts: formats/gpt_oss.py reads their blocks and scales
        if not isinstance(q, dict) or "bits" not in q or "group_size" not in q:
            method = q.get("quant_method", "?") if isinstance(q, dict) else q
            raise ValueError(f"[hf] {source}: quantization_config (quant_method {method!r}) is not MLX's "
                             f"quantization; krnl reads MLX quantized folders and float checkpoints")
    if not isinstance(q, dict):
        raise ValueError(f"[hf] {source}: quantization must be an object, got {q!r}")
    bits, gs = _layout(q, source)
    overrides = {}
    for k, v in q.items():
        if k in ("bits", "group_size", "mode", "quant_method"):
            continue
        if v is False:
            overrides[k] = False
        elif isinstance(v, dict):
            overrides[k] = _layout(v, f"{source} ({k})")
        elif v is not True:
            raise ValueError(f"[hf] {source}: quantization entry {k!r} must be an object or false, got {v!r}")
    return {"bits": bits, "group_size": gs, "overrides": overrides}


def read_quantized(tensors, config, q, folder):
    """Replaces, in {name: LazyTensor} `tensors`, each module stored quantized (`<m>.weight`,
    `.scales`, `.biases`) by one QuantizedArray under `<m>.weight` with the logical shape (O, I);
    raises one ValueError listing every inconsistency, naming files and tensors."""
    want = config.weight_shapes()
    bad = []
    for m in module_paths(config):
        wk, sk, bk = m + ".weight", m + ".scales", m + ".biases"
        ov = q["overrides"].get(m)
        if sk not in tensors or wk not in tensors:
            if isinstance(ov, tuple) and wk in tensors:
                bad.append(f"{m}: the config quantizes it ({ov[0]} bits) but {wk} has no {sk}")
            continue
        w, s = tensors[wk], tensors.pop(sk)
        b = tensors.pop(bk, None)
        if ov is False:
            bad.append(f"{m}: the config says not quantized but {sk} is stored")
            continue
        O, I = want[wk]
        try:
            qa = stored_array(w, s, b, I, m)
        except ValueError as e:
            bad.append(f"{e} ({w.path})")
            continue
        if w.ndim != 2 or w.shape[0] != O:
            bad.append(f"{wk} ({w.path}): codes {w.shape} are not a ({O}, {I}) weight's")
        elif isinstance(ov, tuple) and ov != (qa.bits, qa.group_size):
            bad.append(f"{m}: stored at {qa.bits} bits in groups of {qa.group_size}, the config says {ov[0]} bits, "
                       f"groups of {ov[1]}")
        else:
            tensors[wk] = qa
    if bad:
        raise ValueError(f"[hf] {folder}: quantized tensors do not match the config: " + "; ".join(bad))
    return tensors


# ---------------------------------------------------------------------------------------------
# Write side


def plan(config, bits, group_size, overrides=None, mode="affine"):
    """{module path: (bits, group_size), (4, 32, "mxfp4") or None} as mlx_lm.convert -q chooses: every
    Linear and Embedding whose input size is a multiple of its group size is quantized, in `mode`.
    `overrides` {module path: (bits, group_size) or None} changes single modules (mixed recipes)."""
    default = quantize_spec((bits, group_size, mode))
    out = {}
    for m in module_paths(config) + expert_paths(config):
        router = config.moe and m.endswith(".mlp.gate")  # mlx-lm keeps qwen3_moe's and gpt-oss's at 8 bits, groups of 64
        layout = (overrides or {}).get(m, (8, 64) if router and config.model_type in ("qwen3_moe", "gpt_oss")
                                       else default)
        if layout is not None:
            quantize_spec(layout)
            whole = m in ("model.embed_tokens", "lm_head") or router
            inp = config.hidden_size if whole else config.module_shape(m.rsplit(".", 1)[1])[1]
            layout = layout if inp % layout[1] == 0 else None
        out[m] = layout
    return out


def expert_paths(config):
    """A mixture's experts as mlx-lm stores them: mlp.switch_mlp.{gate,up,down}_proj per layer (gpt-oss:
    mlp.experts.*)."""
    return [f"model.layers.{i}.mlp.{switch_module(config)}.{n}" for i in range(config.num_hidden_layers)
            if config.moe for n in ("gate_proj", "up_proj", "down_proj")]


RECIPES = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6)}


def recipe_overrides(config, recipe, group_size=64):
    """(low bits, {module path: (bits, group_size)}) of one of mlx-lm's mixed recipes (its
    --quant-predicate, after llama.cpp's Q4_K_M choice): v_proj and down_proj get the high bits in
    the first and last eighth of the layers and in every third layer between, the head always;
    every other module gets the low bits."""
    if recipe not in RECIPES:
        raise ValueError(f"[quantize] unknown recipe {recipe!r}; one of {', '.join(RECIPES)}")
    low, high = RECIPES[recipe]
    L = config.num_hidden_layers
    out = {"lm_head": (high, group_size)} if not config.tie_word_embeddings else {}
    for i in range(L):
        if i < L // 8 or i >= 7 * L // 8 or (i - L // 8) % 3 == 2:
            out[f"model.layers.{i}.self_attn.v_proj"] = out[f"model.layers.{i}.mlp.down_proj"] = (high, group_size)
    return low, out


def config_entry(layouts, bits, group_size, mode="affine"):
    """The "quantization" object of config.json: the default plus one entry per module quantized
    otherwise (mlx-lm writes its mixed recipes this way)."""
    entry = lambda lay: {"group_size": int(lay[1]), "bits": int(lay[0]), "mode": lay[2] if len(lay) > 2 else "affine"}
    default = quantize_spec((bits, group_size, mode))
    q = entry(default)
    for m, lay in layouts.items():
        if lay is not None and tuple(lay) != default:
            q[m] = entry(lay)
    return q


def round_to(W32, dtype):
    """float32 values rounded to dtype ("f32", "f16", "bf16") and back: what a weight cast to the
    model dtype holds before MLX quantizes it."""
    W32 = np.asarray(W32, np.float32)
    if dtype == "bf16":
        return (f32_to_bf16(W32).astype(np.uint32) << 16).view(np.float32)
    if dtype == "f16":
        return W32.astype(np.float16).astype(np.float32)
    return W32


def quantized_items(module, get_w32, shape, layout, dtype):
    """[(name, st_dtype, shape, producer)] of `module` quantized at layout (bits, group_size) (weight,
    scales, biases) or (4, 32, "mxfp4") (weight, U8 scales), for write_sharded. get_w32() -> the (O,
    I) float32 weight; it is rounded to dtype first (mlx-lm casts, then quantizes) and quantized
    once, when the codes are written; affine scales and biases are stored in dtype."""
    *lead, I = shape  # (O, I); a mixture's experts (E, O, I), each quantized on its own
    bits, group_size = layout[:2]
    mx = layout[2:] == ("mxfp4",)
    one = mxfp4.quantize if mx else (lambda W: affine.quantize(W, bits, group_size))
    st = "U8" if mx else ST_DTYPES[dtype]
    done = {}

    def quantize(W):
        return [np.stack(p) for p in zip(*(one(We) for We in W))] if W.ndim == 3 else one(W)

    def part(i):
        def make():
            if "q" not in done:
                done["q"] = quantize(round_to(get_w32(), dtype))
            a = done["q"][i]
            if i == len(done["q"]) - 1:
                done.clear()  # the last part: free the module's arrays
            return np.ascontiguousarray(a).view(np.uint32).tobytes() if i == 0 else (
                np.ascontiguousarray(a).tobytes() if mx else encode(a, st))
        return make

    G, lead = I // group_size, tuple(lead)
    return [(module + ".weight", "U32", lead + (I * bits // 32,), part(0)),
            (module + ".scales", st, lead + (G,), part(1))] + ([] if mx else [(module + ".biases", st, lead + (G,),
                                                                               part(2))])


def stored_items(module, qa):
    """The three tensors of a QuantizedArray as they are stored (a module passed through
    unchanged: its codes are not quantized twice)."""
    st = ST_DTYPES[qa.scale_dtype]

    def raw(a, dt):
        if getattr(a, "st_dtype", None) == dt:  # a LazyTensor of that dtype: its bytes as they are
            return a.raw_bytes
        if dt == "U32":
            return lambda: np.ascontiguousarray(np.asarray(a)).view(np.uint32).tobytes()
        return lambda: encode(np.asarray(a, np.float32), dt)

    ws, ss = tuple(np.shape(qa.w)), tuple(np.shape(qa.scales))  # experts' with their leading E
    if qa.mode == "mxfp4":  # E8M0 bytes as they are, no biases
        return [(module + ".weight", "U32", ws, raw(qa.w, "U32")), (module + ".scales", "U8", ss,
                                                                    lambda: np.asarray(qa.scales, np.uint8).tobytes())]
    return [(module + ".weight", "U32", ws, raw(qa.w, "U32")), (module + ".scales", st, ss, raw(qa.scales, st)),
            (module + ".biases", st, ss, raw(qa.biases, st))]


def model_dtype(cfg, weights):
    """The dtype mlx_lm.convert stores a model in without --dtype: the config's torch_dtype (or
    dtype), else the stored dtype of the embedding (mlx-lm then keeps each tensor's own)."""
    for k in ("torch_dtype", "dtype"):
        if cfg.get(k) in FLOAT_NAMES:
            return FLOAT_NAMES[cfg[k]]
    e = weights["model.embed_tokens.weight"]
    if isinstance(e, QuantizedArray):
        return e.scale_dtype
    return SCALE_DTYPES.get(getattr(e, "st_dtype", "F32"), "f32")


def mlx_items(config, weights, names, bits, group_size, dtype, merged=None, overrides=None, mode="affine"):
    """(items for write_sharded, the config's "quantization" object) of an MLX folder holding
    `weights` ({HF name: LazyTensor, QuantizedArray or array}, written in the order of `names`):
    modules quantized as plan() says, everything else cast to dtype. merged {name: () -> float32
    (O, I)} replaces a weight (a fused W + s B A). A module the source stores quantized and that
    is not merged keeps its codes, scales and biases when they are in dtype already: quantizing
    a dequantized weight again would round it twice."""
    merged = merged or {}
    layouts = plan(config, bits, group_size, overrides, mode)
    module_of = {m + ".weight": m for m in layouts}
    st = ST_DTYPES[dtype]
    items, used = [], {}
    for name, t, mget in _switch_parts(config, weights, names, merged):
        m = module_of.get(name)
        get = mget or (lambda t=t: np.asarray(t, np.float32))
        if m is not None and isinstance(t, QuantizedArray) and mget is None and (t.scale_dtype == dtype
                                                                                  or t.mode == "mxfp4"):
            items += stored_items(m, t)
            used[m] = quantize_spec((t.bits, t.group_size, t.mode))
        elif m is not None and layouts[m] is not None:
            items += quantized_items(m, get, tuple(t.shape), layouts[m], dtype)
            used[m] = layouts[m]
        elif mget is None and getattr(t, "st_dtype", None) == st:
            items.append((name, st, tuple(t.shape), t.raw_bytes))
        else:
            items.append((name, st, tuple(np.shape(t)), lambda get=get: encode(get(), st)))
    if config.model_type == "gpt_oss":  # its router goes back under mlp.router (krnl's mlp.gate)
        ren = lambda n: re.sub(r"\.mlp\.gate(?=\.|$)", ".mlp.router", n)
        items, used = [(ren(n), *rest) for n, *rest in items], {ren(m): v for m, v in used.items()}
    return items, config_entry(used, bits, group_size, mode)


def _switch_parts(config, weights, names, merged):
    """(name, tensor, merged getter or None) of each weight to write: a mixture's fused experts as
    mlx-lm's switch_mlp modules, gate_up_proj's halves apart, under `<module>.weight`."""
    for name in names:
        t, get = weights[name], merged.get(name)
        if not (config.moe and ".mlp.experts." in name):
            yield name, t, get
            continue
        p = name.split(".mlp.experts.")[0] + f".mlp.{switch_module(config)}."
        if name.endswith("down_proj") or name.endswith("down_proj_bias"):
            yield p + "down_proj." + ("bias" if name.endswith("_bias") else "weight"), t, get
            continue
        if name.endswith("gate_up_proj_bias"):  # gpt-oss: (E, 2F) gate's, then up's
            pieces = Pieces(get or (lambda t=t: np.asarray(t, np.float32)), lambda a: np.split(a, 2, axis=1))
            for j, n in enumerate(("gate_proj", "up_proj")):
                yield p + n + ".bias", np.broadcast_to(np.float32(0), (t.shape[0], t.shape[1] // 2)), (
                    lambda pieces=pieces, j=j: pieces.take(j))
            continue
        E, F2, C = t.shape
        halves = getattr(t, "parts", (None, None))  # moe.ExpertHalves: as the source holds them
        kept = [get is None and isinstance(h, QuantizedArray) for h in halves]  # passed through as stored
        pieces = Pieces(get or (lambda t=t: np.asarray(t, np.float32)),
                        lambda a, F=F2 // 2: [a[:, :F], a[:, F:]], uses=kept.count(False))
        for j, n in enumerate(("gate_proj", "up_proj")):
            if kept[j]:
                yield p + n + ".weight", halves[j], None
            else:
                yield p + n + ".weight", np.broadcast_to(np.float32(0), (E, F2 // 2, C)), (
                    lambda pieces=pieces, j=j: pieces.take(j))
