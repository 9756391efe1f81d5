"""Gemma 2 (model_type "gemma2"): RMSNorm with (1 + w), four norms per layer, GeGLU, embeddings
scaled by sqrt(C), attention scale query_pre_attn_scalar ** -0.5, attention and final logit
soft-capping, sliding windows on alternating layers, tied head. What Gemma 2 adds to the checks
every family passes (tests/test_families.py: loss and logits, PEFT gradients and adapters, fuse,
generation and cached decoding, CLI, metal-sim, mlx-lm): its config; each piece (caps, windows)
moves the loss; the attention path a soft-capped layer takes; the norms fold 1 + w in f32; the
embedding scale rounds as transformers'; packed rows; the fused window without the attention cap;
a Gemma chat template refuses a system turn with its own error, as one line.

Tolerances as tests/test_families.py: losses in f32 within 1e-5 relative."""

import json
import shutil

import numpy as np
import pytest

import krnl
from krnl.formats import hf
from krnl.models.config import ModelConfig

from hf_families import FOLDERS, V, family_batch, family_folders, hf_model, torch_loss, torch_modules
from mlx_folders import write_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
LOSS_RTOL = 1e-5
CONFIGS = FOLDERS["gemma2"]["configs"]
_batch = family_batch


def test_config_reads_gemma2():
    d = {"model_type": "gemma2", "vocab_size": V, "hidden_size": 48, "intermediate_size": 80,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10,
         "sliding_window": 5, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
         "final_logit_softcapping": None, "tie_word_embeddings": True}
    c = ModelConfig.from_dict(d)
    assert c.gemma == {"attn_scale": 0.25, "attn_softcap": 50.0, "final_softcap": 0.0}
    assert c.layer_windows == [5, 0, 5]
    assert c.sliding_window is None  # per layer, not the Llama family's global window
    s = c.weight_shapes()
    for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        assert s[f"model.layers.2.{n}.weight"] == (48,)
    c2 = ModelConfig.from_dict({**d, "layer_types": ["full_attention", "sliding_attention", "full_attention"]})
    assert c2.layer_windows == [0, 5, 0]
    with pytest.raises(ValueError, match=r"key 'layer_types' must list 3"):
        ModelConfig.from_dict({**d, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match=r"unsupported hidden_activation 'silu'"):
        ModelConfig.from_dict({**d, "hidden_activation": "silu"})
    w = {k: np.zeros(v, np.float32) for k, v in s.items() if "pre_feedforward" not in k}
    with pytest.raises(ValueError, match=r"missing weights \['model.layers.0.pre_feedforward_layernorm.weight'"):
        c.check_weights(w)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return family_folders(tmp_path_factory, "gemma2")


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_gemma_piece_moves_the_loss(folders, name):
    """The final cap holds on transformers' logits; without the attention cap or the windows the
    loss moves (test_families' loss check sees them)."""
    torch, _ = torch_modules()
    folder = folders[name]
    ids, labels, targets = _batch()
    ref_model = hf_model(folder)
    ref = torch_loss(ref_model, ids, labels)
    with torch.no_grad():
        want = ref_model(torch.tensor(ids)).logits.numpy()
    assert np.abs(want).max() < CONFIGS[name]["final_logit_softcapping"]  # the final cap holds
    # Each Gemma piece matters: without the attention cap or the windows the loss moves.
    for change in ({"attn_logit_softcapping": None}, {"sliding_window": 64}):
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(change)
        c = ModelConfig.from_dict(hf.normalize_config(cfg))
        other = krnl.models.model.LlamaModel(krnl.device("cpu"), c, hf.load_hf_weights(folder))
        assert abs(other.loss(ids, targets) - ref) > 1e-4, change


def test_attention_path_follows_cap_and_capabilities():
    """A soft-capped layer is materialised even where the batch takes the fused op; without a cap
    a windowed layer takes the fused op only where the device lists the window."""
    from krnl.models.attention import FusedSaved, MaterialisedSaved
    from krnl.models.gemma2 import GemmaAttn, SoftcapSaved, attend
    from krnl.models.attention import Batch

    d = krnl.device("cpu")
    rng = np.random.default_rng(0)
    q, k, v = (d.tensor(rng.standard_normal(s).astype(np.float32), "f32") for s in ((2, 7, 8), (1, 7, 8), (1, 7, 8)))
    out = d.empty((2, 7, 8), "f32")
    pos = [d.tensor(np.arange(7, dtype=np.int32), "i32")]
    for cap, window, fused_window, want in ((2.0, 3, True, SoftcapSaved), (2.0, 0, True, SoftcapSaved),
                                            (0.0, 3, True, FusedSaved), (0.0, 3, False, MaterialisedSaved),
                                            (0.0, 0, False, FusedSaved)):
        batch = Batch(1, 7, pos, fused=True, fused_window=fused_window)
        assert type(attend(GemmaAttn(None, 0.3, cap, window), batch, 0, q, k, v, out)) is want, (cap, window)


@pytest.mark.torch
def test_norms_fold_one_in_f32_in_every_dtype(folders):
    """The frozen norm copies are 1 + w in f32 (rmsnorm's f32 weights), in a bf16 model too."""
    folder = folders["gqa"]
    w = hf.read_tensors(folder)
    m = hf.load_model(folder, krnl.device("cpu"), dtype="bf16")
    L = m.layers[1]
    for t, name in ((L.n1, "input_layernorm"), (L.gemma.post_attn, "post_attention_layernorm"),
                    (L.mlp.norm, "pre_feedforward_layernorm"), (L.mlp.post, "post_feedforward_layernorm")):
        assert t.dtype == "f32"
        want = 1.0 + np.asarray(w[f"model.layers.1.{name}.weight"], np.float32)
        assert np.array_equal(np.asarray(t.numpy()), want), name
    assert np.array_equal(np.asarray(m.norm_w.numpy()), 1.0 + np.asarray(w["model.norm.weight"], np.float32))


@pytest.mark.torch
@pytest.mark.parametrize("dtype, torch_dtype", [("f32", "float32"), ("f16", "float16"), ("bf16", "bfloat16")])
@pytest.mark.parametrize("C", [48, 2304, 3584])
def test_embed_scale_rounds_as_transformers(dtype, torch_dtype, C):
    torch, _ = torch_modules()
    from krnl.models.gemma2 import embed_scale

    c = ModelConfig.from_dict({**CONFIGS["gqa"], "model_type": "gemma2", "vocab_size": V, "hidden_size": C})
    assert embed_scale(c, dtype) == float(torch.tensor(C ** 0.5, dtype=getattr(torch, torch_dtype)))


@pytest.mark.torch
@pytest.mark.parametrize("fused", [False, True])
def test_packed_rows_equal_separate_sequences(folders, fused):
    """Two samples packed in one row (segments, per-token positions) give the loss of the two
    apart: the windows and the soft-capped scores stay inside a segment."""
    folder = folders["gqa"]
    rng = np.random.default_rng(8)
    a, b = rng.integers(0, V, 6), rng.integers(0, V, 7)
    tgt = lambda x: np.concatenate([x[1:], [-100]])
    m = hf.load_model(folder, krnl.device("cpu"))
    m.fused_attention = fused
    la, lb = m.loss(a[None], tgt(a)[None]), m.loss(b[None], tgt(b)[None])
    packed = m.loss(np.concatenate([a, b])[None], np.concatenate([tgt(a), tgt(b)])[None],
                    segments=np.array([[0] * 6 + [1] * 7]), positions=np.concatenate([np.arange(6), np.arange(7)])[None])
    assert packed == pytest.approx((5 * la + 6 * lb) / 11, rel=LOSS_RTOL)


@pytest.mark.torch
def test_loss_without_attention_softcap_takes_the_fused_window(folders, tmp_path):
    """No attention cap: the fused op runs the windowed layers where the device lists the window
    (the CPU does), else the materialised window; both equal transformers."""
    torch, transformers = torch_modules()
    cfg = json.loads((folders["gqa"] / "config.json").read_text())
    cfg["attn_logit_softcapping"] = None
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text(json.dumps(cfg))
    shutil.copy(folders["gqa"] / "model.safetensors", tmp_path / "f")
    ids, labels, targets = _batch(5)
    ref = torch_loss(hf_model(tmp_path / "f"), ids, labels)
    m = hf.load_model(tmp_path / "f", krnl.device("cpu"))
    assert krnl.device("cpu").capabilities()["fused_attention"]["window"]
    for fused, fused_window in ((True, True), (True, False), (False, False)):
        m.fused_attention, m.fused_window = fused, fused_window
        assert m.loss(ids, targets) == pytest.approx(ref, rel=LOSS_RTOL), (fused, fused_window)


# A Gemma-style chat template (user/model turns, no system role), written for this test.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def test_gemma_chat_template_refuses_a_system_turn(tmp_path):
    from krnl.train.data import DataError, load_split
    from krnl.io.tokenizer import Tokenizer

    write_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": GEMMA_TEMPLATE}))
    tok = Tokenizer.from_folder(tmp_path)
    ok = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    assert tok.apply_chat_template(ok).endswith("<start_of_turn>model\nw3<end_of_turn>\n")
    rows = [{"messages": ok}, {"messages": [{"role": "system", "content": "w4"}, *ok]}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        load_split(tmp_path / "train.jsonl", tok, 32)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"[data] {tmp_path / 'train.jsonl'}:2: ")
    assert msg.endswith("System role not supported")
