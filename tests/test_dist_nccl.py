"""The NCCL path of data-parallel training (krnl.train.dist.nccl, csrc/cuda/nccl_api.cpp, nccl_comm.cpp).

Everywhere (no GPU, no NCCL needed): the loader's one-line errors (no library, a bad KRNL_NCCL
path, a library lacking a symbol, an NCCL older than 2.9) and its answers on a stand-in library
compiled here; the choice between NCCL and the MPI host path from every rank's answers; the
host path chosen, with its line on rank 0, when the ranks are CPU devices (`mpi` marker: two
ranks under mpiexec); StepRunner's device-side sum against its host path, with a stand-in sum;
`krnl bench --workloads train --gpus 2` on two CPU ranks. On a CUDA device with NCCL: a one-rank communicator's allreduce, eager and
recorded into a replayed graph, and a one-rank `krnl train` through NCCL against the host path.
Two GPUs are needed for the sum itself over ranks; no test here has them."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import krnl
from krnl import _core
from krnl.train.dist import world as dist, nccl as dist_nccl
from test_dist import _mpiexec

HERE = Path(__file__).parent

# A stand-in libnccl: every symbol the loader resolves, ncclGetVersion answering VERSION,
# ncclGetUniqueId writing bytes 0..127; OMIT leaves one symbol out.
FAKE = textwrap.dedent("""
    typedef struct { char internal[128]; } fake_id;
    int ncclGetVersion(int* v) { *v = VERSION; return 0; }
    int ncclGetUniqueId(fake_id* id) { for (int i = 0; i < 128; ++i) id->internal[i] = (char)i; return 0; }
    int ncclCommInitRank(void** c, int n, fake_id id, int r) { (void)id; *c = 0; return n > r ? 5 : 4; }
    int ncclAllReduce(const void* s, void* r, unsigned long n, int t, int o, void* c, void* st) { return 5; }
    int ncclCommDestroy(void* c) { return 0; }
    int ncclCommAbort(void* c) { return 0; }
    #ifndef OMIT_ASYNC
    int ncclCommGetAsyncError(void* c, int* e) { *e = 0; return 0; }
    #endif
    int ncclGroupStart(void) { return 0; }
    int ncclGroupEnd(void) { return 0; }
    const char* ncclGetErrorString(int r) { return r == 5 ? "invalid usage" : "other"; }
