"""Data-parallel training over MPI (krnl.train.dist.world): the world of one process, the error without
mpi4py, and, with mpi4py and MPICH's mpiexec installed (pip install 'krnl[mpi]'; the `mpi`
marker), two ranks on this machine: the summed gradient of one step equals one process's on the
global batch, 10 steps of `krnl train` give one process's adapter and metrics (with dropout
too: the same masks), a 2-rank
checkpoint resumes with 1 rank, a rank killed with -9 or hanging ends the run, ranks whose
parameters differ stop it, and ranks sharing a machine split its cores."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from krnl.train.dist import world as dist

HERE = Path(__file__).parent
TRAIN = ["train", "--iters", "10", "--warmup", "2", "--steps-per-eval", "5", "--save-every", "5", "--quiet",
         "--train-samples", "128", "--lora-rank", "4", "--batch-size", "8", "--dtype", "f32", "--device", "cpu",
         "--no-tune"]


# ---- one process, no MPI needed


def test_dist_world_of_one_process(monkeypatch):
    for size_var, rank_var in dist._LAUNCHER_VARS:
        monkeypatch.delenv(size_var, raising=False)
    assert dist.launcher_size() == (1, 0)
    monkeypatch.setenv("PMI_SIZE", "3")
    monkeypatch.setenv("PMI_RANK", "2")
    assert dist.launcher_size() == (3, 2)
    w = dist.World()
    assert (w.rank, w.size, w.root, w.describe()) == (0, 1, True, "")
    a = np.arange(5.0)
    assert w.allreduce(a) is a and w.bcast("x") == "x" and w.on_root(lambda: 7, "seven") == 7
    w.check_same("parameters", b"anything", 0)  # nothing to compare with


def test_dist_slice_takes_each_ranks_rows():
    w = dist.World()
    w.rank, w.size = 1, 3
    ids, tg = np.arange(12).reshape(6, 2), -np.arange(12).reshape(6, 2)
    got = w.slice((ids, tg))
    np.testing.assert_array_equal(got[0], ids[2:4])
    np.testing.assert_array_equal(got[1], tg[2:4])
    with pytest.raises(ValueError, match=r"\[dist\] a batch of 7 rows does not divide among 3 ranks"):
        w.slice((np.zeros((7, 2)), np.zeros((7, 2))))


def test_dist_reduce_order_auto_is_sample_with_ranks(tmp_path):
    """TrainConfig.reduce_order: auto is the sample order with more than one rank, rows with one;
    the Trainer sets the model's sums from it; another value is refused in one line; a resume
    may change it without --resume-override (it changes f32 rounding only)."""
    import krnl
    from conftest import tiny_lora_model
    from krnl.train.dist.ranks import reduce_order
    from krnl.io.run_folder import option_changes
    from krnl.train.trainer import TrainConfig, Trainer

    one, two = dist.World(), dist.World()
    two.size = 2
    for order, want in (("auto", ("rows", "sample")), ("rows", ("rows", "rows")), ("sample", ("sample", "sample"))):
        assert (reduce_order(TrainConfig(reduce_order=order), one),
                reduce_order(TrainConfig(reduce_order=order), two)) == want
    with pytest.raises(ValueError, match=r"\[train\] --reduce-order must be one of auto, rows, sample, got 'tree'"):
        reduce_order(TrainConfig(reduce_order="tree"), one)
    m = tiny_lora_model(krnl.device("cpu"), "f32")
    data = (np.zeros((4, 5), np.int32), np.ones((4, 5), np.int32))
    for order, on in (("auto", False), ("sample", True)):
        Trainer(m, TrainConfig(batch_size=2, reduce_order=order), data, out_dir=tmp_path, progress=False)
        assert m.sums.on is on
    saved, now = {"reduce_order": "sample", "seed": 0}, {"reduce_order": "rows", "seed": 1}
    assert option_changes(saved, now) == {"seed": (0, 1)}


def test_dist_names_a_dead_rank_on_this_machine():
    """The watchdog's message: a peer whose process is gone is named with its pid."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    w = dist.World()
    host = socket.gethostname()
    w.rank, w.size, w.peers = 0, 3, [(host, os.getpid()), (host, gone.pid), ("elsewhere", 1)]
    said = w.missing_ranks()
    assert f"rank 1 (pid {gone.pid}) died" in said and "ranks 2 run elsewhere" in said


