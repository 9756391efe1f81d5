"""Hugging Face model folders (docs/architecture.md, 'Models, adapters and data'): `config.json` plus one `model.safetensors` or
shards named by `model.safetensors.index.json`, for the llama, mistral, qwen2, qwen3, phi3, gemma2
and gemma3_text families. A GGUF file (formats/gguf/file.py) stands wherever a folder does: load_model
and load_tokenizer take either (fuse: gguf/fuse.py).

Weights are mapped to the core as stored ([out, in], no transposes). The safetensors files are
memory-mapped (krnl.io.safetensors_io), so a tensor is read from disk only when it is uploaded; the
model converts every tensor to its compute dtype on upload.

An MLX quantized folder (krnl.formats.mlx_folder) is an HF folder whose config has `quantization`: its
quantized modules come back as QuantizedArray values under their `.weight` names.

`fuse` merges a LoRA adapter into the base weights, W' = W + s B A (float32 math, stored back in
each tensor's original dtype, bf16 for a quantized base), and writes an HF folder that
transformers loads: sharded safetensors with an index, config.json and the tokenizer files; or,
with `quantize`, an MLX quantized folder, which `quantize_folder` writes from a float HF folder.
"""

import json
from pathlib import Path

import numpy as np

from ..models import gemma3
from .adapter import lora_deltas, read_adapter
from ..io.fileio import atomic_write_bytes, atomic_write_chunks, read_json_object
from .mlx_folder import mlx_items, model_dtype, quantization, read_quantized, recipe_overrides
from .gguf.file import is_gguf, read_gguf
from .gguf.tokenizer import load_gguf_tokenizer
from ..models.model import LlamaModel
from ..models.config import ModelConfig
from .experts import (Pieces, StackedTensor, expert_pieces, merged_experts, stacked_experts, stored_name,
                      switch_experts)
