"""The end-to-end training workload (`krnl bench --workloads train`): what `krnl train --model
FOLDER` does, timed. A Llama-shaped model with random bf16 weights is written as an HF folder
(config.json + model.safetensors), loaded as `krnl train` loads it (hf.load_model) and trained by
krnl's own Trainer: LoRA r=16, alpha 32 on all seven projections, AdamW lr 1e-4 constant, gradient
clipping at 1.0, no validation, no checkpoint inside the timed steps. The peers train the same
folder on the same batches (train_peers.py): transformers + PEFT eager and with torch.compile,
mlx-lm's LoRA trainer, and PEFT with Liger's kernels and Unsloth (fast_peers.py). A shape with
"ckpt" (the long rows, train_long.py) has every implementation checkpoint its layers.

One definition of tokens for every implementation: the input tokens that are not padding. Per
implementation: steady tokens/s over the timed steps (each step ends with its loss read on the
host, a device synchronize), the warm-up steps' seconds apart, the peak device memory of the
steps (on a GPU only: on the CPU the pools hold only part of what a run uses), the loss after
the last step and the first step's loss (B = 0 at the start: the base model's loss, equal across
implementations); on an NVIDIA GPU also the SM clock, the power and the joules a step over the
timed steps (gpu_power.py), since under a power cap the time follows the energy."""

import gc
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from . import fast_peers, gpu_power
from .hostmem import HostGrowth
from .train_peers import ALPHA, CLIP, LR, RANK, figures, run_all

PAD_ID = 0  # ids of real tokens are drawn from 1 .. V-1

# "1b": Llama-3.2-1B's layer x16; "8b": Llama-3-8B's layer x8; "quick": seconds on the CPU, awkward sizes.
SHAPES = {
    "1b": dict(layers=16, C=2048, F=8192, H=32, KV=8, D=64, V=32000, T=2048, B=4, steps=10, warmup=3),
    "8b": dict(layers=8, C=4096, F=14336, H=32, KV=8, D=128, V=32000, T=4096, B=2, steps=10, warmup=3),
    "quick": dict(layers=2, C=64, F=160, H=4, KV=2, D=16, V=257, T=33, B=2, steps=3, warmup=1),
}
# --train-* options: the shape's keys they override
OPTIONS = {"layers": "layers", "seq": "T", "batch": "B", "steps": "steps", "warmup": "warmup"}


def shape(name="1b", **over):
    """The sizes of shape `name` with the given OPTIONS overridden (None: the shape's own)."""
    if name not in SHAPES:
        raise ValueError(f"[krnl bench] --train-shape: unknown {name!r}; choose from {', '.join(SHAPES)}")
    s = dict(SHAPES[name], name=name)
    for opt, v in over.items():
        if v is None:
            continue
        least = 0 if opt == "warmup" else 1
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
            raise ValueError(f"[krnl bench] --train-{opt} must be an integer >= {least}, got {v!r}")
        s[OPTIONS[opt]] = int(v)
    if s["T"] < 2:
        raise ValueError(f"[krnl bench] --train-seq must be >= 2 (a token and the one it predicts), got {s['T']}")
    return s


def describe(s):
    return (f"Llama {s['layers']} layers C={s['C']} F={s['F']} {s['H']}/{s['KV']} heads of {s['D']} V={s['V']}, "
            f"LoRA r={RANK} x7, B={s['B']} T={s['T']}, {s['steps']} steps after {s['warmup']}"
            + (", gradient checkpointing" if s.get("ckpt") else ""))


