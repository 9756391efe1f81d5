"""The `krnl` command line's arguments: the parser of every subcommand and the LoRA layout of train's
--lora-* flags (train's --config file: config_file.py). The commands themselves live in main.py,
device.py, fuse.py and serve.py."""

import argparse
import re
import sys

from ..quant import affine
from . import memory, objectives, optim_args
from .config_file import RENAMED, yaml_defaults
from .fuse import gguf_arguments
from .serve import serve_arguments


def _show_default(value):
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value).replace("%", "%%")


def _help_with_defaults(parser):
    """Appends "(default: ...)" to every option's help that does not already state its default."""
    for a in parser._actions:
        if (not a.option_strings or a.default is argparse.SUPPRESS or a.help is argparse.SUPPRESS
                or isinstance(a, argparse._HelpAction)):
            continue
        text = a.help or ""
        if not re.search(r"\bdefault[: ]", text.lower()):  # "(default: x)", "(default x)", "; default: x"
            a.help = (text + " " if text else "") + f"(default: {_show_default(a.default)})"


class _Renamed(argparse.Action):
    """An option's former spelling: hidden from --help, stored under the new one's dest."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"krnl: {option_string} is spelled --{self.dest.replace('_', '-')} now", file=sys.stderr)
        setattr(namespace, self.dest, values)


def quantize_arguments(q, meaning, bits=None, recipes=False, former=("quantize",)):
    """The quantization options, one vocabulary on every command (mlx_lm.convert's): --q-bits and
    --q-group-size quantize this command's model in MLX's affine layout; `meaning` says which model
    (train, eval, generate: the base held in memory; fuse, quantize: the folder written). `former`:
    the command's earlier spellings (RENAMED's keys)."""
    new = {"q_bits": q.add_argument("--q-bits", type=int, default=bits, choices=list(affine.BITS),
                                    help=f"bits per quantized weight of {meaning}, in MLX's affine layout (a "
                                    "scale and a bias per group)"),
           "q_group_size": q.add_argument("--q-group-size", type=int, default=None, choices=list(affine.MLX_GROUP_SIZES),
                                          help="inputs per quantization group (with --q-bits; default 64)")}
    q.add_argument("--q-mode", default="affine", choices=["affine", "mxfp4"],
                   help="mlx_lm.convert's quantization mode: affine, or mxfp4 (4-bit E2M1 codes, a power-of-two "
                   "scale per 32 inputs; implies --q-bits 4 --q-group-size 32)")
    if recipes:
        q.add_argument("--quant-predicate", default=None, choices=["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"],
                       help="one of mlx-lm's mixed-bit recipes (sets the bits; v_proj, down_proj and the head get "
                       "more)")
    for old in former:
        a = new[RENAMED[old]]
        q.add_argument("--" + old.replace("_", "-"), dest=a.dest, type=int, choices=a.choices, action=_Renamed,
                       help=argparse.SUPPRESS)


SHORT_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                 "down": "down_proj"}


def lora_targets(text):
    """The module names of --lora-targets: short names (q,k,v,o,gate,up,down), module names
    (q_proj) or mlx-lm's keys (self_attn.q_proj, mlp.gate_proj), comma-separated."""
    from ..models.config import module_part, ALL_MODULES

    # phi3's fused projections, a mixture's router (the config checks which apply)
    names = ALL_MODULES + ("qkv_proj", "gate_up_proj", "router")
    out = []
    for item in str(text).split(","):
        name = item.strip()
        m = SHORT_TARGETS.get(name, name)
        part, _, last = m.rpartition(".")
        if part:  # an mlx-lm key: its prefix must be the module's block
            m = last if part == module_part(last) else name
        if m not in names:
            raise ValueError(f"--lora-targets: unknown module {name!r}; accepted: {', '.join(SHORT_TARGETS)}, "
                             f"{', '.join(names)}, self_attn.q_proj ... mlp.down_proj")
        if m not in out:
            out.append(m)
    return tuple(out)


