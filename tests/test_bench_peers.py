"""The train workload's long rows (krnl/bench/train_long.py) and its fast peers, Liger and Unsloth
(krnl/bench/fast_peers.py, each row in a process of its own through fast_worker.py). Neither
library runs on this CPU (Triton GPU kernels), so their rows must say why; stand-ins written here,
with the libraries' entry points made of transformers + PEFT, drive the worker end to end. No
timed assertions: what runs, with which settings, and the losses it gives."""

import json
import os
import sys
import textwrap

import numpy as np
import pytest

import krnl
from krnl.bench import fast_peers, report, train, train_long
from krnl.bench.cli import main as bench_main
from krnl.bench.session import Session


@pytest.fixture(autouse=True)
def reference(tmp_path, monkeypatch):
    """Every test gets its own reference file: the user's ~/.cache is never read or written."""
    monkeypatch.setenv("KRNL_BENCH_REFERENCE", str(tmp_path / "ref" / "bench_reference.json"))


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return train.write_folder(train.shape("quick"), tmp_path_factory.mktemp("peers") / "model")


# ---- the long rows


def test_long_shapes_and_where_they_run():
    """The 8b shape at 16k and 32k tokens a row, batch 1, checkpointed; --train-seq one length,
    the other --train-* options as for train; on the CPU only --quick runs (tiny, short)."""
    full = train_long.shapes(False)
    assert [(s["T"], s["B"], s["C"], s["F"], s["layers"], s["ckpt"]) for s in full] == [
        (16384, 1, 4096, 14336, 8, True), (32768, 1, 4096, 14336, 8, True)]
    one = train_long.shapes(False, {"seq": 8192, "layers": 2, "steps": 3, "shape": "1b", "gpus": 2, "batch": None})
    assert [(s["T"], s["layers"], s["steps"], s["B"]) for s in one] == [(8192, 2, 3, 1)]
    assert all(s["C"] == 64 and s["ckpt"] for s in train_long.shapes(True))
    rows = train_long.session_rows(Session("cpu", rounds=1, quick=False, peers=["numpy"], log=quiet), {})
    assert [(r["impl"], r["status"]) for r in rows] == [("krnl", "skipped")] and "sized for a GPU" in rows[0]["reason"]
    assert "gradient checkpointing" in train.describe(full[0]) and "checkpointing" not in train.describe(train.shape("8b"))


def test_long_quick_rows_and_checkpointing_changes_no_value(folder):
    """--quick: a row group per length, krnl checkpointed; recomputing the layers in the backward
    gives the losses of the run that keeps them; the fast peers not asked for are listed."""
    s = train_long.session_rows(Session("cpu", rounds=1, quick=True, peers=["numpy"], log=quiet), {})
    by = {}
    for r in s:
        by.setdefault(r["workload"], {})[r["impl"]] = r
    assert list(by) == [f"long {T}" for T in train_long.SEQS["quick"]]
    for wl, rows in by.items():
        k = rows["krnl"]
        assert k.get("status", "ok") == "ok" and k["tokens_per_s"] > 0 and k["title"].startswith("Long-context training")
        assert "gradient checkpointing" in k["title"] and f"T={wl.split()[1]}" in k["title"]
        assert abs(k["first_loss"] - np.log(257)) < 0.1
        for impl in ("PEFT+Liger", "Unsloth", "Unsloth ckpt on"):
            assert rows[impl]["status"] == "absent" and rows[impl]["reason"] == "not selected (--peers)"
    dev = krnl.device("cpu")
    sh = train.shape("quick", steps=2, warmup=1)
    bs = train.batches(sh, pad=True)
    plain = train.run_krnl(dev, "f32", folder, sh, bs)
    ckpt = train.run_krnl(dev, "f32", folder, dict(sh, ckpt=True), bs)
    assert ckpt["losses"] == plain["losses"] and plain["losses"][-1] < plain["losses"][0]


