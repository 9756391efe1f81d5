"""`krnl doctor`: a complete report on the CPU and on metal-sim (every section, every op of the
contract, valid JSON, Markdown with every heading, written with the user's umask), a planted wrong
op or a tolerance forced to fail gives exit status 1 naming it, a failing section still leaves a
report, and bad flags are refused in one line."""

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

import krnl
from krnl.cli.doctor import command as doctor, cases as doctor_cases, report as doctor_report, runs as doctor_runs
from krnl.cli.main import main

from conftest import METAL_SIM

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("device", "system", "build", "compile", "ops", "training", "timing")


def _doctor(tmp_path, *flags):
    """(exit status, JSON report, Markdown text) of `krnl doctor --quick` with `flags`."""
    base = tmp_path / "report"
    rc = main(["doctor", "--quick", "--report", str(base), *flags])
    return rc, json.loads((tmp_path / "report.json").read_text()), (tmp_path / "report.md").read_text()


def _check_complete(report, md, dev):
    """Every section there and passing, every op of the contract checked, every heading in the Markdown."""
    assert report["ok"] and report["failures"] == [], report["failures"]
    assert set(SECTIONS) <= set(report)
    assert report["device"]["capabilities"] == dev.capabilities()
    assert report["build"] == {**krnl._core.build_info(), **{k: v for k, v in report["build"].items()
                                                           if k.endswith("_version")}}
    checked = {r["op"] for r in report["ops"]["checks"] if r["status"] == "ok"}
    assert checked == set(krnl._core.testing.op_names())
    assert report["ops"]["uncovered"] == []
    for run in report["training"]["runs"]:
        assert run["status"] == "ok" and len(run["device_losses"]) == len(run["cpu_losses"]) == 5
    for work in ("w1", "qlora"):
        krnl_row, peer = report["timing"][work]["rows"]
        assert krnl_row["impl"] == "krnl" and krnl_row["ms"] > 0
        if importlib.util.find_spec("mlx_lm") is None:
            assert peer["status"] == "skipped" and "mlx-lm is not installed" in peer["note"]
    for heading in doctor_report.HEADINGS.values():
        assert f"\n## {heading}\n" in md
    assert md.startswith(f"# krnl doctor: {dev.name}, all checks passed\n")
    losses = report["training"]["runs"][0]
    assert f"| 5 | {losses['device_losses'][4]:.6f} | {losses['cpu_losses'][4]:.6f} | " in md


def test_doctor_cpu_quick(tmp_path, capsys):
    old = os.umask(0o027)
    try:
        rc, report, md = _doctor(tmp_path, "--device", "cpu")
    finally:
        os.umask(old)
    out = capsys.readouterr().out
    assert rc == 0, out
    _check_complete(report, md, krnl.device("cpu"))
    assert report["compile"] == {"status": "skipped", "reason": "cpu runs no Metal libraries",
                                 "seconds": report["compile"]["seconds"]}
    assert [r["dtype"] for r in report["training"]["runs"]] == ["f32"]
    for name in ("report.json", "report.md"):  # the user's umask, as any new file of theirs
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640
    assert "krnl doctor on cpu: all checks passed" in out and "report.json" in out


