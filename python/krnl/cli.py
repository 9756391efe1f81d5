"""The `krnl` command line: `train`, `eval` and `generate` (the embedded default: a tiny Llama and a
generated task; or, for eval and generate, an HF model folder from --model or the adapter's
base_model_name_or_path), `fuse` (an adapter merged into its HF base, written as an HF folder),
`w1` (LoRA on the W1 MLP block of DESIGN section 6, matching a teacher), `bench` (krnl/bench) and
`devices`. The argument parser is in cli_args.py; `devices`, `w1` and the device choice are in
cli_device.py; `krnl.cli:main` stays the entry point."""

import sys
from pathlib import Path

import numpy as np

import krnl

from .cli_args import parse_args
from .cli_device import cmd_devices, cmd_w1, device_from_args

DEFAULT_BASE = "krnl:default-tiny-llama"  # the embedded default's base model id (adapter_config)
BASE_SEED = 1234


def _default_model(dev, lora, dtype, seed, grad_checkpoint=False):
    from .default_task import CharTokenizer, base_weights, tiny_config
    from .model import LlamaModel, ModelConfig

    tok = CharTokenizer()
    config = ModelConfig.from_dict(tiny_config(tok.vocab_size), source="<embedded default>")
    weights = base_weights(config, seed=BASE_SEED)
    return tok, LlamaModel(dev, config, weights, lora=lora, dtype=dtype, seed=seed, grad_checkpoint=grad_checkpoint)


def _lora_from_args(args):
    from .model import LoraConfig

    kw = {"r": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout, "use_rslora": args.rslora}
    if args.lora_layers:
        kw["layers"] = [int(x) for x in args.lora_layers.split(",")]
    if args.lora_targets:
        kw["target_modules"] = tuple(t.strip() for t in args.lora_targets.split(","))
    return LoraConfig(**kw)


def _adapter_base(args):
    """The HF folder an adapter runs on: --model, else its base_model_name_or_path when that is a
    folder; None for the embedded default."""
    from .adapter import CONFIG_NAME, adapter_format
    from .fileio import read_json_object

    if getattr(args, "model", None):
        return args.model
    adapter_format(args.adapter_path)  # refuses pickle files and empty folders first
    cfg = read_json_object(Path(args.adapter_path) / CONFIG_NAME, "adapter")
    base = cfg.get("base_model_name_or_path", cfg.get("model"))
    if base == DEFAULT_BASE:
        return None
    if isinstance(base, str) and base and Path(base).is_dir():
        return base
    raise ValueError(f"[{args.cmd}] {args.adapter_path} was trained on {base!r}, which is not a local folder; "
                     f"pass the base model's HF folder with --model (the embedded default is {DEFAULT_BASE!r})")


def _load_trained(args, dev):
    """(tokenizer, model): the base (an HF folder from --model or the adapter's config, else the
    embedded default) with the adapter found at --adapter-path (PEFT or mlx-lm layout)."""
    from .adapter import read_adapter

    base = _adapter_base(args)
    if base is not None:
        from .hf import load_model

        model = load_model(base, dev, dtype=args.dtype, adapter=args.adapter_path)
        return None, model
    from .default_task import CharTokenizer, tiny_config
    from .model import ModelConfig

    config = ModelConfig.from_dict(tiny_config(CharTokenizer().vocab_size), source="<embedded default>")
    lora, tensors, _ = read_adapter(args.adapter_path, config)
    lora.dropout = 0.0
    tok, model = _default_model(dev, lora, args.dtype, seed=0)
    model.lora_params.load(tensors)
    return tok, model


def _hf_base(args, dev, lora):
    """(tokenizer, model, base id) for training on the HF folder at --model: the id written to
    adapter_config.json's base_model_name_or_path is the folder's absolute path, so eval,
    generate and fuse find the base without --model. (cmd_train calls this once --data is wired.)"""
    from .hf import load_model
    from .tokenizer import Tokenizer

    model = load_model(args.model, dev, lora=lora, dtype=args.dtype, seed=args.seed,
                       grad_checkpoint=args.grad_checkpoint)
    return Tokenizer.from_folder(args.model), model, str(Path(args.model).resolve())


def cmd_fuse(args):
    from .hf import fuse

    base = _adapter_base(args)
    if base is None:
        raise ValueError(f"[fuse] {args.adapter_path} belongs to the embedded default model; fuse needs an HF "
                         "model folder (--model)")
    info = fuse(base, args.adapter_path, args.save_path, shard_size=args.max_shard_size, dtype=args.dtype)
    print(f"fused {len(info['merged'])} weights (scale {info['scale']:g}) into {args.save_path}: "
          f"{', '.join(info['files'])}" + (f"; copied {', '.join(info['copied'])}" if info["copied"] else ""))
    return 0


