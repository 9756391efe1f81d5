"""The train workload (docs/performance.md, 'Training end to end'; defined in krnl/bench/train.py):
`krnl train` on a whole Llama-shaped model from an HF folder, krnl's Trainer next to transformers +
PEFT eager on the same folder and batches, in the same run. This file only times them with
pytest-benchmark (one round each: a round is a whole training run, model loading and warm-up
steps included); the steady tokens/s each run measures (warm-up steps excluded) and their ratio
are printed in the terminal summary.

Sizes: on a GPU the "1b" shape (Llama-3.2-1B's layer x16, seq 2048, batch 4); on the CPU one such
layer at seq 256, batch 1; KRNL_BENCH_TRAIN_SHAPE=quick|1b|8b chooses another.

Run: cd /work/main && PYTHONPATH=python python -m pytest bench/test_train.py --benchmark-only -s -q
"""

import os

import pytest

import krnl
from krnl.bench import train
from krnl.bench.targets import compute_dtype, is_gpu
from krnl.bench.train_peers import run_peft


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    dev = krnl.device()
    gpu = is_gpu(dev)
    name = os.environ.get("KRNL_BENCH_TRAIN_SHAPE")
    if name:
        s = train.shape(name)
    elif gpu:
        s = train.shape("1b")
    else:  # a whole 1B model would take the CPU hours: one of its layers, shorter rows
        s = train.shape("1b", layers=1, seq=256, batch=1, steps=3, warmup=1)
    folder = train.write_folder(s, tmp_path_factory.mktemp("train") / "model")
    return dev, compute_dtype(dev), s, folder, train.batches(s)


def _record(benchmark, results, name, r, s):
    benchmark.extra_info.update(tokens_per_s=r["tokens_per_s"], loss=r["loss"], warmup_s=r["warmup_s"])
    results[name] = r
    print(f"\n{name}: {r['tokens_per_s']:,.0f} tokens/s over {r['samples']} steps after {s['warmup']} "
          f"({r['warmup_s']:.1f} s), loss {r['first_loss']:.4f} -> {r['loss']:.4f}")


def test_train_krnl(benchmark, case, results):
    dev, dtype, s, folder, bs = case
    benchmark.group = "train: one run"
    r = benchmark.pedantic(lambda: train.run_krnl(dev, dtype, folder, s, bs), rounds=1, warmup_rounds=0)
    _record(benchmark, results, "train krnl", r, s)
    assert r["tokens_per_s"] > 0


def test_train_peft_eager(benchmark, case, results):
    for mod in ("torch", "transformers", "peft"):
        pytest.importorskip(mod, reason=f"{mod} (an optional bench peer) is not installed")
    dev, dtype, s, folder, bs = case
    benchmark.group = "train: one run"
    r = benchmark.pedantic(lambda: run_peft(dev.name, dtype, folder, s, bs), rounds=1, warmup_rounds=0)
    _record(benchmark, results, "train PEFT eager", r, s)
    k = results.get("train krnl")
    if k:
        results.setdefault("_lines", []).append(
            f"train ({train.describe(s)}; {dtype}, {dev.name}): krnl {k['tokens_per_s']:,.0f} tokens/s, PEFT eager "
            f"{r['tokens_per_s']:,.0f}: krnl / PEFT eager {k['tokens_per_s'] / r['tokens_per_s']:.2f}x; first losses "
            f"{k['first_loss']:.4f} and {r['first_loss']:.4f}")
        print(results["_lines"][-1])
