"""File I/O every writer and reader of the package shares: atomic replacement (temporary file in
the same folder, fsync, rename: a reader sees the old file or the new one, never a part) and
JSON objects read with errors that name the file and line."""

import contextlib
import json
import os
import tempfile
import threading
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def current_umask():
    """The process umask. Read from /proc/self/status where there is one (no side effect); else by
    setting and restoring it under a lock (os.umask is process-wide: for that instant another
    thread's new file would get the temporary, strict 077)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def atomic_write_bytes(path, data, mode=None):
    """Replaces `path` with `data`."""
    atomic_write_chunks(path, (data,), mode)


def atomic_write_chunks(path, chunks, mode=None):
    """atomic_write_bytes for an iterable of byte strings (large files are streamed). `mode`: the
    file's permission bits; by default those of any new file (0666 less the umask)."""
    with atomic_path(path, mode) as tmp:
        with open(tmp, "wb") as f:
            for data in chunks:
                f.write(data)


@contextlib.contextmanager
def atomic_path(path, mode=None):
    """A temporary file's path in `path`'s folder for a writer that opens files itself (GGUF's):
    once the block ends it gets `mode` (by default 0666 less the umask), is synced to disk and
    replaces `path`; on any error it is removed and `path` left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~current_umask() if mode is None else mode)  # mkstemp creates 0600
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:
            e.filename = str(path)  # a failed write (disk full) names the file it was for
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
