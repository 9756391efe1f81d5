"""LoRA adapters in PEFT's on-disk format (docs/architecture.md, 'Models, adapters and data'): `adapter_config.json` and
`adapter_model.safetensors` with keys `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`,
A (r, in) and B (out, r) (DoRA's magnitude (out,) `...q_proj.lora_magnitude_vector`, use_dora), so
PEFT, transformers and vLLM load them unchanged; and mlx-lm's layout (`adapters.safetensors`, keys
`model.layers.N.self_attn.q_proj.lora_a`, the factors transposed; DoRA's `...q_proj.m`),
which `mlx_lm.load(path, adapter_path=...)` loads. Files are written atomically (temporary file
in the same folder, fsync, rename)."""

import json
import re
from pathlib import Path

import numpy as np

from ..models import gemma3
from ..io.fileio import atomic_write_bytes, read_json_object
from ..models.config import module_part, LoraConfig, lora_key, magnitude_key
from ..models.moe_config import EXPERT_MODULES, lora_shapes, router_module, switch_module
from .experts import held_factors, peft_expert_keys, peft_factors
from .gpt_oss import peft_rows
from ..io.safetensors_io import LazyTensor, read_safetensors_header

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MLX_WEIGHTS_NAME = "adapters.safetensors"
# krnl train --adapter-format mlx writes mlx-lm's files into this subfolder of the PEFT folder:
# both layouts call their config adapter_config.json, with different keys, and PEFT versions
# before 0.14 (and other PEFT readers) refuse a config with keys they do not know.
MLX_SUBFOLDER = "mlx"


