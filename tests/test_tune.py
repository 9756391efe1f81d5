"""GEMM tuning (krnl/bench/tune.py, `krnl tune`, `krnl train --no-tune`) with a fake timer: the shape
classes the timing covers, warm-up and median, the winner stored in and loaded from the cache,
its key, a corrupt cache ignored with one line, tuning never on metal-sim or the CPU, and train's
tuning before its first step. No timing is real: the fake timer says how long each variant takes.
metal-sim stands in for a GPU where a test says the device is tunable (its capabilities patched)."""

import collections
import json
import os

import pytest

import krnl
from krnl.bench import tune
from krnl.cli.main import main
from krnl.io.fileio import current_umask

from conftest import METAL_SIM

REAL_CAPABILITIES = krnl.Device.capabilities
needs_sim = pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is not registered")


@pytest.fixture
def sim():
    dev = krnl.device("metal-sim")
    dev.clear_gemm_choices()
    yield dev
    dev.clear_gemm_choices()


@pytest.fixture
def tunable_sim(sim, monkeypatch):
    """metal-sim claiming gemm_tuning, as a real GPU does (for this test)."""
    def fake(d):
        c = REAL_CAPABILITIES(d)
        c["gemm_tuning"] = True
        return c

    monkeypatch.setattr(krnl.Device, "capabilities", fake)
    return sim


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KRNL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / tune.CACHE_NAME


class FakeTimer:
    """timer(run, class, variant): `cost(class, variant)` seconds, but `warm` for each pair's
    first `warmup` calls (pipeline builds); run() is never called unless `runs` says so."""

    def __init__(self, cost, warmup=2, warm=100.0, runs=lambda cls, v: False):
        self.cost, self.warmup, self.warm, self.runs = cost, warmup, warm, runs
        self.calls = {}

    def __call__(self, run, cls, variant):
        n = self.calls.get((cls, variant), 0)
        self.calls[(cls, variant)] = n + 1
        if self.runs(cls, variant):
            run()
        return self.warm if n < self.warmup else self.cost(cls, variant)


def steel64_on_large(cls, v):
    """steel64 twice as fast on large classes; steel32 only 1% faster than tile32 everywhere."""
    if v == "steel64":
        return 0.5 if cls.endswith(".large") else 2.0
    return 0.99 if v == "steel32" else 1.0


def boom(*a):
    raise AssertionError("the timer must not run")


@needs_sim
def test_plan_covers_each_class_once(sim):
    plan = tune.plan(sim, ["f32", "f16"])
    classes = [p[0] for p in plan]
    assert len(classes) == len(set(classes)) == 3 * 12
    assert set(classes) == {c for c in sim.gemm_shape_classes() if c.split(".")[0] in ("f32", "f16", "f16_f32")}
    for cls, (M, N, K), ta, tb, dt, cdt in plan:  # each shape is one of its class
        assert sim.gemm_shape_class(M, N, K, ta, tb, dt, cdt) == cls


@needs_sim
def test_measure_median_after_warmup(sim):
    seq = {}

    def timer(run, cls, v):  # warm-ups 50, 60, then 3, 1, 2, 5, 4 (median 3), steel32 one slower
        i = seq[(cls, v)] = seq.get((cls, v), -1) + 1
        return [50, 60, 3, 1, 2, 5, 4][i] + (1 if v == "steel32" else 0)

    res = tune.measure(sim, ["f32"], timer=timer, warmup=2, repeats=5)
    assert set(seq.values()) == {6}  # 7 calls per (class, variant)
    for times in res.values():
        assert times == {"tile32": 3, "steel64": 3, "steel32": 4}
    assert tune.winner({"tile32": 3, "steel64": 3, "steel32": 4}, "tile32") == "tile32"  # ties keep the default
    assert tune.winner({"tile32": 1.0, "steel32": 0.985}, "tile32") == "tile32"        # within the margin
    assert tune.winner({"tile32": 1.0, "steel32": 0.9}, "tile32") == "steel32"
    assert tune.winner({}, "tile32") is None
    assert sim.gemm_choices() == {}  # the table is restored


@needs_sim
def test_timed_run_uses_the_variant(sim, monkeypatch):
    """The timed run() is one synchronised GEMM through the variant being timed (small shapes:
    the simulator is slow; only the skinny f32 nn class runs)."""
    monkeypatch.setattr(tune, "SHAPES", {"skinny": {f: (40, 8, 33) for f in tune.FORMS}})
    seen = []

    def timer(run, cls, v):
        if cls == "f32.nn.skinny":
            run()
            seen.append((v, krnl._core.testing.metal_sim_last_step()[-1]["kernel"]))
        return 1.0

    tune.measure(sim, ["f32"], timer=timer, warmup=0, repeats=1)
    assert seen == [("tile32", "gemm_nn_f32"), ("steel64", "gemm_steel64_nn_f32"), ("steel32", "gemm_steel32_nn_f32")]