from . import gpt_oss
from ..quant.qweight import QuantizedArray, quantize_spec
from ..io.safetensors_io import LazyTensor, encode, header_bytes, nbytes, read_safetensors_header
from ..io.tokenizer import Tokenizer
# Defined here before safetensors_io.py took the format; krnl.formats.hf.bf16_to_f32 and friends stay.
from ..io.safetensors_io import bf16_to_f32, f32_to_bf16  # noqa: F401

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
    work as arrays (np.asarray(w, np.float32)); each is read from its memory map on first use. In
    an MLX quantized folder the modules stored quantized are QuantizedArray values (shape (O, I))."""
    folder = Path(folder)
    config = read_config(folder) if config is None else config
    tensors = read_tensors(folder)
    if config.multimodal:  # the text tower, named as Gemma3ForCausalLM's; the vision tower ignored
        tensors = gemma3.text_tower(tensors)[0]
    want = config.weight_shapes()
    # Buffers some exporters keep (not weights).
    ignored = [k for k in tensors if k.endswith(".rotary_emb.inv_freq")]
    if config.tie_word_embeddings:  # tied checkpoints may store a head; the embedding is used
        ignored += [k for k in ("lm_head.weight", "lm_head.scales", "lm_head.biases") if k in tensors]
    for k in ignored:
        tensors.pop(k)
    tensors = stacked_experts(tensors, config)  # per-expert checkpoints read as transformers holds them
    tensors = gpt_oss.read_experts(tensors, config)
    tensors = switch_experts(tensors, config, folder)  # mlx-lm's, float or quantized
    q = quantization(read_json_object(folder / CONFIG_NAME, "hf"), str(folder / CONFIG_NAME))
    if q is not None:
        read_quantized(tensors, config, q, folder)
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
        paths = {(t.w if isinstance(t, QuantizedArray) else t).path for t in tensors.values()}
        files = ", ".join(sorted(Path(p).name for p in paths)) or "no tensors"
        raise ValueError(f"[hf] {folder} ({files}) does not match its config ({config.model_type}, "
                         f"{config.num_hidden_layers} layers): " + "; ".join(msgs))
    return tensors


def load_tokenizer(path):
    """The Tokenizer of an HF folder or of a GGUF file."""
    return load_gguf_tokenizer(path) if is_gguf(path) else Tokenizer.from_folder(path)


def read_base(folder):
    """(ModelConfig, {HF name: weight}) of an HF or MLX quantized folder, or a GGUF file."""
    if is_gguf(folder):
        g = read_gguf(folder)
        return g.config, g.weights
    config = read_config(folder)
    return config, load_hf_weights(folder, config)


def load_model(folder, device, lora=None, dtype="f32", seed=0, grad_checkpoint=False, adapter=None, **kw):
    """A LlamaModel from an HF or MLX quantized folder, or a GGUF file (quantized weights held as
    the file has them). `adapter`: an adapter folder (PEFT or mlx-lm layout) whose LoRA config and
    weights are loaded (then `lora` must be None)."""
    config, weights = read_base(folder)
    held = [w for w in weights.values() if isinstance(w, QuantizedArray)]
    if held and kw.get("quantize") is not None:
        raise ValueError(f"[hf] {folder} is quantized already ({held[0].bits} bits, groups of {held[0].group_size}); "
                         f"leave out --q-bits")
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


def merged_weight(W32, A, B, m, scale):
    """W + s B A in float32 (a mixture's experts (E, out, in): each expert's own factors); with DoRA's
    magnitude m (out,) (None: LoRA), each row o of it times m_o over its norm (PEFT's and mlx-lm's merge)."""
    if np.ndim(W32) == 3:
        return merged_experts(np.asarray(W32, np.float32), A, B, scale)
    W = (np.asarray(W32, np.float32) + np.float32(scale) * (np.asarray(B, np.float32) @ np.asarray(A, np.float32))
         ).astype(np.float32)
    if m is None:
        return W
    norm = np.sqrt(np.sum(np.square(W, dtype=np.float64), axis=1))
    return (W * (np.asarray(m, np.float64) / norm)[:, None]).astype(np.float32)


def fuse(model_folder, adapter_folder, out_folder, shard_size="2GB", dtype=None, quantize=None):
    """Merges the adapter at `adapter_folder` (PEFT or mlx-lm layout) into the model at
    `model_folder` (an HF or MLX quantized folder) and writes the result to `out_folder`: an HF
    folder whose tensors keep their stored dtype (f32, f16 or bf16; bf16 for quantized ones)
    unless dtype ("f32", "f16", "bf16") is given; or, with quantize = (bits, group_size), an MLX
    folder (W + s B A in float32, then quantized). Returns a summary dict."""
    lora, tensors, _ = read_adapter(adapter_folder, read_config(model_folder))
    if lora.full:  # the trained weights replace the base's
        from .full_model import stored
        new = lambda config, weights: {k: lambda a=a: a for k, a in stored(config, tensors).items()}  # noqa: E731
    else:
        new = lambda config, weights: {k: lambda t=weights[k], d=d: merged_weight(t, *d, lora.scale)  # noqa: E731
                                       for k, d in lora_deltas(lora, tensors, config).items()}
    return {**write_model(model_folder, out_folder, new, shard_size, dtype, quantize), "scale": lora.scale}


def write_model(model_folder, out_folder, replaced, shard_size="2GB", dtype=None, quantize=None):
    """The model at `model_folder` written to `out_folder` as fuse() writes it, with the weights
    replaced(config, weights) gives ({HF name: () -> float32 array}) in place of the stored ones."""
    model_folder, out_folder = Path(model_folder), Path(out_folder)
    if out_folder.resolve() == model_folder.resolve():
        raise ValueError(f"[fuse] the output folder must differ from the model folder {model_folder}")
    config = read_config(model_folder)
    weights = load_hf_weights(model_folder, config)
    new = replaced(config, weights)
    if config.multimodal:  # written back under the stored names, the vision tower copied through
        if quantize is not None:
            raise ValueError(f"[fuse] {model_folder} is a multimodal gemma3 model; fuse it without --q-bits")
        _, names, rest = gemma3.text_tower(read_tensors(model_folder))
        weights = {**{names[k]: t for k, t in weights.items()}, **rest}
        new = {names[k]: f for k, f in new.items()}
    files = _write_folder(model_folder, weights, config, out_folder, shard_size, dtype, quantize, new)
    return {"files": files, "merged": sorted(new), "copied": _copy_tokenizer(model_folder, out_folder)}


def quantize_folder(model_folder, out_folder, bits=4, group_size=64, dtype=None, shard_size="2GB",
                    overrides=None, recipe=None, mode="affine"):
    """Writes the float HF folder at `model_folder` as an MLX quantized folder, as `mlx_lm.convert
    -q [--q-mode mode]` does: the linears and the embedding whose input size is a multiple of
    group_size quantized (`overrides` {module path: (bits, group_size) or None} for single modules,
    or one of mlx-lm's mixed `recipe`s, which sets the bits), the rest and the scales in dtype (the
    config's torch_dtype when None); mode "mxfp4" takes 4 bits in groups of 32. Returns a summary dict."""
    model_folder, out_folder = Path(model_folder), Path(out_folder)
    if out_folder.resolve() == model_folder.resolve():
        raise ValueError(f"[quantize] the output folder must differ from the model folder {model_folder}")
    config = read_config(model_folder)
    weights = load_hf_weights(model_folder, config)
    held = [w for w in weights.values() if isinstance(w, QuantizedArray)]
    if held:
        raise ValueError(f"[quantize] {model_folder} is quantized already ({held[0].bits} bits, groups of "
                         f"{held[0].group_size}); krnl quantize reads float HF folders")
    if recipe is not None:
        if mode != "affine":
            raise ValueError(f"[quantize] mlx-lm's recipe {recipe} is affine; it takes no --q-mode {mode}")
        bits, overrides = recipe_overrides(config, recipe, group_size)
    files = _write_folder(model_folder, weights, config, out_folder, shard_size, dtype,
                          quantize_spec((bits, group_size, mode)), overrides=overrides)
    return {"files": files, "copied": _copy_tokenizer(model_folder, out_folder)}


def _write_folder(model_folder, weights, config, out_folder, shard_size, dtype, quantize, merged=None,
                  overrides=None):
    """Writes weights (merged {name: () -> float32} replacing some) and config.json to out_folder:
    an HF folder, or an MLX quantized one when quantize = (bits, group_size)."""
    merged = merged or {}
    cfg = read_json_object(model_folder / CONFIG_NAME, "hf")
    for k in ("quantization", "quantization_config"):
        cfg.pop(k, None)
    # Keep the checkpoint's order: embeddings, layers in order, norm, head.
    order = sorted(weights, key=_weight_order)
    if quantize is not None:
        dt = dtype or model_dtype(cfg, weights)
        items, cfg["quantization"] = mlx_items(config, weights, order, *quantize[:2], dt, merged, overrides,
                                               *quantize[2:])
        cfg["quantization_config"] = cfg["quantization"]
        meta, force = {"format": "mlx"}, {"f32": "F32", "f16": "F16", "bf16": "BF16"}[dt]
    else:
        force = {None: None, "f32": "F32", "f16": "F16", "bf16": "BF16"}[dtype]
        if force is None and any(isinstance(t, QuantizedArray) for t in weights.values()):
            force = "BF16"  # a dequantized base: bf16 as MLX computes it, not f32 twice the size
        items, meta = [], None
        for name in order:
            t = weights[name]
            st = force or t.st_dtype
            get = merged.get(name) or (lambda t=t: np.asarray(t, np.float32))
            if isinstance(t, StackedTensor):  # experts read per expert are written back per expert
                pieces = Pieces(get, lambda a, name=name: [x for _, x in expert_pieces(config, name, a)])
                shapes = expert_pieces(config, name, np.broadcast_to(np.float32(0), t.shape))
                items += [(k, st, a.shape, lambda p=pieces, j=j, st=st: encode(p.take(j), st))
                          for j, (k, a) in enumerate(shapes)]
                continue
            # gpt-oss's router and experts go back in transformers' layout (formats/gpt_oss.py)
            sname, shape, relay = gpt_oss.stored_layout(config, name, t.shape) or (
                stored_name(config, weights, name), tuple(t.shape), None)
            keep = name not in merged and getattr(t, "st_dtype", None) == st  # the stored bytes as they are
            if keep and hasattr(t, "src"):
                t = t.src  # a Relaid's stored tensor
            producer = t.raw_bytes if keep else (lambda get=get, st=st, f=relay or (lambda a: a): encode(f(get()), st))
            items.append((sname, st, shape, producer))
    files = write_sharded(out_folder, items, shard_size=shard_size, metadata=meta)
    if force:
        cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] = _FLOAT_NAMES[force]
    atomic_write_bytes(out_folder / CONFIG_NAME, (json.dumps(cfg, indent=2) + "\n").encode())
    return files


def _copy_tokenizer(model_folder, out_folder):
    copied = []
    for fn in TOKENIZER_FILES:
        src = model_folder / fn
        if src.is_file():
            atomic_write_bytes(out_folder / fn, src.read_bytes())
            copied.append(fn)
    return copied


def _weight_order(name):
    parts = name.split(".")
    if name.startswith("model.embed_tokens"):
        return (0, 0, name)
    if name.startswith("model.layers."):
        return (1, int(parts[2]), name)
    if name.startswith("model.norm"):
        return (2, 0, name)
    return (3, 0, name)