def peft_config(lora, base_model="", layers=None, model_config=None):
    """adapter_config.json contents for a LoraConfig-like object (a multimodal gemma3 model's
    excludes its vision tower, whose q/k/v_proj PEFT would adapt too)."""
    extra = {"exclude_modules": gemma3.EXCLUDE} if model_config is not None and model_config.multimodal else {}
    targets = sorted(lora.target_modules)
    if model_config is not None and model_config.moe:  # experts and router are parameters, not modules, to PEFT
        params = peft_parameters(model_config)
        extra["target_parameters"] = sorted(params[m] for m in targets if m in params)
        targets = [m for m in targets if m not in params]
    return {**extra,
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(lora.r),
        "lora_alpha": float(lora.alpha),
        "lora_dropout": float(lora.dropout),
        "target_modules": targets,
        "use_rslora": bool(lora.use_rslora),
        "use_dora": bool(lora.use_dora),
        "layers_to_transform": None if layers is None else [int(i) for i in layers],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def save_adapter(path, tensors, config, model_config=None):
    """Writes {PEFT key: float32 array} and the config dict into folder `path` (for a multimodal
    gemma3 model under PEFT's names on Gemma3ForConditionalGeneration)."""
    from safetensors.numpy import save

    path = Path(path)
    if model_config is not None and model_config.multimodal:
        tensors = gemma3.peft_keys_out(tensors)
    if model_config is not None and model_config.moe:
        tensors = _peft_experts_out(tensors, model_config)
    blob = save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
                metadata={"format": "pt"})
    atomic_write_bytes(path / WEIGHTS_NAME, blob)  # weights first: the config names a complete set
    atomic_write_bytes(path / CONFIG_NAME, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def peft_parameters(config):
    """{krnl's LoRA target of a mixture: the parameter PEFT reaches it by (target_parameters)}."""
    return {"gate_up_proj": "mlp.experts.gate_up_proj", "down_proj": "mlp.experts.down_proj",
            "router": f"mlp.{router_module(config)}.weight"}


# A router factor's key part: krnl's module name; the module PEFT's ParamWrapper (and mlx-lm's
# LoRALinear) sit on is the family's router_module.
ROUTER = ".mlp.router.lora_"


def _router_file(config):
    return f".mlp.{router_module(config)}.lora_"


def _peft_experts_out(tensors, config):
    """tensors with the experts' factors under PEFT's keys and in its layout (experts.peft_factors;
    gpt-oss's gate_up_proj columns interleave gate's and up's, and so do the rows of its B)."""
    out = {k.replace(ROUTER, _router_file(config)): v for k, v in tensors.items()}
    for i in range(config.num_hidden_layers):
        mods = [m for m in EXPERT_MODULES if lora_key(i, m, "A") in out]
        for m, (kA, kB) in peft_expert_keys(i, mods).items():
            out[kA], out[kB] = peft_factors(out.pop(lora_key(i, m, "A")), out.pop(lora_key(i, m, "B")))
            if m == "gate_up_proj" and config.model_type == "gpt_oss":
                out[kB] = peft_rows(out[kB], True)
    return out


def _peft_experts_in(raw, config, cfg, who):
    """raw with the experts' PEFT factors (target_parameters) under krnl's keys, held as the model
    holds them (experts.held_factors); other keys pass through."""
    params, known = cfg.get("target_parameters") or [], peft_parameters(config)
    mods = [m for m in EXPERT_MODULES if known[m] in params]
    unknown = [p for p in params if p not in known.values()]
    if unknown:
        raise ValueError(f"[{who}] target_parameters {unknown} are not supported; krnl takes "
                         f"{', '.join(known.values())}")
    out, E = {k.replace(_router_file(config), ROUTER): v for k, v in raw.items()}, config.moe["experts"]
    for i in range(config.num_hidden_layers):
        for m, (kA, kB) in peft_expert_keys(i, mods).items():
            if kA in out and kB in out:
                A, B = out.pop(kA), out.pop(kB)
                if A.ndim != 2 or B.ndim != 2 or A.shape[0] % E or B.shape[1] != A.shape[0]:
                    raise ValueError(f"[{who}] {kA} {A.shape} and {kB} {B.shape} are not the LoRA of {E} experts")
                if m == "gate_up_proj" and config.model_type == "gpt_oss":
                    B = peft_rows(B, False)
                out[lora_key(i, m, "A")], out[lora_key(i, m, "B")] = held_factors(A, B, E, m == "gate_up_proj")
    return out


def _mlx_experts_in(raw, config, who):
    """raw with mlx-lm's expert factors (switch_mlp's gate, up and down LoRASwitchLinear; gpt-oss's
    experts') under krnl's keys: gate and up must share their A, as PEFT's one LoRA on the fused
    gate|up does."""
    out = dict(raw)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.{switch_module(config)}."
        got = {h: (out.pop(f"{p}{h}.lora_a", None), out.pop(f"{p}{h}.lora_b", None))
               for h in ("gate_proj", "up_proj", "down_proj")}
        if got["down_proj"][0] is not None:
            d = f"model.layers.{i}.mlp.down_proj."
            out[d + "lora_a"], out[d + "lora_b"] = got["down_proj"]
        (ga, gb), (ua, ub) = got["gate_proj"], got["up_proj"]
        if ga is None and ua is None:
            continue
        if ga is None or ua is None or gb is None or ub is None or ga.shape != ua.shape or not np.array_equal(ga, ua):
            raise ValueError(f"[{who}] layer {i}: krnl's experts take one LoRA on the fused gate|up (PEFT's "
                             "target_parameters): mlx-lm's gate_proj and up_proj factors must share lora_a")
        out[f"model.layers.{i}.mlp.gate_up_proj.lora_a"] = ga
        out[f"model.layers.{i}.mlp.gate_up_proj.lora_b"] = np.stack([gb, ub])
    return out


def mlx_adapter(lora, tensors, config, base_model=""):
    """({mlx-lm key: float32 array}, adapter_config.json dict) of a LoRA adapter in mlx-lm's layout:
    lora_a = A^T (in, r), lora_b = B^T (r, out), the scale itself in lora_parameters. mlx-lm
    adapts the last num_layers layers: other layer sets have no such layout (a ValueError)."""
    if config.multimodal:
        raise ValueError("[adapter] mlx-lm's layout of a multimodal gemma3 adapter is not written; use the PEFT one")
    n, layers = config.num_hidden_layers, lora.adapted_layers(config)
    if layers != list(range(n - len(layers), n)):
        raise ValueError(f"[adapter] mlx-lm adapts the last num_layers layers of a model; LoRA on layers {layers} of "
                         f"{n} has no mlx-lm layout (adapt layers {n - len(layers)}..{n - 1} instead)")
    out, keys = {}, []
    for m in (m for m in config.lora_modules() if m in lora.target_modules):  # one order, whatever the flag's
        if config.moe and m in EXPERT_MODULES:  # LoRASwitchLinear: (E, r, in) and (E, out, r), as krnl holds them
            halves = ("gate_proj", "up_proj") if m == "gate_up_proj" else ("down_proj",)
            keys += [f"mlp.{switch_module(config)}.{h}" for h in halves]
            for i in layers:
                A, B = (np.asarray(tensors[lora_key(i, m, f)], np.float32) for f in "AB")
                for j, h in enumerate(halves):  # gate and up share PEFT's one A
                    out[f"model.layers.{i}.{keys[j - len(halves)]}.lora_a"] = A
                    out[f"model.layers.{i}.{keys[j - len(halves)]}.lora_b"] = B[j] if B.ndim == 4 else B
            continue
        keys.append(f"{module_part(m)}.{router_module(config) if m == 'router' else m}")
        for i in layers:
            for f in ("A", "B"):
                out[f"model.layers.{i}.{keys[-1]}.lora_{f.lower()}"] = np.asarray(tensors[lora_key(i, m, f)],
                                                                                  np.float32).T
            if lora.use_dora:  # DoRALinear's m
                out[f"model.layers.{i}.{keys[-1]}.m"] = np.asarray(tensors[magnitude_key(i, m)], np.float32)
    cfg = {"fine_tune_type": "dora" if lora.use_dora else "lora", "model": base_model, "num_layers": len(layers),
           "lora_parameters": {"rank": int(lora.r), "scale": float(lora.scale), "dropout": float(lora.dropout),
                               "keys": keys}}
    return out, cfg


def save_mlx_adapter(path, lora, tensors, config, base_model=""):
    """Writes the adapter (PEFT keys, as save_adapter takes them) in mlx-lm's layout into folder
    `path`: adapters.safetensors and adapter_config.json, what mlx-lm's --adapter-path names."""
    from safetensors.numpy import save

    out, cfg = mlx_adapter(lora, tensors, config, base_model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    blob = save({k: np.ascontiguousarray(v) for k, v in out.items()}, metadata={"format": "mlx"})
    atomic_write_bytes(path / MLX_WEIGHTS_NAME, blob)
    atomic_write_bytes(path / CONFIG_NAME, (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode())


# ---------------------------------------------------------------------------------------------
# Adapters made by others: PEFT (safetensors) and mlx-lm layouts, checked against a model config.

# group 4 or 5: the factor (A, B; m, the magnitude: PEFT's key without .weight, older ones' with it)
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                       r"(?:lora_([AB])(?:\.[\w-]+)?\.weight|lora_(m)agnitude_vector(?:\.[\w-]+)?(?:\.weight)?)$")
_MLX_KEY = re.compile(r"^(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(?:lora_([ab])|(m))$")


def _read_f32_tensors(path, who):
    """{name: float32 array} of a safetensors file (F32, F16 and BF16 tensors)."""
    try:
        header, _ = read_safetensors_header(path)
    except ValueError as e:
        raise ValueError(f"[{who}] {e}") from None
    return {k: LazyTensor(str(path), k, dt, shape, b, e).float32().copy() for k, (dt, shape, b, e) in header.items()}


def adapter_format(path):
    """"peft" or "mlx" by the files in folder `path`; refuses pickle-based weights."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"[adapter] {path / CONFIG_NAME} not found ({path} is not a folder)")
    if (path / WEIGHTS_NAME).exists():
        fmt = "peft"
    elif (path / MLX_WEIGHTS_NAME).exists():
        fmt = "mlx"
    elif (path / "adapter_model.bin").exists():
        raise ValueError(f"[adapter] {path / 'adapter_model.bin'} is a pickle file; krnl reads only safetensors "
                         f"(convert it with PEFT: model.save_pretrained(..., safe_serialization=True))")
    else:
        raise ValueError(f"[adapter] {path} holds neither {WEIGHTS_NAME} (PEFT) nor {MLX_WEIGHTS_NAME} (mlx-lm)")
    if not (path / CONFIG_NAME).exists():
        raise ValueError(f"[adapter] {path / CONFIG_NAME} not found")
    return fmt


def read_adapter(path, config):
    """Reads the adapter in folder `path` (PEFT or mlx-lm layout) for a model of ModelConfig
    `config`. Returns (LoraConfig, {krnl/PEFT key: float32 A (r, in) or B (out, r)}, info) where
    info has "format", "base_model" and the raw "config". Adapted modules and layers come from the
    tensors present; names, shapes and the rank are checked and any mismatch is a ValueError that
    lists the offending tensors."""
    path = Path(path)
    fmt = adapter_format(path)
    cfg = read_json_object(path / CONFIG_NAME, "adapter")
    who = f"adapter {path}"
    if fmt == "peft":
        if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
            raise ValueError(f"[{who}] peft_type {cfg.get('peft_type')!r} is not supported; krnl loads LORA adapters")
        if cfg.get("fan_in_fan_out"):
            raise ValueError(f"[{who}] fan_in_fan_out weights (fan_in_fan_out: true) are not supported")
        dora = bool(cfg.get("use_dora", False))
        if cfg.get("bias", "none") not in (None, "none"):
            raise ValueError(f"[{who}] bias {cfg['bias']!r} is not supported (krnl adapters train no biases)")
        if cfg.get("modules_to_save"):
            raise ValueError(f"[{who}] modules_to_save {cfg['modules_to_save']} is not supported")
        for key in ("rank_pattern", "alpha_pattern"):
            if cfg.get(key):
                raise ValueError(f"[{who}] per-module ranks or alphas ({key}) are not supported")
        try:
            r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"[{who}] adapter_config.json needs integer 'r' and numeric 'lora_alpha'") from None
        rslora = bool(cfg.get("use_rslora", False))
        dropout = float(cfg.get("lora_dropout") or 0.0)
        base = cfg.get("base_model_name_or_path")
        raw = _read_f32_tensors(path / WEIGHTS_NAME, who)
        if config.multimodal:
            raw = gemma3.peft_keys_in(raw)
        if config.moe:
            raw = _peft_experts_in(raw, config, cfg, who)
        pattern, fname = _PEFT_KEY, WEIGHTS_NAME
    else:
        ft = cfg.get("fine_tune_type", "lora")
        if ft == "full":  # the trained weights themselves (formats/full_model.py)
            from .full_model import read_full
            base = cfg.get("base_model_name_or_path", cfg.get("model"))
            return (*read_full(path, cfg, config, _read_f32_tensors(path / MLX_WEIGHTS_NAME, who), who),
                    {"format": "mlx", "base_model": base, "config": cfg})
        if ft not in ("lora", "dora"):
            raise ValueError(f"[{who}] mlx-lm fine_tune_type {ft!r} is not supported; krnl loads LoRA, DoRA and "
                             "full fine-tunes")
        dora = ft == "dora"
        lp = cfg.get("lora_parameters")
        if not isinstance(lp, dict) or "rank" not in lp or "scale" not in lp:
            raise ValueError(f"[{who}] adapter_config.json needs lora_parameters with rank and scale (mlx-lm layout)")
        r, scale = int(lp["rank"]), float(lp["scale"])
        if not scale > 0:
            raise ValueError(f"[{who}] lora_parameters.scale must be > 0 for krnl, got {scale}")
        alpha, rslora = scale * r, False  # mlx-lm stores the scale itself: alpha / r = scale
        dropout = float(lp.get("dropout") or 0.0)
        base = cfg.get("model")
        raw = _read_f32_tensors(path / MLX_WEIGHTS_NAME, who)
        if config.moe:
            raw = {k.replace(_router_file(config), ROUTER): v for k, v in _mlx_experts_in(raw, config, who).items()}
        pattern, fname = _MLX_KEY, MLX_WEIGHTS_NAME

    found, unexpected = {}, []
    for k, v in raw.items():
        m = pattern.match(k)
        if not m or m.group(3) not in config.lora_modules() or m.group(2) != module_part(m.group(3)):
            unexpected.append(k)
            continue
        i, mod, fac = int(m.group(1)), m.group(3), (m.group(4) or "M").upper()
        if fmt == "mlx" and v.ndim == 2:
            v = v.T  # mlx-lm: lora_a (in, r), lora_b (r, out); its experts' as krnl holds them
        found.setdefault((i, mod), {})[fac] = (k, np.ascontiguousarray(v, np.float32))
    if unexpected:
        raise ValueError(f"[{who}] {fname} has tensors krnl cannot map to LoRA factors of the "
                         f"{', '.join(config.lora_modules())} projections: {sorted(unexpected)}")
    if not found:
        raise ValueError(f"[{who}] {fname} holds no LoRA tensors")
    n = config.num_hidden_layers
    bad, half = [], []
    for (i, mod), fac in sorted(found.items()):
        if i >= n:
            bad.append(f"layer {i} ({mod}) does not exist in a model of {n} layers")
            continue
        if "M" in fac and not dora:
            bad.append(f"{fac['M'][0]}: a DoRA magnitude, but the config says LoRA (PEFT's use_dora, mlx-lm's "
                       "fine_tune_type dora)")
            continue
        if set(fac) != set("ABM" if dora else "AB"):
            names = {"A": "lora_A", "B": "lora_B", "M": "its DoRA magnitude"}
            half.append(f"layer {i} {mod}: only {', '.join(names[f] for f in sorted(fac))}")
            continue
        want = dict(zip("AB", lora_shapes(config, mod, r)), M=lora_shapes(config, mod, r)[1][:1])
        for f, (k, v) in fac.items():
            if v.shape != want[f]:
                shown = v.shape[::-1] if fmt == "mlx" else v.shape
                exp = want[f][::-1] if fmt == "mlx" else want[f]
                bad.append(f"{k}: {shown} (expected {exp} for r={r})")
    if half:
        bad.append("incomplete modules: " + ", ".join(half))
    if bad:
        raise ValueError(f"[{who}] does not fit the model ({config.source}): " + "; ".join(bad))
    layers = sorted({i for i, _ in found})
    modules = tuple(m for m in config.lora_modules() if any(mm == m for _, mm in found))
    lora = LoraConfig(r=r, alpha=alpha, dropout=dropout, target_modules=modules, use_rslora=rslora,
                      layers=None if layers == list(range(n)) else layers, use_dora=dora)
    lora.validate(config)
    tensors = {}
    for i in lora.adapted_layers(config):
        for mod in modules:
            shapes = lora_shapes(config, mod, r)
            fac = found.get((i, mod))
            if fac is None and dora:  # no magnitude makes the base without the weight's norms
                raise ValueError(f"[{who}] DoRA adapts {mod} in some layers but not in layer {i}; krnl takes a DoRA "
                                 "adapter whose modules are adapted in every layer it adapts")
            # A module this adapter leaves alone in a layer it adapts elsewhere: a zero update.
            tensors[lora_key(i, mod, "A")] = fac["A"][1] if fac else np.zeros(shapes[0], np.float32)
            tensors[lora_key(i, mod, "B")] = fac["B"][1] if fac else np.zeros(shapes[1], np.float32)
            if dora:
                tensors[magnitude_key(i, mod)] = fac["M"][1]
    return lora, tensors, {"format": fmt, "base_model": base, "config": cfg}


def lora_deltas(lora, tensors, config):
    """{weight name (as ModelConfig.weight_shapes lists it): (A, B, DoRA's magnitude or None)} of every
    module the adapter trains: fuse's W + s B A. A mixture's experts come under their fused names
    (mlp.experts.gate_up_proj, down_proj), its router under mlp.gate."""
    out = {}
    for i in lora.adapted_layers(config):
        for m in lora.target_modules:
            if config.moe and m in EXPERT_MODULES:
                name = f"model.layers.{i}.mlp.experts.{m}"
            else:
                w = "gate" if m == "router" else m
                name = f"model.layers.{i}.{module_part(w)}.{w}.weight"
            out[name] = (tensors[lora_key(i, m, "A")], tensors[lora_key(i, m, "B")], tensors.get(magnitude_key(i, m)))
    return out


def load_adapter_into(model, path):
    """Loads the adapter in folder `path` into `model` (a LlamaModel built with the same LoRA
    layout: rank, scale, modules and layers); returns the info dict of read_adapter."""
    lora, tensors, info = read_adapter(path, model.config)
    mine = model.lora_config
    if (lora.r != mine.r or not np.isclose(lora.scale, mine.scale) or set(lora.target_modules) != set(mine.target_modules)
            or lora.adapted_layers(model.config) != mine.adapted_layers(model.config)
            or lora.use_dora != mine.use_dora):
        raise ValueError(f"[adapter {path}] r={lora.r}, scale={lora.scale:g}, modules {sorted(lora.target_modules)}, "
                         f"layers {lora.layers}, use_dora {lora.use_dora} differ from the model's LoRA (r={mine.r}, "
                         f"scale={mine.scale:g}, modules {sorted(mine.target_modules)}, layers {mine.layers}, use_dora "
                         f"{mine.use_dora}); build the model with read_adapter's LoraConfig")
    model.lora_params.load(tensors)
    return info