@needs_sim
@pytest.mark.parametrize("make", [tune.device_timer, lambda dev: tune.wall_timer])
def test_real_timers_time_the_run(sim, make):
    """The default timer (the device's time for the ops of run(), from a profile) and the wall
    timer both return the seconds of one synchronised GEMM."""
    A, C = sim.zeros((33, 40), "f32"), sim.empty((33, 33), "f32")
    calls = []

    def run():
        calls.append(1)
        with sim.step():
            krnl.ops.gemm(A, A, C, trans_b=True, split_k=1)
        sim.synchronize()

    t = make(sim)(run, "f32.nt.skinny", "tile32")
    assert calls == [1] and isinstance(t, float) and 0 < t < 60
    assert not sim.in_step


@needs_sim
def test_failing_variant_left_out(sim, capsys):
    def timer(run, cls, v):
        if v == "steel64" or (v == "tile32" and cls == "f32.nn.large"):
            raise RuntimeError(f"[gemm] pipeline of {v} failed\nsecond line")
        return 2.0 if v == "tile32" else 1.0

    res = tune.measure(sim, ["f32"], timer=timer, warmup=0, repeats=1)
    assert res.pop("f32.nn.large") == {}  # the default failed: no comparison, the class keeps it
    assert all(t == {"tile32": 2.0, "steel32": 1.0} for t in res.values())
    assert tune.winner({}, "tile32") is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 12 and not any("second" in e for e in err)  # one line each
    assert sum(e.startswith("krnl: GEMM variant tile32 failed on f32.nn.large") for e in err) == 1
    assert sum(e.startswith("krnl: GEMM variant steel64 failed on f32.") for e in err) == 11


@needs_sim
def test_winner_stored_and_loaded(tunable_sim, cache):
    dev = tunable_sim
    choices, saved = tune.tune(dev, ["f16"], timer=FakeTimer(steel64_on_large))
    assert saved == cache
    large = {c for c in dev.gemm_shape_classes() if c.startswith(("f16.", "f16_f32.")) and c.endswith(".large")}
    assert {c for c, v in choices.items() if v == "steel64"} == large
    assert set(choices.values()) == {"tile32", "steel64"} and len(choices) == 24  # steel32's 1% is noise
    assert dev.gemm_choices() == choices  # applied at once
    d = json.loads(cache.read_text())
    key = tune.cache_key(dev)
    assert d["format"] == tune.FORMAT and list(d["entries"]) == [key]
    assert d["entries"][key]["choices"] == choices and d["entries"][key]["variants"] == dev.gemm_variants()
    assert cache.stat().st_mode & 0o777 == 0o666 & ~current_umask()
    assert not [p for p in cache.parent.iterdir() if p.name != cache.name]  # no temporary left over

    dev.clear_gemm_choices()
    assert tune.load(dev) == set(choices) and dev.gemm_choices() == choices
    # a second dtype is merged into the same entry
    tune.tune(dev, ["f32"], timer=FakeTimer(lambda c, v: 1.0))
    assert len(json.loads(cache.read_text())["entries"][key]["choices"]) == 36


@needs_sim
def test_cache_key_is_gpu_and_os(tunable_sim, cache, monkeypatch):
    dev = tunable_sim
    gpu = dev.capabilities()["details"]["gpu"]
    assert tune.cache_key(dev, "macOS 15.1") == f"{gpu} | macOS 15.1"
    assert tune.os_version() in tune.cache_key(dev)
    tune.tune(dev, ["f32"], timer=FakeTimer(lambda c, v: 0.5 if v == "steel32" else 1.0))
    dev.clear_gemm_choices()
    monkeypatch.setattr(tune, "os_version", lambda: "macOS 99.0")  # a new OS: no entry, the default
    assert tune.load(dev) == set() and dev.gemm_choices() == {}


@needs_sim
@pytest.mark.parametrize("content, why", [
    (b"{not json", "ignoring the GEMM tuning cache"),
    (b"\xff\xfe", "ignoring the GEMM tuning cache"),
    (b'{"format": 99, "entries": {}}', "not a krnl GEMM tuning cache of format 1"),
    (b'{"format": 1, "entries": {"x": {"choices": {"f32.nn.large": 3}}}}', "not a krnl GEMM tuning cache"),
    (b'[1, 2]', "not a krnl GEMM tuning cache"),
])
def test_corrupt_cache_ignored_with_one_line(tunable_sim, cache, capsys, content, why):
    cache.parent.mkdir(parents=True)
    cache.write_bytes(content)
    assert tune.load(tunable_sim) == set() and tunable_sim.gemm_choices() == {}
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("krnl: ") and why in err, err
    # tuning replaces it with a good one
    tune.tune(tunable_sim, ["f32"], timer=FakeTimer(lambda c, v: 1.0))
    assert json.loads(cache.read_text())["format"] == tune.FORMAT


