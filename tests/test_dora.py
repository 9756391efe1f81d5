"""DoRA (krnl.models.dora, --fine-tune-type dora) against PEFT's use_dora and mlx-lm's DoRALinear on
tiny models of several families (llama, qwen2 with its q/k/v biases, qwen3, gemma2, gemma3, phi3's fused
modules): the loss and every LoRA and magnitude gradient equal PEFT's (B and magnitudes off their
start, so that the norm and the scale matter), on every LoRA path (grouped or not, LoRA first or
not, folded); krnl's adapter loads in PEFT with the same loss and PEFT's in krnl; fuse writes
PEFT's merge_and_unload weights; mlx-lm's DoRA adapters go both ways. Without torch: the
gradients against finite differences, a quantized base against its dequantized copy, the sample
reduce order, the base behind adapter_off, generation, the CLI and config file, metal-sim's step
against the CPU's.

Tolerances as tests/test_families.py's: losses within 1e-5 relative, gradients within 1e-4 of the
largest of their tensor (f32; ~4e-6 observed)."""

import json

import numpy as np
import pytest

import krnl
from krnl.formats import adapter as adapter_io, hf
from krnl.models.config import ALL_MODULES, LoraConfig, ModelConfig, random_weights
from krnl.models.model import LlamaModel
from krnl.models.sequence_loss import adapter_off

from conftest import METAL_SIM, TINY_LLAMA, assert_step_close, lora_step
from hf_families import PHI3_MODULES, family_batch, family_models, grad_error, hf_model, torch_modules
from mlx_folders import make_base

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
QV = ("q_proj", "v_proj")  # PEFT's default targets: k stays frozen inside the q|k|v group


def perturb(model, seed=1):
    """B factors and magnitudes off their start; returns the LoRA state."""
    rng = np.random.default_rng(seed)
    st = model.lora_state()
    for k, v in st.items():
        if ".lora_B." in k:
            st[k] = (0.3 * rng.standard_normal(v.shape)).astype(np.float32)
        elif k.endswith("magnitude_vector"):
            st[k] = (v * (1 + 0.2 * rng.standard_normal(v.shape))).astype(np.float32)
    model.lora_params.load(st)
    return st


def dora_model(folder, targets, dev="cpu", layers=None, **kw):
    lora = LoraConfig(r=3, alpha=5.0, target_modules=targets, use_dora=True, layers=layers)
    m = hf.load_model(folder, krnl.device(dev), lora=lora, **kw)
    return m, lora, perturb(m)


def peft_model(folder, lora, state):
    torch, _ = torch_modules()
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), lora_dropout=0.0,
                          use_dora=True)
    pm = peft.get_peft_model(hf_model(folder), cfg)
    missing = peft.set_peft_model_state_dict(pm, {k: torch.tensor(v) for k, v in state.items()}).unexpected_keys
    assert not missing, missing
    return pm


