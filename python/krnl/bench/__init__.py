"""Benchmarks users can trust (docs/performance.md): the workloads W1, W2, W3 and the GEMM rows, krnl
next to its peers (numpy, PyTorch eager and compiled, MLX eager and compiled) in one session,
each peer checked against krnl before it is timed, the session behind a control gate.

Used by `krnl bench` / `python -m krnl.bench` and by the pytest-benchmark files in bench/."""

from .cli import main
from .session import Session, compare

__all__ = ["main", "Session", "compare"]
