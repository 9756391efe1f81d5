"""What makes a configuration a mixture of experts (qwen3_moe, mixtral, olmoe, gpt_oss): their keys of
config.json, read for ModelConfig (config.py), and the names of the experts' LoRA targets. No device code."""

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")
# The LoRA targets of a mixture of experts' layers: attention's, and the experts' two fused weights as
# PEFT's target_parameters name them (gate_up_proj (E, 2F, C), down_proj (E, C, F)).
EXPERT_MODULES = ("gate_up_proj", "down_proj")


def moe_fields(d, get, where):
    """A mixture of experts' keys: {"experts": E, "top_k": K, "expert_size": F (one expert's
    width), "norm_topk": whether the K weights are divided by their sum (Mixtral always),
    "aux_coef": router_aux_loss_coef, "swiglu": (alpha, limit) of the activation (1, 0: plain
    silu(g) u; gpt_oss's clamped form otherwise, ops.swiglu_forward), "bias": whether router and
    experts carry biases (gpt_oss)}. Every layer holds experts (qwen3_moe's mlp_only_layers and
    decoder_sparse_step, dense layers among them, are refused)."""
    mixtral, olmoe, oss = (d.get("model_type") == t for t in ("mixtral", "olmoe", "gpt_oss"))
    # transformers 5 writes num_local_experts for every family (num_experts an alias of it).
    E = get("num_local_experts" if mixtral or oss or d.get("num_experts") is None else "num_experts", int)
    K = get("num_experts_per_tok", int)
    if K > E:
        raise ValueError(f"{where}: num_experts_per_tok ({K}) exceeds the {E} experts")
    if olmoe and d.get("clip_qkv") is not None:
        raise ValueError(f"{where}: clip_qkv {d['clip_qkv']} (q, k and v clamped) is not supported")
    if not mixtral:
        if d.get("mlp_only_layers") or get("decoder_sparse_step", int, default=1) != 1:
            raise ValueError(f"{where}: dense MLP layers among the experts (mlp_only_layers, decoder_sparse_step) "
                             "are not supported")
    # gpt-oss: softmax over the top-K logits, the same weights as top-K probabilities renormalised;
    # transformers 4.55 configs leave swiglu_alpha out (1.702 in its code).
    swiglu = (get("swiglu_alpha", float, default=1.702), get("swiglu_limit", float, default=7.0)) if oss else (1.0, 0.0)
    return {"experts": E, "top_k": K,
            "expert_size": get("intermediate_size" if mixtral or olmoe or oss else "moe_intermediate_size", int),
            "norm_topk": True if mixtral or oss else get("norm_topk_prob", bool, default=False, required=False),
            "aux_coef": get("router_aux_loss_coef", float, default=0.0, required=False, positive=False),
            "swiglu": swiglu, "bias": oss}


def expert_shapes(moe, prefix, C):
    """{name: shape} of a mixture layer's router and fused experts (prefix "model.layers.i.")."""
    E, F = moe["experts"], moe["expert_size"]
    s = {prefix + "mlp.gate.weight": (E, C), prefix + "mlp.experts.gate_up_proj": (E, 2 * F, C),
         prefix + "mlp.experts.down_proj": (E, C, F)}
    if moe["bias"]:  # gpt_oss; gate_up's bias (E, 2F) as its weight's rows: gate's, then up's
        s.update({prefix + "mlp.gate.bias": (E,), prefix + "mlp.experts.gate_up_proj_bias": (E, 2 * F),
                  prefix + "mlp.experts.down_proj_bias": (E, C)})
    return s


def expert_targets(modules):
    """LoRA targets with gate_proj and up_proj as the experts' fused gate_up_proj, whose one LoRA
    PEFT's target_parameters put on both."""
    return tuple(dict.fromkeys("gate_up_proj" if m in ("gate_proj", "up_proj") else m for m in modules))


def lora_shapes(config, module, r):
    """(A, B) shapes of a module's LoRA factors as the model holds them: (r, in) and (out, r); an
    expert module's per expert, (E, r, in) and (E, out, r), gate_up_proj's B as (2, E, F, r): gate's
    and up's rows apart, each a contiguous (E, F, r) (formats.adapter converts to PEFT's layout)."""
    out, inp = config.module_shape(module)
    if not (config.moe and module in EXPERT_MODULES):
        return (r, inp), (out, r)
    E = config.moe["experts"]
    return (E, r, inp), ((2, E, out // 2, r) if module == "gate_up_proj" else (E, out, r))


def router_module(config):
    """The router's module name in transformers' and mlx-lm's files (krnl's own: mlp.gate)."""
    return "router" if config.model_type == "gpt_oss" else "gate"


def switch_module(config):
    """mlx-lm's module of a mixture's 3-D experts (its SwitchGLU)."""
    return "experts" if config.model_type == "gpt_oss" else "switch_mlp"
