"""Where and in what each implementation of a workload runs: krnl's device and dtype, and the
matching device of each peer (PyTorch's CUDA, MPS or CPU; MLX's GPU or CPU), or why there is none."""

from functools import partial

import krnl

# A peer is checked against krnl at a small size in the dtype it is timed in. bf16 keeps 8
# significant bits (0.4% a rounding) and a layer's step compounds dozens of roundings in both
# implementations; a wrong step (a missing term, a wrong scale) is off by tens of percent.
TOLERANCE = {"f32": 1e-4, "f16": 2e-2, "bf16": 5e-2}


class Unavailable(Exception):
    """A peer that cannot run this problem here (its device or dtype); the message says why."""


# The device kinds (capabilities()["kind"]) that are GPUs: W3 and the GPU sizes run there, and a
# peer's GPU device stands beside them. Not "not synchronous": metal-sim queues its ops too, but
# it is the CPU running Metal's kernels, hours over W3.
GPU_KINDS = ("cuda", "metal")


def capabilities(device):
    """The capabilities of `device`, a krnl Device or a device name (Device.capabilities())."""
    return (krnl.device(device) if isinstance(device, str) else device).capabilities()


def kind(device):
    """The backend behind `device` (a Device or a name): "cpu", "cuda", "metal", ..."""
    return capabilities(device)["kind"]


def is_gpu(device):
    """W3 runs only here: metal-sim and the CPU would take hours over a Llama-3-8B layer."""
    return kind(device) in GPU_KINDS


def compute_dtype(device):
    """The dtype a step is timed in unless --dtype says otherwise: what a user trains in there,
    the device's compute_dtype (bf16 on CUDA, f16 on Metal, f32 on the CPU)."""
    return capabilities(device)["compute_dtype"]


def has_graphs(device):
    """Whether krnl can capture a step as a replayable graph on this device (Device.capture)."""
    return capabilities(device)["graphs"]


def replayed(dev, body):
    """(step, graph): `body` recorded once on `dev` as a CUDA graph (Device.capture); step()
    replays it and waits. step.release gives the graph's buffers back; step.graph is the graph."""
    graph = dev.capture(body)

    def step():
        graph.replay()
        dev.synchronize()

    step.release, step.graph = graph.release, graph
    return step, graph


def peer_builders(numpy, torch, mlx):
    """A workload's peers by name (workloads.PEER_NAMES) from its three builders: torch(problem,
    mode) with mode None (eager) or a torch.compile mode, mlx(problem, compiled)."""
    return {"numpy": numpy, "torch": partial(torch, mode=None), "torch.compile": partial(torch, mode="default"),
            "compile+cudagraphs": partial(torch, mode="reduce-overhead"), "mlx": partial(mlx, compiled=False),
            "mx.compile": partial(mlx, compiled=True)}


def numpy_only_f32_cpu(device_name, dtype):
    if kind(device_name) != "cpu" or dtype != "f32":
        raise Unavailable(f"float32 on the host CPU: a peer of the cpu device in f32 only (this run: "
                          f"{device_name}, {dtype})")


def torch_target(device_name, dtype, mode=None, device_kind=None):
    """(torch module, torch device string, torch dtype, sync()) for a peer of krnl's `device_name`:
    CUDA for cuda, MPS for metal, the CPU (krnl's thread count) for cpu. `mode` "reduce-overhead"
    (torch.compile with CUDA graphs) exists on CUDA only. device_kind: the device's kind where it
    is known (a peer's own process: it opens no krnl device for it)."""
    import torch
    k = device_kind or kind(device_name)
    if mode == "reduce-overhead" and k != "cuda":
        raise Unavailable("torch.compile with CUDA graphs: cuda devices only")
    if k == "cuda":
        if not torch.cuda.is_available():
            raise Unavailable("this torch has no CUDA (torch.cuda.is_available() is False)")
        dev, sync = "cuda", torch.cuda.synchronize
    elif k == "metal":
        if not torch.backends.mps.is_available():
            raise Unavailable("this torch has no MPS device")
        dev, sync = "mps", torch.mps.synchronize
    elif k == "cpu":
        torch.set_num_threads(krnl.num_threads())
        dev, sync = "cpu", (lambda: None)
    else:
        raise Unavailable(f"no torch device matches krnl's {device_name}")
    return torch, dev, {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype], sync


def mlx_target(device_name, dtype):
    """(mlx.core, mlx device, mlx dtype) for a peer of krnl's `device_name`: MLX's GPU (Metal or
    CUDA build) for a GPU device, its CPU for cpu."""
    import mlx.core as mx
    k = kind(device_name)
    if k == "cpu":
        dev = mx.cpu
    elif k in GPU_KINDS:
        if not mx.is_available(mx.gpu):
            raise Unavailable("this MLX build has no GPU (the Linux CPU wheel); pip install \"mlx[cuda13]\"")
        dev = mx.gpu
    else:
        raise Unavailable(f"no MLX device matches krnl's {device_name}")
    return mx, dev, {"f32": mx.float32, "bf16": mx.bfloat16, "f16": mx.float16}[dtype]


