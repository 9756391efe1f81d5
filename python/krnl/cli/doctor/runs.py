"""`krnl doctor`'s whole-model runs: the embedded default (`krnl train`'s task) trained on a device
and on the CPU with losses compared step by step, and the timed work: W1 (`krnl w1`'s block) and a
QLoRA step, next to MLX / mlx-lm on the same work where mlx-lm is installed."""

import importlib.util
import tempfile
import time

import numpy as np

import krnl

# Per-step loss agreement with the CPU, relative. f32 differs only by summation order, which 20
# AdamW steps amplify little on this model (seen: < 1e-5); 16-bit compute rounds every activation
# (bf16 keeps 8 bits: a step's loss moves by about 1%, and the trajectories drift apart slowly).
LOSS_RTOL = {"f32": 1e-3, "f16": 3e-2, "bf16": 6e-2}

# Sizes: "full" for a Mac (seconds), "quick" for the CPU and metal-sim in CI time.
TRAIN = {"full": dict(steps=20, batch_size=16), "quick": dict(steps=5, batch_size=4)}
W1 = {"full": dict(T=512, C=2048, F=5632, R=32, steps=6), "quick": dict(T=33, C=64, F=176, R=8, steps=2)}
QLORA = {"full": dict(layers=4, C=1024, F=2816, H=16, KV=4, V=8192, T=256, B=2, steps=5, warmup=2),
         "quick": dict(layers=1, C=64, F=128, H=2, KV=1, V=128, T=16, B=1, steps=2, warmup=1)}


def _train_losses(dev, dtype, steps, batch_size):
    """Per-step training losses of the embedded default with `krnl train`'s defaults (LoRA r=16,
    alpha 32 on every projection, AdamW, warmup and cosine schedule), a fixed seed."""
    from ...models.config import LoraConfig
    from ...train.default_task import CharTokenizer, base_weights, make_split, tiny_config
    from ...models.model import LlamaModel
    from ...models.config import ModelConfig
    from ...train.trainer import TrainConfig, Trainer

    tok = CharTokenizer()
    config = ModelConfig.from_dict(tiny_config(tok.vocab_size), source="<embedded default>")
    model = LlamaModel(dev, config, base_weights(config, seed=1234), lora=LoraConfig(r=16, alpha=32.0),
                       dtype=dtype, seed=0)
    train = make_split(tok, steps * batch_size, seed=100)
    cfg = TrainConfig(iters=steps, batch_size=batch_size, warmup=min(30, steps // 4), val_every=0, save_every=0)
    with tempfile.TemporaryDirectory(prefix="krnl-doctor-") as out:
        trainer = Trainer(model, cfg, train, None, out_dir=out, progress=False)
        trainer.run()
    return [float(loss) for _, loss in trainer.history]


def train_compare(dev, quick, log=print):
    """The embedded default trained on `dev` and on the CPU in f32, and in the device's compute
    dtype where that is another; {"runs": [...], "failures": [...]} with every step's losses."""
    size = TRAIN["quick" if quick else "full"]
    cpu = krnl.device("cpu")
    dtypes = ["f32"] + [d for d in (dev.capabilities()["compute_dtype"],) if d != "f32"]
    runs, failures = [], []
    for dt in dtypes:
        t0 = time.perf_counter()
        got = _train_losses(dev, dt, **size)
        t1 = time.perf_counter()
        ref = _train_losses(cpu, dt, **size)
        rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref)]
        bad = [i + 1 for i, r in enumerate(rel) if not r <= LOSS_RTOL[dt]]  # NaN fails too
        runs.append({"dtype": dt, **size, "device_losses": got, "cpu_losses": ref, "max_rel_diff": max(rel),
                     "tolerance": LOSS_RTOL[dt], "device_s": t1 - t0, "status": "mismatch" if bad else "ok"})
        log(f"  {dt}: loss {got[0]:.4f} -> {got[-1]:.4f} on {dev.name}, {ref[0]:.4f} -> {ref[-1]:.4f} on the CPU; "
            f"largest step difference {max(rel):.1e} (tolerance {LOSS_RTOL[dt]:.0e})")
        if bad:
            failures.append(f"training {dt}: the loss differs from the CPU's by more than {LOSS_RTOL[dt]:.0e} at "
                            f"step{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:5]))} (step {bad[0]}: "
                            f"{got[bad[0] - 1]:.6g} vs {ref[bad[0] - 1]:.6g})")
    return {"runs": runs, "failures": failures}


