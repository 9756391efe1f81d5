"""generate_batch (krnl.models.batch_decode): many sequences decoded together, those of one prompt
sharing its prefill, give row for row the tokens of one generate() call per row with its seed:
greedy, sampled, top-k and top-p, with rows stopping at EOS at different steps, prompts of 1 to 9
tokens, and windows, soft-caps, q/k norms, sinks and experts on the families that have them; each
by decode_groups' steps and by FixedDecoder's (recorded and replayed where the device lists graphs)."""

import numpy as np
import pytest

import krnl
from krnl.models.batch_decode import FixedDecoder, GroupCache, decode_groups
from krnl.models.config import LoraConfig, ModelConfig, random_weights
from krnl.models.generate import KVCache, decode, sample, sample_rows
from krnl.models.model import LlamaModel

from conftest import TINY_LLAMA, metal_sim_as, METAL_SIM

V = TINY_LLAMA["vocab_size"]
TINY = dict(TINY_LLAMA, max_position_embeddings=64)
FAMILIES = {
    "llama": {},
    "qwen3": dict(model_type="qwen3", num_attention_heads=2, num_key_value_heads=1),
    "gemma2": dict(model_type="gemma2", num_attention_heads=2, num_key_value_heads=1, sliding_window=4,
                   query_pre_attn_scalar=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                   tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", num_attention_heads=2, num_key_value_heads=1, sliding_window=4,
                   query_pre_attn_scalar=8, sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=100.0,
                   tie_word_embeddings=True),
    "qwen3_moe": dict(model_type="qwen3_moe", moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2,
                      norm_topk_prob=True),
    "gpt_oss": dict(model_type="gpt_oss", intermediate_size=16, num_local_experts=5, num_experts_per_tok=2,
                    sliding_window=4, swiglu_limit=2.0),
}
# three rows of one prompt, two of another, one of a single token, and a prompt longer than the window
PROMPTS = [[5, 17, 3, 40, 9]] * 3 + [[7, 7, 30, 2, 44, 1, 8, 59, 12]] * 2 + [[33]]
SEEDS = [11, 12, 13, 14, 15, 16]
SAMPLING = [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.8, 0.7, 5)]


def tiny(dev, dtype, family, seed=0):
    cfg = ModelConfig.from_dict({**TINY, **FAMILIES[family]})
    m = LlamaModel(dev, cfg, random_weights(cfg, seed, std=0.3), LoraConfig(r=2, alpha=4.0), dtype=dtype)
    lora = m.lora_state()
    rng = np.random.default_rng(seed + 1)
    m.lora_params.load({k: (0.1 * rng.standard_normal(v.shape)).astype(np.float32) if ".lora_B." in k else v
                        for k, v in lora.items()})
    return m


def eos_for(m):
    """A token greedy decoding of PROMPTS meets at different steps (rows stop apart), else 0."""
    seen = [m.generate(p, 12, seed=s) for p, s in zip(PROMPTS[2:4], SEEDS[2:4])]
    return next((t for t in seen[0][2:] if t not in seen[1][:len(seen[0])]), 0)


def check(m, steps=16, fixed=False):
    """generate_batch against generate() per row for each of SAMPLING; the rows' lengths."""
    eos, lengths = eos_for(m), set()
    for temperature, top_p, top_k in SAMPLING:
        got = m.generate_batch(PROMPTS, steps, temperature, top_p, SEEDS, eos_id=eos, top_k=top_k, fixed=fixed)
        want = [m.generate(p, steps, temperature, top_p, s, eos_id=eos, top_k=top_k) for p, s in zip(PROMPTS, SEEDS)]
        assert got == want, (temperature, top_p, top_k)
        lengths |= {len(x) for x in got}
    return lengths


