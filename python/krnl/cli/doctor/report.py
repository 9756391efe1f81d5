"""`krnl doctor`'s report: one JSON file (everything, for us to read back) and one Markdown file (the
same, for a person reading an issue), written atomically with the user's umask, and the summary
printed at the end."""

import json
import math
from pathlib import Path

from ...io.fileio import atomic_write_bytes

# The report's sections, in order; the Markdown has a heading for each.
HEADINGS = {"device": "Device", "system": "System", "build": "Build", "compile": "Metal libraries compiled",
            "ops": "Ops against the CPU", "training": "Training the embedded default", "timing": "Timing"}


def paths(base):
    """(json path, md path) of the report named `base`: a .json or .md suffix is dropped first."""
    base = Path(base)
    if base.suffix in (".json", ".md"):
        base = base.with_suffix("")
    if not base.name or base.name in (".", ".."):
        raise ValueError(f"--report {str(base)!r}: give a file name (without suffix), e.g. krnl-doctor")
    return base.with_name(base.name + ".json"), base.with_name(base.name + ".md")


def write(report, base):
    """Writes both files; returns their paths."""
    js, md = paths(base)
    atomic_write_bytes(js, (json.dumps(_finite(report), indent=1, default=str, allow_nan=False) + "\n").encode())
    atomic_write_bytes(md, markdown(report).encode())
    return js, md


def _finite(v):
    """`v` with each non-finite float as a string ("nan", "inf"): strict JSON has no NaN, and a
    failing run is the one whose report must parse everywhere."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return ", ".join(map(_fmt, v)) or "-"
    return "-" if v is None else str(v).replace("|", "\\|").replace("\n", " ")


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return out


def _status(section):
    return f"**{section['status']}**: {section.get('error') or section.get('reason', '')}".rstrip(": ")


def markdown(report):
    ok = "all checks passed" if report["ok"] else f"{len(report['failures'])} failure(s)"
    L = [f"# krnl doctor: {report['device']['name']}, {ok}", "",
         f"krnl {report['krnl']}, {report['created']}{', quick' if report['quick'] else ''}", ""]
    if report["failures"]:
        L += ["## Failures", ""] + [f"- {f}" for f in report["failures"]] + [""]
    dev = report["device"]
    L += [f"## {HEADINGS['device']}", "", f"`{dev['summary']}`", ""]
    L += _table(["capability", "value"], [(k, v) for k, v in dev["capabilities"].items() if k != "details"])
    L += [""] + _table(["detail", "value"], list(dev["capabilities"]["details"].items()))
    if "gpu" in dev:
        L += [""] + _table(["GPU", "value"], list(dev["gpu"].items()))
        L += [""] + _table(["library", "MSL version"], list(dev["msl_versions"].items()))
    if dev["unavailable"]:
        L += [""] + [f"- {k} unavailable: {v}" for k, v in dev["unavailable"].items()]
    for key in ("system", "build"):
        L += ["", f"## {HEADINGS[key]}", ""] + _table(["", ""], list(report[key].items()))
    for key, fn in (("compile", _compile_md), ("ops", _ops_md), ("training", _training_md), ("timing", _timing_md)):
        L += ["", f"## {HEADINGS[key]}", ""]
        sec = report.get(key)
        if sec is None:
            L.append("not run (--only)")
        elif sec.get("status") in ("error", "skipped"):
            L.append(_status(sec))
        else:
            L += fn(sec)
    return "\n".join(L) + "\n"


def _compile_md(c):
    return ([c["method"], ""] + _table(["library", "ms"], list(c["libraries"].items()))
            + ["", f"total {c['total_ms']:.1f} ms"])


def _ops_md(o):
    L = [", ".join(f"{v} {k}" for k, v in sorted(o["counts"].items())), ""]
    rows = [(r["op"], r["case"], r["dtype"], r["n"], r["status"], r.get("max_rel_error"), r.get("tolerance"),
             r.get("detail", "")) for r in o["checks"] if r["status"] != "ok"]
    if rows:
        L += _table(["op", "case", "dtype", "n", "status", "error", "tolerance", "detail"], rows) + [""]
    # per op: how many checks passed and the worst error seen (relative to its tolerance)
    per = {}
    for r in o["checks"]:
        p = per.setdefault(r["op"], [0, 0, 0.0])
        p[0] += r["status"] == "ok"
        p[1] += 1
        if r.get("tolerance"):
            p[2] = max(p[2], r["max_rel_error"] / r["tolerance"])
    L += _table(["op", "passed", "worst error / tolerance"], [(k, f"{a}/{b}", c) for k, (a, b, c) in per.items()])
    if o["uncovered"]:
        L += ["", "ops of the contract without a check: " + ", ".join(o["uncovered"])]
    return L


def _training_md(t):
    L = []
    for r in t["runs"]:
        L += [f"{r['dtype']}: {r['steps']} steps of batch {r['batch_size']}, **{r['status']}** (largest step "
              f"difference {r['max_rel_diff']:.2e}, tolerance {r['tolerance']:.0e}; {r['device_s']:.1f} s on the "
              "device)", ""]
        L += _table(["step", "device loss", "CPU loss", "relative difference"],
                    [(i + 1, f"{a:.6f}", f"{b:.6f}", f"{abs(a - b) / abs(b):.2e}" if b else "-")
                     for i, (a, b) in enumerate(zip(r["device_losses"], r["cpu_losses"]))]) + [""]
    return L


def _timing_md(t):
    L = []
    for key, title, rate in (("w1", "W1 (the MLP block's LoRA step)", "gflops"),
                             ("qlora", "QLoRA step (4-bit base)", "tokens_per_s")):
        s = t[key]
        L += [f"{title}, {s['dtype']}: {_fmt(s['size'])}", ""]
        L += _table(["impl", "ms per step", {"gflops": "GFLOP/s", "tokens_per_s": "tokens/s"}[rate], "note"],
                    [(r["impl"], r.get("ms"), r.get(rate), r.get("note", "")) for r in s["rows"]]) + [""]
    return L


def summary(report):
    """What the terminal shows at the end: one line per section, then each failure."""
    L = [f"krnl doctor on {report['device']['name']}: " + ("all checks passed" if report["ok"] else
                                                         f"{len(report['failures'])} FAILURE(S)")]
    c = report.get("compile")
    if c:
        L.append(f"  compile: {len(c['libraries'])} libraries in {c['total_ms']:.0f} ms" if c.get("libraries") else
                 f"  compile: {c['status']}")
    o = report.get("ops")
    if o and "counts" in o:
        L.append("  ops: " + ", ".join(f"{v} {k}" for k, v in sorted(o["counts"].items())))
    t = report.get("training")
    if t and "runs" in t:
        L.append("  training: " + "; ".join(f"{r['dtype']} {r['status']} (largest step difference "
                                            f"{r['max_rel_diff']:.1e})" for r in t["runs"]))
    tm = report.get("timing")
    if tm and "w1" in tm:
        k1, kq = tm["w1"]["rows"][0], tm["qlora"]["rows"][0]
        L.append(f"  timing: W1 {k1['ms']:.1f} ms/step ({k1['gflops']:.1f} GFLOP/s), QLoRA "
                 f"{kq['ms']:.1f} ms/step ({kq['tokens_per_s']:.0f} tokens/s)")
    L += [f"  FAILED: {f}" for f in report["failures"]]
    return "\n".join(L)
