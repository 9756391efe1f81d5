"""mslcuda: run the Metal Shading Language compute kernels of metal/ on an NVIDIA GPU.

    lib = mslcuda.build("metal/gemm.metal", constants={0: True}, include_dirs=[...])
    lib.launch("gemm_nt_f16", grid=(gx, gy, 1), threads=(32, 1, 1), buffers={0: ptr_a, ...},
               args=bytes(gemm_args), args_index=3)

Pipeline: (1) the C preprocessor expands the .metal file (macros, kargs.h and rng.h; the
<metal_*> headers resolve to mslsim's empty stubs; it is compiled as MSL 3.1, __METAL_VERSION__
310, so metal/kargs.h's KRNL_BF16 is on and the bfloat kernels build too); (2) translate() rewrites it into CUDA for include/mslcuda.h with a __global__
wrapper per kernel and a launcher; (3) nvcc builds it into a shared object per (file, function
constants), cached by content hash; (4) Library.launch() starts a kernel on the device's one
stream (include/mslcuda_rt.cu, built once, owns it and the managed memory).

Environment: MSLCUDA_NVCC (nvcc), MSLCUDA_ARCH (sm_90), MSLCUDA_CACHE (~/.cache/krnl-mslcuda),
MSLCUDA_HOST_CXX (nvcc's host compiler, e.g. /usr/bin/g++).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = PACKAGE_DIR / "include"
MSLSIM_DIR = PACKAGE_DIR.parents[1] / "mslsim"  # tools/mslsim: the parsing helpers and stub headers
if str(MSLSIM_DIR) not in sys.path:
    sys.path.insert(0, str(MSLSIM_DIR))

from mslsim import msl_defines  # noqa: E402  (what Apple's compiler defines per MSL version)

from .translate import MslcudaError, Translated, translate  # noqa: E402

STUB_INCLUDE = MSLSIM_DIR / "mslsim" / "include" / "stub"

__all__ = ["build", "runtime", "Library", "MslcudaError", "translate", "translate_file"]


def cache_dir() -> Path:
    return Path(os.environ.get("MSLCUDA_CACHE") or Path.home() / ".cache" / "krnl-mslcuda")


def _nvcc() -> str:
    return os.environ.get("MSLCUDA_NVCC") or "nvcc"


def _arch() -> str:
    return os.environ.get("MSLCUDA_ARCH") or "sm_90"


@functools.lru_cache(maxsize=None)
def _toolchain_id(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise MslcudaError(f"nvcc '{nvcc}' not found (set MSLCUDA_NVCC): {e}") from None


def _flags(opt: str, extra=()) -> list[str]:
    f = ["-std=c++17", opt, f"-arch={_arch()}", "-lineinfo", "-shared", "-Xcompiler", "-fPIC",
         "--expt-relaxed-constexpr", f"-I{INCLUDE_DIR}", "--diag-suppress=177,550,186,1444,20012",
         *extra]
    if os.environ.get("MSLCUDA_HOST_CXX"):
        f += ["-ccbin", os.environ["MSLCUDA_HOST_CXX"]]
    return f


def preprocess(path: Path, defines: dict | None = None, include_dirs=(), msl_version: int = 310) -> str:
    """The .metal file expanded. Line markers name files relative to their folder's parent
    ("metal/gemm.metal", "core/rng.h"), so that the same sources give the same code, and the same
    cached library, wherever the checkout is."""
    path = Path(path).resolve()
    dirs = [Path(d).resolve() for d in include_dirs]
    cmd = [os.environ.get("MSLSIM_CXX") or "g++", "-E", "-x", "c++", "-std=c++17", f"-I{STUB_INCLUDE}",
           *msl_defines(msl_version), "-DMSLCUDA=1"]
    cmd += [f"-I{d}" for d in dirs]
    cmd += [f"-D{k}={v}" for k, v in (defines or {}).items()]
    cmd.append(str(path))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise MslcudaError(f"preprocessing {path} failed:\n{r.stderr}")
    out = r.stdout
    for d in sorted({path.parent, STUB_INCLUDE.resolve(), *dirs}, key=lambda p: -len(str(p))):
        out = out.replace(f'"{d}/', f'"{d.name}/')
    return out


def translate_file(source, constants: dict | None = None, *, defines=None, include_dirs=()) -> Translated:
    path = Path(source)
    if not path.is_file():
        raise MslcudaError(f"{path}: no such file")
    try:
        return translate(preprocess(path, defines, include_dirs), constants)
    except MslcudaError as e:
        raise MslcudaError(f"{path}: {e}") from None


def _tmp(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _compile(stem: str, code: str, opt: str, what: str, link_only_check: bool = False) -> Path:
    """nvcc `code` into <cache>/<stem>-<hash>.so (or reuse it)."""
    nvcc = _nvcc()
    flags = _flags(opt)
    # the include folder's place is no part of the key (its headers' contents are): a cache built
    # in one checkout serves another
    key_flags = [f for f in flags if f != f"-I{INCLUDE_DIR}"]
    h = hashlib.sha256("\0".join([code, " ".join(key_flags), _toolchain_id(nvcc)] +
                                 [f.read_text() for f in sorted(INCLUDE_DIR.glob("*.h"))]).encode())
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    so = cache / f"{stem}-{h.hexdigest()[:20]}.so"
    if not so.exists():
        cu = so.with_suffix(".cu")
        tmp = _tmp(cu)
        tmp.write_text(code)
        os.replace(tmp, cu)
        tmp = _tmp(so)
        r = subprocess.run([nvcc, *flags, str(cu), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode:
            tmp.unlink(missing_ok=True)
            raise MslcudaError(f"compiling {what} (generated {cu}) failed:\n{r.stderr[-20000:]}")
        os.replace(tmp, so)
    return so


def build(source, constants: dict | None = None, *, defines=None, include_dirs=(), opt: str = "-O2",
          name: str | None = None, load: bool = True):
    """Translate and compile the .metal file `source` (or take it from the cache). Returns its
    Library, or with load=False only the path of the shared object (a compile check without a GPU).
    constants: function constant values by name or [[function_constant(index)]]."""
    path = Path(source)
    tr = translate_file(path, constants, defines=defines, include_dirs=include_dirs)
    so = _compile(name or path.stem, tr.code, opt, str(path))
    return Library(so, tr, path) if load else so


class Runtime:
    """The device's memory and stream (include/mslcuda_rt.cu): one per process."""

    def __init__(self, so: Path):
        self.path = so
        L = self._lib = ctypes.CDLL(str(so))
        L.mslcuda_init.restype = ctypes.c_char_p
        L.mslcuda_stream.restype = ctypes.c_void_p
        L.mslcuda_alloc.restype = ctypes.c_void_p
        L.mslcuda_alloc.argtypes = [ctypes.c_size_t]
        L.mslcuda_free.argtypes = [ctypes.c_void_p]
        L.mslcuda_synchronize.restype = ctypes.c_char_p
        L.mslcuda_device_accessible.argtypes = [ctypes.c_void_p]
        L.mslcuda_device_name.restype = ctypes.c_char_p
        err = L.mslcuda_init()
        if err:
            raise MslcudaError(err.decode())
        self.stream = L.mslcuda_stream()

    def address(self, fn: str) -> int:
        """The C function `fn` of the runtime as an integer (krnl's device allocates through it)."""
        return ctypes.cast(getattr(self._lib, fn), ctypes.c_void_p).value

    def alloc(self, n: int) -> int:
        p = self._lib.mslcuda_alloc(n)
        if not p:
            raise MslcudaError(f"cudaMallocManaged of {n} bytes failed")
        return p

    def free(self, p: int):
        self._lib.mslcuda_free(p)

    def synchronize(self):
        err = self._lib.mslcuda_synchronize()
        if err:
            raise MslcudaError(err.decode())

    def device_accessible(self, ptr: int) -> bool:
        return bool(self._lib.mslcuda_device_accessible(ptr))

    def device_name(self) -> str:
        return self._lib.mslcuda_device_name().decode()


