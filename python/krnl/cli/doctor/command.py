"""`krnl doctor`: a self-test whose report tells us what happened on a user's machine (the first Mac
users run the Metal backend before we do). It records the device, its family and limits, the OS and
how the extension was built; compiles every Metal library, timed; checks every op of the contract
against the CPU (doctor_ops.py); trains the embedded default on the device and on the CPU, losses
compared step by step, and times W1 and a QLoRA step (doctor_runs.py); then writes one JSON and one
Markdown report (doctor_report.py) and exits non-zero naming every mismatch or failure."""

import platform
import sys
import time
import traceback

import krnl

from . import ops as doctor_ops, report as doctor_report, runs as doctor_runs
from ..device import _describe

SECTIONS = ("compile", "ops", "training", "timing")


def system_info():
    """The OS, the machine and the Python side's versions."""
    import numpy as np

    info = {"platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "krnl": krnl.__version__, "threads": krnl.num_threads(),
            "cpu_backend": dict(krnl.device("cpu").capabilities()["details"])}  # the BLAS's own version
    mac = platform.mac_ver()[0]
    if mac:
        info["macos"] = mac
    for name in ("mlx", "mlx_lm"):
        try:
            from importlib.metadata import version

            info[name.replace("_", "-")] = version(name.replace("_", "-"))
        except Exception:  # noqa: BLE001 (not installed: nothing to record)
            pass
    return info


def build_info():
    """How the extension was built (krnl._core.build_info()), the macOS numbers also as X.Y."""
    b = dict(krnl._core.build_info())
    for key in ("macos_sdk", "macos_deployment_target"):
        v = b.get(key)
        if v:  # MMmmpp: 140000 -> 14.0, 130300 -> 13.3
            b[key + "_version"] = f"{v // 10000}.{v // 100 % 100}" + (f".{v % 100}" if v % 100 else "")
    return b


def device_info(dev):
    """The device's capabilities; for a Metal device also its GPU's description and limits (family,
    working set, the command-buffer budget) and the MSL version each library is compiled with."""
    caps = dev.capabilities()
    info = {"name": dev.name, "summary": _describe(caps), "capabilities": caps,
            "unavailable": krnl.unavailable_devices()}
    if caps["kind"].startswith("metal"):
        info["gpu"] = dict(krnl._core.metal_gpu(dev))
        info["msl_versions"] = {n: f"{v // 100}.{v % 100}" for n in krnl._core.metal_libraries()
                                for v in (krnl._core.metal_library_msl_version(n),)}
    return info


def compile_libraries(dev):
    """Every Metal library compiled and timed: {"method", "libraries": {name: ms}, "total_ms"}, or
    "skipped" with why where the device compiles none."""
    kind = dev.capabilities()["kind"]
    if not kind.startswith("metal"):
        return {"status": "skipped", "reason": f"{dev.name} runs no Metal libraries"}
    if hasattr(dev, "compile_libraries"):
        try:
            ms = dict(dev.compile_libraries())
            return {"status": "ok", "method": "Device.compile_libraries() (the Metal compiler, from source)",
                    "libraries": {k: float(v) for k, v in ms.items()}, "total_ms": float(sum(ms.values()))}
        except NotImplementedError:
            pass  # metal-sim and metal-cuda: their compiler is the simulator's, below
    if kind == "metal-sim":
        return _compile_mslsim()
    return {"status": "skipped", "reason": f"krnl cannot compile {dev.name}'s libraries on their own here (no "
                                           "Device.compile_libraries); the op checks compile them as they run"}


def _compile_mslsim():
    """metal-sim's compiling: tools/mslsim's build of each metal/*.metal (preprocessing, the MSL to
    C++ transform, g++ unless its disk cache holds the result), as the registered executor does."""
    from pathlib import Path

    sim = sys.modules.get("mslsim.metal_sim")  # loaded by whatever registered metal-sim
    if sim is None:
        return {"status": "skipped", "reason": "metal-sim was not registered through tools/mslsim"}
    root = Path(sim.__file__).resolve().parents[3]
    cache = sim.LibraryCache(root, sim.build)
    out = {}
    for name, constants in cache.variants():
        key = name + "".join(f"[{i}={v}]" for i, v in constants)
        t0 = time.perf_counter()
        cache.library(name, tuple(constants))
        out[key] = 1e3 * (time.perf_counter() - t0)
    return {"status": "ok", "method": "tools/mslsim builds of metal/*.metal (g++; cached on disk by content)",
            "libraries": out, "total_ms": sum(out.values())}


