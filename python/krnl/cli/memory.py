"""krnl train's memory options: `--dry-run` (and `krnl plan`, the same command line) prints what
the run will hold in the device's pool, part by part, and whether it fits the device's budget;
`--max-memory SIZE` and `--fit` (SIZE = that budget) choose gradient checkpointing, smaller
micro-batches (accumulated: the global batch stays) and smaller loss chunks until the estimate
fits, say so, and cap the pool at SIZE. The estimate is krnl.train.memory's, from the model's
config and the data's longest row; no weight is read."""

import ctypes
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from ..models.config import ModelConfig
from ..quant.qweight import QuantizedWeight
from ..train import memory
from ..train.dist.ranks import reduce_order
from ..train.dist.world import World
from ..train.step import padded_length
from ..train.trainer import REPLAY_BUCKET
from . import objectives


def add_arguments(t):
    g = t.add_argument_group("memory (README 'Memory'; `krnl plan ...` is train --dry-run)")
    g.add_argument("--dry-run", action="store_true", help="print the memory the run needs by part and whether it "
                   "fits the device (CPU: available RAM; CUDA: free memory; Metal: its working set); train nothing")
    g.add_argument("--max-memory", default=None, metavar="SIZE", help="fit the run in SIZE (e.g. 8GB, 512MB, powers "
                   "of 1024): gradient checkpointing, then smaller micro-batches with accumulation (the global "
                   "batch kept), then smaller loss chunks, as needed; the device's pool is capped at SIZE")
    g.add_argument("--fit", action="store_true", help="--max-memory of the device's budget (as --dry-run reports it)")


def budget(dev):
    """(bytes or None, where the number comes from): the pool's limit where one is set (Metal's
    default: the GPU's recommended working set), else the CPU's available RAM or the CUDA GPU's
    free memory as the driver reports it; None where the device reports nothing."""
    lim = dev.memory_limit
    if lim["bytes"]:
        return lim["bytes"], lim["origin"]
    caps = dev.capabilities()
    if caps["kind"] == "cpu":
        return _available_ram()
    if caps["kind"] == "cuda":
        free = _cuda_free(int(caps["details"].get("device", 0)))
        return (free, "the GPU's free memory, cuMemGetInfo") if free else (None, "the CUDA driver did not say")
    return None, f"{caps['kind']} reports no memory budget"


def _available_ram():
    try:
        import psutil  # optional: where installed, it knows every OS
        return psutil.virtual_memory().available, "available RAM (psutil)"
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available RAM, /proc/meminfo"
    except OSError:
        pass
    return None, "no /proc/meminfo (pip install psutil to read the available RAM)"


