"""`krnl doctor`'s op checks: every case of doctor_cases.py run on a device at small awkward sizes
against the CPU backend in f32. Both run on the same inputs, rounded to the dtype under test first,
so that only the op's own arithmetic differs; the error of each output is judged against its
largest reference value, at a tolerance in units of the dtype's roundoff."""

import math

import numpy as np

import krnl

from .cases import FLOAT_DTYPES, Operands, cases
from .cases_dora import dora_cases
from .cases_gpt_oss import gpt_oss_cases
from .cases_moe import moe_cases
from .cases_optim import optim_cases
from ...formats.mlx_folder import round_to

SIZES = {"quick": (1, 33), "full": (1, 31, 33, 127)}


def _optional(dev, case, dtype):
    """Whether `dev` may lack `case` in `dtype` by its own capabilities: only fused attention is
    optional (the model then takes the materialised scores), and only where they do not list it
    (its sinks cases: where they do not list sinks)."""
    fa = dev.capabilities()["fused_attention"]
    return case.op.startswith("attention_") and (dtype not in fa["dtypes"] or bool(fa["head_dims"]) and
                                                 8 not in fa["head_dims"] or "sinks" in case.name and not fa["sinks"])


def _read(tensors):
    return {k: np.array(t.numpy(), np.float64, copy=True) for k, t in tensors.items()}


def _compare(got, ref, tol):
    """(worst error relative to the largest reference value, a problem or None) of one output."""
    if got.shape != ref.shape:
        return math.inf, f"shape {got.shape} != {ref.shape}"
    if not np.all(np.isfinite(ref)):  # no case makes one: NaN == NaN must not pass as agreement
        return math.inf, f"the CPU's output is not finite at {np.argwhere(~np.isfinite(ref))[:3].tolist()}"
    if not np.all(np.isfinite(got)):
        return math.inf, f"non-finite output at {np.argwhere(~np.isfinite(got))[:3].tolist()}"
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    rel = err / scale if scale else err
    if rel > tol:
        i = np.unravel_index(int(np.argmax(np.abs(got - ref))), ref.shape)
        return rel, f"max error {rel:.2e} of the largest value > {tol:.1e} at {list(map(int, i))}: got {got[i]:.6g}, " \
                    f"CPU {ref[i]:.6g}"
    return rel, None


def run_case(dev, cpu, case, dtype, n, seed=0):
    """One check's record: {op, case, dtype, n, status (ok, mismatch, error, unsupported), ...}."""
    rec = {"op": case.op, "case": case.name, "dtype": dtype, "n": n}
    inputs = case.gen(np.random.default_rng(seed + n), n)
    inputs = {k: round_to(v, dtype) if v.dtype == np.float32 else v for k, v in inputs.items()}
    try:
        ref = _read(case.run(Operands(cpu, dtype if case.same_dtype else "f32"), inputs))
    except Exception as e:  # noqa: BLE001 (the report names whatever went wrong)
        return {**rec, "status": "error", "detail": f"on the CPU: {type(e).__name__}: {e}"}
    try:
        got = _read(case.run(Operands(dev, dtype), inputs))
    except NotImplementedError as e:
        if _optional(dev, case, dtype):
            return {**rec, "status": "unsupported", "detail": f"{e} (optional: the capabilities do not list it)"}
        return {**rec, "status": "error", "detail": f"NotImplementedError: {e}"}
    except Exception as e:  # noqa: BLE001
        return {**rec, "status": "error", "detail": f"{type(e).__name__}: {e}"}
    tol, worst, problems = case.tolerance(dtype), 0.0, []
    for k in ref:
        rel, problem = _compare(got[k], ref[k], tol)
        worst = max(worst, rel)
        if problem:
            problems.append(f"{k}: {problem}")
    return {**rec, "status": "mismatch" if problems else "ok", "max_rel_error": worst, "tolerance": tol,
            **({"detail": "; ".join(problems)} if problems else {})}


def check_ops(dev, quick=False, log=print):
    """Every case at each awkward size in each float dtype of `dev`, against the CPU; returns
    {"checks": [records], "uncovered": [ops of the contract no case checks]}."""
    cpu = krnl.device("cpu")
    have = dev.capabilities()["dtypes"]
    dtypes = [d for d in FLOAT_DTYPES if d in have]
    all_cases = cases() + moe_cases() + dora_cases() + gpt_oss_cases() + optim_cases()
    records = []
    for case in all_cases:
        for dt in (d for d in dtypes if d in case.dtypes):
            for n in SIZES["quick" if quick else "full"]:
                rec = run_case(dev, cpu, case, dt, n)
                records.append(rec)
                if rec["status"] in ("mismatch", "error"):
                    log(f"  {rec['op']} [{rec['case']}] {dt} n={n}: {rec['status'].upper()}: {rec['detail']}")
    covered = {c.op for c in all_cases}
    uncovered = [op for op in krnl._core.testing.op_names() if op not in covered]
    return {"checks": records, "uncovered": uncovered}
