"""krnl: LoRA fine-tuning with hand-written kernels. This package is the thin Python side; the
native core (`krnl._core`) owns devices, memory and every op.

Its folders are its layers, lowest first. A module imports modules of its own layer or lower ones,
never higher, and no import circle exists; tests/test_layering.py reads this table and checks
both, counting imports inside functions too, and checks that each layer is the folder of its
name (the lowest, ops, is the files at the top). Keep the table's form: a layer's name, then its
modules relative to krnl, `x.*` meaning every module under krnl/x:

    ops       __init__ _core profiler
    io        io io.*
    quant     quant quant.*
    models    models models.*
    formats   formats formats.*
    train     train train.*
    serve     serve serve.*
    bench     bench bench.*
    cli       cli cli.* __main__

- ops: the native core and what this file re-exports from it; importing any submodule runs this
  file first, so it may import nothing above.
- io: bytes on disk (atomic writes, safetensors, checkpoints, run folders, tokenizers), knowing
  nothing of the model, so that the model may read files through it.
- quant: quantized weights: MLX's affine and MXFP4 codecs (affine, mxfp4), GGUF's block codecs
  (gguf) and their writers (ggml_write; the K-quants' in kquants), and the quantized arrays the
  model holds and multiplies by (qweight).
- models: parameters, the model's configuration and LoRA layout, the layers, the model stack, and
  one file per family for what it adds to the Llama layer (gemma2, gemma3, phi3, qwen3).
- formats: the files that describe a model (HF and MLX quantized folders, GGUF files in gguf/,
  PEFT and mlx-lm adapters); they turn into a ModelConfig, a LoraConfig or a LlamaModel, so they
  stand on the model, and hf builds on adapter, mlx_folder and the GGUF reader, never the reverse
  (gguf.fuse and gguf.export, the GGUF writer, build on hf).
- train: the optimizers (optimizers/, re-exported by optim), batches, datasets, the embedded
  default task, the device step (step: eager or replayed), the training loop, and data parallel
  (dist/: the world of ranks, NCCL sums, what the trainer does with ranks); data and trainer both
  draw on batches and not on each other.
- serve: `krnl serve`'s engine (every running request decoded together), its adapters and its
  OpenAI-compatible HTTP API; on the model and the formats, apart from training.
- bench: `krnl bench` and `krnl tune` (the measured GEMM choices the CLI applies).
- cli: the `krnl` commands (cli.main) and the self-test (`krnl doctor`, cli/doctor/), which may
  use everything.

Where things are: LlamaModel in krnl.models.model; ModelConfig and LoraConfig in
krnl.models.config; load_model, load_tokenizer and fuse in krnl.formats.hf; Trainer and
TrainConfig in krnl.train.trainer.
"""

import sys as _sys

if _sys.platform != "darwin":
    # The CPU backend links the scipy-openblas32 wheel's BLAS. Loading it by path first lets the
    # extension resolve it however the package was installed (wheel, editable, in-tree build).
    import ctypes as _ctypes
    import os as _os

    # OpenBLAS workers spin for ~2^28 cycles after each call by default, stealing a core from the
    # core's own threaded loops that follow every GEMM in a step (twice as slow on 2 cores).
    # The library reads this variable once, when loaded (importing scipy_openblas32 loads it):
    # set it for this load only, unless the user chose a value.
    _saved = _os.environ.get("OPENBLAS_THREAD_TIMEOUT")
    _os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    try:
        import scipy_openblas32 as _sob

        _ctypes.CDLL(_os.path.join(_sob.get_lib_dir(), _sob.get_library(fullname=True)), mode=_ctypes.RTLD_GLOBAL)
    finally:
        if _saved is None:
            del _os.environ["OPENBLAS_THREAD_TIMEOUT"]

    # The CUDA backend opens cuDNN (fused attention), NVRTC (which cuDNN's attention engines
    # compile with) and NCCL (data-parallel gradient sums, krnl.train.dist.nccl) at run time: point it
    # at the libraries of installed nvidia wheels (nvidia-cudnn-cu13, nvidia-cuda-nvrtc,
    # nvidia-nccl-cu13), which are not on the loader's path.
    for _env, _rel in (("KRNL_CUDNN", ("nvidia", "cudnn", "lib", "libcudnn.so.9")),
                       ("KRNL_NVRTC", ("nvidia", "cu13", "lib", "libnvrtc.so.13")),
                       ("KRNL_NVRTC", ("nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12")),
                       ("KRNL_NCCL", ("nvidia", "nccl", "lib", "libnccl.so.2")),
                       ("KRNL_NCCL", ("nvidia", "cu13", "lib", "libnccl.so.2"))):
        if _env not in _os.environ:
            for _p in _sys.path:
                if _os.path.isfile(_os.path.join(_p or ".", *_rel)):
                    _os.environ[_env] = _os.path.join(_p or ".", *_rel)
                    break

from . import _core
from ._core import Device, Tensor, ops
from .profiler import Profile, profile

__version__ = "0.1.0"
__all__ = ["Device", "Tensor", "ops", "device", "devices", "unavailable_devices", "profile", "Profile", "num_threads",
           "cuda_graph"]

num_threads = _core.num_threads


def devices():
    """Names of the devices this build can use, best first (e.g. ['cpu'])."""
    return list(_core.devices())


def unavailable_devices():
    """Devices this build has but this machine cannot run, with why: {name: one-line reason}."""
    return dict(_core.unavailable_devices())


def device(name=None):
    """The device called `name` ('metal', 'cuda', 'cpu'); the best available one by default."""
    if name is None:
        name = _core.devices()[0]
    if not isinstance(name, str):
        raise TypeError(f"[device] name must be a string, got {type(name).__name__}")
    return _core.device(name)


def cuda_graph(dev, fn):
    """Records fn() on `dev` as a CUDA graph; returns a krnl.Graph whose replay() re-runs the whole
    call with one launch (no Python, validation or per-op launch cost) and whose `outputs` is what
    the recorded call returned. Same as dev.capture(fn); see its docstring for the constraints:
    fn runs twice (warm-up, then recorded), replays reuse the recorded buffers, shapes and scalars,
    inputs vary only through new contents written into tensors made before capture
    (dev.upload(t, array)), and host reads, steps or nested captures inside fn raise."""
    return dev.capture(fn)
