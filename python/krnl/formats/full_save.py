"""Writes a full fine-tune's files (formats/full_model.py says which) at the end of its run."""

import json
from itertools import chain
from pathlib import Path

from ..io.fileio import atomic_write_bytes, atomic_write_chunks
from ..io.safetensors_io import encode, header_bytes, nbytes
from .full_model import CONFIG_NAME, MODEL_SUBFOLDER, WEIGHTS_NAME, full_config, stored
from .hf import load_hf_weights, read_config, write_model


def save_full(out_dir, state, lora, config, base_model, dtype="F32"):
    """Writes a full fine-tune's files into out_dir (see above); state {model name: float32 array};
    dtype: the safetensors dtype of adapters.safetensors where the base is no folder. Returns the
    paths written."""
    out = Path(out_dir)
    tensors = stored(config, state)
    base = Path(base_model) if base_model else None
    folder = base is not None and base.is_dir()
    types = {}
    if folder:  # the base's stored dtypes, as transformers' save_pretrained keeps them
        weights = load_hf_weights(base, read_config(base))
        types = {k: getattr(weights.get(k), "st_dtype", dtype) for k in tensors}
    st = {k: types.get(k, dtype) for k in tensors}
    header = header_bytes([(k, st[k], tuple(a.shape), nbytes(st[k], a.shape)) for k, a in tensors.items()],
                          {"format": "mlx"})
    atomic_write_chunks(out / WEIGHTS_NAME, chain([header], (encode(a, st[k]) for k, a in tensors.items())))
    atomic_write_bytes(out / CONFIG_NAME, (json.dumps(full_config(lora, config, base_model), indent=2) + "\n").encode())
    written = [out / WEIGHTS_NAME, out / CONFIG_NAME]
    if folder:
        write_model(base, out / MODEL_SUBFOLDER, lambda c, w: {k: (lambda a=a: a) for k, a in tensors.items()})
        written.append(out / MODEL_SUBFOLDER)
    return written
