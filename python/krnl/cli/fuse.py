"""`krnl fuse`: an adapter merged into its base and written as an HF folder, an MLX quantized folder
(--q-bits), or one GGUF file for llama.cpp, Ollama and LM Studio (--export-gguf, with --gguf-type
and, for Ollama, --ollama: formats/gguf/export.py). main.py finds the base (--model or the
adapter's); the parser's other fuse options are in args.py."""

from ..formats.gguf.mix import GGUF_TYPES
from .device import quantize_from_args


def gguf_arguments(f):
    f.add_argument("--export-gguf", default=None, metavar="FILE",
                   help="write one GGUF file instead of a folder (llama.cpp's names, layouts, metadata, tokenizer "
                   "and chat template)")
    f.add_argument("--gguf-type", default=None, choices=list(GGUF_TYPES),
                   help="the GGUF's tensor types (with --export-gguf; default f16): f16, bf16, q8_0 as llama.cpp's "
                   "converter writes them; q4_0, q4_k_m, q5_k_m, q6_k with llama-quantize's mix (README)")
    f.add_argument("--ollama", action="store_true",
                   help="with --export-gguf: an Ollama Modelfile beside the file (FROM, TEMPLATE, stop tokens)")


def fuse_command(args, base):
    """`krnl fuse` for the base model at `base` (None: the embedded default, which has no file)."""
    if base is None:
        raise ValueError(f"[fuse] {args.adapter_path} belongs to the embedded default model; fuse needs an HF "
                         "model folder or GGUF file (--model)")
    q = quantize_from_args(args)
    if args.export_gguf:
        return _export(args, base, q)
    if args.gguf_type or args.ollama:
        raise ValueError(f"[fuse] {'--gguf-type' if args.gguf_type else '--ollama'} goes with --export-gguf FILE")
    from ..formats.gguf.file import is_gguf
    from ..formats.gguf.fuse import fuse_gguf
    from ..formats.hf import fuse

    if is_gguf(base):
        info = fuse_gguf(base, args.adapter_path, args.save_path, args.max_shard_size, args.dtype, quantize=q)
    else:
        info = fuse(base, args.adapter_path, args.save_path, shard_size=args.max_shard_size, dtype=args.dtype,
                    quantize=q)
    what = f" (MLX, {q[0]} bits, groups of {q[1]})" if q else ""
    print(f"fused {len(info['merged'])} weights (scale {info['scale']:g}) into {args.save_path}{what}: "
          f"{', '.join(info['files'])}" + (f"; copied {', '.join(info['copied'])}" if info["copied"] else ""))
    return 0


def _export(args, base, q):
    from ..formats.gguf.export import export_gguf

    if q is not None or args.dtype is not None:
        raise ValueError(f"[fuse] --export-gguf takes --gguf-type for its tensor types, not "
                         f"{'--q-bits / --q-mode' if q is not None else '--dtype'}")
    t = args.gguf_type or "f16"
    info = export_gguf(base, args.adapter_path, args.export_gguf, t, ollama=args.ollama)
    kinds = ", ".join(f"{n} {k}" for k, n in info["types"].items())
    print(f"fused {len(info['merged'])} weights (scale {info['scale']:g}) into {info['path']} ({info['arch']}, {t}: "
          f"{kinds}; {info['bytes'] / 2**20:.1f} MiB)" + (f"; wrote {info['modelfile']}" if info["modelfile"] else ""))
    return 0
