"""A session's results as a text table, JSON, a PNG bar chart and the README's performance block."""

import json
import textwrap
from pathlib import Path

from krnl.io.fileio import atomic_write_bytes, read_json_object

MARK = "UNTRUSTED"


def markers(kind):
    """The README block of one device kind: a CPU session and a CUDA session each own theirs."""
    return f"<!-- bench:{kind}:start -->", f"<!-- bench:{kind}:end -->"


def result_kind(res):
    """The kind of device a session ran on (its capabilities' kind). Results written before
    sessions recorded it ran on "cpu" or "cuda", devices named by their kind."""
    return res.get("kind", res["device"])


def _f(v, fmt):
    """A figure, or '-' right-aligned to the figure's width."""
    return "-".rjust(int(fmt.split(".")[0] or 0)) if v is None else format(v, fmt)


def _ms(v, width=0):
    """A time in ms with about three significant figures (a GPU GEMM takes 0.03 ms, a CPU step
    1000 ms)."""
    if v is None:
        return "-".rjust(width)
    digits = 1 if v >= 10 else 2 if v >= 1 else 3 if v >= 0.1 else 4
    return format(v, f"{width}.{digits}f")


def _rate(v, width=0):
    """GFLOP/s: a decimal only where it says something."""
    return "-".rjust(width) if v is None else format(v, f"{width}.{0 if v >= 1000 else 1}f")


def _header(res):
    m = res["machine"]
    return (f"krnl bench {res['krnl_version']}, {res['date']}: device {res['device']} ({m['cpu']}, {m['cores']} cores, "
            f"{res['threads']} threads), {res.get('dtype', 'f32')}; medians of {res['rounds']} interleaved rounds"
            + (" (--quick sizes)" if res.get("quick") else ""))


def gate_lines(res):
    g = res["gate"]
    ref = "none" if g["reference_gflops"] is None else f"{g['reference_gflops']:.1f}"
    pts = ", ".join(f"{p['gflops']:.1f} {p['at']}" for p in g.get("checkpoints") or
                    [{"at": "before", "gflops": g["before_gflops"]}, {"at": "after", "gflops": g["after_gflops"]}])
    lines = [f"gate: control {g['control_n']}^3 sgemm GFLOP/s: {pts} (moved {100 * g['moved']:.1f}%), reference {ref}"
             + ("" if g["off_reference"] is None else f" (off by {100 * g['off_reference']:.1f}%)")
             + f"; limit {100 * g['tolerance']:.0f}%"]
    if g["trusted"]:
        lines.append("gate: TRUSTED")
    else:
        lines += [f"gate: {MARK}: {r}" for r in g["reasons"]]
    lines += [f"gate: note: {n}" for n in g["notes"]]
    return lines


def format_table(res):
    """The table: workload x implementation; every figure marked when the gate failed."""
    bad = not res["trusted"]
    cols = (f"{'workload':46s} {'impl':18s} {'ms':>9s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'of mm':>6s} {'vs krnl':>7s} "
            f"{'spread':>6s} {'check':>7s}")
    lines = [_header(res)]
    if bad:
        lines.append(f"*** {MARK}: every figure below is marked; the machine changed during the session ***")
    lines.append(f"matmul {res['sgemm']['n']}^3 nn {res.get('dtype', 'f32')} on {res['device']}: "
                 f"{res['sgemm']['gflops']:.1f} GFLOP/s (the 'of mm' base, same session)")
    lines += ["", cols + ("  trust" if bad else "") + "  note", "-" * (len(cols) + 8)]
    last = None
    for r in res["rows"]:
        label = "" if r["workload"] == last else r["workload"]
        if label and r.get("title"):
            lines.append(f"{r['title']}:")
        last = r["workload"]
        if r["status"] != "ok":
            lines.append(f"{label[:46]:46s} {r['impl']:18s} {r['status']}: {r['reason']}")
            continue
        line = (f"{label[:46]:46s} {r['impl']:18s} {_ms(r['ms'], 9)} {_f(r['tokens_per_s'], '9.0f')} "
                f"{_rate(r['gflops'], 8)} {_f(r['of_sgemm'], '6.2f')} {_f(r['vs_krnl'], '7.2f')} "
                f"{_f(r.get('spread') if r.get('samples', 0) > 1 else None, '6.2f')} {_f(r.get('check_err'), '7.0e')}")
        lines.append(line + (f"  {MARK}" if bad else "") + (f"  {r['note']}" if r["note"] else ""))
    lines += ["", "of mm = GFLOP/s over the session's square matmul; vs krnl = krnl's step time / this "
              "implementation's (above 1: faster than krnl); spread = slowest / fastest round; check = largest error "
              "against krnl's outputs at the small size, relative to each output's largest value."]
    lines += gate_lines(res)
    return "\n".join(lines)


