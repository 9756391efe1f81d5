"""Writes a full fine-tune's files (formats/full_model.py says which) at the end of its run."""

import json
from itertools import chain
from pathlib import Path

from ..io.fileio import atomic_write_bytes, atomic_write_chunks
from ..io.safetensors_io import encode, header_bytes, nbytes
from .full_model import CONFIG_NAME, MODEL_SUBFOLDER, WEIGHTS_NAME, full_config, stored
from .hf import write_model


def save_full(out_dir, state, lora, config, base_model, dtype="F32"):
    """Writes a full fine-tune's files into out_dir (formats/full_model.py); state {model name:
    float32 array}; adapters.safetensors in the base folder's stored dtypes, or `dtype` where the
    base is no folder. Returns the paths written."""
    out = Path(out_dir)
    tensors = stored(config, state)
    base = Path(base_model) if base_model else None
    st = dict.fromkeys(tensors, dtype)
    written = []
    if base is not None and base.is_dir():
        def replaced(_, weights):  # write_model's one read of the base: its stored dtypes kept here too
            st.update({k: getattr(weights.get(k), "st_dtype", dtype) for k in tensors})
            return {k: (lambda a=a: a) for k, a in tensors.items()}
        write_model(base, out / MODEL_SUBFOLDER, replaced)
        written.append(out / MODEL_SUBFOLDER)
    # the weights, then the config naming them: the run's files complete last (resume looks for them)
    header = header_bytes([(k, st[k], tuple(a.shape), nbytes(st[k], a.shape)) for k, a in tensors.items()],
                          {"format": "mlx"})
    atomic_write_chunks(out / WEIGHTS_NAME, chain([header], (encode(a, st[k]) for k, a in tensors.items())))
    atomic_write_bytes(out / CONFIG_NAME, (json.dumps(full_config(lora, config, base_model), indent=2) + "\n").encode())
    return written + [out / WEIGHTS_NAME, out / CONFIG_NAME]
