"""Hugging Face model folders (docs/architecture.md, 'Models, adapters and data'): `config.json` plus one `model.safetensors` or
shards named by `model.safetensors.index.json`, for the llama, mistral and qwen2 families. A
GGUF file (gguf_file.py) stands wherever a folder does: load_model and load_tokenizer take
either (fuse: gguf_fuse.py).

Weights are mapped to the core as stored ([out, in], no transposes). The safetensors files are
memory-mapped (krnl.safetensors_io), so a tensor is read from disk only when it is uploaded; the
model converts every tensor to its compute dtype on upload.

`fuse` merges a LoRA adapter into the base weights, W' = W + s B A (float32 math, stored back in
each tensor's original dtype), and writes an HF folder that transformers loads: sharded
safetensors with an index, config.json and the tokenizer files.
"""

import json
from pathlib import Path

import numpy as np

from .adapter import read_adapter
from .fileio import atomic_write_bytes, atomic_write_chunks, read_json_object
from .gguf_file import is_gguf, read_gguf
from .gguf_tokenizer import load_gguf_tokenizer
from .model import ATTN_MODULES, LlamaModel, ModelConfig, lora_key
from .qweight import QuantizedArray
from .safetensors_io import LazyTensor, encode, header_bytes, nbytes, read_safetensors_header
from .tokenizer import Tokenizer
# Defined here before safetensors_io.py took the format; krnl.hf.bf16_to_f32 and friends stay.
from .safetensors_io import bf16_to_f32, f32_to_bf16  # noqa: F401

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")

_FLOAT_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


# ---------------------------------------------------------------------------------------------
# HF folders: the weight files and their tensors