def _median_ms(step, n):
    step()  # warm-up: pipelines, buffers
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def time_w1(dev, dtype, quick):
    """krnl's W1 step (forward, dX and the LoRA gradients of the MLP block) and MLX's on the same
    problem where mlx-lm (and so MLX) is installed."""
    from ...bench import w1

    s = dict(W1["quick" if quick else "full"])
    n = s.pop("steps")
    P = w1.Problem(s, dev.name, dtype)
    gflop = w1.flops(P) / 1e9
    step, _ = w1.build_krnl(P)
    ms = _median_ms(step, n)
    rows = [{"impl": "krnl", "ms": ms, "gflops": gflop / ms * 1e3}]
    rows.append(_peer(lambda: _median_ms(w1.PEERS["mlx"](P)[0], n), "MLX (mlx-lm's framework)", gflop))
    return {"size": s, "dtype": dtype, "gflop_per_step": gflop, "steps": n, "rows": rows}


def time_qlora(dev, dtype, quick):
    """A QLoRA step (4-bit base, LoRA r=16 on the seven projections) in krnl, and in mlx-lm on a
    model of the same shape where mlx-lm is installed."""
    from ...bench import qlora

    s = QLORA["quick" if quick else "full"]
    batches = qlora.tokens(s)
    r = qlora.run_krnl(dev, s, batches, dtype, log=lambda *_: None)
    rows = [{"impl": "krnl", "ms": r["ms"], "tokens_per_s": r["tokens_per_s"], "loss": r["loss"],
             "peak_bytes": r["peak_bytes"]}]
    rows.append(_peer(lambda: _mlx_lm_qlora(s, batches, dtype), "mlx-lm"))
    return {"size": s, "dtype": dtype, "bits": qlora.BITS, "group_size": qlora.GROUP, "rows": rows}


def _peer(run, impl, gflop=None):
    """A peer's row: timed where mlx-lm is installed, else skipped saying so; a peer that fails is
    a note in the report, not a failure of krnl."""
    if importlib.util.find_spec("mlx_lm") is None:
        return {"impl": impl, "status": "skipped", "note": "mlx-lm is not installed (pip install mlx-lm to compare)"}
    try:
        out = run()
    except Exception as e:  # noqa: BLE001 (the peer's own failure, reported as such)
        return {"impl": impl, "status": "error", "note": f"{type(e).__name__}: {str(e)[:200]}"}
    if isinstance(out, dict):
        return {"impl": impl, **out}
    return {"impl": impl, "ms": out, **({"gflops": gflop / out * 1e3} if gflop else {})}


def _mlx_lm_qlora(s, batches, dtype):
    """mlx-lm's Llama of the same shape in `dtype`, its projections quantized as the QLoRA rows'
    (4 bits, groups of 64), LoRA r=16 on them (mlx-lm's linear_to_lora_layers), AdamW steps timed
    as krnl's (warm-up steps first), on MLX's default device: {"ms", "tokens_per_s", "loss", "note"}."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.models import llama
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from ...bench import qlora

    args = llama.ModelArgs(model_type="llama", hidden_size=s["C"], num_hidden_layers=s["layers"],
                           intermediate_size=s["F"], num_attention_heads=s["H"], num_key_value_heads=s["KV"],
                           rms_norm_eps=1e-5, vocab_size=s["V"], rope_theta=500000.0, tie_word_embeddings=False)
    model = llama.Model(args)
    model.set_dtype({"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}[dtype])
    nn.quantize(model, group_size=qlora.GROUP, bits=qlora.BITS,
                class_predicate=lambda path, m: isinstance(m, nn.Linear) and path.split(".")[-1] in qlora.MODULES)
    model.freeze()
    keys = [f"{'mlp' if m in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{m}" for m in qlora.MODULES]
    linear_to_lora_layers(model, s["layers"], {"rank": 16, "scale": 2.0, "dropout": 0.0, "keys": keys})
    opt = optim.AdamW(learning_rate=1e-4)

    def loss_fn(m, ids):
        return nn.losses.cross_entropy(m(ids[:, :-1]), ids[:, 1:]).mean()

    value_and_grad = nn.value_and_grad(model, loss_fn)

    def step(ids):
        loss, grads = value_and_grad(model, mx.array(ids))
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        return loss.item()

    for ids in batches[:s["warmup"]]:
        step(ids)
    t0 = time.perf_counter()
    for ids in batches[s["warmup"]:]:
        loss = step(ids)
    dt = time.perf_counter() - t0
    return {"ms": 1e3 * dt / s["steps"], "tokens_per_s": s["steps"] * s["B"] * s["T"] / dt, "loss": float(loss),
            "note": f"on {mx.default_device()}; random weights of its own (losses not comparable)"}