@pytest.mark.parametrize("fixed", [False, True], ids=["groups", "fixed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_batch(dev, family, fixed):
    lengths = check(tiny(dev, "f32", family), fixed=fixed)
    assert len(lengths) > 1 and 16 in lengths  # some rows met EOS while others ran on to the limit


@pytest.mark.parametrize("fixed", [False, True], ids=["groups", "fixed"])
def test_generate_batch_at_the_position_limit(dev, fixed):
    """A limit of 12 positions cuts rows of a 9-token prompt after 4 tokens as generate() does
    (FixedDecoder: that group stops while the others decode on)."""
    m = tiny(dev, "f32", "gpt_oss", seed=3)
    m.config.max_position_embeddings = 12
    got = m.generate_batch(PROMPTS, 16, 1.0, 1.0, SEEDS, fixed=fixed)
    assert got == [m.generate(p, 16, 1.0, 1.0, s) for p, s in zip(PROMPTS, SEEDS)]
    assert [len(x) for x in got[3:5]] == [4, 4]


@pytest.mark.parametrize("fixed", [False, True], ids=["groups", "fixed"])
def test_generate_batch_bf16(dev, fixed):
    """bf16 activations: each greedy token of the batch is the top one of the model's own logits
    for its row (a whole forward, no cache) up to bf16's rounding. Not generate()'s tokens bit for
    bit: a batch's products may sum in another order than one row's (cuBLAS picks its kernel by
    the row count), and a near tie then goes the other way."""
    m = tiny(dev, "bf16" if "bf16" in dev.capabilities()["dtypes"] else "f32", "gpt_oss", seed=3)
    got = m.generate_batch(PROMPTS, 12, 0.0, 1.0, SEEDS, fixed=fixed)
    for p, tokens in zip(PROMPTS, got):
        z = m.logits(np.array([p + tokens[:-1]]))[0, len(p) - 1:]        # (tokens, V)
        for i, (row, t) in enumerate(zip(z, tokens)):
            assert row[t] >= row.max() - 0.02 * np.abs(row).max(), (p, i, row[t], row.max())


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_fixed_decoder_step(dev, family):
    """FixedDecoder's logits against decode_groups' step by step, for groups at different
    positions (prompts of 9, 5 and 1 tokens; gemma2's and gpt_oss's windows of 4 behind them) on
    caches of 31 and 33 positions; a group that is not live leaves its cache as it was."""
    m = tiny(dev, "f32", family, seed=4)
    prompts, G = (PROMPTS[3], PROMPTS[0], PROMPTS[5]), (2, 3, 1)
    totals = (31, 33, 31)

    def groups(zero):
        out = []
        for p, g, total in zip(prompts, G, totals):
            pc = KVCache(dev, m.dtype, m.layers, m.heads, len(p), m.config.sliding_window)
            decode(m, p, 0, pc)
            out.append(GroupCache(m, pc, len(p), g, total, zero=zero))
        return out

    ref, got = groups(False), groups(True)
    fixed = FixedDecoder(m, got, bool(dev.capabilities()["graphs"]))
    rng = np.random.default_rng(5)
    try:
        for step in range(12):
            ids = rng.integers(0, V, sum(G)).tolist()
            live = [True, step % 3 != 1, step < 6]
            want = decode_groups(m, [gc for gc, on in zip(ref, live) if on],
                                 [t for t, on in zip(ids, np.repeat(live, G)) if on])
            idle = [[k.numpy().copy() for k in gc.k[0]] for gc, on in zip(got, live) if not on]
            logits = fixed.step(ids, live)[np.repeat(live, G)]
            np.testing.assert_allclose(logits, want, rtol=2e-4, atol=2e-4, err_msg=f"step {step}")
            assert [gc.pos for gc in got] == [gc.pos for gc in ref]
            for before, gc in zip(idle, [gc for gc, on in zip(got, live) if not on]):
                np.testing.assert_array_equal(before, gc.k[0].numpy())
    finally:
        fixed.release()


@pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is not registered (KRNL_TEST_METAL_SIM=0)")
def test_generate_batch_metal_sim():
    """The Metal kernels (metal-sim): batched GEMMs over (sequence, KV head) pairs of strided cache
    rows; FixedDecoder's rank-1 appends and scores masked with -inf."""
    with metal_sim_as(9) as dev:
        m = tiny(dev, "f32", "gpt_oss", seed=2)
        want = [m.generate(p, 6, 1.0, 1.0, s) for p, s in zip(PROMPTS, SEEDS)]
        for fixed in (False, True):
            assert m.generate_batch(PROMPTS, 6, 1.0, 1.0, SEEDS, fixed=fixed) == want


def test_generate_batch_refuses_bad_input():
    m = tiny(krnl.device("cpu"), "f32", "llama")
    with pytest.raises(ValueError, match=r"\[generate\] the prompt is empty"):
        m.generate_batch([[1], []])
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        m.generate_batch([[1]], seeds=[1, 2])
    with pytest.raises(ValueError, match="top_p in"):
        m.generate_batch([[1]], top_p=0.0)
    with pytest.raises(ValueError, match="prompt"):
        m.generate_batch([[V + 3]])


def test_sample_rows_matches_a_float64_reference():
    """Each row's draws against the distribution computed in float64 from its definition: softmax
    of logits / T over the top-k, cut to the smallest most-probable set reaching top_p. 31 and 33
    ids; a top-p whose nucleus outgrows the first 64 candidates (the full sort)."""
    rng = np.random.default_rng(0)
    for V_, T, top_p, top_k in ((31, 1.0, 1.0, 0), (33, 0.7, 0.8, 0), (33, 1.3, 1.0, 4), (1, 1.0, 1.0, 1), (127, 1.0, 0.9, 1),
                                (300, 1.0, 0.99, 0)):
        z = rng.standard_normal(V_) * 2
        p = np.exp((z - z.max()) / T)
        if top_k:
            p[z < np.sort(z)[-top_k]] = 0
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        keep = order[:np.searchsorted(np.cumsum(p[order]), top_p) + 1]
        want = np.zeros(V_)
        want[keep] = p[keep] / p[keep].sum()
        n = 20000
        rngs = [np.random.default_rng(s) for s in range(4)]
        draws = np.concatenate([sample_rows(np.tile(z, (4, 1)), T, top_p, rngs, top_k) for _ in range(n // 4)])
        freq = np.bincount(draws, minlength=V_) / n
        assert set(np.flatnonzero(freq)) <= set(keep)
        assert np.abs(freq - want).max() < 5 * np.sqrt(want.max() / n), (V_, T, top_p, top_k)
        # a row's draws do not depend on the rows beside it
        one = sample(z, T, top_p, np.random.default_rng(7), top_k)
        pair = [np.random.default_rng(7), np.random.default_rng(1)]
        assert one == sample_rows(np.stack([z, -z]), T, top_p, pair, top_k)[0]
