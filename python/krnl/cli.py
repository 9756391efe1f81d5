"""The `krnl` command line: `train`, `eval` and `generate` (the embedded default: a tiny Llama and a
generated task; or, for eval and generate, an HF model folder from --model or the adapter's
base_model_name_or_path), `fuse` (an adapter merged into its HF base, written as an HF folder),
`w1` (LoRA on the W1 MLP block of DESIGN section 6, matching a teacher), `bench` (krnl/bench) and
`devices`."""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import krnl

from .mlp_block import MLPBlock, make_w1_params, w1_flops

ops = krnl.ops


def _describe(caps):
    """A device's capabilities on one line: key=value, the hardware details last."""
    fa = caps["fused_attention"]
    fused = ",".join(fa["dtypes"]) + ("+segments" if fa["segments"] else "") if fa["dtypes"] else "-"
    yn = lambda b: "yes" if b else "no"
    parts = [f"kind={caps['kind']}", f"dtypes={','.join(caps['dtypes'])}", f"compute={caps['compute_dtype']}",
             f"fused_attention={fused}", f"attention_block={caps['attention_block'] or 'all'}",
             f"graphs={yn(caps['graphs'])}", f"host_visible={yn(caps['host_visible'])}",
             f"synchronous={yn(caps['synchronous'])}", f"queue_ordered={yn(caps['queue_ordered'])}"]
    if caps["details"]:
        parts.append("(" + "; ".join(f"{k}: {v}" for k, v in caps["details"].items()) + ")")
    return " ".join(parts)


def cmd_devices(args):
    # Best first, as krnl.device() picks; then what this build has but cannot run here, and why.
    caps = {name: krnl.device(name).capabilities() for name in krnl.devices()}
    unavailable = krnl.unavailable_devices()
    if args.json:
        print(json.dumps({"devices": caps, "unavailable": unavailable}, indent=2))
        return 0
    width = max(map(len, caps), default=0)
    for name, c in caps.items():
        print(f"{name:{width}}  {_describe(c)}")
    for name, reason in unavailable.items():
        print(f"{name}: unavailable: {reason}")
    return 0


def _device(args):
    """The device of --device (the best available by default); a --dtype left out becomes the
    device's training dtype (its capabilities' compute_dtype)."""
    dev = krnl.device(args.device)
    if getattr(args, "dtype", None) is None:
        args.dtype = dev.capabilities()["compute_dtype"]
    return dev


