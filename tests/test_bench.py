"""krnl.bench: the control gate, the reference file, peers checked before they are timed, the
reports (table, JSON, PNG, README block) and `krnl bench --quick` end to end. No timed assertions:
only what the figures are marked as and where they go."""

import json
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import krnl
from krnl.bench import gate, hostmem, report, train, w1
from krnl.bench.cli import main as bench_main
from krnl.bench.session import Session, compare
from krnl.bench.workloads import W1, STEPS
from krnl.cli.main import main as krnl_main


@pytest.fixture(autouse=True)
def reference(tmp_path, monkeypatch):
    """Every test gets its own reference file: the user's ~/.cache is never read or written."""
    path = tmp_path / "ref" / "bench_reference.json"
    monkeypatch.setenv("KRNL_BENCH_REFERENCE", str(path))
    return path


# ---- the gate


def test_verdict_trusted_when_steady_and_on_reference():
    v = gate.verdict(100.0, 104.0, 98.0, 1024)
    assert v["trusted"] and v["reasons"] == [] and v["notes"] == []


def test_verdict_moved_more_than_ten_percent_is_untrusted():
    v = gate.verdict(100.0, 85.0, None, 1024)
    assert not v["trusted"]
    assert "moved 15%" in v["reasons"][0] and "100.0 GFLOP/s before, 85.0 after" in v["reasons"][0]
    assert v["notes"] and "--calibrate" in v["notes"][0]  # no reference: said, not hidden


def test_verdict_off_reference_is_untrusted_even_when_steady():
    v = gate.verdict(60.0, 61.0, 140.0, 1024)
    assert not v["trusted"] and len(v["reasons"]) == 1
    assert "off this machine's reference" in v["reasons"][0]


def test_verdict_catches_a_load_between_workloads():
    v = gate.verdict(100.0, 101.0, 100.0, 1024, between=[("before w2", 60.0)])
    assert not v["trusted"] and "60.0 before w2" in v["reasons"][0] and len(v["reasons"]) == 2
    assert [p["at"] for p in v["checkpoints"]] == ["before", "before w2", "after"]


def test_verdict_without_reference_checks_drift_only():
    v = gate.verdict(100.0, 95.0, None, 1024)
    assert v["trusted"] and v["off_reference"] is None and v["notes"]


class _Dev:
    name = "cpu"

    def capabilities(self):
        return krnl.device("cpu").capabilities()


def test_calibrate_writes_the_reference_atomically(reference, monkeypatch):
    other = {"another machine | 8 cores | 8 threads | cpu": {"n": 1024, "gflops": 500.0}}
    reference.parent.mkdir(parents=True)
    reference.write_text(json.dumps(other))
    writes = []
    real = gate.atomic_write_bytes
    monkeypatch.setattr(gate, "atomic_write_bytes", lambda p, d: (writes.append(p), real(p, d)))
    rates = iter([100.0, 104.0])
    c = gate.calibrate(_Dev(), reference, measure=lambda dev, n: next(rates))
    assert writes == [reference]
    stored = json.loads(reference.read_text())
    key = gate.fingerprint_key(gate.fingerprint("cpu"))
    assert stored[key]["gflops"] == pytest.approx(102.0) and stored[key]["n"] == 1024 and c["key"] == key
    assert stored["another machine | 8 cores | 8 threads | cpu"]["gflops"] == 500.0  # others kept
    assert [p.name for p in reference.parent.iterdir()] == [reference.name]  # no temp file left
    assert gate.lookup_reference(reference, gate.fingerprint("cpu"), 1024)["gflops"] == pytest.approx(102.0)
    assert gate.lookup_reference(reference, gate.fingerprint("cpu"), 256) is None  # other size: no reference


def test_calibrate_refuses_a_busy_machine(reference):
    rates = iter([100.0, 70.0])
    with pytest.raises(ValueError, match="busy, nothing stored"):
        gate.calibrate(_Dev(), reference, measure=lambda dev, n: next(rates))
    assert not reference.exists()


@pytest.mark.parametrize("text, msg", [("{not json", "malformed JSON at line 1"),
                                       ('{"m": {"n": "big"}}', "entry 'm' must be an object"),
                                       ("[1, 2]", "expected a JSON object")])
def test_corrupt_reference_names_the_file(reference, text, msg):
    reference.parent.mkdir(parents=True)
    reference.write_text(text)
    with pytest.raises(ValueError, match=msg) as e:
        gate.load_references(reference)
    assert str(reference) in str(e.value)


