"""krnl train's modes beyond SFT (--train-mode dpo, orpo, simpo, grpo): their options, with TRL's names
and defaults, their data from --data, and GRPO's objective (its tokenizer and reward functions)."""

from pathlib import Path

from ..train.grpo import LOSS_TYPES
from ..train.pairs import FEATURES
from ..train.preference import DPO_LOSS_TYPES

PAIRWISE = ("dpo", "orpo", "simpo")


def add_arguments(t):
    t.add_argument("--train-mode", default="sft", choices=["sft", *PAIRWISE, "grpo"], help="sft (the data's "
                   "completions); TRL's objective on preference pairs {prompt, chosen, rejected} (dpo's reference: "
                   "the base, the adapter off); or grpo on prompt-only lines, sampled and rewarded")
    t.add_argument("--beta", type=float, default=None, help="TRL's beta: dpo, orpo (its lambda), simpo (default "
                   "0.1); grpo's KL to the base (default 0)")
    t.add_argument("--loss-type", default=None, choices=[*DPO_LOSS_TYPES, *LOSS_TYPES],
                   help="TRL's loss type: dpo's (default sigmoid) or grpo's (default dapo)")
    t.add_argument("--simpo-gamma", type=float, default=0.5, help="simpo: the target reward margin (TRL's)")
    t.add_argument("--cpo-alpha", type=float, default=0.0, help="simpo: weight of the chosen NLL (CPO's; 0: SimPO)")
    g = t.add_argument_group("grpo (TRL's GRPOConfig names; --batch-size counts completions)")
    g.add_argument("--reward", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="a reward function, module:function or file.py:function, called as TRL calls them (repeat)")
    g.add_argument("--reward-weights", default=None, help="comma-separated weights of the --reward functions")
    g.add_argument("--num-generations", type=int, default=8, help="completions sampled per prompt")
    g.add_argument("--max-completion-length", type=int, default=512)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    g.add_argument("--epsilon", type=float, default=0.2, help="the ratio's clip below 1 (and above, without "
                   "--epsilon-high)")
    g.add_argument("--epsilon-high", type=float, default=None)
    g.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"])
    d = t.add_argument_group("the data's key names in these modes (mlx-lm-lora's *_feature options)")
    for k in FEATURES:
        d.add_argument(f"--{k.replace('_', '-')}-feature", default=k, metavar="KEY",
                       help=f"the key of each line read as {k!r}")


def data_keys(args):
    """{krnl's key: the data's} of the --*-feature options that rename one."""
    keys = {k: getattr(args, f"{k}_feature") for k in FEATURES if getattr(args, f"{k}_feature") != k}
    if keys and args.train_mode == "sft":
        raise ValueError(f"[train] --{next(iter(keys)).replace('_', '-')}-feature names a key of --train-mode "
                         "dpo, orpo, simpo or grpo data; sft reads text, prompt/completion or messages")
    return keys


def config_fields(args):
    """TrainConfig's fields of the mode, its defaults resolved."""
    grpo = args.train_mode == "grpo"
    data_keys(args)  # sft refuses them: they would be ignored
    return {"train_mode": args.train_mode, "beta": args.beta if args.beta is not None else (0.0 if grpo else 0.1),
            "loss_type": args.loss_type or ("dapo" if grpo else "sigmoid"), "simpo_gamma": args.simpo_gamma,
            "cpo_alpha": args.cpo_alpha}


def prompts_per_batch(args):
    """grpo: the prompts of a batch of --batch-size completions."""
    G = args.num_generations
    if args.batch_size % G:
        raise ValueError(f"[train] --batch-size {args.batch_size} (completions) is not whole groups of "
                         f"--num-generations {G}")
    return args.batch_size // G


def mode_split(args, tok, vocab_size):
    """The mode's data read once, whoever asks first (the memory plan, then the run): grpo's prompts
    (load_prompts' items) or the pairs' splits {train, valid}."""
    from ..train.pairs import load_pair_dataset, load_prompts

    if args.pack:
        raise ValueError(f"[train] --pack packs SFT samples; --train-mode {args.train_mode} keeps each row's own")
    if getattr(args, "loaded_data", None) is None:
        if args.train_mode == "grpo":
            args.loaded_data = load_prompts(Path(args.data) / "train.jsonl", tok, args.max_seq_length, vocab_size,
                                            data_keys(args))
        else:
            args.loaded_data = load_pair_dataset(args.data, tok, args.max_seq_length, vocab_size,
                                                 args.train_mode == "orpo", data_keys(args))
    return args.loaded_data


def mode_data(args, tok, model):
    """(train source, valid or None, training items) of the mode from --data: pairs, or grpo's prompts."""
    from ..train.pairs import PromptBatches

    data = mode_split(args, tok, model.config.vocab_size)
    if args.train_mode == "grpo":
        G = args.num_generations
        per_batch = prompts_per_batch(args)
        print(f"train: {len(data)} prompts from {Path(args.data) / 'train.jsonl'}")
        return PromptBatches(data, per_batch, args.seed, where=args.data), None, len(data) * G
    for split in data.values():
        if split is not None:
            print(split.summary())
    return data["train"], data["valid"], len(data["train"].pairs)


def memory_fields(args):
    """krnl.train.memory.Run's fields of the mode: rows a batch item makes, the reference's forward,
    grpo's completion length."""
    if args.train_mode == "sft":
        return {}
    if args.train_mode == "grpo":
        return dict(objective="grpo", rows_per_item=args.num_generations, reference=bool(args.beta),
                    completion=args.max_completion_length)
    return dict(objective=args.train_mode, rows_per_item=2, reference=args.train_mode == "dpo")


def longest(args, split, max_positions):
    """(the longest row of the mode's data (mode_split's), what it is)."""
    if args.train_mode == "grpo":
        n = min(max(len(ids) for ids, _ in split) + args.max_completion_length, max_positions)
        return n, "the longest prompt and --max-completion-length"
    return max(len(s) for p in split["train"].pairs for s in p[:2]), f"the longest pair of {split['train'].path}"


def objective(args, tok, cfg):
    """GRPO's objective of the command line (None for the other modes: TrainConfig says all of theirs)."""
    if args.train_mode != "grpo":
        return None
    from ..train.grpo import GRPO, load_reward

    w = None if args.reward_weights is None else [float(x) for x in args.reward_weights.split(",")]
    return GRPO(tok, [load_reward(s) for s in args.reward], w, args.num_generations, args.max_completion_length,
                args.temperature, args.top_p, cfg.beta, args.epsilon, args.epsilon_high, cfg.loss_type,
                args.scale_rewards, args.seed, args.top_k, graphs=not args.no_graphs)
