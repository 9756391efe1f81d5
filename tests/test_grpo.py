"""GRPO's objective (krnl.train.grpo) on fixed completions: against TRL's GRPOTrainer._compute_loss (the
loss and every LoRA gradient, ratios off 1 so that both clips bite, with and without the KL to the base),
and, without torch, the advantages and the loss's gradient against float64 finite differences."""

import numpy as np
import pytest

from krnl.models.sequence_loss import row_losses
from krnl.train import grpo

from hf_families import V
from test_preference import assert_grads_match, trl_pair


def test_advantages_are_trls_group_normalisation():
    r = np.array([1.0, 0.0, 0.5, 0.5, 2.0, -1.0])
    a = grpo.advantages(r, 2)
    assert a[2] == a[3] == 0.0
    np.testing.assert_allclose(a[:2], [0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-4)] * 1 + [-0.5 / (np.std([1, 0], ddof=1)
                                                                                             + 1e-4)], rtol=1e-12)
    assert grpo.advantages(r, 3, "none")[0] == pytest.approx(1.0 - 0.5)
    assert grpo.advantages(r, 6, "batch")[4] == pytest.approx((2.0 - r.mean()) / (r.std(ddof=1) + 1e-4))
    with pytest.raises(ValueError, match="5 rewards are not whole groups of 2"):
        grpo.advantages(r[:5], 2)


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("beta, correction", [(0.0, True), (0.05, True), (0.05, False)])
def test_objective_gradient_is_its_derivative(loss_type, beta, correction):
    rng = np.random.default_rng(1)
    B, T = 4, 6
    mask = rng.random((B, T)) < 0.8
    logp, old, ref = (-rng.uniform(0.1, 3, (B, T)) for _ in range(3))
    adv = rng.normal(size=B)
    f = lambda lp: grpo.objective(lp, mask, adv, old, ref, beta, 0.2, 0.28, loss_type, 9, correction)
    _, g, _ = f(logp)
    for i in range(B):
        for t in range(T):
            e = np.zeros((B, T))
            e[i, t] = 1e-6
            fd = (f(logp + e)[0] - f(logp - e)[0]) / 2e-6
            assert g[i, t] == pytest.approx(fd, rel=1e-5, abs=1e-9), (i, t)
    assert np.all(g[~mask] == 0)


@pytest.mark.torch
@pytest.mark.parametrize("loss_type, beta", [("grpo", 0.0), ("grpo", 0.04), ("bnpo", 0.04), ("dr_grpo", 0.0)])
def test_grpo_matches_trl(tmp_path, loss_type, beta):
    m, st, pm, tok, torch, peft = trl_pair(tmp_path, 8)  # skips without torch, PEFT, TRL and datasets
    import datasets
    import trl

    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                          beta=beta, loss_type=loss_type, max_completion_length=9, epsilon=0.2, epsilon_high=0.28,
                          report_to=[], use_cpu=True, bf16=False)
    tr = trl.GRPOTrainer(model=pm, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                         train_dataset=datasets.Dataset.from_dict({"prompt": ["w1 w2"] * 4}), processing_class=tok)
    peft.set_peft_model_state_dict(pm, {k: torch.tensor(v) for k, v in st.items()})
    rng = np.random.default_rng(3)
    B, Tp, Tc = 4, 3, 7
    prompt = rng.integers(1, V, (B, Tp))
    comp = rng.integers(1, V, (B, Tc))
    cmask = np.ones((B, Tc), np.int64)
    cmask[1, 5:], cmask[3, 2:] = 0, 0
    adv = np.array([0.7, -0.7, 1.3, -1.3])
    ids = np.concatenate([prompt, comp], axis=1)
    tg = np.full(ids.shape, -100)
    tg[:, Tp - 1:Tp - 1 + Tc] = np.where(cmask == 1, comp, -100)
    now = -row_losses(m, ids, tg)[:, Tp - 1:Tp - 1 + Tc]
    old_c = now + np.where(np.arange(Tc) % 3 == 0, 0.5, np.where(np.arange(Tc) % 3 == 1, -0.5, 0.05))  # both clips bite
    old = np.zeros(ids.shape)
    old[:, Tp - 1:Tp - 1 + Tc] = old_c
    T = lambda a, dt=torch.long: torch.tensor(a, dtype=dt)
    inputs = {"prompt_ids": T(prompt), "prompt_mask": T(np.ones((B, Tp))), "completion_ids": T(comp),
              "completion_mask": T(cmask), "advantages": T(adv, torch.float32),
              "old_per_token_logps": T(old_c, torch.float32), "num_items_in_batch": T(cmask.sum())}
    if beta:
        with torch.no_grad(), pm.disable_adapter():
            inputs["ref_per_token_logps"], _, _ = tr._get_per_token_logps_and_entropies(
                pm, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), Tc)
    tr.current_gradient_accumulation_steps = 1  # what Trainer.training_step sets before the loss
    loss = tr._compute_loss(pm, inputs)
    loss.backward()
    m.lora_params.zero_grads()
    mine, metrics = grpo.grpo_step(m, ids, tg, adv, old, beta, 0.2, 0.28, loss_type, 9)
    assert mine == pytest.approx(float(loss.detach()), rel=1e-5)
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    assert metrics["clip_ratio/high_mean"] == pytest.approx(tr._metrics["train"]["clip_ratio/high_mean"][-1], rel=1e-6)
    assert_grads_match(m, pm)