def test_corrupt_reference_stops_krnl_bench_before_the_work(reference, capsys):
    reference.parent.mkdir(parents=True)
    reference.write_text("{oops")
    assert krnl_main(["bench", "--quick", "--workloads", "gemm", "--peers", "numpy"]) == 1
    err = capsys.readouterr().err
    assert "krnl bench: error:" in err and str(reference) in err and "malformed JSON" in err


# ---- peers: checked before timed, absent with a reason


def test_compare_names_the_worst_output():
    ref = {"y": np.ones(4), "dx": np.ones(3)}
    assert compare(ref, {"y": np.ones(4), "dx": np.ones(3) + 1e-7}, 1e-4) is None
    bad = compare(ref, {"y": np.ones(4), "dx": np.array([1, 1, 1.5])}, 1e-4)
    assert "'dx'" in bad and "5.00e-01" in bad
    assert "missing" in compare(ref, {"y": np.ones(4)}, 1e-4)
    assert "not finite" in compare(ref, {"y": np.ones(4), "dx": np.full(3, np.nan)}, 1e-4)


def _wrong_numpy(P):
    """The numpy W1 step with one LoRA gradient 1% off: plausible numbers, wrong."""
    step, result = w1.build_numpy(P)

    def wrong():
        out = result()
        out["Ag"] = out["Ag"] * 1.01
        return out

    return step, wrong


def _broken(P):
    raise RuntimeError("no kernel for this shape")


def test_session_lists_absent_peers_with_reasons(monkeypatch):
    import krnl.bench.workloads as wl
    monkeypatch.setitem(wl.PEER_MODULES, "mlx", "krnl_no_such_module")
    s = Session("cpu", rounds=1, quick=True, peers=["numpy", "torch", "mlx", "mx.compile"], log=lambda m: None,
                peer_overrides={("w1", "torch"): _wrong_numpy, ("w1", "mx.compile"): _broken})
    s.sgemm_gflops = 100.0
    s.run_step(W1)
    rows = {r["impl"]: r for r in s.rows}
    assert list(rows) == ["krnl", "numpy", "torch", "torch.compile", "compile+cudagraphs", "mlx",
                          "mx.compile"]  # nobody dropped
    assert rows["torch.compile"]["status"] == "absent" and rows["torch.compile"]["reason"] == "not selected (--peers)"
    assert rows["krnl"]["status"] == "ok" and rows["krnl"]["vs_krnl"] == 1.0
    assert rows["numpy"]["status"] == "ok" and rows["numpy"]["ms"] > 0
    assert rows["torch"]["status"] == "absent" and "failed its check against krnl" in rows["torch"]["reason"]
    assert "'Ag'" in rows["torch"]["reason"]
    assert rows["mlx"]["status"] == "absent" and "not installed" in rows["mlx"]["reason"]
    assert rows["mx.compile"]["status"] == "absent" and "no kernel for this shape" in rows["mx.compile"]["reason"]


@pytest.mark.torch
def test_bf16_session_checks_peers_in_bf16_and_lists_the_rest():
    """--dtype bf16 on the CPU: krnl and torch run the step in bf16 and are checked against each
    other at the bf16 tolerance; numpy (f32 only) and CUDA graphs are listed with the reason."""
    from krnl.bench.targets import TOLERANCE
    s = Session("cpu", rounds=1, quick=True, peers=["numpy", "torch", "compile+cudagraphs"], log=lambda m: None,
                dtype="bf16")
    s.sgemm_gflops = 100.0
    s.run_step(W1)
    rows = {r["impl"]: r for r in s.rows}
    assert rows["krnl"]["status"] == "ok" and rows["krnl"]["title"].endswith("; bf16)")
    assert rows["numpy"]["status"] == "absent" and "f32 only" in rows["numpy"]["reason"]
    try:
        import torch  # noqa: F401
    except ImportError:  # every torch peer says so first
        for name in ("torch", "compile+cudagraphs"):
            assert rows[name]["status"] == "absent" and "not installed" in rows[name]["reason"], rows[name]
        return
    assert rows["compile+cudagraphs"]["status"] == "absent" and "cuda devices only" in rows["compile+cudagraphs"]["reason"]
    # an error of bf16 size shows both sides ran in bf16 (in f32 they agree to about 1e-6)
    assert rows["torch"]["status"] == "ok" and 1e-4 < rows["torch"]["check_err"] <= TOLERANCE["bf16"]


