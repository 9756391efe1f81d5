"""The `krnl` command line (entry point `krnl.cli.main:main`): `train`, `eval`, `generate` (the embedded
default, a tiny Llama and a generated task; or an HF or MLX folder or GGUF file from --model or the
adapter's base_model_name_or_path), `fuse` (fuse.py: an adapter merged into its base, written as an HF
or MLX folder or a GGUF file), `quantize` (an HF folder as an MLX one), `serve` (serve.py), `w1`,
`bench` (krnl.bench), `tune`, `devices`, `doctor` (doctor/). Parser: args.py; `devices`, `w1` and the
device choice: device.py."""

import sys
from pathlib import Path

import numpy as np

import krnl

from ..bench.tune import cmd_tune, ensure_tuned
from ..io.run_folder import claim
from ..train.dist import world as dist
from ..train.memory import OutOfMemory
from . import memory, objectives, optim_args
from .args import lora_from_args, parse_args
from .device import cmd_devices, cmd_w1, device_from_args, quantize_from_args as _quantize
from .serve import cmd_serve

DEFAULT_BASE = "krnl:default-tiny-llama"  # the embedded default's base model id (adapter_config)
BASE_SEED = 1234


def _default_model(dev, lora, dtype, seed, grad_checkpoint=False, quantize=None):
    from ..train.default_task import CharTokenizer, base_weights, tiny_config
    from ..models.model import LlamaModel
    from ..models.config import ModelConfig

    tok = CharTokenizer()
    config = ModelConfig.from_dict(tiny_config(tok.vocab_size), source="<embedded default>")
    weights = base_weights(config, seed=BASE_SEED)
    return tok, LlamaModel(dev, config, weights, lora=lora, dtype=dtype, seed=seed, grad_checkpoint=grad_checkpoint,
                           quantize=quantize)


def _adapter_base(args):
    """The HF folder an adapter runs on: --model, else its base_model_name_or_path when that is a
    folder; None for the embedded default."""
    from ..formats.adapter import CONFIG_NAME, adapter_format
    from ..io.fileio import read_json_object

    if getattr(args, "model", None):
        return args.model
    adapter_format(args.adapter_path)  # refuses pickle files and empty folders first
    cfg = read_json_object(Path(args.adapter_path) / CONFIG_NAME, "adapter")
    base = cfg.get("base_model_name_or_path", cfg.get("model"))
    if base == DEFAULT_BASE:
        return None
    from ..formats.gguf.file import is_gguf

    if isinstance(base, str) and base and (Path(base).is_dir() or is_gguf(base)):
        return base
    raise ValueError(f"[{args.cmd}] {args.adapter_path} was trained on {base!r}, which is not a local folder nor GGUF "
                     f"file; pass the base model with --model (the embedded default is {DEFAULT_BASE!r})")


def _resolve_adapter_path(args):
    """eval and generate: None (the base model alone) for --adapter-path "" or, with no
    --adapter-path, when there is no adapters folder; an explicit path that does not exist is an
    error. Says in one line when the base model runs alone."""
    path = args.adapter_path
    if path is None:
        path = "adapters" if Path("adapters").exists() else ""
    elif path and not Path(path).exists():
        raise ValueError(f"adapter folder {path} not found (leave out --adapter-path, or pass --adapter-path \"\", "
                         "to use the base model alone)")
    if not path:
        what = (f"the base model {args.model}" if args.model else
                f"the base model: the untrained embedded default ({DEFAULT_BASE})")
        print(f"no adapter: {'evaluating' if args.cmd == 'eval' else 'generating with'} {what}", file=sys.stderr)
        path = None
    args.adapter_path = path
    return path


def _load_trained(args, dev):
    """(tokenizer, model): the base (an HF folder from --model or the adapter's config, else the
    embedded default) with the adapter found at --adapter-path (PEFT or mlx-lm layout), or the
    base alone (see _resolve_adapter_path)."""
    from ..formats.adapter import read_adapter

    if _resolve_adapter_path(args) is None:
        if args.model:
            from ..formats.hf import load_model

            return None, load_model(args.model, dev, dtype=args.dtype, quantize=_quantize(args))
        return _default_model(dev, None, args.dtype, seed=0, quantize=_quantize(args))
    base = _adapter_base(args)
    if base is not None:
        from ..formats.hf import load_model

        model = load_model(base, dev, dtype=args.dtype, adapter=args.adapter_path, quantize=_quantize(args))
        return None, model
    from ..train.default_task import CharTokenizer, tiny_config
    from ..models.config import ModelConfig

    config = ModelConfig.from_dict(tiny_config(CharTokenizer().vocab_size), source="<embedded default>")
    lora, tensors, _ = read_adapter(args.adapter_path, config)
    lora.dropout = 0.0
    tok, model = _default_model(dev, lora, args.dtype, seed=0, quantize=_quantize(args))
    model.lora_params.load(tensors)
    return tok, model


