"""`krnl fuse` on a GGUF base (docs/architecture.md, 'GGUF files'): every weight dequantized
(exactly, to float32), the adapter merged as hf.fuse merges it, W' = W + s B A, and an HF folder
written that transformers and krnl load: safetensors in bf16 unless dtype says otherwise,
config.json from the file's metadata, and the file's tokenizer as tokenizer.json and
tokenizer_config.json (chat template included)."""

import json
import tempfile
from pathlib import Path

import numpy as np

from ..adapter import lora_deltas, read_adapter
from ...io.fileio import atomic_write_bytes
from .file import read_gguf
from .tokenizer import build_tokenizer, tokenizer_files
from ..hf import _FLOAT_NAMES, CONFIG_NAME, _weight_order, merged_weight, quantize_folder, write_sharded
from .. import gpt_oss
from ...io.safetensors_io import encode


def fuse_gguf(path, adapter_folder, out_folder, shard_size="2GB", dtype=None, quantize=None):
    """Merges the adapter at `adapter_folder` into the GGUF model at `path` and writes an HF folder
    to `out_folder` (dtype "f32", "f16" or "bf16"; bf16 when None), or with quantize = (bits,
    group_size) an MLX folder quantized from that HF folder (written beside the output, then
    removed). Returns hf.fuse's summary."""
    if quantize is not None:
        out = Path(out_folder)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".krnl-fuse-", dir=out.parent) as tmp:
            info = fuse_gguf(path, adapter_folder, tmp, shard_size=shard_size, dtype=dtype)
            q = quantize_folder(tmp, out, quantize[0], quantize[1], dtype=dtype, shard_size=shard_size,
                                mode=(*quantize[2:], "affine")[0])
        return {**info, "files": q["files"], "copied": q.get("copied", info["copied"])}
    out_folder = Path(out_folder)
    if out_folder.exists() and not out_folder.is_dir():
        raise ValueError(f"[fuse] {out_folder} is a file; the output must be a folder")
    g = read_gguf(path)
    st = {None: "BF16", "f32": "F32", "f16": "F16", "bf16": "BF16"}[dtype]
    lora, tensors, _ = read_adapter(adapter_folder, g.config)
    if lora.full:
        raise ValueError(f"[fuse] {adapter_folder} is a full fine-tune, trained on an HF folder; fuse it with that "
                         f"folder (--model), not {path}")
    s, delta = lora.scale, lora_deltas(lora, tensors, g.config)

    def item(name, w, shape):
        # gpt-oss goes out in transformers' layout (formats/gpt_oss.py)
        out, out_shape, relay = gpt_oss.stored_layout(g.config, name, shape) or (
            name, tuple(shape), lambda a: a)

        def make():  # called once, in order, by write_sharded: one weight in memory at a time
            if name in delta:
                return encode(relay(merged_weight(w, *delta[name], s)), st)
            return encode(relay(np.asarray(w, np.float32)), st)
        return out, st, out_shape, make

    shapes = g.config.weight_shapes()
    items = [item(n, g.weights[n], shapes[n]) for n in sorted(g.weights, key=_weight_order)]
    files = write_sharded(out_folder, items, shard_size=shard_size)
    cfg = {**g.hf_config, "torch_dtype": _FLOAT_NAMES[st]}
    atomic_write_bytes(out_folder / CONFIG_NAME, (json.dumps(cfg, indent=2) + "\n").encode())
    tk_files = tokenizer_files(*build_tokenizer(g.metadata, source=str(path)))
    for fn, data in tk_files.items():
        atomic_write_bytes(out_folder / fn, data)
    return {"files": files, "merged": sorted(delta), "copied": sorted(tk_files), "scale": s}
