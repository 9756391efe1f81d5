"""gpt-oss (model_type "gpt_oss") against transformers and PEFT on tiny random models the tests build:
attention sinks, sliding and full layers alternating, biases on attention, router and experts, the
clamped SwiGLU over interleaved gate|up columns (a small limit, so that both clamps bite), YaRN rope;
loss, logits and routing, LoRA gradients through PEFT, the load-balancing loss, krnl's adapter in
PEFT and fuse in transformers, KV-cached greedy tokens; and, without torch, the config, the
checkpoint layout and a CLI run."""

import json

import numpy as np
import pytest

import krnl
from krnl.formats import adapter as adapter_io
from krnl.formats import experts, gpt_oss, hf
from krnl.models.config import LoraConfig, ModelConfig, random_weights
from krnl.quant import mxfp4

from conftest import lora_step
from hf_families import V, assert_greedy_matches, hf_model, random_b, save_random, token_batch, torch_loss
from mlx_folders import write_data, write_tokenizer
from test_moe import router_choices, torch_modules

YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
            original_max_position_embeddings=16)
# Windows 5 < T = 13; GQA; E = 5 experts (not a power of two), K = 2; head_dim 16 with hidden 40.
FOLDERS = {
    "yarn": dict(hidden_size=40, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=5, num_experts_per_tok=2, sliding_window=5,
                 swiglu_limit=1.0, rope_parameters=dict(YARN, truncate=False)),
    "types": dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, num_local_experts=3, num_experts_per_tok=3, sliding_window=4,
                  swiglu_limit=1.5, layer_types=["full_attention", "sliding_attention"],
                  rope_parameters=dict(YARN, factor=2.0)),
    # sizes MXFP4 takes (inputs of 32): its experts also written as OpenAI's checkpoints hold them
    "mxfp4": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                  swiglu_limit=1.0, rope_parameters=YARN),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj", "router")
LOSS_RTOL, GRAD_RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch, transformers = torch_modules()
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss")
    root, out = tmp_path_factory.mktemp("gpt_oss"), {}
    for i, (name, kw) in enumerate(FOLDERS.items()):
        c = transformers.GptOssConfig(vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False, **kw)
        torch.manual_seed(i)
        folder = save_random(transformers.GptOssForCausalLM(c), root / name, 60 + i)
        out[name] = folder
    out["mxfp4-blocks"] = mxfp4_folder(out["mxfp4"], root / "mxfp4-blocks")
    return out


def mxfp4_folder(src, dst):
    """The float gpt-oss folder src with its experts in MXFP4 as OpenAI's checkpoints store them:
    `*_blocks` (E, O, I / 32, 16) bytes of 4-bit codes and `*_scales` (E, O, I / 32) E8M0 bytes, rows
    (out, in), and config.json's quantization_config (quant_method mxfp4)."""
    from safetensors.numpy import save_file

    out = {}
    for k, t in hf.read_tensors(src).items():
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[k] = np.asarray(t, np.float32)
            continue
        W = np.asarray(t, np.float32).transpose(0, 2, 1)                # (E, O, I)
        codes, scales = zip(*(mxfp4.quantize(w) for w in W))
        E, O, words = np.shape(codes)
        out[k + "_blocks"] = np.stack(codes).view(np.uint8).reshape(E, O, words // 4, 16)
        out[k + "_scales"] = np.stack(scales)
    dst.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                  "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(dst)
    return dst


def peft_model(folder, lora, state):
    torch, _ = torch_modules()
    peft = pytest.importorskip("peft")
    known = adapter_io.peft_parameters(hf.read_config(folder))
    cfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=[t for t in lora.target_modules
                                                                           if t not in known] or None,
                          target_parameters=[known[t] for t in lora.target_modules if t in known])
    pm = peft.get_peft_model(hf_model(folder), cfg)
    sd = adapter_io._peft_experts_out(state, hf.read_config(folder))
    peft.set_peft_model_state_dict(pm, {k: torch.tensor(v) for k, v in sd.items()})
    names = {n.replace(".default", "") for n, p in pm.named_parameters() if p.requires_grad}
    assert names == set(sd), sorted(names ^ set(sd))
    return pm