def test_dist_a_pid_reaped_after_kill_is_gone(monkeypatch):
    """A process reaped between kill(pid, 0) and the read of its /proc entry is gone, not alive
    (this made a rank that had exited look alive in one run of 60 here)."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc: kill's answer stands")

    def reaped(*args, **kwargs):
        raise FileNotFoundError(args[0])

    assert dist._alive(os.getpid())
    monkeypatch.setattr(dist, "open", reaped, raising=False)
    assert not dist._alive(os.getpid())


def test_dist_watchdog_names_a_rank_that_died():
    """A rank waiting in a collective whose peer on the same machine is gone (a launcher that
    leaves the others running: rank 1's pid here is a finished process) stops within the poll
    interval, not after KRNL_DIST_TIMEOUT, naming that rank and the collective, status 1."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = ("import socket, time\nfrom krnl.train.dist import world as dist\nw = dist.World()\nh = socket.gethostname()\n"
            f"w.rank, w.size, w.peers = 0, 2, [(h, 1), (h, {gone.pid})]\n"
            "dist._Watchdog(w, 300).arm('the gradient allreduce of step 3')\ntime.sleep(60)")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and time.monotonic() - t0 < 30
    assert (f"krnl train: error: [dist] rank 0: rank 1 (pid {gone.pid}) died while this rank waited in the "
            "gradient allreduce of step 3; stopping") in r.stderr


def test_dist_collective_that_fails_names_a_dead_rank():
    """A collective MPI fails because a peer died mid-transfer (MPICH: process_vm_readv, ESRCH)
    stops this rank naming the dead rank; with every peer alive, MPI's own error propagates."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    w = dist.World()
    host = socket.gethostname()
    w.rank, w.size = 0, 2

    class Unwatched:  # the watchdog's thread would race this path to the same stop
        def arm(self, what):
            pass

        def disarm(self):
            pass

    class Stopped(Exception):
        pass

    def stop(said):
        raise Stopped(said)

    def fail():
        raise RuntimeError("Other MPI error")

    w._watchdog, w.stop = Unwatched(), stop
    w.peers = [(host, os.getpid()), (host, gone.pid)]
    with pytest.raises(Stopped, match=rf"^rank 1 \(pid {gone.pid}\) died while this rank waited in the "
                                      "gradient allreduce of step 3$"):
        w._collect("the gradient allreduce of step 3", fail)
    w.peers = [(host, os.getpid()), (host, os.getppid())]
    with pytest.raises(RuntimeError, match="Other MPI error"):
        w._collect("the gradient allreduce of step 3", fail)


def test_dist_without_mpi4py_says_how_to_install_it(tmp_path):
    """N > 1 ranks from a launcher and no mpi4py: one line naming the package to install."""
    code = "import sys; sys.modules['mpi4py'] = None\nfrom krnl.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PMI_SIZE="2", PMI_RANK="0")
    r = subprocess.run([sys.executable, "-c", code] + TRAIN + ["--adapter-path", str(tmp_path / "a")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert ("krnl train: error: [dist] an MPI launcher started 2 ranks (this is rank 0) but mpi4py is not "
            "installed: pip install 'krnl[mpi]'") in r.stderr


# ---- two ranks under mpiexec


def _mpiexec():
    pytest.importorskip("mpi4py")
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec (pip install 'krnl[mpi]' brings MPICH's)")
    return found


def _env(**extra):
    # One thread per rank: two ranks share this machine's cores.
    return dict(os.environ, KRNL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **extra)


def _krnl(n, args, timeout=600, launcher=(), **env):
    cmd = [sys.executable, "-m", "krnl"] + list(args)
    if n > 1:
        cmd = [_mpiexec(), *launcher, "-n", str(n)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(**env), timeout=timeout)


def _rows(out):
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _adapter(out):
    from safetensors.numpy import load_file

    return load_file(str(Path(out) / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 10-step run (global batch 8) by one process and by two ranks (whose default
    reduce order is the sample one: the one process asks for it)."""
    _mpiexec()
    root = tmp_path_factory.mktemp("dist")
    for n in (1, 2):
        r = _krnl(n, TRAIN + ["--adapter-path", str(root / f"n{n}")] + (["--reduce-order", "sample"] if n == 1 else []))
        assert r.returncode == 0, r.stderr[-3000:]
    return root / "n1", root / "n2"


