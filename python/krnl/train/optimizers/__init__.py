"""krnl's optimizers over a FlatParams (base.py says what they share) and the one that a
TrainConfig names (`from_config`)."""

from .adamw8bit import AdamW8bit
from .elementwise import SGD, Adam, AdamW, Lion
from .factored import Adafactor
from .muon import Muon

OPTIMIZERS = {c.name: c for c in (AdamW, Adam, SGD, Lion, Adafactor, Muon, AdamW8bit)}
# --betas left out: each optimizer's reference default (muon: its AdamW's)
DEFAULT_BETAS = {"adamw": (0.9, 0.999), "adam": (0.9, 0.999), "lion": (0.9, 0.99), "muon": (0.9, 0.999),
                 "adamw8bit": (0.9, 0.999)}


# TrainConfig's fields that shape an optimizer's state: a resumed run keeps the checkpoint's
OPTIMIZER_FIELDS = ("optimizer", "betas", "eps", "momentum", "dampening", "nesterov", "beta2_decay", "clip_threshold",
                    "relative_step", "ns_steps", "adjust_lr_fn", "loraplus_lr_ratio", "min_8bit_size")


def from_config(flat, schedule, cfg):
    """The optimizer of cfg.optimizer with cfg's options (a TrainConfig's fields)."""
    kind = cfg.optimizer
    if kind not in OPTIMIZERS:
        raise ValueError(f"[train] optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
    common = {"weight_decay": cfg.weight_decay, "max_grad_norm": cfg.max_grad_norm or None,
              "lr_ratio": cfg.loraplus_lr_ratio or None}
    betas = tuple(cfg.betas) if cfg.betas else DEFAULT_BETAS.get(kind)
    eps = cfg.eps if cfg.eps is not None else 1e-8
    if kind == "adamw8bit":
        return AdamW8bit(flat, schedule, betas=betas, eps=eps, min_8bit_size=cfg.min_8bit_size, **common)
    if kind in ("adamw", "adam"):
        return OPTIMIZERS[kind](flat, schedule, betas=betas, eps=eps, **common)
    if kind == "lion":
        return Lion(flat, schedule, betas=betas, **common)
    if kind == "muon":
        return Muon(flat, schedule, momentum=0.95 if cfg.momentum is None else cfg.momentum,
                    nesterov=cfg.nesterov is not False, ns_steps=cfg.ns_steps, adjust_lr_fn=cfg.adjust_lr_fn,
                    betas=betas, adam_eps=eps, **common)
    if kind == "adafactor":
        return Adafactor(flat, schedule, beta2_decay=cfg.beta2_decay, d=cfg.clip_threshold,
                         relative_step=cfg.relative_step, **common)
    return SGD(flat, schedule, momentum=cfg.momentum or 0.0, dampening=cfg.dampening, nesterov=bool(cfg.nesterov),
               **common)
