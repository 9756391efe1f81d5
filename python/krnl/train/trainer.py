"""The training loop: micro-batches (one device submission each), gradient accumulation, the
optimizer step, validation, atomic checkpoints and exact resume, progress and metrics.

Resume is exact: a checkpoint holds the adapter masters, the optimizer state (m, v, step
counters, schedule, loss scale), the data position and every seed the loop draws from, so a run
restored from step k reproduces the losses of an uninterrupted run from step k+1 on.
"""

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..formats import adapter as adapter_io
from .batches import Batches
from ..io.checkpoint import fingerprint_diff, list_checkpoints, load_checkpoint, resolve_checkpoint, save_checkpoint
from .dist.world import World
from .dist.nccl import reducer_for
from .dist.ranks import Discard, apply_reduce_order, check_world, evaluate_ranks
from .memory import out_of_memory
from .optim import OPTIMIZER_FIELDS, Schedule, from_config
from ..io.run_folder import describe, option_changes, repair_metrics
from .plot import plot_metrics  # noqa: F401 (the CLI and its tests reach it here)
from .rate import Rate
from . import preference
from .step import StepRunner

# Where the step replays as a graph, each padded length is one recording: lengths go up in steps
# of this many tokens unless --length-bucket says otherwise.
REPLAY_BUCKET = 256


