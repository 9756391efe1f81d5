"""Side-by-side benchmarks: every figure in a run is compared only with figures of the same run."""

import pytest

from krnl.bench.session import compare
from krnl.bench.targets import TOLERANCE
from krnl.bench.workloads import PEER_MODULES

RESULTS = {}


@pytest.fixture
def time_peer():
    """time_peer(benchmark, workload, problem, peer, group): a peer of krnl.bench, checked against
    krnl at the small size, then timed on `problem` (MLX's Linux CPU wheel bundles a slow
    reference BLAS: one round)."""
    def run(benchmark, wl, problem, peer, group):
        pytest.importorskip(PEER_MODULES[peer], reason=f"{peer} (an optional bench peer) is not installed")
        small = wl.make(wl.sizes["small"], problem.device, problem.dtype)
        bad = compare(wl.krnl(small)[1](), wl.peers[peer](small)[1](), TOLERANCE[problem.dtype])
        assert bad is None, f"{peer}: {bad}"
        step = wl.peers[peer](problem)[0]
        step()  # compiles where the peer compiles
        benchmark.group = group
        benchmark.extra_info["gflop"] = wl.flops(problem) / 1e9
        benchmark.pedantic(step, rounds=1 if peer.startswith("m") else 3, warmup_rounds=0)
    return run


@pytest.fixture(scope="session")
def results():
    return RESULTS


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("krnl ratios (same run, same machine)")
    for line in RESULTS.get("_lines", []):
        tr.write_line(line)
