"""What makes a configuration a mixture of experts (qwen3_moe, mixtral, olmoe): their keys of config.json,
read for ModelConfig (config.py), and the names of the experts' LoRA targets. No device code."""

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe")
# The LoRA targets of a mixture of experts' layers: attention's, and the experts' two fused weights as
# PEFT's target_parameters name them (gate_up_proj (E, 2F, C), down_proj (E, C, F)).
EXPERT_MODULES = ("gate_up_proj", "down_proj")


def moe_fields(d, get, where):
    """A mixture of experts' keys: {"experts": E, "top_k": K, "expert_size": F (one expert's
    width), "norm_topk": whether the K weights are divided by their sum (Mixtral always),
    "aux_coef": router_aux_loss_coef}. Every layer holds experts (qwen3_moe's mlp_only_layers and
    decoder_sparse_step, dense layers among them, are refused)."""
    mixtral, olmoe = d.get("model_type") == "mixtral", d.get("model_type") == "olmoe"
    # transformers 5 writes num_local_experts for every family (num_experts an alias of it).
    E = get("num_local_experts" if mixtral or d.get("num_experts") is None else "num_experts", int)
    K = get("num_experts_per_tok", int)
    if K > E:
        raise ValueError(f"{where}: num_experts_per_tok ({K}) exceeds the {E} experts")
    if olmoe and d.get("clip_qkv") is not None:
        raise ValueError(f"{where}: clip_qkv {d['clip_qkv']} (q, k and v clamped) is not supported")
    if not mixtral:
        if d.get("mlp_only_layers") or get("decoder_sparse_step", int, default=1) != 1:
            raise ValueError(f"{where}: dense MLP layers among the experts (mlp_only_layers, decoder_sparse_step) "
                             "are not supported")
    return {"experts": E, "top_k": K,
            "expert_size": get("intermediate_size" if mixtral or olmoe else "moe_intermediate_size", int),
            "norm_topk": True if mixtral else get("norm_topk_prob", bool, default=False, required=False),
            "aux_coef": get("router_aux_loss_coef", float, default=0.0, required=False, positive=False)}


def expert_shapes(moe, prefix, C):
    """{name: shape} of a mixture layer's router and fused experts (prefix "model.layers.i.")."""
    E, F = moe["experts"], moe["expert_size"]
    return {prefix + "mlp.gate.weight": (E, C), prefix + "mlp.experts.gate_up_proj": (E, 2 * F, C),
            prefix + "mlp.experts.down_proj": (E, C, F)}


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
