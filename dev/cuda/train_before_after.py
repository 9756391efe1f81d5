"""krnl's Trainer on an HF folder, timed as `krnl bench --workloads train` times krnl (steps
stamped after a synchronize, warm-up steps apart), with whichever krnl is first on PYTHONPATH:
the same script runs an earlier tree and the current one on the same folder and batches, so a
change's before and after are measured in one session.

    python3 train_before_after.py write DIR --shape 1b      # (current tree) the folder and batches
    python3 train_before_after.py time DIR --label before   # (any tree) one JSON line of figures
"""
import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


class _Done(Exception):
    pass


def write(folder, shape_name):
    from krnl.bench.train import batches, shape, write_folder
    s = shape(shape_name)
    write_folder(s, Path(folder) / "model")
    bs = batches(s)
    np.savez(Path(folder) / "batches.npz", ids=np.stack([b.ids for b in bs]), targets=np.stack([b.targets for b in bs]),
             tokens=np.array([b.tokens for b in bs]), warmup=s["warmup"], B=s["B"])


def time_run(folder, label, device, dtype):
    import krnl
    from krnl.models.config import LoraConfig
    from krnl.formats.hf import load_model
    from krnl.train.trainer import TrainConfig, Trainer
    z = np.load(Path(folder) / "batches.npz")
    ids, tg, toks, warm = z["ids"], z["targets"], z["tokens"], int(z["warmup"])
    dev = krnl.device(device)
    model = load_model(str(Path(folder) / "model"), dev, lora=LoraConfig(r=16, alpha=32.0), dtype=dtype, seed=0)
    gc.collect()
    dev.synchronize()
    dev.reset_peak()
    n = len(ids)

    class Source:
        i = 0

        def next(self):
            self.i += 1
            return ids[(self.i - 1) % n], tg[(self.i - 1) % n]

        def state(self):
            return {"i": self.i}

        def load_state(self, st):
            self.i = st["i"]

    stamps, losses = [], []

    def on_step(step, rec):
        dev.synchronize()
        stamps.append(time.perf_counter())
        losses.append(rec["loss"])
        if step == n:
            raise _Done

    cfg = TrainConfig(iters=n + 1, batch_size=int(z["B"]), learning_rate=1e-4, warmup=0, schedule="constant",
                      max_grad_norm=1.0, val_every=0, save_every=10**9, seed=0)
    with tempfile.TemporaryDirectory() as out:
        tr = Trainer(model, cfg, Source(), out_dir=out, progress=False, on_step=on_step)
        stamps.insert(0, time.perf_counter())
        try:
            tr.run()
        except _Done:
            pass
    dt = np.diff(stamps)[warm:]
    print(json.dumps({"label": label, "krnl": krnl.__file__, "tokens_per_s": float(toks[warm:].sum() / dt.sum()),
                      "ms": 1e3 * float(dt.mean()), "spread": float(dt.max() / dt.min()), "loss": losses[-1],
                      "peak_gib": dev.pool_stats()["peak_reserved"] / 2**30}), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("write", "time"))
    p.add_argument("folder")
    p.add_argument("--shape", default="1b")
    p.add_argument("--label", default="")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    a = p.parse_args()
    write(a.folder, a.shape) if a.what == "write" else time_run(a.folder, a.label, a.device, a.dtype)
    sys.exit(0)