def hf_config(s):
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": s["C"],
            "intermediate_size": s["F"], "num_hidden_layers": s["layers"], "num_attention_heads": s["H"],
            "num_key_value_heads": s["KV"], "head_dim": s["D"], "vocab_size": s["V"],
            "max_position_embeddings": max(8192, s["T"]), "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def write_folder(s, folder, seed=0):
    """An HF Llama folder with random weights stored in bf16: norms 1, every matrix N(0, 0.02^2)
    (a first loss near ln V). Returns the folder."""
    from safetensors import TensorSpec, serialize_file
    from ..models.config import ModelConfig
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(s)
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shp in ModelConfig.from_dict(cfg).weight_shapes().items():
        if name.endswith("norm.weight"):
            arrays[name] = np.full(shp, 0x3F80, np.uint16)  # 1.0 in bf16
        else:
            # bf16 is the top half of an f32: truncating is a valid bf16 and skips a rounding pass
            # over a billion values
            w = rng.standard_normal(shp, dtype=np.float32)
            w *= 0.02
            arrays[name] = (w.view(np.uint32) >> 16).astype(np.uint16)
            del w
    specs = {k: TensorSpec(dtype="bfloat16", shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
             for k, a in arrays.items()}
    serialize_file(specs, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


class Batch:
    """One step's rows: ids (B, T), targets (B, T) = ids shifted left, -100 where nothing is
    predicted (padding and each row's last real token), lengths (B,) = real tokens per row (the
    padding, PAD_ID, is on the right)."""

    def __init__(self, ids, lengths):
        self.ids = np.asarray(ids, np.int32)               # (B, T)
        self.lengths = np.asarray(lengths, np.int64)       # (B,)
        T = self.ids.shape[1]
        pos = np.arange(T)[None, :]
        tg = np.concatenate([self.ids[:, 1:], np.full((len(self.ids), 1), -100, np.int32)], axis=1)
        self.targets = np.where(pos + 1 < self.lengths[:, None], tg, -100).astype(np.int32)  # (B, T)

    @property
    def tokens(self):
        """Input tokens that are not padding: the one count every implementation is measured by."""
        return int(self.lengths.sum())


def batches(s, seed=0, pad=False):
    """warmup + steps batches of random tokens; pad: rows of random lengths (at least 2) padded."""
    rng = np.random.default_rng([seed, 7])
    out = []
    for _ in range(s["warmup"] + s["steps"]):
        ids = rng.integers(1, s["V"], (s["B"], s["T"]), dtype=np.int32)
        lengths = rng.integers(2, s["T"] + 1, s["B"]) if pad else np.full(s["B"], s["T"])
        ids[np.arange(s["T"])[None, :] >= lengths[:, None]] = PAD_ID
        out.append(Batch(ids, lengths))
    return out


class _Source:
    """The prepared batches in order, as a Trainer batch source (next, state, load_state)."""

    def __init__(self, bs):
        self.bs, self.i = bs, 0

    def next(self):
        b = self.bs[self.i % len(self.bs)]
        self.i += 1
        return b.ids, b.targets

    def state(self):
        return {"index": self.i}

    def load_state(self, st):
        self.i = int(st["index"])


class _Done(Exception):
    """Raised by on_step after the last timed step: the run ends before Trainer.run's end-of-run
    checkpoint and adapter files, which are no part of a training step's time."""


def run_krnl(dev, dtype, folder, s, bs, seed=0, graphs=True, profile=False, world=None):
    """krnl: the folder loaded as `krnl train --model` loads it, trained by Trainer on `bs`
    (graphs False: every step eager, `krnl train --no-graphs`). profile: one more step after the
    timed ones runs under krnl.profile (its per-op table in the result's "profile"). world: a
    krnl.train.dist.world.World whose ranks each train on their slice of `bs` (train_dist.py).
    s["ckpt"]: the model's gradient checkpointing (`krnl train --grad-checkpoint`)."""
    from .. import profile as op_profile
    from ..models.config import LoraConfig
    from ..formats.hf import load_model
    from ..train.trainer import TrainConfig, Trainer
    model = load_model(str(folder), dev, lora=LoraConfig(r=RANK, alpha=ALPHA), dtype=dtype, seed=seed,
                       grad_checkpoint=s.get("ckpt", False))
    gc.collect()
    dev.synchronize()
    dev.reset_peak()
    n = len(bs)
    # iters past the last step: that step is not the run's last, so no checkpoint is written in it
    cfg = TrainConfig(iters=n + 2, batch_size=s["B"], learning_rate=LR, warmup=0, schedule="constant",
                      max_grad_norm=CLIP, val_every=0, save_every=10**9, seed=seed, graphs=graphs)
    stamps, losses, prof = [], [], {}

    def on_step(step, rec):
        dev.synchronize()  # the step is done when it is stamped, whether or not the Trainer read its loss
        if step <= n:
            stamps.append(time.perf_counter())
            losses.append(rec["loss"])
        if step == n and profile:
            prof["p"] = op_profile(dev).__enter__()  # the next step, profiled, is not timed
        elif step == n + 1 and profile:
            p = prof["p"]
            p.__exit__(None, None, None)
            prof["table"] = {"workload": "train", "wall_ms": p.wall_ms, "op_ms": p.op_ms, "step_gflops": None,
                             "rows": sorted(({k: g[k] for k in ("op", "shape", "dtype", "calls", "ms", "share", "gflops")}
                                             for g in p.rows()), key=lambda g: -g["ms"])}
        if step >= n + (1 if profile else 0):
            raise _Done

    with tempfile.TemporaryDirectory(prefix="krnl-bench-train-") as out:
        trainer = Trainer(model, cfg, _Source(bs), out_dir=out, progress=False, on_step=on_step, world=world)
        stamps.append(time.perf_counter())
        with HostGrowth() as host:
            try:
                trainer.run()
            except _Done:
                pass
    res = figures(stamps, losses, bs, s["warmup"])
    res["host_bytes"] = host.bytes
    res["peak_bytes"], res["peak_kind"] = int(dev.pool_stats()["peak_reserved"]), "reserved (krnl pool)"
    if "table" in prof:
        res["profile"] = prof["table"]
    del trainer, model
    gc.collect()
    dev.trim()
    return res


def run(dev, dtype, s, peers=(), log=print, on_gpu=False, folder=None, bs=None, profile=False):
    """Rows (dicts for Session._row) of krnl and its peers on shape `s`; `folder`: an existing one
    to train (else a temporary folder, removed at the end); `bs`: the batches (else batches(s))."""
    with tempfile.TemporaryDirectory(prefix="krnl-bench-model-") as tmp:
        if folder is None:
            t0 = time.perf_counter()
            folder = write_folder(s, Path(tmp) / "model")
            log(f"krnl bench: train: wrote {folder} in {time.perf_counter() - t0:.1f} s")
        bs = batches(s) if bs is None else bs
        title = f"Training end to end ({describe(s)}; {dtype})"
        rows = []
        # where the device has graphs, krnl replays its step; "krnl eager" is the same run with none
        impls = (("krnl", True), ("krnl eager", False))[:1 + bool(dev.capabilities()["graphs"])]
        with gpu_power.metered(dev, on=on_gpu) as (meter, no_meter):
            for impl, graphs in impls:
                try:  # the profile (of an eager step: per op) where asked, from the last krnl row
                    rows.append(dict(impl=impl, **run_krnl(dev, dtype, folder, s, bs, graphs=graphs,
                                                           profile=profile and impl == impls[-1][0])))
                    log(f"krnl bench: train {impl}: {rows[-1]['tokens_per_s']:,.0f} tokens/s, "
                        f"loss {rows[-1]['loss']:.4f}")
                except Exception as e:  # listed with what broke; the other rows still run
                    rows.append(dict(impl=impl, status="absent", reason=f"failed: {type(e).__name__}: {e}"[:200]))
                    gc.collect()
                    dev.trim()
            rows += run_all(dev.name, dtype, folder, s, bs, peers, log)
            rows += fast_peers.run_all(dev.name, dtype, folder, s, bs, peers, log)  # each in its own process
    for r in rows:
        a_b = r.pop("timed_window", None)
        if a_b is not None and meter is not None:
            r["gpu"] = power_figures(meter.window([a_b]), r)
        elif a_b is not None and no_meter:
            r["gpu"] = {"why_not": no_meter}
    base = [r for r in rows if r.get("status", "ok") == "ok" and r["impl"].startswith("krnl")]
    if not base:
        raise RuntimeError(f"[krnl bench] train: krnl failed: {rows[0]['reason']}")
    k = base[0]["tokens_per_s"]
    for r in rows:
        r.update(title=title, dtype=dtype)
        if r.get("status", "ok") != "ok":
            continue
        r["vs_krnl"] = r["tokens_per_s"] / k
        if not on_gpu:  # the CPU's pools hold only part of a CPU run's memory: no figure rather than a wrong one
            r["peak_bytes"] = r["peak_kind"] = None
        r["note"] = note(r)
    return rows


def power_figures(w, r):
    """A row's GPU figures over its timed steps (gpu_power.window's `w`): the clock, the share of
    samples the power cap held, and from the mean power the joules a step and tokens a joule."""
    if w is None:
        return {"why_not": "no sample inside the timed steps"}
    out = dict(w)
    if w["watts"] is not None:
        out["joules_per_step"] = w["watts"] * r["ms"] / 1e3
        out["tokens_per_joule"] = r["tokens_per_s"] / w["watts"]
    return out


def note(r):
    peak = (f"peak {r['peak_bytes'] / 2**30:.2f} GiB {r['peak_kind']}" if r.get("peak_bytes") else "")
    # beside a device's peak, what the steps kept in host memory (offloaded checkpoints)
    host = f"host +{r['host_bytes'] / 2**30:.2f} GiB in the steps" if peak and r.get("host_bytes") is not None else ""
    return ", ".join(x for x in (f"loss {r['loss']:.4f} (first {r['first_loss']:.4f})", peak, host,
                                 f"warm-up {r['warmup_s']:.1f} s", gpu_power.describe(r.get("gpu")), r.get("note", "")) if x)


def session_rows(session, opts, profile=False):
    """The rows a Session adds for the train workload (opts: the --train-* options); with
    profile, a row may carry the per-op "profile" of one krnl step."""
    from .targets import is_gpu
    opts = dict(opts or {})
    name = opts.pop("shape", None) or ("quick" if session.quick else "1b")
    opts.pop("gpus", None)  # train_dist.session_rows runs the N-rank session
    s = shape(name, **opts)
    gpu = is_gpu(session.dev)
    if name != "quick" and not gpu:
        return [dict(impl="krnl", status="skipped", reason=f"the {name} shape is sized for a GPU; --quick (or "
                                                            f"--train-shape quick) runs a small one here")]
    session.log(f"krnl bench: train ({describe(s)})")
    return run(session.dev, session.dtype, s, session.peers, session.log, gpu, profile=profile)
