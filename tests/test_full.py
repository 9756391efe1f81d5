"""Full fine-tuning (--fine-tune-type full, krnl.models.full): the trained weights' gradients equal
PyTorch autograd's on the same transformers model (llama, qwen2 with its q/k/v biases (k's frozen
between q's and v's too), qwen3 with its
q/k norms, gemma2 with its norms frozen, phi3's fused projections; a subset of layers and targets,
checkpointed); without torch, each projection's gradient G against LoRA's own backward (with B = 0 the
model is the base, and dB = s G A^T, dA = s B^T G for any A, B), the norms' against finite differences.
A CLI run writes mlx-lm's full layout and an HF folder that transformers (and mlx-lm) load with krnl's
loss; eval, generate and fuse read it back; resume is exact; metal-sim's step equals the CPU's; bad
combinations are one-line errors."""

import json
import re
import shutil

import numpy as np
import pytest

import krnl
from krnl.formats import hf
from krnl.models.config import ALL_MODULES, LoraConfig, ModelConfig, random_weights
from krnl.models.model import LlamaModel

from conftest import METAL_SIM, TINY_LLAMA, assert_step_close, lora_step
from hf_families import PHI3_MODULES, family_batch, family_models, grad_error, hf_model, torch_loss, torch_modules
from mlx_folders import make_base, write_data

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
BATCH = (np.random.default_rng(3).integers(0, 61, (2, 9)), np.random.default_rng(4).integers(0, 61, (2, 9)))


def full_model(dev="cpu", dtype="f32", weights=None, config=TINY_LLAMA, grad_checkpoint=False, **lora_kw):
    c = ModelConfig.from_dict(config)
    w = weights if weights is not None else random_weights(c, 2, std=0.2)
    return LlamaModel(krnl.device(dev), c, w, lora=LoraConfig(full=True, **lora_kw), dtype=dtype,
                      grad_checkpoint=grad_checkpoint), w


# ---- without torch -------------------------------------------------------------------------

@pytest.mark.parametrize("grad_checkpoint", [False, True])
def test_projection_gradients_equal_lora_backward(grad_checkpoint):
    """Each projection's G against LoRA's dA and dB at B = 0 (the same point as the base): dB = s G A^T;
    and at B != 0 through dA = s B^T G, the base then W + s B A (full's weights set to it)."""
    m, w = full_model(grad_checkpoint=grad_checkpoint)
    _, G = lora_step(m, *BATCH)
    lora = LoraConfig(r=5, alpha=7.0)
    ref = LlamaModel(krnl.device("cpu"), m.config, w, lora=lora, grad_checkpoint=grad_checkpoint)
    st = ref.lora_state()
    _, g = lora_step(ref, *BATCH)
    s = lora.scale
    for k, A in ((k, v) for k, v in st.items() if ".lora_A." in k):
        name = k.replace("base_model.model.", "").replace(".lora_A", "")
        kB = k.replace(".lora_A.", ".lora_B.")
        np.testing.assert_allclose(g[kB], s * G[name] @ A.T.astype(np.float64), rtol=1e-4,
                                   atol=1e-4 * np.abs(g[kB]).max())
    assert len(G) == 2 * 9  # 7 projections and 2 norms a layer


@pytest.mark.parametrize("tied", [False, True])
def test_norm_embedding_and_head_gradients_against_finite_differences(tied):
    """The layers' norms, and with train_embeddings the final norm, the head and the table (rows of
    the batch's ids; a tied table's gradient holds both uses) against central differences."""
    m, w = full_model(config={**TINY_LLAMA, "tie_word_embeddings": tied}, target_modules=("q_proj",),
                      train_embeddings=True)
    _, G = lora_step(m, *BATCH)
    assert ("lm_head.weight" in G) != tied and "model.norm.weight" in G
    c = m.config
    rng = np.random.default_rng(0)
    for name in [k for k in G if "norm" in k or "embed" in k or "lm_head" in k]:
        rows = [int(BATCH[0][0, 1]), int(BATCH[0][1, 4])] if G[name].ndim == 2 else [None]
        for r in rows:
            for j in rng.choice(c.hidden_size, 2, replace=False):
                at = j if r is None else (r, j)

                def loss(d, name=name, at=at):
                    v = {**w, name: w[name].copy()}
                    v[name][at] += d
                    return LlamaModel(krnl.device("cpu"), c, v).loss(*BATCH)
                fd = (loss(1e-2) - loss(-1e-2)) / 2e-2
                assert G[name][at] == pytest.approx(fd, rel=2e-2, abs=2e-4), (name, at)


