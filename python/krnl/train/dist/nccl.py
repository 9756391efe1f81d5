"""The gradient's sum across ranks on the GPUs themselves: where every rank of a data-parallel run
is a CUDA device with a loadable NCCL (and no two ranks share a GPU), the flat LoRA gradient and
the micro-batches' loss sums are summed by one NCCL allreduce on each device's stream, once per
optimizer step after accumulation (recorded into the replayed optimizer graph where the step
replays), instead of the host copy and MPI_Allreduce of StepRunner.reduce. MPI still starts the
run, carries NCCL's unique id from rank 0 to the others, the checkpoints and the errors.

KRNL_DIST_BACKEND: auto (the default: NCCL where every rank can, else MPI through host memory),
nccl (NCCL or a one-line error; also with a single rank, which then sums with itself: a check of
the path on one GPU), mpi (always the host path). Rank 0 prints one line saying which path the
gradient takes and why."""

import os
import socket
import weakref

from ... import _core

BACKEND_VAR = "KRNL_DIST_BACKEND"
MODES = ("auto", "nccl", "mpi")
_MADE = weakref.WeakKeyDictionary()  # World -> (device name, NcclReducer or None): chosen once per run


def backend_mode(env=None):
    """KRNL_DIST_BACKEND's value (auto when unset); a one-line error for anything else."""
    mode = (os.environ if env is None else env).get(BACKEND_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"[dist] {BACKEND_VAR} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def rank_info(dev):
    """What this rank offers the choice: its host, its GPU (PCI bus id), its NCCL's version, or
    why it has none (a device without NCCL collectives, or the loader's one-line error)."""
    caps = dev.capabilities()
    info = {"host": socket.gethostname(), "gpu": caps["details"].get("pci_bus_id"), "nccl": None, "why": ""}
    if "nccl" not in caps["collectives"]:
        info["why"] = f"{dev.name} has no NCCL collectives (CUDA devices do)"
        return info
    try:
        info["nccl"] = _core.nccl_info()["version"]
    except RuntimeError as e:
        info["why"] = str(e)
    return info


def decide(infos, mode="auto"):
    """(use NCCL?, why) from every rank's rank_info, the same answer on every rank."""
    if mode == "mpi":
        return False, f"{BACKEND_VAR}=mpi"
    lacking = [(r, i["why"]) for r, i in enumerate(infos) if i["nccl"] is None]
    if lacking:
        reasons = sorted({why for _, why in lacking})
        if len(lacking) == len(infos) and len(reasons) == 1:
            return False, f"every rank: {reasons[0]}"
        return False, "; ".join(f"rank {r}: {why}" for r, why in lacking)
    first = {}
    for r, i in enumerate(infos):
        at = (i["host"], i["gpu"])
        if at in first:
            return False, (f"ranks {first[at]} and {r} share the GPU {i['gpu']} on {i['host']} (NCCL needs a GPU of "
                           f"its own per rank: more GPUs, or CUDA_VISIBLE_DEVICES per rank)")
        first[at] = r
    versions = sorted({i["nccl"] for i in infos})
    return True, f"NCCL {', '.join(versions)} on every rank"


def describe(use, why, size):
    """Rank 0's line about the gradient's path."""
    if use:
        return (f"dist: the gradient is summed over {size} rank(s) by NCCL on the GPUs, in device memory on each "
                f"step's stream ({why})")
    return f"dist: the gradient is summed over {size} ranks by MPI through host memory ({why})"


class NcclReducer:
    """The device-side sum StepRunner uses instead of its host allreduce."""

    def __init__(self, world, dev, comm):
        self.world, self.dev, self.comm = world, dev, comm

    def allreduce(self, tensors):
        """Queues the in-place sums of f32 device tensors on the device's stream (no wait)."""
        self.comm.allreduce(list(tensors))

    def wait(self, fn, what):
        """fn() (which waits for the device) under the watchdog, then NCCL's own error check: a
        peer that stops makes this rank's collective wait on the GPU, not in MPI."""
        out = self.world.watched(what, fn)
        self.comm.check()
        return out


def reducer_for(world, dev, log=print):
    """The NcclReducer of this run's ranks on `dev`, or None for the host path (MPI, or a single
    rank with nothing to sum). Chosen once per World: every rank gathers every rank's rank_info
    and takes the same decision; rank 0 then makes NCCL's unique id, MPI broadcasts it, and each
    rank joins the communicator."""
    mode = backend_mode()
    if world.size == 1 and mode != "nccl":
        # Nothing to sum and nothing set up: one process may train on one device, then another.
        return None
    if world in _MADE:
        name, reducer = _MADE[world]
        if name != dev.name:
            raise ValueError(f"[dist] the gradient's allreduce was set up on {name}, not {dev.name}")
        return reducer
    reducer = None
    # mpi: no rank opens NCCL (the same answer everywhere, since every rank reads the variable)
    infos = [] if mode == "mpi" else world.allgather(rank_info(dev), "the start (choosing the gradient's allreduce)")
    use, why = decide(infos, mode)
    if mode == "nccl" and not use:
        raise ValueError(f"[dist] {BACKEND_VAR}=nccl but NCCL cannot run here: {why}")
    if world.root:
        log(describe(use, why, world.size))
    if use:
        uid = world.on_root(_core.nccl_unique_id, "the start (making NCCL's unique id)")
        comm = world.watched("the start (joining the NCCL communicator)",
                             lambda: _core.nccl_comm(dev, uid, world.rank, world.size))
        reducer = NcclReducer(world, dev, comm)
    _MADE[world] = (dev.name, reducer)
    return reducer
