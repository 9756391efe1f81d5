"""Per-op profile of a region: one record per op, grouped by op and shape into a table."""

import time
from collections import OrderedDict

from . import _core


class Profile:
    """Records every op run on `device` inside `with krnl.profile(dev) as prof:`."""

    def __init__(self, device):
        self.device = device
        self.records = []
        self.wall_ms = 0.0

    def __enter__(self):
        if self.device.in_step:
            raise RuntimeError("[profile] start profiling outside a step")
        _core.clear_profile(self.device)
        _core.set_profiling(self.device, True)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.device.synchronize()
        self.wall_ms = (time.perf_counter() - self._t0) * 1e3
        _core.set_profiling(self.device, False)
        self.records = list(_core.profile_records(self.device))
        _core.clear_profile(self.device)
        return False

    @property
    def op_ms(self):
        """Sum of the per-op times."""
        return sum(r["ms"] for r in self.records)

    def rows(self):
        """One dict per (op, shape, dtype): calls, total ms, share of the op time, GFLOP/s, GB/s."""
        groups = OrderedDict()
        for r in self.records:
            key = (r["op"], r["shape"], r["dtype"])
            g = groups.setdefault(key, {"op": r["op"], "shape": r["shape"], "dtype": r["dtype"],
                                        "calls": 0, "ms": 0.0, "flops": 0.0, "bytes": 0.0})
            g["calls"] += 1
            g["ms"] += r["ms"]
            g["flops"] += r["flops"]
            g["bytes"] += r["bytes"]
        total = self.op_ms or 1.0
        out = []
        for g in groups.values():
            sec = g["ms"] / 1e3
            g["share"] = g["ms"] / total
            g["gflops"] = g["flops"] / sec / 1e9 if sec > 0 and g["flops"] else 0.0
            g["gbps"] = g["bytes"] / sec / 1e9 if sec > 0 else 0.0
            out.append(g)
        return out

    def table(self):
        """The report as text, slowest first."""
        rows = sorted(self.rows(), key=lambda g: -g["ms"])
        lines = [f"{'op':24s} {'shape':34s} {'dtype':5s} {'calls':>5s} {'ms':>9s} {'share':>6s} {'GFLOP/s':>9s} {'GB/s':>7s}"]
        for g in rows:
            lines.append(f"{g['op']:24s} {g['shape'][:34]:34s} {g['dtype']:5s} {g['calls']:5d} {g['ms']:9.3f} "
                         f"{100 * g['share']:5.1f}% {g['gflops']:9.1f} {g['gbps']:7.1f}")
        lines.append(f"sum of ops {self.op_ms:.3f} ms; region wall time {self.wall_ms:.3f} ms on {self.device.name}")
        return "\n".join(lines)


def profile(device):
    """`with krnl.profile(dev) as prof: ...` then `print(prof.table())`."""
    return Profile(device)
