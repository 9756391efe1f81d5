"""Training checkpoints: one directory per checkpoint, written atomically.

Layout under a run's checkpoint root:

    root/
      latest                  one line: the name of the newest complete checkpoint
      step-00000100/
        adapter.safetensors   the LoRA tensors
        optimizer.safetensors every numpy array of the optimizer state (m, v, ...)
        optimizer.json        the rest of the optimizer state (arrays replaced by references)
        trainer.json          step, data position, RNG state, anything JSON-able
        fingerprint.json      what the checkpoint belongs to (model config, LoRA config, shapes)
        manifest.json         size and sha256 of each file above; written last

Atomicity: everything is written into a hidden temporary sibling (`.tmp-step-...`), each file
fsynced, then the directory is renamed into place and `latest` replaced atomically
(fileio.atomic_write_bytes). A crash at any point leaves the previous checkpoint and `latest` untouched; a
leftover temporary directory never matches the `step-<digits>` name pattern, so it is never
taken for a checkpoint (and is removed by the next save).
"""

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field

import numpy as np

from .fileio import atomic_write_bytes

_NAME = re.compile(r"^step-(\d+)$")
LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = 1


@dataclass
class Checkpoint:
    path: str
    step: int
    adapter: dict
    optimizer_state: dict
    trainer_state: dict
    fingerprint: dict = field(default_factory=dict)


def _st():
    try:
        import safetensors.numpy as stn
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("[checkpoint] needs the safetensors package (pip install 'safetensors>=0.4')") from e
    return stn


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_bytes(path, data):
    """Writes and fsyncs one file (the single writer every checkpoint file goes through)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _json_bytes(obj, what):
    try:
        return json.dumps(obj, indent=1, sort_keys=True, allow_nan=True).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"[save_checkpoint] {what} is not JSON-serialisable: {e}") from None


def _split_arrays(obj, tensors, prefix=""):
    """obj with every numpy array moved into `tensors` under its key path and replaced by
    {"__tensor__": key}; numpy scalars become Python numbers."""
    if isinstance(obj, np.ndarray):
        key = prefix or "_"
        tensors[key] = np.ascontiguousarray(obj)
        return {"__tensor__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"[save_checkpoint] optimizer_state keys must be strings, got {k!r}")
            out[k] = _split_arrays(v, tensors, f"{prefix}/{k}" if prefix else k)
        return out
    if isinstance(obj, (list, tuple)):
        return [_split_arrays(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]
    return obj


def _join_arrays(obj, tensors, fname):
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            key = obj["__tensor__"]
            if key not in tensors:
                raise ValueError(f"[load_checkpoint] {fname} has no tensor {key!r}")
            return tensors[key]
        return {k: _join_arrays(v, tensors, fname) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_arrays(v, tensors, fname) for v in obj]
    return obj


def list_checkpoints(root):
    """[(step, path)] of the checkpoint directories under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def save_checkpoint(root, *, adapter, optimizer_state, trainer_state, model_fingerprint, step=None, keep_last=None):
    """Writes checkpoint `step-<step>` under `root` atomically and points `latest` at it; with
    keep_last=K only the newest K checkpoints are kept. step defaults to trainer_state["step"].
    Returns the checkpoint's directory."""
    if step is None:
        if "step" not in trainer_state:
            raise ValueError("[save_checkpoint] pass step= or put 'step' in trainer_state")
        step = trainer_state["step"]
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"[save_checkpoint] step must be an integer >= 0, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"[save_checkpoint] keep_last must be None or an integer >= 1, got {keep_last!r}")
    step = int(step)
    stn = _st()
    os.makedirs(root, exist_ok=True)
    name = f"step-{step:08d}"
    final = os.path.join(root, name)
    # Leftovers of an earlier crashed save (single writer per root assumed).
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        if entry.startswith((".tmp-", ".old-")):
            shutil.rmtree(path, ignore_errors=True)
        elif entry.startswith(f".{LATEST}.") and entry.endswith(".tmp"):  # fileio's temp of `latest`
            os.remove(path)

    adapter_np = {}
    for k, v in adapter.items():
        if not isinstance(k, str):
            raise TypeError(f"[save_checkpoint] adapter keys must be strings, got {k!r}")
        adapter_np[k] = np.ascontiguousarray(np.asarray(v))
    opt_tensors = {}
    opt_json = _split_arrays(dict(optimizer_state), opt_tensors)
    files = {
        "adapter.safetensors": stn.save(adapter_np),
        "optimizer.safetensors": stn.save(opt_tensors),
        "optimizer.json": _json_bytes(opt_json, "optimizer_state"),
        "trainer.json": _json_bytes(trainer_state, "trainer_state"),
        "fingerprint.json": _json_bytes(model_fingerprint, "model_fingerprint"),
    }
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
    os.makedirs(tmp)
    old = None
    try:
        manifest = {"format": FORMAT, "step": step, "files": {}}
        for fname, data in files.items():
            _write_bytes(os.path.join(tmp, fname), data)
            manifest["files"][fname] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _write_bytes(os.path.join(tmp, MANIFEST), _json_bytes(manifest, "manifest"))
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving a step (e.g. after resuming): swap directories
            old = os.path.join(root, f".old-{name}-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        atomic_write_bytes(os.path.join(root, LATEST), (name + "\n").encode())
        _fsync_dir(root)
    except BaseException:
        if old is not None and not os.path.exists(final):
            try:
                os.replace(old, final)  # put the checkpoint being replaced back
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last is not None:
        for _, path in list_checkpoints(root)[:-keep_last]:
            if os.path.abspath(path) != os.path.abspath(final):
                shutil.rmtree(path, ignore_errors=True)
    return final


def resolve_checkpoint(path):
    """The checkpoint directory `path` names: itself when it holds a manifest, else the one its
    `latest` file points to (or, when `latest` is missing or names a directory that no longer
    exists, the newest `step-*` directory)."""
    if not os.path.isdir(path):
        raise ValueError(f"[load_checkpoint] {path} is not a directory")
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.exists(latest):
        with open(latest, "r", encoding="utf-8", errors="replace") as f:
            name = f.read().strip()
        if not _NAME.match(name):
            raise ValueError(f"[load_checkpoint] {latest} is corrupt: {name[:60]!r} is not a checkpoint name")
        target = os.path.join(path, name)
        if os.path.isdir(target):
            return target
    found = list_checkpoints(path)
    if not found:
        raise ValueError(f"[load_checkpoint] no checkpoint in {path} (no {MANIFEST}, no {LATEST}, no step-* directory)")
    return found[-1][1]


def _read_checked(ckpt, fname, manifest):
    fpath = os.path.join(ckpt, fname)
    entry = manifest["files"].get(fname)
    if entry is None:
        raise ValueError(f"[load_checkpoint] {os.path.join(ckpt, MANIFEST)} does not list {fname}")
    try:
        with open(fpath, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"[load_checkpoint] cannot read {fpath}: {e.strerror or e}") from None
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(f"[load_checkpoint] {fpath} is corrupt: {len(data)} bytes, checksum does not match "
                         f"the manifest ({entry['bytes']} bytes)")
    return fpath, data


def _parse_json(fpath, data):
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"[load_checkpoint] {fpath} is corrupt: {e}") from None