def test_untrusted_session_exits_2(monkeypatch, capsys):
    rates = iter([100.0, 60.0])  # the control before and after: moved 40%
    monkeypatch.setattr(gate, "measure_control", lambda dev, n: next(rates))
    assert bench_main(["--quick", "--workloads", "gemm", "--peers", "numpy", "--rounds", "1"]) == 2
    out, err = capsys.readouterr()
    assert "UNTRUSTED" in out and "moved 40%" in out and "control gate failed" in err


def test_w3_is_skipped_on_cpu():
    s = Session("cpu", rounds=1, quick=True, peers=["numpy"], log=lambda m: None)
    s.run_step(STEPS["w3"])
    assert [(r["impl"], r["status"], r["reason"]) for r in s.rows] == [("all", "skipped", "sized for the H200")]


def test_qlora_workload_rows():
    """The QLoRA workload: at full size only on a GPU; --quick runs krnl with and without gradient
    checkpointing on the same batches (same losses: recomputation changes no value), and no PEFT
    row where torch is not among the peers asked for."""
    s = Session("cpu", rounds=1, quick=False, peers=["numpy"], log=lambda m: None)
    s.run_model("qlora")
    assert [(r["impl"], r["status"]) for r in s.rows] == [("krnl", "skipped")]
    assert "sized for the H200" in s.rows[0]["reason"]
    s = Session("cpu", rounds=1, quick=True, peers=["numpy"], log=lambda m: None)
    s.run_model("qlora")
    rows = {r["impl"]: r for r in s.rows}
    assert list(rows) == ["krnl", "krnl grad-ckpt"]
    plain, ckpt = rows["krnl"], rows["krnl grad-ckpt"]
    assert plain["tokens_per_s"] > 0 and ckpt["tokens_per_s"] > 0 and np.isfinite(plain["loss"])
    assert plain["loss"] == ckpt["loss"] and plain["title"].startswith("QLoRA 4-bit g64")
    # what each row held before its steps and what its steps took in host memory (Linux: measured)
    assert all(r["resident_bytes"] >= 0 and r["host_bytes"] >= 0 for r in (plain, ckpt))


def test_host_growth_sees_a_buffer_freed_before_the_end(monkeypatch):
    """HostGrowth's figure is the largest resident set inside less the one on entering: a 64 MiB
    buffer written and freed inside counts; an empty block takes next to nothing; without /proc
    there is no figure rather than a wrong one."""
    with hostmem.HostGrowth(every=0.001) as g:
        a = np.ones(64 << 20, np.uint8)
        time.sleep(0.05)
        del a
    assert g.bytes >= 60 << 20
    with hostmem.HostGrowth() as g:
        pass
    assert 0 <= g.bytes < 16 << 20
    monkeypatch.setattr(hostmem, "STATM", Path("/nonexistent/statm"))
    with hostmem.HostGrowth() as g:
        pass
    assert g.bytes is None


def test_train_note_puts_host_memory_beside_a_device_peak():
    """A train row's note gives the host memory its steps took where it has a device peak (a GPU),
    and none on the CPU, whose host memory is the device's."""
    r = dict(loss=1.0, first_loss=2.0, warmup_s=0.5, peak_bytes=3 << 30, peak_kind="reserved (torch.cuda)",
             host_bytes=1 << 29)
    assert "peak 3.00 GiB reserved (torch.cuda), host +0.50 GiB in the steps" in train.note(r)
    assert "host" not in train.note(dict(r, peak_bytes=None))


def test_moe_workload_rows():
    """The MoE workload: at full size only on a GPU; --quick runs krnl in the compute dtype and with
    4-bit experts on the same batches (both train: finite losses near each other)."""
    s = Session("cpu", rounds=1, quick=False, peers=["numpy"], log=lambda m: None)
    s.run_model("moe")
    assert [(r["impl"], r["status"]) for r in s.rows] == [("krnl", "skipped")]
    assert "Qwen3-30B-A3B" in s.rows[0]["reason"]
    s = Session("cpu", rounds=1, quick=True, peers=["numpy"], log=lambda m: None)
    s.run_model("moe")
    rows = {r["impl"]: r for r in s.rows}
    assert list(rows) == ["krnl f32", "krnl 4-bit g64"] and rows["krnl f32"]["title"].startswith("MoE 7 experts top-2")
    dense, q = rows["krnl f32"], rows["krnl 4-bit g64"]
    assert dense["tokens_per_s"] > 0 and q["tokens_per_s"] > 0 and np.isfinite(dense["loss"])
    assert q["loss"] == pytest.approx(dense["loss"], rel=0.02) and q["loss"] != dense["loss"]


