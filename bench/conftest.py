"""Side-by-side benchmarks: every figure in a run is compared only with figures of the same run."""

import pytest

RESULTS = {}


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