def peft_step(pm, ids, labels):
    """(loss, {krnl key: float64 gradient}) of PyTorch autograd through PEFT's DoRA."""
    torch, _ = torch_modules()
    out = pm(torch.tensor(ids), labels=torch.tensor(labels))
    out.loss.backward()
    key = lambda n: n.replace(".default", "").replace("magnitude_vector.weight", "magnitude_vector")  # noqa: E731
    return float(out.loss.detach()), {key(n): p.grad.double().numpy() for n, p in pm.named_parameters()
                                      if p.requires_grad}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (folder, targets)}: hf_families.family_models' with qwen2's q and v adapted (k frozen
    inside the group) and down."""
    f = family_models(tmp_path_factory, "dora")
    return {k: (v, PHI3_MODULES if k == "phi3" else QV + ("down_proj",) if k == "qwen2" else ALL_MODULES)
            for k, v in f.items()}


# variants of llama's run: (environment, model keywords, targets or None for the family's)
VARIANTS = {"plain": ({}, {}, None), "checkpointed": ({}, {"grad_checkpoint": True}, None),
            "q,v": ({}, {}, QV), "folded": ({"KRNL_LORA_FOLD": "1"}, {}, None),
            "folded q,v,o": ({"KRNL_LORA_FOLD": "1", "KRNL_LORA_FIRST": "0"}, {}, QV + ("o_proj",)),
            "ungrouped": ({"KRNL_LORA_GROUPS": "0"}, {}, None), "frozen first": ({"KRNL_LORA_FIRST": "0"}, {}, None)}
CASES = [("llama", v) for v in VARIANTS] + [(f, "plain") for f in ("qwen2", "qwen3", "gemma2", "gemma3", "phi3")]


@pytest.mark.torch
@pytest.mark.parametrize("family, variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_loss_and_gradients_equal_peft(folders, family, variant, monkeypatch):
    env, kw, targets = VARIANTS[variant]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    folder, family_targets = folders[family]
    m, lora, st = dora_model(folder, targets or family_targets, **kw)
    ids, labels, tg = family_batch(3)
    loss, grads = lora_step(m, ids, tg)
    ref_loss, ref = peft_step(peft_model(folder, lora, st), ids, labels)
    assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
    assert len(ref) == 3 * len(lora.target_modules) * m.config.num_hidden_layers
    assert grad_error(grads, ref) <= GRAD_RTOL


@pytest.mark.torch
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_adapters_go_both_ways_and_fuse_equals_peft_merge(folders, family, tmp_path):
    """krnl's DoRA adapter: PEFT loads it (use_dora) with krnl's loss and krnl reads it back; PEFT's
    own save reads in krnl with the same tensors; fuse writes merge_and_unload's weights."""
    torch, _ = torch_modules()
    peft = pytest.importorskip("peft")
    folder, targets = folders[family]
    m, lora, st = dora_model(folder, targets)
    ids, labels, tg = family_batch(4)
    cfg = adapter_io.peft_config(lora, str(folder), model_config=m.config)
    adapter_io.save_adapter(tmp_path / "ad", st, cfg, m.config)
    assert cfg["use_dora"] is True
    pm = peft.PeftModel.from_pretrained(hf_model(folder), str(tmp_path / "ad")).eval()
    with torch.no_grad():
        assert float(pm(torch.tensor(ids), labels=torch.tensor(labels)).loss) == pytest.approx(m.loss(ids, tg),
                                                                                           rel=LOSS_RTOL)
    assert hf.load_model(folder, krnl.device("cpu"), adapter=tmp_path / "ad").loss(ids, tg) == m.loss(ids, tg)
    pm.save_pretrained(str(tmp_path / "theirs"))
    lora2, t2, _ = adapter_io.read_adapter(tmp_path / "theirs", m.config)
    assert lora2.use_dora and t2.keys() == st.keys() and all(np.array_equal(t2[k], st[k]) for k in st)
    hf.fuse(folder, tmp_path / "ad", tmp_path / "fused")
    from safetensors.numpy import load_file

    fused = load_file(str(tmp_path / "fused" / "model.safetensors"))
    merged = {k: v.numpy() for k, v in pm.merge_and_unload().state_dict().items()}
    changed = [k for k in fused if not np.array_equal(fused[k], merged[k])]
    assert len(changed) == len(targets) * m.config.num_hidden_layers  # only the adapted weights moved
    for k in changed:
        assert np.abs(fused[k] - merged[k]).max() <= 1e-6 * np.abs(merged[k]).max(), k


def mlx_loss(path, ids, adapter):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    model, _ = load(str(path), adapter_path=str(adapter))
    model.set_dtype(mx.float32)
    logits = model(mx.array(ids[:, :-1])).astype(mx.float32)
    return nn.losses.cross_entropy(logits, mx.array(ids[:, 1:])).mean().item()