@pytest.mark.torch
def test_moe_workload_peft_row():
    """With torch among the peers, PEFT's row (target_parameters on transformers' Qwen3-MoE) trains
    the same-shaped stack: a finite loss near krnl's (random weights on both sides: about ln V)."""
    peft, transformers = pytest.importorskip("peft"), pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5 or tuple(map(int, peft.__version__.split(".")[:2])) < (0, 17):
        pytest.skip(f"transformers {transformers.__version__} / PEFT {peft.__version__}: fused experts and "
                    "target_parameters need transformers 5 and PEFT 0.17")
    s = Session("cpu", rounds=1, quick=True, peers=["torch"], log=lambda m: None)
    s.run_model("moe")
    rows = {r["impl"].split(" (")[0]: r for r in s.rows}
    assert rows["PEFT bf16"]["tokens_per_s"] > 0
    assert rows["PEFT bf16"]["loss"] == pytest.approx(rows["krnl f32"]["loss"], rel=0.05)


def test_bad_arguments_are_named(capsys):
    with pytest.raises(ValueError, match="--rounds"):
        Session("cpu", rounds=0)
    with pytest.raises(ValueError, match="--peers: unknown"):
        Session("cpu", peers=["jax"])
    with pytest.raises(SystemExit):
        bench_main(["--workloads", "w1,w9"])
    assert "--workloads: unknown ['w9']" in capsys.readouterr().err


# ---- reports


def _result(trusted):
    rows = [
        {"workload": "w1", "title": "W1 MLP block (tiny)", "impl": "krnl", "status": "ok", "reason": None,
         "ms": 10.0, "tokens_per_s": 6400.0, "gflops": 50.0, "of_sgemm": 0.5, "vs_krnl": 1.0, "samples": 3, "note": ""},
        {"workload": "w1", "title": "W1 MLP block (tiny)", "impl": "mlx", "status": "ok", "reason": None,
         "ms": 20.0, "tokens_per_s": 3200.0, "gflops": 25.0, "of_sgemm": 0.25, "vs_krnl": 0.5, "samples": 3,
         "note": "Linux CPU wheel: bundled reference BLAS, slow"},
        {"workload": "w1", "title": "W1 MLP block (tiny)", "impl": "torch", "status": "absent",
         "reason": "not installed (No module named 'torch')"},
        {"workload": "gemm nn 256^3", "impl": "krnl", "status": "ok", "reason": None, "ms": 1.0,
         "tokens_per_s": None, "gflops": 33.5, "of_sgemm": 1.0, "vs_krnl": None, "samples": 3, "note": ""},
    ]
    v = gate.verdict(100.0, 101.0 if trusted else 70.0, None, 256)
    return {"krnl_version": "0.1.0", "date": "2026-11-29 10:00 UTC", "seconds": 1.0,
            "machine": {"cpu": "Test CPU", "cores": 2, "threads": 2, "device": "cpu"}, "device": "cpu", "kind": "cpu",
            "threads": 2,
            "rounds": 3, "quick": True, "workloads": ["w1", "gemm"], "sgemm": {"n": 256, "gflops": 100.0},
            "trusted": v["trusted"], "untrusted_reasons": v["reasons"], "gate": v, "reference_file": "x",
            "rows": rows, "profile": None}


def test_table_marks_every_figure_when_untrusted():
    good, bad = report.format_table(_result(True)), report.format_table(_result(False))
    assert "UNTRUSTED" not in good and "gate: TRUSTED" in good
    assert "not installed (No module named 'torch')" in good and "reference BLAS" in good
    figure_lines = [l for l in bad.splitlines() if re.search(r"\s(krnl|mlx)\s+\d", l)]
    assert len(figure_lines) == 3 and all("UNTRUSTED" in l for l in figure_lines)
    assert "moved 30%" in bad and "spread" in good