@pytest.mark.torch
def test_yarn_frequencies_match_transformers(folders):
    torch, transformers = torch_modules()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for name in FOLDERS:
        ref = transformers.AutoConfig.from_pretrained(str(folders[name]))
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](ref, "cpu")
        c = hf.read_config(folders[name])
        assert np.allclose(c.inv_freq(), inv.numpy(), rtol=1e-6, atol=0)
        assert c.rope_attention_factor == pytest.approx(factor, rel=1e-12) and factor > 1


@pytest.mark.torch
@pytest.mark.parametrize("name", list(FOLDERS))
def test_loss_logits_and_routing_match_transformers(folders, name):
    torch, _ = torch_modules()
    ids, labels, targets = token_batch(V, seed=1)
    ref = hf_model(folders[name])
    with torch.no_grad():
        out = ref(torch.tensor(ids), labels=torch.tensor(labels))
        routed = ref(torch.tensor(ids), output_router_logits=True)
    m = hf.load_model(folders[name], krnl.device("cpu"))
    assert m.loss(ids, targets) == pytest.approx(float(out.loss), rel=LOSS_RTOL)
    want = out.logits.numpy()
    assert np.abs(m.logits(ids) - want).max() <= 1e-5 * np.abs(want).max()
    K = m.config.moe["top_k"]
    for mine, lg in zip(router_choices(m, ids), routed.router_logits, strict=True):
        assert np.array_equal(np.sort(mine, -1), np.sort(torch.topk(lg, K, -1).indices.numpy(), -1))
    # Each gpt-oss piece matters: the sinks, the biases and the clamp move the loss.
    for piece in ("sinks", "bias", "clamp"):
        m2 = hf.load_model(folders[name], krnl.device("cpu"))
        for L in m2.layers:
            if piece == "sinks":
                L.sinks = None
            elif piece == "bias":
                L.mlp.biases = None
            else:
                L.mlp.swiglu = (1.0, 0.0)
        assert abs(m2.loss(ids, targets) - float(out.loss)) > 1e-3, piece


@pytest.mark.torch
@pytest.mark.parametrize("name, targets", [("yarn", TARGETS), ("types", ("gate_up_proj", "o_proj")),
                                           ("types", ("router", "down_proj", "q_proj"))])
def test_lora_gradients_match_peft(folders, name, targets):
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
    mine = adapter_io._peft_experts_out(grads, m.config)
    assert set(mine) == set(ref)
    for k, g in ref.items():
        assert np.abs(g).max() > 0, k
        assert np.abs(mine[k] - g).max() <= GRAD_RTOL * np.abs(g).max(), k


@pytest.mark.torch
def test_load_balancing_loss_matches_transformers(folders):
    torch, _ = torch_modules()
    coef = 0.3
    lora = LoraConfig(r=3, alpha=5.0, target_modules=("q_proj", "gate_up_proj", "router"))
    m = hf.load_model(folders["yarn"], krnl.device("cpu"), lora=lora)
    m.aux_loss_coef = coef
    st = random_b(m, 2)
    ids, labels, tg = token_batch(V, seed=5)
    loss, grads = lora_step(m, ids, tg)
    pm = peft_model(folders["yarn"], lora, st)
    pm.base_model.model.router_aux_loss_coef = coef
    out = pm(torch.tensor(ids), labels=torch.tensor(labels), output_router_logits=True)
    out.loss.backward()
    assert m.aux_loss() == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)
    assert loss + coef * m.aux_loss() == pytest.approx(float(out.loss.detach()), rel=LOSS_RTOL)
    ref = {n.replace(".default", ""): p.grad.double().numpy() for n, p in pm.named_parameters() if p.requires_grad}
    mine = adapter_io._peft_experts_out(grads, m.config)
    for k, g in ref.items():
        assert np.abs(mine[k] - g).max() <= GRAD_RTOL * np.abs(g).max(), k