def test_krnl_bench_long_reaches_json_table_and_docs(tmp_path, capsys):
    readme = tmp_path / "performance.md"
    start, end = report.markers("cpu")
    readme.write_text(f"# x\n\n{start}\n{end}\n")
    out_json = tmp_path / "long.json"
    rc = bench_main(["--quick", "--device", "cpu", "--rounds", "1", "--peers", "numpy", "--workloads", "long",
                     "--train-steps", "1", "--json", str(out_json), "--readme", str(readme)])
    out = capsys.readouterr().out
    res = json.loads(out_json.read_text())
    assert rc == (0 if res["trusted"] else 2)  # 2: the gate failed, and the table says so
    assert res["trusted"] or "UNTRUSTED" in out
    rows = {(r["workload"], r["impl"]): r for r in res["rows"]}
    for T in train_long.SEQS["quick"]:
        k = rows[(f"long {T}", "krnl")]
        assert k["status"] == "ok" and k["samples"] == 1 and k["tokens"] == T and k["vs_krnl"] == 1.0
        assert rows[(f"long {T}", "Unsloth")]["status"] == "absent"
    assert "Long-context training end to end" in out and "gate:" in out
    block = readme.read_text()
    assert "Long-context training end to end" in block and "| PEFT+Liger |" in block


@pytest.mark.torch
def test_long_peft_row_is_checkpointed_and_trains_as_krnl(folder):
    """PEFT eager on a long shape checkpoints its layers (gradient_checkpointing_enable) and its
    losses follow krnl's step for step (f32, same batches and recipe)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from krnl.bench.train_peers import peft_model
    for ckpt in (False, True):
        model, params, _ = peft_model(torch, folder, torch.float32, "cpu", ckpt=ckpt)
        assert model.base_model.model.is_gradient_checkpointing == ckpt and len(params) == 2 * 7 * 2
    s = dict(train.shape("quick", seq=40, batch=1, steps=2, warmup=1), ckpt=True)
    rows = {r["impl"]: r for r in train.run(krnl.device("cpu"), "f32", s, peers=["torch"], log=quiet, folder=folder)}
    k, t = rows["krnl"], rows["PEFT eager"]
    assert t.get("status", "ok") == "ok", t.get("reason")
    assert t["losses"] == pytest.approx(k["losses"], rel=1e-4)


# ---- the fast peers: Liger and Unsloth


LIGER = '''
import json, os


def _record(**kw):
    with open(os.environ["KRNL_TEST_PEER_RECORD"], "a") as f:
        f.write(json.dumps(kw) + "\\n")


def apply_liger_kernel_to_llama(**kw):
    """Liger's stand-in: records the call and swaps modeling_llama's MLP class for one that records
    each instance, as Liger swaps in its SwiGLU class: only a model made after the call has them."""
    from transformers.models.llama import modeling_llama

    class RecordedMLP(modeling_llama.LlamaMLP):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            _record(event="mlp")

    modeling_llama.LlamaMLP = RecordedMLP
    _record(event="apply", kwargs=kw)
'''

UNSLOTH = '''
import json, os


def _record(**kw):
    with open(os.environ["KRNL_TEST_PEER_RECORD"], "a") as f:
        f.write(json.dumps(kw) + "\\n")


class FastLanguageModel:
    """Unsloth's stand-in: records its arguments; the model is transformers' with PEFT's LoRA."""

    @staticmethod
    def from_pretrained(model_name, dtype=None, **kw):
        import transformers
        tok = transformers.AutoTokenizer.from_pretrained(model_name)
        _record(event="from_pretrained", dtype=str(dtype), vocab=len(tok), pad=tok.pad_token_id, **kw)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype)
        model.config.use_cache = False
        return model, tok

    @staticmethod
    def get_peft_model(model, r, lora_alpha, lora_dropout, target_modules, use_gradient_checkpointing, **kw):
        from peft import LoraConfig, get_peft_model
        _record(event="get_peft_model", r=r, lora_alpha=lora_alpha, target_modules=target_modules,
                use_gradient_checkpointing=use_gradient_checkpointing, **kw)
        for p in model.parameters():
            p.requires_grad_(False)
        if use_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                                target_modules=target_modules))

    @staticmethod
    def for_training(model):
        model.train()
