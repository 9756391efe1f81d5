"""`krnl bench --workloads train --gpus N`: data-parallel training, 1 and N ranks side by side.

krnl's Trainer runs as one process and under `mpiexec -n N` (krnl.train.dist.world: NCCL between CUDA ranks
where it loads, MPI through host memory otherwise); transformers + PEFT under PyTorch DDP runs
under torchrun with 1 and N processes (NCCL on CUDA, gloo on the CPU). Each rank trains on the
shape's batch (B rows), so N ranks train on global batches of N B rows: tokens/s of the global
batch, and the scaling efficiency = tokens/s of N ranks / (N x tokens/s of one). Every run is its
own launch of train_worker.py on the same model folder and batches; rank 0 writes its figures.
On a CPU device the ranks are CPU processes sharing the machine's cores (--quick: the plumbing)."""

import shutil
import sys
import tempfile
from pathlib import Path

from . import train
from .spawn import LAUNCH_TIMEOUT_S, launch
from .targets import is_gpu
from .train import describe, note, write_folder

QUICK_TIMEOUT_S = 300  # the quick shape's launch: a wedged rank fails its row instead of the run


def mpiexec():
    """MPICH's launcher beside this Python (pip install 'krnl[mpi]'), else one on PATH, else None."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def commands(ranks, on_gpu):
    """{impl: (command before SPEC.json, or None, why not)} for `ranks` processes."""
    worker = [sys.executable, "-m", "krnl.bench.train_worker"]
    unit = "GPU" if on_gpu else "rank"
    name = f"{ranks} {unit}{'s' if ranks > 1 else ''}"
    out = {}
    if ranks == 1:
        out[f"krnl {name}"] = (worker + ["krnl"], None)
    else:
        mpi = mpiexec()
        out[f"krnl {name}"] = (([mpi, "-n", str(ranks)] + worker + ["krnl"]) if mpi else None,
                               "no mpiexec: pip install 'krnl[mpi]'")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m",
           "krnl.bench.train_worker", "ddp"]
    out[f"DDP+PEFT {name}"] = (run, None)
    return out


def session_rows(session, opts, profile=False):
    """The train workload's rows: train.session_rows', or with opts["gpus"] = N > 1, the rows of
    1 and N ranks (the shape as train.shape makes it from the other --train-* options)."""
    opts = dict(opts or {})
    ranks = opts.pop("gpus", None) or 1
    if ranks == 1:
        return train.session_rows(session, opts, profile=profile)
    name = opts.pop("shape", None) or ("quick" if session.quick else "1b")
    s, gpu = train.shape(name, **opts), is_gpu(session.dev)
    if name != "quick" and not gpu:
        return [dict(impl="krnl", status="skipped", reason=f"the {name} shape is sized for a GPU; --quick (or "
                                                            f"--train-shape quick) runs a small one here")]
    session.log(f"krnl bench: train over 1 and {ranks} ranks ({describe(s)} per rank)")
    return rows(session, s, ranks, gpu)


def rows(session, s, ranks, on_gpu):
    """The rows of krnl and PyTorch DDP + PEFT at 1 and `ranks` ranks; the N-rank rows carry
    "speedup" and "scaling" (efficiency) against their own 1-rank row."""
    kind = session.dev.capabilities()["kind"]
    want_torch = "torch" in session.peers
    title = f"Data-parallel training, 1 and {ranks} ranks ({describe(s)} per rank; {session.dtype})"
    out = []
    with tempfile.TemporaryDirectory(prefix="krnl-bench-model-") as tmp:
        folder = write_folder(s, Path(tmp) / "model")
        spec = {"folder": str(folder), "shape": s, "device": session.dev.name, "kind": kind, "dtype": session.dtype}
        single = {}
        for n in (1, ranks):
            for impl, (cmd, why) in commands(n, on_gpu).items():
                peft = impl.startswith("DDP")
                if peft and not want_torch:
                    out.append(dict(impl=impl, status="absent", reason="not selected (--peers torch)"))
                    continue
                if cmd is None:
                    out.append(dict(impl=impl, status="absent", reason=why))
                    continue
                # gloo (DDP on the CPU) on the loopback: one machine, whatever the hostname resolves to
                env = None if on_gpu else {"GLOO_SOCKET_IFNAME": "lo"}
                wait = QUICK_TIMEOUT_S if s.get("name") == "quick" else LAUNCH_TIMEOUT_S
                retried = None
                for _ in range(2 if peft else 1):  # the peer's launch once more: its failures are not krnl's
                    try:
                        r = launch(cmd, spec, session.log, env, wait)
                        break
                    except Exception as e:  # listed with what broke; the other rows still run
                        retried, r = f"failed: {e}"[:240], None
                        session.log(f"krnl bench: train {impl}: {retried}")
                if r is None:
                    out.append(dict(impl=impl, status="absent", reason=retried))
                    continue
                if retried:
                    r["retried"] = retried
                r["impl"] = impl
                key = "ddp" if peft else "krnl"
                if n == 1:
                    single[key] = r["tokens_per_s"]
                elif key in single:
                    r["speedup"] = r["tokens_per_s"] / single[key]
                    r["scaling"] = r["speedup"] / n
                session.log(f"krnl bench: train {impl}: {r['tokens_per_s']:,.0f} tokens/s")
                out.append(r)
    base = {r["ranks"]: r["tokens_per_s"] for r in out if r.get("status", "ok") == "ok" and r["impl"].startswith("krnl")}
    for r in out:
        r.update(title=title, dtype=session.dtype)
        if r.get("status", "ok") != "ok":
            continue
        r["vs_krnl"] = r["tokens_per_s"] / base[r["ranks"]] if r["ranks"] in base else None
        if not on_gpu:
            r["peak_bytes"] = r["peak_kind"] = None
        extra = [f"x{r['speedup']:.2f} over 1 rank, scaling {100 * r['scaling']:.0f}%"] if "speedup" in r else []
        if r.get("allreduce"):
            extra.append(r["allreduce"])
        if r.get("retried"):
            extra.append(f"ran on a second launch, the first {r['retried']}")
        r["note"] = ", ".join(extra + [note(r)])
    return out
