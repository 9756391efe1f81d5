"""Mixture-of-experts families (qwen3_moe, mixtral, olmoe) against transformers and PEFT on tiny random
models the tests build: loss and logits, the router's choices, the LoRA gradients of attention and
experts through PEFT's target_parameters, krnl's adapter in PEFT, fuse in transformers, KV-cached
greedy tokens; and, without torch, the checkpoint layouts, adapter round trips and a CLI run."""

import json

import numpy as np
import pytest

import krnl
from krnl.formats import adapter as adapter_io
from krnl.formats import hf
from krnl.formats import experts
from krnl.models import moe
from krnl.models.config import LoraConfig, ModelConfig, random_weights
from krnl.models.model import LlamaModel

from conftest import lora_step
from hf_families import V, assert_greedy_matches, hf_model, random_b, save_random, token_batch, torch_loss
from hf_families import torch_modules as _torch_modules
from mlx_folders import write_tokenizer
from mlx_folders import write_data

# Tiny folders: E not a power of two, K > 1, qwen3_moe with and without norm_topk_prob (its
# per-head q/k norms, head_dim 10 with hidden 48), Mixtral (always renormalised) with GQA.
FOLDERS = {
    "qwen3_moe-norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=48, moe_intermediate_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=10, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=False)),
    "qwen3_moe-raw": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=32, moe_intermediate_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=7, num_experts_per_tok=3, norm_topk_prob=False,
        tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=48, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=3, num_experts_per_tok=2, tie_word_embeddings=False)),
    # OLMoE: RMSNorm over the whole q (H D = 48) and k (Hk D = 24), norm_topk_prob False by default
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        hidden_size=48, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=5, num_experts_per_tok=2, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
LOSS_RTOL, GRAD_RTOL = 2e-5, 1e-4


def torch_modules():
    """torch and transformers, where transformers holds the experts fused (5.0 on) and PEFT, if
    installed, adapts them through target_parameters (0.17 on); else the test skips saying so."""
    torch, transformers = _torch_modules()
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__} keeps experts as modules; these checks need 5.0 or later")
    try:
        import peft
    except ImportError:
        return torch, transformers
    if tuple(int(x) for x in peft.__version__.split(".")[:2]) < (0, 17):
        pytest.skip(f"PEFT {peft.__version__} has no target_parameters; these checks need 0.17 or later")
    return torch, transformers


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch, transformers = torch_modules()
    root, out = tmp_path_factory.mktemp("moe"), {}
    for i, (name, (cfg, model, kw)) in enumerate(FOLDERS.items()):
        c = getattr(transformers, cfg)(vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6, **kw)
        torch.manual_seed(i)
        out[name] = save_random(getattr(transformers, model)(c), root / name, 40 + i)
    return out


def peft_layout(config, tensors):
    """krnl's factors (or gradients) under PEFT's keys and layouts."""
    return adapter_io._peft_experts_out(tensors, config)


def peft_model(folder, lora, state):
    """transformers' model of `folder` with PEFT's LoRA on attention (target_modules) and the experts
    (target_parameters), its factors set from krnl's `state`."""
    torch, _ = torch_modules()
    peft = pytest.importorskip("peft")
    m = hf_model(folder)
    known = adapter_io.peft_parameters(hf.read_config(folder))
    mods = [t for t in lora.target_modules if t not in known]
    params = [known[t] for t in lora.target_modules if t in known]
    cfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=mods or None, target_parameters=params)
    pm = peft.get_peft_model(m, cfg)
    sd = peft_layout(hf.read_config(folder), state)
    missing, _ = peft.set_peft_model_state_dict(pm, {k: torch.tensor(v) for k, v in sd.items()}), None
    names = {n.replace(".default", "") for n, p in pm.named_parameters() if p.requires_grad}
    assert names == set(sd), sorted(names ^ set(sd))
    return pm


def router_choices(m, ids):
    """Each layer's (N, K) expert ids as krnl's forward routes them."""
    seen = []
    real = moe.ops

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def moe_route(logits, ids_t, w, norm):
            real.moe_route(logits, ids_t, w, norm)
            seen.append(ids_t)

    moe.ops = Spy()
    try:
        m.loss(ids, ids)
    finally:
        moe.ops = real
    return [np.asarray(t.numpy()) for t in seen]


