"""The README's 'Memory' table: krnl's estimate (krnl.train.memory) of the device memory a LoRA run
of common models takes, from their config.json numbers written out below (no download). LoRA
r=16 on all seven projections, bf16, batch 1, AdamW, on a CUDA GPU with fused attention (cuDNN);
the materialised attention of a device without it adds the (heads, T, T) scores of every layer.

    python dev/memory_table.py    # prints the table; tests/test_memory.py checks the README has it
"""

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from krnl.models.config import LoraConfig, ModelConfig  # noqa: E402
from krnl.train import memory  # noqa: E402

# config.json's numbers (vocab, hidden, intermediate, layers, heads, KV heads, head dim, tied head)
MODELS = {
    "Qwen2.5-0.5B": ("qwen2", 151936, 896, 4864, 24, 14, 2, 64, True, True),
    "Llama-3.2-1B": ("llama", 128256, 2048, 8192, 16, 32, 8, 64, True, False),
    "Llama-3.2-3B": ("llama", 128256, 3072, 8192, 28, 24, 8, 128, True, False),
    "Mistral-7B-v0.3": ("mistral", 32768, 4096, 14336, 32, 32, 8, 128, False, False),
    "Qwen2.5-7B": ("qwen2", 152064, 3584, 18944, 28, 28, 4, 128, False, True),
    "Llama-3.1-8B": ("llama", 128256, 4096, 14336, 32, 32, 8, 128, False, False),
    "Qwen3-8B": ("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, False, False),
}
LENGTHS = (512, 2048, 8192)
VARIANTS = (("bf16", None, False), ("bf16 + ckpt", None, True), ("4-bit + ckpt", (4, 64), True))


def config(name):
    kind, V, C, F, L, H, Hk, D, tied, bias = MODELS[name]
    return ModelConfig.from_dict(dict(model_type=kind, vocab_size=V, hidden_size=C, intermediate_size=F,
                                      num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=Hk, head_dim=D,
                                      tie_word_embeddings=tied, attention_bias=bias, max_position_embeddings=131072))


def table():
    """The markdown table: one row per model, one column per (variant, length), in GiB."""
    head = ["model"] + [f"{v}, {T // 1024}K" if T >= 1024 else f"{v}, {T}" for v, _, _ in VARIANTS for T in LENGTHS]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lora = LoraConfig(r=16, alpha=32)
    for name in MODELS:
        base = memory.Run(config(name), lora, "bf16", batch=1, device=memory.CUDA)
        cells = [f"{memory.estimate(replace(base, seq=T, quantize=q, grad_checkpoint=gc)).total / 2**30:.1f}"
                 for _, q, gc in VARIANTS for T in LENGTHS]
        rows.append("| " + " | ".join([name] + cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
