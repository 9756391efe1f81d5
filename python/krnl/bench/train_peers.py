"""The peers of the end-to-end training workload (train.py), each training the same HF folder on
the same batches with the same recipe (LoRA r=16, alpha 32 on the seven projections, AdamW lr 1e-4
without weight decay, clipping at 1.0): transformers + PEFT eager (SDPA attention) and with the
model under torch.compile, and mlx-lm's LoRA trainer (linear_to_lora_layers, its default_loss,
its compiled step). Each is optional: one that cannot run is a row with the reason."""

import gc
import time

import numpy as np

from .hostmem import HostGrowth
from .targets import Unavailable, mlx_target, torch_target

# The recipe every implementation trains with.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA, LR, CLIP = 16, 32.0, 1e-4, 1.0

# peer row -> the --peers name that selects it, and what to install
PEERS = {"PEFT eager": "torch", "PEFT torch.compile": "torch.compile", "mlx-lm": "mlx"}
HINT = {"torch": "pip install torch transformers peft", "mlx": "pip install mlx-lm (and mlx for the device)"}


def one_line(e):
    """An exception as one short line for a table cell."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


def figures(stamps, losses, bs, warmup):
    """A row's figures from the times at which each step ended (stamps[0]: before the first) and
    the losses of the steps; bs: the batches (their tokens), the first `warmup` not timed."""
    dts = np.diff(np.asarray(stamps, np.float64))
    timed, toks = dts[warmup:], sum(b.tokens for b in bs[warmup:])
    return {"tokens_per_s": toks / float(timed.sum()), "ms": 1e3 * float(timed.mean()), "tokens": toks,
            "warmup_s": float(dts[:warmup].sum()), "samples": len(timed),
            "spread": float(timed.max() / timed.min()), "loss": float(losses[-1]), "first_loss": float(losses[0]),
            "losses": [float(x) for x in losses], "timed_window": (stamps[warmup], stamps[-1])}


def timed_steps(step, bs, sync):
    """(stamps, losses): each batch's step run and synchronized; stamps[0] before the first."""
    sync()
    stamps, losses = [time.perf_counter()], []
    for b in bs:
        losses.append(step(b))
        sync()
        stamps.append(time.perf_counter())
    return stamps, losses


def peft_model(torch, folder, tdtype, dev, ckpt=False):
    """transformers' Llama from `folder` in tdtype on dev, frozen, with PEFT's LoRA of the recipe:
    (model, its trainable parameters, torch.optim.AdamW over them). ckpt: transformers' gradient
    checkpointing of every layer (non-reentrant: the frozen inputs need no grad)."""
    import transformers
    from peft import LoraConfig, get_peft_model
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=tdtype, attn_implementation="sdpa")
    model.config.use_cache = False
    model.to(dev)
    for p in model.parameters():
        p.requires_grad_(False)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(MODULES)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, params, torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def lm_labels(b):
    """transformers' causal-LM labels for batch b: the loss shifts them left by one, so each of
    b.targets stands one position right of where it is predicted (-100 in front)."""
    return np.concatenate([np.full((len(b.ids), 1), -100, np.int32), b.targets[:, :-1]], axis=1)


def release(torch, on_cuda):
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()


