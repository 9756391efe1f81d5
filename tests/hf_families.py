"""What the model-family tests (test_families.py and the family-specific test_qwen3.py,
test_gemma2.py, test_gemma3.py, test_phi3.py) share: the tiny random transformers folders of each
family (FOLDERS, built once per session by family_folders), token batches, transformers' loss, and
the LoRA gradients PyTorch autograd computes through PEFT, compared with krnl's."""

import numpy as np
import pytest

from mlx_folders import write_tokenizer


V = 61  # vocabulary of every family folder
T = 13  # their batches' length: longer than every sliding window below
PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_rng = np.random.default_rng(5)
LONGROPE = {"rope_type": "longrope", "short_factor": [float(x) for x in 1 + _rng.random(10)],
            "long_factor": [float(x) for x in 1 + 3 * _rng.random(10)]}

# Each family's folders: transformers' config and model classes, the keywords every folder of the
# family takes, the save_random seed of the first folder (the i-th takes seed + i, after
# torch.manual_seed(i)), the norms' centre, and the folders by name.
FOLDERS = {
    # Qwen3: GQA (4 query heads on 2 KV heads), head_dim 10 with hidden 48 (not 48 / 4); untied and tied.
    "qwen3": dict(config="Qwen3Config", model="Qwen3ForCausalLM", seed=10, norm_center=1.0,
                  common=dict(vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0),
                  configs={
        "gqa": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=10, tie_word_embeddings=False),
        "tied": dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=24, tie_word_embeddings=True),
    }),
    # Gemma 2: GQA (4 query heads on 2 KV heads), head_dim 10 with hidden 48; windows 5 and 4 (< T);
    # layer types given, or (in "old") left to the default: even layers slide.
    "gemma2": dict(config="Gemma2Config", model="Gemma2ForCausalLM", seed=10, norm_center=0.0,
                   common=dict(vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True),
                   configs={
        "gqa": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=10, sliding_window=5, query_pre_attn_scalar=7,
                    attn_logit_softcapping=2.5, final_logit_softcapping=3.0,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        "old": dict(hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=24, sliding_window=4, query_pre_attn_scalar=24,
                    attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
    }),
    # Gemma 3 text: GQA (4 query heads on 2 KV heads), head_dim 10; window 5 < T; layer 2 of 3 full
    # ("pattern", as sliding_window_pattern 3 gives) or layer types given; global layers' rope scaled
    # by a linear factor 8 with rope_theta 1e6 against a local base of 1e4 (as the 4B-27B checkpoints).
    "gemma3": dict(config="Gemma3TextConfig", model="Gemma3ForCausalLM", seed=20, norm_center=0.0,
                   common=dict(vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True),
                   configs={
        "pattern": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=10, sliding_window=5, query_pre_attn_scalar=7,
                        sliding_window_pattern=3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}),
        "types": dict(hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=24, sliding_window=4, query_pre_attn_scalar=24,
                      layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                      rope_theta=50_000.0, rope_local_base_freq=300.0),
    }),
    # Phi-3: GQA (4 query heads on 2 KV heads, D 12), untied; and LongRoPE (D 20, original 8 positions
    # of 64: a 13-token batch takes the long factors, a 7-token one the short; attention factor sqrt(2)).
    "phi3": dict(config="Phi3Config", model="Phi3ForCausalLM", seed=10, norm_center=1.0,
                 common=dict(vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2),
                 configs={
        "gqa": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False),
        "longrope": dict(hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, tie_word_embeddings=False, original_max_position_embeddings=8,
                         rope_parameters=dict(LONGROPE, rope_theta=10000.0)),
    }),
}
_built = {}


def family_folders(tmp_path_factory, family):
    """{name: folder} of `family`'s FOLDERS, written by transformers once per test session."""
    key = (id(tmp_path_factory), family)
    if key not in _built:
        torch, transformers = torch_modules()
        f = FOLDERS[family]
        root = tmp_path_factory.mktemp(family)
        out = {}
        for i, (name, kw) in enumerate(f["configs"].items()):
            cfg = getattr(transformers, f["config"])(**f["common"], **kw)
            torch.manual_seed(i)
            m = getattr(transformers, f["model"])(cfg)
            out[name] = save_random(m, root / name, f["seed"] + i, norm_center=f["norm_center"])
        _built[key] = out
    return _built[key]


def family_batch(seed=0, B=2, T=T):
    """token_batch over the family folders' vocabulary."""
    return token_batch(V, seed, B, T)


def torch_modules():
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