def _hf_base(args, dev, lora):
    """(tokenizer, model, base id) for training on the HF folder at --model: the id written to
    adapter_config.json's base_model_name_or_path is the folder's absolute path, so eval,
    generate and fuse find the base without --model. (cmd_train calls this once --data is wired.)"""
    from ..formats.hf import load_model, load_tokenizer

    model = load_model(args.model, dev, lora=lora, dtype=args.dtype, seed=args.seed,
                       grad_checkpoint=args.grad_checkpoint, quantize=_quantize(args))
    return load_tokenizer(args.model), model, str(Path(args.model).resolve())


def cmd_fuse(args):
    from .fuse import fuse_command

    return fuse_command(args, _adapter_base(args))


def cmd_quantize(args):
    from ..formats.hf import quantize_folder

    bits, group_size, *mode = _quantize(args)
    info = quantize_folder(args.model, args.save_path, bits, group_size, dtype=args.dtype,
                           shard_size=args.max_shard_size, recipe=args.quant_predicate, mode=(*mode, "affine")[0])
    what = args.quant_predicate or f"{bits} bits"
    print(f"quantized {args.model} to {what} (groups of {group_size}) into {args.save_path}: "
          f"{', '.join(info['files'])}" + (f"; copied {', '.join(info['copied'])}" if info["copied"] else ""))
    return 0


def learning_rate(args, lora):
    """--learning-rate, or its default for the fine-tune type: a full fine-tune's steps move the weights
    themselves, where LoRA's 3e-3 would wreck them (mlx-lm's 1e-5)."""
    if args.learning_rate is not None:
        return args.learning_rate
    return 1e-5 if lora.full else 3e-3