@pytest.mark.mlx
def test_mlx_lm_dora_adapters_go_both_ways(tmp_path):
    """mlx-lm's own DoRA adapter (linear_to_lora_layers use_dora, m and B off their start) gives
    mlx-lm's loss in krnl; krnl's, written in mlx-lm's layout, gives krnl's loss in mlx-lm."""
    mx, utils = pytest.importorskip("mlx.core"), pytest.importorskip("mlx_lm.tuner.utils")
    from mlx.utils import tree_flatten
    from mlx_lm import load

    base = make_base(tmp_path / "base", num_hidden_layers=3)
    ids = np.random.default_rng(2).integers(0, 61, (2, 12))
    params = {"rank": 3, "scale": 1.5, "dropout": 0.0,
              "keys": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]}
    model, _ = load(str(base))
    utils.linear_to_lora_layers(model, 2, params, use_dora=True)
    mx.random.seed(3)
    ad = {k: v + 0.3 * mx.random.normal(v.shape) if k.endswith(("lora_b", ".m")) else v
          for k, v in tree_flatten(model.parameters()) if k.endswith(("lora_a", "lora_b", ".m"))}
    (tmp_path / "theirs").mkdir()
    mx.save_safetensors(str(tmp_path / "theirs" / "adapters.safetensors"), ad)
    (tmp_path / "theirs" / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "dora", "num_layers": 2, "lora_parameters": params}))
    mine = hf.load_model(base, krnl.device("cpu"), adapter=tmp_path / "theirs")
    assert mine.lora_config.use_dora and mine.lora_config.layers == [1, 2]
    assert mine.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(mlx_loss(base, ids, tmp_path / "theirs"), rel=1e-4)
    m, lora, st = dora_model(base, ("q_proj", "o_proj", "gate_proj"), layers=[1, 2])
    adapter_io.save_mlx_adapter(tmp_path / "ours", lora, st, m.config)
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["fine_tune_type"] == "dora"
    loss = m.loss(ids[:, :-1], ids[:, 1:])
    assert loss == pytest.approx(mlx_loss(base, ids, tmp_path / "ours"), rel=1e-4)
    assert hf.load_model(base, krnl.device("cpu"), adapter=tmp_path / "ours").loss(ids[:, :-1], ids[:, 1:]) == loss


def test_fuse_of_a_quantized_gguf_base(tmp_path):
    """QDoRA on a GGUF file (Q8_0 and Q4_0 projections): fuse writes weights whose plain model gives
    the DoRA model's loss (the norm of the dequantized rows on both sides)."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf
    from krnl.formats.gguf.fuse import fuse_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, types={"blk.0.attn_q.weight": "Q8_0", "blk.1.ffn_down.weight": "Q4_0"})
    m, lora, st = dora_model(path, ("q_proj", "v_proj", "down_proj"))
    adapter_io.save_adapter(tmp_path / "ad", st, adapter_io.peft_config(lora, model_config=m.config), m.config)
    fuse_gguf(path, tmp_path / "ad", tmp_path / "fused", dtype="f32")
    ids = np.random.default_rng(5).integers(0, m.config.vocab_size, (2, 10))
    fused = hf.load_model(tmp_path / "fused", krnl.device("cpu"))
    assert fused.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(m.loss(ids[:, :-1], ids[:, 1:]), rel=1e-5)


# ---- without torch: the tiny Llama of conftest

def tiny(dev="cpu", dtype="f32", quantize=None, weights=None, grad_checkpoint=False, **lora_kw):
    """conftest's tiny Llama (F 64: every input size a multiple of 32, so it quantizes) with DoRA r=2."""
    cfg = ModelConfig.from_dict({**TINY_LLAMA, "intermediate_size": 64})
    weights = random_weights(cfg, 0, std=0.2) if weights is None else weights
    lora = LoraConfig(**{"r": 2, "alpha": 4.0, "use_dora": True, **lora_kw})
    m = LlamaModel(krnl.device(dev), cfg, weights, lora, dtype=dtype, quantize=quantize,
                   grad_checkpoint=grad_checkpoint)
    perturb(m)
    return m


BATCH = tuple(np.random.default_rng(7).integers(0, 61, (2, 2, 9)))


