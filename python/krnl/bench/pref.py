"""What the preference workloads (dpo.py, grpo.py) share: the model, train.py's "1b" shape
(Llama-3.2-1B's layer x16; "quick" for tests and the CPU) with random weights made in memory and
LoRA r=16, alpha 32 on the seven projections, on krnl's side and on transformers + PEFT's (bf16,
SDPA attention), and how TRL's trainers are set up around the PEFT model without a dataset on
disk: an in-memory word-level tokenizer, a one-line dataset for the constructor (its map is no
part of any timing), batches collated or built by hand from the same token ids krnl trains on.
The two sides draw their own weights, so losses are reported side by side, not compared."""

import gc
import sys
import tempfile
import warnings

from . import qlora, train

SPECIAL = 3  # ids 0..2 (pad, bos, eos in train.hf_config) are never drawn as tokens


def hf_config(s):
    """train.py's HF config of shape s["shape"], without an EOS: no sampler on either side can stop
    early, every completion is exactly as long as asked."""
    return {**train.hf_config(train.shape(s["shape"])), "eos_token_id": None}


def describe(s):
    sh = train.shape(s["shape"])
    return (f"{s['shape']} shape: Llama {sh['layers']} layers C={sh['C']} F={sh['F']} {sh['H']}/{sh['KV']} heads "
            f"of {sh['D']} V={sh['V']}, LoRA r={train.RANK} x7")


def tokens(rng, s, *shape):
    """Random token ids of the given shape, none of them a special one."""
    return rng.integers(SPECIAL, train.shape(s["shape"])["V"], shape)


def krnl_model(dev, s, dtype):
    from ..models.config import LoraConfig, ModelConfig, random_weights
    from ..models.model import LlamaModel
    cfg = ModelConfig.from_dict(hf_config(s))
    weights = random_weights(cfg, seed=0, std=0.02)
    model = LlamaModel(dev, cfg, weights, LoraConfig(r=train.RANK, alpha=train.ALPHA), dtype=dtype)
    del weights
    return model


def peft_model(s, on_gpu):
    """transformers' Llama of the shape in bf16 with PEFT's LoRA (qlora.peft_model without NF4)."""
    import torch
    return qlora.peft_model(None, torch, on_gpu, config=hf_config(s), nf4=False)[0]


def trl_missing():
    """None where TRL and datasets import, else the reason a TRL row is skipped."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed (pip install trl datasets)"
    return None


def tokenizer(s):
    """A word-level tokenizer of the shape's vocabulary ("t0" .. "t{V-1}", t0 the padding), made in
    memory: TRL's trainers take a processing class, though every batch here is token ids already."""
    import tokenizers
    import transformers
    V = train.shape(s["shape"])["V"]
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0", eos_token="t2")


def trl_trainer(kind, s, pm, on_gpu, rows, **kw):
    """TRL's DPOTrainer or GRPOTrainer (kind "dpo", "grpo") on the PEFT model, set up like for like
    with krnl: bf16, no gradient checkpointing, `rows` a device batch, no logging or saving; kw go
    to its config. The trainer's output folder is a temporary one, removed when it is collected."""
    import datasets
    import trl
    datasets.disable_progress_bars()  # the constructor's map of one line: noise in the bench's log
    out = tempfile.TemporaryDirectory(prefix="krnl-bench-trl-")
    common = dict(output_dir=out.name, per_device_train_batch_size=rows, bf16=True, gradient_checkpointing=False,
                  report_to=[], use_cpu=not on_gpu, save_strategy="no", logging_steps=10**6, disable_tqdm=True)
    tok = tokenizer(s)
    if kind == "dpo":
        data = {"prompt": ["t3 t4"], "chosen": [" t5"], "rejected": [" t6"]}
        tr = trl.DPOTrainer(model=pm, args=trl.DPOConfig(**common, **kw), processing_class=tok,
                            train_dataset=datasets.Dataset.from_dict(data))
    else:
        tr = trl.GRPOTrainer(model=pm, args=trl.GRPOConfig(**common, **kw), processing_class=tok,
                             reward_funcs=lambda completions, **_: [0.0] * len(completions),
                             train_dataset=datasets.Dataset.from_dict({"prompt": ["t3 t4"] * rows}))
    tr.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before a step's loss
    tr._krnl_bench_out = out  # the folder lives as long as the trainer
    pm.train()
    return tr


def versions():
    """The peer's library versions, for its label."""
    import peft
    import transformers
    try:
        import trl
        t = f"trl {trl.__version__}, "
    except ImportError:
        t = ""
    return f"{t}transformers {transformers.__version__}, PEFT {peft.__version__}"


def peer_rows(label, body, trl=True):
    """body()'s rows, or one row saying why the peer cannot run: TRL missing (trl) or the peer's
    failure (a library version that breaks is listed, not fatal to the session)."""
    why = trl and trl_missing()
    if why:
        return dict(impl=label, status="skipped", reason=why)
    try:
        with warnings.catch_warnings():  # transformers 5's deprecation notes on every step
            warnings.simplefilter("ignore", FutureWarning)
            return body()
    except Exception as e:  # noqa: BLE001
        return dict(impl=label, status="absent", reason=f"failed: {type(e).__name__}: {str(e)[:160]}")
    finally:  # the peer's model and trainer are gone: their cached blocks go back before the next workload
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()