def safetensors_files(folder):
    """The weight files of an HF folder, with the tensor names each holds (from the index)."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"[hf] {index}: malformed index ({e})") from None
        files = sorted(set(wm.values()))
        missing = [f for f in files if not (folder / f).exists()]
        if missing:
            raise ValueError(f"[hf] {index} names shard(s) that are not in the folder: {missing}")
        return [folder / f for f in files]
    single = folder / SINGLE_NAME
    if single.exists():
        return [single]
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        return [folder / f for f in others]
    bins = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if bins:
        raise ValueError(f"[hf] {folder} holds only pickle-based weights ({', '.join(bins)}); krnl reads only "
                         "safetensors (re-save with transformers: model.save_pretrained(dir, safe_serialization=True))")
    raise ValueError(f"[hf] {folder} has no {SINGLE_NAME} nor {INDEX_NAME}")


def read_tensors(folder):
    """{name: LazyTensor} over every safetensors file of the folder (nothing is read yet)."""
    out = {}
    for f in safetensors_files(folder):
        header, _ = read_safetensors_header(f)
        for name, (dt, shape, b, e) in header.items():
            if name in out:
                raise ValueError(f"[hf] tensor {name!r} appears in both {out[name].path} and {f}")
            out[name] = LazyTensor(str(f), name, dt, shape, b, e)
    return out


# ---------------------------------------------------------------------------------------------
# config and weights


def read_config(folder):
    """ModelConfig from folder/config.json (transformers 4 `rope_theta`/`rope_scaling` or
    transformers 5 `rope_parameters`)."""
    path = Path(folder) / CONFIG_NAME
    if not Path(folder).is_dir():
        raise ValueError(f"[hf] {folder} is not a folder")
    return ModelConfig.from_dict(normalize_config(read_json_object(path, "hf")), source=str(path))


def normalize_config(d):
    if not isinstance(d, dict):
        return d
    d = dict(d)
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        if d.get("rope_theta") is None:
            d["rope_theta"] = rp["rope_theta"]
        if rp.get("rope_type", rp.get("type")) not in (None, "default") and d.get("rope_scaling") is None:
            d["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    return d


def load_hf_weights(folder, config=None):
    """{HF name: LazyTensor} of the weights `config` needs (read_config(folder) when None), checked:
    a ValueError lists missing and unexpected tensors and wrong shapes, naming the files. The values
    work as arrays (np.asarray(w, np.float32)); each is read from its memory map on first use."""
    folder = Path(folder)
    config = read_config(folder) if config is None else config
    tensors = read_tensors(folder)
    want = config.weight_shapes()
    # Buffers some exporters keep (not weights).
    ignored = [k for k in tensors if k.endswith(".rotary_emb.inv_freq")]
    if config.tie_word_embeddings and "lm_head.weight" in tensors:
        ignored.append("lm_head.weight")  # tied checkpoints may store it; the embedding is used
    for k in ignored:
        tensors.pop(k)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    bad = [f"{k}: {tensors[k].shape} (expected {tuple(want[k])})" for k in sorted(set(want) & set(tensors))
           if tensors[k].shape != tuple(want[k])]
    msgs = []
    if missing:
        msgs.append(f"missing tensors {missing}")
    if unexpected:
        hint = ""
        if any(".lora_" in k for k in unexpected):
            hint = " (LoRA tensors: this looks like an adapter, not a base model)"
        msgs.append(f"unexpected tensors {unexpected}{hint}")
    if bad:
        msgs.append(f"wrong shapes {bad}")
    if msgs:
        files = ", ".join(sorted({Path(t.path).name for t in tensors.values()})) or "no tensors"
        raise ValueError(f"[hf] {folder} ({files}) does not match its config ({config.model_type}, "
                         f"{config.num_hidden_layers} layers): " + "; ".join(msgs))
    return tensors


def load_tokenizer(path):
    """The Tokenizer of an HF folder or of a GGUF file."""
    return load_gguf_tokenizer(path) if is_gguf(path) else Tokenizer.from_folder(path)


def load_model(folder, device, lora=None, dtype="f32", seed=0, grad_checkpoint=False, adapter=None, **kw):
    """A LlamaModel from an HF folder or a GGUF file (its quantized weights held as the file has
    them). `adapter`: an adapter folder (PEFT or mlx-lm layout) whose LoRA config and weights are
    loaded (then `lora` must be None)."""
    if is_gguf(folder):
        g = read_gguf(folder)
        config, weights = g.config, g.weights
        held = [w for w in weights.values() if isinstance(w, QuantizedArray)]
        if held and kw.get("quantize") is not None:
            raise ValueError(f"[gguf] {folder} holds quantized tensors ({len(held)}); leave out --quantize")
    else:
        config = read_config(folder)
        weights = load_hf_weights(folder, config)
    tensors = None
    if adapter is not None:
        if lora is not None:
            raise ValueError("[hf] pass either lora or adapter, not both")
        lora, tensors, _ = read_adapter(adapter, config)
    model = LlamaModel(device, config, weights, lora=lora, dtype=dtype, seed=seed, grad_checkpoint=grad_checkpoint,
                       **kw)
    if tensors is not None:
        model.lora_params.load(tensors)
    return model


# ---------------------------------------------------------------------------------------------
# safetensors, write side and fuse


def _parse_size(s):
    if isinstance(s, (int, np.integer)):
        return int(s)
    t = str(s).strip().upper()
    for suf, mul in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6),
                     ("KB", 10**3), ("B", 1)):
        if t.endswith(suf):
            return int(float(t[:-len(suf)]) * mul)
    return int(t)


def write_sharded(out_folder, items, shard_size="2GB", metadata=None):
    """Writes [(name, st_dtype, shape, producer)] (producer() -> bytes, called once, in order) as
    model.safetensors, or model-0000i-of-0000n.safetensors shards plus the index when they exceed
    shard_size bytes. Each file is written atomically. Returns the file names."""
    out_folder = Path(out_folder)
    limit = max(1, _parse_size(shard_size))
    shards, cur, cur_size = [], [], 0
    for it in items:
        nb = nbytes(it[1], it[2])
        if cur and cur_size + nb > limit:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append((*it, nb))
        cur_size += nb
    if cur or not shards:
        shards.append(cur)
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    meta = {"format": "pt", **(metadata or {})}
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        header = header_bytes([(nm, dt, sh, nb) for nm, dt, sh, _, nb in shard], meta)

        def chunks(shard=shard, header=header):
            yield header
            for nm, dt, sh, producer, nb in shard:
                b = producer()
                if len(b) != nb:
                    raise RuntimeError(f"[hf] {nm}: produced {len(b)} bytes, expected {nb}")
                yield b

        atomic_write_chunks(out_folder / fname, chunks())
        for nm, _, _, _, nb in shard:
            weight_map[nm] = fname
            total += nb
    index = out_folder / INDEX_NAME
    if n > 1:
        atomic_write_bytes(index, (json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2, sort_keys=True) + "\n").encode())
    # Weight files of an earlier write into the same folder would shadow or confuse this one.
    stale = [index] if n == 1 else [out_folder / SINGLE_NAME]
    stale += [p for p in out_folder.glob("model-*-of-*.safetensors") if p.name not in names]
    for p in stale:
        if p.exists():
            p.unlink()
    return names


def merged_weight(W32, A, B, scale):
    """W + s B A in float32."""
    return (np.asarray(W32, np.float32) + np.float32(scale) * (np.asarray(B, np.float32) @ np.asarray(A, np.float32))
            ).astype(np.float32)


def fuse(model_folder, adapter_folder, out_folder, shard_size="2GB", dtype=None):
    """Merges the adapter at `adapter_folder` (PEFT or mlx-lm layout) into the HF model at
    `model_folder` and writes the result to `out_folder`. Tensors keep their stored dtype
    (f32, f16 or bf16) unless dtype ("f32", "f16", "bf16") is given. Returns a summary dict."""
    model_folder, out_folder = Path(model_folder), Path(out_folder)
    if out_folder.resolve() == model_folder.resolve():
        raise ValueError(f"[fuse] the output folder must differ from the model folder {model_folder}")
    config = read_config(model_folder)
    weights = load_hf_weights(model_folder, config)
    lora, tensors, _ = read_adapter(adapter_folder, config)
    force = {None: None, "f32": "F32", "f16": "F16", "bf16": "BF16"}[dtype]
    s = lora.scale
    delta = {}
    for i in lora.adapted_layers(config):
        for m in lora.target_modules:
            part = "self_attn" if m in ATTN_MODULES else "mlp"
            delta[f"model.layers.{i}.{part}.{m}.weight"] = (tensors[lora_key(i, m, "A")], tensors[lora_key(i, m, "B")])

    def producer(name, t, st):
        def make():
            if name in delta:
                A, B = delta[name]
                return encode(merged_weight(t.float32(), A, B, s), st)
            if st == t.st_dtype:
                return t.raw_bytes()
            return encode(t.float32(), st)
        return make

    # Keep the checkpoint's order: embeddings, layers in order, norm, head.
    order = sorted(weights, key=_weight_order)
    items = []
    for name in order:
        t = weights[name]
        st = force or t.st_dtype
        items.append((name, st, t.shape, producer(name, t, st)))
    files = write_sharded(out_folder, items, shard_size=shard_size)
    cfg = json.loads((model_folder / CONFIG_NAME).read_text(encoding="utf-8"))
    if force:
        cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] = _FLOAT_NAMES[force]
    atomic_write_bytes(out_folder / CONFIG_NAME, (json.dumps(cfg, indent=2) + "\n").encode())
    copied = []
    for fn in TOKENIZER_FILES:
        src = model_folder / fn
        if src.is_file():
            atomic_write_bytes(out_folder / fn, src.read_bytes())
            copied.append(fn)
    return {"files": files, "merged": sorted(delta), "copied": copied, "scale": s}


def _weight_order(name):
    parts = name.split(".")
    if name.startswith("model.embed_tokens"):
        return (0, 0, name)
    if name.startswith("model.layers."):
        return (1, int(parts[2]), name)
    if name.startswith("model.norm"):
        return (2, 0, name)
    return (3, 0, name)