def test_gradients_against_finite_differences():
    """Each parameter kind's gradient against central differences of the loss along a random
    direction (f32: a step of 1e-3 keeps rounding noise and curvature ~1e-3 of the derivative). The norm is a
    constant to the gradient: A and B move with each magnitude rescaled by the norm's change, so
    that the scale m / ||W + s B A|| stays the one at the point (the detached norm's derivative)."""
    m = tiny()
    weights, s = random_weights(m.config, 0, std=0.2), m.lora_config.scale
    loss, grads = lora_step(m, *BATCH)
    st, rng = m.lora_state(), np.random.default_rng(3)

    def norms(p):
        return {k: np.linalg.norm(weights[k[len("base_model.model."):].replace("lora_magnitude_vector", "weight")]
                                  + s * p[k.replace("magnitude_vector", "B.weight")].astype(np.float64)
                                  @ p[k.replace("magnitude_vector", "A.weight")], axis=1)
                for k in p if k.endswith("magnitude_vector")}
    n0 = norms(st)
    for kind in (".lora_A.", ".lora_B.", "magnitude_vector"):
        u = {k: rng.standard_normal(v.shape).astype(np.float32) if kind in k else 0 * v for k, v in st.items()}
        eps = 1e-3

        def at(t):
            p = {k: v + t * u[k] for k, v in st.items()}
            if kind != "magnitude_vector":
                p.update({k: p[k] * n / n0[k] for k, n in norms(p).items()})
            m.lora_params.load(p)
            return m.loss(*BATCH)
        numeric = (at(eps) - at(-eps)) / (2 * eps)
        analytic = sum(float(np.sum(grads[k] * u[k])) for k in st)
        assert analytic == pytest.approx(numeric, rel=5e-3), kind
        assert abs(numeric) > 0.1, kind


def test_starts_as_the_base_and_adapter_off_is_the_base():
    """Magnitudes start at ||W_o||: a fresh DoRA model's loss is the base's; adapter_off (B zeroed,
    the scale off) gives the base's loss bit for bit, and the adapter's after."""
    cfg = ModelConfig.from_dict({**TINY_LLAMA, "intermediate_size": 64})
    w = random_weights(cfg, 0, std=0.2)
    base = LlamaModel(krnl.device("cpu"), cfg, w, LoraConfig(r=2, alpha=4.0)).loss(*BATCH)
    fresh = LlamaModel(krnl.device("cpu"), cfg, w, LoraConfig(r=2, alpha=4.0, use_dora=True))
    assert fresh.loss(*BATCH) == base
    m = tiny(weights=w)
    tuned = m.loss(*BATCH)
    with adapter_off(m):
        assert m.loss(*BATCH) == base
    assert m.loss(*BATCH) == tuned != base


def test_quantized_base_equals_its_dequantized_copy():
    """QDoRA: on a base quantized on load, the loss and gradients equal those of a dense model
    holding the dequantized weights (the norm from the dequantized rows); bf16 runs finite."""
    from krnl.quant import affine

    q = tiny(quantize=(4, 32))
    deq = {k: affine.dequantize(*affine.quantize(v, 4, 32), 4, 32) if ".layers." in k and v.ndim == 2 else v
           for k, v in random_weights(q.config, 0, std=0.2).items()}
    loss, grads = lora_step(q, *BATCH)
    ref_loss, ref = lora_step(tiny(weights=deq), *BATCH)
    assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL) and grad_error(grads, ref) <= GRAD_RTOL
    loss16, grads16 = lora_step(tiny(dtype="bf16", quantize=(4, 32)), *BATCH)
    assert np.isfinite(loss16) and all(np.isfinite(g).all() for g in grads16.values())


def test_sample_order_equals_rows():
    m = tiny()
    ref = lora_step(m, *BATCH)
    m.sums.on = True
    assert_step_close(ref, lora_step(m, *BATCH), 1e-6, 1e-5)


def test_generation_holds_the_scale_it_computes():
    """generate() reuses each linear's scale over its tokens (held, dropped after): its greedy
    tokens are the argmax of logits() computed per call."""
    m = tiny()
    prompt = [5, 9, 11]
    got = m.generate(prompt, max_new_tokens=4)
    assert all(d.held is None for d in m.dora.linears)
    seq = list(prompt)
    for _ in range(4):
        seq.append(int(np.argmax(m.logits(np.array([seq]))[0, -1])))
    assert got == seq[len(prompt):]


