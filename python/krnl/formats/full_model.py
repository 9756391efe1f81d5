"""A full fine-tune's files (--fine-tune-type full) in its --adapter-path:

- `adapters.safetensors` (the trained weights under their stored HF names, in the base's stored
  dtype) and `adapter_config.json` with mlx-lm's `fine_tune_type: full`: mlx-lm's own layout of a
  full fine-tune, which `mlx_lm.generate --model BASE --adapter-path RUN` loads, and krnl's eval,
  generate and fuse read (read_full) as they read an adapter;
- `model/`, the whole fine-tuned model as an HF folder (config, weights, tokenizer) that
  transformers and mlx-lm load as they load the base, written where the base is an HF folder.

This module reads them and names their tensors; full_save.py writes them.

phi3's fused projections are stored fused (qkv_proj, gate_up_proj) as its checkpoints hold them;
the model trains their members."""

import numpy as np

from ..models.config import ALL_MODULES, LoraConfig
from ..models.full import full_param_shapes
from ..models.phi3 import FUSED

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapters.safetensors"  # mlx-lm's name
MODEL_SUBFOLDER = "model"


def stored(config, state):
    """{stored HF name: float32 array} of a full fine-tune's trained tensors {model name: array}:
    phi3's members joined into their fused projection."""
    if not config.fused_projections:
        return dict(state)
    out = dict(state)
    for k in list(state):
        head, _, tail = k.rpartition(".")  # model.layers.i.part.module, weight
        part, module = head.rsplit(".", 1)
        fused = next((f for f, ms in FUSED.items() if ms[0] == module), None)
        if fused is not None:
            members = [f"{part}.{m}.{tail}" for m in FUSED[fused]]
            out[f"{part}.{fused}.{tail}"] = np.concatenate([out.pop(n) for n in members])
    return out


def split(config, tensors):
    """stored()'s inverse: the fused projections of phi3 in their members' rows."""
    if not config.fused_projections:
        return dict(tensors)
    out = dict(tensors)
    for k in list(tensors):
        head, _, tail = k.rpartition(".")
        part, module = head.rsplit(".", 1)
        if module in FUSED:
            a, r0 = out.pop(k), 0
            for m in FUSED[module]:
                n = config.module_shape(m)[0]
                out[f"{part}.{m}.{tail}"], r0 = a[r0:r0 + n], r0 + n
    return out


def full_config(lora, config, base_model):
    """adapter_config.json of a full fine-tune: mlx-lm's keys (fine_tune_type, num_layers, model)
    and krnl's (the base, the trained layers and modules)."""
    layers = lora.adapted_layers(config)
    return {"fine_tune_type": "full", "model": base_model, "base_model_name_or_path": base_model,
            "num_layers": len(layers), "layers": layers, "target_modules": list(lora.target_modules),
            "train_embeddings": bool(lora.train_embeddings)}


def read_full(path, cfg, config, raw, who):
    """(LoraConfig(full=True), {model name: float32 array}) of the full fine-tune in folder `path`
    (cfg its adapter_config.json, raw its adapters.safetensors) for a model of `config`. What
    trained comes from the tensors present (mlx-lm's config names only num_layers): their layers,
    their projections, the embeddings; the layers' norms must be there too."""
    tensors = split(config, raw)
    parts = [k.split(".") for k in tensors if k.startswith("model.layers.")]
    layers = sorted({int(p[2]) for p in parts if p[2].isdigit()})
    mods = tuple(m for m in ALL_MODULES if any(k.endswith(f".{m}.weight") for k in tensors))
    lora = LoraConfig(full=True, target_modules=mods, layers=layers,
                      train_embeddings="model.embed_tokens.weight" in tensors)
    try:
        lora.validate(config)
    except ValueError as e:
        raise ValueError(f"[{who}] {e}") from None
    if lora.layers is not None and sorted(lora.layers) == list(range(config.num_hidden_layers)):
        lora.layers = None
    want = full_param_shapes(config, lora)[0]
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    bad = [f"{k}: {tensors[k].shape} (expected {want[k]})" for k in want if k in tensors
           and tuple(tensors[k].shape) != tuple(want[k])]
    if missing or extra or bad:
        raise ValueError(f"[{who}] {WEIGHTS_NAME} does not fit its adapter_config.json and the model "
                         f"({config.source}): " + "; ".join(
                             p for p in (missing and f"missing {missing}", extra and f"unexpected {extra}",
                                         bad and f"wrong shapes {bad}") if p))
    return lora, {k: np.ascontiguousarray(tensors[k], np.float32) for k in want}
