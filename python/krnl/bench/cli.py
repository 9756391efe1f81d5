"""`krnl bench` (also `python -m krnl.bench`): the options and what runs them."""

import argparse
import sys

from . import gate, report
from .session import Session
from .workloads import ALL, KNOWN, PEER_NAMES

UNTRUSTED_EXIT = 2  # the session ran, but the gate says its figures are not measurements


def _names(value, known, option):
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in names if v not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{option}: unknown {unknown or value!r}; choose from {', '.join(known)}")
    return names


def add_arguments(p):
    p.add_argument("--workloads", default=",".join(ALL), type=lambda v: _names(v, KNOWN, "--workloads"),
                   help=f"comma-separated, of {','.join(KNOWN)} (default: {','.join(ALL)}; w3, qlora, moe, dpo, grpo, "
                        "serve, full, train and long run only on GPU devices, except with --quick)")
    p.add_argument("--peers", default=",".join(PEER_NAMES), type=lambda v: _names(v, PEER_NAMES, "--peers"),
                   help=f"comma-separated, of {','.join(PEER_NAMES)} (default: all; liger and unsloth, CUDA only, "
                        "are peers of the train, long and qlora workloads)")
    p.add_argument("--device", default=None, help="krnl device (default: the best available)")
    p.add_argument("--dtype", choices=("f32", "bf16", "f16"), default=None,
                   help="compute dtype of every implementation (default: the device's compute dtype, see "
                        "`krnl devices`: f32 on the CPU, bf16 on CUDA, f16 on Metal)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    p.add_argument("--slow", type=float, default=10.0, metavar="S",
                   help="a peer whose step takes more than S seconds is timed once, not every round")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds, for tests)")
    g = p.add_argument_group("the train and long workloads (`krnl train` end to end, bench/train.py; long: its 8b "
                             "shape at 16k and 32k tokens a row, batch 1, checkpointed, bench/train_long.py)")
    g.add_argument("--train-shape", choices=("1b", "8b", "quick"), default=None,
                   help="1b: Llama-3.2-1B's layer x16, seq 2048, batch 4; 8b: Llama-3-8B's layer x8, seq 4096, "
                        "batch 2; quick: a tiny model (default: quick with --quick, else 1b)")
    for opt, what in (("layers", "decoder layers (default: the shape's)"), ("seq", "tokens per row (default: the "
                      "shape's)"), ("batch", "rows per step (default: the shape's)"), ("steps", "timed steps "
                      "(default 10; quick: 3)"), ("warmup", "untimed steps before them (default 3; quick: 1)")):
        g.add_argument(f"--train-{opt}", type=int, default=None, metavar="N", help=what)
    g.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="N > 1: data-parallel training, krnl under `mpiexec -n N` and PyTorch DDP + PEFT under "
                        "torchrun, at 1 and N ranks of --train-shape's batch each, side by side with the scaling "
                        "efficiency (on the CPU: N CPU ranks sharing its cores)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--png", metavar="PATH", help="write a bar chart (tokens/s per workload and implementation)")
    p.add_argument("--profile", action="store_true", help="also print the per-op profile of one step (W2; W3 on a GPU; with --workloads train alone, one eager krnl training step)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the control sgemm on a quiet machine and store it as this machine's reference; "
                        "nothing else runs")
    p.add_argument("--reference", metavar="PATH", default=None,
                   help=f"the reference file (default: $KRNL_BENCH_REFERENCE or {gate.reference_path()})")
    p.add_argument("--readme", metavar="PATH",
                   help="replace the device kind's <!-- bench:KIND:start --> ... <!-- bench:KIND:end --> block of "
                        "this file (docs/performance.md) with the results")
    p.add_argument("--from-json", metavar="PATH",
                   help="run nothing: report (table, --png, --readme) from a JSON written by --json")


def train_options(args):
    """The --train-* options as bench/train.py takes them (None: the shape's own)."""
    opts = {k: getattr(args, f"train_{k}", None) for k in ("layers", "seq", "batch", "steps", "warmup")}
    gpus = getattr(args, "gpus", 1)
    if gpus < 1:
        raise ValueError(f"[krnl bench] --gpus must be >= 1, got {gpus}")
    return dict(opts, shape=getattr(args, "train_shape", None), gpus=gpus)


def cmd_bench(args):
    ref_path = args.reference or gate.reference_path()
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.calibrate:
        import krnl
        dev = krnl.device(args.device)
        c = gate.calibrate(dev, ref_path, quick=args.quick)
        print(f"krnl bench: reference for '{c['key']}': control {c['n']}^3 sgemm {c['gflops']:.1f} GFLOP/s, "
              f"written to {c['path']}")
        return 0
    if args.from_json:
        res = report.read_json(args.from_json)
    else:
        import krnl
        from .tune import load as load_tuning

        load_tuning(krnl.device(args.device))  # the GEMM variants `krnl tune` chose for this GPU, if any
        log = lambda msg: print(msg, file=sys.stderr, flush=True)
        s = Session(args.device, rounds=args.rounds, quick=args.quick, peers=args.peers, slow_s=args.slow,
                    reference_path=ref_path, log=log, dtype=args.dtype, train=train_options(args))
        res = s.run(args.workloads, profile=args.profile)
    print(report.format_table(res))
    if res.get("profile") and (args.profile or args.from_json):
        print()
        print(report.format_profile(res["profile"]))
    if args.json and not args.from_json:
        report.write_json(res, args.json)
    if args.png:
        report.write_png(res, args.png)
    if args.readme:
        report.replace_readme_block(args.readme, report.readme_block(res), report.result_kind(res))
    if not res["trusted"] and not args.from_json:
        print("krnl bench: the control gate failed: the figures above are untrusted (exit status 2)", file=sys.stderr)
        return UNTRUSTED_EXIT
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="krnl bench", description="krnl and its peers, side by side, behind a control gate")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return cmd_bench(args)
    except ValueError as err:
        print(f"krnl bench: error: {err}", file=sys.stderr)
        return 1
