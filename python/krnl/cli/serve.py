"""`krnl serve`: an OpenAI-compatible server (krnl.serve) for a base model with no, one or several
adapters, each served under its own model name; needs the `serve` extra (uvicorn, Starlette)."""

import json
import sys
from pathlib import Path

from .device import device_from_args, quantize_from_args


def serve_arguments(s):
    s.add_argument("--model", required=True, help="the base model: HF or MLX quantized folder, or GGUF file")
    s.add_argument("--adapter-path", default=None, help="one adapter folder, served under its folder's name")
    s.add_argument("--adapters", nargs="+", default=None, metavar="NAME=PATH",
                   help="several adapters (one LoRA rank and target set), each served as NAME")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting to join; more are answered 429")
    s.add_argument("--max-tokens", type=int, default=512, help="a request's max_tokens when it gives none")


def eos_ids(tok, model_path):
    """The ids that end a completion: the tokenizer's EOS and generation_config.json's eos_token_id."""
    ids = {tok.eos_id} if tok.eos_id is not None else set()
    gc = Path(model_path) / "generation_config.json"
    if gc.is_file():
        try:
            v = json.loads(gc.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            v = None
        ids |= set(v if isinstance(v, list) else [v] if isinstance(v, int) else [])
    return ids


def build(args):
    """(engine, tokenizer, {served name: adapter name}, eos ids) for the command line's model and
    adapters, the engine started."""
    from ..formats.hf import load_model, load_tokenizer
    from ..serve.adapters import Adapters, parse_adapters
    from ..serve.engine import Engine

    if args.adapter_path and args.adapters:
        raise ValueError("[serve] pass --adapter-path or --adapters, not both")
    paths = parse_adapters(args.adapters or ([args.adapter_path] if args.adapter_path else []))
    dev = device_from_args(args)
    first = next(iter(paths.values()), None)
    model = load_model(args.model, dev, dtype=args.dtype, adapter=first, quantize=quantize_from_args(args))
    tok = load_tokenizer(args.model)
    base = Path(args.model).name or str(args.model)
    names = {**{n: n for n in paths}, base: ""}
    if len(names) != len(paths) + 1:
        raise ValueError(f"[serve] an adapter is named {base!r}, the base model's name")
    adapters = Adapters(model, paths) if paths else None
    engine = Engine(model, adapters, args.max_batch, args.max_queue).start()
    return engine, tok, names, eos_ids(tok, args.model)


def cmd_serve(args):
    try:
        import uvicorn
        from ..serve.app import make_app
    except ImportError as e:
        raise ValueError(f"[serve] needs the serve extra: pip install 'krnl[serve]' ({e})") from None
    for name in ("max_batch", "max_queue", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"[serve] --{name.replace('_', '-')} must be >= 1")
    engine, tok, names, eos = build(args)
    app = make_app(engine, tok, names, eos, args.max_tokens)
    print(f"krnl serve: {', '.join(names)} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.stop()
    return 0
