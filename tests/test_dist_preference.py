"""Data-parallel preference and RL training (--train-mode dpo, orpo, simpo, grpo over MPI ranks). Without
MPI: each rank's parts of a batch's loss, gradient weights and metrics (its whole pairs, or its prompts'
groups) sum to one process's, and what ranks refuse. With mpiexec (the `mpi` marker, as tests/test_dist.py):
2 ranks train as one process on the same global batches (DPO with 3 pairs a batch split 2 and 1, gradient
accumulation and validation; ORPO; SimPO with one pair a batch, rank 1 idle; GRPO over the batch's reward
std with the dapo loss, the grpo loss with a KL and dropout, dr_grpo with one prompt a batch), and 2-rank
DPO and GRPO runs resumed by 2 ranks are the uninterrupted ones."""

import json
import shutil

import numpy as np
import pytest

from krnl.train import grpo, preference
from krnl.train.dist import world as dist
from krnl.train.dist.ranks import check_world, reduce_order
from krnl.train.trainer import TrainConfig

from test_dist import _adapter, _krnl, _mpiexec, _rows
from test_preference import pairs, write_pairs


def _rank(r, size):
    w = dist.World()
    w.rank, w.size = r, size
    return w


def test_span_gives_each_rank_consecutive_whole_items():
    for n in range(0, 9):
        for size in (1, 2, 3, 4):
            spans = [_rank(r, size).span(n) for r in range(size)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [hi - lo for lo, hi in spans]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), (n, size, spans)


@pytest.mark.parametrize("mode", ["dpo", "orpo", "simpo"])
def test_pair_parts_sum_to_the_batchs(mode):
    """3 pairs over 2 ranks (2 and 1 pairs): the ranks' losses, row weights and metrics sum to the
    batch's; a rank's own mean (share 1) would not."""
    ids, tg = pairs(seed=3, P=3)
    obj = preference.Pairwise(mode, 0.3, cpo_alpha=0.5)
    rng = np.random.default_rng(0)
    read, done = obj.targets(ids, tg)
    rows = np.where(read != -100, rng.uniform(0.5, 4.0, ids.shape), 0.0)
    ref = -(rng.uniform(0.5, 4.0, ids.shape) * done).sum(axis=1)
    want = obj.loss(rows, read, done, ref)
    loss, w, metrics = 0.0, np.zeros(ids.shape), {}
    for r in range(2):
        obj.world = _rank(r, 2)
        mine, share, nll_tokens, _ = obj.mine(ids, tg)
        assert len(mine) == 2 * (2 - r) and share == (2 - r) / 3
        part = obj.loss(rows[mine], read[mine], done[mine], ref[mine], share, nll_tokens)
        loss, w[mine] = loss + part[0], part[1]
        metrics = {k: metrics.get(k, 0.0) + v for k, v in part[2].items()}
        alone = obj.loss(rows[mine], read[mine], done[mine], ref[mine])
        assert abs(alone[2]["rewards/margins"] - want[2]["rewards/margins"]) > 1e-3
    assert loss == pytest.approx(want[0], rel=1e-12)
    np.testing.assert_allclose(w, want[1], rtol=1e-12, atol=1e-15)
    assert metrics.keys() == want[2].keys()
    for k, v in want[2].items():
        assert metrics[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert (mode != "dpo") == (metrics.get("nll_loss", 0) > 0)


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_grpo_parts_sum_to_the_batchs(loss_type):
    """6 completions (3 groups of 2) as a rank's 4 and another's 2: given the batch's completions and
    tokens, the parts' losses, gradients and metrics sum to the batch's."""
    rng = np.random.default_rng(2)
    B, T = 6, 7
    mask = rng.random((B, T)) < 0.7
    logp, old, ref = (-rng.uniform(0.1, 3, (B, T)) for _ in range(3))
    adv = grpo.advantages(rng.normal(size=B), 2, "batch")
    f = lambda rows, whole=None: grpo.objective(logp[rows], mask[rows], adv[rows], old[rows], ref[rows], 0.04, 0.2,
                                                0.28, loss_type, 9, True, whole)
    want = f(slice(None))
    parts = [f(slice(0, 4), (B, mask.sum())), f(slice(4, 6), (B, mask.sum()))]
    assert sum(p[0] for p in parts) == pytest.approx(want[0], rel=1e-12)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), want[1], rtol=1e-12)
    for k, v in want[2].items():
        assert sum(p[2][k] for p in parts) == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert f(slice(0, 4))[0] != pytest.approx(parts[0][0], rel=1e-3)  # the rank's own normalisation differs