@pytest.mark.torch
def test_krnl_adapter_in_peft_and_fuse_in_transformers(folders, tmp_path):
    torch, _ = torch_modules()
    peft = pytest.importorskip("peft")
    folder = folders["yarn"]
    lora = LoraConfig(r=2, alpha=6.0, target_modules=("q_proj", "o_proj", "gate_up_proj", "down_proj", "router"))
    m = hf.load_model(folder, krnl.device("cpu"), lora=lora)
    st = random_b(m, 3)
    cfg = adapter_io.peft_config(lora, str(folder), model_config=m.config)
    assert cfg["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.router.weight"]
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
    assert {k: v.shape for k, v in t.items()} == {k: v.shape for k, v in orig.items()}
    assert torch_loss(hf_model(tmp_path / "fused"), ids, labels) == pytest.approx(mine, rel=LOSS_RTOL)


@pytest.mark.torch
def test_mxfp4_experts_stay_in_4_bits_with_transformers_loss(folders, tmp_path):
    """OpenAI's MXFP4 layout: krnl keeps the experts as mxfp4 codes (moe_quantized_matmul) and its
    loss is transformers' (which dequantizes them on the CPU); LoRA on them trains, and fuse writes a
    bf16 folder in transformers' layout that transformers loads with krnl's loss."""
    torch, _ = torch_modules()
    folder = folders["mxfp4-blocks"]
    ids, labels, targets = token_batch(V, seed=6)
    w = hf.load_hf_weights(folder)
    gu = w["model.layers.1.mlp.experts.gate_up_proj"]
    assert all(p.mode == "mxfp4" for p in gu.parts) and w["model.layers.1.mlp.experts.down_proj"].mode == "mxfp4"
    m = hf.load_model(folder, krnl.device("cpu"))
    assert m.layers[0].mlp.down.mode == "mxfp4"
    mine = m.loss(ids, targets)
    assert mine == pytest.approx(torch_loss(hf_model(folder), ids, labels), rel=LOSS_RTOL)
    assert abs(mine - torch_loss(hf_model(folders["mxfp4"]), ids, labels)) > 1e-4  # 4 bits of the float model
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("q_proj", "gate_up_proj", "down_proj"))
    m = hf.load_model(folder, krnl.device("cpu"), lora=lora)
    st = random_b(m, 7)
    adapter_io.save_adapter(tmp_path / "ad", st, adapter_io.peft_config(lora, "", model_config=m.config), m.config)
    hf.fuse(folder, tmp_path / "ad", tmp_path / "fused")
    t = hf.read_tensors(tmp_path / "fused")
    assert t["model.layers.0.mlp.experts.gate_up_proj"].st_dtype == "BF16"
    assert "quantization_config" not in json.loads((tmp_path / "fused" / "config.json").read_text())
    assert torch_loss(hf_model(tmp_path / "fused"), ids, labels) == pytest.approx(m.loss(ids, targets), rel=1e-2)


@pytest.mark.torch
@pytest.mark.parametrize("name", list(FOLDERS))
def test_greedy_generation_matches_transformers(folders, name):
    torch_modules()
    assert_greedy_matches(folders[name])


# ---------------------------------------------------------------------------------------------
# Without torch

CFG = dict(model_type="gpt_oss", vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=5, num_experts_per_tok=2,
           sliding_window=4, max_position_embeddings=64, rms_norm_eps=1e-5, swiglu_limit=2.0,
           rope_parameters=dict(YARN, truncate=False))


