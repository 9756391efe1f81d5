"""The device-level commands of the `krnl` command line: `devices` (what each device can do, and
why any other is unavailable here) and `w1` (LoRA on the W1 MLP block of docs/performance.md,
matching a teacher), which need no model folder, tokenizer or data; and the --device/--dtype
choice every command shares."""

import json
import sys
import time

import numpy as np

import krnl

from ..models.mlp_block import MLPBlock, make_w1_params, w1_flops
from ..bench.tune import load as load_tuning

ops = krnl.ops


def _describe(caps):
    """A device's capabilities on one line: key=value, the hardware details last."""
    fa = caps["fused_attention"]
    extras = [w for w in ("segments", "window") if fa[w]] + (["D=" + "/".join(map(str, fa["head_dims"]))]
                                                              if fa["head_dims"] else [])
    fused = "+".join([",".join(fa["dtypes"])] + extras) if fa["dtypes"] else "-"
    yn = lambda b: "yes" if b else "no"
    parts = [f"kind={caps['kind']}", f"dtypes={','.join(caps['dtypes'])}", f"compute={caps['compute_dtype']}",
             f"fused_attention={fused}", f"attention_block={caps['attention_block'] or 'all'}",
             f"graphs={yn(caps['graphs'])}", f"host_visible={yn(caps['host_visible'])}",
             f"synchronous={yn(caps['synchronous'])}", f"queue_ordered={yn(caps['queue_ordered'])}",
             f"gemm_tuning={yn(caps['gemm_tuning'])}", f"collectives={','.join(caps['collectives']) or '-'}"]
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


def device_from_args(args):
    """The device of --device (the best available by default); a --dtype left out becomes the
    device's training dtype (its capabilities' compute_dtype)."""
    dev = krnl.device(args.device)
    load_tuning(dev)  # this GPU's GEMM variant choices (krnl tune), where a cache entry exists
    if getattr(args, "dtype", None) is None:
        args.dtype = dev.capabilities()["compute_dtype"]
    return dev


def cmd_w1(args):
    dev = device_from_args(args)
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


def quantize_from_args(args):
    """(bits, group_size), or (4, 32, "mxfp4") with --q-mode mxfp4, from --q-bits / --q-group-size;
    None without either (no quantization)."""
    bits, gs, mode = getattr(args, "q_bits", None), getattr(args, "q_group_size", None), getattr(args, "q_mode", "affine")
    if mode == "mxfp4":
        if bits not in (None, 4) or gs not in (None, 32):
            raise ValueError(f"[quantize] --q-mode mxfp4 takes 4 bits in groups of 32, got --q-bits {bits} "
                             f"--q-group-size {gs}")
        return 4, 32, mode
    return None if bits is None else (bits, gs or 64)