@pytest.mark.torch
@pytest.mark.parametrize("name", list(FOLDERS))
def test_loss_logits_and_routing_match_transformers(folders, name):
    torch, _ = torch_modules()
    ids, labels, targets = token_batch(V, seed=1)
    ref = hf_model(folders[name])
    with torch.no_grad():  # output_router_logits adds the load-balancing loss to out.loss
        out = ref(torch.tensor(ids), labels=torch.tensor(labels))
        routed = ref(torch.tensor(ids), output_router_logits=True)
    m = hf.load_model(folders[name], krnl.device("cpu"))
    assert m.loss(ids, targets) == pytest.approx(float(out.loss), rel=LOSS_RTOL)
    want = out.logits.numpy()
    assert np.abs(m.logits(ids) - want).max() <= 1e-5 * np.abs(want).max()
    K = m.config.moe["top_k"]
    got = router_choices(m, ids)
    assert len(got) == len(routed.router_logits)
    for mine, lg in zip(got, routed.router_logits):
        p = torch.softmax(lg.float(), -1)
        assert np.array_equal(np.sort(mine, -1), np.sort(torch.topk(p, K, -1).indices.numpy(), -1))
        assert len(np.unique(mine)) > K  # the batch reaches more experts than one token's


@pytest.mark.torch
@pytest.mark.parametrize("name, targets", [("qwen3_moe-norm", TARGETS), ("qwen3_moe-raw", ("gate_up_proj",)),
                                           ("mixtral", ("v_proj", "down_proj")), ("mixtral", TARGETS),
                                           ("qwen3_moe-raw", ("router", "down_proj")), ("mixtral", ("router",)),
                                           ("olmoe", TARGETS + ("router",))])
def test_lora_gradients_match_peft(folders, name, targets):
    """Every factor's gradient, attention's, the experts' and the router's, against PyTorch autograd
    through PEFT (target_parameters on the fused experts and on the router's weight), the gradient
    through the routing weights included."""
    torch, _ = torch_modules()
    lora = LoraConfig(r=3, alpha=5.0, target_modules=targets)
    m = hf.load_model(folders[name], krnl.device("cpu"), lora=lora)
    st = random_b(m, 1)
    ids, labels, tg = token_batch(V, seed=2)
    loss, grads = lora_step(m, ids, tg)
    pm = peft_model(folders[name], lora, st)
    out = pm(torch.tensor(ids), labels=torch.tensor(labels))
    out.loss.backward()
    ref = {n.replace(".default", ""): p.grad.double().numpy() for n, p in pm.named_parameters() if p.requires_grad}
    assert loss == pytest.approx(float(out.loss.detach()), rel=LOSS_RTOL)
    mine = peft_layout(m.config, grads)
    assert set(mine) == set(ref)
    for k, g in ref.items():
        scale = np.abs(g).max()
        assert scale > 0, k
        assert np.abs(mine[k] - g).max() <= GRAD_RTOL * scale, k


@pytest.mark.torch
@pytest.mark.parametrize("name", ["qwen3_moe-raw", "mixtral"])
def test_load_balancing_loss_matches_transformers(folders, name):
    """aux_loss() is transformers' aux_loss; with a coefficient, the loss and every LoRA gradient are
    those of transformers' loss with output_router_logits (CE + coef aux) through PEFT."""
    torch, _ = torch_modules()
    coef = 0.3
    lora = LoraConfig(r=3, alpha=5.0, target_modules=("q_proj", "gate_up_proj", "down_proj"))
    m = hf.load_model(folders[name], krnl.device("cpu"), lora=lora)
    m.aux_loss_coef = coef
    st = random_b(m, 2)
    ids, labels, tg = token_batch(V, seed=5)
    loss, grads = lora_step(m, ids, tg)
    pm = peft_model(folders[name], lora, st)
    pm.base_model.model.router_aux_loss_coef = coef  # read from the config at init
    out = pm(torch.tensor(ids), labels=torch.tensor(labels), output_router_logits=True)
    out.loss.backward()
    assert m.aux_loss() == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert loss + coef * m.aux_loss() == pytest.approx(float(out.loss.detach()), rel=LOSS_RTOL)
    ref = {n.replace(".default", ""): p.grad.double().numpy() for n, p in pm.named_parameters() if p.requires_grad}
    mine = peft_layout(m.config, grads)
    for k, g in ref.items():
        assert np.abs(mine[k] - g).max() <= GRAD_RTOL * np.abs(g).max(), k
    m.aux_loss_coef = 0.0  # the coefficient moves the gradients: without it they differ
    _, plain = lora_step(m, ids, tg)
    assert any(np.abs(plain[k] - grads[k]).max() > 1e-4 * np.abs(grads[k]).max() for k in grads)


