"""krnl train's optimizer options (--optimizer and each optimizer's own), with the names and
defaults of the reference each optimizer matches (README, 'Optimizers')."""

import argparse

from ..train.optimizers import OPTIMIZERS


def _betas(text):
    """--betas "0.9,0.999": two numbers, comma-separated."""
    try:
        b = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        b = ()
    if len(b) != 2:
        raise argparse.ArgumentTypeError(f"expected two comma-separated numbers, e.g. 0.9,0.999; got {text!r}")
    return b


def add_arguments(t):
    o = t.add_argument_group("optimizer (torch.optim's names and defaults; --weight-decay and --max-grad-norm apply "
                             "to each)")
    o.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS),
                   help="adamw, adam (L2 weight decay), sgd, lion, adafactor, muon (AdamW for parameters not 2-D), "
                   "adamw8bit (bitsandbytes' blockwise 8-bit moments)")
    o.add_argument("--betas", type=_betas, default=None, metavar="B1,B2",
                   help="adamw, adam, adamw8bit, lion, muon's AdamW: the moments' decay rates (default: 0.9,0.999; "
                   "lion 0.9,0.99)")
    o.add_argument("--eps", type=float, default=None, help="adamw, adam, muon's AdamW: the denominator's epsilon "
                   "(default: 1e-8)")
    o.add_argument("--momentum", type=float, default=None, help="sgd: momentum (default: 0, plain SGD); muon: its "
                   "momentum (default: 0.95)")
    o.add_argument("--dampening", type=float, default=0.0, help="sgd: dampening of the momentum")
    o.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=None,
                   help="Nesterov momentum: sgd (default: off; needs --momentum, no dampening), muon (default: on)")
    o.add_argument("--loraplus-lr-ratio", type=float, default=0.0, metavar="R",
                   help="LoRA+ (PEFT's create_loraplus_optimizer): the LoRA B factors train at --learning-rate times R "
                   "(0: off), with any optimizer")
    o.add_argument("--min-8bit-size", type=int, default=4096, help="adamw8bit: parameters of fewer elements keep f32 "
                   "moments (bitsandbytes' min_8bit_size)")
    o.add_argument("--ns-steps", type=int, default=5, help="muon: Newton-Schulz iterations")
    o.add_argument("--adjust-lr-fn", default="original", choices=["original", "match_rms_adamw"],
                   help="muon: torch's learning-rate ratio per shape (A, B): sqrt(max(1, A/B)), or 0.2 sqrt(max(A, B))")
    o.add_argument("--beta2-decay", type=float, default=-0.8, help="adafactor: the second moment decays as "
                   "1 - t^beta2_decay")
    o.add_argument("--clip-threshold", type=float, default=1.0, help="adafactor: the update's rms is clipped at this "
                   "(torch's d)")
    o.add_argument("--relative-step", action=argparse.BooleanOptionalAction, default=True,
                   help="adafactor: step size min(lr, 1/sqrt(t)) times the parameter's rms (torch's); off: the "
                   "schedule's lr times the rms")


def config_fields(args):
    """TrainConfig's optimizer fields of the command line."""
    if args.loraplus_lr_ratio < 0:
        raise ValueError(f"[train] --loraplus-lr-ratio must be >= 0 (0: off), got {args.loraplus_lr_ratio}")
    if args.nesterov and args.optimizer not in ("sgd", "muon"):
        raise ValueError("[train] --nesterov is SGD's and Muon's")
    if args.nesterov and args.optimizer == "sgd" and (not (args.momentum or 0) > 0 or args.dampening):
        raise ValueError("[train] --nesterov with sgd needs --momentum > 0 and no --dampening")
    return {"optimizer": args.optimizer, "betas": args.betas, "eps": args.eps, "momentum": args.momentum,
            "dampening": args.dampening, "nesterov": args.nesterov, "beta2_decay": args.beta2_decay,
            "clip_threshold": args.clip_threshold, "relative_step": args.relative_step, "ns_steps": args.ns_steps,
            "adjust_lr_fn": args.adjust_lr_fn, "loraplus_lr_ratio": args.loraplus_lr_ratio,
            "min_8bit_size": args.min_8bit_size}