def train_torch(torch, fwd, params, opt, dev, sync, s, bs, labels=False):
    """figures() of the recipe's steps of a torch model `fwd` on batches bs, with the peak on CUDA.
    labels: the model takes the loss itself from lm_labels (Liger's and Unsloth's fused losses
    take labels and never form the logits); else the mean cross entropy over b.targets in f32,
    as transformers' own causal-LM loss takes it."""
    on_cuda = dev == "cuda"
    release(torch, on_cuda)
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def step(b):
        ids = torch.as_tensor(b.ids, dtype=torch.long, device=dev)
        if labels:
            loss = fwd(input_ids=ids, labels=torch.as_tensor(lm_labels(b), dtype=torch.long, device=dev)).loss
        else:
            tg = torch.as_tensor(b.targets, dtype=torch.long, device=dev)
            logits = fwd(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tg.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    with HostGrowth() as host:
        res = figures(*timed_steps(step, bs, sync), bs, s["warmup"])
    res["host_bytes"] = host.bytes
    if on_cuda:
        res.update(peak_bytes=int(torch.cuda.max_memory_reserved()), peak_kind="reserved (torch.cuda)",
                   note=f"allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB at most")
    else:
        res.update(peak_bytes=None, peak_kind=None)
    return res


def run_peft(device_name, dtype, folder, s, bs, compiled=False):
    """transformers' Llama from `folder` in `dtype`, LoRA through PEFT, torch.optim.AdamW;
    checkpointed where the shape says (s["ckpt"])."""
    torch, dev, tdtype, sync = torch_target(device_name, dtype)
    model, params, opt = peft_model(torch, folder, tdtype, dev, ckpt=s.get("ckpt", False))
    fwd = torch.compile(model) if compiled else model
    res = train_torch(torch, fwd, params, opt, dev, sync, s, bs)
    del model, fwd, opt, params
    release(torch, dev == "cuda")
    return res


def mlx_lengths(b):
    """default_loss's (offset, length) rows: it scores targets j with 0 <= j < length, the
    predicted positions of right-padded rows."""
    n = np.count_nonzero(b.targets != -100, axis=1)
    T = b.ids.shape[1]
    if not (b.targets[np.arange(T)[None, :] < n[:, None]] == np.concatenate(
            [b.ids[:, 1:], b.ids[:, :1]], axis=1)[np.arange(T)[None, :] < n[:, None]]).all():
        raise Unavailable("mlx-lm's loss scores a prefix of each row: the targets are not the ids shifted")
    return np.stack([np.zeros_like(n), n], axis=1)


def run_mlx(device_name, dtype, folder, s, bs):
    """mlx-lm: the folder loaded by mlx_lm.utils.load_model, LoRA by linear_to_lora_layers, the
    step as mlx_lm.tuner.trainer.train compiles it (clipping added: mlx-lm's loop has none);
    checkpointed where the shape says, by mlx-lm's grad_checkpoint."""
    from pathlib import Path
    mx, mdev, mdtype = mlx_target(device_name, dtype)
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.trainer import grad_checkpoint
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model
    mx.set_default_device(mdev)
    model, _ = load_model(Path(folder))
    model.set_dtype(mdtype)
    model.freeze()
    keys = [f"self_attn.{m}" for m in MODULES[:4]] + [f"mlp.{m}" for m in MODULES[4:]]
    linear_to_lora_layers(model, s["layers"], {"rank": RANK, "scale": ALPHA / RANK, "dropout": 0.0, "keys": keys})
    if len(tree_flatten(model.trainable_parameters())) != 2 * len(MODULES) * s["layers"]:
        raise RuntimeError("linear_to_lora_layers did not adapt the seven projections of every layer")
    model.train()
    layer_cls = type(model.layers[0])
    plain = layer_cls.__call__
    if s.get("ckpt"):
        grad_checkpoint(model.layers[0])  # patches the layer class: undone below, for the rows after
    try:
        return _mlx_steps(mx, nn, optim, model, mdev, s, bs)
    finally:
        layer_cls.__call__ = plain


def _mlx_steps(mx, nn, optim, model, mdev, s, bs):
    """run_mlx's figures: the adapted `model` trained on bs by the compiled update."""
    from functools import partial
    from mlx_lm.tuner.trainer import default_loss
    opt = optim.AdamW(learning_rate=LR, weight_decay=0.0)
    value_and_grad = nn.value_and_grad(model, default_loss)
    state = [model.state, opt.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def update(batch, lengths):
        (loss, _), grad = value_and_grad(model, batch, lengths)
        grad, _ = optim.clip_grad_norm(grad, CLIP)
        opt.update(model, grad)
        return loss

    prepared = [(mx.array(np.concatenate([b.ids, np.zeros((len(b.ids), 1), np.int32)], axis=1)),
                 mx.array(mlx_lengths(b))) for b in bs]
    on_gpu = mdev == mx.gpu
    if on_gpu:
        mx.reset_peak_memory()
    i = iter(prepared)

    def step(b):
        loss = update(*next(i))
        mx.eval(state, loss)
        return float(loss)

    res = figures(*timed_steps(step, bs, lambda: None), bs, s["warmup"])
    res.update(peak_bytes=int(mx.get_peak_memory()) if on_gpu else None,
               peak_kind="mx.get_peak_memory" if on_gpu else None, note="mlx-lm's compiled step")
    return res


def run_all(device_name, dtype, folder, s, bs, peers, log=print):
    """A row per peer: figures, or status absent with the reason (not selected, not installed,
    failed)."""
    rows = []
    for impl, sel in PEERS.items():
        if sel not in peers:
            rows.append(dict(impl=impl, status="absent", reason="not selected (--peers)"))
            continue
        mods = ("torch", "transformers", "peft") if sel.startswith("torch") else ("mlx.core", "mlx_lm")
        try:
            for m in mods:
                __import__(m)
        except ImportError as e:
            rows.append(dict(impl=impl, status="absent", reason=f"not installed ({e}); {HINT[sel.split('.')[0]]}"))
            continue
        except Exception as e:  # installed but broken (a missing shared library, say)
            rows.append(dict(impl=impl, status="absent", reason=f"cannot import: {one_line(e)}"))
            continue
        try:
            if sel == "mlx":
                r = run_mlx(device_name, dtype, folder, s, bs)
            else:
                r = run_peft(device_name, dtype, folder, s, bs, compiled=sel == "torch.compile")
        except Unavailable as e:
            rows.append(dict(impl=impl, status="absent", reason=str(e)))
            continue
        except Exception as e:  # a peer that breaks (torch.compile included) is listed with what broke
            rows.append(dict(impl=impl, status="absent", reason=f"failed: {one_line(e)}"))
            continue
        finally:
            gc.collect()
        log(f"krnl bench: train {impl}: {r['tokens_per_s']:,.0f} tokens/s, loss {r['loss']:.4f}")
        rows.append(dict(impl=impl, **r))
    return rows