@pytest.mark.torch
@pytest.mark.parametrize("name", ["qwen3_moe-norm", "mixtral", "olmoe"])
def test_krnl_adapter_in_peft_and_fuse_in_transformers(folders, name, tmp_path):
    torch, _ = torch_modules()
    peft = pytest.importorskip("peft")
    folder = folders[name]
    lora = LoraConfig(r=2, alpha=6.0, target_modules=("q_proj", "gate_up_proj", "down_proj", "router"))
    m = hf.load_model(folder, krnl.device("cpu"), lora=lora)
    st = random_b(m, 3)
    cfg = adapter_io.peft_config(lora, str(folder), model_config=m.config)
    assert cfg["target_modules"] == ["q_proj"]
    assert cfg["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]
    adapter_io.save_adapter(tmp_path / "ad", st, cfg, m.config)
    ids, labels, targets = token_batch(V, seed=4)
    mine = m.loss(ids, targets)
    assert abs(mine - torch_loss(hf_model(folder), ids, labels)) > 1e-3  # the adapter matters
    pm = peft.PeftModel.from_pretrained(hf_model(folder), str(tmp_path / "ad")).eval()
    assert torch_loss(pm, ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)
    again = hf.load_model(folder, krnl.device("cpu"), adapter=tmp_path / "ad")
    assert again.loss(ids, targets) == pytest.approx(mine, rel=1e-6)

    hf.fuse(folder, tmp_path / "ad", tmp_path / "fused")
    t, orig = hf.read_tensors(tmp_path / "fused"), hf.read_tensors(folder)
    assert sorted(t) == sorted(orig)  # per expert, as transformers wrote the base
    assert torch_loss(hf_model(tmp_path / "fused"), ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)


@pytest.mark.torch
@pytest.mark.parametrize("name", list(FOLDERS))
def test_greedy_generation_matches_transformers(folders, name):
    torch_modules()
    assert_greedy_matches(folders[name])


# ---------------------------------------------------------------------------------------------
# Without torch

CFG = dict(model_type="qwen3_moe", vocab_size=V, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=5, num_experts_per_tok=2,
           norm_topk_prob=True, max_position_embeddings=64)


def write_folder(folder, cfg, seed=5, std=0.3):
    """A tiny float HF folder of `cfg` as transformers writes it (experts per expert) with the keys
    mlx-lm's model classes need too; returns ModelConfig and the per-expert tensors."""
    from safetensors.numpy import save_file

    full = dict(cfg, rope_theta=10000.0, rms_norm_eps=1e-6, intermediate_size=48, decoder_sparse_step=1,
                mlp_only_layers=[], tie_word_embeddings=False)
    config = ModelConfig.from_dict(full)
    per = {}
    for k, v in random_weights(config, seed=seed, std=std).items():
        per.update(experts.expert_pieces(config, k, v))
    folder.mkdir(parents=True)
    save_file({k: np.ascontiguousarray(v) for k, v in per.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(full))
    write_tokenizer(folder)
    return config, per


def test_peft_factor_layout_round_trips():
    """PEFT's expert factors: A (E r, in) rows e r..(e+1) r are expert e's; B (out, r E) column
    j E + e is rank j of expert e; and the nesting of its keys."""
    rng = np.random.default_rng(0)
    E, r, F, C = 5, 3, 4, 6
    A, B = rng.standard_normal((E, r, C)).astype(np.float32), rng.standard_normal((2, E, F, r)).astype(np.float32)
    pa, pb = experts.peft_factors(A, B)
    for e in range(E):
        full = np.concatenate([B[0, e], B[1, e]])                         # (2F, r)
        np.testing.assert_array_equal(pb[:, np.arange(r) * E + e], full)
        np.testing.assert_array_equal(pa[e * r:(e + 1) * r], A[e])
    back = experts.held_factors(pa, pb, E, True)
    np.testing.assert_array_equal(back[0], A)
    np.testing.assert_array_equal(back[1], B)
    keys = experts.peft_expert_keys(1, ("down_proj", "gate_up_proj"))
    assert keys["gate_up_proj"][0] == "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"
    assert keys["down_proj"][1] == "base_model.model.model.layers.1.mlp.experts.lora_B.weight"
    assert experts.peft_expert_keys(0, ("down_proj",))["down_proj"][0].endswith("layers.0.mlp.experts.lora_A.weight")


def test_per_expert_folder_reads_as_fused(tmp_path):
    """transformers' save_pretrained layout (per expert; Mixtral's w1/w3/w2) and the fused one give
    the same model."""
    from safetensors.numpy import save_file

    for mt, extra in (("qwen3_moe", {}), ("mixtral", {"num_local_experts": 5, "intermediate_size": 16})):
        d = dict(CFG, model_type=mt, **extra)
        config = ModelConfig.from_dict(d)
        w = random_weights(config, seed=3, std=0.3)
        per = {}
        for k, v in w.items():
            per.update(experts.expert_pieces(config, k, v))
        assert not any("experts.gate_up_proj" in k for k in per) and len(per) > len(w)
        for name, ws in (("fused", w), ("per", per)):
            (tmp_path / mt / name).mkdir(parents=True)
            save_file({k: np.ascontiguousarray(v) for k, v in ws.items()},
                      str(tmp_path / mt / name / "model.safetensors"))
            (tmp_path / mt / name / "config.json").write_text(json.dumps(d))
        ids = np.random.default_rng(1).integers(0, V, (2, 9))
        a, b = (hf.load_model(tmp_path / mt / n, krnl.device("cpu")).loss(ids, ids) for n in ("fused", "per"))
        assert a == b


def test_moe_bad_configs_and_options():
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_dict(dict(CFG, mlp_only_layers=[1]))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(6\) exceeds the 5 experts"):
        ModelConfig.from_dict(dict(CFG, num_experts_per_tok=6))
    config = ModelConfig.from_dict(CFG)
    with pytest.raises(ValueError, match="dropout 0.1 on the experts' or router's LoRA"):
        LoraConfig(dropout=0.1).validate(config)
    lc = LoraConfig(target_modules=("q_proj", "gate_proj", "up_proj", "down_proj"))
    lc.validate(config)
    assert lc.target_modules == ("q_proj", "gate_up_proj", "down_proj")
    w = random_weights(config)
    with pytest.raises(ValueError, match=r"experts.down_proj \(5, 32, 16\): its input size must be a multiple of "
                                         r"--q-group-size 32"):
        LlamaModel(krnl.device("cpu"), config, w, quantize=(4, 32))


def test_training_lowers_the_loss_and_leaves_frozen_weights(tmp_path):
    """A few steps on the CPU lower the loss of a fixed batch; the router and the experts' frozen
    weights stay as loaded."""
    from krnl.train.optim import AdamW, Schedule

    config = ModelConfig.from_dict(CFG)
    m = LlamaModel(krnl.device("cpu"), config, random_weights(config, seed=4, std=0.3),
                   lora=LoraConfig(r=4, alpha=8, target_modules=("gate_up_proj", "down_proj")))
    before = {k: np.array(v.numpy()) for k, v in m.layers[0].frozen().items()}
    ids = np.random.default_rng(2).integers(0, V, (2, 12))
    opt = AdamW(m.lora_params, Schedule(1e-2, kind="constant"))
    first = m.loss(ids, ids)
    for _ in range(8):
        m.zero_grads()
        m.forward_backward(ids, ids)
        opt.step()
    assert m.loss(ids, ids) < first - 0.05
    for k, v in m.layers[0].frozen().items():
        np.testing.assert_array_equal(np.asarray(v.numpy()), before[k], err_msg=k)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe"])
def test_cli_trains_evaluates_and_fuses_a_moe_folder(tmp_path, model_type):
    """train (router adapted, load-balancing loss trained with), fuse (written back per expert),
    generate from the fused folder and eval with the adapter, for each family from an HF folder."""
    from krnl.cli.main import main

    folder = tmp_path / "base"
    _, per = write_folder(folder, dict(CFG, model_type=model_type, num_local_experts=CFG["num_experts"]))
    write_data(tmp_path / "data")
    out = tmp_path / "ad"
    assert main(["train", "--model", str(folder), "--data", str(tmp_path / "data"), "--device", "cpu", "--dtype",
                 "f32", "--iters", "3", "--batch-size", "2", "--lora-rank", "2", "--steps-per-eval", "0", "--quiet",
                 "--no-tune", "--adapter-path", str(out), "--router-aux-loss-coef", "0.01", "--lora-targets",
                 "q,k,v,o,gate,up,down,router"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) and 0 < r["aux_loss"] < 1e3 for r in rows)
    ac = json.loads((out / "adapter_config.json").read_text())
    assert ac["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]
    assert main(["fuse", "--model", str(folder), "--adapter-path", str(out), "--save-path",
                 str(tmp_path / "fused")]) == 0
    assert sorted(hf.read_tensors(tmp_path / "fused")) == sorted(per)
    assert main(["generate", "--model", str(tmp_path / "fused"), "--prompt", "w1 w2", "--max-tokens", "3",
                 "--device", "cpu"]) == 0
    assert main(["eval", "--model", str(folder), "--adapter-path", str(out), "--data", str(tmp_path / "data"),
                 "--device", "cpu"]) == 0


def _dequantized(weights):
    return {k: np.asarray(v, np.float32) for k, v in weights.items()}


def test_quantized_experts_train_as_their_dequantized_weights(tmp_path):
    """Experts quantized on load (and an MLX folder's, below) run through moe_quantized_matmul: the
    loss and every LoRA gradient equal those of a float model holding the dequantized weights."""
    from conftest import assert_step_close

    _, per = write_folder(tmp_path / "base", dict(CFG, hidden_size=64, head_dim=16, moe_intermediate_size=32))
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("q_proj", "gate_up_proj", "down_proj"))
    q = hf.load_model(tmp_path / "base", krnl.device("cpu"), lora=lora, quantize=(4, 32))
    assert type(q.layers[0].mlp.gate).__name__ == "QuantizedWeight" and q.layers[0].mlp.gate.w.ndim == 3
    st = random_b(q, 4)
    deq = {}
    for i, L in enumerate(q.layers):  # the model's experts as it holds them, dequantized
        W = [np.asarray(x.numpy(), np.float32) if hasattr(x, "numpy") else None for x in (L.mlp.gate, L.mlp.up)]
        deq[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([W[0], W[1]], axis=1)
        deq[f"model.layers.{i}.mlp.experts.down_proj"] = np.asarray(L.mlp.down.numpy(), np.float32)
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            deq[f"model.layers.{i}.self_attn.{m}.weight"] = np.asarray(L.linears()[m].W.numpy(), np.float32)
    base = hf.load_hf_weights(tmp_path / "base")
    f = LlamaModel(krnl.device("cpu"), q.config, {**_dequantized(base), **deq}, lora=lora)
    f.lora_params.load(st)
    ids = np.random.default_rng(3).integers(0, V, (2, 10))
    assert_step_close(lora_step(f, ids, ids), lora_step(q, ids, ids), 1e-5, 1e-4)


@pytest.mark.mlx
@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe"])
def test_mlx_quantized_moe_matches_mlx_lm(tmp_path, model_type):
    """mlx_lm.convert -q of a mixture's folder (switch_mlp experts at 4 bits; qwen3_moe's router at
    mlx-lm's 8): krnl reads it as stored and its loss equals mlx-lm's."""
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn

    write_folder(tmp_path / "base", dict(CFG, model_type=model_type, hidden_size=64, head_dim=16,
                                         moe_intermediate_size=32))
    mlx_lm.convert(str(tmp_path / "base"), str(tmp_path / "q"), quantize=True, q_bits=4, q_group_size=32)
    w = hf.load_hf_weights(tmp_path / "q")
    # olmoe's experts are intermediate_size (48) wide: mlx-lm leaves down_proj (in 48) in floats
    down = w["model.layers.1.mlp.experts.down_proj"]
    assert isinstance(down, krnl.quant.qweight.QuantizedArray) == (model_type == "qwen3_moe")
    assert all(isinstance(p, krnl.quant.qweight.QuantizedArray)
               for p in w["model.layers.0.mlp.experts.gate_up_proj"].parts)
    m = hf.load_model(tmp_path / "q", krnl.device("cpu"))
    model, _ = mlx_lm.load(str(tmp_path / "q"))
    model.set_dtype(mx.float32)
    for seed, n in ((0, 11), (1, 6)):
        ids = np.random.default_rng(seed).integers(0, V, (2, n)).astype(np.int32)
        logits = model(mx.array(ids[:, :-1])).astype(mx.float32)
        ref = nn.losses.cross_entropy(logits, mx.array(ids[:, 1:])).mean().item()
        assert m.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(ref, rel=1e-5)


GGUF_TYPES = {"blk.0.ffn_gate_exps.weight": "Q4_K", "blk.0.ffn_up_exps.weight": "Q8_0",
              "blk.0.ffn_down_exps.weight": "Q6_K", "blk.1.ffn_gate_exps.weight": "Q5_K",
              "blk.1.ffn_up_exps.weight": "F16", "blk.1.ffn_down_exps.weight": "Q4_0"}


@pytest.mark.parametrize("arch, per_expert", [("qwen3moe", False), ("llama", False), ("llama", True), ("olmoe", False)])
def test_gguf_moe_reads_quantized_experts_and_fuses(tmp_path, arch, per_expert):
    """llama.cpp's mixtures (qwen3moe, olmoe; Mixtral as llama with experts): ffn_*_exps held as the file
    quantizes them (older Mixtral files' ffn_gate.E one by one, stacked), the loss that of the float
    weights the file holds; trained adapter fused."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf
    from krnl.formats.gguf.file import read_gguf
    from krnl.formats.gguf.fuse import fuse_gguf

    path = tmp_path / "m.gguf"
    want = write_gguf(path, arch=arch, types=GGUF_TYPES, experts=(5, 2, 512), seed=2,  # llama: feed_forward_length
                      per_expert=per_expert)
    g = read_gguf(path, quiet=True)
    assert g.config.model_type == {"qwen3moe": "qwen3_moe", "llama": "mixtral", "olmoe": "olmoe"}[arch]
    assert g.config.moe["top_k"] == 2 and g.config.moe["norm_topk"] == (arch != "olmoe")
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("q_proj", "gate_up_proj", "down_proj"))
    m = hf.load_model(path, krnl.device("cpu"), lora=lora)
    assert type(m.layers[0].mlp.gate).__name__ == "QuantizedWeight" and m.layers[0].mlp.gate.bits == 4
    assert type(m.layers[1].mlp.up).__name__ != "QuantizedWeight"  # F16: dense
    f = LlamaModel(krnl.device("cpu"), g.config, want, lora=lora)
    st = random_b(m, 6)
    f.lora_params.load(st)
    ids = np.random.default_rng(1).integers(0, g.config.vocab_size, (2, 9))
    assert m.loss(ids, ids) == pytest.approx(f.loss(ids, ids), rel=1e-5)
    cfg = adapter_io.peft_config(lora, str(path), model_config=m.config)
    adapter_io.save_adapter(tmp_path / "ad", st, cfg, m.config)
    fuse_gguf(path, tmp_path / "ad", tmp_path / "fused", dtype="f32")
    fused = hf.load_model(tmp_path / "fused", krnl.device("cpu"))
    assert fused.loss(ids, ids) == pytest.approx(m.loss(ids, ids), rel=1e-5)


@pytest.mark.torch
@pytest.mark.parametrize("arch", ["qwen3moe", "llama", "olmoe"])
def test_gguf_moe_fused_folder_loads_in_transformers(tmp_path, arch):
    torch, _ = torch_modules()
    pytest.importorskip("gguf")
    from gguf_files import write_gguf
    from krnl.formats.gguf.fuse import fuse_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, arch=arch, types=GGUF_TYPES, experts=(5, 2, 512), seed=3)
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("v_proj", "gate_up_proj", "down_proj"))
    m = hf.load_model(path, krnl.device("cpu"), lora=lora)
    st = random_b(m, 7)
    adapter_io.save_adapter(tmp_path / "ad", st, adapter_io.peft_config(lora, str(path), model_config=m.config),
                            m.config)
    fuse_gguf(path, tmp_path / "ad", tmp_path / "fused", dtype="f32")
    ids = np.random.default_rng(2).integers(0, m.config.vocab_size, (2, 9))
    tg = np.concatenate([ids[:, 1:], np.full((2, 1), -100)], axis=1)  # transformers' labels=ids, shifted
    assert torch_loss(hf_model(tmp_path / "fused"), ids, ids) == pytest.approx(m.loss(ids, tg), rel=1e-4)


@pytest.mark.mlx
def test_quantize_and_fuse_write_mlx_moe_folders_as_mlx_lm(tmp_path):
    """krnl quantize of a float qwen3_moe folder writes what mlx_lm.convert -q writes (switch_mlp
    experts, the router at mlx-lm's 8 bits), tensor for tensor; fuse -q of an adapter into it
    loads in mlx-lm with krnl's loss."""
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn

    write_folder(tmp_path / "base", dict(CFG, hidden_size=64, head_dim=16, moe_intermediate_size=32))
    hf.quantize_folder(tmp_path / "base", tmp_path / "k", bits=4, group_size=32)
    mlx_lm.convert(str(tmp_path / "base"), str(tmp_path / "m"), quantize=True, q_bits=4, q_group_size=32)
    mine, theirs = hf.read_tensors(tmp_path / "k"), hf.read_tensors(tmp_path / "m")
    assert sorted(mine) == sorted(theirs) and any(".switch_mlp." in k for k in mine)
    for k in theirs:
        assert np.array_equal(np.asarray(mine[k].raw()), np.asarray(theirs[k].raw())), k
    q = json.loads((tmp_path / "k" / "config.json").read_text())["quantization"]
    assert q["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8, "mode": "affine"}

    lora = LoraConfig(r=2, alpha=4.0, target_modules=("q_proj", "gate_up_proj", "down_proj"))
    m = hf.load_model(tmp_path / "base", krnl.device("cpu"), lora=lora)
    st = random_b(m, 8)
    adapter_io.save_adapter(tmp_path / "ad", st, adapter_io.peft_config(lora, "", model_config=m.config), m.config)
    hf.fuse(tmp_path / "base", tmp_path / "ad", tmp_path / "fq", quantize=(4, 32))
    fq = hf.load_model(tmp_path / "fq", krnl.device("cpu"))
    model, _ = mlx_lm.load(str(tmp_path / "fq"))
    model.set_dtype(mx.float32)
    ids = np.random.default_rng(4).integers(0, V, (2, 10)).astype(np.int32)
    logits = model(mx.array(ids[:, :-1])).astype(mx.float32)
    ref = nn.losses.cross_entropy(logits, mx.array(ids[:, 1:])).mean().item()
    assert fq.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(ref, rel=1e-5)
    assert fq.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(m.loss(ids[:, :-1], ids[:, 1:]), rel=0.05)  # 4 bits of it


@pytest.mark.mlx
def test_mlx_lm_adapter_layout_of_experts(tmp_path):
    """--adapter-format mlx for a mixture: LoRASwitchLinear factors on switch_mlp's gate, up (one A,
    PEFT's) and down; mlx-lm loads the adapter onto its model of the folder with krnl's loss, and
    krnl reads it back to the same factors."""
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn

    write_folder(tmp_path / "base", dict(CFG, hidden_size=64, head_dim=16, moe_intermediate_size=32))
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("q_proj", "gate_up_proj", "down_proj", "router"))
    m = hf.load_model(tmp_path / "base", krnl.device("cpu"), lora=lora)
    st = random_b(m, 9)
    adapter_io.save_mlx_adapter(tmp_path / "ad", lora, st, m.config)
    model, _ = mlx_lm.load(str(tmp_path / "base"), adapter_path=str(tmp_path / "ad"))
    model.set_dtype(mx.float32)
    ids = np.random.default_rng(5).integers(0, V, (2, 10)).astype(np.int32)
    logits = model(mx.array(ids[:, :-1])).astype(mx.float32)
    ref = nn.losses.cross_entropy(logits, mx.array(ids[:, 1:])).mean().item()
    assert m.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(ref, rel=1e-5)
    back, tensors, info = adapter_io.read_adapter(tmp_path / "ad", m.config)
    assert info["format"] == "mlx" and set(back.target_modules) == set(lora.target_modules)
    for k, v in st.items():
        np.testing.assert_allclose(tensors[k], v, rtol=1e-6, err_msg=k)


@pytest.mark.parametrize("dtype, tol", [("bf16", 3e-2), ("f16", 5e-3)])
def test_moe_step_in_16_bit_dtypes_matches_f32(dtype, tol):
    """One LoRA step of a mixture in bf16 and f16 (activations, experts and router logits rounded;
    routing still in f32) against the f32 step: loss and every gradient within the dtype's reach."""
    from conftest import assert_step_close

    config = ModelConfig.from_dict(dict(CFG, hidden_size=64, head_dim=16, moe_intermediate_size=32))
    w = random_weights(config, seed=11, std=0.1)
    lora = LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "gate_up_proj", "down_proj"))
    models = {dt: LlamaModel(krnl.device("cpu"), config, w, lora=lora, dtype=dt) for dt in ("f32", dtype)}
    st = random_b(models["f32"], 12)
    models[dtype].lora_params.load(st)
    ids = np.random.default_rng(8).integers(0, V, (2, 12))
    assert_step_close(lora_step(models["f32"], ids, ids), lora_step(models[dtype], ids, ids), tol, 4 * tol)


@pytest.mark.parametrize("model_type, dtype, tol", [("qwen3_moe", "f32", 1e-5), ("qwen3_moe", "bf16", 3e-2),
                                                    ("olmoe", "f32", 1e-5)])
def test_moe_training_step_on_metal_sim_matches_cpu(model_type, dtype, tol):
    """One LoRA step of a tiny mixture (attention, experts and router adapted) on metal-sim, the
    MSL kernels of every moe op in a model's chain, against the CPU backend in the same dtype (bf16
    against f32 moves some gradients of this tiny model by 12-42% on the CPU alone: its routing is
    that sensitive to rounding)."""
    from conftest import METAL_SIM, assert_step_close

    if METAL_SIM is None:
        pytest.skip("metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
    config = ModelConfig.from_dict(dict(CFG, model_type=model_type, hidden_size=32, head_dim=8, moe_intermediate_size=16,
                                        intermediate_size=16, num_experts=5))
    w = random_weights(config, seed=13, std=0.2)
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("q_proj", "gate_up_proj", "down_proj", "router"))
    cpu = LlamaModel(krnl.device("cpu"), config, w, lora=lora, dtype=dtype)
    sim = LlamaModel(krnl.device("metal-sim"), config, w, lora=lora, dtype=dtype)
    st = random_b(cpu, 14)
    sim.lora_params.load(st)
    ids = np.random.default_rng(9).integers(0, V, (2, 7))
    assert_step_close(lora_step(cpu, ids, ids), lora_step(sim, ids, ids), tol, 4 * tol)


def test_moe_gradient_checkpointing_changes_nothing():
    """Checkpointed layers recompute their mixture in the backward (routing, grouping, the experts)
    without counting the load-balancing statistics twice: loss, aux loss and every gradient equal."""
    config = ModelConfig.from_dict(CFG)
    w = random_weights(config, seed=15, std=0.3)
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("q_proj", "gate_up_proj", "down_proj", "router"))
    runs = []
    for ckpt in (False, True):
        m = LlamaModel(krnl.device("cpu"), config, w, lora=lora, grad_checkpoint=ckpt)
        m.aux_loss_coef = 0.05
        if runs:
            m.lora_params.load(st)
        else:
            st = random_b(m, 16)
        ids = np.random.default_rng(10).integers(0, V, (2, 9))
        runs.append((*lora_step(m, ids, ids), m.aux_loss()))
    (l0, g0, a0), (l1, g1, a1) = runs
    assert l0 == l1 and a0 == a1
    for k in g0:
        np.testing.assert_array_equal(g0[k], g1[k], err_msg=k)


def test_switch_experts_read_mxfp4_and_refuse_other_microscaling():
    """mlx-lm's switch_mlp experts with U8 scales and no biases: MXFP4 (4 bits, groups of 32) is read
    in mode mxfp4; another microscaling layout (nvfp4's groups of 16) is refused by name, never read
    as affine codes."""
    class Stored:  # a LazyTensor's face: shape, ndim, st_dtype
        def __init__(self, shape, st_dtype):
            self.shape, self.ndim, self.st_dtype = shape, len(shape), st_dtype

    config = ModelConfig.from_dict(CFG)
    p = "model.layers.0.mlp.switch_mlp.gate_proj."
    tensors = {p + "weight": Stored((5, 16, 4), "U32"), p + "scales": Stored((5, 16, 1), "U8")}
    got = experts.stored_array(tensors[p + "weight"], tensors[p + "scales"], None, 32, "g")
    assert (got.mode, got.bits, got.group_size) == ("mxfp4", 4, 32)
    tensors[p + "scales"] = Stored((5, 16, 2), "U8")
    with pytest.raises(ValueError, match=r"\[hf\] f: model\.layers\.0\.mlp\.switch_mlp\.gate_proj\.scales: U8 scales "
                                         r"\(5, 16, 2\) with codes \(5, 16, 4\) are no MXFP4 of 32 inputs"):
        experts.switch_experts(tensors, config, "f")