def write_folder(folder, cfg=CFG, seed=5, std=0.3):
    """A tiny float folder of `cfg` in transformers' gpt-oss layout; returns ModelConfig and the stored tensors."""
    from safetensors.numpy import save_file

    config = ModelConfig.from_dict(hf.normalize_config(cfg))
    stored = {}
    for k, v in random_weights(config, seed=seed, std=std).items():
        name, _, relay = gpt_oss.stored_layout(config, k, v.shape) or (k, None, lambda a: a)
        stored[name] = np.ascontiguousarray(relay(v))
    folder.mkdir(parents=True)
    save_file(stored, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(folder)
    return config, stored


def test_config_and_layout_round_trip(tmp_path):
    c, stored = write_folder(tmp_path / "m")
    assert c.moe["swiglu"] == (1.702, 2.0) and c.moe["norm_topk"] and c.moe["bias"]
    assert c.layer_windows == [4, 0] and c.sliding_window is None and c.attention_sinks and c.o_proj_bias
    assert c.rope_scaling["attention_factor"] == pytest.approx(0.1 * np.log(4.0) + 1)
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (5, 32, 32)      # (E, C, 2F)
    assert stored["model.layers.0.mlp.experts.down_proj"].shape == (5, 16, 32)         # (E, F, C)
    assert "model.layers.1.mlp.router.bias" in stored and "model.layers.1.self_attn.sinks" in stored
    w = hf.load_hf_weights(tmp_path / "m")
    gu = stored["model.layers.0.mlp.experts.gate_up_proj"]
    want = np.concatenate([gu[:, :, 0::2], gu[:, :, 1::2]], axis=2).transpose(0, 2, 1)
    assert np.array_equal(np.asarray(w["model.layers.0.mlp.experts.gate_up_proj"], np.float32), want)
    b = stored["model.layers.0.mlp.experts.gate_up_proj_bias"]
    assert np.array_equal(np.asarray(w["model.layers.0.mlp.experts.gate_up_proj_bias"]),
                          np.concatenate([b[:, 0::2], b[:, 1::2]], axis=1))
    assert np.array_equal(np.asarray(w["model.layers.0.mlp.experts.down_proj"]),
                          stored["model.layers.0.mlp.experts.down_proj"].transpose(0, 2, 1))
    with pytest.raises(ValueError, match="rope_scaling.original_max_position_embeddings"):
        ModelConfig.from_dict(hf.normalize_config(dict(CFG, rope_parameters=dict(rope_type="yarn", factor=2.0,
                                                                                  rope_theta=1e4))))


def test_peft_rows_of_gate_up_interleave():
    B = np.arange(24, dtype=np.float32).reshape(6, 4)                    # (2F, r E): gate's rows, then up's
    P = gpt_oss.peft_rows(B, True)
    assert np.array_equal(P[0::2], B[:3]) and np.array_equal(P[1::2], B[3:])
    assert np.array_equal(gpt_oss.peft_rows(P, False), B)


def test_cli_trains_evaluates_and_fuses_a_gpt_oss_folder(tmp_path):
    from krnl.cli.main import main

    folder = tmp_path / "base"
    _, stored = write_folder(folder)
    write_data(tmp_path / "data")
    out = tmp_path / "ad"
    assert main(["train", "--model", str(folder), "--data", str(tmp_path / "data"), "--device", "cpu", "--dtype",
                 "f32", "--iters", "3", "--batch-size", "2", "--lora-rank", "2", "--steps-per-eval", "0", "--quiet",
                 "--no-tune", "--adapter-path", str(out), "--router-aux-loss-coef", "0.01", "--lora-targets",
                 "q,k,v,o,gate,up,down,router"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) and 0 < r["aux_loss"] < 1e3 for r in rows)
    ac = json.loads((out / "adapter_config.json").read_text())
    assert ac["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.router.weight"]
    assert main(["fuse", "--model", str(folder), "--adapter-path", str(out), "--save-path",
                 str(tmp_path / "fused")]) == 0
    fused = hf.read_tensors(tmp_path / "fused")
    assert {k: v.shape for k, v in fused.items()} == {k: v.shape for k, v in stored.items()}
    assert not np.array_equal(np.asarray(fused["model.layers.1.mlp.experts.gate_up_proj"]),
                              stored["model.layers.1.mlp.experts.gate_up_proj"])
    assert np.array_equal(np.asarray(fused["model.layers.1.mlp.router.bias"]), stored["model.layers.1.mlp.router.bias"])
    ids, targets = np.array([[3, 9, 4, 40, 2, 7, 1]]), np.array([[9, 4, 40, 2, 7, 1, -100]])
    with_adapter = hf.load_model(folder, krnl.device("cpu"), adapter=out).loss(ids, targets)
    assert hf.load_model(tmp_path / "fused", krnl.device("cpu")).loss(ids, targets) == pytest.approx(with_adapter,
                                                                                                    rel=1e-5)
    assert main(["generate", "--model", str(tmp_path / "fused"), "--prompt", "w1 w2", "--max-tokens", "3",
                 "--device", "cpu"]) == 0
    assert main(["eval", "--model", str(folder), "--adapter-path", str(out), "--data", str(tmp_path / "data"),
                 "--device", "cpu"]) == 0


def test_mxfp4_folder_reads_as_its_dequantized_weights_and_trains(tmp_path):
    """OpenAI's MXFP4 layout without torch: the loss of krnl's 4-bit experts equals the loss of a
    float folder holding their dequantized values (float64 numpy's E2M1 times 2^(e - 127)); the CLI
    trains LoRA on them and fuses a bf16 folder in transformers' layout."""
    from safetensors.numpy import save_file
    from krnl.cli.main import main

    cfg = dict(CFG, hidden_size=64, intermediate_size=32, head_dim=16)
    write_folder(tmp_path / "f", cfg)
    mxfp4_folder(tmp_path / "f", tmp_path / "q")
    deq = {}
    for k, t in hf.read_tensors(tmp_path / "q").items():
        if k.endswith("_scales"):
            continue
        if k.endswith("_blocks"):
            b, e = np.asarray(t.raw()), np.asarray(hf.read_tensors(tmp_path / "q")[k[:-6] + "scales"].raw())
            vals = mxfp4.E2M1.astype(np.float64)[np.stack([b & 15, b >> 4], -1)].reshape(*b.shape[:2], -1)
            W = vals * np.exp2(e.astype(np.float64) - 127).repeat(32, axis=-1)  # (E, O, I)
            deq[k[:-7]] = np.ascontiguousarray(W.transpose(0, 2, 1), np.float32)
        else:
            deq[k] = np.asarray(t, np.float32)
    (tmp_path / "d").mkdir()
    save_file(deq, str(tmp_path / "d" / "model.safetensors"))
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    ids, targets = np.array([[3, 9, 4, 40, 2, 7, 1, 5]]), np.array([[9, 4, 40, 2, 7, 1, 5, -100]])
    q = hf.load_model(tmp_path / "q", krnl.device("cpu"))
    assert q.layers[1].mlp.gate.mode == "mxfp4"
    assert q.loss(ids, targets) == pytest.approx(hf.load_model(tmp_path / "d", krnl.device("cpu")).loss(ids, targets),
                                                 rel=1e-6)
    write_data(tmp_path / "data")
    assert main(["train", "--model", str(tmp_path / "q"), "--data", str(tmp_path / "data"), "--device", "cpu",
                 "--iters", "2", "--batch-size", "2", "--lora-rank", "2", "--steps-per-eval", "0", "--quiet",
                 "--no-tune", "--adapter-path", str(tmp_path / "ad"), "--lora-targets", "q,gate,up,down"]) == 0
    assert main(["fuse", "--model", str(tmp_path / "q"), "--adapter-path", str(tmp_path / "ad"), "--save-path",
                 str(tmp_path / "fused")]) == 0
    fused = hf.read_tensors(tmp_path / "fused")
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (5, 64, 64)
    assert not any(k.endswith(("_blocks", "_scales")) for k in fused)


# mlx-lm's gpt-oss: swiglu limit 7 and YaRN truncated (its own constants), rope keys of transformers 4
MLX_CFG = dict(CFG, hidden_size=64, intermediate_size=32, head_dim=16, swiglu_limit=7.0, rope_theta=150000.0,
               rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=8.0, beta_slow=1.0,
                                 original_max_position_embeddings=16))