@needs_sim
def test_entry_this_build_cannot_apply_is_ignored(tunable_sim, cache, capsys):
    key = tune.cache_key(tunable_sim)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"format": 1, "entries": {key: {"choices": {"f32.nn.large": "steel64",
                                                                            "f32.nn.medium": "steel256"}}}}))
    assert tune.load(tunable_sim) == set() and tunable_sim.gemm_choices() == {}
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "unknown GEMM variant 'steel256'" in err


@needs_sim
def test_unwritable_cache_still_applies_this_run(tunable_sim, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KRNL_CACHE", str(blocker / "sub"))  # a folder under a file: cannot be made
    choices, saved = tune.tune(tunable_sim, ["f32"], timer=FakeTimer(lambda c, v: 0.5 if v == "steel64" else 1.0))
    assert saved is None and set(choices.values()) == {"steel64"} and tunable_sim.gemm_choices() == choices
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("krnl: could not save the GEMM tuning to ")


def test_never_tunes_on_cpu_or_metal_sim(cache, capsys):
    names = ["cpu"] + (["metal-sim"] if METAL_SIM is not None else [])
    for name in names:
        dev = krnl.device(name)
        assert not tune.tunable(dev)
        assert tune.ensure_tuned(dev, "f32", timer=boom) == "skipped"
        assert tune.load(dev) == set()
        assert main(["tune", "--device", name]) == 1
        assert "has no GEMM variants worth timing" in capsys.readouterr().err
    assert not cache.exists()


@needs_sim
def test_ensure_tuned_once_per_gpu(tunable_sim, cache, capsys):
    dev = tunable_sim
    timer = FakeTimer(steel64_on_large)
    assert tune.ensure_tuned(dev, "f16", no_tune=True, timer=boom) == "skipped"  # --no-tune: no entry, no timing
    assert not cache.exists()
    assert tune.ensure_tuned(dev, "f16", timer=timer) == "tuned"
    assert "timing the GEMM variants for f16" in capsys.readouterr().err
    n = sum(timer.calls.values())
    dev.clear_gemm_choices()
    assert tune.ensure_tuned(dev, "f16", timer=boom) == "cached"  # the entry covers f16: loaded, not timed
    assert dev.gemm_choices()["f16.nn.large"] == "steel64"
    assert tune.ensure_tuned(dev, "f32", timer=timer) == "tuned"  # f32's classes were missing
    assert sum(timer.calls.values()) > n
    dev.clear_gemm_choices()
    assert tune.ensure_tuned(dev, "f32", no_tune=True, timer=boom) == "skipped"  # the cache still applies
    assert dev.gemm_choices()["f16.nn.large"] == "steel64"


TINY = ["--iters", "1", "--train-samples", "16", "--batch-size", "2", "--quiet", "--steps-per-eval", "0"]


@pytest.mark.parametrize("flag", [[], ["--no-tune"]])
def test_train_tunes_before_its_first_step(tmp_path, monkeypatch, flag):
    """train calls ensure_tuned once, with --no-tune's value, before the trainer's first step."""
    import krnl.cli.main
    import krnl.train.trainer

    events = []
    monkeypatch.setattr(krnl.cli.main, "ensure_tuned", lambda dev, dtype, no_tune: events.append(("tune", dtype, no_tune)))
    real_run = krnl.train.trainer.Trainer.run
    monkeypatch.setattr(krnl.train.trainer.Trainer, "run", lambda self: events.append("run") or real_run(self))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--device", "cpu", *TINY, *flag]) == 0
    assert events == [("tune", "f32", bool(flag)), "run"]


@needs_sim
def test_no_tuning_for_a_dtype_without_kernels(tunable_sim, cache, capsys, monkeypatch):
    real = krnl.Device.capabilities
    monkeypatch.setattr(krnl.Device, "capabilities", lambda d: {**real(d), "dtypes": ["f32", "f16"]})
    assert tune.ensure_tuned(tunable_sim, "bf16", timer=boom) == "skipped"
    assert main(["tune", "--device", "metal-sim", "--dtype", "bf16"]) == 1
    assert "metal-sim has no bf16 kernels (its dtypes: f32, f16)" in capsys.readouterr().err
    assert not cache.exists()


def test_tune_arguments():
    from krnl.cli.args import parse_args

    args = parse_args(["tune", "--dtype", "f16", "--repeats", "3"], collections.defaultdict(lambda: None))
    assert (args.cmd, args.dtype, args.repeats, args.device) == ("tune", "f16", 3, None)
    assert os.environ.get("KRNL_CACHE") is None or tune.cache_path().name == tune.CACHE_NAME