def test_json_and_png_round_trip(tmp_path):
    res = _result(False)
    report.write_json(res, tmp_path / "r.json")
    back = report.read_json(tmp_path / "r.json")
    assert back == json.loads(json.dumps(res)) and back["trusted"] is False
    report.write_png(back, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a krnl bench result"):
        report.read_json(tmp_path / "other.json")


def test_readme_block_replaced_and_nothing_else(tmp_path):
    readme = tmp_path / "README.md"
    before, after = "# krnl\n\n## Performance\n\nHand-written text.\n\n", "\n\n## Layout\n\nmore\n"
    start, end = report.markers("cpu")
    cuda_block = "\n".join(report.markers("cuda")) + "\n"  # another device kind's block: left alone
    readme.write_text(before + start + "\nold figures\n" + end + after + cuda_block)
    report.replace_readme_block(readme, report.readme_block(_result(False)), "cpu")
    text = readme.read_text()
    assert text.startswith(before) and text.endswith(after + cuda_block) and "old figures" not in text
    block = text[len(before):-len(after + cuda_block)]
    assert block.startswith(start) and block.endswith(end)
    assert "**UNTRUSTED**" in block and "| w1 |" not in block and "W1 MLP block (tiny) | mlx | 20.0 |" in block
    report.replace_readme_block(readme, report.readme_block(_result(True)), "cpu")  # again: still one block
    assert readme.read_text().count(start) == 1 and "UNTRUSTED" not in readme.read_text()
    assert readme.read_text().endswith(cuda_block)
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="plain.md must hold exactly one"):
        report.replace_readme_block(tmp_path / "plain.md", "x", "cpu")


def test_result_kind_is_the_recorded_kind():
    """A session records its device's kind; the README block is that kind's whatever the device's
    name. Results from before the kind was recorded ran on "cpu" or "cuda", named by their kind."""
    res = _result(True)
    assert report.result_kind({**res, "device": "cpu:1"}) == "cpu"
    assert report.readme_block({**res, "device": "cpu:1"}).startswith(report.markers("cpu")[0])
    old = {k: v for k, v in res.items() if k != "kind"}
    assert report.result_kind({**old, "device": "cuda"}) == "cuda"


# ---- end to end


def test_krnl_bench_quick_end_to_end(tmp_path, reference, capsys, monkeypatch):
    readme = tmp_path / "README.md"
    start, end = report.markers("cpu")
    readme.write_text(f"# x\n\n## Performance\n\n{start}\n{end}\n")
    # --calibrate with a steady control stores the reference (exit 0); a control that moves
    # between its two measurements stores nothing and says why (exit 1). Steady and moving are
    # made here: a real machine's control may do either.
    calibrate = gate.calibrate
    rates = iter([100.0, 60.0])
    monkeypatch.setattr(gate, "calibrate", lambda *a, **k: calibrate(*a, **k, measure=lambda dev, n: next(rates)))
    assert krnl_main(["bench", "--calibrate", "--quick"]) == 1
    assert "the machine is busy, nothing stored" in capsys.readouterr().err and not reference.exists()
    monkeypatch.setattr(gate, "calibrate", lambda *a, **k: calibrate(*a, **k, measure=lambda dev, n: 100.0))
    assert krnl_main(["bench", "--calibrate", "--quick"]) == 0
    capsys.readouterr()
    assert reference.exists() and '"gflops": 100.0' in reference.read_text()
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    # on the CPU device, where W3 (sized for a GPU) must be listed as skipped, on any machine
    rc = krnl_main(["bench", "--quick", "--device", "cpu", "--rounds", "2", "--peers", "numpy",
                    "--workloads", "w1,w2,w3,gemm,lora", "--json", str(out_json), "--png", str(out_png), "--readme", str(readme), "--profile"])
    captured = capsys.readouterr()
    out = captured.out
    res = json.loads(out_json.read_text())
    assert rc == (0 if res["trusted"] else 2)  # 2: the gate failed; the table says so, and stderr
    assert res["trusted"] or "control gate failed" in captured.err
    assert isinstance(res["trusted"], bool) and res["gate"]["control_n"] == 256
    got = {(r["workload"], r["impl"]): r["status"] for r in res["rows"]}
    assert got[("w1", "krnl")] == got[("w1", "numpy")] == got[("w2", "numpy")] == "ok"
    assert got[("w3", "all")] == "skipped" and got[("gemm tn 256^3", "krnl")] == "ok"
    lora = [r for r in res["rows"] if r["workload"].startswith("lora ")]
    assert len(lora) == 10 and all(0 < r["of_bound"] and r["bytes"] > 0 for r in lora)
    assert "of its bandwidth bound" in lora[0]["note"]
    for peer in ("torch", "torch.compile", "compile+cudagraphs", "mlx", "mx.compile"):  # listed, not dropped
        assert got[("w1", peer)] == "absent"
    assert ("w1", "krnl graph") not in got  # the CPU's capabilities: no graphs
    assert res["kind"] == "cpu"  # the README block is the device kind's (report.result_kind)
    assert "gate:" in out and "w3" in out and "per-op profile of one W2 step" in out
    assert res["profile"]["rows"] and res["profile"]["rows"][0]["op"]
    assert out_png.read_bytes()[:4] == b"\x89PNG" and start in readme.read_text()
    assert "| numpy |" in readme.read_text()
    # --from-json: the report again without running anything
    assert krnl_main(["bench", "--from-json", str(out_json)]) == 0
    assert "gate:" in capsys.readouterr().out