@dataclass
class TrainConfig:
    iters: int = 600
    batch_size: int = 16
    grad_accum: int = 1
    learning_rate: float = 3e-3
    warmup: int = 30
    schedule: str = "cosine"      # cosine | linear | constant (after warmup)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0    # 0 disables clipping
    optimizer: str = "adamw"      # adamw | adam | sgd | lion | adafactor | muon | adamw8bit (train.optimizers)
    betas: tuple = None           # adamw(8bit), adam, lion, muon's AdamW (None: the optimizer's default)
    eps: float = None             # adamw(8bit), adam, muon's AdamW (None: 1e-8)
    momentum: float = None        # sgd (0), muon (0.95); None: that default
    dampening: float = 0.0        # sgd
    nesterov: bool = None         # sgd (off), muon (on); None: that default
    ns_steps: int = 5             # muon: Newton-Schulz iterations, and torch's learning-rate adjustment
    adjust_lr_fn: str = "original"
    loraplus_lr_ratio: float = 0.0  # LoRA+ (PEFT's): the B factors at learning_rate * this; 0: off
    min_8bit_size: int = 4096     # adamw8bit: smaller parameters keep f32 moments (bitsandbytes')
    beta2_decay: float = -0.8     # adafactor (torch.optim.Adafactor's), with its clip threshold d
    clip_threshold: float = 1.0
    relative_step: bool = True    # adafactor: step min(lr, 1/sqrt(t)); False: the schedule's lr
    val_every: int = 100          # 0: only at the end
    val_batches: int = 8
    save_every: int = 200         # 0: only at the end
    keep_checkpoints: int = 2
    seed: int = 0
    length_bucket: int = 0        # pad each batch's length to a multiple (0: 256 where graphs replay, else none)
    graphs: bool = True           # record the step once per padded length and replay it, where the device can
    reduce_order: str = "auto"    # sample: LoRA grads summed per sample (dist/ranks.py); auto: sample with > 1 rank
    train_mode: str = "sft"       # sft | dpo | orpo | simpo | grpo (krnl.train.preference, krnl.train.grpo)
    beta: float = 0.1             # TRL's beta (ORPO's lambda; GRPO's KL weight)
    loss_type: str = "sigmoid"    # dpo: sigmoid | hinge | ipo; grpo: grpo | bnpo | dr_grpo | dapo
    simpo_gamma: float = 0.5      # simpo: the target reward margin
    cpo_alpha: float = 0.0        # simpo: weight of the chosen rows' NLL (CPO's; 0 is SimPO's own)

    def validate(self):
        for name in ("iters", "batch_size", "grad_accum", "val_batches", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"[train] {name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "val_every", "save_every", "length_bucket"):
            if getattr(self, name) < 0:
                raise ValueError(f"[train] {name} must be >= 0, got {getattr(self, name)}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"[train] learning_rate must be > 0, got {self.learning_rate}")
        preference.check(self)


def _batch_args(batch):
    """(ids, targets, {segments, positions} or {}) of a batch tuple of 2 or 4 arrays."""
    if len(batch) > 2:
        return batch[0], batch[1], {"segments": batch[2], "positions": batch[3]}
    return batch[0], batch[1], {}


class Trainer:
    def __init__(self, model, cfg, train, valid=None, out_dir="krnl_out", fingerprint=None, base_model="",
                 progress=True, on_step=None, options=None, adapter_format="peft", world=None, objective=None):
        cfg.validate()
        self.model, self.cfg, self.valid = model, cfg, valid
        # krnl.train.dist.world: each rank trains on its slice of the global batches; rank 0 alone writes files.
        self.world = world or World()
        check_world(self.world, cfg, model.lora_config.dropout)
        apply_reduce_order(model, cfg, self.world)
        # None: sft's mean cross entropy; else it takes whole batches and slices them itself among the ranks
        self.objective = preference.objective(cfg, self.world, objective)
        preference.check_full(cfg, model.lora_config)
        # train: (ids, targets[, segments, positions]) arrays, a krnl.train.data.Split (its batches()),
        # or a batch source with next(), state() and load_state().
        if hasattr(train, "batches"):
            self.data = train.batches(cfg.batch_size, cfg.seed)
        elif hasattr(train, "next"):
            self.data = train
        else:
            self.data = Batches(train[0], train[1], cfg.batch_size, cfg.seed,
                                *(train[2:4] if len(train) > 2 else ()))
        self.out = Path(out_dir)
        self.fingerprint = fingerprint or {}
        self.base_model = base_model
        self.progress, self.on_step = progress, on_step
        # "mlx": the adapter also in mlx-lm's layout, in out_dir/mlx (adapter.MLX_SUBFOLDER).
        self.adapter_format = adapter_format
        # Run options outside TrainConfig that a resume must match (data, ...): {name: JSON value}.
        self.options = dict(options or {})
        self.notes = []      # what resume() did besides restoring (skipped checkpoints, changes): lines
        self.resumed = None  # what resume() changed, recorded in the first metrics row after it
        sched = Schedule(cfg.learning_rate, warmup_steps=min(cfg.warmup, cfg.iters), total_steps=cfg.iters,
                         kind=cfg.schedule, min_lr_ratio=cfg.min_lr_ratio)
        self.opt = from_config(model.lora_params, sched, cfg)
        self.step = 0
        self.history = []  # (step, train loss)
        self.memory_estimate = None  # krnl.train.memory's Estimate of this run, for the out-of-memory line
        self.val_history = []

    # -- state -----------------------------------------------------------------------------

    def _trainer_state(self):
        return {"step": self.step, "data": self.data.state(), "dropout_seed": self.model._call_seed,
                "config": asdict(self.cfg), "options": self.options, "world_size": self.world.size}

    def save(self):
        if not self.world.root:
            return
        save_checkpoint(self.out / "checkpoints", adapter=self.model.lora_state(),
                        optimizer_state=self.opt.state_dict(), trainer_state=self._trainer_state(),
                        model_fingerprint=self.fingerprint, step=self.step, keep_last=self.cfg.keep_checkpoints)

    def _candidates(self, path):
        """The checkpoints resume tries, in order: `path` (a checkpoint directory, or a checkpoint
        root) or the step it names (an int); for a root, the one its `latest` names, then the
        older ones, newest first."""
        root = self.out / "checkpoints"
        if isinstance(path, int):
            found = dict(list_checkpoints(root))
            if path not in found:
                have = ", ".join(str(s) for s in found) or "none"
                raise ValueError(f"[train] --resume-from {path}: {root} has no checkpoint of step {path} "
                                 f"(steps there: {have})")
            return [Path(found[path])]
        if path is None and not list_checkpoints(root):
            raise ValueError(f"[train] --resume: {root} holds no checkpoint; start a new run (with --overwrite "
                             f"if {self.out} holds an earlier run's files)")
        root = Path(path) if path is not None else root
        found = list_checkpoints(root)
        if (root / "manifest.json").exists() or not found:
            return [root]  # one checkpoint, or none: load_checkpoint says what is wrong
        try:
            first = Path(resolve_checkpoint(root))
        except ValueError as e:  # a corrupt `latest`
            self.notes.append(f"{e}; trying the step-* checkpoints, newest first")
            first = Path(found[-1][1])
        first_step = dict((Path(p), s) for s, p in found).get(first, found[-1][0])
        return [first] + [Path(p) for s, p in reversed(found) if s < first_step]

    def resume(self, path=None, override=False):
        """Restores the newest checkpoint under out_dir that verifies (a corrupt one is skipped,
        with a line in self.notes), or the checkpoint `path` names (a directory, a checkpoint root,
        or a step number); returns its step. TrainConfig fields and options that differ from the
        checkpoint's are refused (ValueError listing them) unless override; cfg.iters may differ:
        the learning-rate schedule is then stretched (or shrunk) to end at cfg.iters."""
        ck = self.world.on_root(lambda: self._load(path), "reading the checkpoint to resume from")
        self._restore(ck, override)
        return self.step

    def _load(self, path):
        """The checkpoint resume() restores (see there), with notes on the ones skipped."""
        cands = self._candidates(path)
        skipped = []
        for cand in cands:
            try:
                ck = load_checkpoint(cand)
                break
            except ValueError as e:
                if len(cands) == 1:
                    raise
                skipped.append(f"{cand.name}: {e}")
        else:
            raise ValueError(f"[train] no checkpoint under {cands[0].parent} verifies: " + "; ".join(skipped))
        self.notes.extend(f"skipped checkpoint {s} (falling back to {Path(ck.path).name})" for s in skipped)
        return ck

    def _restore(self, ck, override):
        diff = fingerprint_diff(ck.fingerprint, json.loads(json.dumps(self.fingerprint)))
        if diff:
            raise ValueError(f"[train] {ck.path} belongs to a different model or LoRA layout (--resume-override "
                             f"cannot change these): " + "; ".join(diff[:5])
                             + (f" (and {len(diff) - 5} more)" if len(diff) > 5 else ""))
        st = ck.trainer_state
        saved = dict(st.get("config", {}), **st.get("options", {}))
        changes = option_changes(saved, dict(asdict(self.cfg), **self.options))
        if changes and not override:
            raise ValueError(f"[train] {ck.path} was trained with other options: {describe(changes)}; rerun with "
                             f"the checkpoint's values, or pass --resume-override to continue with these")
        if any(k in OPTIMIZER_FIELDS for k in changes):  # the saved state is the saved optimizer's
            raise ValueError(f"[train] --resume-override cannot change the optimizer or its options: {describe(changes)}")
        self.model.lora_params.load(ck.adapter)
        try:
            self.opt.load_state_dict(ck.optimizer_state)
        except ValueError as e:  # one line that names the file it came from
            raise ValueError(f"{e} (the optimizer state of {ck.path})") from None
        self.data.load_state(st["data"])
        self.model._call_seed = int(st["dropout_seed"])
        self.step = int(st["step"])
        # The data position counts global batches, the same for any number of ranks.
        if int(st.get("world_size", 1)) != self.world.size:
            self.notes.append(f"checkpoint written by {st.get('world_size', 1)} ranks, continuing with "
                              f"{self.world.size} (same global batch and data position)")
        # Metrics written after this checkpoint by the interrupted run are replayed: drop them, and
        # a torn last line (a write cut short).
        note = repair_metrics(self.out / "metrics.jsonl", self.step) if self.world.root else None
        if note:
            self.notes.append(note)
        if self.step < self.cfg.iters:
            self._apply_changes(changes, saved.get("iters"))

    def _apply_changes(self, changes, saved_iters):
        """After a restore: the overridden options take effect and the schedule ends at cfg.iters."""
        cfg, sched = self.cfg, self.opt.schedule
        if changes:
            self.notes.append(f"continuing with changed options (--resume-override): {describe(changes)}")
            if "weight_decay" in changes:
                self.opt.weight_decay = float(cfg.weight_decay)
            if "max_grad_norm" in changes:
                self.opt.max_grad_norm = float(cfg.max_grad_norm) if cfg.max_grad_norm else None
        warm = cfg.warmup if "warmup" in changes else sched.warmup_steps
        new = Schedule(cfg.learning_rate if "learning_rate" in changes else sched.lr,
                       warmup_steps=min(warm, cfg.iters), total_steps=cfg.iters,
                       kind=cfg.schedule if "schedule" in changes else sched.kind,
                       min_lr_ratio=cfg.min_lr_ratio if "min_lr_ratio" in changes else sched.min_lr_ratio)
        changed = {k: list(v) for k, v in changes.items()}
        if saved_iters is not None and saved_iters != cfg.iters:
            changed["iters"] = [saved_iters, cfg.iters]
        if new.state_dict() != sched.state_dict():
            old_total = sched.total_steps
            self.opt.schedule = new
            why = f"--iters {saved_iters} -> {cfg.iters}: " if "iters" in changed else ""
            self.notes.append(f"{why}learning-rate schedule from step {self.step + 1}: {new.kind}, warmup "
                              f"{new.warmup_steps}, ending at step {new.total_steps} (was {old_total})")
        if changed or new is self.opt.schedule:
            self.resumed = {"from_step": self.step, "changed": changed, "schedule": self.opt.schedule.state_dict()}

    # -- loop --------------------------------------------------------------------------------

    def evaluate(self):
        if self.valid is None:
            return None
        if self.world.size > 1 and self.objective is None:
            return evaluate_ranks(self.model, self.valid, self.cfg, self.world, self.step)
        bs, total = self.cfg.batch_size, []
        if hasattr(self.valid, "eval_batches"):  # a krnl.train.data.Split (or pairs.PairSplit)
            for batch in self.valid.eval_batches(bs)[:self.cfg.val_batches]:
                if self.objective:  # its batches its own: pairs' rows and their scores
                    total.append(self.objective.evaluate(self.model, *batch))
                    continue
                ids, tg, kw = _batch_args(batch)
                total.append(self.model.loss(ids, tg, **kw))
            return float(np.mean(total))
        ids, tg = self.valid[0], self.valid[1]
        extra = self.valid[2:4] if len(self.valid) > 2 else None
        for b in range(min(self.cfg.val_batches, max(1, len(ids) // bs))):
            rows = slice(b * bs, (b + 1) * bs)
            kw = {"segments": extra[0][rows], "positions": extra[1][rows]} if extra else {}
            total.append(self.model.loss(ids[rows], tg[rows], **kw))
        return float(np.mean(total))

    def run(self, metrics_path=None):
        cfg, model, dev = self.cfg, self.model, self.model.dev
        metrics_path = Path(metrics_path) if metrics_path else self.out / "metrics.jsonl"
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        bar = None
        if self.progress and self.world.root:
            from tqdm import tqdm

            bar = tqdm(total=cfg.iters, initial=self.step, unit="step", dynamic_ncols=True)
        # a sequence objective reads each micro-batch's sums on the host mid-step: never a replayed graph
        replay = cfg.graphs and bool(dev.capabilities()["graphs"]) and self.objective is None
        bucket = cfg.length_bucket or (REPLAY_BUCKET if replay else 1)
        runner = StepRunner(model, self.opt, bucket=bucket, replay=replay, micro_batches=cfg.grad_accum,
                            world=self.world, reducer=reducer_for(self.world, dev), objective=self.objective)
        rate = Rate()
        dev.reset_peak()
        self.world.check_params(self.model.lora_params, self.step)
        try:
            with open(metrics_path, "a") if self.world.root else Discard() as log:
                while self.step < cfg.iters:
                    try:
                        self._one_step(runner, rate, log, bar)
                    except RuntimeError as e:  # the pool's refusal, or the device's allocator's
                        if not str(e).startswith("[alloc]"):
                            raise
                        found = list_checkpoints(self.out / "checkpoints")
                        raise out_of_memory(e, self.step, self.memory_estimate, found[-1][0] if found else None) \
                            from None
        finally:
            runner.release()
        if bar is not None:
            bar.close()
        if self.world.root:
            self.save_adapter()
        return {"steps": self.step, "loss": self.history[-1][1] if self.history else None,
                "val_loss": self.val_history[-1][1] if self.val_history else None,
                "skipped_steps": self.opt.skipped_steps, "metrics": str(metrics_path)}

    def _one_step(self, runner, rate, log, bar):
        """Queues the step's micro-batches and update, waits once, then metrics, progress,
        validation and checkpoints."""
        cfg, dev = self.cfg, self.model.dev
        self.step += 1
        tokens, ranks = 0, self.world.size > 1
        for i in range(cfg.grad_accum):
            batch = self.data.next()
            if self.objective is not None:  # a sampling objective's seeds follow the run's position
                self.objective.position = (self.step, i)
            if ranks and self.objective is None:  # the tokens of the global batch: every rank reads all of it
                n = int(np.count_nonzero(np.asarray(batch[1]) != -100))
                tokens += n
                mine = self.world.slice(batch)
                runner.micro_batch(mine, self.opt.loss_scale, i, n, first_row=self.world.rank * len(mine[0]))
            else:
                tokens += runner.micro_batch(batch, self.opt.loss_scale, i)
        runner.optimizer(cfg.grad_accum, self.step)
        loss, info = runner.finish()
        if not math.isfinite(loss) and not self.opt.scaler.enabled:
            raise FloatingPointError(f"[train] loss is {loss} at step {self.step}; stopping (no adapter "
                                     f"written for this step; the last checkpoint is intact)")
        rate.add(tokens)
        peak = dev.pool_stats()["peak_reserved"] / 2**20
        rec = {"step": self.step, "loss": loss, "lr": info["lr"], "grad_norm": info["grad_norm"],
               "tokens_per_s": rate.recent(), "tokens_per_s_cumulative": rate.cumulative(), "peak_mem_mib": peak,
               "skipped_steps": info["skipped_steps"], "loss_scale": info["loss_scale"]}
        for k in ("aux_loss", *info.get("objective", ())):  # a mixture's load-balancing loss; dpo's rewards
            if k in info:
                rec[k] = info[k]
        if self.resumed is not None:  # the first step after a resume that changed the run
            rec["resumed"], self.resumed = self.resumed, None
        self.history.append((self.step, loss))
        last = self.step == cfg.iters
        if (cfg.val_every and self.step % cfg.val_every == 0) or last:
            v = self.evaluate()
            if v is not None:
                rec["val_loss"] = v
                self.val_history.append((self.step, v))
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if bar is not None:
            post = {"loss": f"{loss:.4f}", "tok/s": f"{rec['tokens_per_s']:.0f}", "lr": f"{info['lr']:.2e}",
                    "peak": f"{peak:.0f}MiB"}
            if "val_loss" in rec:
                post["val"] = f"{rec['val_loss']:.4f}"
            if info["skipped_steps"]:
                post["skipped"] = info["skipped_steps"]
            bar.set_postfix(post, refresh=False)
            bar.update(1)
        if ranks and (self.step % self.world.check_every == 0 or last):
            self.world.check_params(self.model.lora_params, self.step)
        if (cfg.save_every and self.step % cfg.save_every == 0) or last:
            self.save()
        if self.on_step is not None:
            self.on_step(self.step, rec)

    def save_adapter(self):
        lc = self.model.lora_config
        if lc.full:  # the trained weights, and the whole model where the base is a folder
            from ..formats.full_save import save_full
            save_full(self.out, self.model.lora_state(), lc, self.model.config, self.base_model)
            return
        cfg = adapter_io.peft_config(lc, base_model=self.base_model, layers=lc.layers, model_config=self.model.config)
        state = self.model.lora_state()
        adapter_io.save_adapter(self.out, state, cfg, self.model.config)
        if self.adapter_format == "mlx":
            adapter_io.save_mlx_adapter(self.out / adapter_io.MLX_SUBFOLDER, lc, state, self.model.config,
                                        self.base_model)
