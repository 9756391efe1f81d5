"""The memory a run needs, known before it runs (krnl.train.memory; README 'Memory'): the estimate
against the pool's measured peak over real training steps, `krnl plan` / `--dry-run`, the choices
of `--max-memory` / `--fit`, and the one line an out-of-memory step ends with."""

import gc
import importlib.util
import re
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

import krnl
import krnl.models.model
from krnl import _core
from krnl.cli.args import lora_from_args, parse_args
from krnl.cli.main import main
from krnl.cli import memory as cli_memory
from krnl.io.checkpoint import list_checkpoints, load_checkpoint
from krnl.models import mlp_rows
from krnl.models.batch_decode import generate_batch
from krnl.models.config import LoraConfig, ModelConfig, random_weights
from krnl.models.model import LlamaModel
from krnl.train import memory
from krnl.train.trainer import TrainConfig, Trainer

from conftest import METAL_SIM, ROOT

LLAMA = dict(model_type="llama", vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
MOE = dict(LLAMA, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96)
GEMMA2 = dict(LLAMA, model_type="gemma2", tie_word_embeddings=True, query_pre_attn_scalar=32, sliding_window=32)


@pytest.fixture
def cpu1():
    """A CPU device of its own (conftest registers cpu:1): no other test's buffers in its pool (the
    earlier tests' models collected first: a cycle among their objects would hold their tensors)."""
    gc.collect()
    dev = krnl.device("cpu:1")
    yield dev
    dev.set_memory_limit(None)


def measured(dev, out, cfg, lora, dtype="f32", B=2, T=64, gc=False, quantize=None, micro=1, packed=False,
             fused=False, fold=False, monkeypatch=None, optimizer="adamw", momentum=None, order="rows", block=None):
    """(the pool's peak reserved bytes over two training steps, the Run that describes them).
    block: mlp_rows.LIMIT, the bytes a checkpointed MLP's (rows, F) block may hold."""
    if monkeypatch is not None:
        monkeypatch.setenv("KRNL_LORA_FOLD", "1" if fold else "0")
        if block is not None:
            monkeypatch.setattr(mlp_rows, "LIMIT", block)
    config = ModelConfig.from_dict(cfg)
    dev.synchronize()
    dev.trim()
    dev.reset_peak()
    base = dev.pool_stats()["reserved"]
    m = LlamaModel(dev, config, random_weights(config, seed=0), lora=replace(lora), dtype=dtype,
                   grad_checkpoint=gc, quantize=quantize)
    m.fused_attention = m.token_major = fused  # CUDA's paths, which the CPU runs as reference loops
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (4 * B * micro, T)).astype(np.int32)
    data = (ids, np.roll(ids, -1, 1))
    if packed:  # two samples a row
        seg = np.repeat((np.arange(T) >= T // 3).astype(np.int32)[None], len(ids), 0)
        data += (seg, np.where(seg == 0, np.arange(T), np.arange(T) - T // 3).astype(np.int32))
    cfg_t = TrainConfig(iters=2, batch_size=B, grad_accum=micro, val_every=0, save_every=0, warmup=0,
                        optimizer=optimizer, min_8bit_size=256, momentum=momentum, reduce_order=order)
    Trainer(m, cfg_t, data, None, out_dir=out, progress=False).run()
    peak = dev.pool_stats()["peak_reserved"] - base
    traits = replace(memory.Traits.of(dev), fused_dtypes=(dtype,) if fused else (), token_major=fused,
                     lora_fold=fold)
    return peak, memory.Run(config, lora, dtype, quantize=quantize, batch=B, seq=T, grad_checkpoint=gc,
                            micro_batches=micro, packed=packed, device=traits, optimizer=optimizer,
                            min_8bit_size=256, momentum=momentum or 0.0, sample_order=order == "sample")


R8 = LoraConfig(r=8, alpha=16)
CASES = {
    "dense f32": dict(cfg=LLAMA),
    "dense f32, sgd": dict(cfg=LLAMA, optimizer="sgd"),
    "dense f32, sgd with momentum": dict(cfg=LLAMA, optimizer="sgd", momentum=0.9),
    "dense f32, lion": dict(cfg=LLAMA, optimizer="lion"),
    "dense f32, muon": dict(cfg=LLAMA, optimizer="muon"),
    "dense f32, adafactor": dict(cfg=LLAMA, optimizer="adafactor"),
    "dense f32, 8-bit AdamW": dict(cfg=LLAMA, optimizer="adamw8bit"),
    "dense bf16": dict(cfg=LLAMA, dtype="bf16"),
    "dense f32, checkpointed": dict(cfg=LLAMA, gc=True),
    "dense bf16, checkpointed, T 300 in 3 attention blocks": dict(cfg=LLAMA, dtype="bf16", gc=True, B=1, T=300),
    "checkpointed MLPs in blocks of 37 rows, LoRA folded": dict(cfg=LLAMA, gc=True, T=37, block=384 * 4 * 37,
                                                                fold=True),
    "checkpointed MLPs in 3 blocks of 100 rows, bf16, 4-bit base": dict(cfg=LLAMA, dtype="bf16", gc=True, B=3,
                                                                        T=100, quantize=(4, 32), block=384 * 2 * 128),
    "4-bit base": dict(cfg=LLAMA, quantize=(4, 32)),
    "8-bit base bf16, checkpointed": dict(cfg=LLAMA, quantize=(8, 64), dtype="bf16", gc=True),
    "GQA 8/2 f16, B 3 T 96, 2 micro-batches": dict(cfg=dict(LLAMA, num_attention_heads=8, head_dim=16), dtype="f16",
                                                    B=3, T=96, micro=2),
    "qwen2 biases, dropout": dict(cfg=dict(LLAMA, model_type="qwen2", attention_bias=True),
                                  lora=LoraConfig(r=8, alpha=16, dropout=0.1)),
    "qwen3 q/k norms, q and v only, packed": dict(cfg=dict(LLAMA, model_type="qwen3"), packed=True,
                                                  lora=LoraConfig(r=4, target_modules=("q_proj", "v_proj"))),
    "MoE bf16": dict(cfg=MOE, dtype="bf16"),
    "MoE f32, checkpointed": dict(cfg=MOE, gc=True),
    "fused token-major attention, LoRA folded (CUDA's paths)": dict(cfg=LLAMA, dtype="bf16", fused=True, fold=True),
    "DoRA bf16, 4-bit base, q, v and down": dict(cfg=LLAMA, dtype="bf16", quantize=(4, 32), lora=LoraConfig(
        r=8, alpha=16, use_dora=True, target_modules=("q_proj", "v_proj", "down_proj"))),
    "DoRA f32, checkpointed, dropout": dict(cfg=LLAMA, gc=True, lora=LoraConfig(r=8, use_dora=True, dropout=0.1)),
    "gemma2 soft-capped, bf16": dict(cfg=dict(GEMMA2, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
                                     dtype="bf16"),
    "gemma3 (local rotary), checkpointed, DoRA": dict(cfg=dict(GEMMA2, model_type="gemma3_text"), gc=True,
                                                      lora=LoraConfig(r=8, use_dora=True)),
    "full fine-tuning of gemma2's embeddings (tied, scaled), f16": dict(
        cfg=GEMMA2, dtype="f16", lora=LoraConfig(full=True, train_embeddings=True, target_modules=("o_proj",))),
    "OLMoE (q/k norms over all heads), full fine-tuning of its attention": dict(
        cfg=dict(MOE, model_type="olmoe"), lora=LoraConfig(full=True, target_modules=("q_proj", "k_proj", "v_proj",
                                                                                        "o_proj"))),
    "gpt-oss (sinks, windows, biased experts, yarn)": dict(cfg=dict(
        model_type="gpt_oss", vocab_size=1024, hidden_size=128, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=16, max_position_embeddings=4096, rms_norm_eps=1e-5, swiglu_limit=7.0,
        rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, rope_theta=150000.0,
                             original_max_position_embeddings=4096, truncate=False))),
    "the sample reduce order, 3 samples, 2 micro-batches": dict(cfg=LLAMA, order="sample", B=3, micro=2),
    "the sample reduce order, bf16, 4 samples, phi3's fused projections, DoRA": dict(
        cfg=dict(LLAMA, model_type="phi3"), order="sample", B=4, dtype="bf16", lora=LoraConfig(r=8, use_dora=True)),
    "phi3's LongRoPE past its original 32 positions": dict(cfg=dict(
        LLAMA, model_type="phi3", original_max_position_embeddings=32, rope_scaling=dict(
            rope_type="longrope", short_factor=[1.0] * 16, long_factor=[2.0] * 16))),
    "full fine-tuning bf16": dict(cfg=LLAMA, dtype="bf16", lora=LoraConfig(full=True)),
    "full fine-tuning with the embeddings, head and final norm": dict(
        cfg=LLAMA, lora=LoraConfig(full=True, train_embeddings=True, layers=[3])),
    "full fine-tuning of o and a tied table, f16": dict(
        cfg=dict(LLAMA, tie_word_embeddings=True), dtype="f16",
        lora=LoraConfig(full=True, train_embeddings=True, target_modules=("o_proj",))),
    "full fine-tuning f32, checkpointed, last 2 layers": dict(cfg=LLAMA, gc=True,
                                                               lora=LoraConfig(full=True, layers=[2, 3])),
    "full fine-tuning of qwen2's q and v (k frozen between them), their biases": dict(
        cfg=dict(LLAMA, model_type="qwen2", attention_bias=True),
        lora=LoraConfig(full=True, target_modules=("q_proj", "v_proj"))),
    "full fine-tuning, MoE attention and norms, 8-bit AdamW": dict(
        cfg=MOE, optimizer="adamw8bit",
        lora=LoraConfig(full=True, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_matches_the_measured_peak(cpu1, monkeypatch, tmp_path, case):
    kw = dict(CASES[case])
    peak, run = measured(cpu1, tmp_path, kw.pop("cfg"), kw.pop("lora", R8), monkeypatch=monkeypatch, **kw)
    est = memory.estimate(run)
    assert abs(est.total - peak) <= 0.01 * peak, (case, est.total, peak)
    assert sum(est.parts.values()) == est.total and est.parts["slack"] >= 0
    # a full fine-tune's peak may be its optimizer step's, where no activation is held
    assert est.parts.get("optimizer" if run.lora.full else "checkpoints" if run.grad_checkpoint else "activations") > 0


@pytest.mark.skipif(METAL_SIM is None, reason="metal-sim is off (KRNL_TEST_METAL_SIM=0)")
def test_metal_pool_stays_near_its_live_peak(tmp_path):
    """The Metal backend's pool (metal-sim: its submission, completion lagging behind commit)
    reuses a buffer released inside a step for the step's later requests, as the plan counts a
    queue-ordered device's: the pool's peak stays near the live one (it was 2x when a step's
    buffers waited for the step's end), and checkpointing lowers it. The plan leaves out the
    backend's own temporaries (split-K workspaces, the attention backward's delta), which at these
    sizes put it 7-10% under the pool."""
    sim = krnl.device("metal-sim")
    peaks = {}
    for case in ("dense f32", "dense f32, checkpointed"):
        kw = dict(CASES[case])
        peaks[case], run = measured(sim, tmp_path / str(len(peaks)), kw.pop("cfg"), kw.pop("lora", R8), **kw)
        assert run.device.queue_ordered
        assert peaks[case] <= 1.2 * sim.pool_stats()["peak_in_use"], (case, sim.pool_stats())
        est = memory.estimate(run).total
        assert 0.85 * peaks[case] <= est <= peaks[case], (case, est, peaks[case])
    assert peaks["dense f32, checkpointed"] < 0.85 * peaks["dense f32"], peaks


class Chars:
    """GRPO's tokenizer of the measured runs: no EOS, so every completion takes its whole length."""
    eos_id, pad_id = None, 0

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def measured_mode(dev, cfg, mode, lora=R8, dtype="f32", B=2, T=48, gc=False, beta=0.1, G=3, completion=16,
                  fixed=False):
    """(the pool's peak reserved bytes over two steps of --train-mode `mode`, the Run that describes
    them): B pairs of rows of T tokens (the prompt a third), or B prompts of T - completion tokens
    with G completions each; fixed: GRPO's generation by FixedDecoder's steps, as where the device
    records graphs (here run eagerly: a recording takes what its warm-up did)."""
    from krnl.train.data import Sample
    from krnl.train.grpo import GRPO
    from krnl.train.pairs import PairBatches, PromptBatches

    config = ModelConfig.from_dict(cfg)
    dev.trim()
    base = dev.pool_stats()["reserved"]
    m = LlamaModel(dev, config, random_weights(config, seed=0), lora=replace(lora), dtype=dtype, grad_checkpoint=gc)
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(1, config.vocab_size, n).astype(np.int32)
    learn = np.arange(T) >= T // 3
    objective = None
    if mode == "grpo":
        data = PromptBatches([(list(ids(T - completion)), {"prompt": str(i)}) for i in range(4 * B)], B, 0)
        objective = GRPO(Chars(), [("a", lambda completions, **kw: [float(c.count("a")) for c in completions])],
                         num_generations=G, max_completion_length=completion, beta=beta)
    else:
        data = PairBatches([(Sample(ids(T), learn), Sample(ids(T), learn)) for _ in range(4 * B)], B, 0)
    cfg_t = TrainConfig(iters=2, batch_size=B, val_every=0, save_every=0, warmup=0, train_mode=mode, beta=beta,
                        loss_type="dapo" if mode == "grpo" else "sigmoid")
    with pytest.MonkeyPatch.context() as mp:
        if fixed:
            mp.setattr(krnl.models.model, "generate_batch", lambda *a, **k: generate_batch(*a, **{**k, "fixed": True}))
        Trainer(m, cfg_t, data, None, out_dir=dev.name, progress=False, objective=objective).run()
    peak = dev.pool_stats()["peak_reserved"] - base
    grpo = dict(rows_per_item=G, completion=completion, reference=bool(beta)) if mode == "grpo" else \
        dict(rows_per_item=2, reference=mode == "dpo")
    return peak, memory.Run(config, lora, dtype, batch=B, seq=T, grad_checkpoint=gc,
                            device=replace(memory.Traits.of(dev), graphs=fixed), objective=mode, **grpo)


MODE_CASES = {
    "dpo f32": dict(cfg=LLAMA, mode="dpo"),
    "dpo bf16, checkpointed": dict(cfg=LLAMA, mode="dpo", dtype="bf16", gc=True),
    "orpo f32 (no reference)": dict(cfg=LLAMA, mode="orpo"),
    "simpo on a mixture of experts": dict(cfg=MOE, mode="simpo", B=1),
    "grpo, no KL term": dict(cfg=LLAMA, mode="grpo", beta=0.0),
    "grpo bf16 with the KL term, 4 generations": dict(cfg=LLAMA, mode="grpo", dtype="bf16", G=4, T=64),
    "grpo, fixed decoding steps": dict(cfg=LLAMA, mode="grpo", beta=0.0, fixed=True),
}


@pytest.mark.parametrize("case", list(MODE_CASES))
def test_estimate_of_sequence_objectives_matches_the_measured_peak(cpu1, tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    peak, run = measured_mode(cpu1, **MODE_CASES[case])
    est = memory.estimate(run)
    assert abs(est.total - peak) <= 0.01 * peak, (case, est.total, peak)
    sft = memory.estimate(replace(run, objective="sft", rows_per_item=1, reference=False, completion=0))
    assert est.total > sft.total  # a pair's two rows, G completions a prompt


def test_plan_counts_the_fused_attention_backward_workspace():
    """A device whose fused attention backward takes a workspace from the pool (CUDA's cuDNN: its
    capabilities' bytes a (B, H, T, D) element and a (B, H, T) row) has it in the plan, at the
    backward's peak; the CPU reports none."""
    assert memory.Traits.of(krnl.device("cpu")).attention_workspace == (0, 0)
    cfg = ModelConfig.from_dict(dict(LLAMA, num_hidden_layers=2))
    run = memory.Run(cfg, R8, "bf16", batch=2, seq=512, grad_checkpoint=True, device=memory.CUDA)
    none = memory.estimate(replace(run, device=replace(memory.CUDA, attention_workspace=(0, 0))))
    ws = 2 * 4 * 512 * (8 * 32 + 4)  # B H T (8 D + 4) bytes
    got = memory.estimate(run)
    assert 0 < got.total - none.total <= memory.class_size(ws)
    assert got.parts["working"] >= ws  # the peak is the workspace's moment


def test_class_size_is_the_pools():
    for n in list(range(1, 9000, 97)) + [2**k + d for k in range(12, 34) for d in (-1, 0, 1, 2**k // 3)]:
        assert memory.class_size(n) == _core.testing.HostBufferPool.class_size(n), n


def test_trace_holds_released_buffers_until_the_step_ends_where_not_queue_ordered():
    for ordered, peak in ((True, 2 << 20), (False, 3 << 20)):
        t = memory.Trace(queue_ordered=ordered)
        t.begin_step()
        t.free(t.alloc((1 << 20,), 1, "x"))
        a, b = t.alloc((1 << 20,), 1, "x"), t.alloc((1 << 20,), 1, "x")
        t.end_step()
        t.free(a, b)
        assert (t.peak_reserved, t.peak_in_use, t.reserved) == (peak, 2 << 20, peak)


def test_trace_records_graphs_through_the_arena():
    """A recording's request takes a released arena buffer of its class; while no graph lives,
    the pool's cached one of its class next; else the smallest released arena buffer that holds
    it, else a new one. What a recording releases stays the graphs', in use to the pool."""
    MiB, t = 1 << 20, memory.Trace()
    t.free(t.alloc((MiB,), 1, "x"), t.alloc((MiB // 2,), 1, "x"))  # the warm-up: one of each cached

    def first():
        t.free(t.alloc((MiB,), 1, "x"))        # the pool's MiB, then the arena's
        t.free(t.alloc((MiB // 2,), 1, "x"))   # no graph yet: the pool's half, not the arena's MiB

    t.record(first)
    assert (t.reserved, t.in_use, t.arena, t.graphs) == (3 * MiB // 2, 3 * MiB // 2, [MiB // 2, MiB], 1)

    def second():
        c = t.alloc((MiB // 4,), 1, "x")       # a graph lives: best fit, the arena's half
        d = t.alloc((MiB // 2,), 1, "x")       # best fit: the MiB
        e = t.alloc((MiB // 2,), 1, "x")       # nothing released holds it: the pool grows
        t.free(c, d, e)

    t.record(second)
    assert (t.reserved, t.in_use, t.arena) == (2 * MiB, 2 * MiB, [MiB // 2, MiB // 2, MiB])
    t.free(t.alloc((MiB,), 1, "x"))            # eager again: the pool's rules
    assert t.reserved == 3 * MiB


def test_estimate_of_a_replayed_step_holds_its_recording():
    """Run.replay (steps recorded as graphs, the Trainer's choice where the device has them): the
    warm-up's buffers stay cached while the recording takes its own, so the plan is at least the
    eager one's, and one micro-batch or several record the same."""
    run = memory.Run(ModelConfig.from_dict(LLAMA), R8, "bf16", batch=2, seq=256, device=memory.CUDA)
    eager, replayed = memory.estimate(run), memory.estimate(replace(run, replay=True))
    assert replayed.total > eager.total and replayed.live > eager.live
    assert memory.estimate(replace(run, replay=True, micro_batches=3)).total == replayed.total


def test_optimizer_state_is_a_function_of_the_optimizer():
    run = memory.Run(ModelConfig.from_dict(LLAMA), R8, "f32", batch=1, seq=16)
    est = memory.estimate(run)
    assert est.parts["optimizer"] == 2 * est.parts["grads"]  # AdamW: m and v, f32 like the gradients
    with pytest.raises(ValueError, match="no state layout for optimizer 'sgdx'"):
        memory.estimate(replace(run, optimizer="sgdx"))


# -- the command line: the embedded tiny model, B 16 rows of 12 tokens ----------------------------

def default_run(*argv):
    args = parse_args(["train", *argv], defaultdict(lambda: None))
    args.dtype = "f32"
    config, fq, _ = cli_memory.model_config(args)
    T, _ = cli_memory.longest(args, config)
    return cli_memory.run_of(args, krnl.device("cpu"), lora_from_args(args), config, T, None, fq)


def test_plan_prints_each_part_the_total_and_whether_it_fits(capsys):
    assert main(["plan", "--batch-size", "16", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    est = memory.estimate(default_run("--batch-size", "16"))
    assert "16 x 12 tokens a micro-batch" in out
    for name in ("frozen weights", "trained weights", "their gradients", "optimizer state", "saved activations",
                 "attention", "loss", "pool slack"):
        assert name in out, out
    assert "total (peak of the pool)" in out and memory.size_text(est.total) in out
    assert "budget: " in out and "available RAM" in out and "fits: yes" in out
    assert main(["train", "--dry-run", "--batch-size", "16", "--device", "cpu"]) == 0  # the same plan
    assert capsys.readouterr().out == out


def test_plan_of_a_rank_holds_its_share_in_the_sample_order(capsys):
    from types import SimpleNamespace

    args = parse_args(["plan", "--batch-size", "4", "--device", "cpu", "--dtype", "f32"], defaultdict(lambda: None))
    config, fq, _ = cli_memory.model_config(args)
    two = SimpleNamespace(size=2)  # a world of two ranks (World's size is what the plan reads)
    run = cli_memory.run_of(args, krnl.device("cpu"), lora_from_args(args), config, 12, None, fq, two)
    assert (run.ranks, run.sample_order) == (2, True)  # auto: the sample order where ranks share a batch
    assert memory.estimate(run).total == memory.estimate(default_run("--batch-size", "2", "--reduce-order",
                                                                     "sample")).total
    assert cli_memory.before_load(args, krnl.device("cpu"), lora_from_args(args), None, two) == 0
    assert ("4 x 12 tokens a micro-batch (the embedded task's rows), 2 rows on each of 2 ranks, 1 a step, in the "
            "sample reduce order") in capsys.readouterr().out


def test_max_memory_chooses_checkpointing_then_micro_batches(capsys, cpu1):
    base = default_run("--batch-size", "16")
    plain, gc = memory.estimate(base).total, memory.estimate(replace(base, grad_checkpoint=True)).total
    half = memory.estimate(replace(base, grad_checkpoint=True, batch=8, micro_batches=2)).total
    assert half < gc < plain
    cpu1.trim()
    held = cpu1.pool_stats()["reserved"]  # what the pool holds counts against its limit
    plan = ["plan", "--batch-size", "16", "--device", "cpu:1", "--max-memory"]
    assert main(plan + [str(held + (gc + plain) // 2)]) == 0
    out = capsys.readouterr().out
    assert "memory: --grad-checkpoint fits" in out and "micro-batches" not in out, out
    assert main(plan + [str(held + (half + gc) // 2)]) == 0
    out = capsys.readouterr().out
    assert "memory: --grad-checkpoint, micro-batches of 8 rows, 2 accumulated (global batch 16 kept)" in out
    assert main(plan + ["64K"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("krnl plan: error: [memory] nothing fits"), err


def test_fit_trains_within_the_limit_it_chose(tmp_path, capsys, cpu1):
    base = default_run("--batch-size", "16")
    plain, gc = memory.estimate(base).total, memory.estimate(replace(base, grad_checkpoint=True)).total
    cpu1.trim()
    held = cpu1.pool_stats()["reserved"]  # other tests' live tensors, if any: the limit counts them
    size = gc + held + 1024
    assert size < plain
    rc = main(["train", "--batch-size", "16", "--device", "cpu:1", "--max-memory", str(size), "--iters", "2",
               "--quiet", "--no-tune", "--adapter-path", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert rc == 0 and "memory: --grad-checkpoint fits" in out, out
    assert cpu1.memory_limit["bytes"] == size


def mode_folder(tmp_path):
    """A tiny HF folder, pairs of prompts of 1-3 words (train.jsonl), and the arguments of a plan on it."""
    import json
    from mlx_folders import make_base

    make_base(tmp_path / "base")
    (tmp_path / "data").mkdir()
    rng = np.random.default_rng(0)
    lines = [{"prompt": " ".join(f"w{i}" for i in rng.integers(10, 40, k)), "chosen": " w5 w6",
              "rejected": " w7 w8 w9"} for k in (1, 2, 3, 1, 2, 3)]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return ["plan", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "--device", "cpu",
            "--dtype", "f32"]


def test_plan_says_when_rows_of_several_lengths_record_several_graphs(tmp_path, capsys, monkeypatch):
    """Where steps replay as graphs (here a CPU that says it records them), --data whose rows pad
    to several lengths gets a line saying the plan is the longest's; --pack and --no-graphs not."""
    plan = mode_folder(tmp_path)
    (tmp_path / "data" / "train.jsonl").write_text("".join(
        '{"text": "%s"}\n' % " ".join(["w5"] * k) for k in (1, 6, 13, 2)))
    monkeypatch.setattr(memory.Traits, "of", classmethod(lambda cls, dev: replace(memory.CUDA, queue_ordered=True)))
    bucket = ["--length-bucket", "8", "--batch-size", "2"]
    assert main(plan + bucket) == 0
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("memory: the rows pad")]
    got = re.search(r"up to (\d+) lengths \((\d+) to (\d+) tokens\)", line[0]) if len(line) == 1 else None
    T = re.search(r" x (\d+) tokens a micro-batch", out)
    assert got and int(got[1]) > 1 and int(got[2]) == 8 and got[3] == T[1], out  # the plan is the longest's
    for extra in (["--pack", "--max-seq-length", "16"], ["--no-graphs"]):
        assert main(plan + bucket + extra) == 0
        assert "memory: the rows pad" not in capsys.readouterr().out


def test_plan_of_preference_and_grpo_runs_counts_their_rows(tmp_path, capsys):
    from krnl.formats import hf
    from krnl.train.pairs import load_pair_dataset, load_prompts

    plan = mode_folder(tmp_path)
    tok = hf.load_tokenizer(tmp_path / "base")
    pairs = load_pair_dataset(tmp_path / "data", tok, 2048)["train"]
    T = max(len(x) for p in pairs.pairs for x in p[:2])
    assert main(plan + ["--train-mode", "dpo", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert f"4 rows (2 pairs) x {T} tokens a micro-batch (the longest pair of " in out, out
    args = parse_args(["train", *plan[1:], "--train-mode", "dpo", "--batch-size", "2"], defaultdict(lambda: None))
    config = hf.read_config(tmp_path / "base")
    run = cli_memory.run_of(args, krnl.device("cpu"), lora_from_args(args), config, T, None, None)
    assert (run.objective, run.rows_per_item, run.reference, run.batch) == ("dpo", 2, True, 2)
    assert memory.size_text(memory.estimate(run).total) in out
    # the loaded run's estimate (the out-of-memory line's) reads the pairs' rows, not the pairs
    m = hf.load_model(tmp_path / "base", krnl.device("cpu"), lora=lora_from_args(args), dtype="f32")
    assert cli_memory.after_load(args, krnl.device("cpu"), m, pairs).run.seq == T
    # grpo: the batch counts completions, a row is the longest prompt and the completion
    longest = max(len(ids) for ids, _ in load_prompts(tmp_path / "data" / "train.jsonl", tok, 2048))
    grpo = ["--train-mode", "grpo", "--num-generations", "2", "--max-completion-length", "9"]
    assert main(plan + grpo + ["--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert f"4 rows (4 completions of 2 prompts) x {longest + 9} tokens a micro-batch" in out, out
    assert main(plan + grpo + ["--batch-size", "3"]) == 1
    assert "--batch-size 3 (completions) is not whole groups of --num-generations 2" in capsys.readouterr().err


def test_fit_trains_dpo_within_the_limit_it_chose(tmp_path, capsys, cpu1):
    plan = mode_folder(tmp_path)
    dpo = ["--train-mode", "dpo", "--batch-size", "2", "--device", "cpu:1"]
    args = parse_args(["train", *plan[1:], *dpo], defaultdict(lambda: None))
    config, _, _ = cli_memory.model_config(args)
    run = cli_memory.run_of(args, cpu1, lora_from_args(args), config, cli_memory.longest(args, config)[0], None, None)
    plain, gc = memory.estimate(run).total, memory.estimate(replace(run, grad_checkpoint=True)).total
    cpu1.trim()
    size = gc + cpu1.pool_stats()["reserved"] + 1024
    assert size < plain
    rc = main(["train", *plan[1:], *dpo, "--max-memory", str(size), "--iters", "2", "--quiet", "--no-tune",
               "--adapter-path", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert rc == 0 and "memory: --grad-checkpoint fits" in out, out


def test_fit_of_grpo_keeps_whole_groups():
    run = memory.Run(ModelConfig.from_dict(LLAMA), R8, "f32", batch=4, seq=64, objective="grpo", rows_per_item=2,
                     completion=32)
    sizes = [(c.batch, c.micro_batches) for c in memory.candidates(run)][2:4]
    assert sizes == [(2, 2), (1, 4)]  # prompts a micro-batch: each keeps its G completions
    assert memory.describe(replace(run, batch=1, micro_batches=4), run) == \
        "micro-batches of 2 completions, 4 accumulated (global batch 8 kept)"


def test_out_of_memory_is_one_line_naming_the_step_and_what_to_change(tmp_path, capsys):
    dev = krnl.device("cpu")
    dev.trim()
    try:
        dev.set_memory_limit(dev.pool_stats()["reserved"] + (2 << 20))
        rc = main(["train", "--batch-size", "16", "--device", "cpu", "--iters", "2", "--quiet", "--no-tune",
                   "--adapter-path", str(tmp_path / "run")])
    finally:
        dev.set_memory_limit(None)
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith("krnl train: error: out of memory in step 1: [alloc] cpu: a request of"), err
    assert "krnl's estimate for this run is" in err and "--grad-checkpoint" in err and "--max-memory" in err
    assert "no checkpoint was written yet" in err


def test_out_of_memory_keeps_the_last_checkpoint(tmp_path, cpu1):
    config = ModelConfig.from_dict(LLAMA)
    m = LlamaModel(cpu1, config, random_weights(config, seed=0), lora=replace(R8))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (8, 16)).astype(np.int32)
    tr = Trainer(m, TrainConfig(iters=4, batch_size=2, save_every=1, val_every=0, warmup=0), (ids, np.roll(ids, -1, 1)),
                 None, out_dir=tmp_path, progress=False)
    real = m.forward_backward_step

    def step(key, inputs):
        if tr.step == 3:
            raise RuntimeError("[alloc] cpu:1: a request of 1.0 GiB would take the pool past its limit")
        return real(key, inputs)

    m.forward_backward_step = step
    with pytest.raises(memory.OutOfMemory, match=r"^out of memory in step 3: \[alloc\] cpu:1: .*; the last "
                                                 r"checkpoint \(step 2\) is intact$"):
        tr.run()
    found = list_checkpoints(tmp_path / "checkpoints")
    assert [s for s, _ in found] == [1, 2]
    assert load_checkpoint(found[-1][1]).trainer_state["step"] == 2  # verifies every file's digest


def test_readme_has_the_table_dev_prints():
    spec = importlib.util.spec_from_file_location("memory_table", ROOT / "dev" / "memory_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.table() in (ROOT / "README.md").read_text(encoding="utf-8")
