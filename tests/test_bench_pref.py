"""krnl bench's preference workloads (bench/dpo.py, bench/grpo.py) at their quick sizes: the rows
they add, finite losses, generations of exactly the tokens asked for, and with torch, PEFT and TRL
installed the peers' rows (TRL's DPOTrainer and GRPOTrainer, transformers' generate). No timed
assertions."""

import math

import numpy as np
import pytest

import krnl
from krnl.bench import dpo, grpo, pref
from krnl.bench.session import Session


@pytest.fixture(autouse=True)
def reference(tmp_path, monkeypatch):
    monkeypatch.setenv("KRNL_BENCH_REFERENCE", str(tmp_path / "ref" / "bench_reference.json"))


def rows_of(name, peers=("numpy",)):
    s = Session("cpu", rounds=1, quick=True, peers=list(peers), log=lambda m: None)
    s.run_model(name)
    return {r["impl"]: r for r in s.rows}


@pytest.mark.parametrize("name", ["dpo", "grpo"])
def test_full_size_is_skipped_on_cpu(name):
    s = Session("cpu", rounds=1, quick=False, peers=["numpy"], log=lambda m: None)
    s.run_model(name)
    assert [(r["impl"], r["status"]) for r in s.rows] == [("krnl", "skipped")]
    assert "1b shape" in s.rows[0]["reason"]


def test_dpo_quick_krnl_row():
    rows = rows_of("dpo")
    assert list(rows) == ["krnl"]
    k = rows["krnl"]
    assert k["status"] == "ok" and k["tokens_per_s"] > 0 and k["title"].startswith("DPO sigmoid beta 0.1")
    # the adapter starts at B = 0 (policy = reference): DPO's loss is ln 2, and a few steps move it little
    assert k["loss"] == pytest.approx(math.log(2), abs=0.02)


def test_dpo_rows_are_pairs_chosen_first():
    s = dpo.SIZES["quick"]
    b = dpo.batches(s)[0]
    ids, tg = b.rows()
    P, Tp, Tc = s["P"], s["prompt"], s["completion"]
    assert ids.shape == (2 * P, Tp + Tc)
    assert (ids[:P, Tp:] == b.chosen).all() and (ids[P:, Tp:] == b.rejected).all() and (ids[P:, :Tp] == b.prompt).all()
    assert ((tg != -100).sum(axis=1) == Tc).all() and (tg[:, Tp - 1:-1] == ids[:, Tp:]).all()
    assert [len(e["chosen_ids"]) for e in b.examples()] == [Tc] * P


def test_grpo_quick_krnl_rows_and_token_counts():
    rows = rows_of("grpo")
    assert list(rows) == ["krnl generate", "krnl step"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["krnl generate"]["loss"] is None and np.isfinite(rows["krnl step"]["loss"])
    s = grpo.SIZES["quick"]
    prompts = pref.tokens(np.random.default_rng(0), s, s["prompts"], s["prompt"])
    _, _, (ids, tg, adv) = grpo.run_krnl(krnl.device("cpu"), s, prompts, "f32", log=lambda m: None)
    n = s["prompts"] * s["G"]
    assert ids.shape == (n, s["prompt"] + s["completion"]) and adv.shape == (n,)
    assert (ids[:, :s["prompt"]] == np.repeat(prompts, s["G"], axis=0)).all()
    assert ((tg != -100).sum(axis=1) == s["completion"]).all()


def test_grpo_check_refuses_short_or_missing_completions():
    s = grpo.SIZES["quick"]
    n, T = s["prompts"] * s["G"], s["completion"]
    grpo.check([[5] * T] * n, s, "x")
    for bad in ([[5] * T] * (n - 1), [[5] * T] * (n - 1) + [[5] * (T - 1)]):
        with pytest.raises(RuntimeError, match="expected"):
            grpo.check(bad, s, "x")


@pytest.mark.torch
def test_peer_rows_with_trl():
    """With torch among the peers: TRL's DPOTrainer row (its loss ln 2 at the start as krnl's), the
    transformers generate row and TRL's GRPO step row, each measured against its krnl row."""
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    rows = rows_of("dpo", ["torch"])
    t = rows[dpo.TRL_ROW]
    assert t["status"] == "ok", t.get("reason")
    assert t["loss"] == pytest.approx(math.log(2), abs=0.02) and t["vs_krnl"] > 0
    rows = rows_of("grpo", ["torch"])
    assert list(rows) == list(grpo.ROWS)
    for name in grpo.ROWS[2:]:
        assert rows[name]["status"] == "ok", rows[name].get("reason")
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["vs_krnl"] > 0
    assert np.isfinite(rows["TRL GRPO step"]["loss"])


def test_serve_quick_rows():
    """bench/serve.py: krnl serve at each client count, every stream of exactly the tokens asked for
    (serve.stream raises otherwise), or one row saying the serve extra is missing."""
    from krnl.bench import serve

    rows = rows_of("serve")
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        assert [r["status"] for r in rows.values()] == ["skipped"]
        return
    s = serve.SIZES["quick"]
    assert list(rows) == [f"krnl serve x{c}" for c in s["clients"]]
    for c, r in zip(s["clients"], rows.values()):
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["samples"] == c * s["requests"]
        assert "req/s" in r["note"] and "p99" in r["note"]


def test_full_fine_tuning_rows():
    """bench/full.py: krnl's row trains every weight of the layers (its loss finite, near ln V at the
    start); skipped at full size on the CPU."""
    from krnl.bench import full
    rows = rows_of("full")
    k = rows["krnl"]
    assert list(rows) == ["krnl"] and k["status"] == "ok" and k["tokens_per_s"] > 0
    assert abs(k["loss"] - math.log(257)) < 1.0 and "weights trained" in k["note"]
    s = Session("cpu", rounds=1, quick=False, peers=["numpy"], log=lambda m: None)
    s.run_model("full")
    assert s.rows[0]["status"] == "skipped" and s.rows[0]["reason"] == full.SKIP


@pytest.mark.torch
def test_full_fine_tuning_peer_rows():
    """With torch: transformers' full fine-tuning in f32 + autocast and in bf16, each measured
    against krnl's row, their losses at the start near krnl's (other random weights, one vocabulary)."""
    pytest.importorskip("peft")
    from krnl.bench import full
    rows = rows_of("full", ["torch"])
    assert list(rows) == ["krnl", *full.ROWS.values()]
    for name in full.ROWS.values():
        assert rows[name]["status"] == "ok", rows[name].get("reason")
        assert rows[name]["vs_krnl"] > 0 and abs(rows[name]["loss"] - rows["krnl"]["loss"]) < 1.0
