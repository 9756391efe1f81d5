"""Where krnl bench's W3 figure parts from the traced one: the same recorded W3 step (krnl.bench.w2)
replayed under several timing patterns, each replay timed on the host.

    python3 dev/cuda/w3_timing.py [rounds]

- paused:   a 0.3 s pause (krnl bench's on a CPU; on a GPU it pauses not at all), then a sample
            of as many replays as krnl bench takes (7), each waited for;
- eager, graph: the same, each sample after one of the eager step (6 steps), as krnl bench
            interleaves "krnl" and "krnl graph";
- nopause:  the samples back to back, as krnl bench takes them on a GPU;
- queued:   50 replays launched together, one wait;
- sustained: 300 replays, each waited for (about 2 s of load), in blocks of 30.
Each line gives the replays' times in ms (first, median of the rest) and the wall clock at its
start, so that nvidia-smi's samples of the SM clock taken alongside line up with it."""
import sys
import time

import numpy as np

from krnl.bench import w2
from krnl.bench.session import SETTLE_S, sample_reps


def wall():
    return time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"


def timed_reps(step, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return np.array(out) * 1e3


def show(label, ms, at):
    print(f"{label:<12} {at}  n={len(ms):<3} first {ms[0]:6.3f}  rest median {np.median(ms[1:]):6.3f}"
          f"  min {ms.min():6.3f}  max {ms.max():6.3f}  mean {ms.mean():6.3f}", flush=True)


def main(rounds=5):
    case = w2.Case.of(w2.W3, device="cuda", dtype="bf16")
    dev = case.dev
    step = w2.build_krnl_graph(case)[0]
    graph = step.graph
    eager = w2.build_krnl(case)[0]
    for _ in range(5):
        step()
    once = float(np.median(timed_reps(step, 5))) / 1e3
    n = sample_reps(once)
    print(f"W3 replayed; a sample is {n} replays", flush=True)
    for r in range(rounds):
        time.sleep(SETTLE_S)
        at = wall()
        show(f"paused {r}", timed_reps(step, n), at)
    ne = sample_reps(float(np.median(timed_reps(eager, 3))) / 1e3)
    for r in range(rounds):
        time.sleep(SETTLE_S)
        at = wall()
        show(f"eager {r}", timed_reps(eager, ne), at)
        time.sleep(SETTLE_S)
        at = wall()
        show(f"graph {r}", timed_reps(step, n), at)
    time.sleep(1.0)
    for r in range(rounds):
        at = wall()
        show(f"nopause {r}", timed_reps(step, n), at)
    for r in range(3):
        at = wall()
        t0 = time.perf_counter()
        for _ in range(50):
            graph.replay()
        dev.synchronize()
        print(f"queued {r}     {at}  50 replays, {(time.perf_counter() - t0) * 1e3 / 50:6.3f} ms each", flush=True)
    time.sleep(1.0)
    for b in range(10):
        at = wall()
        show(f"sustained {b}", timed_reps(step, 30), at)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
