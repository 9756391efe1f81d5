"""One benchmark session: the control gate around every workload, each peer checked against krnl
at a small size before it is timed, and krnl and its peers timed in interleaved rounds (drift of
a shared machine then hits all of them alike). The result is one JSON-able dict."""

import importlib
import time

import numpy as np

import krnl
from . import gate
from .workloads import (ALL, PEER_MODULES, PEER_NAMES, INSTALL_HINT, STEPS, gemm_fn, is_gpu, lora_gemms, peer_note,
                        square_gemms)
from . import w1


class PeerError(Exception):
    """A peer that cannot be timed; the message is the reason listed next to it."""


def _why(e):
    """An exception as one short line for a table cell."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


def compare(ref, got, tolerance):
    """None if `got` matches `ref` output by output within `tolerance` of each reference's
    largest magnitude; otherwise the reason, naming the worst output."""
    missing = sorted(set(ref) - set(got))
    if missing:
        return f"missing outputs {missing[:3]}"
    worst, err = None, -1.0
    for k, r in ref.items():
        r, g = np.asarray(r, np.float64), np.asarray(got[k], np.float64)
        if r.shape != g.shape:
            return f"output {k!r} has shape {g.shape}, krnl's {r.shape}"
        if not np.isfinite(g).all():
            return f"output {k!r} is not finite (nan or inf)"
        e = float(np.max(np.abs(g - r))) / max(float(np.max(np.abs(r))), 1e-30) if r.size else 0.0
        if e > err:
            worst, err = k, e
    if err > tolerance:
        return f"output {worst!r} off by {err:.2e} of its largest value (tolerance {tolerance:.0e})"
    return None


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# BLAS and OpenMP worker threads spin for a while after a call returns (OpenBLAS, MKL under
# torch, MLX's pool): without a pause they steal a core from whichever implementation runs next.
SETTLE_S = 0.3


def interleave(fns, rounds, settle_s=SETTLE_S):
    """{name: [seconds per round]}: every round runs each fn once, in order, each after a pause
    that lets the previous one's worker threads go idle."""
    out = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            time.sleep(settle_s)
            out[k].append(_timed(fn))
    return out


