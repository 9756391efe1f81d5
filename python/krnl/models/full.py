"""Full fine-tuning (mlx-lm's --fine-tune-type full): the chosen layers' weights trained themselves,
no LoRA factors. They live in one FlatParams under their HF names (f32 masters, gradients and
optimizer state; the working copy in the compute dtype is what the layers compute with), so the
optimizer, clipping, checkpoints, resume and data parallel treat them as they treat LoRA factors.

Trained per chosen layer (LoraConfig.layers, default all): the target projections' weights and
biases, and the layer's RMSNorm weights (input, post-attention, qwen3's and olmoe's q/k norms);
with train_embeddings also the embedding table, an untied head and the final norm (end_names).
Gemma's norms, which the model holds as 1 + w, stay frozen, as do a mixture's router and experts.
Layout: the table first, then per layer in the order the layer reads them its norms, q|k|v
weights side by side (the fused projection reads them as one tensor), their biases side by side,
o, gate|up, down, then the final norm and the head; no weight is copied."""

from .. import _core
from .config import ALL_MODULES, QKV_MODULES, module_part
from .params import FlatParams
from ..quant.qweight import QuantizedArray, RowStack

ops = _core.ops

# The layer's norms a full fine-tune trains: {Layer attribute: the HF name's tail}; the q/k norms
# where the family has them.
NORMS = {"n1": "input_layernorm", "n2": "post_attention_layernorm"}
QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def weight_name(layer, module, what="weight"):
    return f"model.layers.{layer}.{module_part(module)}.{module}.{what}"


def norm_names(config, layer):
    """{Layer attribute: HF name} of the norms trained in `layer` (none for Gemma's 1 + w)."""
    if config.gemma:
        return {}
    out = {a: f"model.layers.{layer}.{n}.weight" for a, n in NORMS.items()}
    if config.qk_norm or config.qk_full_norm:
        out.update({a: f"model.layers.{layer}.{n}.weight" for a, n in QK_NORMS.items()})
    return out


def bias_modules(config, modules):
    """The trained projections that have a bias."""
    with_bias = QKV_MODULES + (("o_proj",) if config.o_proj_bias else ()) if config.attention_bias else ()
    return [m for m in modules if m in with_bias]


def end_names(config, lora_config):
    """{what: HF name} of the tensors outside the layers that train with train_embeddings: the
    embedding table, an untied head and the final norm (not Gemma's 1 + w)."""
    if not lora_config.train_embeddings:
        return {}
    out = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight", "norm": "model.norm.weight"}
    if config.tie_word_embeddings:
        del out["head"]
    if config.gemma:
        del out["norm"]
    return out


def full_param_shapes(config, lora_config):
    """({HF name: shape} in FlatParams' layout order, the set of trained (layer, module) pairs)."""
    shapes, trained, out = config.weight_shapes(), set(), {}
    ends = end_names(config, lora_config)
    if "embed" in ends:
        out[ends["embed"]] = shapes[ends["embed"]]
    mods = [m for m in ALL_MODULES if m in lora_config.target_modules]
    biased = bias_modules(config, mods)
    for i in lora_config.adapted_layers(config):
        for name in norm_names(config, i).values():
            out[name] = shapes[name]
        for group in (QKV_MODULES, ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)):
            for m in (m for m in group if m in mods):
                out[weight_name(i, m)] = config.module_shape(m)
                trained.add((i, m))
            for m in (m for m in group if m in biased):
                out[weight_name(i, m, "bias")] = (config.module_shape(m)[0],)
    out.update({ends[k]: shapes[ends[k]] for k in ("norm", "head") if k in ends})
    return out, trained


def init_full(device, config, lora_config, dtype, weights, quantize=None):
    """The trained weights of a full fine-tune as one FlatParams (full_param_shapes' layout) holding
    their base values; also the set of trained (layer, module) pairs. A quantized weight cannot
    train: a ValueError names it."""
    shapes, trained = full_param_shapes(config, lora_config)
    held = [k for k in shapes if isinstance(weights[k], QuantizedArray)]
    if held or quantize is not None:
        what = f"{held[0]} is stored quantized" if held else "--q-bits quantizes the base on load"
        raise ValueError(f"[full] full fine-tuning trains the weights themselves, in the compute dtype: {what}; "
                         "start from a float (f32/f16/bf16) base, or train LoRA (QLoRA) on this one")
    params = FlatParams(device, shapes, dtype)
    if shapes:
        params.load({k: weights[k] for k in shapes})
    return params, trained