""")


def _fake(tmp_path, version=22703, omit_async=False):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libnccl")
    src, lib = tmp_path / "fake_nccl.c", tmp_path / f"libfake_{version}_{int(omit_async)}.so"
    src.write_text(FAKE)
    flags = [f"-DVERSION={version}"] + (["-DOMIT_ASYNC"] if omit_async else [])
    subprocess.run([cc, "-shared", "-fPIC", "-w", "-o", str(lib), str(src)] + flags, check=True)
    return str(lib)


# ---- the loader


def test_nccl_loader_names_a_missing_library():
    with pytest.raises(RuntimeError) as e:
        _core.testing.nccl_load("/nonexistent/libnccl.so.2")
    msg = str(e.value)
    assert msg.startswith("[nccl] cannot open /nonexistent/libnccl.so.2: ") and "\n" not in msg


def test_nccl_loader_on_a_stand_in_library(tmp_path):
    """Every symbol resolved and the version decoded (NCCL_VERSION's encoding from 2.9 on)."""
    lib = _fake(tmp_path, 22703)
    assert _core.testing.nccl_load(lib) == {"version": "2.27.3", "code": 22703, "path": lib}
    assert _core.testing.nccl_load(_fake(tmp_path, 20900))["version"] == "2.9.0"


def test_nccl_loader_refuses_a_library_lacking_a_symbol(tmp_path):
    lib = _fake(tmp_path, omit_async=True)
    with pytest.raises(RuntimeError, match=r"^\[nccl\] .*libfake_22703_1\.so lacks ncclCommGetAsyncError "
                                           r"\(not an NCCL 2 library\?\)$"):
        _core.testing.nccl_load(lib)


def test_nccl_loader_refuses_an_nccl_older_than_2_9(tmp_path):
    """2.8.4 in the old encoding (2 * 1000 + 8 * 100 + 4): no collectives in a graph capture."""
    with pytest.raises(RuntimeError, match=r"is NCCL 2\.8\.4, older than 2\.9 \(the first whose collectives a "
                                           r"CUDA graph may record\)$"):
        _core.testing.nccl_load(_fake(tmp_path, 2804))


# What a subprocess reports: the process's NCCL (KRNL_NCCL read once, at the first use), a unique
# id, and the rank's answer for a device that says it has NCCL collectives.
PROBE = textwrap.dedent("""
    import json, sys
    from krnl import _core
    from krnl.train.dist import nccl as dist_nccl
    class Dev:
        name = "stand-in"
        def capabilities(self):
            return {"collectives": ["nccl"], "details": {"pci_bus_id": "0000:01:00.0"}}
    out = {"info": dist_nccl.rank_info(Dev())}
    try:
        out["nccl"] = _core.nccl_info()
        out["id"] = _core.nccl_unique_id().hex()
    except RuntimeError as e:
        out["error"] = str(e)
    print(json.dumps(out))
""")


def _probe(**env):
    e = {k: v for k, v in os.environ.items() if k != "KRNL_NCCL"}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=dict(e, **env), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_nccl_bad_krnl_nccl_path_falls_back_to_mpi(tmp_path):
    """KRNL_NCCL naming no library: the one-line error, which is then this rank's reason for the
    MPI host path."""
    bad = str(tmp_path / "nowhere" / "libnccl.so.2")
    got = _probe(KRNL_NCCL=bad)
    assert got["error"].startswith(f"[nccl] cannot open {bad}: ") and got["error"].endswith("(from KRNL_NCCL)")
    assert "\n" not in got["error"]
    assert got["info"]["nccl"] is None and got["info"]["why"] == got["error"]
    use, why = dist_nccl.decide([got["info"], dict(got["info"], gpu="0000:02:00.0")])
    assert not use and why == f"every rank: {got['error']}"
    assert dist_nccl.describe(use, why, 2) == f"dist: the gradient is summed over 2 ranks by MPI through host memory ({why})"


def test_nccl_krnl_nccl_opens_the_library_it_names(tmp_path):
    lib = _fake(tmp_path, 22304)
    got = _probe(KRNL_NCCL=lib)
    assert got["nccl"] == {"version": "2.23.4", "code": 22304, "path": lib}
    assert got["id"] == bytes(range(128)).hex()
    assert got["info"]["nccl"] == "2.23.4" and got["info"]["why"] == ""


def test_nccl_without_a_library_says_how_to_get_one():
    """No KRNL_NCCL and nothing on the loader's path (this machine has no NCCL): how to get one."""
    if "KRNL_NCCL" in os.environ or any((Path(p or ".") / "nvidia" / "nccl").is_dir() for p in sys.path):
        pytest.skip("an NCCL may be installed here")
    got = _probe()
    if "error" not in got:
        pytest.skip(f"this machine has an NCCL on the loader's path: {got['nccl']}")
    assert got["error"].startswith("[nccl] cannot open libnccl.so.2: ")
    assert "pip install nvidia-nccl-cu13, or set KRNL_NCCL" in got["error"]


# ---- the choice


def _info(host="a", gpu="0000:01:00.0", nccl="2.27.3", why=""):
    return {"host": host, "gpu": gpu, "nccl": nccl, "why": why}


def test_dist_nccl_decide():
    two = [_info(), _info(gpu="0000:02:00.0")]
    assert dist_nccl.decide(two) == (True, "NCCL 2.27.3 on every rank")
    # the same bus id on two machines: two GPUs
    assert dist_nccl.decide([_info(host="a"), _info(host="b")])[0]
    assert dist_nccl.decide(two, "mpi") == (False, "KRNL_DIST_BACKEND=mpi")
    assert dist_nccl.decide(two, "nccl")[0]
    cpu = _info(gpu=None, nccl=None, why="cpu has no NCCL collectives (CUDA devices do)")
    assert dist_nccl.decide([cpu, cpu]) == (False, "every rank: cpu has no NCCL collectives (CUDA devices do)")
    assert dist_nccl.decide([two[0], cpu, cpu]) == (
        False, "rank 1: cpu has no NCCL collectives (CUDA devices do); rank 2: cpu has no NCCL collectives (CUDA "
               "devices do)")
    one_gpu = [_info(), _info(), _info(gpu="0000:02:00.0")]
    use, why = dist_nccl.decide(one_gpu)
    assert not use and why.startswith("ranks 0 and 1 share the GPU 0000:01:00.0 on a (NCCL needs a GPU of its own")
    assert dist_nccl.describe(True, "NCCL 2.27.3 on every rank", 2) == (
        "dist: the gradient is summed over 2 rank(s) by NCCL on the GPUs, in device memory on each step's stream "
        "(NCCL 2.27.3 on every rank)")


def test_dist_nccl_backend_mode():
    assert dist_nccl.backend_mode({}) == "auto"
    assert dist_nccl.backend_mode({"KRNL_DIST_BACKEND": " NCCL "}) == "nccl"
    with pytest.raises(ValueError, match=r"^\[dist\] KRNL_DIST_BACKEND must be one of auto, nccl, mpi, got 'gloo'$"):
        dist_nccl.backend_mode({"KRNL_DIST_BACKEND": "gloo"})


def test_dist_nccl_one_process_keeps_the_host_path(monkeypatch):
    """One rank: nothing to sum and nothing said, unless NCCL is forced, which a CPU device refuses
    in one line."""
    said = []
    monkeypatch.delenv("KRNL_DIST_BACKEND", raising=False)
    one = dist.World()
    assert dist_nccl.reducer_for(one, krnl.device("cpu"), said.append) is None and said == []
    # one process, one World, a second run on another device (CLI runs in one Python session)
    assert dist_nccl.reducer_for(one, krnl.device("cpu:1"), said.append) is None and said == []
    monkeypatch.setenv("KRNL_DIST_BACKEND", "nccl")
    with pytest.raises(ValueError, match=r"^\[dist\] KRNL_DIST_BACKEND=nccl but NCCL cannot run here: every rank: "
                                         r"cpu has no NCCL collectives \(CUDA devices do\)$"):
        dist_nccl.reducer_for(dist.World(), krnl.device("cpu"), said.append)
    with pytest.raises(NotImplementedError, match=r"^\[nccl\] cpu has no NCCL communicator"):
        _core.nccl_comm(krnl.device("cpu"), bytes(128), 0, 1)


# ---- two CPU ranks under mpiexec: the host path and its line


TRAIN = ["train", "--iters", "2", "--warmup", "1", "--steps-per-eval", "0", "--quiet", "--train-samples", "32",
         "--lora-rank", "4", "--batch-size", "4", "--dtype", "f32", "--device", "cpu", "--no-tune"]




def _two_ranks(tmp_path, **env):
    cmd = [_mpiexec(), "-n", "2", sys.executable, "-m", "krnl"] + TRAIN + ["--adapter-path", str(tmp_path / "a")]
    # Open MPI's mpiexec (a GPU machine's) refuses root unless told twice; MPICH ignores these
    e = dict(os.environ, KRNL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
             OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **env)
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=300)


