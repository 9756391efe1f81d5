"""One row of fast_peers.py (Liger or Unsloth) in a process of its own, since both patch
transformers for the whole process:

    python -m krnl.bench.fast_worker SPEC.json

SPEC.json holds {peer: liger | unsloth, ckpt: false | true | "unsloth", workload: train | qlora,
shape, dtype, device, kind, folder, batches (.npz), scratch, out}. Writes to `out` the row's
figures (train_peers.figures for train, qlora.time_steps' for qlora) with a "note" on its
settings, or {"unavailable": why} where the library does not import."""

import json
import sys
from pathlib import Path

import numpy as np

from ..io.fileio import atomic_write_bytes
from .targets import Unavailable, torch_target
from .train_peers import ALPHA, LR, MODULES, RANK, one_line, peft_model, train_torch

LIGER = "apply_liger_kernel_to_llama() (RoPE, RMSNorm, SwiGLU, fused linear cross entropy)"


def load(peer):
    """The library's entry point, imported before transformers is: Unsloth patches it as it is
    imported and asks to come first."""
    try:
        if peer == "liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama
            return apply_liger_kernel_to_llama
        from unsloth import FastLanguageModel
        return FastLanguageModel
    except Exception as e:  # absent, or what it needs under it (triton, a GPU) missing
        raise Unavailable(f"cannot import {'liger_kernel.transformers' if peer == 'liger' else 'unsloth'}: "
                          f"{one_line(e)}") from None


def batches(spec):
    """The batches fast_peers.save_batches wrote: train.Batch rows, or id arrays (qlora)."""
    z = np.load(spec["batches"])
    if "lengths" not in z:
        return list(z["ids"])
    from .train import Batch
    return [Batch(ids, n) for ids, n in zip(z["ids"], z["lengths"])]


def write_tokenizer(folder, V):
    """A word-level tokenizer of the model's V ids in `folder` (pad 0, bos 1, eos 2 as the folder's
    config has them): FastLanguageModel.from_pretrained loads one with the model, and the rows
    train on ids, never text."""
    folder = Path(folder)
    if (folder / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {**{t: i for i, t in enumerate(specials)}, **{f"t{i}": i for i in range(len(specials), V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>",
           "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 1 << 20}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def unsloth_model(FastLanguageModel, spec, tdtype, quantized):
    """Unsloth's model of spec's folder with its LoRA: the recipe's rank, alpha and projections,
    gradient checkpointing spec["ckpt"] ("unsloth", its docs' choice; True; False); a 4-bit
    (bitsandbytes NF4) base where quantized, else 16-bit LoRA."""
    s, ckpt = spec["shape"], spec["ckpt"]
    write_tokenizer(spec["folder"], s["V"])
    model, _ = FastLanguageModel.from_pretrained(
        model_name=spec["folder"], max_seq_length=s["T"], dtype=tdtype, load_in_4bit=quantized,
        load_in_16bit=not quantized, full_finetuning=False, use_gradient_checkpointing=ckpt)
    model = FastLanguageModel.get_peft_model(
        model, r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(MODULES), bias="none",
        use_gradient_checkpointing=ckpt, random_state=3407, max_seq_length=s["T"])
    FastLanguageModel.for_training(model)
    return model


def attention():
    """What Unsloth's attention had to choose from: flash-attn and xformers where they imported
    (neither is carried to the H200), else PyTorch's SDPA."""
    have = [m for m in ("flash_attn", "xformers") if m in sys.modules]
    return f"; {' and '.join(have)} imported" if have else "; no flash-attn or xformers: PyTorch SDPA attention"


def run_train(spec, lib, bs):
    """The train (and long) row: the recipe's steps on the batches, the loss the library's own."""
    s = spec["shape"]
    torch, dev, tdtype, sync = torch_target(spec["device"], spec["dtype"], device_kind=spec["kind"])
    if spec["peer"] == "liger":
        lib()  # into modeling_llama's classes, before the model is made of them
        model, params, opt = peft_model(torch, spec["folder"], tdtype, dev, ckpt=spec["ckpt"])
        note = LIGER + (", checkpointed" if spec["ckpt"] else "")
    else:
        model = unsloth_model(lib, spec, tdtype, quantized=False)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        note = f"use_gradient_checkpointing={spec['ckpt']!r}" + attention()
    res = train_torch(torch, model, params, opt, dev, sync, s, bs, labels=True)
    res["note"] = "; ".join(x for x in (note, res.get("note")) if x)
    return res


def run_qlora(spec, lib, bs):
    """The qlora row: qlora.time_torch's steps (the model's own loss on labels) on a 4-bit base."""
    import torch
    from . import qlora
    s, on_gpu = spec["shape"], spec["kind"] == "cuda"
    if spec["peer"] == "liger":
        lib()
        model, label = qlora.peft_model(s, torch, on_gpu)  # PEFT's base, bitsandbytes NF4 where it runs
        note = f"{LIGER} on {label}"
    else:
        if not (Path(spec["folder"]) / "config.json").exists():  # written once for both Unsloth rows
            from .train import write_folder
            write_folder(dict(s, D=s["C"] // s["H"]), spec["folder"])
        model = unsloth_model(lib, spec, torch.bfloat16, quantized=on_gpu)  # bitsandbytes NF4 needs CUDA
        note = (f"use_gradient_checkpointing={spec['ckpt']!r} on "
                + ("its bnb-nf4 base" if on_gpu else "a bf16 base (its 4-bit load here on CUDA only)") + attention())
    res = qlora.time_torch(model, s, bs, on_gpu, print, f"qlora {spec['peer']}")
    res["note"] = note
    return res


def run(spec):
    lib = load(spec["peer"])
    bs = batches(spec)
    return run_qlora(spec, lib, bs) if spec["workload"] == "qlora" else run_train(spec, lib, bs)


def main(argv):
    if len(argv) != 1:
        print("usage: python -m krnl.bench.fast_worker SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        res = run(spec)
    except Unavailable as e:
        res = {"unavailable": str(e)}
    atomic_write_bytes(spec["out"], (json.dumps(res) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
