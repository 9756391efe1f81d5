"""File I/O every writer and reader of the package shares: atomic replacement (temporary file in
the same folder, fsync, rename: a reader sees the old file or the new one, never a part) and
JSON objects read with errors that name the file and line."""

import json
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path, data):
    """Replaces `path` with `data`."""
    atomic_write_chunks(path, (data,))


def atomic_write_chunks(path, chunks):
    """atomic_write_bytes for an iterable of byte strings (large files are streamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for data in chunks:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json_object(path, who):
    """The JSON object in `path`; ValueError("[who] ...") naming the file (and line) otherwise."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"[{who}] cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"[{who}] {path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(d, dict):
        raise ValueError(f"[{who}] {path}: expected a JSON object")
    return d
