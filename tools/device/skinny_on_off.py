"""krnl's training step with the CUDA skinny GEMM (csrc/cuda/skinny_gemm.h) on and off
(KRNL_CUDA_SKINNY_GEMM, read at every GEMM), in one process on one folder and the same batches,
timed as `krnl bench --workloads train` times krnl (bench/train.py's run_krnl): the replayed step
in interleaved rounds, then one eager run each way whose last step is profiled, giving the LoRA
products' time (the GEMMs with M, N or K of 16, 32 or 48) and their share of the op time.

    python3 tools/device/skinny_on_off.py [--shape 1b] [--rounds 2] [--json PATH] [--device cuda]
"""
import argparse
import json
import os
import re
import tempfile
from pathlib import Path

import krnl
from krnl.bench.train import batches, run_krnl, shape, write_folder

LORA_DIMS = {16, 32, 48}


def lora_part(profile):
    """(ms, share of the op time, calls) of the LoRA products in a profile table."""
    ms = share = calls = 0
    for r in profile["rows"]:
        if r["op"] == "gemm" and LORA_DIMS & {int(v) for v in re.findall(r"[MNK]=(\d+)", r["shape"])}:
            ms, share, calls = ms + r["ms"], share + r["share"], calls + r["calls"]
    return ms, share, calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1b")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    dev, s = krnl.device(a.device), shape(a.shape)
    out = {"shape": a.shape, "replayed": {"1": [], "0": []}, "eager": {}}
    with tempfile.TemporaryDirectory(prefix="krnl-skinny-") as tmp:
        folder = write_folder(s, Path(tmp) / "model")
        bs = batches(s)
        for _ in range(a.rounds):
            for sw in ("1", "0"):
                os.environ["KRNL_CUDA_SKINNY_GEMM"] = sw
                r = run_krnl(dev, "bf16", folder, s, bs, graphs=True)
                out["replayed"][sw].append(r["tokens_per_s"])
                print(f"replayed skinny={sw}: {r['tokens_per_s']:,.0f} tokens/s, {r['ms']:.2f} ms/step, "
                      f"loss {r['loss']:.5f}", flush=True)
        for sw in ("1", "0"):
            os.environ["KRNL_CUDA_SKINNY_GEMM"] = sw
            r = run_krnl(dev, "bf16", folder, s, bs, graphs=False, profile=True)
            ms, share, calls = lora_part(r["profile"])
            out["eager"][sw] = {"tokens_per_s": r["tokens_per_s"], "ms": r["ms"], "loss": r["loss"],
                                "lora_gemm_ms": ms, "lora_gemm_share": share, "lora_gemm_calls": calls,
                                "op_ms": r["profile"]["op_ms"], "profile": r["profile"]}
            print(f"eager skinny={sw}: {r['tokens_per_s']:,.0f} tokens/s, {r['ms']:.2f} ms/step, loss {r['loss']:.5f}; "
                  f"profiled step: LoRA GEMMs {ms:.2f} ms in {calls} calls = {100 * share:.1f}% of "
                  f"{r['profile']['op_ms']:.1f} ms", flush=True)
            for row in r["profile"]["rows"]:
                if row["op"] == "gemm" and LORA_DIMS & {int(v) for v in re.findall(r"[MNK]=(\d+)", row["shape"])}:
                    print(f"  {row['shape']:28s} {row['calls']:4d} calls {1e3 * row['ms'] / row['calls']:7.1f} us",
                          flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