def lora_from_args(args):
    """The LoraConfig of train's --lora-* options."""
    from ..models.config import LoraConfig

    kw = {"r": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout, "use_rslora": args.rslora,
          "use_dora": args.fine_tune_type == "dora", "full": args.fine_tune_type == "full",
          "train_embeddings": args.train_embeddings}
    if args.num_layers is not None and args.lora_layers:
        raise ValueError("--num-layers and --lora-layers both choose layers: give one")
    if args.num_layers is not None:
        if args.num_layers == 0 or args.num_layers < -1:
            raise ValueError(f"--num-layers must be -1 (all) or >= 1, got {args.num_layers}")
        kw["layers"] = None if args.num_layers == -1 else ("last", args.num_layers)
    if args.lora_layers:
        items = [x.strip() for x in str(args.lora_layers).split(",")]
        bad = [x for x in items if not x.isdigit()]
        if bad:
            raise ValueError(f"--lora-layers: not a layer index: {', '.join(map(repr, bad))}; give comma-separated "
                             f"layer numbers from 0, e.g. --lora-layers 0,1,2")
        kw["layers"] = [int(x) for x in items]
    if args.lora_targets:
        kw["target_modules"] = lora_targets(args.lora_targets)
    return LoraConfig(**kw)


def parse_args(argv, commands):
    """The parsed command line; `fn` is the function of the chosen command, from `commands`
    ({command name: function}), so that this module needs none of them. A train --config YAML
    file fills in the options the command line leaves out."""
    p = argparse.ArgumentParser(prog="krnl", description="LoRA fine-tuning engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("devices", help="list the devices this build can use, with what each can do, and why any "
                       "other is unavailable here")
    d.add_argument("--json", action="store_true", help="print everything as JSON")
    d.set_defaults(fn=commands["devices"])

    def common(q):
        q.add_argument("--device", default=None, help="cpu, ... (default: best available)")
        q.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"],
                       help="compute dtype (default: the device's compute dtype, see `krnl devices`)")
        q.add_argument("--seed", type=int, default=0)

    def quantize(q):  # train, eval and generate: the base held quantized (QLoRA)
        quantize_arguments(q, "the base's projections, held so in memory (QLoRA; eval and generate need the "
                           "value training used)")

    t = sub.add_parser("train", aliases=["plan"], help="LoRA fine-tune (default: the embedded tiny model and task); "
                       "`plan`: the same options, the memory it needs printed instead (--dry-run)")
    common(t)
    quantize(t)
    t.add_argument("--adapter-path", default="adapters", help="output folder: adapter, checkpoints, metrics")
    t.add_argument("--config", default=None, help="YAML file of train options (flags given on the command line win)")
    t.add_argument("--model", default=None, help="HF or MLX quantized model folder, or GGUF file (default: the "
                   "embedded tiny model)")
    t.add_argument("--data", default=None, help="folder with train.jsonl (and valid.jsonl, test.jsonl)")
    t.add_argument("--max-seq-length", type=int, default=2048)
    t.add_argument("--mask-prompt", action=argparse.BooleanOptionalAction, default=True,
                   help="learn only completions / assistant turns (default: on)")
    t.add_argument("--pack", action="store_true", help="pack short samples into full rows (attention never "
                   "crosses samples); default: length-sorted batches")
    t.add_argument("--iters", type=int, default=1500, help="optimizer steps")
    t.add_argument("--epochs", type=float, default=None, help="passes over the training set (overrides --iters)")
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--grad-accumulation", type=int, default=1)
    t.add_argument("--learning-rate", type=float, default=None, help="default: 3e-3 (LoRA, DoRA); 1e-5 with "
                   "--fine-tune-type full, whose steps move the weights themselves")
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--lr-schedule", default="cosine", choices=["cosine", "linear", "constant"])
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    t.add_argument("--steps-per-eval", type=int, default=100)
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--lora-rank", type=int, default=16)
    t.add_argument("--lora-alpha", type=float, default=32.0)
    t.add_argument("--lora-dropout", type=float, default=0.0)
    t.add_argument("--rslora", action="store_true", help="scale by alpha/sqrt(r) (rsLoRA)")
    t.add_argument("--fine-tune-type", default="lora", choices=["lora", "dora", "full"],
                   help="dora: LoRA plus a trained magnitude per output, PEFT's use_dora; full: the chosen layers' "
                   "projections (--lora-targets) and norms trained themselves, written as an HF folder (mlx-lm's "
                   "names)")
    t.add_argument("--lora-layers", default=None, help="comma-separated layer indices (default: all)")
    t.add_argument("--num-layers", type=int, default=None, help="train the last N layers (mlx-lm's option; -1: all)")
    t.add_argument("--train-embeddings", action="store_true", help="with --fine-tune-type full: the embeddings, an "
                   "untied head and the final norm train too (default: frozen)")
    t.add_argument("--lora-targets", default=None, help="comma-separated modules: short names (q,k,v,o,gate,up,down), module "
                   "names (q_proj) or mlx-lm keys (self_attn.q_proj); mixtures of experts: gate and up are the experts' "
                   "gate_up_proj, router their router (default: all seven; a mixture's router left frozen)")
    t.add_argument("--grad-checkpoint", action="store_true", help="recompute layers in backward (less memory)")
    t.add_argument("--router-aux-loss-coef", type=float, default=0.0,
                   help="mixture-of-experts models: train with this times the load-balancing loss (transformers' "
                        "router_aux_loss_coef with output_router_logits; 0: reported only)")
    t.add_argument("--length-bucket", type=int, default=0, metavar="N",
                   help="pad each batch's length to a multiple of N tokens (default: 256 where the step replays as a "
                   "graph, else no padding)")
    t.add_argument("--no-graphs", action="store_true",
                   help="run every step eagerly (default: record it once per padded length and replay it where the "
                   "device has graphs, see `krnl devices`; grpo: its generation's decoding step too)")
    t.add_argument("--reduce-order", default="auto", choices=["auto", "rows", "sample"],
                   help="how LoRA gradients sum over a batch's rows: sample (per sample in a fixed tree, as a "
                   "data-parallel run's ranks do: one process then gives their adapter), rows (one GEMM over all "
                   "rows), auto (default: sample under an MPI launcher with more than one rank, else rows)")
    optim_args.add_arguments(t)  # --optimizer and its options
    objectives.add_arguments(t)  # --train-mode dpo|orpo|simpo|grpo and their options
    memory.add_arguments(t)  # --dry-run, --max-memory, --fit
    t.add_argument("--train-samples", type=int, default=4000)
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --adapter-path that "
                   "verifies (the run's options must match the checkpoint's; --iters may grow)")
    t.add_argument("--resume-from", default=None, metavar="STEP|PATH",
                   help="continue from the checkpoint of this step in --adapter-path, or at this path (implies --resume)")
    t.add_argument("--resume-override", action="store_true",
                   help="resume even where options differ from the checkpoint's (the new ones apply; a different model "
                   "or LoRA layout stays refused)")
    t.add_argument("--overwrite", action="store_true",
                   help="start a new run in an --adapter-path that holds another run (its checkpoints, metrics and "
                   "adapter are removed)")
    t.add_argument("--adapter-format", default="peft", choices=["peft", "mlx"],
                   help="peft: the PEFT files in --adapter-path; mlx: also mlx-lm's adapters.safetensors and "
                   "adapter_config.json in --adapter-path/mlx, for mlx_lm --adapter-path")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--no-tune", action="store_true", help="do not time the GEMM variants before the first step on a "
                   "GPU that has no tuning yet (see `krnl tune`)")
    t.set_defaults(fn=commands["train"])

    def adapter_and_model(q):  # eval and generate: which adapter, on which base
        q.add_argument("--adapter-path", default=None, help="adapter folder (default: adapters when that folder "
                       "exists, else the base model alone); \"\" for the base model alone")
        q.add_argument("--model", default=None, help="HF or MLX quantized model folder, or GGUF file (default: the "
                       "adapter's base model)")

    e = sub.add_parser("eval", help="test loss of a trained adapter")
    common(e)
    quantize(e)
    adapter_and_model(e)
    e.add_argument("--data", default=None, help="folder with test.jsonl (or valid.jsonl), for HF models")
    e.add_argument("--max-seq-length", type=int, default=2048)
    e.add_argument("--samples", type=int, default=256, help="generated samples (embedded default)")
    e.set_defaults(fn=commands["eval"])

    g = sub.add_parser("generate", help="sample from the model with a trained adapter (KV-cached)")
    common(g)
    quantize(g)
    adapter_and_model(g)
    g.add_argument("--prompt", default="+2c>")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temp", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--raw-prompt", action="store_true",
                   help="send the prompt as is (default: as a user turn of the model's chat template, if any)")
    g.set_defaults(fn=commands["generate"])

    f = sub.add_parser("fuse", help="merge an adapter into its base model and write an HF folder (or, with "
                       "--q-bits, an MLX quantized folder; with --export-gguf, a GGUF file)")
    f.add_argument("--model", default=None, help="the base model's HF or MLX folder, or GGUF file (default: the "
                   "adapter's base model)")
    f.add_argument("--adapter-path", default="adapters", help="adapter folder (PEFT or mlx-lm layout)")
    f.add_argument("--save-path", default="fused_model", help="output folder")
    f.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 2GB, 500MB")
    f.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"],
                   help="output dtype (default: each tensor's stored dtype; bf16 from a quantized base; with "
                   "--q-bits the base's dtype)")
    quantize_arguments(f, "the fused model, written as an MLX folder as mlx_lm.convert -q writes one")
    gguf_arguments(f)
    f.set_defaults(fn=commands["fuse"])

    v = sub.add_parser("serve", help="an OpenAI-compatible server of the model and its adapters (pip install "
                       "'krnl[serve]')")
    common(v)
    quantize(v)
    serve_arguments(v)
    v.set_defaults(fn=commands["serve"])

    z = sub.add_parser("quantize", help="write an HF model folder as an MLX quantized folder (as mlx_lm.convert -q)")
    z.add_argument("--model", required=True, help="the HF folder to quantize (f32, f16 or bf16 weights)")
    z.add_argument("--save-path", default="mlx_model", help="output folder")
    quantize_arguments(z, "the written folder", bits=4, recipes=True, former=("bits", "group_size"))
    z.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"],
                   help="dtype of the scales, biases and unquantized weights (default: the config's torch_dtype, "
                   "else the stored one)")
    z.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 2GB, 500MB")
    z.set_defaults(fn=commands["quantize"])

    w = sub.add_parser("w1", help="train LoRA on the W1 MLP block to match a teacher (a small, real LoRA run)")
    w.add_argument("--device", default=None, help="cpu, ... (default: best available)")
    w.add_argument("--steps", type=int, default=10)
    w.add_argument("--tokens", type=int, default=512)
    w.add_argument("--width", type=int, default=2048)
    w.add_argument("--ffn", type=int, default=5632)
    w.add_argument("--rank", type=int, default=32)
    w.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"],
                   help="compute dtype (default: the device's compute dtype, see `krnl devices`)")
    w.add_argument("--learning-rate", type=float, default=1e-2)
    w.add_argument("--seed", type=int, default=0)
    w.set_defaults(fn=commands["w1"])

    u = sub.add_parser("tune", help="time the GEMM variants on this GPU and keep the fastest per shape class "
                       "(cached per GPU and OS version; train does it once by itself)")
    u.add_argument("--device", default=None, help="a Metal GPU (default: best available)")
    u.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"],
                   help="operand dtype to tune (default: every dtype the device has kernels for)")
    u.add_argument("--repeats", type=int, default=5, help="timed runs per variant and shape class (median)")
    u.set_defaults(fn=commands["tune"])

    k = sub.add_parser("doctor", help="self-test: the device, every op against the CPU, a training run and timings, "
                       "written to a report to attach to an issue (Mac users: please run it)")
    k.add_argument("--device", default=None, help="the device to test (default: best available)")
    k.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"],
                   help="dtype of the timed W1 and QLoRA steps (default: the device's compute dtype)")
    k.add_argument("--quick", action="store_true", help="small sizes and fewer steps (seconds; CI, the simulator)")
    k.add_argument("--only", default=None, metavar="SECTIONS",
                   help="comma-separated sections to run, of compile,ops,training,timing (default: all)")
    k.add_argument("--report", default="krnl-doctor", metavar="PATH",
                   help="the report's path without suffix: PATH.json and PATH.md are written")
    k.set_defaults(fn=commands["doctor"])

    from ..bench.cli import add_arguments as bench_arguments
    b = sub.add_parser("bench", help="krnl next to numpy, PyTorch and MLX on W1/W2/W3 and GEMMs, behind a control gate")
    bench_arguments(b)
    b.set_defaults(fn=commands["bench"])
    for q in (d, t, e, g, f, v, z, w, u, k, b):
        _help_with_defaults(q)
    args = p.parse_args(argv)
    if getattr(args, "config", None):
        t.set_defaults(**yaml_defaults(args.config, t))
        args = p.parse_args(argv)
    for name in ("steps", "tokens", "width", "ffn", "rank", "iters", "batch_size", "grad_accumulation",
                 "lora_rank", "max_tokens", "samples", "train_samples", "repeats"):
        if getattr(args, name, 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "seed", 0) < 0:
        raise SystemExit(f"krnl {args.cmd}: error: --seed must be >= 0, got {args.seed}")
    return args