def format_profile(prof):
    lines = [f"per-op profile of one {prof.get('workload', 'w2').upper()} step: {prof['op_ms']:.1f} ms in ops, {prof['wall_ms']:.1f} ms wall",
             f"{'op':24s} {'shape':34s} {'calls':>5s} {'ms':>9s} {'share':>6s} {'GFLOP/s':>8s}"]
    for g in prof["rows"]:
        lines.append(f"{g['op'][:24]:24s} {g['shape'][:34]:34s} {g['calls']:5d} {g['ms']:9.3f} "
                     f"{100 * g['share']:5.1f}% {g['gflops']:8.1f}")
    return "\n".join(lines)


def write_json(res, path):
    atomic_write_bytes(path, (json.dumps(res, indent=2) + "\n").encode())


def read_json(path):
    res = read_json_object(path, "krnl bench")
    for k in ("rows", "gate", "trusted", "machine"):
        if k not in res:
            raise ValueError(f"[krnl bench] {path}: not a krnl bench result (no {k!r})")
    return res


def write_png(res, path):
    """Bars: tokens/s of each implementation per training-step workload; GFLOP/s per GEMM."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in res["rows"] if r["status"] == "ok"]
    steps = [r for r in ok if r["tokens_per_s"] is not None]
    gemms = [r for r in ok if r["tokens_per_s"] is None]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.4]})
    wls = list(dict.fromkeys(r["workload"] for r in steps))
    impls = list(dict.fromkeys(r["impl"] for r in steps))
    ax = axes[0]
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        xs, ys = [], []
        for j, wl in enumerate(wls):
            for r in steps:
                if r["workload"] == wl and r["impl"] == impl:
                    xs.append(j + i * width)
                    ys.append(r["tokens_per_s"])
        ax.bar(xs, ys, width, label=impl)
    ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(wls))], [w.upper() for w in wls])
    ax.set_ylabel("tokens/s (higher is better)")
    ax.set_title("training step")
    if impls:
        ax.legend(fontsize=8)
    ax = axes[1]
    ax.barh(range(len(gemms)), [r["gflops"] for r in gemms])
    ax.set_yticks(range(len(gemms)), [r["workload"] for r in gemms], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GFLOP/s (krnl)")
    ax.set_title("GEMMs")
    title = _header(res)
    if not res["trusted"]:
        title = textwrap.fill(f"{MARK}: " + "; ".join(res["untrusted_reasons"]), 150) + "\n" + title
    fig.suptitle(title, fontsize=8, color="red" if not res["trusted"] else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def readme_block(res):
    """The README's performance figures (markdown) from a session's results."""
    m = res["machine"]
    bad = not res["trusted"]
    start, end = markers(result_kind(res))
    dt = res.get("dtype", "f32")
    out = [start,
           f"Generated by `krnl bench --readme` from the run of {res['date']} on {m['cpu']} ({m['cores']} cores, "
           f"device {res['device']}, {res['threads']} threads), {dt}; medians of {res['rounds']} interleaved rounds. "
           f"matmul {res['sgemm']['n']}^3 {dt} in the same run: {res['sgemm']['gflops']:.1f} GFLOP/s.", ""]
    if bad:
        out += [f"**{MARK}**: " + "; ".join(res["untrusted_reasons"]) + ". The figures below are not results.", ""]
    out += ["| workload | implementation | ms | tokens/s | GFLOP/s | of mm | vs krnl | note |",
            "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        wl = r.get("title", r["workload"]).replace("|", "/")
        if r["status"] != "ok":
            out.append(f"| {wl} | {r['impl']} | | | | | | {r['status']}: {r['reason']} |")
            continue
        note = " ".join(x for x in ((MARK if bad else ""), r["note"]) if x)
        out.append(f"| {wl} | {r['impl']} | {_ms(r['ms'])} | {_f(r['tokens_per_s'], '.0f')} | "
                   f"{_rate(r['gflops'])} | {_f(r['of_sgemm'], '.2f')} | {_f(r['vs_krnl'], '.2f')} | {note} |")
    g = res["gate"]
    out += ["", f"Control gate: {g['control_n']}^3 sgemm {g['before_gflops']:.1f} -> {g['after_gflops']:.1f} GFLOP/s"
            + ("" if g["reference_gflops"] is None else f", reference {g['reference_gflops']:.1f}")
            + f": {'trusted' if g['trusted'] else MARK}.", end]
    return "\n".join(out)


def replace_readme_block(path, block, kind):
    """Replaces the text between the bench markers of device kind `kind` in `path` (markers
    included) with `block`."""
    start, end = markers(kind)
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"[krnl bench] --readme: cannot read {path}: {e}") from None
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i or text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"[krnl bench] --readme: {path} must hold exactly one {start} ... {end} block "
                         "(put it in the Performance section)")
    atomic_write_bytes(path, (text[:i] + block + text[j + len(end):]).encode("utf-8"))
