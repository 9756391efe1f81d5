"""What makes a configuration a mixture of experts (qwen3_moe, mixtral): their keys of config.json,
read for ModelConfig (config.py), and the names of the experts' LoRA targets. No device code."""

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
# The LoRA targets of a mixture of experts' layers: attention's, and the experts' two fused weights as
# PEFT's target_parameters name them (gate_up_proj (E, 2F, C), down_proj (E, C, F)).
EXPERT_MODULES = ("gate_up_proj", "down_proj")


def moe_fields(d, get, where):
    """A mixture of experts' keys: {"experts": E, "top_k": K, "expert_size": F (one expert's
    width), "norm_topk": whether the K weights are divided by their sum (Mixtral always),
    "aux_coef": router_aux_loss_coef}. Every layer holds experts (qwen3_moe's mlp_only_layers and
    decoder_sparse_step, dense layers among them, are refused)."""
    mixtral = d.get("model_type") == "mixtral"
    # transformers 5 writes num_local_experts for every family (num_experts an alias of it).
    E = get("num_local_experts" if mixtral or d.get("num_experts") is None else "num_experts", int)
    K = get("num_experts_per_tok", int)
    if K > E:
        raise ValueError(f"{where}: num_experts_per_tok ({K}) exceeds the {E} experts")
    if not mixtral:
        if d.get("mlp_only_layers") or get("decoder_sparse_step", int, default=1) != 1:
            raise ValueError(f"{where}: dense MLP layers among the experts (mlp_only_layers, decoder_sparse_step) "
                             "are not supported")
    return {"experts": E, "top_k": K,
            "expert_size": get("intermediate_size" if mixtral else "moe_intermediate_size", int),
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