REWARD = '''
def fives(prompts, completions, completion_ids, **kwargs):
    """The share of a completion's tokens that are w5 (id 5): a rule the policy can learn."""
    return [sum(t == 5 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def tagged(prompts, completions, tag, **kwargs):
    return [1.0 if t == "yes" else None for t in tag]
'''


def test_cli_grpo_samples_rewards_and_raises_the_reward(tmp_path):
    """krnl train --train-mode grpo: prompts sampled num_generations times by krnl's generation, two
    reward functions from a file (one reading the lines' own key, one answering None), TRL's metrics per
    step; a short run raises the mean reward."""
    import json
    from mlx_folders import make_base
    from krnl.cli.main import main

    make_base(tmp_path / "base")
    (tmp_path / "rw.py").write_text(REWARD)
    (tmp_path / "data").mkdir()
    rng = np.random.default_rng(0)
    (tmp_path / "data" / "train.jsonl").write_text("".join(
        json.dumps({"prompt": " ".join(f"w{i}" for i in rng.integers(10, 40, 3)), "tag": "yes" if k % 2 else "no"})
        + "\n" for k in range(16)))
    out = tmp_path / "ad"
    assert main(["train", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "--device", "cpu",
                 "--train-mode", "grpo", "--reward", f"{tmp_path / 'rw.py'}:fives", "--reward",
                 f"{tmp_path / 'rw.py'}:tagged", "--reward-weights", "1,0.1", "--num-generations", "4",
                 "--batch-size", "16", "--max-completion-length", "6", "--iters", "12", "--learning-rate", "2e-2",
                 "--lr-schedule", "constant", "--warmup", "0", "--beta", "0.02", "--steps-per-eval", "0", "--quiet",
                 "--no-tune", "--adapter-path", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    for r in rows:
        assert {"reward", "reward_std", "rewards/fives/mean", "rewards/tagged/mean", "kl", "completions/mean_length",
                "timing/generation_s", "clip_ratio/high_mean"} <= set(r)
        assert r["rewards/tagged/mean"] == 1.0 and 0 < r["completions/mean_length"] <= 6
    first, last = np.mean([r["rewards/fives/mean"] for r in rows[:3]]), np.mean([r["rewards/fives/mean"] for r in rows[-3:]])
    assert last > first + 0.05, (first, last)


def test_no_graphs_runs_the_generation_eagerly_too(tmp_path):
    """--no-graphs reaches GRPO's generation: its decoding steps then run eagerly (decode_groups)
    where the device would record them."""
    from collections import defaultdict
    from types import SimpleNamespace
    from krnl.cli import objectives
    from krnl.cli.args import parse_args

    (tmp_path / "rw.py").write_text(REWARD)
    argv = ["train", "--model", "m", "--train-mode", "grpo", "--reward", f"{tmp_path / 'rw.py'}:fives"]
    cfg = SimpleNamespace(beta=0.0, loss_type="dapo")
    for extra, graphs in (([], True), (["--no-graphs"], False)):
        got = objectives.objective(parse_args(argv + extra, defaultdict(lambda: None)), None, cfg)
        assert got.graphs is graphs


def test_sample_top_k_keeps_the_k_largest_logits():
    from krnl.models.generate import sample

    logits = np.array([0.0, 3.0, 2.9, -1.0, 2.95])
    rng = np.random.default_rng(0)
    assert {sample(logits, 1.0, 1.0, rng, top_k=1) for _ in range(50)} == {1}
    assert {sample(logits, 5.0, 1.0, rng, top_k=2) for _ in range(200)} == {1, 4}
    assert len({sample(logits, 5.0, 1.0, rng) for _ in range(400)}) == 5


def test_cli_grpo_resume_is_exact(tmp_path):
    """4 GRPO steps in one run, or 2 then a resume to 4 (a constant rate): the same adapter, the
    completions sampled with seeds of the run's position."""
    import json
    from mlx_folders import make_base
    from safetensors.numpy import load_file
    from krnl.cli.main import main

    make_base(tmp_path / "base")
    (tmp_path / "rw.py").write_text(REWARD)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps({"prompt": f"w{10 + k} w{20 + k}"}) + "\n"
                                                           for k in range(8)))
    run = lambda out, iters, *more: main(["train", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"),
                                         "--device", "cpu", "--train-mode", "grpo", "--reward", f"{tmp_path / 'rw.py'}:fives",
                                         "--num-generations", "2", "--batch-size", "4", "--max-completion-length", "4",
                                         "--top-k", "20", "--iters", str(iters), "--save-every", "2", "--lr-schedule",
                                         "constant", "--warmup", "0", "--steps-per-eval", "0", "--quiet", "--no-tune",
                                         "--adapter-path", str(out), *more])
    assert run(tmp_path / "a", 4) == 0
    assert run(tmp_path / "b", 2) == 0 and run(tmp_path / "b", 4, "--resume") == 0
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in "ab")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert any(np.abs(a[k]).max() > 0 for k in a if ".lora_B." in k)