def test_serve_switches_between_dora_adapters_and_the_base(tmp_path):
    """serve's Adapters: "" is the base model (B zeroed, the scale off), an adapter its own logits,
    with the scales held while it serves and recomputed after a switch."""
    from krnl.serve.adapters import Adapters

    m, ids = tiny(), np.array([[3, 14, 15, 9, 2, 6]])
    for name, seed in (("a", 1), ("b", 2)):
        perturb(m, seed)
        adapter_io.save_adapter(tmp_path / name, m.lora_state(), adapter_io.peft_config(m.lora_config), m.config)
    want = {n: LlamaModel(krnl.device("cpu"), m.config, random_weights(m.config, 0, std=0.2),
                          LoraConfig(r=2, alpha=4.0, use_dora=n != "")) for n in ("", "a", "b")}
    for n in ("a", "b"):
        adapter_io.load_adapter_into(want[n], tmp_path / n)
    ad = Adapters(m, {"a": tmp_path / "a", "b": tmp_path / "b"})
    for n in ("a", "", "b", "a"):
        ad.use(n)
        np.testing.assert_array_equal(m.logits(ids), want[n].logits(ids))


def test_dropout_and_checkpointing_train():
    """With dropout (mlx-lm's form: the frozen product reads x) and gradient checkpointing: the
    loss finite, every gradient non-zero."""
    loss, grads = lora_step(tiny(dropout=0.3, grad_checkpoint=True), *BATCH)
    assert np.isfinite(loss) and all(np.abs(g).max() > 0 for g in grads.values())


def test_refused_on_experts():
    cfg = ModelConfig.from_dict({**TINY_LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 16, "head_dim": 8})
    with pytest.raises(ValueError, match=r"^\[LoraConfig\] DoRA on the experts' or router's LoRA") as e:
        LoraConfig(use_dora=True).validate(cfg)
    assert "\n" not in str(e.value)
    LoraConfig(use_dora=True, target_modules=("q_proj", "v_proj")).validate(cfg)


def test_cli_and_config_file(tmp_path, monkeypatch, capsys):
    """--fine-tune-type dora (and the config file's fine_tune_type, mlx-lm's key): the adapter says
    use_dora and holds the magnitudes; eval reads it back."""
    from krnl.cli.main import main

    monkeypatch.chdir(tmp_path)
    tiny_run = ["--iters", "2", "--train-samples", "64", "--batch-size", "4", "--quiet", "--steps-per-eval", "0"]
    assert main(["train", "--fine-tune-type", "dora", "--adapter-path", "a", *tiny_run]) == 0
    assert "DoRA r=16" in capsys.readouterr().out
    (tmp_path / "c.yaml").write_text("fine_tune_type: dora\nlora_parameters: {rank: 4, keys: [self_attn.q_proj]}\n")
    assert main(["train", "--config", "c.yaml", "--adapter-path", "b", "--adapter-format", "mlx", *tiny_run]) == 0
    from safetensors.numpy import load_file

    for path, keys in (("a/adapter_model.safetensors", "lora_magnitude_vector"), ("b/mlx/adapters.safetensors", ".m")):
        assert any(k.endswith(keys) for k in load_file(str(tmp_path / path))), path
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["use_dora"] is True
    assert json.loads((tmp_path / "b" / "mlx" / "adapter_config.json").read_text())["fine_tune_type"] == "dora"
    assert main(["eval", "--adapter-path", "a"]) == 0
    assert "loss" in capsys.readouterr().out


@pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
@pytest.mark.parametrize("dtype, tol", [("f32", 1e-5), ("bf16", 3e-2)])
def test_metal_sim_step_matches_cpu(dtype, tol):
    """One DoRA step on metal-sim (its capabilities fold the LoRA products) against the CPU in f32."""
    assert_step_close(lora_step(tiny(), *BATCH), lora_step(tiny("metal-sim", dtype), *BATCH), tol, 4 * tol)