@pytest.mark.mpi
def test_dist_gradient_sum_equals_one_process(tmp_path):
    """StepRunner.reduce: the ranks' gradients of two micro-batches (6 rows each, unequal target
    counts per row and per rank), summed, equal one process's on the global batch: each
    parameter within 1e-5 of its norm, the loss within 1e-6."""
    worker = str(HERE / "dist_worker.py")
    one = subprocess.run([sys.executable, worker, str(tmp_path / "one.npz")], env=_env(), timeout=300)
    two = subprocess.run([_mpiexec(), "-n", "2", sys.executable, worker, str(tmp_path / "two.npz")], env=_env(),
                         timeout=300)
    assert one.returncode == 0 and two.returncode == 0
    a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert abs(float(a["loss"]) - float(b["loss"])) <= 1e-6 * abs(float(a["loss"]))
    for off, size in a["offsets"]:
        x, y = a["grads"][off:off + size], b["grads"][off:off + size]
        assert np.linalg.norm(x) > 0
        assert np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(x)


@pytest.mark.mpi
def test_dist_two_ranks_train_like_one_process(runs):
    """10 steps: the same learning rates, losses and gradient norms and the same adapter, bit
    for bit: the LoRA gradients and the loss are summed per sample in a fixed tree
    (krnl.models.sample_sums), of which each rank computes one half and MPI adds the two, and every
    CPU GEMM of the step runs in blocks of one sample's rows (Device.gemm_row_block), so a
    rank's rows get one process's bits. Validation losses (summed over rows, not in the sample
    order) within 1e-5. Summed over all rows in one GEMM instead (--reduce-order rows), a
    gradient element whose terms nearly cancel keeps f32 rounding in percents, which clipping
    and Adam's eps carry into the adapter (1.6e-5 of a tensor's norm after these 10 steps,
    measured)."""
    one, two = runs
    r1, r2 = _rows(one), _rows(two)
    assert [r["step"] for r in r2] == list(range(1, 11))
    for x, y in zip(r1, r2):
        assert (x["lr"], x["loss"], x["grad_norm"]) == (y["lr"], y["loss"], y["grad_norm"])
        assert ("val_loss" in x) == ("val_loss" in y)
        if "val_loss" in x:
            assert abs(x["val_loss"] - y["val_loss"]) <= 1e-5 * x["val_loss"]
    a, b = _adapter(one), _adapter(two)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    state = json.loads((two / "checkpoints" / "step-00000010" / "trainer.json").read_text())
    assert state["world_size"] == 2 and state["config"]["reduce_order"] == "auto"


