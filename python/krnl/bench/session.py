"""One benchmark session: the control gate around every workload, each peer checked against krnl
at a small size before it is timed, and krnl and its peers timed in interleaved rounds (drift of
a shared machine then hits all of them alike). The result is one JSON-able dict."""

import functools
import gc
import importlib
import sys
import time

import numpy as np

import krnl
from . import gate, gpu_power, w1, w2
from .targets import TOLERANCE, Unavailable, compute_dtype, has_graphs, is_gpu, kind
from .train_peers import one_line
from .workloads import (ALL, KNOWN, PEER_MODULES, PEER_NAMES, INSTALL_HINT, STEP_PEERS, STEPS, copy_rate, gemm_bytes,
                        gemm_fn, lora_gemms, peer_note, square_gemms)


class PeerError(Exception):
    """A peer that cannot be timed; the message is the reason listed next to it."""


def worst_error(ref, got):
    """(output, error) of the output of `got` furthest from `ref`, the error relative to that
    reference's largest magnitude; or (None, reason) when they cannot be compared."""
    missing = sorted(set(ref) - set(got))
    if missing:
        return None, f"missing outputs {missing[:3]}"
    worst, err = None, -1.0
    for k, r in ref.items():
        r, g = np.asarray(r, np.float64), np.asarray(got[k], np.float64)
        if r.shape != g.shape:
            return None, f"output {k!r} has shape {g.shape}, krnl's {r.shape}"
        if not np.isfinite(g).all():
            return None, f"output {k!r} is not finite (nan or inf)"
        e = float(np.max(np.abs(g - r))) / max(float(np.max(np.abs(r))), 1e-30) if r.size else 0.0
        if e > err:
            worst, err = k, e
    return worst, err


def compare(ref, got, tolerance):
    """None if `got` matches `ref` output by output within `tolerance` of each reference's
    largest magnitude; otherwise the reason, naming the worst output."""
    worst, err = worst_error(ref, got)
    if worst is None:
        return err
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


# A sample is at least this long: a GPU step of a fraction of a millisecond is repeated so that
# the timer and the pause before it do not dominate.
MIN_SAMPLE_S = 0.05


