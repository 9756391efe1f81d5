"""The executor of krnl's `metal-cuda` test device: runs the dispatch records of the Metal
backend (csrc/metal's op files), the same records metal-sim executes, with the unmodified kernels of
metal/ compiled for an NVIDIA GPU by mslcuda.

    import mslcuda.metal_cuda
    mslcuda.metal_cuda.register(krnl._core, repo_root)   # then krnl.device("metal-cuda")

Each command buffer's records are launched in order on one stream and the executor waits for
the GPU before it returns, so completion means the host may read. Memory is managed
(mslcuda_alloc, cudaMallocManaged): tensors are host-visible as on Apple's unified memory."""
from __future__ import annotations

import collections
import ctypes
import os
from pathlib import Path

from mslsim.metal_sim import LibraryCache

from . import MslcudaError, build, runtime


class Executor(LibraryCache):
    def __init__(self, root: Path):
        super().__init__(root, build)
        self.rt = runtime()
        self.dispatches = 0  # launched so far (tests read it)
        self.launched = collections.Counter()  # by kernel name (the sanitizer driver's coverage)
        self._reachable: set = set()  # buffer bases the GPU can reach (managed memory)

    def __call__(self, records):
        if not self._libs:
            self.warm()
        bounce = self._bounce_buffers(records)
        try:
            for r in records:
                self.run(r, bounce)
        finally:
            # the command buffer is complete once the GPU is done: an error of any of its kernels
            # fails it (raised at its step's end)
            try:
                self.rt.synchronize()
            finally:
                for base, (tmp, n) in bounce.items():
                    ctypes.memmove(base, tmp, n)  # the kernels' writes, back into the host memory
                    self.rt.free(tmp)

    def _bounce_buffers(self, records):
        """{base: (managed copy, bytes)} for bound host memory the GPU cannot reach (a from_numpy
        tensor where the system does not page host memory in): the command buffer works on a
        managed copy, written back when it completes, as the shared memory it stands for would be."""
        ends = {}
        for r in records:
            for _index, _address, extent, base, offset in r["buffers"]:
                if not extent:
                    continue
                if base not in self._reachable:
                    if self.rt.device_accessible(base):
                        self._reachable.add(base)
                        continue
                    ends[base] = max(ends.get(base, 0), offset + extent)
        out = {}
        for base, n in ends.items():
            tmp = self.rt.alloc(n)
            ctypes.memmove(tmp, base, n)
            out[base] = (tmp, n)
        return out

    def run(self, r: dict, bounce=None):
        lib = self.library(r["library"], tuple(r["constants"]))
        buffers = {}
        for index, address, _extent, base, offset in r["buffers"]:
            buffers[index] = bounce[base][0] + offset if bounce and base in bounce else address
        lib.launch(r["kernel"], r["grid"], r["threads"], buffers, bytes(r["args"]), r["args_index"])
        self.dispatches += 1
        self.launched[r["kernel"]] += 1


def register(core, root, apple_family: int = 9) -> Executor:
    """Registers krnl's metal-cuda device with an executor over `root`/metal; returns it."""
    ex = Executor(root)
    core.testing.register_metal_cuda(ex, ex.rt.address("mslcuda_alloc"), ex.rt.address("mslcuda_free"),
                                     apple_family)
    return ex


def available() -> bool:
    """Whether this machine can run metal-cuda: nvcc and a CUDA GPU (the runtime builds and finds one)."""
    import shutil
    if shutil.which(os.environ.get("MSLCUDA_NVCC") or "nvcc") is None:
        return False
    try:
        runtime()
    except (MslcudaError, OSError):
        return False
    return True


__all__ = ["Executor", "register", "available", "MslcudaError"]