# ---- the train workload (bench/train.py): `krnl train` end to end


@pytest.fixture(scope="module")
def train_folder(tmp_path_factory):
    from krnl.bench import train
    return train.write_folder(train.shape("quick"), tmp_path_factory.mktemp("train") / "model")


def test_train_workload_loss_is_the_trainers(train_folder, tmp_path):
    """The workload's krnl figures come from krnl's Trainer itself: its losses equal those of a
    plain Trainer run (ids/targets arrays, run to the end) on the same folder and batch, and the
    timing stops before the run's end-of-run files without changing a value."""
    from krnl.bench import train
    from krnl.models.config import LoraConfig
    from krnl.formats.hf import load_model
    from krnl.train.trainer import TrainConfig, Trainer
    dev = krnl.device("cpu")
    s = train.shape("quick", steps=2, warmup=1)
    b = train.batches(s)[0]
    got = train.run_krnl(dev, "f32", train_folder, s, [b] * 3)
    model = load_model(str(train_folder), dev, lora=LoraConfig(r=16, alpha=32.0), dtype="f32", seed=0)
    cfg = TrainConfig(iters=3, batch_size=s["B"], learning_rate=1e-4, warmup=0, schedule="constant",
                      max_grad_norm=1.0, val_every=0, save_every=0)
    tr = Trainer(model, cfg, (b.ids, b.targets), out_dir=tmp_path / "run", progress=False)
    summary = tr.run()
    assert got["losses"] == [loss for _, loss in tr.history] and got["loss"] == summary["loss"]
    assert got["losses"][2] < got["losses"][0]  # the same batch three times: training lowers its loss
    assert got["samples"] == 2 and got["tokens"] == 2 * s["B"] * s["T"] and got["peak_bytes"] > 0
    assert np.isfinite(got["tokens_per_s"]) and got["tokens_per_s"] > 0 and got["warmup_s"] > 0
    assert abs(got["first_loss"] - np.log(s["V"])) < 0.1  # small random weights: near uniform


def test_train_tokens_exclude_padding():
    """tokens = input tokens that are not padding, the one definition every row is measured by;
    the targets predict the next real token only."""
    from krnl.bench import train
    s = train.shape("quick")
    full, padded = train.batches(s), train.batches(s, pad=True)
    for b in padded:
        real = np.arange(s["T"])[None, :] < b.lengths[:, None]
        assert b.tokens == int(real.sum()) < s["B"] * s["T"] and (b.ids[~real] == train.PAD_ID).all()
        assert (b.ids[real] != train.PAD_ID).all()
        assert ((b.targets != -100).sum(1) == b.lengths - 1).all()
        i, j = np.nonzero(b.targets != -100)
        assert (b.targets[i, j] == b.ids[i, j + 1]).all()
    assert all(b.tokens == s["B"] * s["T"] for b in full)
    rows = train.run(krnl.device("cpu"), "f32", s, log=lambda m: None, bs=padded)
    k = rows[0]
    assert k["impl"] == "krnl" and k["tokens"] == sum(b.tokens for b in padded[s["warmup"]:])
    assert k["tokens_per_s"] == pytest.approx(k["tokens"] / (k["ms"] * k["samples"] / 1e3))
    assert k["peak_bytes"] is None  # the CPU: no figure rather than a wrong one
    assert "gpu" not in k and "timed_window" not in k  # no GPU meter here, and the window stays internal
    assert [(r["impl"], r["status"]) for r in rows[1:]] == [
        ("PEFT eager", "absent"), ("PEFT torch.compile", "absent"), ("mlx-lm", "absent"), ("PEFT+Liger", "absent"),
        ("Unsloth", "absent"), ("Unsloth ckpt off", "absent")]
    assert all(r["reason"] == "not selected (--peers)" for r in rows[1:])