def sample_reps(once_s, most=50):
    """How many repetitions make a sample of about MIN_SAMPLE_S (1 to `most`)."""
    return int(max(1, min(most, MIN_SAMPLE_S // max(once_s, 1e-6))))


def repeated(step, once_s):
    """(fn, n): `step` n times per call, n = sample_reps(once_s)."""
    n = sample_reps(once_s)
    if n == 1:
        return step, 1

    def fn():
        for _ in range(n):
            step()

    return fn, n


def interleave(fns, rounds, settle_s=SETTLE_S):
    """{name: [(start, end) of each round's run]} in time.perf_counter() stamps: every round runs
    each fn once, in order, each after a pause that lets the previous one's worker threads go idle."""
    out = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            time.sleep(settle_s)
            t0 = time.perf_counter()
            fn()
            out[k].append((t0, time.perf_counter()))
    return out


class Session:
    def __init__(self, device=None, rounds=5, quick=False, peers=PEER_NAMES, slow_s=10.0,
                 reference_path=None, log=print, peer_overrides=None, dtype=None, train=None):
        if rounds < 1:
            raise ValueError(f"[krnl bench] --rounds must be >= 1, got {rounds}")
        if dtype is not None and dtype not in TOLERANCE:
            raise ValueError(f"[krnl bench] --dtype: unknown {dtype!r}; choose from {', '.join(TOLERANCE)}")
        self.dev = krnl.device(device)
        self.dtype = dtype or compute_dtype(self.dev)
        # No pause between a GPU's samples: nothing spins on the host, and an idle GPU lowers its
        # clocks, which would slow the first step of every sample.
        self.settle_s = 0.0 if is_gpu(self.dev) else SETTLE_S
        self.rounds, self.quick, self.slow_s, self.log = rounds, quick, slow_s, log
        unknown = [p for p in peers if p not in PEER_NAMES]
        if unknown:
            raise ValueError(f"[krnl bench] --peers: unknown {unknown}; known: {', '.join(PEER_NAMES)}")
        self.peers = list(peers)
        self.reference_path = reference_path or gate.reference_path()
        self.peer_overrides = peer_overrides or {}  # {(workload, peer): builder}: tests inject peers here
        self.rows = []
        self.train_opts = dict(train or {})  # the --train-* options (bench/train.py)

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
        fn = gemm_fn(self.dev, n, n, n, False, False, dtype=self.dtype)
        fn()
        return 2 * n**3 / float(np.median([_timed(fn) for _ in range(max(self.rounds, 3))])) / 1e9

    def run_gemms(self, which):
        shapes = []
        if "gemm" in which:
            for n in sorted({256 if self.quick else 2048, self.sgemm_n}):
                shapes += square_gemms(n)
        if "lora" in which:
            # the LoRA products of the device's reference workload: W1's on the CPU, W3's on a GPU
            if self.quick:
                sz = w1.QUICK
            elif is_gpu(self.dev):
                sz = dict(T=w2.W3["T"], C=w2.W3["C"], F=w2.W3["F"], R=w2.W3["r"])
            else:
                sz = dict(T=w1.T, C=w1.C, F=w1.F, R=w1.R)
            shapes += lora_gemms(sz["T"], sz["C"], sz["F"], sz["R"])
            self.copy_bps = copy_rate(self.dev, self.dtype, 1 << (22 if self.quick else 30))
        if not shapes:
            return
        # Skinny products take microseconds on a GPU, well under a millisecond on the CPU: each
        # sample repeats a product so that it lasts about MIN_SAMPLE_S and the timer, the launch of
        # the first and the final synchronize do not dominate.
        fns, flops, reps, nbytes = {}, {}, {}, {}
        for name, m, nn, k, ta, tb, beta, out_f32 in shapes:
            run = gemm_fn(self.dev, m, nn, k, ta, tb, beta, out_f32, self.dtype)
            run()
            # queued back to back, one synchronize: a GPU's launch and sync latency amortised
            reps[name] = sample_reps(_timed(run), most=500)
            fns[name] = functools.partial(run, reps[name])
            flops[name] = 2.0 * m * nn * k
            nbytes[name] = gemm_bytes(m, nn, k, beta, out_f32, self.dtype) if name.startswith("lora") else None
        times = {k: [b - a for a, b in v] for k, v in interleave(fns, self.rounds, self.settle_s).items()}
        for name in fns:
            row = self._row(name, "krnl", dtype=self.dtype)
            self._figures(row, [t / reps[name] for t in times[name]], flops[name], None)
            if nbytes[name]:
                # the time the bytes take at the copy rate, over the time taken: 1 = at the bound
                row["bytes"] = nbytes[name]
                row["of_bound"] = nbytes[name] / self.copy_bps / (row["ms"] / 1e3)
                row["note"] = (f"{row['of_bound']:.2f} of its bandwidth bound: {nbytes[name] / 1e6:.1f} MB at the "
                               f"measured copy rate {self.copy_bps / 1e9:.0f} GB/s")

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

    def _check(self, builder, small_ref, small):
        """Runs `builder` at the small size against krnl's outputs: its error, or PeerError with the
        reason. Unavailable (no such device or dtype for this peer) passes through."""
        try:
            got = builder(small)[1]()
        except Unavailable:
            raise
        except Exception as e:  # a peer that breaks is listed with what broke, not dropped
            raise PeerError(f"failed at the check size: {one_line(e)}") from None
        bad = compare(small_ref, got, TOLERANCE[self.dtype])
        if bad:
            raise PeerError(f"failed its check against krnl at the small size: {bad}")
        return worst_error(small_ref, got)[1]

    def run_step(self, wl):
        size = wl.sizes["quick" if self.quick else "full"]
        title = f"{wl.title} ({wl.describe(size)}; {self.dtype})"
        if wl.gpu_only and not is_gpu(self.dev):
            self._row(wl.name, "all", status="skipped", reason=wl.gpu_only, title=title)
            return
        small = wl.make(wl.sizes["small"], self.dev.name, self.dtype)
        small_ref = wl.krnl(small)[1]()
        impls = (("krnl graph",) if has_graphs(self.dev) else ()) + STEP_PEERS
        builders, errs = {}, {}
        for name in impls:
            try:
                if name == "krnl graph":
                    builder = wl.krnl_graph
                elif name not in self.peers:
                    raise PeerError("not selected (--peers)")
                else:
                    builder = self._peer_builder(wl, name)
                errs[name] = self._check(builder, small_ref, small)
                builders[name] = builder
            except (PeerError, Unavailable) as e:
                builders[name] = str(e)
        del small
        problem = wl.make(size, self.dev.name, self.dtype)
        tokens, flops = wl.tokens(problem), wl.flops(problem)
        k_step = wl.krnl(problem)[0]
        k_step()  # warm-up
        fn, n = repeated(k_step, min(_timed(k_step), _timed(k_step)))
        steps, per = {"krnl": fn}, {"krnl": n}
        absent, single, made = {}, {}, []
        for name, b in builders.items():
            if isinstance(b, str):
                absent[name] = b
                continue
            try:
                step = b(problem)[0]
                made.append(step)
                step()  # warm-up (and compilation): never timed
                t = _timed(step)
                if t <= self.slow_s:  # twice: torch's CUDA graphs are recorded on the second call
                    t = min(t, _timed(step))
            except Exception as e:
                absent[name] = f"failed at the full size: {one_line(e)}"
                continue
            if t > self.slow_s:
                # A step this slow would take the session hostage over several rounds: this one
                # warm run is its sample.
                single[name] = [t]
            else:
                steps[name], per[name] = repeated(step, t)
        self.log(f"  {wl.name}: timing {', '.join(steps)} in {self.rounds} interleaved rounds"
                 + (f"; {', '.join(single)} once (a step over {self.slow_s:g} s)" if single else ""))
        with gpu_power.metered(self.dev) as (meter, _):  # None off an NVIDIA GPU
            spans = interleave(steps, self.rounds, self.settle_s)
        times = {k: [(b - a) / per[k] for a, b in v] for k, v in spans.items()}
        times.update(single)
        k_ms = float(np.median(times["krnl"]))
        for name in ("krnl",) + impls:
            if name in absent:
                self._row(wl.name, name, status="absent", reason=absent[name], title=title, dtype=self.dtype)
                continue
            row = self._row(wl.name, name, title=title, note=peer_note(name, self.dev), dtype=self.dtype,
                            check_err=errs.get(name))
            gpu = meter.window(spans[name]) if meter is not None and name in spans else None  # its clock
            notes = (row["note"], f"1 sample (step > {self.slow_s:g} s)" if name in single else "",
                     f"{per[name]} steps a sample" if per.get(name, 1) > 1 else "", gpu_power.describe(gpu))
            row.update(note="; ".join(x for x in notes if x), gpu=gpu)
            self._figures(row, times[name], flops, tokens)
            row["vs_krnl"] = k_ms / float(np.median(times[name]))
        self._free(made)
        return problem

    def _free(self, steps):
        """Gives back what the timed implementations hold on the device before the next workload:
        krnl's captured graphs, PyTorch's cached blocks."""
        for step in steps:
            release = getattr(step, "release", None)
            if release:
                release()
        steps.clear()
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and is_gpu(self.dev) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.dev.synchronize()

    # ---- the whole session

    def run(self, workloads=ALL, profile=False):
        unknown = [w for w in workloads if w not in KNOWN]
        if unknown:
            raise ValueError(f"[krnl bench] --workloads: unknown {unknown}; known: {', '.join(KNOWN)}")
        dev = self.dev
        n_ctl = gate.control_size(dev, self.quick)
        fp = gate.fingerprint(dev.name)
        ref = gate.lookup_reference(self.reference_path, fp, n_ctl)  # a corrupt file fails here, before the work
        t0 = time.time()
        self.log(f"krnl bench: control {n_ctl}^3 sgemm (before)")
        before = gate.measure_control(dev, n_ctl)
        # The matmul rate every row is a fraction of: 2048^3 on the CPU, 8192^3 on a GPU (2048^3
        # takes tens of microseconds there, far from the device's rate).
        self.sgemm_n = 256 if self.quick else (8192 if is_gpu(dev) else 2048)
        self.sgemm_gflops = None
        self.run_gemms(workloads)
        # The 'of sgemm' base: the nn square row when it ran, else its own measurement.
        nn = [r for r in self.rows if r["workload"] == f"gemm nn {self.sgemm_n}^3"]
        self.sgemm_gflops = nn[0]["gflops"] if nn else self._sgemm_rate(self.sgemm_n)
        for r in self.rows:
            r["of_sgemm"] = r["gflops"] / self.sgemm_gflops
        # the profiled step: the device's reference workload (W3 on a GPU, W2 elsewhere)
        prof_wl = "w3" if is_gpu(dev) else "w2"
        prof, between = None, []
        for name in ("w1", "w2", "w3"):
            if name in workloads:
                if self.rows:
                    between.append((f"before {name}", gate.measure_control(dev, n_ctl)))
                self.log(f"krnl bench: {name}")
                problem = self.run_step(STEPS[name])
                if name == prof_wl and profile and problem is not None:
                    prof = self._profile(problem, name)
                del problem
        for name in ("qlora", "moe", "dpo", "grpo", "serve", "full"):
            if name in workloads:
                if self.rows:
                    between.append((f"before {name}", gate.measure_control(dev, n_ctl)))
                self.run_model(name, profile)
        from . import train_dist, train_long  # train: one process, or with --gpus N, 1 and N ranks
        for name, mod in (("train", train_dist), ("long", train_long)):
            if name in workloads:
                if self.rows:
                    between.append((f"before {name}", gate.measure_control(dev, n_ctl)))
                for r in mod.session_rows(self, self.train_opts, profile=profile and prof is None):
                    prof = r.pop("profile", None) or prof  # a training step's, when no W step was profiled
                    self._row(r.pop("workload", name), r.pop("impl"), **r)
        if profile and prof is None:
            wl = STEPS[prof_wl]
            prof = self._profile(wl.make(wl.sizes["quick" if self.quick else "full"], dev.name, self.dtype), prof_wl)
        self.log(f"krnl bench: control {n_ctl}^3 sgemm (after)")
        after = gate.measure_control(dev, n_ctl)
        verdict = gate.verdict(before, after, ref["gflops"] if ref else None, n_ctl, between=between)
        return {
            "krnl_version": krnl.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
            "seconds": round(time.time() - t0, 1),
            "machine": fp, "device": dev.name, "kind": kind(dev), "dtype": self.dtype, "threads": krnl.num_threads(),
            "rounds": self.rounds, "quick": self.quick, "workloads": list(workloads),
            "sgemm": {"n": self.sgemm_n, "gflops": self.sgemm_gflops},
            "trusted": verdict["trusted"], "untrusted_reasons": verdict["reasons"], "gate": verdict,
            "reference_file": str(self.reference_path),
            "rows": self.rows, "profile": prof,
        }

    def run_model(self, name, profile=False):
        """A whole-model workload: qlora, moe, dpo, grpo, serve or full (the module of its name)."""
        mod = importlib.import_module(f".{name}", __package__)
        if not self.quick and not is_gpu(self.dev):
            self._row(name, "krnl", status="skipped", reason=mod.SKIP)
            return
        self.log(f"krnl bench: {name}")
        # qlora takes the peers by name (PEFT, Liger, Unsloth); the others whether torch's run
        peers = self.peers if name == "qlora" else "torch" in self.peers
        for r in mod.run(self.dev, self.dtype, quick=self.quick, peers=peers, log=self.log, profile=profile):
            peak, loss, vs = r.pop("peak_bytes", None), r.pop("loss", None), r.pop("peak_vs_krnl", None)
            gpu = is_gpu(self.dev)
            peak = peak if gpu else None  # the CPU's pool holds only part of a CPU run's memory
            resident, host = (r.get("resident_bytes"), r.get("host_bytes")) if gpu else (None, None)
            note = ", ".join(x for x in (f"peak {peak / 2**30:.2f} GiB" if peak else "",
                                         f"x{vs:.2f} krnl's peak" if vs else "",
                                         f"{resident / 2**30:.2f} GiB before the steps" if resident else "",
                                         f"host +{host / 2**30:.2f} GiB in the steps" if host is not None else "",
                                         f"loss {loss:.3f}" if loss is not None else "", r.pop("note", "")) if x)
            self._row(name, r.pop("impl"), note=note, peak_bytes=peak, loss=loss, **r)

    def _profile(self, case, name):
        """The per-op profile of one step of workload `name` (after a warm-up step)."""
        case.krnl_step()
        with krnl.profile(self.dev) as p:
            case.krnl_step()
        step_s = p.op_ms / 1e3
        rows = sorted(p.rows(), key=lambda g: -g["ms"])
        return {"workload": name, "wall_ms": p.wall_ms, "op_ms": p.op_ms, "step_gflops": case.flops / step_s / 1e9 if step_s else None,
                "rows": [{"op": g["op"], "shape": g["shape"], "dtype": g["dtype"], "calls": g["calls"], "ms": g["ms"],
                          "share": g["share"], "gflops": g["gflops"]} for g in rows]}