def _parse_tensors(fpath, data):
    try:
        return dict(_st().load(data))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"[load_checkpoint] {fpath} is corrupt: {e}") from None


def _norm(x):
    return json.loads(json.dumps(x))


def fingerprint_diff(stored, expected, prefix=""):
    """Human-readable differences between two fingerprints (JSON-normalised)."""
    out = []
    if isinstance(stored, dict) and isinstance(expected, dict):
        for k in list(dict.fromkeys(list(stored) + list(expected))):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in expected:
                out.append(f"checkpoint has {key} = {stored[k]!r}, this model has none")
            elif k not in stored:
                out.append(f"checkpoint has no {key}, this model has {expected[k]!r}")
            else:
                out.extend(fingerprint_diff(stored[k], expected[k], key))
    elif stored != expected:
        out.append(f"checkpoint is for {prefix or 'fingerprint'} {stored!r}, this model has {expected!r}")
    return out


def load_checkpoint(path, expected_fingerprint=None):
    """Loads a checkpoint directory, or the one `latest` names in a checkpoint root. Raises
    ValueError naming the file when one is missing or corrupt, and naming what differs when
    expected_fingerprint does not match the checkpoint's."""
    ckpt = resolve_checkpoint(path)
    mpath = os.path.join(ckpt, MANIFEST)
    try:
        with open(mpath, "rb") as f:
            manifest = _parse_json(mpath, f.read())
    except OSError as e:
        raise ValueError(f"[load_checkpoint] cannot read {mpath}: {e.strerror or e}") from None
    if not isinstance(manifest, dict) or "files" not in manifest or manifest.get("format") != FORMAT:
        raise ValueError(f"[load_checkpoint] {mpath} is corrupt or of an unknown format")

    fingerprint = _parse_json(*_read_checked(ckpt, "fingerprint.json", manifest))
    if expected_fingerprint is not None:
        diff = fingerprint_diff(fingerprint, _norm(expected_fingerprint))
        if diff:
            raise ValueError(f"[load_checkpoint] {ckpt} belongs to a different model: " + "; ".join(diff[:5])
                             + (f" (and {len(diff) - 5} more)" if len(diff) > 5 else ""))
    adapter = _parse_tensors(*_read_checked(ckpt, "adapter.safetensors", manifest))
    opt_tensors = _parse_tensors(*_read_checked(ckpt, "optimizer.safetensors", manifest))
    opt_path, opt_data = _read_checked(ckpt, "optimizer.json", manifest)
    optimizer_state = _join_arrays(_parse_json(opt_path, opt_data), opt_tensors, opt_path)
    trainer_state = _parse_json(*_read_checked(ckpt, "trainer.json", manifest))
    return Checkpoint(path=ckpt, step=int(manifest["step"]), adapter=adapter, optimizer_state=optimizer_state,
                      trainer_state=trainer_state, fingerprint=fingerprint)
