"""`krnl train --resume` in every corner of the output folder: a finished run (nothing to do), a
longer --iters (the schedule stretched), a torn metrics tail, a corrupt newest checkpoint (fall
back), --resume-from, changed options (refused, or --resume-override), a changed LoRA rank, the
folder lock, a new run into an occupied folder, and --overwrite. All on the embedded default model
with a few steps."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from krnl.cli.main import main
from krnl.io.run_folder import LOCK_NAME, FolderLock

BASE = ["train", "--iters", "6", "--warmup", "2", "--steps-per-eval", "3", "--save-every", "2", "--quiet",
        "--train-samples", "128", "--lora-rank", "4"]
LR, MIN_RATIO = 3e-3, 0.1  # the defaults of --learning-rate and TrainConfig.min_lr_ratio


def train(out, *extra):
    return main(BASE + ["--adapter-path", str(out)] + list(extra))


def rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def cosine_lr(step, total, warmup=2, lr=LR):
    if step <= warmup:
        return lr * step / warmup
    lo = lr * MIN_RATIO
    return lo + (lr - lo) * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 6-step run (checkpoints at steps 4 and 6)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train(out) == 0
    return out


@pytest.fixture
def run(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def test_finished_run_has_nothing_to_do(run, capsys):
    before = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert train(run, "--resume") == 0
    assert "already at step 6 of 6; nothing to do" in capsys.readouterr().out
    assert train(run, "--resume", "--iters", "4") == 0
    assert "already at step 6, past --iters 4; nothing to do" in capsys.readouterr().out
    assert (run / "metrics.jsonl").read_bytes() == before


def test_longer_iters_continues_with_the_schedule_stretched(run, capsys):
    capsys.readouterr()
    assert train(run, "--resume", "--iters", "12") == 0
    out = capsys.readouterr().out
    assert "--iters 6 -> 12: learning-rate schedule from step 7" in out and "ending at step 12 (was 6)" in out
    r = rows(run)
    assert [x["step"] for x in r] == list(range(1, 13))
    for x in r[:6]:  # the steps already taken keep the schedule they were trained with
        assert x["lr"] == pytest.approx(cosine_lr(x["step"], 6), rel=1e-12)
    for x in r[6:]:  # from step 7 on: the same schedule, ending at step 12
        assert x["lr"] == pytest.approx(cosine_lr(x["step"], 12), rel=1e-12)
    assert r[6]["resumed"]["changed"] == {"iters": [6, 12]} and r[6]["resumed"]["schedule"]["total_steps"] == 12
    assert all("resumed" not in x for x in r[7:])
    assert r[-1]["lr"] == pytest.approx(LR * MIN_RATIO)


def test_torn_metrics_tail_is_dropped(run, capsys):
    mp = run / "metrics.jsonl"
    os.chmod(mp, 0o640)
    good = mp.read_text()
    with open(mp, "a") as f:
        f.write('{"step": 7, "loss": 1.2')  # a write cut short
    capsys.readouterr()
    assert train(run, "--resume", "--iters", "7") == 0
    assert "dropped the torn last line of" in capsys.readouterr().out
    assert mp.read_text().startswith(good)
    assert [x["step"] for x in rows(run)] == list(range(1, 8))
    assert os.stat(mp).st_mode & 0o777 == 0o640  # rewritten with the file's mode, not mkstemp's 0600
    assert not [p for p in os.listdir(run) if p.endswith(".tmp")]


def test_malformed_metrics_line_before_the_last_is_an_error(run, capsys):
    mp = run / "metrics.jsonl"
    lines = mp.read_text().splitlines()
    lines[2] = "garbage"
    mp.write_text("\n".join(lines) + "\n")
    assert train(run, "--resume", "--iters", "8") == 1
    err = capsys.readouterr().err
    assert "metrics.jsonl: line 3 is not a metrics row" in err and "Traceback" not in err
    assert mp.read_text().splitlines()[2] == "garbage"  # nothing dropped


def test_corrupt_newest_checkpoint_falls_back(run, capsys):
    original = rows(run)
    bad = run / "checkpoints" / "step-00000006" / "adapter.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    capsys.readouterr()
    assert train(run, "--resume") == 0
    out = capsys.readouterr().out
    assert "skipped checkpoint step-00000006" in out and "adapter.safetensors is corrupt" in out
    assert "falling back to step-00000004" in out and "resumed from step 4" in out
    again = rows(run)
    assert [x["step"] for x in again] == list(range(1, 7))
    # Resume is exact: steps 5 and 6 replayed from step 4 give the same losses.
    assert [x["loss"] for x in again] == [x["loss"] for x in original]


def test_no_checkpoint_verifies(run, capsys):
    for step in (4, 6):
        (run / "checkpoints" / f"step-0000000{step}" / "trainer.json").write_text("{}")
    assert train(run, "--resume") == 1
    err = capsys.readouterr().err
    assert "no checkpoint under" in err and "step-00000006" in err and "step-00000004" in err


def test_corrupt_latest_falls_back_to_the_newest_step(run, capsys):
    (run / "checkpoints" / "latest").write_text("garbage\n")
    capsys.readouterr()
    assert train(run, "--resume") == 0
    out = capsys.readouterr().out
    assert "latest is corrupt" in out and "already at step 6 of 6" in out


def test_resume_without_a_checkpoint_says_so(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert train(tmp_path / "run", "--resume") == 1
    assert "holds no checkpoint; start a new run" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["step", "path"])
def test_resume_from_step_or_path(run, capsys, how):
    original = rows(run)
    where = "4" if how == "step" else str(run / "checkpoints" / "step-00000004")
    capsys.readouterr()
    assert train(run, "--resume-from", where) == 0
    assert "resumed from step 4" in capsys.readouterr().out
    again = rows(run)
    assert [x["step"] for x in again] == list(range(1, 7))
    assert [x["loss"] for x in again] == [x["loss"] for x in original]


def test_resume_from_a_missing_step_lists_the_steps(run, capsys):
    assert train(run, "--resume-from", "5") == 1
    assert "--resume-from 5" in (err := capsys.readouterr().err) and "steps there: 4, 6" in err


def test_changed_options_are_refused_and_listed(run, capsys):
    before = (run / "metrics.jsonl").read_bytes()
    assert train(run, "--resume", "--iters", "8", "--learning-rate", "1e-3", "--batch-size", "8", "--seed", "3") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    for diff in ("--learning-rate 0.003 -> 0.001", "--batch-size 16 -> 8", "--seed 0 -> 3", "--resume-override"):
        assert diff in err
    assert "--iters" not in err  # --iters may differ
    assert (run / "metrics.jsonl").read_bytes() == before


def test_resume_override_applies_and_logs_the_changes(run, capsys):
    capsys.readouterr()
    assert train(run, "--resume", "--iters", "8", "--learning-rate", "1e-3", "--resume-override") == 0
    out = capsys.readouterr().out
    assert "continuing with changed options (--resume-override): --learning-rate 0.003 -> 0.001" in out
    r = rows(run)
    assert r[6]["resumed"]["changed"] == {"learning_rate": [0.003, 0.001], "iters": [6, 8]}
    for x in r[6:]:
        assert x["lr"] == pytest.approx(cosine_lr(x["step"], 8, lr=1e-3), rel=1e-12)


def test_changed_rank_stays_refused(run, capsys):
    assert main(BASE[:-2] + ["--lora-rank", "8", "--adapter-path", str(run), "--resume", "--iters", "8",
                             "--resume-override"]) == 1
    err = capsys.readouterr().err
    assert "lora.r" in err and "4" in err and "8" in err and "cannot change" in err


def test_lock_refuses_a_second_writer_with_its_pid(run, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from krnl.io.run_folder import FolderLock; "
                               "lock = FolderLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)",
                               str(run)], stdout=subprocess.PIPE, text=True)
    try:
        while (line := holder.stdout.readline()) and line.strip() != "locked":  # (an editable build's output)
            pass
        assert line.strip() == "locked"
        assert train(run, "--resume", "--iters", "8") == 1
        err = capsys.readouterr().err
        assert f"in use by another krnl train (pid {holder.pid}" in err and LOCK_NAME in err
    finally:
        holder.kill()  # as in a crash: the OS drops the lock
        holder.wait()
    assert train(run, "--resume", "--iters", "7") == 0


def test_lock_from_a_second_descriptor(tmp_path, capsys):
    with FolderLock(tmp_path / "run"):
        assert train(tmp_path / "run") == 1
        assert f"(pid {os.getpid()}" in capsys.readouterr().err
    assert train(tmp_path / "run") == 0


def test_new_run_into_an_occupied_folder_is_refused(run, capsys):
    before = (run / "metrics.jsonl").read_bytes()
    assert train(run) == 1
    err = capsys.readouterr().err
    assert "holds the checkpoints of another run (newest: step 6)" in err
    assert "--resume" in err and "--overwrite" in err
    assert (run / "metrics.jsonl").read_bytes() == before


def test_overwrite_starts_fresh(run, capsys):
    (run / "notes.txt").write_text("mine")
    (run / "checkpoints" / "step-00000004").rename(run / "checkpoints" / "step-00000010")  # another run's
    assert train(run, "--overwrite", "--iters", "4") == 0
    assert [x["step"] for x in rows(run)] == [1, 2, 3, 4]
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step-00000002", "step-00000004"]
    assert (run / "notes.txt").read_text() == "mine"  # only krnl's files are removed
    assert not [p for p in os.listdir(run) if p.startswith(".krnl-overwritten")]
    assert train(run, "--overwrite", "--resume") == 1
    assert "choose one" in capsys.readouterr().err


def test_hf_run_options_record_the_data(tmp_path):
    """For an HF model the data (folder and train.jsonl contents) and its options must match too."""
    from argparse import Namespace

    from krnl.cli.main import _run_options
    from krnl.io.run_folder import describe, option_changes

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text('{"text": "a"}\n')
    args = Namespace(model="m", data=str(tmp_path / "d"), max_seq_length=32, mask_prompt=True, pack=False)
    saved = _run_options(args)
    assert option_changes(saved, _run_options(args)) == {}
    (tmp_path / "d" / "train.jsonl").write_text('{"text": "b"}\n')
    args.pack = True
    changes = option_changes(saved, _run_options(args))
    assert set(changes) == {"data_sha256", "pack"}
    assert "--pack False -> True" in describe(changes) and "--data (train.jsonl contents)" in describe(changes)
