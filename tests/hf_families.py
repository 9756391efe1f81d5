"""What the model-family tests (test_qwen3.py, test_phi3.py, test_gemma2.py) share: tiny random
transformers models saved as HF folders, token batches, transformers' loss, and the LoRA
gradients PyTorch autograd computes through PEFT, compared with krnl's."""

import numpy as np
import pytest

from mlx_folders import write_tokenizer


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
    from krnl import hf
    from krnl.model import LoraConfig
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
