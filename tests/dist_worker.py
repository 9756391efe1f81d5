"""Run by tests/test_dist.py, alone and under mpiexec: one optimizer step's gradient of the tiny
model over two micro-batches of a global batch of 6 rows whose rows hold unequal target counts
(so each rank's slice has its own count), summed over the ranks by StepRunner.reduce. Rank 0
writes the summed flat gradient and the step's loss to the .npz named by argv[1]."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import krnl  # noqa: E402
from conftest import tiny_lora_model  # noqa: E402
from krnl.train.dist import world as dist  # noqa: E402
from krnl.train.optim import AdamW, Schedule  # noqa: E402
from krnl.train.step import StepRunner  # noqa: E402

B, T, ACCUM = 6, 11, 2


def batches(vocab):
    rng = np.random.default_rng(5)
    out = []
    for _ in range(ACCUM):
        ids = rng.integers(0, vocab, (B, T)).astype(np.int32)
        tg = np.roll(ids, -1, axis=1)
        for b in range(B):  # row b learns only its last 2 + b tokens (no target at all in row 0 of batch 1)
            tg[b, :T - 2 - b] = -100
        tg[:, -1] = -100
        out.append((ids, tg))
    out[1][1][0, :] = -100
    return out


def main(path):
    world = dist.world()
    m = tiny_lora_model(krnl.device("cpu"), "f32")
    runner = StepRunner(m, AdamW(m.lora_params, Schedule(1e-3, total_steps=10)), micro_batches=ACCUM, world=world)
    for i, batch in enumerate(batches(m.config.vocab_size)):
        n = int(np.count_nonzero(batch[1] != -100))
        if world.size > 1:
            runner.micro_batch(world.slice(batch), 1.0, i, n)
        else:
            runner.micro_batch(batch, 1.0, i)
    runner.reduce(1)
    flat = m.lora_params
    grads = np.array(flat.grads.numpy()[:flat.numel], np.float32)
    sums = runner.reduced if runner.reduced is not None else runner.losses.numpy()
    loss = float(np.mean([s / max(n, 1) for s, n in zip(np.asarray(sums, np.float64), runner.n_valid)]))
    if world.root:
        np.savez(path, grads=grads, loss=loss, offsets=np.array([flat.offsets[k] for k in flat.offsets]))


if __name__ == "__main__":
    main(sys.argv[1])