def test_ranks_refuse_dropout_of_pairs_and_weigh_rows_after_the_forward():
    """Over ranks: pairs with LoRA dropout are refused in one line (a rank's rows are two blocks: no
    slice offset draws one process's masks), GRPO's are not (a rank's completions are consecutive
    rows); an uneven batch of pairs or prompts is sliced, an uneven SFT batch refused; auto's reduce
    order is the rows' for the sequence objectives (they weigh each row after the forward)."""
    two = _rank(0, 2)
    with pytest.raises(ValueError, match=r"^\[train\] --lora-dropout 0.1 with --train-mode orpo over 2 ranks: .*"
                                         r"use --lora-dropout 0 \(TRL's default for pairs\) or one rank$"):
        check_world(two, TrainConfig(train_mode="orpo", batch_size=3), 0.1)
    check_world(two, TrainConfig(train_mode="grpo", batch_size=3, loss_type="dapo", beta=0.0), 0.1)
    check_world(two, TrainConfig(train_mode="dpo", batch_size=3))
    with pytest.raises(ValueError, match=r"--batch-size 3 \(the global batch\) does not divide among 2 ranks"):
        check_world(two, TrainConfig(batch_size=3))
    assert reduce_order(TrainConfig(train_mode="dpo"), two) == "rows"
    with pytest.raises(ValueError, match=r"^\[train\] --reduce-order sample sums SFT's token losses per sample; "
                                         r"--train-mode simpo weighs each row after the forward: use"):
        reduce_order(TrainConfig(train_mode="simpo", reduce_order="sample"), dist.World())
    assert reduce_order(TrainConfig(), two) == "sample"


# ---- two ranks under mpiexec

RULES = '''
def odd(completion_ids, **kwargs):
    """The share of a completion's tokens of odd id: varied among samples, learnable."""
    return [sum(t % 2 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def chars(completions, tag, **kwargs):
    """A rule on the text, None (not rewarded) on the lines tagged skip."""
    return [None if t == "skip" else float(len(c) % 3) for c, t in zip(completions, tag)]
'''


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from mlx_folders import make_base

    _mpiexec()  # skips without mpi4py or mpiexec, before any run of one process
    root = tmp_path_factory.mktemp("dp_pref")
    make_base(root / "base")
    (root / "pairs").mkdir()
    (root / "pairs" / "train.jsonl").write_text(write_pairs(24, 1))
    (root / "pairs" / "valid.jsonl").write_text(write_pairs(5, 2))
    (root / "prompts").mkdir()
    rng = np.random.default_rng(4)
    (root / "prompts" / "train.jsonl").write_text("".join(
        json.dumps({"prompt": " ".join(f"w{i}" for i in rng.integers(10, 40, 1 + k % 3)),
                    "tag": "skip" if k % 4 == 1 else "keep"}) + "\n" for k in range(12)))
    (root / "rules.py").write_text(RULES)
    return root


def _train(n, data, out, mode, *more):
    """`krnl train` of `mode` on the fixture's data by n processes (2: under mpiexec), into `out`."""
    if mode == "grpo":
        rules = str(data / "rules.py")
        mode_args = ["--data", str(data / "prompts"), "--reward", f"{rules}:odd", "--reward", f"{rules}:chars",
                     "--reward-weights", "1,0.2", "--num-generations", "2", "--batch-size", "6",
                     "--max-completion-length", "6", "--top-k", "30", "--scale-rewards", "batch"]
    else:
        mode_args = ["--data", str(data / "pairs"), "--beta", "0.5", "--batch-size", "3", "--steps-per-eval", "2"]
    r = _krnl(n, ["train", "--model", str(data / "base"), "--train-mode", mode, "--device", "cpu", "--quiet",
                  "--no-tune", "--lr-schedule", "constant", "--warmup", "0", "--learning-rate", "1e-2",
                  "--save-every", "2", "--adapter-path", str(out), *mode_args, *more], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _same_runs(one, two, metrics, tol=1e-4):
    """The two runs' metrics rows: the same steps and learning rates, losses, gradient norms, validation
    losses and `metrics` within tol (relative, or absolute near 0; NaN where a reward function rewarded
    none in a batch); adapters within 10 tol of each tensor's norm, the B factors trained (not 0). The
    ranks' gradients, summed, round otherwise than one process's sum (f32, the rows' order: the metrics
    1e-6 to 1e-5 apart here), and Adam moves an element whose terms nearly cancel by its full step either
    way: 2e-5 to 1.6e-4 of a tensor's norm after these steps, measured."""
    r1, r2 = _rows(one), _rows(two)
    assert r1 and [x["step"] for x in r1] == [y["step"] for y in r2]
    for x, y in zip(r1, r2):
        assert x["lr"] == y["lr"] and x.keys() == y.keys()
        for k in ("loss", "grad_norm", "val_loss", *metrics):
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=tol, abs=tol, nan_ok=True), (x["step"], k, x[k], y[k])
    a, b = _adapter(one), _adapter(two)
    assert a.keys() == b.keys()
    for k in a:
        assert np.linalg.norm(a[k] - b[k]) <= 10 * tol * np.linalg.norm(a[k]), k
    assert all(np.abs(a[k]).max() > 0 for k in a if ".lora_B." in k)
    return r1, r2


