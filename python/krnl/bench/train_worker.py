"""One rank of the data-parallel training workload (train_dist.py), run under a launcher:

    python -m krnl.bench.train_worker krnl SPEC.json   (one process, or under mpiexec -n N)
    python -m krnl.bench.train_worker ddp SPEC.json    (under torchrun --nproc-per-node N)

SPEC.json holds {folder, shape, device, kind, dtype, out}. Every rank trains on its slice of the
same global batches (N times the shape's rows: each rank gets the one-GPU batch), and rank 0
writes the figures (train_peers.figures over the global tokens) to `out` as JSON."""

import json
import os
import sys

from ..io.fileio import atomic_write_bytes
from .train import batches
from .train_peers import CLIP, figures, peft_model, timed_steps


def global_shape(s, ranks):
    """The shape whose batches are the global ones: `ranks` times the rows of one rank's."""
    return dict(s, B=s["B"] * ranks)


def _write(path, res):
    atomic_write_bytes(path, (json.dumps(res) + "\n").encode())


def run_krnl(spec):
    """krnl's Trainer over the MPI world (dist.world(): one rank without a launcher)."""
    import krnl
    from ..train.dist import world as dist
    from .train import run_krnl as train_krnl
    world = dist.world(mute_others=True)  # before the device: it picks this rank's GPU
    s = global_shape(spec["shape"], world.size)
    dev = krnl.device(spec["device"])
    res = train_krnl(dev, spec["dtype"], spec["folder"], s, batches(s), world=world)
    res["ranks"] = world.size
    if world.root:
        _write(spec["out"], res)


def run_ddp(spec):
    """transformers + PEFT under PyTorch DDP (NCCL on CUDA, gloo on the CPU): torchrun's ranks,
    each its slice of the global batch, the loss of the global batch's mean (each rank's token
    sum over the global target count, times the ranks: DDP averages the gradients)."""
    import torch
    import torch.distributed as tdist
    rank, size, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    on_cuda = spec["kind"] == "cuda"  # krnl's device kind (capabilities()): the torch device that matches it
    if on_cuda:
        torch.cuda.set_device(local)
        dev, sync = torch.device("cuda", local), torch.cuda.synchronize
    elif spec["kind"] == "cpu":
        dev, sync = torch.device("cpu"), (lambda: None)
    else:
        raise SystemExit(f"DDP + PEFT: no torch device with DDP for krnl's {spec['kind']} (cuda or cpu)")
    tdist.init_process_group("nccl" if on_cuda else "gloo")
    tdtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[spec["dtype"]]
    s = global_shape(spec["shape"], size)
    bs = batches(s)
    model, params, opt = peft_model(torch, spec["folder"], tdtype, dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if on_cuda else None)
    per = spec["shape"]["B"]
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()

    def step(b):
        rows = slice(rank * per, (rank + 1) * per)
        ids = torch.as_tensor(b.ids[rows], dtype=torch.long, device=dev)
        tg = torch.as_tensor(b.targets[rows], dtype=torch.long, device=dev)
        n_global = int((b.targets != -100).sum())
        logits = ddp(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tg.flatten(), ignore_index=-100,
                                                 reduction="sum") * (size / max(n_global, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        tdist.all_reduce(total)  # the global batch's mean loss, times the ranks
        return float(total) / size

    res = figures(*timed_steps(step, bs, sync), bs, s["warmup"])
    res.update(ranks=size, peak_bytes=int(torch.cuda.max_memory_reserved()) if on_cuda else None,
               peak_kind="reserved (torch.cuda)" if on_cuda else None)
    if rank == 0:
        _write(spec["out"], res)
    tdist.destroy_process_group()


def main(argv):
    if len(argv) != 2 or argv[0] not in ("krnl", "ddp"):
        print("usage: python -m krnl.bench.train_worker krnl|ddp SPEC.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    if argv[0] == "ddp":
        run_ddp(spec)
        return 0
    from ..train.dist import world as dist
    return dist.guarded(lambda: run_krnl(spec) or 0)  # a failing rank ends every rank


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