del MLX_CFG["rope_parameters"]


def mlx_names(config, weights):
    """krnl's weights under mlx-lm's sanitized gpt-oss names and layouts (mlp.router, and
    mlp.experts.{gate,up,down}_proj.{weight,bias} with (E, O, I) weights)."""
    out, F = {}, config.moe["expert_size"]
    for k, v in weights.items():
        p, _, rest = k.partition(".mlp.")
        if rest.startswith("gate."):
            out[f"{p}.mlp.router.{rest[5:]}"] = v
        elif rest in ("experts.gate_up_proj", "experts.gate_up_proj_bias"):
            kind = "weight" if rest.endswith("proj") else "bias"
            out[f"{p}.mlp.experts.gate_proj.{kind}"], out[f"{p}.mlp.experts.up_proj.{kind}"] = v[:, :F], v[:, F:]
        elif rest in ("experts.down_proj", "experts.down_proj_bias"):
            out[f"{p}.mlp.experts.down_proj.{'weight' if rest.endswith('proj') else 'bias'}"] = v
        else:
            out[k] = v
    return out


def float_folders(tmp_path):
    """tmp_path/hf (transformers' layout) and tmp_path/mlx (mlx-lm's) of the same random MLX_CFG weights."""
    from safetensors.numpy import save_file

    config, _ = write_folder(tmp_path / "hf", MLX_CFG)
    (tmp_path / "mlx").mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in mlx_names(config, random_weights(config, 5, 0.3)).items()},
              str(tmp_path / "mlx" / "model.safetensors"))
    (tmp_path / "mlx" / "config.json").write_text(json.dumps(MLX_CFG))
    write_tokenizer(tmp_path / "mlx")