def _cuda_free(ordinal):
    """Free bytes on CUDA device `ordinal`, from the driver (the primary context, which krnl's
    backend uses too, made current for the call); None where the driver cannot be asked."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if cu.cuInit(0) or cu.cuDeviceGet(ctypes.byref(dev), ordinal):
            return None
        if cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
            return None
        try:
            if cu.cuCtxPushCurrent_v2(ctx):
                return None
            ok = cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
            return free.value if ok else None
        finally:
            cu.cuDevicePrimaryCtxRelease_v2(dev)
    except (OSError, AttributeError):
        return None


def wanted(args):
    return args.cmd == "plan" or args.dry_run or args.fit or args.max_memory is not None


def model_config(args):
    """(ModelConfig, an MLX folder's (bits, group_size) or None, a note) of --model, weights unread."""
    if not args.model:
        from ..train.default_task import CharTokenizer, tiny_config
        return ModelConfig.from_dict(tiny_config(CharTokenizer().vocab_size), source="<embedded default>"), None, ""
    from ..formats.gguf.file import is_gguf
    if is_gguf(args.model):
        from ..formats.gguf.file import read_gguf
        return read_gguf(args.model).config, None, "; GGUF weights counted dense in the compute dtype"
    from ..formats.hf import read_config
    from ..formats.mlx_folder import quantization
    from ..io.fileio import read_json_object
    q = quantization(read_json_object(Path(args.model) / "config.json", "hf"), args.model)
    return read_config(args.model), (q["bits"], q["group_size"]) if q else None, ""


def sft_data(args, vocab_size, tok=None):
    """--data's splits, read once whoever asks first (the plan, then the run); tok: the run's
    tokenizer, else --model's is read where the data is not loaded yet."""
    if getattr(args, "loaded_data", None) is None:
        from ..formats.hf import load_tokenizer
        from ..train.data import load_dataset
        tok = tok or load_tokenizer(args.model)
        args.loaded_data = load_dataset(args.data, tok, args.max_seq_length, mask_prompt=args.mask_prompt,
                                        pack=args.pack, vocab_size=vocab_size)
    return args.loaded_data


def longest(args, config):
    """(T, what it is): the longest row the run pads a batch to."""
    if not args.model:
        from ..train.default_task import CharTokenizer, make_split
        return make_split(CharTokenizer(), 1, 0)[0].shape[1], "the embedded task's rows"
    if args.pack:
        return args.max_seq_length, "--pack's rows of --max-seq-length"
    grpo = args.train_mode == "grpo"
    if not args.data:
        if grpo:
            return (min(args.max_seq_length + args.max_completion_length, config.max_position_embeddings),
                    "--max-seq-length and --max-completion-length, the worst case")
        return args.max_seq_length, "--max-seq-length, the worst case"
    if args.train_mode != "sft":
        from ..formats.hf import load_tokenizer
        split = objectives.mode_split(args, load_tokenizer(args.model), config.vocab_size)
        return objectives.longest(args, split, config.max_position_embeddings)
    train = sft_data(args, config.vocab_size)["train"]
    return max(len(s) for s in train.samples), f"the longest sample of {train.path}"


def graph_lengths(args, run, config):
    """The padded lengths --data's rows come to where steps replay as graphs: a graph each (at
    most; a batch pads to its longest row). The plan is the longest's."""
    if not (run.replay and args.model and args.data and not args.pack):
        return []
    train = sft_data(args, config.vocab_size)["train"]
    bucket = args.length_bucket or REPLAY_BUCKET
    return sorted({padded_length(len(s), bucket, config.max_position_embeddings) for s in train.samples})


def run_of(args, dev, lora, config, T, quantize, file_q, world=None):
    """The memory.Run of the command line on `dev` (one rank's of `world`'s, where one is given)."""
    world = world or World()
    cfg = SimpleNamespace(reduce_order=getattr(args, "reduce_order", "auto"), train_mode=args.train_mode)
    traits = memory.Traits.of(dev)
    if args.no_graphs:  # no step recorded, GRPO's decoding steps neither
        traits = replace(traits, graphs=False)
    replay = traits.graphs and args.train_mode == "sft"  # as Trainer decides
    mode = objectives.memory_fields(args)
    batch = objectives.prompts_per_batch(args) if mode.get("objective") == "grpo" else args.batch_size
    Tp = padded_length(T, args.length_bucket or (REPLAY_BUCKET if replay else 1),
                       config.max_position_embeddings)
    return memory.Run(config, replace(lora), args.dtype, quantize=quantize, file_quantized=file_q,
                      batch=batch, seq=Tp, grad_checkpoint=args.grad_checkpoint,
                      micro_batches=args.grad_accumulation, packed=args.pack, device=traits,
                      ce_chunk=getattr(args, "ce_chunk", None), optimizer=getattr(args, "optimizer", "adamw"),
                      min_8bit_size=getattr(args, "min_8bit_size", 4096),
                      momentum=getattr(args, "momentum", None) or 0.0, ranks=world.size,
                      sample_order=reduce_order(cfg, world) == "sample" and not lora.full, replay=replay, **mode)


def before_load(args, dev, lora, quantize, world=None):
    """krnl plan / --dry-run: prints the plan, returns the exit status. --fit / --max-memory:
    applies the first choice that fits (args' batch size, accumulation, checkpointing and
    args.ce_chunk), caps the pool, returns None; ValueError where nothing fits."""
    config, file_q, note = model_config(args)
    T, where = longest(args, config)
    run = run_of(args, dev, lora, config, T, quantize, file_q, world)
    est = memory.estimate(run)
    limit, origin = budget(dev)
    if args.max_memory is not None:
        dev.set_memory_limit(args.max_memory)  # reads SIZE as KRNL_MAX_MEMORY does (one-line errors)
        limit, origin = dev.memory_limit["bytes"], f"--max-memory {args.max_memory}"
    held = dev.pool_stats()["reserved"]
    if held and limit is not None and dev.memory_limit["bytes"]:  # a pool limit counts what it holds already
        limit, origin = max(limit - held, 0), f"{origin}, less {memory.size_text(held)} the pool holds"
    name = Path(args.model).name if args.model else "the embedded tiny Llama"
    kind = "full fine-tuning" if lora.full else f"LoRA r={lora.r}"
    n, noun = memory.batch_size(run)
    rows = f"{run.batch * run.rows_per_item}"
    if noun != "rows":
        rows += f" rows ({n} {noun}{f' of {run.batch} prompts' if noun == 'completions' else ''})"
    share = -(-run.batch // run.ranks) * run.rows_per_item  # the plan is a rank's: its share of a micro-batch
    ranks = f", {share} rows on each of {run.ranks} ranks" if run.ranks > 1 else ""
    head = (f"memory plan on {dev.name}: {name} ({config.num_hidden_layers} layers, hidden {config.hidden_size}), "
            f"{args.dtype}, {kind}; {rows} x {run.seq} tokens a micro-batch ({where}){ranks}, "
            f"{run.micro_batches} a step{', checkpointed' if run.grad_checkpoint else ''}"
            f"{', in the sample reduce order' if run.sample_order else ''}{note}")
    dry = args.cmd == "plan" or args.dry_run
    lengths = graph_lengths(args, run, config)
    if dry:
        print(head)
        print("\n".join(est.table(limit, origin)))
    if len(lengths) > 1:  # README 'Memory': each new length records a graph beside the others
        print(f"memory: the rows pad to up to {len(lengths)} lengths ({lengths[0]} to {lengths[-1]} tokens), each "
              f"recorded as a graph of its own, so the run can need more than this plan; --pack or --no-graphs "
              f"keep it at the plan")
    if not (args.fit or args.max_memory is not None):
        return 0
    if limit is None:
        raise ValueError(f"[memory] --fit: {origin}; give --max-memory SIZE")
    chosen, ok = memory.fit(run, limit)
    if not ok:
        raise ValueError(f"[memory] nothing fits {memory.size_text(limit)} ({origin}): the smallest choice "
                         f"({memory.describe(chosen.run, run)}) needs {memory.size_text(chosen.total)}; lower "
                         f"--max-seq-length or --batch-size, or quantize the base (--q-bits 4)")
    c = chosen.run
    print(f"memory: {memory.describe(c, run)} fits {memory.size_text(limit)} ({origin}): "
          f"{memory.size_text(chosen.total)} estimated")
    if dry:
        print("\n".join(chosen.table(limit, origin)))
        return 0
    args.grad_checkpoint, args.grad_accumulation = c.grad_checkpoint, c.micro_batches
    args.batch_size = memory.batch_size(c)[0]
    args.ce_chunk = c.ce_chunk
    if args.max_memory is None:
        dev.set_memory_limit(limit + held)
    return None


def summary(est, dev):
    """One line of an Estimate: the peak, its largest parts and whether it fits the device's budget."""
    limit, origin = budget(dev)
    parts = sorted(((n, k) for k, n in est.parts.items() if n), reverse=True)[:4]
    fits = "" if limit is None else f"; {'fits' if est.total <= limit else 'does NOT fit'} {memory.size_text(limit)} " \
        f"({origin})"
    return (f"{memory.size_text(est.total)} estimated at the peak (" + ", ".join(
        f"{memory.PARTS[k]} {memory.size_text(n)}" for n, k in parts) + f"){fits}; `krnl plan` for every part")


def after_load(args, dev, model, train, world=None):
    """The run's Estimate (for the out-of-memory line), from the loaded model and its data; sets
    the model's loss chunk where --fit chose one."""
    if getattr(args, "ce_chunk", None):
        model.ce_chunk = int(args.ce_chunk)
    if args.train_mode != "sft":
        split = train.items if args.train_mode == "grpo" else {"train": train}  # PromptBatches, PairSplit
        T = objectives.longest(args, split, model.config.max_position_embeddings)[0]
    elif hasattr(train, "samples"):
        T = args.max_seq_length if args.pack else max(len(s) for s in train.samples)
    elif isinstance(train, tuple):
        T = train[0].shape[1]
    else:
        T = args.max_seq_length
    qkv = model.layers[0].qkv if model.layers else None
    q = (qkv.bits, qkv.group_size, qkv.mode) if isinstance(qkv, QuantizedWeight) and not model.quantize else None
    fq = (model.embed.bits, model.embed.group_size) if isinstance(model.embed, QuantizedWeight) else None
    run = run_of(args, dev, model.lora_config, model.config, T, model.quantize or q, fq, world)
    try:
        return memory.estimate(replace(run, ce_chunk=model.ce_chunk))
    except Exception as e:  # noqa: BLE001 (a layout the replay does not know must not stop the run)
        print(f"memory estimate unavailable ({type(e).__name__}: {e}); training without it", file=sys.stderr)
        return None