def save_random(model, folder, seed, norm_center=1.0):
    """Saves transformers' `model` to `folder` (with a tokenizer) after drawing its weights at
    realistic sizes (the default init gives near-zero logits): norm weights around norm_center
    (0 for Gemma, which scales by 1 + w), the rest with unit-variance outputs."""
    torch, _ = torch_modules()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(norm_center + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def hf_model(folder):
    torch, transformers = torch_modules()
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def token_batch(V, seed=0, B=2, T=13):
    """(ids, labels as transformers takes them, targets as krnl takes them: the next token)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (B, T))
    labels = ids.copy()
    labels[0, :3] = -100  # masked prompt tokens
    targets = np.concatenate([labels[:, 1:], np.full((B, 1), -100)], axis=1)
    return ids, labels, targets


def torch_loss(model, ids, labels):
    torch, _ = torch_modules()
    with torch.no_grad():
        return float(model(torch.tensor(ids), labels=torch.tensor(labels)).loss)


def assert_greedy_matches(folder, prompt=(7, 1, 33, 12, 50), n=9):
    """krnl's KV-cached greedy tokens after `prompt` equal transformers' generate (no EOS stop), and
    are not one token repeated."""
    import krnl
    from krnl.formats import hf

    torch, _ = torch_modules()
    ref = hf_model(folder)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False,
                            pad_token_id=0)[0, len(prompt):].tolist()
    got = hf.load_model(folder, krnl.device("cpu")).generate(list(prompt), max_new_tokens=n)
    assert got == want and len(set(want)) > 1


def random_b(model, seed):
    """B factors off zero, so that every LoRA path carries signal; returns the LoRA state."""
    rng = np.random.default_rng(seed)
    st = model.lora_state()
    for k in st:
        if ".lora_B." in k:
            st[k] = (0.3 * rng.standard_normal(st[k].shape)).astype(np.float32)
    model.lora_params.load(st)
    return st


def check_lora_gradients(folder, targets, n_layers, batch, loss_rtol, grad_rtol, grad_checkpoint=False,
                         **model_attrs):
    """The family tests' PEFT gradient check: krnl's model of `folder` on the CPU with LoRA r=3,
    alpha 5 on `targets` (B factors off zero), `model_attrs` set on it first (fused_attention,
    attn_block), one step on batch = (ids, labels, targets), against assert_peft_gradients."""
    import krnl
    from krnl.formats import hf
    from krnl.models.config import LoraConfig
    from conftest import lora_step

    lora = LoraConfig(r=3, alpha=5.0, target_modules=targets)
    m = hf.load_model(folder, krnl.device("cpu"), lora=lora, grad_checkpoint=grad_checkpoint)
    for k, v in model_attrs.items():
        setattr(m, k, v)
    st = random_b(m, 1)
    ids, labels, tg = batch
    loss, grads = lora_step(m, ids, tg)
    assert_peft_gradients(folder, lora, st, ids, labels, loss, grads, 2 * len(targets) * n_layers, loss_rtol,
                          grad_rtol)


def assert_peft_gradients(folder, lora, state, ids, labels, loss, grads, n_factors, loss_rtol, grad_rtol,
                          **peft_kw):
    """krnl's loss and LoRA gradients (`grads`, PEFT names) against PyTorch autograd through
    PEFT's LoRA (same r, alpha, targets and factors `state`; peft_kw more LoraConfig fields) on
    transformers' model of `folder`: every one of the n_factors gradients non-zero and within
    grad_rtol of its largest value."""
    torch, _ = torch_modules()
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), lora_dropout=0.0,
                          **peft_kw)
    pm = peft.get_peft_model(hf_model(folder), cfg)
    peft.set_peft_model_state_dict(pm, {k: torch.tensor(v) for k, v in state.items()})
    out = pm(torch.tensor(ids), labels=torch.tensor(labels))
    out.loss.backward()
    ref = {n.replace(".default", ""): p.grad.double().numpy() for n, p in pm.named_parameters() if p.requires_grad}
    assert loss == pytest.approx(float(out.loss.detach()), rel=loss_rtol)
    assert set(ref) == set(grads) and len(ref) == n_factors
    for k, g in ref.items():
        scale = np.abs(g).max()
        assert scale > 0, k
        assert np.abs(grads[k] - g).max() <= grad_rtol * scale, k


def family_models(tmp_path_factory, name):
    """{family: folder} of the tiny models the fine-tune-type tests share: llama (make_base), qwen2
    (biases on q, k, v), qwen3, gemma2 and gemma3 (FOLDERS'), phi3."""
    from mlx_folders import make_base

    _, transformers = torch_modules()
    root = tmp_path_factory.mktemp(name)
    qwen2 = transformers.Qwen2Config(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return {"llama": make_base(root / "llama"),
            "qwen2": save_random(transformers.Qwen2ForCausalLM(qwen2), root / "qwen2", 4),
            "qwen3": family_folders(tmp_path_factory, "qwen3")["gqa"],
            "gemma2": family_folders(tmp_path_factory, "gemma2")["gqa"],
            "gemma3": family_folders(tmp_path_factory, "gemma3")["pattern"],
            "phi3": family_folders(tmp_path_factory, "phi3")["gqa"]}


def grad_error(grads, ref):
    """The largest gradient error relative to its tensor's largest reference value (each non-zero)."""
    assert set(grads) == set(ref)
    assert all(np.abs(g).max() > 0 for g in ref.values())
    return max(np.abs(grads[k] - g).max() / np.abs(g).max() for k, g in ref.items())