def mlx_loss(folder, ids):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm

    model, _ = mlx_lm.load(str(folder))
    model.set_dtype(mx.float32)
    logits = model(mx.array(ids[:, :-1])).astype(mx.float32)
    return nn.losses.cross_entropy(logits, mx.array(ids[:, 1:])).mean().item()


@pytest.mark.mlx
def test_mlx_lm_computes_krnl_loss_from_both_layouts_and_quantized(tmp_path):
    """The same weights in transformers' layout and in mlx-lm's (a float MLX folder) give krnl one
    loss, which mlx-lm's own gpt-oss (sinks, clamped SwiGLU, biases, YaRN) computes too; mlx_lm.convert
    -q of it (experts at 4 bits, the router at mlx-lm's 8) reads in krnl with mlx-lm's loss, and krnl
    quantize of the transformers folder writes the same tensors."""
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")

    float_folders(tmp_path)
    ids = np.random.default_rng(3).integers(0, V, (2, 12)).astype(np.int32)
    mine = hf.load_model(tmp_path / "hf", krnl.device("cpu")).loss(ids[:, :-1], ids[:, 1:])
    assert hf.load_model(tmp_path / "mlx", krnl.device("cpu")).loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(
        mine, rel=1e-6)
    assert mlx_loss(tmp_path / "mlx", ids) == pytest.approx(mine, rel=1e-5)

    mlx_lm.convert(str(tmp_path / "mlx"), str(tmp_path / "q"), quantize=True, q_bits=4, q_group_size=32)
    q = hf.load_hf_weights(tmp_path / "q")
    assert all(isinstance(p, krnl.quant.qweight.QuantizedArray) for p in q["model.layers.0.mlp.experts.gate_up_proj"].parts)
    assert q["model.layers.1.mlp.gate.weight"].bits == 8
    quantized = hf.load_model(tmp_path / "q", krnl.device("cpu")).loss(ids[:, :-1], ids[:, 1:])
    assert quantized == pytest.approx(mlx_loss(tmp_path / "q", ids), rel=1e-5)
    assert quantized == pytest.approx(mine, rel=0.05) and quantized != mine

    hf.quantize_folder(tmp_path / "hf", tmp_path / "k", bits=4, group_size=32)
    a, b = hf.read_tensors(tmp_path / "k"), hf.read_tensors(tmp_path / "q")
    assert sorted(a) == sorted(b)
    for k in b:
        assert np.array_equal(np.asarray(a[k].raw()), np.asarray(b[k].raw())), k


