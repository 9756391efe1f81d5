"""LoRA adapters in PEFT's on-disk format (DESIGN section 8): `adapter_config.json` and
`adapter_model.safetensors` with keys `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`,
A (r, in) and B (out, r), so PEFT, transformers and vLLM load them unchanged. Files are written
atomically (temporary file in the same folder, fsync, rename)."""

import json
import os
import tempfile
from pathlib import Path

import numpy as np

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def atomic_write_bytes(path, data):
    """Replaces `path` with `data` so a reader sees the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def peft_config(lora, base_model="", layers=None):
    """adapter_config.json contents for a LoraConfig-like object."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(lora.r),
        "lora_alpha": float(lora.alpha),
        "lora_dropout": float(lora.dropout),
        "target_modules": sorted(lora.target_modules),
        "use_rslora": bool(lora.use_rslora),
        "layers_to_transform": None if layers is None else [int(i) for i in layers],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def save_adapter(path, tensors, config):
    """Writes {PEFT key: float32 array} and the config dict into folder `path`."""
    from safetensors.numpy import save

    path = Path(path)
    blob = save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
                metadata={"format": "pt"})
    atomic_write_bytes(path / WEIGHTS_NAME, blob)  # weights first: the config names a complete set
    atomic_write_bytes(path / CONFIG_NAME, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def load_adapter(path):
    """(tensors, config) from a PEFT adapter folder; refuses pickle-based .bin weights."""
    from safetensors.numpy import load_file

    path = Path(path)
    cfg_path, w_path = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not cfg_path.exists():
        raise ValueError(f"[load_adapter] {cfg_path} not found")
    if not w_path.exists():
        if (path / "adapter_model.bin").exists():
            raise ValueError(f"[load_adapter] {path / 'adapter_model.bin'} is a pickle file; krnl reads only "
                             f"safetensors (convert it with PEFT: model.save_pretrained(..., safe_serialization=True))")
        raise ValueError(f"[load_adapter] {w_path} not found")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"[load_adapter] {cfg_path}:{e.lineno}: {e.msg}") from None
    try:
        tensors = load_file(str(w_path))
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise ValueError(f"[load_adapter] {w_path} is not a valid safetensors file: {e}") from None
    return tensors, config