def cmd_train(args):
    from .trainer import Trainer, TrainConfig, plot_metrics

    dev = device_from_args(args)
    lora = _lora_from_args(args)
    if args.model:
        if not args.data:
            raise ValueError("[train] --data is required with --model")
        from .data import load_dataset

        tok, model, base_id = _hf_base(args, dev, lora)
        ds = load_dataset(args.data, tok, args.max_seq_length, mask_prompt=args.mask_prompt, pack=args.pack,
                          vocab_size=model.config.vocab_size)
        for split in ds.values():
            if split is not None:
                print(split.summary())
        train, valid = ds["train"], ds["valid"]
        n_train = len(train.packed().ids) if args.pack else len(train.samples)
        what = f"{Path(args.model).name} ({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size})"
        hint = f"krnl generate --adapter-path {args.adapter_path} --prompt '...'"
    else:
        from .default_task import make_split

        tok, model = _default_model(dev, lora, args.dtype, seed=args.seed, grad_checkpoint=args.grad_checkpoint)
        train = make_split(tok, args.train_samples, seed=args.seed + 100)
        valid = make_split(tok, 256, seed=args.seed + 200)
        n_train, base_id = len(train[0]), DEFAULT_BASE
        what = (f"tiny Llama ({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, GQA "
                f"{model.config.num_attention_heads}/{model.config.num_key_value_heads})")
        hint = f"krnl generate --adapter-path {args.adapter_path} --prompt '+2c>'"
    iters = args.iters
    if args.epochs is not None:
        if not args.epochs > 0:
            raise ValueError(f"--epochs must be > 0, got {args.epochs}")
        iters = max(1, round(args.epochs * (n_train // (args.batch_size * args.grad_accumulation))))
    cfg = TrainConfig(iters=iters, batch_size=args.batch_size, grad_accum=args.grad_accumulation,
                      learning_rate=args.learning_rate, warmup=args.warmup, schedule=args.lr_schedule,
                      weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                      val_every=args.steps_per_eval, save_every=args.save_every, seed=args.seed)
    fingerprint = {"base": base_id, "model": vars(model.config), "lora": vars(lora), "dtype": args.dtype}
    trainer = Trainer(model, cfg, train, valid, out_dir=args.adapter_path, fingerprint=fingerprint,
                      base_model=base_id, progress=not args.quiet)
    print(f"krnl {krnl.__version__} on {dev.name}: {what}, LoRA r={lora.r} on {len(model.adapted)} modules "
          f"({model.lora_params.numel} trainable parameters), {args.dtype}")
    if args.resume:
        print(f"resumed from step {trainer.resume()}")
    summary = trainer.run()
    png = Path(args.adapter_path) / "loss.png"
    plot_metrics(summary["metrics"], png)
    val = f", validation loss {summary['val_loss']:.4f}" if summary["val_loss"] is not None else ""
    print(f"step {summary['steps']}: train loss {summary['loss']:.4f}{val}"
          + (f", {summary['skipped_steps']} skipped steps" if summary["skipped_steps"] else ""))
    print(f"adapter: {args.adapter_path}/adapter_model.safetensors (PEFT format); metrics: {summary['metrics']}; "
          f"loss curve: {png}")
    print(f"try: {hint}")
    return 0


def cmd_eval(args):
    dev = device_from_args(args)
    tok, model = _load_trained(args, dev)
    if tok is None:  # an HF base: evaluate on --data's test split (valid when there is no test)
        if not args.data:
            raise ValueError("[eval] --data is required to evaluate on an HF model")
        from .data import load_dataset
        from .tokenizer import Tokenizer

        tok = Tokenizer.from_folder(_adapter_base(args))
        ds = load_dataset(args.data, tok, args.max_seq_length, vocab_size=model.config.vocab_size,
                          required=("test",) if (Path(args.data) / "test.jsonl").exists() else ("valid",))
        split = ds["test"] or ds["valid"]
        losses, weights = [], []
        for batch in split.eval_batches(8):
            losses.append(model.loss(*batch[:2]) if len(batch) == 2 else
                          model.loss(batch[0], batch[1], segments=batch[2], positions=batch[3]))
            weights.append(int(np.count_nonzero(np.asarray(batch[1]) != -100)))
        loss = float(np.average(losses, weights=weights))
        print(f"{split.name} loss {loss:.4f} (ppl {np.exp(loss):.3f}) on {len(split.samples)} samples of {split.path}")
        return 0
    from .default_task import make_split

    ids, tg = make_split(tok, args.samples, seed=args.seed + 300)
    loss = float(np.mean([model.loss(ids[i:i + 64], tg[i:i + 64]) for i in range(0, len(ids), 64)]))
    print(f"test loss {loss:.4f} (ppl {np.exp(loss):.3f}) on {len(ids)} generated samples")
    return 0


def cmd_generate(args):
    dev = device_from_args(args)
    tok, model = _load_trained(args, dev)
    if tok is None:
        from .tokenizer import Tokenizer

        tok = Tokenizer.from_folder(_adapter_base(args))
        if tok.has_chat_template and not args.raw_prompt:
            # As mlx-lm does: the prompt is the user's turn of a chat rendered by the checkpoint.
            text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(args.prompt)
    else:
        ids = tok.encode(args.prompt)
    out = model.generate(ids, max_new_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p,
                         seed=args.seed, eos_id=tok.eos_id)
    print(args.prompt + tok.decode(out))
    return 0


def main(argv=None):
    from .bench.cli import cmd_bench  # krnl.bench pulls in its workloads: only once the CLI runs

    commands = {"devices": cmd_devices, "train": cmd_train, "eval": cmd_eval, "generate": cmd_generate,
                "fuse": cmd_fuse, "w1": cmd_w1, "bench": cmd_bench}
    args = parse_args(argv, commands)
    try:
        return args.fn(args)
    except (ValueError, FloatingPointError) as err:
        print(f"krnl {args.cmd}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