@pytest.mark.mlx
def test_mlx_mxfp4_folder_matches_mlx_lm(tmp_path):
    """mlx_lm.convert --q-mode mxfp4: every linear (experts, attention, head) and the embedding in MXFP4
    (U8 scales, no biases), the router at 8-bit affine; krnl keeps the linears in 4 bits (the
    embedding dense) and its loss equals mlx-lm's."""
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")

    float_folders(tmp_path)
    mlx_lm.convert(str(tmp_path / "mlx"), str(tmp_path / "q"), quantize=True, q_mode="mxfp4")
    w = hf.load_hf_weights(tmp_path / "q")
    assert all(p.mode == "mxfp4" for p in w["model.layers.0.mlp.experts.gate_up_proj"].parts)
    assert w["model.layers.0.self_attn.q_proj.weight"].mode == "mxfp4" and w["lm_head.weight"].mode == "mxfp4"
    assert w["model.layers.0.mlp.gate.weight"].mode == "affine" and w["model.layers.0.mlp.gate.weight"].bits == 8
    m = hf.load_model(tmp_path / "q", krnl.device("cpu"))
    ids = np.random.default_rng(8).integers(0, V, (2, 12)).astype(np.int32)
    assert m.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(mlx_loss(tmp_path / "q", ids), rel=1e-5)
    t = hf.read_tensors(tmp_path / "q")
    with pytest.raises(ValueError, match=r"q_proj\.scales: U8 scales \(64, 2\) with codes \(64, 8\) are no MXFP4 of 96"):
        experts.stored_array(t["model.layers.0.self_attn.q_proj.weight"], t["model.layers.0.self_attn.q_proj.scales"],
                             None, 96, "q_proj")


@pytest.mark.parametrize("fused_gate_up", [False, True])
def test_gguf_gpt_oss_keeps_mxfp4_experts_and_fuses(tmp_path, fused_gate_up):
    """llama.cpp's gpt-oss files (arch gpt-oss; ggml's MXFP4 experts, gate and up apart or fused): the
    experts stay mxfp4 (ggml's nibble order turned into krnl's), the loss that of the float weights
    gguf-py dequantizes; an adapter trained on it fuses into a folder in transformers' layout."""
    pytest.importorskip("gguf")
    from gguf_files import write_gpt_oss_gguf
    from krnl.formats.gguf.file import read_gguf
    from krnl.formats.gguf.fuse import fuse_gguf
    from krnl.models.model import LlamaModel

    path = tmp_path / "m.gguf"
    want = write_gpt_oss_gguf(path, seed=3, fused_gate_up=fused_gate_up)
    g = read_gguf(path, quiet=True)
    c = g.config
    assert c.model_type == "gpt_oss" and c.layer_windows == [4, 0] and c.moe["swiglu"] == (1.702, 7.0)
    assert c.rope_scaling["truncate"] and c.rope_attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("q_proj", "gate_up_proj", "down_proj", "router"))
    m = hf.load_model(path, krnl.device("cpu"), lora=lora)
    assert m.layers[0].mlp.gate.mode == "mxfp4" and m.layers[1].mlp.down.mode == "mxfp4"
    f = LlamaModel(krnl.device("cpu"), c, want, lora=lora)
    st = random_b(m, 6)
    f.lora_params.load(st)
    ids = np.random.default_rng(1).integers(0, c.vocab_size, (2, 9))
    assert m.loss(ids, ids) == pytest.approx(f.loss(ids, ids), rel=1e-5)
    adapter_io.save_adapter(tmp_path / "ad", st, adapter_io.peft_config(lora, str(path), model_config=c), c)
    fuse_gguf(path, tmp_path / "ad", tmp_path / "fused", dtype="f32")
    t = hf.read_tensors(tmp_path / "fused")
    assert t["model.layers.0.mlp.experts.gate_up_proj"].shape == (5, 64, 64) and "model.layers.0.mlp.router.bias" in t
    assert hf.load_model(tmp_path / "fused", krnl.device("cpu")).loss(ids, ids) == pytest.approx(m.loss(ids, ids),
                                                                                                 rel=1e-5)


