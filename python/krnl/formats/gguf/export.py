"""`krnl fuse --export-gguf`: an adapter merged into its base (an HF or MLX quantized folder, or a GGUF
file; W + s B A in float32 from the dequantized base, as hf.fuse merges) and written as one GGUF file
that llama.cpp, Ollama and LM Studio load (docs/architecture.md, 'GGUF files'):

- tensors under llama.cpp's names and layouts (names.py: q/k rows permuted for the llama
  architecture, Gemma's norms as 1 + w, a mixture's fused gate|up split into ffn_gate_exps and
  ffn_up_exps, Phi-3's fused projections as attn_qkv and ffn_up), in the types mix.py picks for
  --gguf-type; quantized (quant/ggml_write.py) from the f16-rounded weights, as llama-quantize
  reads the f16 file, so that a quantized export's tensors are those it makes of the f16 export;
- the configuration as `{arch}.*` metadata (meta.py), the tokenizer and chat template (vocab.py);
- written through a temporary file in the output's folder, then renamed (the user's umask);
- with `ollama`, an Ollama Modelfile beside it (ollama.py).

Tensors are merged, quantized and written one at a time: memory holds one weight, not the model.
A multimodal gemma3 base exports its text tower (llama.cpp keeps the vision tower in a separate
mmproj file, which krnl does not write)."""

import sys
from pathlib import Path

import numpy as np

from ..adapter import lora_deltas, read_adapter
from ..hf import load_tokenizer, merged_weight, read_base
from ...io.fileio import atomic_path
from ...quant.ggml_write import encode
from .meta import arch_metadata, check_supported, notes, rope_tensors
from .mix import GGUF_TYPES, tensor_type
from .names import EXPORT_ARCH, NORM_SHIFT, gguf_name, permute, permuted_heads
from .ollama import write_modelfile
from .vocab import tokenizer_metadata

QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION: the block layouts of current llama.cpp


def load_source(base, adapter_folder=None):
    """(ModelConfig, {HF name: weight}, Tokenizer, {name: (A, B, DoRA magnitude or None)}, scale) of a base and an adapter
    (None: the base alone)."""
    config, weights = read_base(base)
    deltas, scale = {}, 0.0
    if adapter_folder is not None:
        lora, tensors, _ = read_adapter(adapter_folder, config)
        if lora.full:  # the trained weights in place of the base's
            from ..full_model import stored
            weights = {**weights, **stored(config, tensors)}
        else:
            deltas, scale = lora_deltas(lora, tensors, config), lora.scale
    return config, weights, load_tokenizer(base), deltas, scale


def _pieces(name, shape):
    """[(name to map to GGUF, shape, rows)] of one krnl weight: a mixture's experts under mlx-lm's
    switch_mlp names, the fused gate|up in its halves (rows: the slice of axis -2 it takes)."""
    expert = name.rsplit(".mlp.experts.", 1)
    if len(expert) == 1:
        return [(name, tuple(shape), None)]
    prefix, what = expert[0] + ".mlp.switch_mlp.", expert[1]
    suffix = ".bias" if what.endswith("_bias") else ".weight"
    if what.startswith("down_proj"):
        return [(prefix + "down_proj" + suffix, tuple(shape), None)]
    F = shape[-2] // 2 if suffix == ".weight" else shape[-1] // 2
    half = (*shape[:-2], F, shape[-1]) if suffix == ".weight" else (*shape[:-1], F)
    return [(prefix + "gate_proj" + suffix, half, slice(0, F)), (prefix + "up_proj" + suffix, half, slice(F, 2 * F))]