def cmd_train(args):
    from ..train.trainer import Trainer, TrainConfig, plot_metrics

    world = dist.world(mute_others=True)  # before the device: it may set KRNL_NUM_THREADS per rank
    dev = device_from_args(args)
    lora = lora_from_args(args)
    if args.model and not args.data and not (args.cmd == "plan" or args.dry_run):
        raise ValueError("[train] --data is required with --model")
    if memory.wanted(args):  # the plan (then done), or --fit's choice applied to args
        code = memory.before_load(args, dev, lora, _quantize(args), world)
        if code is not None:
            return code
    if args.model:
        if lora.full and not Path(args.model).is_dir():
            raise ValueError(f"[train] --fine-tune-type full writes an HF folder and needs one to start from; "
                             f"{args.model} is a GGUF file (convert it to an HF folder first)")
        tok, model, base_id = _hf_base(args, dev, lora)
        if args.train_mode == "sft":
            ds = memory.sft_data(args, model.config.vocab_size, tok)
            for split in ds.values():
                if split is not None:
                    print(split.summary())
            train, valid = ds["train"], ds["valid"]
            n_train = len(train.packed().ids) if args.pack else len(train.samples)
        else:
            train, valid, n_train = objectives.mode_data(args, tok, model)
        what = f"{Path(args.model).name} ({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size})"
        hint = f"krnl generate --adapter-path {args.adapter_path} --prompt '...'"
    else:
        if args.train_mode != "sft":
            raise ValueError(f"[train] --train-mode {args.train_mode} needs --model and preference data (--data)")
        from ..train.default_task import make_split

        tok, model = _default_model(dev, lora, args.dtype, seed=args.seed, grad_checkpoint=args.grad_checkpoint,
                                    quantize=_quantize(args))
        train = make_split(tok, args.train_samples, seed=args.seed + 100)
        valid = make_split(tok, 256, seed=args.seed + 200)
        n_train, base_id = len(train[0]), DEFAULT_BASE
        what = (f"tiny Llama ({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, GQA "
                f"{model.config.num_attention_heads}/{model.config.num_key_value_heads})")
        hint = f"krnl generate --adapter-path {args.adapter_path} --prompt '+2c>'"
    model.aux_loss_coef = args.router_aux_loss_coef  # refused (> 0) by a model without experts
    iters = args.iters
    if args.epochs is not None:
        if not args.epochs > 0:
            raise ValueError(f"--epochs must be > 0, got {args.epochs}")
        iters = max(1, round(args.epochs * (n_train // (args.batch_size * args.grad_accumulation))))
    cfg = TrainConfig(iters=iters, batch_size=args.batch_size, grad_accum=args.grad_accumulation,
                      learning_rate=learning_rate(args, lora), warmup=args.warmup, schedule=args.lr_schedule,
                      weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                      val_every=args.steps_per_eval, save_every=args.save_every, seed=args.seed,
                      length_bucket=args.length_bucket, graphs=not args.no_graphs, reduce_order=args.reduce_order,
                      **objectives.config_fields(args), **optim_args.config_fields(args))
    lora_fp = {k: v for k, v in vars(lora).items()  # older checkpoints lack these keys
               if k not in ("use_dora", "full", "train_embeddings") or v}
    fingerprint = {"base": base_id, "model": vars(model.config), "lora": lora_fp, "dtype": args.dtype}
    if model.quantize is not None:  # only then: older checkpoints have no such key
        fingerprint["quantize"] = list(model.quantize)
    fingerprint.update({"aux_loss_coef": model.aux_loss_coef} if model.aux_loss_coef else {})  # likewise
    trainer = Trainer(model, cfg, train, valid, out_dir=args.adapter_path, fingerprint=fingerprint,
                      base_model=base_id, progress=not args.quiet, options=_run_options(args),
                      adapter_format=args.adapter_format, world=world,
                      objective=objectives.objective(args, tok, cfg))
    trainer.memory_estimate = est = memory.after_load(args, dev, model, train, world)
    if lora.full and est is not None:  # the weights' own copies, gradients and state: say what it takes
        print(f"memory: {memory.summary(est, dev)}")
    if args.adapter_format == "mlx" and not lora.full:  # refused before training, not after it
        from ..formats.adapter import mlx_adapter

        mlx_adapter(lora, model.lora_state(), model.config)
    kind = "full fine-tuning of" if lora.full else f"{'DoRA' if lora.use_dora else 'LoRA'} r={lora.r} on"
    print(f"krnl {krnl.__version__} on {dev.name}: {what}, {kind} {len(model.adapted)} modules "
          f"({model.lora_params.numel} trainable parameters), {args.dtype}"
          + (f", base quantized to {model.quantize[0]} bits (groups of {model.quantize[1]})" if model.quantize else "")
          + world.describe())
    resuming = args.resume or args.resume_from is not None
    # The OS drops the lock at exit; rank 0 alone writes the folder.
    lock = claim(args.adapter_path, resume=resuming, overwrite=args.overwrite) if world.root else dist.NO_LOCK
    if resuming and not _resume(args, trainer):
        lock.release()
        return 0
    ensure_tuned(dev, args.dtype, no_tune=args.no_tune)  # before the first step, never inside one
    try:
        summary = trainer.run()
    except KeyboardInterrupt:
        raise Interrupted(_interrupted_message(trainer, args.adapter_path)) from None
    png = Path(args.adapter_path) / "loss.png"
    if world.root:
        plot_metrics(summary["metrics"], png)
    val = f", validation loss {summary['val_loss']:.4f}" if summary["val_loss"] is not None else ""
    print(f"step {summary['steps']}: train loss {summary['loss']:.4f}{val}"
          + (f", {summary['skipped_steps']} skipped steps" if summary["skipped_steps"] else ""))
    mlx = f", {args.adapter_path}/mlx (mlx-lm)" if args.adapter_format == "mlx" else ""
    hf_dir = Path(args.adapter_path) / "model"
    files = (f"full fine-tune: {args.adapter_path}/adapters.safetensors (mlx-lm's layout)"
             + (f", the model as an HF folder: {hf_dir}" if hf_dir.is_dir() else "") if lora.full
             else f"adapter: {args.adapter_path}/adapter_model.safetensors (PEFT format){mlx}")
    print(f"{files}; metrics: {summary['metrics']}; "
          f"loss curve: {png}")
    print(f"try: {hint}")
    lock.release()
    return 0


def _run_options(args):
    """The options outside TrainConfig that a resumed run must share with its checkpoint."""
    if not args.model:
        return {"train_samples": args.train_samples}
    import hashlib

    train = Path(args.data) / "train.jsonl"
    digest = hashlib.sha256(train.read_bytes()).hexdigest()[:16] if train.is_file() else None
    return {"data": str(Path(args.data).resolve()), "data_sha256": digest, "max_seq_length": args.max_seq_length,
            "mask_prompt": args.mask_prompt, "pack": args.pack}


def _resume(args, trainer):
    """Restores --resume-from's checkpoint (a step or a path), else the newest that verifies, and
    says what resume did; False when the run is already at --iters (nothing to do)."""
    where = args.resume_from
    step = trainer.resume(int(where) if where is not None and where.isdigit() else where,
                          override=args.resume_override)
    for note in trainer.notes:
        print(note)
    iters = trainer.cfg.iters
    if step >= iters:
        print(f"already at step {step} of {iters}; nothing to do" if step == iters else
              f"already at step {step}, past --iters {iters}; nothing to do")
        done = "adapters.safetensors" if trainer.model.lora_config.full else "adapter_model.safetensors"
        if trainer.world.root and not (Path(args.adapter_path) / done).exists():
            trainer.save_adapter()  # a run stopped between its last checkpoint and the adapter
        return False
    print(f"resumed from step {step}")
    return True


class Interrupted(Exception):
    """Ctrl-C during a command; main() prints the message and exits 130."""


def _interrupted_message(trainer, out_dir):
    from ..io.checkpoint import list_checkpoints

    found = list_checkpoints(Path(out_dir) / "checkpoints")
    newest = f"step {found[-1][0]}; continue with --resume" if found else "none yet; start the run again"
    return f"interrupted at step {trainer.step}; newest checkpoint: {newest}"


def _os_error_message(err, args):
    """One line for an OSError: the path, what went wrong and what to do."""
    import errno

    path = err.filename or getattr(args, "adapter_path", None) or getattr(args, "save_path", None) or "?"
    if err.filename2:
        path = f"{path} -> {err.filename2}"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = "the disk is full: free some space (or write elsewhere)"
    elif err.errno == errno.EROFS:
        todo = "read-only file system: choose a folder on a writable disk"
    elif err.errno in (errno.EACCES, errno.EPERM):
        todo = "permission denied: fix its permissions (the folder must be writable) or choose another path"
    elif err.errno == errno.ENOTDIR:
        todo = "a part of this path is a file, not a folder: choose another path"
    elif err.errno == errno.ENOENT:
        todo = "no such file or folder"
    else:
        todo = err.strerror or str(err)
    checkpoints = " (checkpoints written so far are intact)" if args.cmd == "train" else ""
    return f"{path}: {todo}{checkpoints}"


def cmd_eval(args):
    dev = device_from_args(args)
    tok, model = _load_trained(args, dev)
    if tok is None:  # an HF base: evaluate on --data's test split (valid when there is no test)
        if not args.data:
            raise ValueError("[eval] --data is required to evaluate on an HF model")
        from ..train.data import load_dataset
        from ..formats.hf import load_tokenizer

        tok = load_tokenizer(_adapter_base(args))
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
    from ..train.default_task import make_split

    ids, tg = make_split(tok, args.samples, seed=args.seed + 300)
    loss = float(np.mean([model.loss(ids[i:i + 64], tg[i:i + 64]) for i in range(0, len(ids), 64)]))
    print(f"test loss {loss:.4f} (ppl {np.exp(loss):.3f}) on {len(ids)} generated samples")
    return 0


def cmd_generate(args):
    dev = device_from_args(args)
    tok, model = _load_trained(args, dev)
    if tok is None:
        from ..formats.hf import load_tokenizer

        tok = load_tokenizer(_adapter_base(args))
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
    code = dist.supervise(sys.argv[1:] if argv is None else argv)  # a rank of several: its child runs it
    if code is not None:
        return code
    from ..bench.cli import cmd_bench  # krnl.bench pulls in its workloads: only once the CLI runs
    from .doctor.command import cmd_doctor

    commands = {"devices": cmd_devices, "train": cmd_train, "eval": cmd_eval, "generate": cmd_generate,
                "fuse": cmd_fuse, "quantize": cmd_quantize, "w1": cmd_w1, "tune": cmd_tune, "bench": cmd_bench,
                "doctor": cmd_doctor, "serve": cmd_serve}
    args = parse_args(argv, commands)
    return dist.guarded(_run, args)


def _run(args):
    try:
        return args.fn(args)
    except (ValueError, FloatingPointError, OutOfMemory) as err:
        print(f"krnl {args.cmd}: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # disk full, read-only folder, permissions: one line, not a traceback
        print(f"krnl {args.cmd}: error: {_os_error_message(err, args)}", file=sys.stderr)
        return 1
    except Interrupted as err:
        print(f"\nkrnl {args.cmd}: {err}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"\nkrnl {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