'''


def stand_in(root, package, files, dist, version="9.9.9"):
    """A package on `root` (files: relative path -> text) with its dist-info (the version)."""
    for rel, text in files.items():
        p = root / package / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


@pytest.fixture
def peers_here(tmp_path, monkeypatch):
    """(site folder on this process's and the workers' path, the record file, records()): the
    stand-ins go in the folder; the CPU is allowed as a device for both."""
    site, record = tmp_path / "site", tmp_path / "record.jsonl"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(x for x in (str(site), os.environ.get("PYTHONPATH")) if x))
    monkeypatch.setenv("KRNL_TEST_PEER_RECORD", str(record))
    monkeypatch.setattr(fast_peers, "KINDS", {"liger": ("cpu", "cuda"), "unsloth": ("cpu", "cuda")})

    def records():
        return [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []

    return site, records


def test_fast_peers_say_why_they_do_not_run(tmp_path, monkeypatch):
    """Not selected, not installed (no import: importing Unsloth patches transformers), or
    installed on a device that is not CUDA: a row each, with the reason and the version."""
    bs = train.batches(train.shape("quick"))
    monkeypatch.setitem(fast_peers.PACKAGES, "unsloth", ("krnl_no_such_module", "unsloth"))
    stand_in(tmp_path, "liger_kernel", {"__init__.py": "", "transformers.py": "raise SystemExit('imported')"},
             "liger-kernel", "9.9.9")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = {r["impl"]: r for r in fast_peers.run_all("cpu", "f32", "unused", train.shape("quick"), bs,
                                                      ["liger", "unsloth"], quiet)}
    assert list(rows) == ["PEFT+Liger", "Unsloth", "Unsloth ckpt off"] and all(r["status"] == "absent" for r in rows.values())
    assert rows["PEFT+Liger"]["reason"] == ("liger-kernel 9.9.9: Liger's kernels are Triton GPU kernels, CUDA devices "
                                            "only (this run: cpu)")
    assert rows["Unsloth"]["reason"] == "not installed (no module 'krnl_no_such_module'); pip install unsloth"
    assert "liger_kernel.transformers" not in sys.modules
    rows = fast_peers.run_all("cpu", "f32", "unused", dict(train.shape("quick"), ckpt=True), bs, ["torch"], quiet)
    assert [(r["impl"], r["reason"]) for r in rows] == [(i, "not selected (--peers)") for i in
                                                       ("PEFT+Liger", "Unsloth", "Unsloth ckpt on")]
    assert fast_peers.qlora_rows("cpu", {}, [], ["torch"], quiet) == []  # qlora lists only the peers asked for


def test_a_peer_that_cannot_import_is_a_row_with_the_reason(peers_here):
    """What stops the import in the worker (Triton missing, no GPU) comes back as the row's reason."""
    site, records = peers_here
    stand_in(site, "liger_kernel", {"__init__.py": "", "transformers.py": "raise ImportError(\"No module named 'triton'\")"},
             "liger-kernel", "9.9.9")
    s = train.shape("quick")
    (row,) = [r for r in fast_peers.run_all("cpu", "f32", "unused", s, train.batches(s), ["liger"], quiet)
              if r["impl"] == "PEFT+Liger"]
    assert row["status"] == "absent"
    assert row["reason"] == ("liger-kernel 9.9.9: cannot import liger_kernel.transformers: ImportError: "
                             "No module named 'triton'")


@pytest.mark.torch
def test_liger_row_patches_before_the_model_in_its_own_process(peers_here, folder):
    """The Liger row: apply_liger_kernel_to_llama() with its defaults, before the model is made
    (every layer's MLP is the patched class), in a worker process (this one never imports it);
    the loss is the model's own on labels, equal to krnl's on the same padded batches at the start."""
    pytest.importorskip("peft")
    site, records = peers_here
    stand_in(site, "liger_kernel", {"__init__.py": "", "transformers.py": LIGER}, "liger-kernel", "9.9.9")
    s = train.shape("quick", steps=1, warmup=1)
    rows = {r["impl"]: r for r in train.run(krnl.device("cpu"), "f32", s, peers=["liger"], log=quiet, folder=folder,
                                             bs=train.batches(s, pad=True))}
    k, lg = rows["krnl"], rows["PEFT+Liger"]
    assert lg.get("status", "ok") == "ok", lg.get("reason")
    assert abs(lg["first_loss"] - k["first_loss"]) <= 1e-4 * k["first_loss"]
    assert lg["version"] == "9.9.9" and "liger-kernel 9.9.9; apply_liger_kernel_to_llama() (RoPE" in lg["note"]
    assert lg["vs_krnl"] == pytest.approx(lg["tokens_per_s"] / k["tokens_per_s"])
    assert records() == [{"event": "apply", "kwargs": {}}] + [{"event": "mlp"}] * s["layers"]
    assert "liger_kernel" not in sys.modules


@pytest.mark.torch
def test_unsloth_rows_its_checkpointing_and_like_for_like(peers_here, folder):
    """Two Unsloth rows per shape: use_gradient_checkpointing "unsloth" (its docs' choice) and,
    like for like, the workload's own (off on train, on for the long rows); the recipe's rank,
    alpha and projections in 16-bit LoRA; a tokenizer of the model's ids beside the weights."""
    pytest.importorskip("peft")
    site, records = peers_here
    stand_in(site, "unsloth", {"__init__.py": UNSLOTH}, "unsloth", "2026.1.1")
    s = train.shape("quick", steps=1, warmup=1)
    bs = train.batches(s, pad=True)
    for ckpt in (False, True):
        rows = {r["impl"]: r for r in train.run(krnl.device("cpu"), "f32", dict(s, ckpt=ckpt), peers=["unsloth"],
                                                 log=quiet, folder=folder, bs=bs)}
        k = rows["krnl"]
        for impl, mode in (("Unsloth", "unsloth"), (f"Unsloth ckpt {'on' if ckpt else 'off'}", ckpt)):
            u = rows[impl]
            assert u.get("status", "ok") == "ok", u.get("reason")
            assert abs(u["first_loss"] - k["first_loss"]) <= 1e-4 * k["first_loss"]
            assert f"unsloth 2026.1.1; use_gradient_checkpointing={mode!r}" in u["note"]
    rec = records()
    loads = [r for r in rec if r["event"] == "from_pretrained"]
    lora = [r for r in rec if r["event"] == "get_peft_model"]
    assert [r["use_gradient_checkpointing"] for r in lora] == ["unsloth", False, "unsloth", True]
    assert all(r["r"] == 16 and r["lora_alpha"] == 32 and len(r["target_modules"]) == 7 for r in lora)
    assert all(r["load_in_16bit"] and not r["load_in_4bit"] and r["vocab"] == s["V"] and r["pad"] == 0
               and r["max_seq_length"] == s["T"] and r["dtype"] == "torch.float32" for r in loads)


@pytest.mark.torch
def test_qlora_fast_peer_rows(peers_here):
    """qlora with --peers liger,unsloth: their rows after krnl's two (no PEFT row: not asked for),
    relative to krnl's; the notes say which base each trained on (Unsloth's 4-bit load is CUDA's)."""
    pytest.importorskip("peft")
    site, records = peers_here
    stand_in(site, "liger_kernel", {"__init__.py": "", "transformers.py": LIGER}, "liger-kernel", "9.9.9")
    stand_in(site, "unsloth", {"__init__.py": UNSLOTH}, "unsloth", "2026.1.1")
    s = Session("cpu", rounds=1, quick=True, peers=["liger", "unsloth"], log=quiet)
    s.run_model("qlora")
    rows = {r["impl"]: r for r in s.rows}
    assert list(rows) == ["krnl", "krnl grad-ckpt", "PEFT+Liger", "Unsloth", "Unsloth ckpt off"]
    for impl in ("PEFT+Liger", "Unsloth", "Unsloth ckpt off"):
        r = rows[impl]
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and np.isfinite(r["loss"]) and r["vs_krnl"] > 0
    # Liger's base is PEFT's (qlora.peft_model): NF4 where bitsandbytes runs here (CI's torch stage), else bf16
    assert any(b in rows["PEFT+Liger"]["note"] for b in ("PEFT bnb-nf4", "PEFT bf16 base"))
    assert "a bf16 base" in rows["Unsloth"]["note"]
    loads = [r for r in records() if r["event"] == "from_pretrained"]
    assert len(loads) == 2 and all(not r["load_in_4bit"] and r["dtype"] == "torch.bfloat16" for r in loads)