def plan(config, arch, weights, deltas, scale, gguf_type):
    """[(GGUF name, shape, ggml type, producer)] of every tensor of the file, in llama.cpp's order
    (embedding, layers, norm, head); producer() gives its float32 values in GGUF's layout."""
    tied, E = config.tie_word_embeddings, (config.moe or {}).get("experts", 0)
    llama_70b = (arch == "llama" and config.num_hidden_layers == 80
                 and config.num_key_value_heads != config.num_attention_heads)
    held = {}  # the last merged weight, for the second half of a fused gate|up

    def merged(name):
        if held.get("name") != name:
            held.clear()
            w = weights[name]
            held.update(name=name, w=merged_weight(w, *deltas[name], scale) if name in deltas
                        else np.asarray(w, np.float32))
        return held["w"]

    def producer(name, piece, rows):
        def make():
            a = merged(name)
            if rows is not None:  # gate or up half: weights (..., 2F, C) by rows, biases (..., 2F)
                a = a[..., rows, :] if piece.endswith(".weight") else a[..., rows]
            heads = permuted_heads(arch, piece, config)
            if heads:
                a = permute(a, heads)
            if NORM_SHIFT.get(arch) and piece.endswith("norm.weight"):
                a = a + np.float32(NORM_SHIFT[arch])
            return np.ascontiguousarray(a, np.float32)
        return make

    out = [(k, v.shape, "F32", lambda v=v: v) for k, v in rope_tensors(config, arch).items()]
    for name, shape in config.weight_shapes().items():
        for piece, pshape, rows in _pieces(name, shape):
            g = gguf_name(piece, arch)
            kind = tensor_type(gguf_type, g, pshape, config.num_hidden_layers, E, tied, llama_70b)
            out.append((g, pshape, kind, producer(name, piece, rows)))
    return out


def _as_quantizer_reads(a, kind):
    """The values a block type is quantized from: rounded to f16 first, as llama-quantize reads the
    f16 file, so that the blocks are byte for byte those it makes of krnl's f16 export (the
    rounding is 1/16 of a Q8_0 step, or less); values past f16's range stay as they are."""
    if kind in ("F32", "F16", "BF16"):
        return a
    with np.errstate(over="ignore"):
        h = a.astype(np.float16).astype(np.float32)
    return np.where(np.isfinite(h), h, a)


def _put(writer, key, value):
    """One metadata key, typed as llama.cpp reads it: ints uint32, floats float32, lists arrays."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def export_gguf(base, adapter_folder, out_path, gguf_type="f16", ollama=False, name=None):
    """Writes the adapter at `adapter_folder` merged into `base` as the GGUF file `out_path` in
    --gguf-type `gguf_type` (mix.GGUF_TYPES), named `name` (default: the base's folder or file
    name), and with `ollama` a Modelfile beside it. Returns a summary dict (path, bytes, types,
    merged, scale, modelfile, notes, arch)."""
    import gguf

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"[gguf] --gguf-type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
    out = Path(out_path)
    if out.is_dir():
        raise ValueError(f"[gguf] --export-gguf {out} is a folder; give the .gguf file to write")
    config, weights, tok, deltas, scale = load_source(base, adapter_folder)
    arch = EXPORT_ARCH.get(config.model_type)
    if arch is None:
        raise ValueError(f"[gguf] {base}: llama.cpp has no architecture for {config.model_type}; GGUF export takes "
                         f"{', '.join(sorted(EXPORT_ARCH))}")
    check_supported(config, arch, base)
    tensors = plan(config, arch, weights, deltas, scale, gguf_type)
    kinds = [k for _, _, k, _ in tensors]
    # general.name: the base's, as convert_hf_to_gguf names a file (llama.cpp's vocabulary loader
    # keys some tokenizer settings on it, Phi-3's among them)
    base_name = Path(base).name if Path(base).is_dir() else Path(base).stem
    md = {"general.name": name or base_name, "general.file_type": GGUF_TYPES[gguf_type][1],
          "general.quantization_version": QUANTIZATION_VERSION, **arch_metadata(config, arch),
          **tokenizer_metadata(tok, config.vocab_size, source=str(base))}
    writer = gguf.GGUFWriter(None, arch)
    for key, value in md.items():
        _put(writer, key, value)
    for g, shape, kind, _ in tensors:
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor_info(g, shape, np.float32, int(np.prod(shape[:-1])) * (shape[-1] // block) * size,
                               raw_dtype=qtype)
    with atomic_path(out) as tmp:
        try:
            writer.write_header_to_file(path=Path(tmp))
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for g, shape, kind, make in tensors:
                writer.write_tensor_data(encode(_as_quantizer_reads(make(), kind), kind))
        finally:
            writer.close()
    modelfile = write_modelfile(out, tok) if ollama else None
    said = notes(config, arch) + ([f"{base} is multimodal: the file holds its text tower only"]
                                  if config.multimodal else [])
    for n in said:
        print(f"note: {n}", file=sys.stderr)
    counts = {k: kinds.count(k) for k in sorted(set(kinds))}
    return {"path": str(out), "bytes": out.stat().st_size, "types": counts, "merged": sorted(deltas), "scale": scale,
            "modelfile": modelfile, "notes": said, "arch": arch}