def _results(row):
    """A metrics row less its measures of time and memory."""
    return {k: v for k, v in row.items() if not ("per_s" in k or k.startswith(("peak_", "timing/")))}


PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")


@pytest.fixture(scope="module")
def dpo_runs(data, tmp_path_factory):
    """4 DPO steps of 2 micro-batches of 3 pairs each, by one process and by 2 ranks."""
    root = tmp_path_factory.mktemp("dpo")
    for n in (1, 2):
        _train(n, data, root / f"n{n}", "dpo", "--iters", "4", "--grad-accumulation", "2")
    return root / "n1", root / "n2"


@pytest.mark.mpi
def test_dist_dpo_with_an_odd_batch_trains_like_one_process(dpo_runs):
    """Rank 0 trains on 2 pairs of each batch, rank 1 on 1: the losses, every reward metric (the batch's,
    not rank 0's), the validation losses (5 pairs: batches of 3 and 2) and the adapter those of one process."""
    r1, r2 = _same_runs(*dpo_runs, PAIR_METRICS)
    assert len([x for x in r2 if "val_loss" in x]) == 2
    assert r2[-1]["rewards/margins"] > 0.01 and r2[-1]["val_loss"] < np.log(2)


@pytest.mark.mpi
@pytest.mark.parametrize("mode, more", [("dpo", ["--grad-accumulation", "2"]), ("grpo", ["--lora-dropout", "0.1"])])
def test_dist_resumes_under_two_ranks(data, tmp_path, mode, more):
    """A 2-rank run's step-2 checkpoint resumed by 2 ranks: steps 3 and 4 and the adapter those of the
    uninterrupted run, bit for bit (GRPO's: the same completions and dropout masks)."""
    _train(2, data, tmp_path / "a", mode, "--iters", "4", *more)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    r = _train(2, data, tmp_path / "b", mode, "--iters", "4", "--resume-from", "2", *more)
    assert "resumed from step 2" in r.stdout
    before, after = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [x["step"] for x in after] == [1, 2, 3, 4]
    for x, y in zip(before[2:], after[2:]):
        assert _results(x) == _results(y)
    a, b = _adapter(tmp_path / "a"), _adapter(tmp_path / "b")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.mpi
def test_dist_orpo_trains_like_one_process(data, tmp_path):
    """ORPO over 2 ranks: its NLL a mean over the whole batch's chosen tokens, its odds ratio over pairs."""
    for n in (1, 2):
        _train(n, data, tmp_path / f"n{n}", "orpo", "--iters", "3")
    r1, _ = _same_runs(tmp_path / "n1", tmp_path / "n2", PAIR_METRICS + ("nll_loss", "log_odds_ratio"))
    assert all(x["nll_loss"] > 0 for x in r1)


@pytest.mark.mpi
@pytest.mark.parametrize("loss_type, more", [("dapo", []), ("grpo", ["--beta", "0.05", "--lora-dropout", "0.1"]),
                                             ("dr_grpo", ["--batch-size", "2"])])
def test_dist_grpo_trains_like_one_process(data, tmp_path, loss_type, more):
    """GRPO over 2 ranks, 3 prompts a batch (2 and 1, their 2 completions each sampled with one process's
    seeds), advantages over the batch's reward std: the rewards, the per-function means (one function
    skips lines), completion lengths, clip ratios, KL, losses and adapter those of one process; with
    LoRA dropout too (a rank's rows padded as the batch's draw its masks); and one prompt a batch (rank 1
    samples and trains on none)."""
    for n in (1, 2):
        _train(n, data, tmp_path / f"n{n}", "grpo", "--iters", "3", "--loss-type", loss_type, *more)
    keys = ("reward", "reward_std", "rewards/odd/mean", "rewards/chars/mean", "completions/mean_length",
            "clip_ratio/low_mean", "clip_ratio/high_mean", *(("kl",) if more else ()))
    r1, _ = _same_runs(tmp_path / "n1", tmp_path / "n2", keys)
    assert len({x["reward"] for x in r1}) == 3 and any(x["reward_std"] > 0 for x in r1)


@pytest.mark.mpi
def test_dist_simpo_with_a_rank_without_pairs(data, tmp_path):
    """SimPO (with CPO's NLL) on one pair a batch over 2 ranks: rank 1 trains and validates on none and
    adds nothing to the sums; one process's run all the same."""
    for n in (1, 2):
        _train(n, data, tmp_path / f"n{n}", "simpo", "--iters", "3", "--batch-size", "1", "--cpo-alpha", "0.3")
    r1, _ = _same_runs(tmp_path / "n1", tmp_path / "n2", PAIR_METRICS + ("nll_loss",))
    assert all(x["nll_loss"] > 0 for x in r1) and len([x for x in r1 if "val_loss" in x]) == 2
