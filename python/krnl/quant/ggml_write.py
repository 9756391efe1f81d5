"""The write side of GGUF's tensor types (krnl fuse --export-gguf): the bytes a ggml tensor of a
type holds for float32 values, through the quantizers that define the formats: gguf-py's for
Q8_0, Q4_0, Q5_0, Q5_1 and BF16 (the ones llama.cpp's converter uses; their bytes are ggml's
reference quantizers'), krnl's kquants for Q4_K, Q5_K and Q6_K (gguf-py has none)."""

import numpy as np

from . import kquants


def encode(array, type_name):
    """The bytes (rows, bytes per row) uint8 that a ggml tensor of `type_name` holds for float32
    `array` (..., cols), its rows the array's rows in order."""
    a = np.asarray(array, np.float32)
    rows = np.ascontiguousarray(a.reshape(-1, a.shape[-1]))
    if type_name == "F32":
        out = rows
    elif type_name == "F16":
        out = rows.astype(np.float16)
    elif type_name in kquants.QTYPES.values():
        out = kquants.quantize(rows, type_name.lower())
    else:
        import gguf
        from gguf.quants import quantize

        out = quantize(rows, gguf.GGMLQuantizationType[type_name])
    return np.ascontiguousarray(out).view(np.uint8).reshape(rows.shape[0], -1)
