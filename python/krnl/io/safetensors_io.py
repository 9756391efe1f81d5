"""The safetensors file format, parsed and written here (8-byte header length, JSON header, raw
little-endian data) so that tensors are memory-mapped and read from disk only when used. bf16,
which numpy has no type for, is widened to f32 by a 16-bit shift one tensor at a time.

This is storage only: it knows bytes and dtypes, not models. HF folders (hf.py) and adapters
(adapter.py) build on it."""

import json
import struct
from pathlib import Path

import numpy as np

NP_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "U32": np.dtype("<u4"),
             "I32": np.dtype("<i4"), "U8": np.dtype("u1")}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "U32": 4, "I32": 4, "U8": 1}
# Integer tensors are quantized weights' packed codes (U32, I32) or the scales of MLX's
# microscaling modes (U8): read as their raw integers, never converted to float.
INT_DTYPES = ("U32", "I32", "U8")
# The float dtypes krnl computes in, by their safetensors names, and back.
FLOAT_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
ST_DTYPES = {v: k for k, v in FLOAT_DTYPES.items()}


def nbytes(st_dtype, shape):
    """Bytes of a tensor of safetensors dtype `st_dtype` and `shape` (a scalar when shape is empty)."""
    return ITEMSIZE[st_dtype] * (int(np.prod(shape)) if shape else 1)


# ---------------------------------------------------------------------------------------------
# bf16 <-> f32


def bf16_to_f32(u16):
    """uint16 bf16 bit patterns -> float32 (exact)."""
    return (np.asarray(u16, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """float32 -> uint16 bf16 bit patterns, rounded to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, np.float32))
    if nan.any():
        rounded = np.where(nan, ((u >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)
    return rounded


# ---------------------------------------------------------------------------------------------
# Read side


class LazyTensor:
    """A tensor in a memory-mapped safetensors file: `.shape`, `.st_dtype` ("F32", "F16", "BF16";
    "U32", "I32" or "U8" for quantized files) and `np.asarray(t, np.float32)`; bytes are read and
    converted only when asked for. An integer tensor reads as its raw integers (np.asarray(t)):
    packed codes are bit patterns, and a float conversion of them means nothing."""

    def __init__(self, path, name, st_dtype, shape, start, end):
        self.path, self.name, self.st_dtype = path, name, st_dtype
        self.shape, self.start, self.end = tuple(int(s) for s in shape), int(start), int(end)
        self._mm = None

    @property
    def ndim(self):
        return len(self.shape)

    def raw(self):
        """The stored elements: a read-only memmap (f32/f16/f64, u32/i32/u8) or uint16 bit patterns
        (bf16)."""
        n = int(np.prod(self.shape)) if self.shape else 1
        if n == 0:
            return np.zeros(self.shape, np.uint16 if self.st_dtype == "BF16" else NP_DTYPES[self.st_dtype])
        dt = np.dtype("<u2") if self.st_dtype == "BF16" else NP_DTYPES[self.st_dtype]
        return np.memmap(self.path, dtype=dt, mode="r", offset=self.start, shape=self.shape)

    def raw_bytes(self):
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read(self.end - self.start)

    def float32(self):
        r = self.raw()
        if self.st_dtype == "BF16":
            return bf16_to_f32(r)
        return np.asarray(r, np.float32)

    def __array__(self, dtype=None, copy=None):
        if self.st_dtype in INT_DTYPES:
            a = np.array(self.raw())
            return a if dtype is None else a.astype(dtype, copy=False)
        a = self.float32()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __repr__(self):
        return f"LazyTensor({self.name!r}, {self.st_dtype}, {self.shape}, {self.path})"


def read_safetensors_header(path):
    """{name: (dtype, shape, abs_start, abs_end)} and the metadata dict of one safetensors file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ValueError(f"[hf] cannot read {path}: {e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"[hf] {path} is not a valid safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"[hf] {path} is not a valid safetensors file: the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    base, out = 8 + n, {}
    for name, info in header.items():
        try:
            dt, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"[hf] {path}: malformed header entry for {name!r}") from None
        if dt not in ITEMSIZE:
            raise ValueError(f"[hf] {path}: tensor {name!r} has dtype {dt}; krnl reads F32, F16 and BF16 "
                             "weights and U32, I32 or U8 quantized tensors")
        if e - b != nbytes(dt, shape) or base + e > size:
            raise ValueError(f"[hf] {path}: tensor {name!r} has inconsistent data offsets (truncated file?)")
        out[name] = (dt, tuple(shape), base + b, base + e)
    return out, meta


# ---------------------------------------------------------------------------------------------
# Write side


def header_bytes(entries, metadata=None):
    """entries: [(name, st_dtype, shape, nbytes)] in data order -> header bytes (padded to 8)."""
    h, off = {}, 0
    if metadata:
        h["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, dt, shape, nb in entries:
        h[name] = {"dtype": dt, "shape": [int(s) for s in shape], "data_offsets": [off, off + nb]}
        off += nb
    js = json.dumps(h, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js


def encode(arr32, st_dtype):
    """float32 array -> bytes in the safetensors dtype."""
    if st_dtype == "BF16":
        return f32_to_bf16(arr32).astype("<u2").tobytes()
    return np.ascontiguousarray(arr32, NP_DTYPES[st_dtype]).tobytes()
