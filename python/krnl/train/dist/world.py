"""Data-parallel training over MPI (mpi4py): which rank of how many this process is, the sums
across ranks the trainer needs (the flat LoRA gradient once per optimizer step, a few numbers),
a broadcast, a comparison of parameter hashes, and a clean stop when another rank dies or fails.

`world()` looks at the environment an MPI launcher sets (MPICH's and Open MPI's, Slurm's PMI):
without one, or with one rank, it is a World of size 1 whose operations do nothing, and mpi4py is
never imported. With N > 1 ranks it needs mpi4py (`pip install 'krnl[mpi]'`).

Every collective runs under a watchdog: a rank that waits longer than KRNL_DIST_TIMEOUT seconds
(default 600) for the others says which collective of which step it waited in, names the ranks
on its own machine that are gone (their pids are exchanged at start), and exits with status 1;
the launcher then ends the others. Host memory carries the gradient (a CUDA device copies it
down and up; Metal's unified memory makes that a plain copy), except between CUDA ranks with
NCCL, which sum it on the GPUs (krnl.train.dist.nccl)."""

import hashlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

# Variables that MPI launchers set in each rank's environment: (size, rank).
_LAUNCHER_VARS = (("PMI_SIZE", "PMI_RANK"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                  ("PMIX_SIZE", "PMIX_RANK"), ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"))
DEFAULT_TIMEOUT = 600.0
POLL_SECONDS = 1.0  # how often a rank waiting in a collective looks for dead peers on its machine
# How long a failing rank waits between printing why and MPI_Abort or its exit: MPICH's launcher
# tears the job down at either and can drop the message still in the rank's pipe.
ABORT_GRACE_SECONDS = 0.5
DEFAULT_CHECK_EVERY = 50  # optimizer steps between two parameter hash checks (KRNL_DIST_CHECK_EVERY)


def launcher_size():
    """(size, rank) an MPI launcher put in the environment, or (1, 0) without one."""
    for size_var, rank_var in _LAUNCHER_VARS:
        if os.environ.get(size_var, "").isdigit():
            return int(os.environ[size_var]), int(os.environ.get(rank_var, "0") or 0)
    return 1, 0


def _alive(pid):
    """Whether process `pid` runs (a zombie, killed but not yet reaped by its launcher, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # reaped since kill() where there is /proc; without (macOS) kill's answer stands
        return not os.path.isdir("/proc/self")


class _Watchdog:
    """A thread that ends the process when a collective outlives its deadline."""

    def __init__(self, world, timeout):
        self.world, self.timeout = world, float(timeout)
        self.cv = threading.Condition()
        self.what, self.deadline = None, None
        threading.Thread(target=self._watch, name="krnl-dist-watchdog", daemon=True).start()

    def arm(self, what):
        with self.cv:
            self.what, self.deadline = what, time.monotonic() + self.timeout
            self.cv.notify()

    def disarm(self):
        with self.cv:
            self.what, self.deadline = None, None

    def _watch(self):
        with self.cv:
            while True:
                if self.deadline is None:
                    self.cv.wait()
                    continue
                left = self.deadline - time.monotonic()
                # A peer on this machine whose process is gone stops the wait at once (polled:
                # a launcher that does not end the job when a rank dies leaves this rank waiting).
                gone = self.world.gone_ranks() if left > 0 else []
                if left > 0 and not gone:
                    self.cv.wait(min(left, POLL_SECONDS))
                    continue
                # The main thread may hold MPI's locks inside the collective: leave without MPI
                # calls; the launcher sees a rank exit with status 1 and ends the job.
                self.world.stop(self.world.died(gone, self.what) if gone else
                                f"waited {self.timeout:g} s in {self.what}; {self.world.missing_ranks()}")


class World:
    """This process's place among the ranks of a run: rank, size, root (rank 0 writes files)."""

    def __init__(self, comm=None, timeout=None):
        self.comm = comm
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        self.peers = [(socket.gethostname(), os.getpid())]
        self._watchdog = None
        self.check_every = max(1, int(os.environ.get("KRNL_DIST_CHECK_EVERY", DEFAULT_CHECK_EVERY)))
        if self.size > 1:
            if timeout is None:
                timeout = float(os.environ.get("KRNL_DIST_TIMEOUT", DEFAULT_TIMEOUT))
            self._watchdog = _Watchdog(self, timeout)
            self.peers = self._collect("the start (exchanging host names)", lambda: comm.allgather(self.peers[0]))

    @property
    def root(self):
        return self.rank == 0

    def describe(self):
        """', N ranks (data parallel): rank 0 pid P on HOST, ...', or '' for one process: the
        table that maps a launcher's message about a pid to its rank."""
        if self.size == 1:
            return ""
        return f", {self.size} ranks (data parallel): " + ", ".join(
            f"rank {r} pid {p} on {h}" for r, (h, p) in enumerate(self.peers))

    def local_size(self):
        """Ranks on this rank's machine (this one included)."""
        return sum(1 for h, _ in self.peers if h == self.peers[self.rank][0])

    def gone_ranks(self):
        """['rank R (pid P)', ...]: the other ranks on this machine whose process is gone (from
        the pids exchanged at start; none while that exchange itself runs)."""
        if len(self.peers) < self.size:
            return []
        host = self.peers[self.rank][0]
        return [f"rank {r} (pid {pid})" for r, (h, pid) in enumerate(self.peers)
                if r != self.rank and h == host and not _alive(pid)]

    def missing_ranks(self):
        """A phrase naming the ranks on this machine whose process is gone; ranks on other
        machines cannot be checked from here."""
        host = self.peers[self.rank][0]
        gone = self.gone_ranks()
        remote = [r for r, (h, _) in enumerate(self.peers) if h != host]
        said = (f"{', '.join(gone)} died" if gone else "no other rank on this machine died")
        if remote:
            said += f"; ranks {', '.join(map(str, remote))} run elsewhere (the launcher's message names a dead one)"
        return said

    @staticmethod
    def died(gone, what):
        """What a rank says when gone_ranks() named `gone` while it waited in `what`."""
        return f"{', '.join(gone)} died while this rank waited in {what}"

    def stop(self, said):
        """Ends this rank at once, without MPI calls, saying why: the launcher sees status 1
        and ends the others."""
        sys.stderr.write(f"krnl train: error: [dist] rank {self.rank}: {said}; stopping\n")
        sys.stderr.flush()
        os._exit(1)

    def _collect(self, what, fn):
        if self._watchdog is None:
            return fn()
        self._watchdog.arm(what)
        try:
            return fn()
        except Exception:
            # MPI fails a collective whose peer died mid-transfer (MPICH: process_vm_readv,
            # ESRCH) before the watchdog's next poll: say which rank, not MPI's error stack. The
            # peer may still be exiting (its memory gone, its pid not yet a zombie).
            deadline = time.monotonic() + POLL_SECONDS
            while not (gone := self.gone_ranks()) and time.monotonic() < deadline:
                time.sleep(0.01)
            if gone:
                self.stop(self.died(gone, what))
            raise
        finally:
            self._watchdog.disarm()

    def allreduce(self, array, what="a sum across ranks", in_place=False):
        """The element-wise sum of a numpy array over the ranks: a new array, or with in_place
        `array` itself (contiguous) holding it; the input itself when there is one rank."""
        if self.size == 1:
            return array
        from mpi4py import MPI

        if in_place:
            if not array.flags.c_contiguous:
                raise ValueError("[dist] allreduce in place needs a contiguous array")
            self._collect(what, lambda: self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM))
            return array
        buf = np.ascontiguousarray(array)
        out = np.empty_like(buf)
        self._collect(what, lambda: self.comm.Allreduce(buf, out, op=MPI.SUM))
        return out

    def slice(self, batch):
        """This rank's rows of a global batch tuple (ids, targets[, segments, positions]): the
        ranks take equal consecutive slices, rank 0 first."""
        rows = len(batch[0])
        if rows % self.size:
            raise ValueError(f"[dist] a batch of {rows} rows does not divide among {self.size} ranks")
        per = rows // self.size
        return tuple(np.asarray(a)[self.rank * per:(self.rank + 1) * per] for a in batch)

    def span(self, n):
        """(lo, hi): this rank's consecutive share of n whole items (pairs, prompts) of a global batch, rank
        0 first: shares differ by one at most, the first ranks' the larger (the last get none when n is
        smaller than the ranks)."""
        q, extra = divmod(n, self.size)
        lo = self.rank * q + min(self.rank, extra)
        return lo, lo + q + (self.rank < extra)

    def allgather(self, obj, what="a gather from every rank"):
        """Every rank's `obj` (any picklable value), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        return self._collect(what, lambda: self.comm.allgather(obj))

    def watched(self, what, fn):
        """fn() under the watchdog: a wait of more than the timeout in it ends this rank, saying
        `what` it waited in (for waits outside MPI, such as a device's collective)."""
        return self._collect(what, fn)

    def bcast(self, obj, what="a broadcast from rank 0"):
        """Rank 0's `obj` on every rank (any picklable value)."""
        if self.size == 1:
            return obj
        return self._collect(what, lambda: self.comm.bcast(obj, root=0))

    def on_root(self, fn, what):
        """fn()'s value computed on rank 0 and broadcast; an exception it raised is raised on
        every rank (so that all stop alike, none waits for the others)."""
        if self.size == 1:
            return fn()
        ok, value = True, None
        if self.root:
            try:
                value = fn()
            except Exception as e:  # noqa: BLE001 (re-raised on every rank below)
                ok, value = False, e
        ok, value = self.bcast((ok, value), what)
        if not ok:
            raise value
        return value

    def check_same(self, name, data, step):
        """Raises ValueError on every rank unless `data` (bytes, e.g. the parameters) hashes the
        same on all of them: the ranks of a data-parallel run must hold identical parameters."""
        if self.size == 1:
            return
        digest = hashlib.sha256(data).hexdigest()[:16]
        every = self._collect(f"the {name} hash check of step {step}", lambda: self.comm.allgather(digest))
        if len(set(every)) > 1:
            groups = {}
            for r, d in enumerate(every):
                groups.setdefault(d, []).append(r)
            seen = "; ".join(f"ranks {','.join(map(str, rs))}: {d}" for d, rs in groups.items())
            raise ValueError(f"[dist] step {step}: the ranks' {name} differ ({seen}); every rank must run the same "
                             f"krnl build, device kind and options")

    def check_params(self, flat, step):
        """check_same of a FlatParams' f32 masters."""
        if self.size > 1:
            self.check_same("parameters", np.ascontiguousarray(flat.params.numpy()[:flat.numel]).tobytes(), step)

    def abort(self, code=1):
        """Ends every rank of the run (after this rank printed why)."""
        sys.stderr.flush()
        sys.stdout.flush()
        if self.size > 1:
            time.sleep(ABORT_GRACE_SECONDS)
            self.comm.Abort(code)
        raise SystemExit(code)


class _NoLock:
    """What ranks other than 0 hold instead of the output folder's lock."""

    def release(self):
        pass


NO_LOCK = _NoLock()
_WORLD = None


def supervise(argv):
    """Under an MPI launcher with several ranks (POSIX): run this rank's krnl as a child process
    and return its exit status, naming this rank where a signal killed the child; None in that
    child, or where there is nothing to supervise. MPICH's launcher SIGKILLs every other rank
    within a millisecond of reaping a dead one, before a survivor can say which rank died (its
    own message names a pid, at times a survivor's); this parent outlives its child to say it.
    The child dies with its parent (_die_with_parent) when the launcher kills the parent."""
    size, rank = launcher_size()
    if size <= 1 or os.name != "posix" or importlib.util.find_spec("mpi4py") is None:
        return None  # without mpi4py the rank's own run says how to install it
    if os.environ.get("KRNL_DIST_PARENT"):
        _die_with_parent(int(os.environ["KRNL_DIST_PARENT"]))
        return None
    env = dict(os.environ, KRNL_DIST_PARENT=str(os.getpid()))
    child = subprocess.Popen([sys.executable, "-m", "krnl", *argv], env=env, close_fds=False)  # the PMI fd
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, lambda sig, _frame: child.send_signal(sig))
    code = child.wait()
    if code < 0:
        print(f"krnl: error: [dist] rank {rank} (pid {child.pid}) was killed by {signal.Signals(-code).name}",
              file=sys.stderr, flush=True)
        code = 128 - code
    if code:
        # MPICH's launcher tears the job down when a rank exits non-zero and can drop what is
        # still in that rank's pipe (this line, the child's last words).
        time.sleep(ABORT_GRACE_SECONDS)
    return code


def _die_with_parent(parent):
    """supervise()'s child ends when its parent does: Linux's parent-death signal, else a thread
    that looks every half second (nothing else would end it before its next collective's timeout)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    else:
        def watch():
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, daemon=True, name="krnl-parent").start()
    if os.getppid() != parent:  # gone before the signal was armed
        os._exit(1)


def running():
    """Whether this process is one of several ranks (world() ran and found N > 1)."""
    return _WORLD is not None and _WORLD.size > 1


def guarded(fn, *args):
    """fn(*args), an exit code. Among several ranks, a failure here (a non-zero code, an
    exception) ends every rank: the others would wait for this one in their next collective."""
    try:
        code = fn(*args)
    except BaseException:
        if not running():
            raise
        traceback.print_exc()
        code = 1
    if code and running():
        world().abort(code)
    return code


def world(mute_others=False):
    """The World of this process (detected once): size 1 unless an MPI launcher started N > 1.
    mute_others: ranks other than 0 print nothing to stdout (rank 0 speaks for the run)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = _detect()
    if mute_others and not _WORLD.root:
        sys.stdout = open(os.devnull, "w")
    return _WORLD


def _detect():
    size, rank = launcher_size()
    if size <= 1:
        return World()
    try:
        from mpi4py import MPI
    except ImportError:
        raise ValueError(f"[dist] an MPI launcher started {size} ranks (this is rank {rank}) but mpi4py is not "
                         f"installed: pip install 'krnl[mpi]'") from None
    w = World(MPI.COMM_WORLD)
    if w.size != size:
        raise ValueError(f"[dist] the launcher says {size} ranks but MPI sees {w.size}: mpi4py is built on "
                         f"another MPI than the launcher's (use the launcher of the MPI mpi4py uses)")
    local = w.local_size()
    if local > 1 and "KRNL_NUM_THREADS" not in os.environ:
        # Ranks sharing a machine share its cores (read when the core's thread pool starts).
        os.environ["KRNL_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))
    # This rank's place among those on its machine: the CUDA device takes that GPU (modulo the
    # GPUs), so ranks sharing a machine take distinct ones (read when the device is made).
    host = w.peers[w.rank][0]
    os.environ.setdefault("KRNL_LOCAL_RANK", str(sum(1 for h, _ in w.peers[:w.rank] if h == host)))
    return w