@pytest.mark.mpi
def test_dist_resume_two_ranks_with_one(runs, tmp_path):
    """The 2-rank run's step-5 checkpoint resumed by one process: the same samples and learning
    rates from step 6 on, losses within 1e-6 of the uninterrupted 2-rank run's (relative)."""
    _, two = runs
    out = tmp_path / "resumed"
    shutil.copytree(two, out)
    r = _krnl(1, TRAIN + ["--adapter-path", str(out), "--resume-from", "5"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint written by 2 ranks, continuing with 1" in r.stdout
    before, after = _rows(two), _rows(out)
    assert [x["step"] for x in after] == list(range(1, 11))
    for x, y in zip(before[5:], after[5:]):
        assert x["lr"] == y["lr"]
        assert abs(x["loss"] - y["loss"]) <= 1e-6 * abs(x["loss"])


@pytest.mark.mpi
def test_dist_refuses_an_uneven_batch(tmp_path):
    r = _krnl(2, TRAIN + ["--adapter-path", str(tmp_path / "a"), "--batch-size", "7"], timeout=120)
    assert r.returncode != 0
    assert "[train] --batch-size 7 (the global batch) does not divide among 2 ranks" in r.stderr


@pytest.mark.mpi
def test_dist_dropout_masks_are_the_global_batchs(tmp_path):
    """LoRA dropout 0.2 with 2 micro-batches a step: each rank's slice draws the masks one
    process draws for those rows (seed_offset's first row), so 10 steps give one process's
    losses and adapter bit for bit (the one process summing per sample as the ranks do, across
    the micro-batches too); other masks would move the first step's loss by far more."""
    extra = ["--lora-dropout", "0.2", "--grad-accumulation", "2"]
    for n in (1, 2):
        order = ["--reduce-order", "sample"] if n == 1 else []
        r = _krnl(n, TRAIN + extra + order + ["--adapter-path", str(tmp_path / f"n{n}")])
        assert r.returncode == 0, r.stderr[-3000:]
    for x, y in zip(_rows(tmp_path / "n1"), _rows(tmp_path / "n2")):
        assert x["loss"] == y["loss"]
    a, b = _adapter(tmp_path / "n1"), _adapter(tmp_path / "n2")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.mpi
def test_dist_readme_claim_at_any_thread_count(tmp_path):
    """README's claim as a user runs it: the embedded task (LoRA rank 16), `krnl train --iters 6
    --batch-size 8 --seed 3`, 2 ranks under mpiexec with the thread counts left to krnl and
    OpenBLAS (each rank cores / ranks), and one process given --reduce-order sample on 1 thread
    and on 2: three identical adapters. Before the sample order's GEMMs went by blocks of a
    sample's rows, the ranks' rank-16 LoRA products of 48 rows took OpenBLAS's SkylakeX
    small-matrix kernel and one process's of 96 rows its main one: 6e-7 of a tensor's norm apart
    here, 1.6e-5 on an AMD EPYC VM."""
    args = ["train", "--iters", "6", "--batch-size", "8", "--seed", "3", "--quiet", "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k not in ("KRNL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    runs = {"ranks": ([_mpiexec(), "-n", "2"], {}), "one thread": ([], {"KRNL_NUM_THREADS": "1"}),
            "two threads": ([], {"KRNL_NUM_THREADS": "2"})}
    for name, (launcher, extra) in runs.items():
        order = [] if launcher else ["--reduce-order", "sample"]
        cmd = launcher + [sys.executable, "-m", "krnl"] + args + order + ["--adapter-path", str(tmp_path / name)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, **extra), timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    want = _adapter(tmp_path / "ranks")
    assert len(want) == 28  # q, k, v, o, gate, up, down of 2 layers, A and B
    for name in ("one thread", "two threads"):
        got = _adapter(tmp_path / name)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{name}: {k}")


@pytest.mark.mpi
def test_dist_ranks_with_different_parameters_stop(tmp_path):
    """Rank 1 starts from another seed (another LoRA initialisation): the hash check before the
    first step stops both."""
    common = ["--adapter-path", str(tmp_path / "a")]
    r = subprocess.run(
        [_mpiexec(), "-n", "1", sys.executable, "-m", "krnl"] + TRAIN + common + ["--seed", "0"]
        + [":", "-n", "1", sys.executable, "-m", "krnl"] + TRAIN + common + ["--seed", "1"],
        capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode != 0
    assert "[dist] step 0: the ranks' parameters differ (ranks 0:" in r.stderr


def _start(tmp_path, **env):
    """A long 2-rank run; returns (process, {rank: pid}) once it is in its step loop."""
    out = tmp_path / "a"
    args = [a if a != "10" else "100000" for a in TRAIN]  # --iters
    p = subprocess.Popen([_mpiexec(), "-n", "2", sys.executable, "-m", "krnl"] + args + ["--adapter-path", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(**env))
    line = ""
    while "ranks (data parallel)" not in line:
        line = p.stdout.readline()
        assert line or p.poll() is None, "the run ended before it started"
    pids = {int(r): int(pid) for r, pid in re.findall(r"rank (\d+) pid (\d+)", line)}
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.1)
    return p, pids


@pytest.mark.mpi
def test_dist_killed_rank_ends_the_run(tmp_path):
    """kill -9 of rank 1 (the pid the run's first line gives it): the run ends non-zero within 60 s
    with krnl's line naming rank 1. MPICH's launcher SIGKILLs the other ranks within a
    millisecond of reaping a dead one (strace, MPICH 5.0.2), and its own message named a
    survivor's pid in one run of sixteen here, so each rank runs under a parent of its own
    (dist.supervise) that names it; rank 0 may say it first, from its watchdog (polling once a
    second while it waits in a collective) or from a collective MPI failed.

    One outcome is MPICH's alone: a kill landing inside a single-copy transfer (CMA) can make
    MPICH abort rank 0 at once with its own error stack, and its launcher then kills rank 1's
    parent before that wakes to speak (5 runs of 140 on this VM with two busy cores)."""
    p, pids = _start(tmp_path)
    try:
        os.kill(pids[1], signal.SIGKILL)
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode != 0
    assert (f"krnl: error: [dist] rank 1 (pid {pids[1]}) was killed by SIGKILL" in out
            or f"[dist] rank 0: rank 1 (pid {pids[1]}) died while this rank waited in" in out
            or ("(rank 0 in comm 0): Fatal error in internal_Allreduce_c" in out
                and "process_vm_readv failed (errno 3)" in out)), out[-2000:]
    assert "Traceback" not in out, out[-2000:]


@pytest.mark.mpi
def test_dist_hung_rank_ends_the_run(tmp_path):
    """Rank 1 stopped (SIGSTOP): rank 0 waits KRNL_DIST_TIMEOUT seconds in its next collective,
    says so and exits within the timeout. Whether the launcher then ends a stopped process is
    the launcher's affair: MPICH's usually does at once, but twice here (CI, a loaded VM) the job
    stayed up with rank 0 gone, so the test ends rank 1 itself once rank 0 has."""
    p, pids = _start(tmp_path, KRNL_DIST_TIMEOUT="3")
    try:
        os.kill(pids[1], signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while dist._alive(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        rank0_ended = not dist._alive(pids[0])
    finally:
        try:
            os.kill(pids[1], signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
    assert rank0_ended, out[-2000:]
    assert p.returncode != 0
    # the collective rank 0 waits in depends on where rank 1 stopped
    assert re.search(r"krnl train: error: \[dist\] rank 0: waited 3 s in the (gradient allreduce|validation|"
                     r"parameters hash check) of step \d+", out), out[-2000:]
    assert "no other rank on this machine died" in out


@pytest.mark.mpi
def test_dist_ranks_sharing_a_machine_split_its_cores():
    """Without KRNL_NUM_THREADS, each of 2 ranks on this machine sizes its thread pool to half
    the cores (set by dist.world() before the pool starts)."""
    # rank 0 prints every rank's line (two ranks' prints to one pipe may interleave)
    code = ("import os, krnl\nfrom krnl.train.dist import world as dist\nw = dist.world()\nkrnl.device('cpu')\n"
            "got = w.comm.gather(f'threads {w.rank} {krnl.num_threads()} {os.cpu_count()}')\n"
            "print('\\n'.join(got) if w.root else '')")
    env = {k: v for k, v in os.environ.items() if k != "KRNL_NUM_THREADS"}
    r = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = sorted(line.split()[1:] for line in r.stdout.splitlines() if line.startswith("threads"))
    assert [g[0] for g in got] == ["0", "1"]
    assert all(int(g[1]) == max(1, int(g[2]) // 2) for g in got)