def test_layers_and_targets_choose_what_trains():
    """Layer 1's q and v (k frozen between them: the q|k|v weight a RowStack) and norms; --num-layers 1
    means the last layer; the other weights get no gradient and stay the base's."""
    m, w = full_model(target_modules=("q_proj", "v_proj"), layers=("last", 1))
    assert sorted(m.lora_params.shapes) == sorted(["model.layers.1.input_layernorm.weight",
                                                   "model.layers.1.post_attention_layernorm.weight",
                                                   "model.layers.1.self_attn.q_proj.weight",
                                                   "model.layers.1.self_attn.v_proj.weight"])
    _, G = lora_step(m, *BATCH)
    ref, _ = full_model(weights=w)
    _, Gall = lora_step(ref, *BATCH)
    for k, g in G.items():
        np.testing.assert_allclose(g, Gall[k], rtol=1e-5, atol=1e-6 * np.abs(Gall[k]).max())


@pytest.mark.parametrize("kw, match", [
    ({"dropout": 0.1}, r"^\[LoraConfig\] dropout 0.1 applies to LoRA's input"),
    ({"use_dora": True}, r"^\[LoraConfig\] full fine-tuning and DoRA exclude each other"),
])
def test_refused_combinations(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        full_model(**kw)
    assert "\n" not in str(e.value)


def test_refused_on_quantized_and_experts():
    with pytest.raises(ValueError, match=r"^\[full\] full fine-tuning trains the weights themselves") as e:
        c = ModelConfig.from_dict(TINY_LLAMA)
        LlamaModel(krnl.device("cpu"), c, random_weights(c), lora=LoraConfig(full=True), quantize=(4, 32))
    assert "--q-bits" in str(e.value)
    moe = ModelConfig.from_dict({**TINY_LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 16, "head_dim": 8})
    with pytest.raises(ValueError, match=r"full fine-tuning of a mixture's gate_up_proj, down_proj"):
        LoraConfig(full=True).validate(moe)
    LoraConfig(full=True, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")).validate(moe)


def test_training_moves_every_weight_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    """The CLI on the embedded default: adapters.safetensors holds every trained weight, changed from
    the base; generate and eval read it; the run resumed from its step-2 checkpoint (a copy of its
    folder) repeats its losses and weights bit for bit."""
    from safetensors.numpy import load_file
    from krnl.cli.main import BASE_SEED, main
    from krnl.train.default_task import CharTokenizer, base_weights, tiny_config

    monkeypatch.chdir(tmp_path)
    run = ["train", "--fine-tune-type", "full", "--iters", "4", "--train-samples", "64", "--batch-size", "4",
           "--quiet", "--steps-per-eval", "0", "--save-every", "2", "--learning-rate", "1e-3"]
    assert main([*run, "--adapter-path", "a"]) == 0
    assert "full fine-tuning of 14 modules" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["fine_tune_type"] == "full" and cfg["num_layers"] == 2
    got = load_file(str(tmp_path / "a" / "adapters.safetensors"))
    base = base_weights(ModelConfig.from_dict(tiny_config(CharTokenizer().vocab_size)), seed=BASE_SEED)
    assert len(got) == 18 and all(not np.array_equal(v, base[k]) for k, v in got.items())
    assert main(["generate", "--adapter-path", "a", "--prompt", "+2c>", "--max-tokens", "4"]) == 0
    assert main(["eval", "--adapter-path", "a"]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "adapters.safetensors").unlink()
    assert main([*run, "--adapter-path", "b", "--resume-from", "2"]) == 0
    losses = [[json.loads(x)["loss"] for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in "ab"]
    assert losses[0] == losses[1]
    again = load_file(str(tmp_path / "b" / "adapters.safetensors"))
    assert all(np.array_equal(again[k], v) for k, v in got.items())


def test_reduce_order_sample_refused():
    from krnl.train.dist.ranks import apply_reduce_order
    from krnl.train.dist.world import World
    from krnl.train.trainer import TrainConfig

    m, _ = full_model()
    with pytest.raises(ValueError, match=r"^\[train\] --reduce-order sample holds a gradient slot per sample"):
        apply_reduce_order(m, TrainConfig(reduce_order="sample"), World())
    apply_reduce_order(m, TrainConfig(), World())
    assert not m.sums.on


@pytest.mark.parametrize("dtype, tol", [("f32", 1e-4), ("bf16", 3e-2)])
def test_device_step_matches_cpu_f32(dev, dtype, tol):
    """One step training everything (layers, embeddings, head, final norm; checkpointed) on each device
    of the build (CUDA on the H200) in dtype, against the CPU in f32."""
    _, w = full_model()
    kw = dict(weights=w, train_embeddings=True, grad_checkpoint=True)
    assert_step_close(lora_step(full_model(**kw)[0], *BATCH), lora_step(full_model(dev.name, dtype, **kw)[0], *BATCH),
                      tol, 4 * tol)


@pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0 or no g++)")
@pytest.mark.parametrize("dtype, tol", [("f32", 1e-5), ("bf16", 3e-2)])
def test_metal_sim_step_matches_cpu(dtype, tol):
    _, w = full_model()
    assert_step_close(lora_step(full_model(weights=w)[0], *BATCH),
                      lora_step(full_model("metal-sim", dtype, weights=w)[0], *BATCH), tol, 4 * tol)


# ---- against transformers --------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (folder, targets)}: hf_families.family_models' with all their projections."""
    f = family_models(tmp_path_factory, "full")
    return {k: (v, PHI3_MODULES if k == "phi3" else ALL_MODULES) for k, v in f.items() if k != "gemma3"}


def torch_step(folder, names, ids, labels):
    """(loss, {name: float64 gradient}) of autograd on transformers' model with only `names` trainable
    (phi3's members as row blocks of their fused weight)."""
    torch, _ = torch_modules()
    from krnl.formats.full_model import split, stored

    ref = hf_model(folder)
    for p in ref.parameters():
        p.requires_grad_(False)
    params = dict(ref.named_parameters())
    config = hf.read_config(folder)
    want = stored(config, dict.fromkeys(names, np.zeros(1)))  # the stored names holding them
    for k in want:
        params[k].requires_grad_(True)
    out = ref(torch.tensor(ids), labels=torch.tensor(labels))
    out.loss.backward()
    grads = split(config, {k: params[k].grad.double().numpy() for k in want})
    return float(out.loss.detach()), {k: grads[k] for k in names}


CASES = [("llama", {}),
         ("llama", {"grad_checkpoint": True, "layers": [1], "targets": ("q_proj", "v_proj", "down_proj")}),
         ("llama", {"train_embeddings": True, "layers": [0]}),
         ("qwen2", {}), ("qwen2", {"targets": ("q_proj", "v_proj")}), ("qwen3", {}), ("gemma2", {}),
         ("gemma2", {"train_embeddings": True}), ("phi3", {})]


@pytest.mark.torch
@pytest.mark.parametrize("family, kw", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_gradients_equal_torch_autograd(folders, family, kw):
    folder, targets = folders[family]
    kw = dict(kw)
    lora = LoraConfig(full=True, target_modules=kw.pop("targets", targets), layers=kw.pop("layers", None),
                      train_embeddings=kw.pop("train_embeddings", False))
    m = hf.load_model(folder, krnl.device("cpu"), lora=lora, **kw)
    ids, labels, tg = family_batch(3)
    loss, grads = lora_step(m, ids, tg)
    ref_loss, ref = torch_step(folder, list(grads), ids, labels)
    assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
    assert grad_error(grads, ref) <= GRAD_RTOL
    norms = [k for k in grads if "norm" in k]
    assert (not norms) == (family == "gemma2")  # gemma's 1 + w norms stay frozen


@pytest.mark.torch
def test_saved_folder_loads_in_transformers_with_krnls_loss(folders, tmp_path, monkeypatch):
    """krnl train --fine-tune-type full on an HF folder: RUN/model loads in transformers with the
    loss krnl computes for the trained model (read back from RUN), and fuse of RUN writes the same."""
    from krnl.cli.main import main

    folder, _ = folders["llama"]
    write_data(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", str(folder), "--data", "data", "--fine-tune-type", "full", "--iters", "3",
                 "--batch-size", "2", "--learning-rate", "1e-3", "--quiet", "--adapter-path", "run"]) == 0
    ids, labels, tg = family_batch(5)
    trained = hf.load_model(folder, krnl.device("cpu"), adapter=tmp_path / "run").loss(ids, tg)
    base = hf.load_model(folder, krnl.device("cpu")).loss(ids, tg)
    assert abs(trained - base) > 1e-3
    assert torch_loss(hf_model(tmp_path / "run" / "model"), ids, labels) == pytest.approx(trained, rel=LOSS_RTOL)
    assert main(["fuse", "--adapter-path", "run", "--save-path", "fused"]) == 0
    assert hf.load_model(tmp_path / "fused", krnl.device("cpu")).loss(ids, tg) == pytest.approx(trained, rel=1e-6)


@pytest.mark.mlx
def test_mlx_lm_loads_the_run_and_its_folder(tmp_path, monkeypatch):
    """mlx-lm reads both forms of a krnl full fine-tune: the base with RUN as its --adapter-path (its own
    fine_tune_type full layout) and RUN/model as a model, each with krnl's loss."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load
    from krnl.cli.main import main

    folder = make_base(tmp_path / "base")
    write_data(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", str(folder), "--data", "data", "--fine-tune-type", "full", "--iters", "3",
                 "--batch-size", "2", "--learning-rate", "1e-3", "--quiet", "--adapter-path", "run"]) == 0
    ids = np.random.default_rng(2).integers(0, 61, (2, 9))
    want = hf.load_model(folder, krnl.device("cpu"), adapter=tmp_path / "run").loss(
        ids, np.concatenate([ids[:, 1:], np.full((2, 1), -100)], axis=1))
    for path, adapter in ((folder, tmp_path / "run"), (tmp_path / "run" / "model", None)):
        model, _ = load(str(path), adapter_path=None if adapter is None else str(adapter))
        model.set_dtype(mx.float32)
        logits = model(mx.array(ids[:, :-1])).astype(mx.float32)
        got = nn.losses.cross_entropy(logits, mx.array(ids[:, 1:])).mean().item()
        assert got == pytest.approx(want, rel=1e-5), path


def test_reads_mlx_lms_full_layout(tmp_path):
    """mlx-lm's own full fine-tune (adapter_config.json names only num_layers): what trained comes
    from the tensors; a layer missing its norm, or a tensor of no such layer, is a one-line error."""
    from safetensors.numpy import save_file
    from krnl.formats.adapter import read_adapter

    m, w = full_model(layers=[1])
    st = {k: v + 0.01 for k, v in m.lora_state().items()}
    (tmp_path / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full", "num_layers": 1}))
    save_file(st, str(tmp_path / "adapters.safetensors"))
    lora, tensors, _ = read_adapter(tmp_path, m.config)
    assert lora.full and lora.layers == [1] and set(lora.target_modules) == set(ALL_MODULES)
    assert all(np.array_equal(tensors[k], v) for k, v in st.items())
    no_norm = {k: v for k, v in st.items() if k != "model.layers.1.input_layernorm.weight"}
    extra = {**st, "model.layers.7.mlp.up_proj.weight": st["model.layers.1.mlp.up_proj.weight"]}
    for bad, match in ((no_norm, "missing"), (extra, "layers \\[7\\] out of range")):
        save_file(bad, str(tmp_path / "adapters.safetensors"))
        with pytest.raises(ValueError, match=match) as e:
            read_adapter(tmp_path, m.config)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"[adapter {tmp_path}]")


def test_the_default_learning_rate_is_the_fine_tune_types(tmp_path, monkeypatch):
    """Without --learning-rate, a full fine-tune steps at 1e-5 (mlx-lm's), LoRA at 3e-3; a value given wins."""
    from krnl.cli.main import main

    monkeypatch.chdir(tmp_path)
    tiny = ["--iters", "1", "--train-samples", "16", "--batch-size", "4", "--quiet", "--steps-per-eval", "0",
            "--warmup", "0", "--lr-schedule", "constant"]
    for kind, given, lr in (("full", [], 1e-5), ("lora", [], 3e-3), ("full", ["--learning-rate", "2e-4"], 2e-4)):
        out = f"{kind}{len(given)}"
        assert main(["train", "--fine-tune-type", kind, "--adapter-path", out, *tiny, *given]) == 0
        assert json.loads((tmp_path / out / "metrics.jsonl").read_text().splitlines()[0])["lr"] == pytest.approx(lr)


def test_config_file_and_flags(tmp_path, monkeypatch, capsys):
    """mlx-lm's config keys (fine_tune_type: full, num_layers) and train_embeddings choose what trains;
    --train-embeddings without full, and --num-layers with --lora-layers, are one-line errors."""
    from safetensors.numpy import load_file
    from krnl.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("fine_tune_type: full\nnum_layers: 1\ntrain_embeddings: true\n"
                                     "learning_rate: 1.0e-4\n")
    tiny = ["--iters", "2", "--train-samples", "32", "--batch-size", "4", "--quiet", "--steps-per-eval", "0"]
    assert main(["train", "--config", "c.yaml", "--adapter-path", "a", *tiny]) == 0
    out = capsys.readouterr().out
    assert "full fine-tuning of 7 modules" in out and out.startswith("memory: ")
    names = set(load_file(str(tmp_path / "a" / "adapters.safetensors")))
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"1"}
    for argv, match in ((["--train-embeddings"], r"train_embeddings goes with full fine-tuning"),
                        (["--fine-tune-type", "full", "--num-layers", "1", "--lora-layers", "0"],
                         r"--num-layers and --lora-layers both choose layers")):
        assert main(["train", *argv, "--adapter-path", "b", *tiny]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(match, err[0]), err


def test_no_base_to_switch_to():
    """A full fine-tune keeps no base beside its weights: the modes whose reference is the adapter off
    (DPO, GRPO with beta > 0), adapter_off itself and serving it as an adapter are one-line errors;
    ORPO, SimPO and GRPO without the KL term train."""
    from krnl.models.sequence_loss import adapter_off
    from krnl.serve.adapters import Adapters
    from krnl.train.preference import check_full
    from krnl.train.trainer import TrainConfig

    m, _ = full_model()
    for mode, beta in (("dpo", 0.1), ("grpo", 0.04)):
        with pytest.raises(ValueError, match=rf"^\[train\] --train-mode {mode} takes its reference from the base"):
            check_full(TrainConfig(train_mode=mode, beta=beta), m.lora_config)
    for mode, beta in (("orpo", 0.1), ("simpo", 2.0), ("grpo", 0.0), ("sft", 0.1)):
        check_full(TrainConfig(train_mode=mode, beta=beta), m.lora_config)
    emb, _ = full_model(train_embeddings=True)
    with pytest.raises(ValueError, match=r"^\[train\] --train-embeddings trains with --train-mode sft only"):
        check_full(TrainConfig(train_mode="orpo"), emb.lora_config)
    from krnl.models.sequence_loss import forward_backward_rows
    with pytest.raises(ValueError, match=r"cannot train the embeddings and head"):
        forward_backward_rows(emb, *BATCH, lambda r: (r, None))
    with pytest.raises(ValueError, match=r"^\[adapter_off\] a full fine-tune"):
        with adapter_off(m):
            pass
    with pytest.raises(ValueError, match=r"^\[serve\] run is a full fine-tune: serve the model it wrote"):
        Adapters(m, {"a": "run"})
