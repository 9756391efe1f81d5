"""Preference training (krnl.train.preference, models/sequence_loss.py): DPO's objectives against TRL's
DPOTrainer (loss, reward metrics and every LoRA gradient through PEFT, the reference the adapter
off); and, without torch, the per-sample machinery against krnl's own cross entropy and the
objectives' gradients against float64 finite differences."""

import json

import numpy as np
import pytest

import krnl
from krnl.models.config import LoraConfig, ModelConfig, random_weights
from krnl.models.model import LlamaModel
from krnl.models.sequence_loss import adapter_off, forward_backward_rows, row_losses
from krnl.train import preference

from conftest import lora_step
from hf_families import V, random_b

CFG = dict(model_type="qwen3", vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny(seed=0, lora=None):
    c = ModelConfig.from_dict(CFG)
    m = LlamaModel(krnl.device("cpu"), c, random_weights(c, seed=seed, std=0.3),
                   lora=lora or LoraConfig(r=2, alpha=4.0, target_modules=TARGETS))
    random_b(m, seed + 1)
    return m


def pairs(seed=0, P=3, T=11):
    """ids (2P, T) and targets: completions of different lengths after prompts of different lengths,
    chosen rows first."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (2 * P, T))
    tg = np.full((2 * P, T), -100)
    for b in range(2 * P):
        p0, p1 = rng.integers(1, 4), rng.integers(6, T)
        tg[b, p0:p1] = ids[b, p0 + 1:p1 + 1]
    return ids, tg


def test_row_losses_sum_to_the_cross_entropy_sums():
    m = tiny()
    ids, tg = pairs()
    rows = row_losses(m, ids, tg)
    assert np.all(rows[tg == -100] == 0)
    logp, n = -rows.sum(axis=1), (tg != -100).sum(axis=1)
    for b in range(len(ids)):
        assert n[b] == (tg[b] != -100).sum()
        assert logp[b] == pytest.approx(-m.loss(ids[b:b + 1], tg[b:b + 1]) * n[b], rel=1e-5)


def test_weights_of_the_mean_give_forward_backward_gradients():
    """An objective of the rows' losses whose weights are 1 / (valid tokens) is the mean cross entropy:
    the same LoRA gradients as forward_backward."""
    m = tiny()
    ids, tg = pairs(seed=1)
    _, want = lora_step(m, ids, tg)
    m.lora_params.zero_grads()
    valid = tg != -100
    got = forward_backward_rows(m, ids, tg, lambda rows: (valid / valid.sum(), rows))
    assert got.shape == ids.shape and np.all(got[~valid] == 0) and np.all(got[valid] > 0)
    for k, g in m._lora_grads().items():
        np.testing.assert_allclose(g.numpy(), want[k], rtol=1e-4, atol=1e-5 * np.abs(want[k]).max(), err_msg=k)


def test_adapter_off_is_the_base_model_and_restores_the_adapter():
    m = tiny()
    ids, tg = pairs(seed=2)
    before = m.lora_state()
    with_adapter = m.loss(ids, tg)
    with adapter_off(m):
        off = m.loss(ids, tg)
    base = LlamaModel(krnl.device("cpu"), m.config, random_weights(m.config, seed=0, std=0.3))
    assert off == pytest.approx(base.loss(ids, tg), rel=1e-6) and abs(off - with_adapter) > 1e-3
    assert m.loss(ids, tg) == with_adapter
    for k, v in m.lora_state().items():
        assert np.array_equal(v, before[k]), k


OBJECTIVES = {**{f"dpo-{t}": lambda lp, n, ref, t=t: preference.dpo(lp, n, ref, 0.3, t) for t in preference.DPO_LOSS_TYPES},
              "orpo": lambda lp, n, ref: preference.orpo(lp, n, 0.3),
              "simpo": lambda lp, n, ref: preference.simpo(lp, n, 2.0, 0.5, 0.7, 0.1)}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_objective_weights_are_its_loss_derivative(name):
    """w = dloss/dS with S = -logp each row's summed token losses, against float64 central differences."""
    f = OBJECTIVES[name]
    rng = np.random.default_rng(3)
    n = rng.integers(1, 20, 8)
    logp, ref = -rng.uniform(0.2, 3.0, 8) * n, -rng.uniform(5, 30, 8)  # per token: log-probabilities < 0
    _, w, _ = f(logp, n, ref)
    for i in range(8):
        e = np.zeros(8)
        e[i] = 1e-6
        fd = (f(logp - e, n, ref)[0] - f(logp + e, n, ref)[0]) / 2e-6   # dloss/dS = -dloss/dlogp
        assert w[i] == pytest.approx(fd, rel=1e-6, abs=1e-9), i
    with pytest.raises(ValueError, match="a batch holds pairs"):
        f(logp[:3], n[:3], ref[:3])


def test_dpo_refuses_unknown_loss_types():
    with pytest.raises(ValueError, match="loss_type must be one of sigmoid, hinge, ipo"):
        preference.dpo(np.zeros(2), np.ones(2), np.zeros(2), 0.3, "kto")


def test_dpo_training_raises_the_margin():
    """A few steps of DPO with AdamW move the chosen-minus-rejected margin of the batch up."""
    from krnl.train.optim import AdamW, Schedule

    m = tiny(seed=4)
    ids, tg = pairs(seed=4, P=4)
    opt = AdamW(m.lora_params, Schedule(5e-3, kind="constant"))
    margins = []
    for _ in range(6):
        m.lora_params.zero_grads()
        loss, metrics = preference.dpo_step(m, ids, tg, beta=0.5)
        opt.step()
        margins.append(metrics["rewards/margins"])
    assert margins[-1] > margins[0] + 0.05


# ---------------------------------------------------------------------------------------------
# TRL

def trl_pair(tmp_path, seed):
    """(krnl's model with random B factors, its LoRA state, PEFT's model of the same folder with the
    initial (zero-B) adapter, the folder's tokenizer for TRL, torch, peft) on a tiny Qwen3 folder; the
    caller loads the state into PEFT once its trainer has copied what it needs."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from hf_families import save_random
    from krnl.formats import hf

    c = transformers.Qwen3Config(**{k: v for k, v in CFG.items() if k != "model_type"}, rms_norm_eps=1e-6,
                                 tie_word_embeddings=False)
    torch.manual_seed(0)
    folder = save_random(transformers.Qwen3ForCausalLM(c), tmp_path / "m", 10 + seed)
    m = hf.load_model(folder, krnl.device("cpu"), lora=LoraConfig(r=2, alpha=4.0, target_modules=TARGETS))
    st = random_b(m, seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                             attn_implementation="eager")
    pm = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4.0, target_modules=list(TARGETS)))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="</s>",
                                               pad_token="</s>")
    return m, st, pm, tok, torch, peft


def assert_grads_match(m, pm):
    """Every LoRA gradient of krnl's model within 1e-4 of PEFT's (autograd's), none zero."""
    ref = {n.replace(".default", ""): p.grad.double().numpy() for n, p in pm.named_parameters() if p.requires_grad}
    grads = {k: np.asarray(g.numpy(), np.float64) for k, g in m._lora_grads().items()}
    assert set(grads) == set(ref)
    for k, g in ref.items():
        assert np.abs(g).max() > 0, k
        assert np.abs(grads[k] - g).max() <= 1e-4 * np.abs(g).max(), k


PAIR_DATA = {"prompt": ["w1 w2", "w3", "w9 w8 w7"], "chosen": [" w4 w5", " w6", " w11"],
             "rejected": [" w7", " w8 w9 w1", " w12 w13"]}


@pytest.mark.torch
@pytest.mark.parametrize("loss_type", preference.DPO_LOSS_TYPES)
def test_dpo_matches_trl(tmp_path, loss_type):
    """The same batch through TRL's DPOTrainer (PEFT LoRA, the reference the adapter off) and krnl:
    loss, reward metrics and every LoRA gradient equal."""
    m, st, pm, tok, torch, peft = trl_pair(tmp_path, 5)  # skips without torch, PEFT, TRL and datasets
    import datasets
    import trl

    args = trl.DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, beta=0.2,
                         loss_type=[loss_type], report_to=[], use_cpu=True, bf16=False)
    tr = trl.DPOTrainer(model=pm, args=args, train_dataset=datasets.Dataset.from_dict(PAIR_DATA), processing_class=tok)
    # after the trainer copies the initial adapter (B = 0: the base) as its reference
    peft.set_peft_model_state_dict(pm, {k: torch.tensor(v) for k, v in st.items()})
    batch = next(iter(tr.get_train_dataloader()))
    loss = tr.compute_loss(pm, batch)
    loss.backward()
    ids, cm = batch["input_ids"].numpy(), batch["completion_mask"].numpy()
    tg = np.where(cm[:, 1:] == 1, ids[:, 1:], -100)
    tg = np.concatenate([tg, np.full((len(ids), 1), -100)], axis=1)
    m.lora_params.zero_grads()
    mine, metrics = preference.dpo_step(m, ids, tg, beta=0.2, loss_type=loss_type)
    assert mine == pytest.approx(float(loss.detach()), rel=1e-5)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[k] == pytest.approx(tr._metrics["train"][k][-1], rel=1e-4, abs=1e-6), k
    assert_grads_match(m, pm)


def write_pairs(n, seed, conversational=False):
    """n preference pairs in TRL's standard (or conversational) format: whatever the prompt, the chosen
    completion is 'w5 w6' and the rejected one 'w7 w8' (a preference the model can learn)."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        prompt = " ".join(f"w{i}" for i in rng.integers(10, 40, rng.integers(1, 5)))
        if conversational:
            lines.append({"prompt": [{"role": "user", "content": prompt}],
                          "chosen": [{"role": "assistant", "content": "w5 w6"}],
                          "rejected": [{"role": "assistant", "content": "w7 w8"}]})
        else:
            lines.append({"prompt": prompt, "chosen": " w5 w6", "rejected": " w7 w8"})
    return "".join(json.dumps(x) + "\n" for x in lines)


def test_cli_dpo_trains_and_moves_held_out_margins(tmp_path, capsys):
    """krnl train --train-mode dpo on a tiny folder: metrics carry TRL's reward metrics, the validation
    loss is DPO's, and the held-out pairs' margin goes up; bad pair lines are named."""
    from mlx_folders import make_base
    from krnl.cli.main import main
    from krnl.formats import hf

    make_base(tmp_path / "base")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(write_pairs(32, 1))
    (tmp_path / "data" / "valid.jsonl").write_text(write_pairs(8, 2))
    out = tmp_path / "ad"
    args = ["train", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "--device", "cpu",
            "--train-mode", "dpo", "--beta", "0.5", "--iters", "8", "--batch-size", "4", "--learning-rate", "1e-2",
            "--steps-per-eval", "4", "--quiet", "--no-tune", "--adapter-path", str(out)]
    assert main(args) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all("rewards/margins" in r and "rewards/accuracies" in r for r in rows)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 2 and vals[-1] < np.log(2) - 0.01  # DPO's loss starts at log 2 (policy = reference)
    m = hf.load_model(tmp_path / "base", krnl.device("cpu"), adapter=out)
    from krnl.train.pairs import load_pairs

    split = load_pairs(tmp_path / "data" / "valid.jsonl", hf.load_tokenizer(tmp_path / "base"), 64)
    ids, tg = split.eval_batches(8)[0]
    assert preference.Pairwise("dpo", 0.5).evaluate(m, ids, tg) == pytest.approx(vals[-1], rel=1e-4)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train.jsonl").write_text('{"prompt": "w1", "chosen": " w2"}\n')
    assert main(args[:4] + [str(tmp_path / "bad")] + args[5:]) != 0
    assert "bad/train.jsonl:1: missing key 'rejected'" in capsys.readouterr().err


def test_pairs_of_both_formats_mask_the_prompt(tmp_path):
    """Standard and conversational pairs: 2P rows, the chosen first; only completion tokens are targets
    (with a chat template, the tokens after the prompt's generation prompt)."""
    from mlx_folders import make_base
    from krnl.formats import hf
    from krnl.train.pairs import load_pairs

    make_base(tmp_path / "base")
    tok = hf.load_tokenizer(tmp_path / "base")
    (tmp_path / "p.jsonl").write_text('{"prompt": "w1 w2 w3", "chosen": " w5 w6", "rejected": " w7"}\n')
    ids, tg = load_pairs(tmp_path / "p.jsonl", tok, 64).eval_batches(4)[0]
    assert ids.shape[0] == 2 and list(tg[0][tg[0] != -100]) == [5, 6, tok.eos_id]
    assert list(tg[1][tg[1] != -100]) == [7, tok.eos_id]
    (tmp_path / "c.jsonl").write_text(write_pairs(3, 4, conversational=True))
    with pytest.raises(ValueError, match=r"c.jsonl:1: conversational pairs need a tokenizer with a chat template"):
        load_pairs(tmp_path / "c.jsonl", tok, 64)
    cfg = json.loads((tmp_path / "base" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                            "{% if add_generation_prompt %}assistant {% endif %}")
    (tmp_path / "base" / "tokenizer_config.json").write_text(json.dumps(cfg))
    split = load_pairs(tmp_path / "c.jsonl", hf.load_tokenizer(tmp_path / "base"), 64)
    ids, tg = split.eval_batches(3)[0]
    assert ids.shape[0] == 6
    assert all(list(t[t != -100]) == ([5, 6] if b < 3 else [7, 8]) for b, t in enumerate(tg))


def test_cli_dpo_resume_is_exact(tmp_path):
    """4 DPO steps in one run, or 2 then a resume to 4 (a constant rate: the schedule does not hang on
    --iters): the same adapter."""
    from mlx_folders import make_base
    from safetensors.numpy import load_file
    from krnl.cli.main import main

    make_base(tmp_path / "base")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(write_pairs(16, 5))
    run = lambda out, iters, *more: main(["train", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"),
                                         "--device", "cpu", "--train-mode", "dpo", "--loss-type", "ipo", "--iters",
                                         str(iters), "--batch-size", "2", "--grad-accumulation", "2", "--save-every",
                                         "2", "--steps-per-eval", "0", "--lr-schedule", "constant", "--warmup", "0",
                                         "--quiet", "--no-tune", "--adapter-path", str(out), *more])
    assert run(tmp_path / "a", 4) == 0
    assert run(tmp_path / "b", 2) == 0 and run(tmp_path / "b", 4, "--resume") == 0
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in "ab")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert any(np.abs(a[k]).max() > 0 for k in a if ".lora_B." in k)


@pytest.mark.torch
@pytest.mark.parametrize("mode, alpha", [("orpo", None), ("simpo", 0.0), ("simpo", 1.0)])
def test_orpo_and_simpo_match_trl(tmp_path, mode, alpha):
    """TRL's ORPOTrainer and CPOTrainer (loss_type simpo, with and without CPO's NLL) on one batch and
    krnl's objectives: loss, reward metrics and every LoRA gradient equal."""
    m, st, pm, tok, torch, peft = trl_pair(tmp_path, 6)  # skips without torch, PEFT, TRL and datasets
    import datasets
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    peft.set_peft_model_state_dict(pm, {k: torch.tensor(v) for k, v in st.items()})
    ds = datasets.Dataset.from_dict(PAIR_DATA)
    common = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, beta=0.2, report_to=[],
                  use_cpu=True, bf16=False)
    if mode == "orpo":
        tr = ORPOTrainer(model=pm, args=ORPOConfig(**common), train_dataset=ds, processing_class=tok)
    else:
        tr = CPOTrainer(model=pm, args=CPOConfig(**common, loss_type="simpo", simpo_gamma=0.3, cpo_alpha=alpha),
                        train_dataset=ds, processing_class=tok)
    batch = next(iter(tr.get_train_dataloader()))
    loss, want = tr.get_batch_loss_metrics(pm, batch)
    loss.backward()
    T = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    pad = lambda a, v: np.pad(a.numpy(), ((0, 0), (0, T - a.shape[1])), constant_values=v)
    ids = np.concatenate([pad(batch[f"{k}_input_ids"], 0) for k in ("chosen", "rejected")])
    lab = np.concatenate([pad(batch[f"{k}_labels"], -100) for k in ("chosen", "rejected")])
    tg = np.concatenate([lab[:, 1:], np.full((len(lab), 1), -100)], axis=1)
    m.lora_params.zero_grads()
    obj = preference.Pairwise(mode, 0.2, gamma=0.3, cpo_alpha=alpha or 0.0)
    mine, metrics = obj.step(m, ids, tg)
    assert mine == pytest.approx(float(loss.detach()), rel=1e-5)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "nll_loss"):
        assert metrics[k] == pytest.approx(float(want[k]), rel=1e-4, abs=1e-6), k
    assert_grads_match(m, pm)