_runtime = None
_runtime_lock = threading.Lock()


def runtime() -> Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            code = (INCLUDE_DIR / "mslcuda_rt.cu").read_text()
            _runtime = Runtime(_compile("mslcuda_rt", code, "-O2", "mslcuda_rt.cu"))
        return _runtime


def _dim3(v, what: str, kernel: str) -> tuple[int, int, int]:
    v = tuple(int(x) for x in v)
    if not 1 <= len(v) <= 3 or min(v) < 1:
        raise MslcudaError(f"kernel {kernel}: {what} must be 1 to 3 sizes >= 1, got {v}")
    return v + (1,) * (3 - len(v))


class Library:
    """A compiled .metal file: its kernels by host name, launched on the runtime's stream."""

    def __init__(self, so_path: Path, tr: Translated, source: Path):
        self.path = so_path
        self.source = source
        self.translated = tr
        L = self._lib = ctypes.CDLL(str(so_path))
        L.mslcuda_kernel_count.restype = ctypes.c_int
        L.mslcuda_kernel_name.restype = ctypes.c_char_p
        L.mslcuda_kernel_name.argtypes = [ctypes.c_int]
        u32p = ctypes.POINTER(ctypes.c_uint32)
        L.mslcuda_launch.restype = ctypes.c_char_p
        L.mslcuda_launch.argtypes = [ctypes.c_int, u32p, u32p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                     ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p]
        self.index = {L.mslcuda_kernel_name(i).decode(): i for i in range(L.mslcuda_kernel_count())}

    @property
    def kernel_names(self) -> list[str]:
        return list(self.index)

    def launch(self, kernel: str, grid, threads, buffers: dict, args: bytes = b"", args_index: int = 31):
        """Queues dispatchThreadgroups(grid, threads) of `kernel` on the runtime's stream.
        buffers: {[[buffer(i)]]: device address}; args: bytes bound at [[buffer(args_index)]]."""
        k = self.index.get(kernel)
        if k is None:
            raise MslcudaError(f"{self.source.name}: no kernel '{kernel}' (has: {', '.join(self.index)})")
        grid, threads = _dim3(grid, "grid", kernel), _dim3(threads, "threads", kernel)
        if threads[0] * threads[1] * threads[2] > 1024:
            raise MslcudaError(f"kernel {kernel}: {threads} is more than 1024 threads per threadgroup")
        nb = max([*buffers, -1]) + 1
        ptrs = (ctypes.c_void_p * max(nb, 1))()
        for i, p in buffers.items():
            ptrs[i] = p
        err = self._lib.mslcuda_launch(k, (ctypes.c_uint32 * 3)(*grid), (ctypes.c_uint32 * 3)(*threads), ptrs, nb,
                                       bytes(args), len(args), args_index, runtime().stream)
        if err:
            raise MslcudaError(f"{self.source.name}: launching {kernel} {grid}x{threads}: {err.decode()}")
