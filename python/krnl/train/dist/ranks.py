"""The trainer's side of data-parallel training (krnl.train.dist.world): what a run over several ranks
refuses, the order its gradients sum over rows in, the validation loss over the ranks' slices,
the sums of a sequence objective's numbers over the ranks (pooled), and the metrics log of ranks
other than 0 (which write no file)."""

import numpy as np


class Discard:
    """A metrics log that drops what it is given (ranks other than 0)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, text):
        pass

    def flush(self):
        pass


def check_world(world, cfg, dropout=0.0):
    """Refuses what ranks cannot train as one process would. A sequence objective slices whole pairs or
    prompts, unevenly where they do not divide (krnl.train.preference, grpo)."""
    if world.size == 1:
        return
    if cfg.train_mode == "sft" and cfg.batch_size % world.size:
        raise ValueError(f"[train] --batch-size {cfg.batch_size} (the global batch) does not divide among "
                         f"{world.size} ranks")
    if cfg.train_mode in ("dpo", "orpo", "simpo") and dropout:
        # the masks follow the batch's rows from the slice's first (one offset): a rank's pairs are two blocks
        raise ValueError(f"[train] --lora-dropout {dropout:g} with --train-mode {cfg.train_mode} over {world.size} "
                         f"ranks: a rank's chosen and rejected rows are two blocks of the batch, which cannot draw "
                         f"one process's dropout masks; use --lora-dropout 0 (TRL's default for pairs) or one rank")


def pooled(world, values, what, most=()):
    """{k: the sum over the ranks of values[k]} (floats; the largest for the keys in `most`) in one
    gather, the same on every rank; a rank without items may give {}. With one rank, `values` itself."""
    if world.size == 1:
        return values
    every = [v for v in world.allgather(values, what) if v]
    return {k: float((max if k in most else sum)(v[k] for v in every)) for k in every[0]}


REDUCE_ORDERS = ("auto", "rows", "sample")


def reduce_order(cfg, world):
    """TrainConfig.reduce_order resolved: "sample" (krnl.models.sample_sums: each LoRA weight gradient and
    the loss summed per sample in a fixed tree, so that ranks reproduce one process's sums) or
    "rows" (one GEMM over all rows); "auto" is "sample" where the world has more than one rank, in SFT
    (the sequence objectives' are "rows")."""
    if cfg.reduce_order not in REDUCE_ORDERS:
        raise ValueError(f"[train] --reduce-order must be one of {', '.join(REDUCE_ORDERS)}, got {cfg.reduce_order!r}")
    if cfg.train_mode != "sft":  # a sequence objective weighs each row after the forward
        if cfg.reduce_order == "sample":
            raise ValueError(f"[train] --reduce-order sample sums SFT's token losses per sample; --train-mode "
                             f"{cfg.train_mode} weighs each row after the forward: use --reduce-order auto or rows")
        return "rows"
    if cfg.reduce_order == "auto":
        return "sample" if world.size > 1 else "rows"
    return cfg.reduce_order


def apply_reduce_order(model, cfg, world):
    """Sets the model's sums over rows to reduce_order(cfg, world). A full fine-tune sums over rows:
    the sample order's per-sample slots would hold every trained weight once a sample."""
    order = reduce_order(cfg, world)
    if model.lora_config.full and order == "sample":
        if cfg.reduce_order == "sample":
            raise ValueError("[train] --reduce-order sample holds a gradient slot per sample, too large for full "
                             "fine-tuning: use --reduce-order auto or rows")
        order = "rows"
    model.sums.on = order == "sample"


def evaluate_ranks(model, valid, cfg, world, step):
    """Trainer.evaluate over the ranks: each takes its slice of every validation batch; the
    token-loss sums and target counts are summed over the ranks."""
    bs = cfg.batch_size
    if hasattr(valid, "eval_batches"):  # a krnl.train.data.Split
        batches = valid.eval_batches(bs)[:cfg.val_batches]
    else:
        n = min(cfg.val_batches, max(1, len(valid[0]) // bs))
        batches = [tuple(np.asarray(a)[b * bs:(b + 1) * bs] for a in valid[:4]) for b in range(n)]
    sums = np.zeros((2, len(batches)), np.float64)  # token-loss sums, target counts
    for j, batch in enumerate(batches):
        per = -(-len(batch[0]) // world.size)  # a short last batch: the last ranks may get no row
        mine = tuple(np.asarray(a)[world.rank * per:(world.rank + 1) * per] for a in batch)
        n = int(np.count_nonzero(np.asarray(mine[1]) != -100))
        if len(mine[0]):
            kw = {"segments": mine[2], "positions": mine[3]} if len(mine) > 2 else {}
            sums[0, j], sums[1, j] = model.loss(mine[0], mine[1], **kw) * n, n
    sums = world.allreduce(sums, f"the validation of step {step}")
    return float(np.mean(sums[0] / np.maximum(sums[1], 1)))