class Session:
    def __init__(self, device=None, rounds=5, quick=False, peers=PEER_NAMES, slow_s=10.0,
                 reference_path=None, log=print, peer_overrides=None):
        if rounds < 1:
            raise ValueError(f"[krnl bench] --rounds must be >= 1, got {rounds}")
        self.dev = krnl.device(device)
        self.rounds, self.quick, self.slow_s, self.log = rounds, quick, slow_s, log
        unknown = [p for p in peers if p not in PEER_NAMES]
        if unknown:
            raise ValueError(f"[krnl bench] --peers: unknown {unknown}; known: {', '.join(PEER_NAMES)}")
        self.peers = list(peers)
        self.reference_path = reference_path or gate.reference_path()
        self.peer_overrides = peer_overrides or {}  # {(workload, peer): builder}: tests inject peers here
        self.rows = []

    # ---- rows

    def _row(self, workload, impl, **kw):
        row = {"workload": workload, "impl": impl, "status": "ok", "reason": None, "ms": None,
               "tokens_per_s": None, "gflops": None, "of_sgemm": None, "vs_krnl": None, "samples": 0,
               "note": ""}
        row.update(kw)
        self.rows.append(row)
        return row

    def _figures(self, row, seconds, flops, tokens):
        s = float(np.median(seconds))
        row.update(ms=s * 1e3, gflops=flops / s / 1e9, samples=len(seconds),
                   tokens_per_s=tokens / s if tokens else None,
                   spread=float(max(seconds) / min(seconds)) if len(seconds) > 1 else 1.0)
        if self.sgemm_gflops:
            row["of_sgemm"] = row["gflops"] / self.sgemm_gflops

    # ---- GEMMs

    def _sgemm_rate(self, n):
        fn = gemm_fn(self.dev, n, n, n, False, False)
        fn()
        return 2 * n**3 / float(np.median([_timed(fn) for _ in range(max(self.rounds, 3))])) / 1e9

    def run_gemms(self, which):
        n = self.sgemm_n
        shapes = []
        if "gemm" in which:
            shapes += square_gemms(n)
        if "lora" in which:
            sz = w1.QUICK if self.quick else dict(T=w1.T, C=w1.C, F=w1.F, R=w1.R)
            shapes += lora_gemms(sz["T"], sz["C"], sz["F"], sz["R"])
        if not shapes:
            return
        # Skinny products take well under a millisecond: repeat them so the timer does not dominate.
        fns, flops, reps = {}, {}, {}
        for name, m, nn, k, ta, tb in shapes:
            f = 2.0 * m * nn * k
            reps[name] = int(min(20, max(1, 1e9 // f)))
            fns[name] = gemm_fn(self.dev, m, nn, k, ta, tb, reps[name])
            flops[name] = f
            fns[name]()
        times = interleave(fns, self.rounds)
        for name in fns:
            row = self._row(name, "krnl")
            self._figures(row, [t / reps[name] for t in times[name]], flops[name], None)

    # ---- training steps

    def _peer_builder(self, wl, name):
        if (wl.name, name) in self.peer_overrides:
            return self.peer_overrides[(wl.name, name)]
        mod = PEER_MODULES[name]
        try:
            importlib.import_module(mod)
        except ImportError as e:
            hint = INSTALL_HINT.get(mod)
            raise PeerError(f"not installed ({e}){'; ' + hint if hint else ''}") from None
        except Exception as e:  # installed but broken (a missing shared library, say)
            raise PeerError(f"cannot import {mod}: {type(e).__name__}: {e}") from None
        return wl.peers[name]

    def _check_peer(self, wl, name, small_ref, small):
        """Builds the peer and checks it against krnl at the small size; PeerError with the reason."""
        builder = self._peer_builder(wl, name)
        try:
            got = builder(small)[1]()
        except Exception as e:  # a peer that breaks is listed with what broke, not dropped
            raise PeerError(f"failed at the check size: {_why(e)}") from None
        bad = compare(small_ref, got, wl.tolerance)
        if bad:
            raise PeerError(f"failed its check against krnl at the small size: {bad}")
        return builder

    def run_step(self, wl):
        size = wl.sizes["quick" if self.quick else "full"]
        title = f"{wl.title} ({wl.describe(size)})"
        if wl.gpu_only and not is_gpu(self.dev.name):
            self._row(wl.name, "all", status="skipped", reason=wl.gpu_only, title=title)
            return
        small = wl.make(wl.sizes["small"], self.dev.name)
        small_ref = wl.krnl(small)[1]()
        builders = {}
        for name in PEER_NAMES:
            try:
                if name not in self.peers:
                    raise PeerError("not selected (--peers)")
                if wl.gpu_only and not self.quick:
                    raise PeerError(f"peers run on the host CPU; {wl.name.upper()} is {wl.gpu_only}")
                builders[name] = self._check_peer(wl, name, small_ref, small)
            except PeerError as e:
                builders[name] = str(e)
        problem = wl.make(size, self.dev.name)
        tokens, flops = wl.tokens(problem), wl.flops(problem)
        steps = {"krnl": wl.krnl(problem)[0]}
        absent, single = {}, {}
        for name, b in builders.items():
            if isinstance(b, str):
                absent[name] = b
                continue
            try:
                step = b(problem)[0]
                step()  # warm-up (and compilation): never timed
                t = _timed(step)
            except Exception as e:
                absent[name] = f"failed at the full size: {_why(e)}"
                continue
            if t > self.slow_s:
                # A step this slow would take the session hostage over several rounds: this one
                # warm run is its sample.
                single[name] = [t]
            else:
                steps[name] = step
        steps["krnl"]()
        self.log(f"  {wl.name}: timing {', '.join(steps)} in {self.rounds} interleaved rounds"
                 + (f"; {', '.join(single)} once (a step over {self.slow_s:g} s)" if single else ""))
        times = interleave(steps, self.rounds)
        times.update(single)
        k_ms = float(np.median(times["krnl"]))
        for name in ("krnl",) + PEER_NAMES:
            if name in absent:
                self._row(wl.name, name, status="absent", reason=absent[name], title=title)
                continue
            row = self._row(wl.name, name, title=title, note=peer_note(name) if name != "krnl" else "")
            if name in single:
                row["note"] = "; ".join(x for x in (row["note"], f"1 sample (step > {self.slow_s:g} s)") if x)
            self._figures(row, times[name], flops, tokens)
            row["vs_krnl"] = k_ms / float(np.median(times[name]))
        return problem

    # ---- the whole session

    def run(self, workloads=ALL, profile=False):
        unknown = [w for w in workloads if w not in ALL]
        if unknown:
            raise ValueError(f"[krnl bench] --workloads: unknown {unknown}; known: {', '.join(ALL)}")
        dev = self.dev
        n_ctl = gate.control_size(dev.name, self.quick)
        fp = gate.fingerprint(dev.name)
        ref = gate.lookup_reference(self.reference_path, fp, n_ctl)  # a corrupt file fails here, before the work
        t0 = time.time()
        self.log(f"krnl bench: control {n_ctl}^3 sgemm (before)")
        before = gate.measure_control(dev, n_ctl)
        self.sgemm_n = 256 if self.quick else 2048
        self.sgemm_gflops = None
        self.run_gemms(workloads)
        # The 'of sgemm' base: the nn square row when it ran, else its own measurement.
        nn = [r for r in self.rows if r["workload"] == f"gemm nn {self.sgemm_n}^3"]
        self.sgemm_gflops = nn[0]["gflops"] if nn else self._sgemm_rate(self.sgemm_n)
        for r in self.rows:
            r["of_sgemm"] = r["gflops"] / self.sgemm_gflops
        prof, between = None, []
        for name in ("w1", "w2", "w3"):
            if name in workloads:
                if self.rows:
                    between.append((f"before {name}", gate.measure_control(dev, n_ctl)))
                self.log(f"krnl bench: {name}")
                problem = self.run_step(STEPS[name])
                if name == "w2" and profile and problem is not None:
                    prof = self._profile(problem)
        if profile and prof is None:
            prof = self._profile(STEPS["w2"].make(STEPS["w2"].sizes["quick" if self.quick else "full"], dev.name))
        self.log(f"krnl bench: control {n_ctl}^3 sgemm (after)")
        after = gate.measure_control(dev, n_ctl)
        verdict = gate.verdict(before, after, ref["gflops"] if ref else None, n_ctl, between=between)
        return {
            "krnl_version": krnl.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
            "seconds": round(time.time() - t0, 1),
            "machine": fp, "device": dev.name, "threads": krnl.num_threads(),
            "rounds": self.rounds, "quick": self.quick, "workloads": list(workloads),
            "sgemm": {"n": self.sgemm_n, "gflops": self.sgemm_gflops},
            "trusted": verdict["trusted"], "untrusted_reasons": verdict["reasons"], "gate": verdict,
            "reference_file": str(self.reference_path),
            "rows": self.rows, "profile": prof,
        }

    def _profile(self, case):
        """The per-op profile of one W2 step (after a warm-up step)."""
        case.krnl_step()
        with krnl.profile(self.dev) as p:
            case.krnl_step()
        step_s = p.op_ms / 1e3
        rows = sorted(p.rows(), key=lambda g: -g["ms"])
        return {"wall_ms": p.wall_ms, "op_ms": p.op_ms, "step_gflops": case.flops / step_s / 1e9 if step_s else None,
                "rows": [{"op": g["op"], "shape": g["shape"], "dtype": g["dtype"], "calls": g["calls"], "ms": g["ms"],
                          "share": g["share"], "gflops": g["gflops"]} for g in rows]}