class Trained:
    """What the layers of a full fine-tune read: each trained tensor's working view and f32 gradient."""

    def __init__(self, params):
        self.params = params

    def has(self, name):
        return name in self.params.shapes

    def weight(self, name):
        return self.params.compute(name)

    def grad(self, name):
        return self.params.grad(name)

    def stacked(self, names):
        """(working, grad) views of names' tensors as one, where they lie side by side in this order
        (the q|k|v weights, (QKV, C); their biases, (1, QKV)); else None."""
        p = self.params
        if not all(n in p.shapes for n in names):
            return None
        if all(len(p.shapes[n]) == 2 for n in names):
            return p.rows(names)
        return p.joined(names, (1, sum(p.offsets[n][1] for n in names)))


def tensor(trained, names, frozen):
    """(the tensor a layer computes with, its f32 gradient) of names' tensors stacked by rows, one
    or more of them trained: the working view (and the gradient's) where all train side by side;
    else for the q|k|v weights a RowStack of trained views and frozen(name) uploads, whose
    gradients the linears hold (gradient None), and for their biases the list of each one's (1, n)
    and the list of its gradient or None."""
    if len(names) == 1:
        return trained.weight(names[0]), trained.grad(names[0])
    both = trained.stacked(names)
    if both is not None:
        return both
    parts = [trained.weight(n) if trained.has(n) else frozen(n) for n in names]
    if len(parts[0].shape) == 2:
        return RowStack(parts), None
    return [p.reshape(1, p.shape[0]) if trained.has(n) else p for p, n in zip(parts, names)], \
        [trained.grad(n) if trained.has(n) else None for n in names]


def layer_grads(L, xn, dqkv, dys, do):
    """The gradients of a layer's trained q/k/v weights and biases and o's bias, from xn (N, C) (their
    input), dqkv (N, QKV), its column blocks dys and do (N, C), the gradient at o_proj's output. (o,
    gate, up and down's weights: their linears' backward; the norms: rmsnorm_backward's dw.)"""
    g, beta = L.grads, L.q_proj.grad_beta
    if "qkv" in g:                                                        # one GEMM for the three
        L.q_proj.sums.weight_grad(dqkv, xn, g["qkv"], 1.0, beta)
    else:
        for (lin, _, _), dy in zip(L.qkv_blocks(), dys):
            if lin.gW is not None:
                lin.weight_grad(dy, xn)
    bias = g.get("qkv_bias")
    for dy, gb in [(dqkv, bias)] if not isinstance(bias, list) else zip(dys, bias):
        if gb is not None:                                                # the sum over rows: 1^T dy
            ops.gemm(L.ones(dy.shape[0]), dy, gb.reshape(1, dy.shape[1]), trans_a=True, beta=beta)
    if "o_bias" in g:
        ops.gemm(L.ones(do.shape[0]), do, g["o_bias"].reshape(1, do.shape[1]), trans_a=True, beta=beta)


def add_bias(L, y):
    """y (N, QKV) += the q, k and v biases: one (1, QKV) tensor, or full.tensor's list of three."""
    b, ones = L.qkv_bias, L.ones(y.shape[0])
    for part, (_, c0, c1) in zip(b, L.qkv_blocks()) if isinstance(b, list) else [(b, (None, 0, y.shape[1]))]:
        ops.gemm(ones, part, y[:, c0:c1], beta=1.0)


def end_tensors(trained, config, lora_config):
    """{"embed", "head", "norm": working view} of the tensors outside the layers that train
    (end_names), {} where none does (a tied head is the table: LlamaModel takes it so)."""
    if trained is None:
        return {}
    return {k: trained.weight(n) for k, n in end_names(config, lora_config).items()}


def end_grads(trained, config, lora_config):
    """{"embed", "head", "norm": f32 gradient} of end_tensors (a tied head's is the table's), or None."""
    names = end_names(config, lora_config) if trained is not None else {}
    if not names:
        return None
    grads = {k: trained.grad(n) for k, n in names.items()}
    grads.setdefault("head", grads["embed"])
    return grads


def head_grad(grads, dl, xn):
    """The head's gradient (V, C) (+)= dl^T xn over one chunk of rows (dlogits already scaled)."""
    ops.gemm(dl, xn, grads["head"], trans_a=True, beta=1.0)


def embed_grad(model, ids, dx):
    """The table's gradient (+)= its rows' scatter of dx (N, C), the gradient at the embeddings'
    output (times Gemma's sqrt(C) scale, which the forward applies to them)."""
    C = model.config.hidden_size
    dout = dx[:, :C]
    if model.embed_scale is not None:
        dout = model.dev.empty((dx.shape[0], C), dx.dtype)
        ops.scale(dx[:, :C], model.embed_scale, dout)
    ops.embedding_backward(ids, dout, model.end_grads["embed"])
    model.d_embed_out = None  # read here only: not held until the next call