@pytest.fixture
def sim():
    """metal-sim (the fixture's name also counts the test's time in the suite's metal-sim budget)."""
    if METAL_SIM is None:
        pytest.skip("metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
    return krnl.device("metal-sim")


def test_doctor_metal_sim_quick(tmp_path, capsys, sim):
    rc, report, md = _doctor(tmp_path, "--device", "metal-sim")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "gpu: metal-sim (tools/mslsim on the CPU, standing for an Apple9 GPU), apple family 9" in out
    _check_complete(report, md, sim)
    libs = {p.stem for p in (ROOT / "metal").glob("*.metal")} - {"gemm"} | {"gemm[0=True]", "gemm[0=False]"}
    assert report["compile"]["status"] == "ok" and set(report["compile"]["libraries"]) == libs
    assert all(ms > 0 for ms in report["compile"]["libraries"].values())
    # f32 and the simulated Apple9's compute dtype, each against the CPU
    assert [r["dtype"] for r in report["training"]["runs"]] == ["f32", sim.capabilities()["compute_dtype"]] \
        == ["f32", "bf16"]
    assert report["device"]["gpu"]["apple_family"] == 9 and report["device"]["gpu"]["command_buffer_policy"]
    assert set(report["device"]["msl_versions"]) == {p.stem for p in (ROOT / "metal").glob("*.metal")}
    assert "| apple_family | 9 |" in md
    assert report["ops"]["counts"] == {"ok": len(report["ops"]["checks"])}
    assert {r["dtype"] for r in report["ops"]["checks"]} == {"f32", "f16", "bf16"}


def test_doctor_names_a_wrong_op(tmp_path, capsys, monkeypatch):
    """swiglu_forward made 1% wrong in f16 only (its plain form) and sumsq NaN in bf16 only: exit
    status 1, the failures are exactly their checks, each naming the op, and the report is still
    strict JSON."""
    real_swiglu, real_sumsq = krnl.ops.swiglu_forward, krnl.ops.sumsq

    def wrong_swiglu(g, u, s, **clamp):
        real_swiglu(g, u, s, **clamp)
        if s.dtype == "f16" and not clamp:
            krnl.ops.scale(s, 1.01, s)

    def nan_sumsq(x, out):
        real_sumsq(x, out)
        if x.dtype == "bf16":
            krnl.ops.fill(out, float("nan"))

    monkeypatch.setattr(krnl.ops, "swiglu_forward", wrong_swiglu)
    monkeypatch.setattr(krnl.ops, "sumsq", nan_sumsq)
    rc, report, md = _doctor(tmp_path, "--device", "cpu", "--only", "ops")
    out = capsys.readouterr().out
    assert rc == 1
    swiglu, sumsq = report["failures"][:2], report["failures"][2:]
    assert len(swiglu) == len(sumsq) == 2  # the quick sizes, n = 1 and 33
    assert all(f.startswith("op swiglu_forward [33 wide] f16 n=") and ": mismatch: s: max error" in f
               for f in swiglu), swiglu
    assert all(f.startswith("op sumsq [33 wide] bf16 n=") and ": mismatch: out: non-finite output" in f
               for f in sumsq), sumsq
    assert "FAILED: op swiglu_forward" in out and "FAILED: op sumsq" in out and "4 FAILURE(S)" in out
    assert "## Failures\n\n- op swiglu_forward" in md and "| sumsq | 4/6 |" in md
    assert "compile" not in report and "not run (--only)" in md

    def refuse(name):
        raise AssertionError(f"{name} in the JSON report")

    json.loads((tmp_path / "report.json").read_text(), parse_constant=refuse)


def test_doctor_training_tolerance_forced_to_fail(tmp_path, capsys, monkeypatch, sim):
    """metal-sim's f32 losses differ from the CPU's by summation order only (~1e-7); a tolerance
    of 1e-12 must fail and say at which steps."""
    monkeypatch.setitem(doctor_runs.LOSS_RTOL, "f32", 1e-12)
    rc, report, _ = _doctor(tmp_path, "--device", "metal-sim", "--only", "training")
    assert rc == 1
    f32 = report["training"]["runs"][0]
    assert f32["status"] == "mismatch" and report["training"]["runs"][1]["status"] == "ok"
    assert len(report["failures"]) == 1
    assert report["failures"][0].startswith("training f32: the loss differs from the CPU's by more than 1e-12 at step")


def test_doctor_section_error_still_writes_the_report(tmp_path, capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(doctor_runs, "time_qlora", boom)
    rc, report, md = _doctor(tmp_path, "--device", "cpu", "--only", "timing")
    assert rc == 1
    assert report["failures"] == ["timing: RuntimeError: planted"]
    assert report["timing"]["status"] == "error" and "planted" in report["timing"]["traceback"]
    assert "**error**: RuntimeError: planted" in md


def test_doctor_refuses_bad_flags(tmp_path, capsys):
    assert main(["doctor", "--device", "cpu", "--only", "ops,bogus", "--report", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err == ("krnl doctor: error: --only: unknown section 'bogus'; choose from compile, "
                                       "ops, training, timing\n")
    assert not list(tmp_path.iterdir())
    assert main(["doctor", "--device", "cpu", "--only", "compile", "--report", ""]) == 1
    assert "--report '.': give a file name" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["doctor", "--device", "cpu", "--only", "compile", "--report", str(tmp_path / "file" / "r")]) == 1
    assert capsys.readouterr().err == (f"krnl doctor: error: --report {tmp_path / 'file' / 'r'}: {tmp_path / 'file'} "
                                       "is a file, not a folder\n")


def test_doctor_report_paths():
    assert doctor_report.paths("out/krnl-doctor.json") == (Path("out/krnl-doctor.json"), Path("out/krnl-doctor.md"))
    assert doctor_report.paths("r.md") == doctor_report.paths("r") == (Path("r.json"), Path("r.md"))


def test_doctor_cases_cover_the_contract():
    """Each op of csrc/core/op_list.h has a case (the doctor also reports any that has none)."""
    from krnl.cli.doctor.cases_dora import dora_cases
    from krnl.cli.doctor.cases_moe import moe_cases
    from krnl.cli.doctor.cases_optim import optim_cases

    assert {c.op for c in doctor_cases.cases() + moe_cases() + dora_cases() + optim_cases()} == \
        set(krnl._core.testing.op_names())


def test_help_lists_doctor(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "doctor" in capsys.readouterr().out


class _Metal:
    """A stand-in Metal device for the compile section: `compiled` is what compile_libraries()
    returns, or an exception it raises."""

    def __init__(self, kind, compiled):
        self.name, self.kind, self.compiled = kind, kind, compiled

    def capabilities(self):
        return {"kind": self.kind}

    def compile_libraries(self):
        if isinstance(self.compiled, Exception):
            raise self.compiled
        return self.compiled


def test_doctor_compile_section_follows_the_contract():
    """On "metal" the times are Device.compile_libraries()'s; a compiler error propagates (the
    section then fails, named); NotImplementedError (metal-sim) falls back to the mslsim builds."""
    c = doctor.compile_libraries(_Metal("metal", {"gemm": 12.5, "rope": 1.5}))
    assert c["status"] == "ok" and c["libraries"] == {"gemm": 12.5, "rope": 1.5} and c["total_ms"] == 14.0
    assert c["method"].startswith("Device.compile_libraries()")
    with pytest.raises(RuntimeError, match="rope.metal: error"):
        doctor.compile_libraries(_Metal("metal", RuntimeError("rope.metal: error: no such type")))
    c = doctor.compile_libraries(_Metal("metal-cuda", NotImplementedError("[compile_libraries] not on metal-cuda")))
    assert c["status"] == "skipped"
    if METAL_SIM is not None:
        c = doctor.compile_libraries(_Metal("metal-sim", NotImplementedError("[compile_libraries] not on metal-sim")))
        assert c["status"] == "ok" and c["method"].startswith("tools/mslsim") and "rope" in c["libraries"]


def test_doctor_compare_refuses_what_is_not_agreement():
    """NaN against NaN, an unwritten (NaN-prefilled) element, a shape change and an error past the
    tolerance all fail; exact agreement passes a zero tolerance."""
    from krnl.cli.doctor.ops import _compare

    assert _compare(np.array([np.nan]), np.array([np.nan]), 1.0)[1].startswith("the CPU's output is not finite")
    assert _compare(np.array([1.0, np.nan]), np.array([1.0, 2.0]), 1.0)[1] == "non-finite output at [[1]]"
    assert _compare(np.ones((2, 3)), np.ones((3, 2)), 1.0)[1] == "shape (2, 3) != (3, 2)"
    rel, problem = _compare(np.array([1.0, 2.0]), np.array([1.0, 2.1]), 1e-3)
    assert rel == pytest.approx(0.1 / 2.1) and problem.startswith("max error 4.76e-02 of the largest value > 1.0e-03")
    assert _compare(np.array([1.0, 2.0]), np.array([1.0, 2.0]), 0.0) == (0.0, None)


def test_doctor_build_versions(monkeypatch):
    """The SDK and deployment target of an Apple build (MMmmpp numbers) also as X.Y[.Z]."""
    monkeypatch.setattr(krnl._core, "build_info", lambda: {"compiler": "clang 15.0.0", "macos_sdk": 150000,
                                                           "macos_deployment_target": 130302, "blas": "Accelerate"})
    b = doctor.build_info()
    assert (b["macos_sdk_version"], b["macos_deployment_target_version"]) == ("15.0", "13.3.2")
    monkeypatch.setattr(krnl._core, "build_info", lambda: {"compiler": "gcc", "macos_sdk": None,
                                                           "macos_deployment_target": None, "blas": "x"})
    assert "macos_sdk_version" not in doctor.build_info()