@pytest.mark.torch
def test_gguf_gpt_oss_fused_folder_loads_in_transformers(tmp_path):
    torch, _ = torch_modules()
    pytest.importorskip("gguf")
    from gguf_files import write_gpt_oss_gguf
    from krnl.formats.gguf.fuse import fuse_gguf

    path = tmp_path / "m.gguf"
    write_gpt_oss_gguf(path, seed=4)
    lora = LoraConfig(r=2, alpha=4.0, target_modules=("v_proj", "gate_up_proj", "router"))
    m = hf.load_model(path, krnl.device("cpu"), lora=lora)
    st = random_b(m, 7)
    adapter_io.save_adapter(tmp_path / "ad", st, adapter_io.peft_config(lora, str(path), model_config=m.config),
                            m.config)
    fuse_gguf(path, tmp_path / "ad", tmp_path / "fused", dtype="f32")
    ids = np.random.default_rng(2).integers(0, m.config.vocab_size, (2, 9))
    tg = np.concatenate([ids[:, 1:], np.full((2, 1), -100)], axis=1)  # transformers' labels=ids, shifted
    assert torch_loss(hf_model(tmp_path / "fused"), ids, ids) == pytest.approx(m.loss(ids, tg), rel=1e-4)


@pytest.mark.mlx
def test_krnl_quantize_mxfp4_writes_what_mlx_lm_convert_writes(tmp_path, capsys):
    """krnl quantize --q-mode mxfp4 of a gpt-oss folder writes mlx_lm.convert --q-mode mxfp4's tensors
    byte for byte (U8 scales, no biases; the router at 8-bit affine) and its quantization entry;
    the CLI trains on the folder and fuses back into one in the same mode."""
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    from krnl.cli.main import main

    float_folders(tmp_path)
    mlx_lm.convert(str(tmp_path / "mlx"), str(tmp_path / "m"), quantize=True, q_mode="mxfp4")
    assert main(["quantize", "--model", str(tmp_path / "hf"), "--save-path", str(tmp_path / "k"),
                 "--q-mode", "mxfp4"]) == 0
    mine, theirs = hf.read_tensors(tmp_path / "k"), hf.read_tensors(tmp_path / "m")
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert mine[k].st_dtype == theirs[k].st_dtype and np.array_equal(np.asarray(mine[k].raw()),
                                                                         np.asarray(theirs[k].raw())), k
    q = lambda f: json.loads((tmp_path / f / "config.json").read_text())["quantization"]
    assert q("k")["mode"] == "mxfp4" and q("k")["model.layers.0.mlp.router"] == {"group_size": 64, "bits": 8,
                                                                                 "mode": "affine"}
    assert main(["quantize", "--model", str(tmp_path / "hf"), "--save-path", str(tmp_path / "x"), "--q-mode", "mxfp4",
                 "--q-bits", "8"]) != 0
    assert "--q-mode mxfp4 takes 4 bits in groups of 32, got --q-bits 8" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    write_data(tmp_path / "data")
    assert main(["train", "--model", str(tmp_path / "k"), "--data", str(tmp_path / "data"), "--device", "cpu",
                 "--iters", "2", "--batch-size", "2", "--lora-rank", "2", "--steps-per-eval", "0", "--quiet",
                 "--no-tune", "--adapter-path", str(tmp_path / "ad"), "--lora-targets", "q,gate,up,down"]) == 0
    assert main(["fuse", "--model", str(tmp_path / "k"), "--adapter-path", str(tmp_path / "ad"), "--save-path",
                 str(tmp_path / "fq"), "--q-mode", "mxfp4"]) == 0
    fused = hf.load_hf_weights(tmp_path / "fq")
    assert fused["model.layers.0.self_attn.k_proj.weight"].mode == "mxfp4"  # not adapted: passed through
    ids = np.random.default_rng(2).integers(0, V, (2, 10)).astype(np.int32)
    assert hf.load_model(tmp_path / "fq", krnl.device("cpu")).loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(
        mlx_loss(tmp_path / "fq", ids), rel=1e-5)
