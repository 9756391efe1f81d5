"""Every kernel of krnl's replayed train step, timed by the GPU: torch.profiler's CUPTI trace of
the process records the kernels of krnl's CUDA graph replays with their own durations, without
the per-op waits of `krnl bench --profile` (whose figures add host time to every op).

    python3 dev/cuda/train_before_after.py write /tmp/f8 --shape 8b
    python3 dev/cuda/step_kernels.py /tmp/f8 kernels.tsv     # steps 7 and 8 of a Trainer run
    python3 dev/cuda/step_kernels.py w3 kernels.tsv          # 3 replays of krnl bench's W3 step

Prints each kernel name's time and count per step, and the idle time between kernels; kernels.tsv
lists every kernel in order (start us, duration us, name), which maps them to the layer's ops."""
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import krnl
from krnl.models.config import LoraConfig
from krnl.formats.hf import load_model
from krnl.train.trainer import TrainConfig, Trainer

FIRST, LAST = 6, 8  # the profile covers steps FIRST+1..LAST, long after the graph was recorded


class _Done(Exception):
    pass


def trace_w3(replays=3):
    """CUDA events of `replays` replays of W3's recorded step (krnl.bench.w2), after 5 warm ones."""
    from krnl.bench import w2
    case = w2.Case.of(w2.W3, device="cuda", dtype="bf16")
    step, _ = w2.build_krnl_graph(case)
    for _ in range(5):
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            step()
    return prof, replays


def trace_train(folder):
    """CUDA events of steps FIRST+1..LAST of a Trainer run on the batches in `folder`."""
    z = np.load(Path(folder) / "batches.npz")
    ids, tg = z["ids"], z["targets"]
    dev = krnl.device("cuda")
    model = load_model(str(Path(folder) / "model"), dev, lora=LoraConfig(r=16, alpha=32.0), dtype="bf16", seed=0)

    class Source:
        i = 0

        def next(self):
            self.i += 1
            return ids[(self.i - 1) % len(ids)], tg[(self.i - 1) % len(ids)]

        def state(self):
            return {"i": self.i}

        def load_state(self, st):
            self.i = st["i"]

    prof = profile(activities=[ProfilerActivity.CUDA])

    def on_step(step, rec):
        dev.synchronize()
        if step == FIRST:
            prof.start()
        elif step == LAST:
            prof.stop()
            raise _Done

    cfg = TrainConfig(iters=LAST + 1, batch_size=int(z["B"]), learning_rate=1e-4, warmup=0, schedule="constant",
                      max_grad_norm=1.0, val_every=0, save_every=10**9, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            Trainer(model, cfg, Source(), out_dir=tmp, progress=False, on_step=on_step).run()
        except _Done:
            pass
    return prof, LAST - FIRST


def main(what, out):
    prof, steps = trace_w3() if what == "w3" else trace_train(what)
    rows = sorted((e.time_range.start, e.time_range.end - e.time_range.start, e.name)
                  for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    with open(out, "w") as f:
        f.writelines(f"{t0:.1f}\t{dur:.1f}\t{name[:160]}\n" for t0, dur, name in rows)
    total = {}
    for _, dur, name in rows:
        n, s = total.get(name[:90], (0, 0.0))
        total[name[:90]] = (n + 1, s + dur)
    span = (rows[-1][0] + rows[-1][1] - rows[0][0]) / 1e3
    print(f"{steps} steps: {len(rows)} kernels, span {span:.2f} ms, kernels {sum(r[1] for r in rows) / 1e3:.2f} ms")
    # idle time before each kernel (its start after the previous one's end), under 50 us: the
    # gaps inside a replay, not the host's time between two replays
    idle = [max(0.0, b[0] - a[0] - a[1]) for a, b in zip(rows, rows[1:])]
    inside = [g for g in idle if g < 50]
    print(f"idle between kernels: {sum(inside) / steps / 1e3:.3f} ms/step over {len(inside) // steps} gaps, "
          f"median {np.median(inside) if inside else 0:.2f} us")
    for name, (n, s) in sorted(total.items(), key=lambda kv: -kv[1][1])[:45]:
        print(f"{s / steps / 1e3:8.3f} ms/step {n // steps:5d}/step  {name}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
