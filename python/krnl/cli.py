"""The `krnl` command line. `krnl w1` trains LoRA adapters of the W1 MLP block (DESIGN section 6)
to match a teacher block, printing the loss and the step time."""

import argparse
import sys
import time

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


def main(argv=None):
    p = argparse.ArgumentParser(prog="krnl", description="LoRA fine-tuning engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("devices", help="list the devices this build can use").set_defaults(fn=cmd_devices)
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
    for name in ("steps", "tokens", "width", "ffn", "rank"):
        if getattr(args, name, 1) < 1:
            p.error(f"--{name} must be >= 1")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