def cmd_w1(args):
    dev = _device(args)
    T, C, F, R = args.tokens, args.width, args.ffn, args.rank
    P = make_w1_params(T, C, F, R, seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    teacher = dict(P)
    teacher["Bg"] = (rng.standard_normal((F, R)) / np.sqrt(R)).astype(np.float32)
    teacher["Bu"] = (rng.standard_normal((F, R)) / np.sqrt(R)).astype(np.float32)
    student = dict(P)
    student["Bg"] = np.zeros((F, R), np.float32)  # PEFT's initialisation: B = 0
    student["Bu"] = np.zeros((F, R), np.float32)

    x = dev.tensor(P["x"], args.dtype)
    target = dev.empty((T, C), args.dtype)
    ops.cast(MLPBlock(dev, teacher, T, dtype=args.dtype).forward(x), target)
    block = MLPBlock(dev, student, T, dtype=args.dtype)
    diff = dev.empty((T, C), args.dtype)
    sq = dev.empty((1,), "f32")
    n = T * C
    flops = w1_flops(T, C, F, R)
    print(f"krnl {krnl.__version__} on {dev.name} ({krnl.num_threads()} threads): W1 block T={T} C={C} F={F} "
          f"R={R} {args.dtype}, {flops / 1e9:.2f} GFLOP per step")
    times, first = [], None
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        with dev.step():
            y = block.forward(x)
            ops.cast(y, diff)
            ops.axpy(-1.0, target, diff)              # diff = y - target
            ops.sumsq(diff, sq)
            ops.scale(diff, 1.0 / n, diff)            # dL/dy of L = 0.5 * mean(diff^2)
            block.backward(x, diff)
            block.adamw(args.learning_rate)
        loss = 0.5 * float(sq.numpy()[0]) / n         # read once, after the step
        dt = time.perf_counter() - t0
        if not np.isfinite(loss):
            print(f"error: loss is {loss} at step {step}", file=sys.stderr)
            return 1
        first = loss if first is None else first
        times.append(dt)
        print(f"step {step:3d}  loss {loss:.6f}  {dt * 1e3:8.1f} ms  {flops / dt / 1e9:7.1f} GFLOP/s")
    med = float(np.median(times[1:] if len(times) > 1 else times))
    stats = dev.pool_stats()
    print(f"loss {first:.6f} -> {loss:.6f}; median step {med * 1e3:.1f} ms ({flops / med / 1e9:.1f} GFLOP/s); "
          f"peak pool memory {stats['peak_reserved'] / 2**20:.1f} MiB")
    return 0


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

    dev = _device(args)
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
    dev = _device(args)
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
    dev = _device(args)
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


def _yaml_defaults(path, parser):
    """Train options from a YAML file (mlx-lm style: flat keys with underscores or dashes, and a
    lora_parameters mapping with rank, alpha or scale, dropout). Unknown keys are errors."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise SystemExit(f"krnl train: error: --config {path}: {e.strerror}")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise SystemExit(f"krnl train: error: {path}{where}: invalid YAML ({getattr(e, 'problem', e)})")
    if not isinstance(data, dict):
        raise SystemExit(f"krnl train: error: {path}: expected a mapping of options")
    known = {a.dest for a in parser._actions}
    out = {}
    lp = data.pop("lora_parameters", None) or {}
    if lp:
        rank = int(lp.get("rank", parser.get_default("lora_rank")))
        out["lora_rank"] = rank
        if "alpha" in lp:
            out["lora_alpha"] = float(lp["alpha"])
        elif "scale" in lp:  # mlx-lm stores alpha / r
            out["lora_alpha"] = float(lp["scale"]) * rank
        if "dropout" in lp:
            out["lora_dropout"] = float(lp["dropout"])
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in known or dest in ("help", "config"):
            raise SystemExit(f"krnl train: error: {path}: unknown option {key!r}")
        out[dest] = value
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="krnl", description="LoRA fine-tuning engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("devices", help="list the devices this build can use, with what each can do, and why any "
                       "other is unavailable here")
    d.add_argument("--json", action="store_true", help="print everything as JSON")
    d.set_defaults(fn=cmd_devices)

    def common(q):
        q.add_argument("--device", default=None, help="cpu, ... (default: best available)")
        q.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"],
                       help="compute dtype (default: the device's compute dtype, see `krnl devices`)")
        q.add_argument("--seed", type=int, default=0)

    t = sub.add_parser("train", help="LoRA fine-tune (default: the embedded tiny model and task)")
    common(t)
    t.add_argument("--adapter-path", default="adapters", help="output folder: adapter, checkpoints, metrics")
    t.add_argument("--config", default=None, help="YAML file of train options (flags given on the command line win)")
    t.add_argument("--model", default=None, help="HF model folder (default: the embedded tiny model)")
    t.add_argument("--data", default=None, help="folder with train.jsonl (and valid.jsonl, test.jsonl)")
    t.add_argument("--max-seq-length", type=int, default=2048)
    t.add_argument("--mask-prompt", action=argparse.BooleanOptionalAction, default=True,
                   help="learn only completions / assistant turns (default: on)")
    t.add_argument("--pack", action="store_true", help="pack short samples into full rows (attention never "
                   "crosses samples); default: length-sorted batches")
    t.add_argument("--iters", type=int, default=1500, help="optimizer steps")
    t.add_argument("--epochs", type=float, default=None, help="passes over the training set (overrides --iters)")
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--grad-accumulation", type=int, default=1)
    t.add_argument("--learning-rate", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--lr-schedule", default="cosine", choices=["cosine", "linear", "constant"])
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    t.add_argument("--steps-per-eval", type=int, default=100)
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--lora-rank", type=int, default=16)
    t.add_argument("--lora-alpha", type=float, default=32.0)
    t.add_argument("--lora-dropout", type=float, default=0.0)
    t.add_argument("--rslora", action="store_true", help="scale by alpha/sqrt(r) (rsLoRA)")
    t.add_argument("--lora-layers", default=None, help="comma-separated layer indices (default: all)")
    t.add_argument("--lora-targets", default=None, help="comma-separated modules (default: q,k,v,o,gate,up,down)")
    t.add_argument("--grad-checkpoint", action="store_true", help="recompute layers in backward (less memory)")
    t.add_argument("--train-samples", type=int, default=4000)
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --adapter-path")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="test loss of a trained adapter")
    common(e)
    e.add_argument("--adapter-path", default="adapters")
    e.add_argument("--model", default=None, help="HF model folder (default: the adapter's base model)")
    e.add_argument("--data", default=None, help="folder with test.jsonl (or valid.jsonl), for HF models")
    e.add_argument("--max-seq-length", type=int, default=2048)
    e.add_argument("--samples", type=int, default=256, help="generated samples (embedded default)")
    e.set_defaults(fn=cmd_eval)

    g = sub.add_parser("generate", help="sample from the model with a trained adapter (KV-cached)")
    common(g)
    g.add_argument("--adapter-path", default="adapters")
    g.add_argument("--model", default=None, help="HF model folder (default: the adapter's base model)")
    g.add_argument("--prompt", default="+2c>")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temp", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--raw-prompt", action="store_true",
                   help="send the prompt as is (default: as a user turn of the model's chat template, if any)")
    g.set_defaults(fn=cmd_generate)

    f = sub.add_parser("fuse", help="merge an adapter into its base model and write an HF folder")
    f.add_argument("--model", default=None, help="the base model's HF folder (default: the adapter's base model)")
    f.add_argument("--adapter-path", default="adapters", help="adapter folder (PEFT or mlx-lm layout)")
    f.add_argument("--save-path", default="fused_model", help="output HF folder")
    f.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 2GB, 500MB")
    f.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"],
                   help="output dtype (default: each tensor's stored dtype)")
    f.set_defaults(fn=cmd_fuse)

    w = sub.add_parser("w1", help="train LoRA on the W1 MLP block to match a teacher (a small, real LoRA run)")
    w.add_argument("--device", default=None, help="cpu, ... (default: best available)")
    w.add_argument("--steps", type=int, default=10)
    w.add_argument("--tokens", type=int, default=512)
    w.add_argument("--width", type=int, default=2048)
    w.add_argument("--ffn", type=int, default=5632)
    w.add_argument("--rank", type=int, default=32)
    w.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"],
                   help="compute dtype (default: the device's compute dtype, see `krnl devices`)")
    w.add_argument("--learning-rate", type=float, default=1e-2)
    w.add_argument("--seed", type=int, default=0)
    w.set_defaults(fn=cmd_w1)

    from .bench.cli import add_arguments as bench_arguments, cmd_bench
    b = sub.add_parser("bench", help="krnl next to numpy, PyTorch and MLX on W1/W2/W3 and GEMMs, behind a control gate")
    bench_arguments(b)
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    if getattr(args, "config", None):
        t.set_defaults(**_yaml_defaults(args.config, t))
        args = p.parse_args(argv)
    for name in ("steps", "tokens", "width", "ffn", "rank", "iters", "batch_size", "grad_accumulation",
                 "lora_rank", "max_tokens", "samples", "train_samples"):
        if getattr(args, name, 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        return args.fn(args)
    except (ValueError, FloatingPointError) as err:
        print(f"krnl {args.cmd}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