@pytest.mark.parametrize("mode", ["orpo", "simpo"])
def test_cli_orpo_and_simpo_train(tmp_path, mode):
    """--train-mode orpo and simpo from the CLI: TRL's metrics per step, the validation loss (the
    mode's) going down."""
    from mlx_folders import make_base
    from krnl.cli.main import main

    make_base(tmp_path / "base")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(write_pairs(32, 1))
    (tmp_path / "data" / "valid.jsonl").write_text(write_pairs(8, 2))
    out = tmp_path / "ad"
    assert main(["train", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "--device", "cpu",
                 "--train-mode", mode, "--beta", "0.5", "--cpo-alpha", "0.2", "--iters", "8", "--batch-size", "4",
                 "--learning-rate", "1e-2", "--steps-per-eval", "1", "--quiet", "--no-tune",
                 "--adapter-path", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["nll_loss"] > 0 and "rewards/margins" in r for r in rows)
    vals = [r["val_loss"] for r in rows]
    assert vals[-1] < vals[0] - 0.01, vals


def test_dpo_on_a_base_quantized_on_load(tmp_path):
    """QLoRA: DPO on a base held in 4 bits. The untrained adapter is its own reference (loss log 2); a
    few steps lower the loss on the batch."""
    from mlx_folders import make_base
    from krnl.formats import hf
    from krnl.train.optim import AdamW, Schedule

    make_base(tmp_path / "base")
    m = hf.load_model(tmp_path / "base", krnl.device("cpu"), quantize=(4, 32),
                      lora=LoraConfig(r=4, alpha=8.0, target_modules=TARGETS))
    assert type(m.layers[0].qkv).__name__ == "QuantizedWeight"
    ids, tg = pairs(seed=6, P=4)
    opt = AdamW(m.lora_params, Schedule(1e-2, kind="constant"))
    losses = []
    for _ in range(5):
        m.lora_params.zero_grads()
        losses.append(preference.dpo_step(m, ids, tg, beta=0.5)[0])
        opt.step()
    assert losses[0] == pytest.approx(np.log(2), rel=1e-6) and losses[-1] < losses[0] - 0.02, losses


@pytest.mark.parametrize("mode", ["dpo", "orpo"])
def test_preference_step_on_metal_sim_matches_cpu(mode):
    """A DPO step (its reference forward with the adapter off, the rows' weighted backward) and an ORPO
    step on metal-sim, the MSL kernels, against the CPU backend."""
    from conftest import METAL_SIM

    if METAL_SIM is None:
        pytest.skip("metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
    c = ModelConfig.from_dict(CFG)
    w = random_weights(c, seed=0, std=0.3)
    lora = LoraConfig(r=2, alpha=4.0, target_modules=TARGETS)
    cpu, sim = (LlamaModel(krnl.device(d), c, w, lora=lora) for d in ("cpu", "metal-sim"))
    sim.lora_params.load(random_b(cpu, 7))
    ids, tg = pairs(seed=7)
    out = []
    for m in (cpu, sim):
        m.lora_params.zero_grads()
        loss, metrics = preference.Pairwise(mode, 0.3).step(m, ids, tg)
        out.append((loss, metrics, {k: np.asarray(g.numpy(), np.float64) for k, g in m._lora_grads().items()}))
    (lc, mc, gc), (ls, ms, gs) = out
    assert ls == pytest.approx(lc, rel=1e-5) and ms["rewards/margins"] == pytest.approx(mc["rewards/margins"], abs=1e-5)
    for k, g in gc.items():
        assert np.abs(gs[k] - g).max() <= 1e-4 * np.abs(g).max(), k