def _section(report, name, fn, log):
    """Runs one section into report[name]; an exception becomes a named failure, and the other
    sections still run (a report with a traceback beats none)."""
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001
        report[name] = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        report["failures"].append(f"{name}: {type(e).__name__}: {e}")
        log(f"  {name}: ERROR {type(e).__name__}: {e}")
    report[name]["seconds"] = time.perf_counter() - t0


def run(dev, quick=False, sections=SECTIONS, dtype=None, log=print):
    """The doctor's report (a dict) for `dev`; report["failures"] names every failure."""
    report = {"krnl": krnl.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "quick": quick, "sections": list(sections), "system": system_info(), "build": build_info(),
              "device": device_info(dev), "failures": []}
    dtype = dtype or report["device"]["capabilities"]["compute_dtype"]
    log(f"krnl doctor {krnl.__version__} on {dev.name}: {report['device']['summary']}")
    gpu = report["device"].get("gpu")
    if gpu:
        ws = f"{gpu['working_set'] / 2**30:.1f} GiB" if gpu["working_set"] else "unknown"
        log(f"gpu: {gpu['name']}, apple family {gpu['apple_family'] or 'below 7'}, working set {ws}, "
            f"unified memory {'yes' if gpu['unified_memory'] else 'no'}")
    for name, why in report["device"]["unavailable"].items():
        log(f"{name}: unavailable here: {why}")
    b = report["build"]
    log(f"system: {report['system']['platform']}; built with {b['compiler']}"
        + (f", macOS SDK {b['macos_sdk_version']}, target {b['macos_deployment_target_version']}"
           if b.get("macos_sdk") else "") + f", BLAS {b['blas']}")
    if "compile" in sections:
        log("compiling the Metal libraries")
        _section(report, "compile", lambda: compile_libraries(dev), log)
    if "ops" in sections:
        log("checking every op against the CPU")
        _section(report, "ops", lambda: _ops(dev, quick, report["failures"], log), log)
    if "training" in sections:
        log(f"training the embedded default on {dev.name} and on the CPU")
        _section(report, "training", lambda: _training(dev, quick, report["failures"], log), log)
    if "timing" in sections:
        log(f"timing W1 and a QLoRA step in {dtype}")
        _section(report, "timing", lambda: {"w1": doctor_runs.time_w1(dev, dtype, quick),
                                            "qlora": doctor_runs.time_qlora(dev, dtype, quick)}, log)
    report["ok"] = not report["failures"]
    return report


def _ops(dev, quick, failures, log):
    res = doctor_ops.check_ops(dev, quick=quick, log=log)
    counts = {}
    for r in res["checks"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        if r["status"] in ("mismatch", "error"):
            failures.append(f"op {r['op']} [{r['case']}] {r['dtype']} n={r['n']}: {r['status']}: {r['detail']}")
    for op in res["uncovered"]:
        failures.append(f"op {op}: no check in krnl doctor (an op of the contract without a case)")
    log(f"  {len(res['checks'])} checks: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return {"counts": counts, **res}


def _training(dev, quick, failures, log):
    res = doctor_runs.train_compare(dev, quick, log=log)
    failures.extend(res["failures"])
    return res


def cmd_doctor(args):
    dev = krnl.device(args.device)
    sections = SECTIONS if args.only is None else tuple(s.strip() for s in args.only.split(","))
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise ValueError(f"--only: unknown section {', '.join(map(repr, bad))}; choose from {', '.join(SECTIONS)}")
    folder = doctor_report.paths(args.report)[0].parent  # refused before minutes of checks, not after
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--report {args.report}: {folder} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    report = run(dev, quick=args.quick, sections=sections, dtype=args.dtype)
    paths = doctor_report.write(report, args.report)
    print(doctor_report.summary(report))
    print(f"report: {paths[0]}, {paths[1]} (attach both to an issue of krnl's repository)")
    return 0 if report["ok"] else 1
