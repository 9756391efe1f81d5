"""The `krnl` command line: `train`, `eval` and `generate` (the embedded default: a tiny Llama and a
generated task; real checkpoints and data come with issue 5), `w1` (LoRA on the W1 MLP block of
DESIGN section 6, matching a teacher) and `devices`."""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import krnl

from .mlp_block import MLPBlock, make_w1_params, w1_flops

ops = krnl.ops


def cmd_devices(args):
    for name in krnl.devices():
        print(name)
    return 0


def cmd_w1(args):
    dev = krnl.device(args.device)
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


def _load_trained(args, dev):
    """The embedded default model with the adapter found at --adapter-path."""
    from .adapter import load_adapter
    from .model import LoraConfig

    tensors, cfg = load_adapter(args.adapter_path)
    if cfg.get("base_model_name_or_path") != DEFAULT_BASE:
        raise ValueError(f"[{args.cmd}] {args.adapter_path} was trained on {cfg.get('base_model_name_or_path')!r}; "
                         f"this version runs adapters of the embedded default ({DEFAULT_BASE!r}) only")
    lora = LoraConfig(r=cfg["r"], alpha=cfg["lora_alpha"], dropout=0.0, target_modules=tuple(cfg["target_modules"]),
                      use_rslora=cfg.get("use_rslora", False), layers=cfg.get("layers_to_transform"))
    tok, model = _default_model(dev, lora, args.dtype, seed=0)
    model.lora_params.load(tensors)
    return tok, model


def cmd_train(args):
    from .default_task import CharTokenizer, make_split
    from .trainer import Trainer, TrainConfig, plot_metrics

    dev = krnl.device(args.device)
    lora = _lora_from_args(args)
    tok, model = _default_model(dev, lora, args.dtype, seed=args.seed, grad_checkpoint=args.grad_checkpoint)
    train = make_split(tok, args.train_samples, seed=args.seed + 100)
    valid = make_split(tok, 256, seed=args.seed + 200)
    iters = args.iters
    if args.epochs is not None:
        if not args.epochs > 0:
            raise ValueError(f"--epochs must be > 0, got {args.epochs}")
        per_epoch = len(train[0]) // (args.batch_size * args.grad_accumulation)
        iters = max(1, round(args.epochs * per_epoch))
    cfg = TrainConfig(iters=iters, batch_size=args.batch_size, grad_accum=args.grad_accumulation,
                      learning_rate=args.learning_rate, warmup=args.warmup, schedule=args.lr_schedule,
                      weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                      val_every=args.steps_per_eval, save_every=args.save_every, seed=args.seed)
    fingerprint = {"base": DEFAULT_BASE, "model": vars(model.config), "lora": vars(lora), "dtype": args.dtype}
    trainer = Trainer(model, cfg, train, valid, out_dir=args.adapter_path, fingerprint=fingerprint,
                      base_model=DEFAULT_BASE, progress=not args.quiet)
    n_lora = model.lora_params.numel
    print(f"krnl {krnl.__version__} on {dev.name}: tiny Llama ({model.config.num_hidden_layers} layers, hidden "
          f"{model.config.hidden_size}, GQA {model.config.num_attention_heads}/{model.config.num_key_value_heads}), "
          f"LoRA r={lora.r} on {len(model.adapted)} modules ({n_lora} trainable parameters), {args.dtype}")
    if args.resume:
        print(f"resumed from step {trainer.resume()}")
    summary = trainer.run()
    png = Path(args.adapter_path) / "loss.png"
    plot_metrics(summary["metrics"], png)
    print(f"step {summary['steps']}: train loss {summary['loss']:.4f}, validation loss {summary['val_loss']:.4f}"
          + (f", {summary['skipped_steps']} skipped steps" if summary["skipped_steps"] else ""))
    print(f"adapter: {args.adapter_path}/adapter_model.safetensors (PEFT format); metrics: {summary['metrics']}; "
          f"loss curve: {png}")
    print(f"try: krnl generate --adapter-path {args.adapter_path} --prompt '+2c>'")
    return 0


def cmd_eval(args):
    from .default_task import make_split

    dev = krnl.device(args.device)
    tok, model = _load_trained(args, dev)
    ids, tg = make_split(tok, args.samples, seed=args.seed + 300)
    loss = float(np.mean([model.loss(ids[i:i + 64], tg[i:i + 64]) for i in range(0, len(ids), 64)]))
    print(f"test loss {loss:.4f} (ppl {np.exp(loss):.3f}) on {len(ids)} generated samples")
    return 0


def cmd_generate(args):
    dev = krnl.device(args.device)
    tok, model = _load_trained(args, dev)
    ids = tok.encode(args.prompt)
    out = model.generate(ids, max_new_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p,
                         seed=args.seed, eos_id=tok.eos_id)
    print(args.prompt + tok.decode(out))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="krnl", description="LoRA fine-tuning engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("devices", help="list the devices this build can use").set_defaults(fn=cmd_devices)

    def common(q):
        q.add_argument("--device", default=None, help="cpu, ... (default: best available)")
        q.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"], help="compute dtype")
        q.add_argument("--seed", type=int, default=0)

    t = sub.add_parser("train", help="LoRA fine-tune (default: the embedded tiny model and task)")
    common(t)
    t.add_argument("--adapter-path", default="adapters", help="output folder: adapter, checkpoints, metrics")
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
    e.add_argument("--samples", type=int, default=256)
    e.set_defaults(fn=cmd_eval)

    g = sub.add_parser("generate", help="sample from the model with a trained adapter (KV-cached)")
    common(g)
    g.add_argument("--adapter-path", default="adapters")
    g.add_argument("--prompt", default="+2c>")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temp", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.set_defaults(fn=cmd_generate)

    w = sub.add_parser("w1", help="train LoRA on the W1 MLP block to match a teacher (a small, real LoRA run)")
    w.add_argument("--device", default=None, help="cpu, ... (default: best available)")
    w.add_argument("--steps", type=int, default=10)
    w.add_argument("--tokens", type=int, default=512)
    w.add_argument("--width", type=int, default=2048)
    w.add_argument("--ffn", type=int, default=5632)
    w.add_argument("--rank", type=int, default=32)
    w.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    w.add_argument("--learning-rate", type=float, default=1e-2)
    w.add_argument("--seed", type=int, default=0)
    w.set_defaults(fn=cmd_w1)
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