@pytest.mark.torch
def test_train_peft_first_loss_matches_krnl(train_folder):
    """transformers + PEFT on the same folder and batches in f32: the first step's loss (LoRA B = 0,
    the base model's) equals krnl's to 1e-4."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from krnl.bench import train
    s = train.shape("quick", steps=1, warmup=1)
    bs = train.batches(s, pad=True)
    rows = {r["impl"]: r for r in train.run(krnl.device("cpu"), "f32", s, peers=["torch"], log=lambda m: None,
                                             folder=train_folder, bs=bs)}
    k, t = rows["krnl"], rows["PEFT eager"]
    assert t.get("status", "ok") == "ok", t.get("reason")
    assert abs(t["first_loss"] - k["first_loss"]) <= 1e-4 * abs(k["first_loss"]), (k["first_loss"], t["first_loss"])
    assert t["tokens"] == k["tokens"] and t["vs_krnl"] == pytest.approx(t["tokens_per_s"] / k["tokens_per_s"])


def test_krnl_bench_train_rows_reach_json_table_and_docs(tmp_path, capsys):
    readme = tmp_path / "performance.md"
    start, end = report.markers("cpu")
    readme.write_text(f"# x\n\n{start}\n{end}\n")
    out_json = tmp_path / "t.json"
    rc = bench_main(["--quick", "--device", "cpu", "--rounds", "1", "--peers", "numpy", "--workloads", "train",
                     "--train-seq", "17", "--train-steps", "2", "--json", str(out_json), "--readme", str(readme)])
    out = capsys.readouterr().out
    res = json.loads(out_json.read_text())
    assert rc == (0 if res["trusted"] else 2)
    rows = {r["impl"]: r for r in res["rows"] if r["workload"] == "train"}
    k = rows["krnl"]
    assert k["status"] == "ok" and k["samples"] == 2 and k["tokens"] == 2 * 2 * 17 and "T=17" in k["title"]
    assert np.isfinite(k["loss"]) and k["tokens_per_s"] > 0 and k["vs_krnl"] == 1.0
    assert rows["PEFT eager"]["status"] == "absent" and rows["mlx-lm"]["status"] == "absent"
    assert "Training end to end" in out and f"loss {k['loss']:.4f}" in out and "not selected (--peers)" in out
    block = readme.read_text()
    assert "| krnl |" in block and f"loss {k['loss']:.4f}" in block and "| PEFT eager |" in block


def test_gpu_power_window_takes_whole_counter_periods():
    """The window's power comes from the energy counter's moves inside it: a counter that steps
    every 0.1 s under a constant 500 W gives 500 W whatever the window's edges, the clock is the
    median of the samples inside and the cap share counts them."""
    from krnl.bench.gpu_power import Reading, window
    rs = []
    for i in range(200):  # a sample every 10 ms; the counter moves by 50 J at each 0.1 s
        t = 1.0 + 0.01 * i
        rs.append(Reading(t, 1500 + (i % 3) * 100, 10**6 + 50_000 * (i // 10), i % 4 == 0))
    w = window(rs, [(1.034, 2.456)])
    assert w["watts"] == pytest.approx(500.0, rel=1e-9)
    inside = [r for r in rs if 1.034 <= r.t <= 2.456]
    assert w["samples"] == len(inside) and w["sm_mhz"] == 1600
    assert w["capped"] == pytest.approx(sum(r.capped for r in inside) / len(inside))
    assert window(rs, [(1.031, 1.095)])["watts"] is None  # fewer than two moves: no power figure
    assert window(rs, [(5.0, 6.0)]) is None
    # several spans: their samples together, the power over the periods inside each
    spans = [(1.095, 1.305), (1.695, 1.905), (2.505, 2.595)]
    several = window(rs, spans)
    assert several["watts"] == pytest.approx(500.0, rel=1e-9) and several["samples"] == 21 + 21 + 9


def test_interleave_records_each_runs_span():
    """interleave's spans, which time the rounds and window the GPU meter, are each run's own: in
    round order, alternating between the implementations, each at least as long as its run."""
    import time
    from krnl.bench.session import interleave
    spans = interleave({"a": lambda: time.sleep(0.002), "b": lambda: time.sleep(0.004)}, 3, 0.0)
    assert [len(spans[k]) for k in "ab"] == [3, 3]
    for k in "ab":
        assert min(b - a for a, b in spans[k]) >= (0.002 if k == "a" else 0.004)
    order = sorted((a, k) for k in "ab" for a, _ in spans[k])
    assert [k for _, k in order] == list("ababab")


def test_gpu_power_meter_and_train_rows():
    """A Meter samples its reader in a thread until stopped; power_figures turns a window into
    joules a step and tokens a joule; on the CPU no meter is made (its train rows carry no "gpu":
    test_train_tokens_exclude_padding)."""
    import time
    from krnl.bench import gpu_power, train
    n = {"calls": 0}

    def read():
        n["calls"] += 1
        return gpu_power.Reading(time.perf_counter(), 1000, 400 * n["calls"], False)

    m = gpu_power.Meter(read, period=0.001).start()
    time.sleep(0.05)
    m.stop()
    calls = n["calls"]
    time.sleep(0.01)
    assert calls >= 5 and n["calls"] == calls == len(m.readings)
    g = train.power_figures({"sm_mhz": 1500, "capped": 0.5, "watts": 400.0, "samples": 9},
                            {"ms": 250.0, "tokens_per_s": 8000.0})
    assert g["joules_per_step"] == pytest.approx(100.0) and g["tokens_per_joule"] == pytest.approx(20.0)
    assert gpu_power.describe(g) == "SM 1500 MHz, 400 W, 100.0 J a step, power cap 50% of 9 samples"
    assert gpu_power.describe(dict(g, watts=None, joules_per_step=None)) == "SM 1500 MHz, power cap 50% of 9 samples"
    assert gpu_power.meter_for(krnl.device("cpu")) == (None, "no NVML GPU behind a cpu device")
    with gpu_power.metered(krnl.device("cpu")) as (meter, why):
        assert meter is None and why == "no NVML GPU behind a cpu device"
    with gpu_power.metered(krnl.device("cpu"), on=False) as (meter, why):
        assert meter is None and why is None


def test_train_workload_sizes_and_errors(capsys):
    from krnl.bench import train
    rows = train.session_rows(Session("cpu", rounds=1, quick=False, peers=["numpy"], log=lambda m: None), {})
    assert [(r["impl"], r["status"]) for r in rows] == [("krnl", "skipped")]
    assert "1b shape is sized for a GPU" in rows[0]["reason"]
    assert train.shape("8b", layers=2)["layers"] == 2 and train.shape("8b")["T"] == 4096
    with pytest.raises(ValueError, match=r"--train-steps must be an integer >= 1, got 0"):
        train.shape("1b", steps=0)
    with pytest.raises(ValueError, match=r"--train-seq must be >= 2"):
        train.shape("quick", seq=1)
    with pytest.raises(SystemExit):
        bench_main(["--workloads", "train", "--train-shape", "9b"])
    assert "--train-shape" in capsys.readouterr().err


@pytest.mark.mlx
def test_train_mlx_lm_first_loss_matches_krnl():
    """mlx-lm's trainer on the same folder and padded batches in f32: default_loss's length mask
    scores the positions krnl's targets score, so the first losses agree to 1e-4."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from krnl.bench import train
    from krnl.bench.targets import Unavailable
    from krnl.bench.train_peers import mlx_lengths
    s = train.shape("quick", layers=1, steps=1, warmup=1)
    bs = train.batches(s, pad=True)
    assert (mlx_lengths(bs[0])[:, 1] == bs[0].lengths - 1).all()
    bad = train.Batch(bs[0].ids, bs[0].lengths)
    bad.targets = bad.targets.copy()
    bad.targets[0, 0] = (bad.targets[0, 0] + 1) % s["V"]  # not the next id: no length mask says this
    with pytest.raises(Unavailable, match="not the ids shifted"):
        mlx_lengths(bad)
    with tempfile.TemporaryDirectory() as tmp:
        folder = train.write_folder(s, Path(tmp) / "model")
        rows = {r["impl"]: r for r in train.run(krnl.device("cpu"), "f32", s, peers=["mlx"], log=lambda m: None,
                                                 folder=folder, bs=bs)}
    k, m = rows["krnl"], rows["mlx-lm"]
    assert m.get("status", "ok") == "ok", m.get("reason")
    assert abs(m["first_loss"] - k["first_loss"]) <= 1e-4 * abs(k["first_loss"]), (k["first_loss"], m["first_loss"])