@pytest.mark.mpi
def test_dist_nccl_cpu_ranks_take_the_host_path(tmp_path):
    r = _two_ranks(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    line = ("dist: the gradient is summed over 2 ranks by MPI through host memory (every rank: cpu has no NCCL "
            "collectives (CUDA devices do))")
    assert r.stdout.count(line) == 1, r.stdout[-2000:]  # rank 0 alone


@pytest.mark.mpi
def test_dist_ranks_learn_their_place_on_the_machine():
    """dist.world() sets KRNL_LOCAL_RANK (0 and 1 for two ranks here) before any device exists:
    the CUDA device takes that GPU, modulo the GPUs it sees."""
    code = ("import os\nfrom krnl.train.dist import world as dist\nw = dist.world()\n"
            "got = w.comm.gather(f'local {w.rank} {os.environ.get(\"KRNL_LOCAL_RANK\")}')\n"
            "print('\\n'.join(got) if w.root else '')")
    env = {k: v for k, v in os.environ.items() if k != "KRNL_LOCAL_RANK"}
    r = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(x for x in r.stdout.splitlines() if x.startswith("local")) == ["local 0 0", "local 1 1"]


@pytest.mark.mpi
def test_dist_nccl_forced_on_cpu_ranks_stops_in_one_line(tmp_path):
    r = _two_ranks(tmp_path, KRNL_DIST_BACKEND="nccl")
    assert r.returncode != 0
    assert ("krnl train: error: [dist] KRNL_DIST_BACKEND=nccl but NCCL cannot run here: every rank: cpu has no "
            "NCCL collectives (CUDA devices do)") in r.stderr


# ---- a CUDA device with NCCL (the H200 check): one rank


def _cuda():
    if "cuda" not in krnl.devices():
        pytest.skip("no cuda device")


def _cuda_nccl():
    _cuda()
    try:
        return _core.nccl_info()
    except RuntimeError as e:
        pytest.skip(str(e))


def test_nccl_one_rank_allreduce_eager_and_replayed():
    """nranks = 1: the sum over one rank leaves each buffer as it was, eager and inside a recorded
    graph whose replays read new contents (31 and 1 elements: awkward sizes, two buffers in one
    NCCL group); a non-f32 tensor is refused in one line."""
    _cuda_nccl()
    dev = krnl.device("cuda")
    comm = _core.nccl_comm(dev, _core.nccl_unique_id(), 0, 1)
    assert (comm.rank, comm.nranks) == (0, 1)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(31).astype(np.float32), np.array([3.5], np.float32)
    ta, tb = dev.tensor(a), dev.tensor(b)
    comm.allreduce([ta, tb])
    np.testing.assert_array_equal(ta.numpy(), a)
    np.testing.assert_array_equal(tb.numpy(), b)

    def body():  # allreduce, then x2: the replay must run both, in order, on the new contents
        comm.allreduce([ta])
        krnl.ops.scale(ta, 2.0, ta)

    graph = dev.capture(body)  # the warm-up runs it once
    np.testing.assert_array_equal(ta.numpy(), 2 * a)
    for k in range(3):
        x = rng.standard_normal(31).astype(np.float32)
        dev.upload(ta, x)
        graph.replay()
        np.testing.assert_array_equal(ta.numpy(), 2 * x)
    graph.release()
    comm.check()
    with pytest.raises(ValueError, match=r"^\[nccl\] allreduce: tensor 0 must be f32"):
        comm.allreduce([dev.tensor(a, "bf16")])


@pytest.mark.parametrize("graphs", [True, False])
def test_nccl_one_rank_train_like_the_host_path(tmp_path, graphs):
    """`krnl train --device cuda` with NCCL forced on one rank (the sum over one rank, recorded in
    the optimizer's graph, or eager with --no-graphs) gives the adapter and losses of the same
    run without it (a one-rank sum changes no value; held to 1e-6 of each tensor's norm, not bit
    for bit, in case a kernel's float atomics reorder a sum between two runs)."""
    _cuda_nccl()
    args = ["train", "--iters", "4", "--warmup", "1", "--steps-per-eval", "0", "--quiet", "--train-samples", "32",
            "--lora-rank", "4", "--batch-size", "4", "--device", "cuda", "--no-tune"] + ([] if graphs else ["--no-graphs"])
    outs = {}
    for mode in ("auto", "nccl"):
        out = tmp_path / mode
        r = subprocess.run([sys.executable, "-m", "krnl"] + args + ["--adapter-path", str(out)], capture_output=True,
                           text=True, env=dict(os.environ, KRNL_DIST_BACKEND=mode), timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("by NCCL on the GPUs" in r.stdout) == (mode == "nccl"), r.stdout[-2000:]
        outs[mode] = out
    from safetensors.numpy import load_file
    a, b = (load_file(str(outs[m] / "adapter_model.safetensors")) for m in ("auto", "nccl"))
    assert a.keys() == b.keys()
    for k in a:
        assert np.linalg.norm(a[k] - b[k]) <= 1e-6 * np.linalg.norm(a[k]), k
    rows = [[json.loads(x)["loss"] for x in (outs[m] / "metrics.jsonl").read_text().splitlines()] for m in outs]
    assert len(rows[0]) == 4 and np.allclose(rows[0], rows[1], rtol=1e-6, atol=0), rows


# ---- krnl bench --workloads train --gpus N: the plumbing, on CPU ranks


class _Session:
    """What train_dist.rows reads of a bench Session."""

    def __init__(self, peers):
        self.dev, self.dtype, self.peers, self.said = krnl.device("cpu"), "f32", peers, []
        self.log = self.said.append


@pytest.mark.mpi
def test_bench_train_gpus_two_cpu_ranks():
    """--gpus 2 at the quick size on the CPU: krnl as one process and under mpiexec -n 2 (the host
    path, said in the note), PyTorch DDP + PEFT under torchrun at 1 and 2 processes where torch
    and PEFT are installed; the 2-rank rows carry the speedup and the scaling efficiency over
    their own 1-rank row. The figures themselves mean nothing at this size."""
    _mpiexec()
    from krnl.bench import train, train_dist
    try:
        import peft  # noqa: F401
        import torch  # noqa: F401
        peers = ["torch"]
    except ImportError:
        peers = []
    session = _Session(peers)
    rows = train_dist.rows(session, train.shape("quick", steps=2, warmup=1), 2, on_gpu=False)
    by = {r["impl"]: r for r in rows}
    assert list(by) == ["krnl 1 rank", "DDP+PEFT 1 rank", "krnl 2 ranks", "DDP+PEFT 2 ranks"]
    want = ["krnl 1 rank", "krnl 2 ranks"] + (["DDP+PEFT 1 rank", "DDP+PEFT 2 ranks"] if peers else [])
    for impl in want:
        r = by[impl]
        assert r.get("status", "ok") == "ok", r
        assert r["tokens_per_s"] > 0 and r["samples"] == 2 and np.isfinite(r["loss"])
        assert r["ranks"] == (2 if "2 ranks" in impl else 1)
        assert r["tokens"] == 2 * 2 * 33 * r["ranks"]  # 2 timed steps of B=2 rows of 33 tokens per rank
    for impl in want[1::2] if peers else want[1:]:
        r = by[impl]
        assert abs(r["speedup"] - r["tokens_per_s"] / by[impl.replace("2 ranks", "1 rank")]["tokens_per_s"]) < 1e-9
        assert abs(r["scaling"] - r["speedup"] / 2) < 1e-12 and "scaling" in r["note"]
    assert "by MPI through host memory (every rank: cpu has no NCCL collectives" in by["krnl 2 ranks"]["note"]
    # the first step starts from B = 0 (the base model), the same model in both implementations
    if peers:
        for n in ("1 rank", "2 ranks"):
            assert abs(by[f"krnl {n}"]["first_loss"] - by[f"DDP+PEFT {n}"]["first_loss"]) < 1e-4
    else:
        assert by["DDP+PEFT 1 rank"]["status"] == "absent"


def test_bench_train_gpus_retries_only_the_peer(monkeypatch):
    """A failed launch of the PyTorch peer runs once more and its row says so (a torchrun/gloo
    start-up failure is not krnl's); a failed krnl launch is reported as it is, never retried."""
    from krnl.bench import train, train_dist
    calls = []

    def fake_launch(cmd, spec, log, env=None, timeout=None):
        impl = "ddp" if "ddp" in cmd else "krnl"
        calls.append(impl)
        if calls.count(impl) == 1:
            raise RuntimeError(f"exit status 1: {impl} start-up")
        return dict(tokens_per_s=100.0, ranks=1, loss=1.0, first_loss=2.0, warmup_s=0.1)

    monkeypatch.setattr(train_dist, "launch", fake_launch)
    rows = train_dist.rows(_Session(["torch"]), train.shape("quick", steps=2, warmup=1), 2, on_gpu=False)
    by = {r["impl"]: r for r in rows}
    assert by["krnl 1 rank"]["status"] == "absent" and "krnl start-up" in by["krnl 1 rank"]["reason"]
    assert by["DDP+PEFT 1 rank"].get("status", "ok") == "ok"
    assert "ran on a second launch, the first failed: exit status 1: ddp start-up" in by["DDP+PEFT 1 rank"]["note"]
    assert calls[:3] == ["krnl", "ddp", "ddp"]


def test_bench_gpus_must_be_positive():
    import argparse

    from krnl.bench import cli
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.train_options(p.parse_args(["--gpus", "2"]))["gpus"] == 2
    with pytest.raises(ValueError, match=r"^\[krnl bench\] --gpus must be >= 1, got 0$"):
        cli.train_options(p.parse_args(["--gpus", "0"]))


# ---- StepRunner's device path, with a stand-in for NCCL (CPU)


class _Doubling:
    """Two identical ranks: the sum doubles every element, on the host (a World's allreduce) or
    on the device (a reducer's, queued as an op)."""

    size, rank = 2, 0

    def __init__(self):
        self.calls, self.waits = 0, []

    def allreduce(self, arg, what="", in_place=False):
        if isinstance(arg, np.ndarray):  # World.allreduce of the host copy
            arg *= 2
            return arg
        self.calls += 1
        for t in arg:  # NcclReducer.allreduce of device tensors
            krnl.ops.scale(t, 2.0, t)

    def wait(self, fn, what):
        self.waits.append(what)
        return fn()


def test_step_runner_device_reduce_matches_the_host_path():
    """The same two optimizer steps (2 micro-batches each) with the sum on the host (a World) and
    on the device (a reducer): the same losses and parameters, one device sum per step, and
    finish() waiting under the reducer's name of that step."""
    from conftest import tiny_lora_model
    from krnl.train.optim import AdamW, Schedule
    from krnl.train.step import StepRunner
    out = {}
    for path in ("host", "device"):
        m = tiny_lora_model(krnl.device("cpu"), "f32", seed=1)
        fake = _Doubling()
        kw = {"world": fake} if path == "host" else {"reducer": fake}
        runner = StepRunner(m, AdamW(m.lora_params, Schedule(1e-2, total_steps=4)), micro_batches=2, **kw)
        losses = []
        for step in (1, 2):
            for i in range(2):
                r = np.random.default_rng([step, i])
                ids = r.integers(0, m.config.vocab_size, (3, 7)).astype(np.int32)
                runner.micro_batch((ids, np.roll(ids, -1, axis=1)), 1.0, i)
            runner.optimizer(2, step)
            losses.append(runner.finish()[0])
        out[path] = (losses, np.array(m.lora_params.params.numpy()), fake)
    (lh, ph, _), (ld, pd, fake) = out["host"], out["device"]
    assert ld == lh and np.array_equal(pd, ph)
    assert fake.calls == 2 and fake.waits == ["the NCCL gradient allreduce of step 1",
                                              "the NCCL gradient allreduce of step 2"]


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["nccl", "mpi"])
@pytest.mark.parametrize("dtype, tol", [("f32", 1e-3), ("bf16", 3e-2)])
def test_nccl_two_gpus_train_like_one(tmp_path, dtype, tol, backend):
    """Two CUDA ranks, one GPU each, summing through NCCL, or through host memory and MPI
    (KRNL_DIST_BACKEND=mpi, where two ranks may share one GPU): 6 steps of `krnl train` give one
    GPU's losses and adapter on the same global batch. Adam's first steps divide each gradient
    element by its own magnitude, so the ranks' other order of f32 sums shows in elements whose
    gradient is near zero: each adapter tensor is held to `tol` of its norm (test_dist's 1e-3 in
    f32; bf16 activations round differently when a GEMM sees half the rows). NCCL skips where the
    two ranks could not take it (one GPU: they share it), saying why."""
    _cuda_nccl() if backend == "nccl" else _cuda()
    args = ["train", "--iters", "6", "--warmup", "1", "--steps-per-eval", "0", "--quiet", "--train-samples", "64",
            "--lora-rank", "4", "--batch-size", "8", "--dtype", dtype, "--device", "cuda", "--no-tune"]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               KRNL_DIST_BACKEND="auto" if backend == "nccl" else "mpi")
    env.pop("KRNL_LOCAL_RANK", None)
    two = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-m", "krnl"] + args
                         + ["--adapter-path", str(tmp_path / "two")], capture_output=True, text=True, env=env,
                         timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    said = [x for x in two.stdout.splitlines() if x.startswith("dist:")]
    if backend == "nccl" and (not said or "by NCCL on the GPUs" not in said[0]):
        pytest.skip(f"the two ranks did not take NCCL: {said}")
    assert said and ("by NCCL on the GPUs" in said[0]) == (backend == "nccl"), said
    one = subprocess.run([sys.executable, "-m", "krnl"] + args + ["--adapter-path", str(tmp_path / "one")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    from safetensors.numpy import load_file
    a, b = (load_file(str(tmp_path / n / "adapter_model.safetensors")) for n in ("one", "two"))
    assert a.keys() == b.keys()
    for k in a:
        assert np.linalg.norm(a[k] - b[k]) <= tol * np.linalg.norm(a[k]), k
    rows = [[json.loads(x)["loss"] for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
            for n in ("one", "two")]
    assert len(rows[1]) == 6 and np.allclose(rows[0], rows[1], rtol=tol / 10, atol=0), rows
