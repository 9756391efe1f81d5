"""Tiny HF folders of every family krnl exports to GGUF (test_gguf_export.py), built without torch:
random weights at sizes that give spread-out logits, tokenizers llama.cpp's vocabulary loader
accepts (byte-level BPE trained here with the tokenizers library, split by llama3's, qwen2's,
GPT-2's or gpt-4o's regex; SentencePiece-style BPE with byte fallback, as krnl's GGUF tokenizer
builds one from pieces and scores, with or without the space prefix), chat templates, and PEFT
adapters whose B factors are off zero."""

import json
from pathlib import Path

import numpy as np

CORPUS = ["The quick brown fox jumps over the lazy dog. Hello world, hello there!",
          "Numbers like 12345 and 2024 appear in text; the model reads 3 or 33 of them.",
          "Training a small model: the loss falls, the tokens repeat, the world is large.",
          "She said: 'I've been told he's there, we'll see.' They're sure it's fine.",
          "def hello(name):\n    return 'hello ' + name\n\nprint(hello('world'))",
          "A tokenizer splits text into pieces; pieces merge into tokens, tokens into words."]
PROMPT = "Hello world, the tokenizer reads 12345 words: café naïve <think>yes"
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
# <|endoftext|>: llama.cpp's vocabulary loader looks it up in a file whose general.name says phi3
SPM_SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
         "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
         "<start_of_turn>model\n{% endif %}")
PHI3 = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")

BASE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
_ALT = ["sliding_attention", "full_attention"]
# family: (config keys over BASE, tokenizer (kind, pre-tokenizer or space prefix), chat template, extra rows)
FAMILIES = {
    "llama": (dict(model_type="llama", num_hidden_layers=4, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), ("bpe", "llama3"), LLAMA3, 0),
    "mistral": (dict(model_type="mistral", num_hidden_layers=3), ("spm", True), MISTRAL, 0),
    "qwen2": (dict(model_type="qwen2", tie_word_embeddings=True), ("bpe", "qwen2"), CHATML, 3),
    "qwen3": (dict(model_type="qwen3", head_dim=32), ("bpe", "qwen2"), CHATML, 0),
    "gemma2": (dict(model_type="gemma2", tie_word_embeddings=True, query_pre_attn_scalar=64, sliding_window=4,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, layer_types=_ALT * 2,
                    num_hidden_layers=4), ("spm", False), GEMMA, 0),
    "gemma3": (dict(model_type="gemma3_text", tie_word_embeddings=True, query_pre_attn_scalar=64, sliding_window=4,
                    num_hidden_layers=3, layer_types=["sliding_attention"] * 2 + ["full_attention"],
                    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                    rope_scaling={"rope_type": "linear", "factor": 2.0}), ("spm", False), GEMMA, 0),
    "phi3": (dict(model_type="phi3", original_max_position_embeddings=256), ("spm", True), PHI3, 0),
    "qwen3_moe": (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                       norm_topk_prob=True), ("bpe", "qwen2"), CHATML, 0),
    "mixtral": (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=256),
                ("spm", True), MISTRAL, 0),
    "olmoe": (dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=256,
                   num_key_value_heads=4, norm_topk_prob=False), ("bpe", "gpt-2"), CHATML, 0),
    "gpt_oss": (dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, intermediate_size=256,
                     sliding_window=4, layer_types=_ALT, attention_bias=True, rope_theta=150000.0,
                     rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                                   "beta_fast": 32.0, "beta_slow": 1.0}), ("bpe", "gpt-4o"), CHATML, 0),
}


def train_merges(words, n):
    """n BPE merges learned from `words` (each a list of symbols), deterministically: the most
    frequent adjacent pair first, ties by the pair (the tokenizers library's trainer breaks ties by
    hash order, so its vocabulary changes from run to run)."""
    from collections import Counter

    words, merges = [list(w) for w in words], []
    for _ in range(n):
        counts = Counter(p for w in words for p in zip(w, w[1:]))
        if not counts:
            break
        a, b = min(counts, key=lambda p: (-counts[p], p))
        merges.append((a, b))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    return merges


def bpe_tokenizer(pre):
    """(tokenizers.Tokenizer, tokenizer_config) of a byte-level BPE learned from CORPUS, split by
    `pre`'s regex (krnl's table of llama.cpp's names; "gpt-2": ByteLevel's own regex)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    from krnl.formats.gguf.tokenizer import SPLITS

    if pre == "gpt-2":
        split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                                         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    words = [w for text in CORPUS for w, _ in split.pre_tokenize_str(text)]
    merges = train_merges(words, 160)
    tokens = BPE_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges]
    tk = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tk.pre_tokenizer, tk.decoder = split, decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BPE_SPECIALS])
    tk.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    config = {"eos_token": "<|im_end|>"}
    if pre == "llama3":  # Llama 3: BOS from the post-processor, turns end with <|eot_id|>
        bos = "<|begin_of_text|>"
        tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                          special_tokens=[(bos, tk.token_to_id(bos))])
        config = {"bos_token": bos, "eos_token": "<|eot_id|>"}
    return tk, config


def spm_tokenizer(space_prefix):
    """(tokenizers.Tokenizer, tokenizer_config) of a SentencePiece-style vocabulary: <unk> <s> </s>,
    the 256 <0xNN> byte tokens, the characters and pieces learned from CORPUS (scored by their
    order), control tokens and one user-defined token, built as krnl builds a GGUF file's 'llama'
    tokenizer."""
    from tokenizers import pre_tokenizers

    from krnl.formats.gguf.tokenizer import build_tokenizer

    split = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    words = [w for text in CORPUS for w, _ in split.pre_tokenize_str(text)]
    pieces = sorted({c for w in words for c in w}) + [a + b for a, b in train_merges(words, 160)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + SPM_SPECIALS + ["<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3] * len(SPM_SPECIALS) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * (len(SPM_SPECIALS) + 1)
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": space_prefix}
    return build_tokenizer(md)


PAD = {"phi3": "<|endoftext|>"}  # Phi-3 pads with it (transformers' GGUF loader needs a pad id in range)


def make_folder(root, family, seed=0, name=None, **overrides):
    """Writes the tiny HF folder of `family` (config keys `overrides` over FAMILIES') under
    root/name (default: the family); returns it."""
    from safetensors.numpy import save_file

    from krnl.formats.gguf.tokenizer import tokenizer_files
    from krnl.formats.gpt_oss import stored_layout
    from krnl.models.config import ModelConfig, random_weights

    keys, (kind, arg), template, extra = FAMILIES[family]
    tk, tconfig = bpe_tokenizer(arg) if kind == "bpe" else spm_tokenizer(arg)
    if family in PAD:
        tconfig = {**tconfig, "pad_token": PAD[family]}
    folder = Path(root) / (name or family)
    folder.mkdir(parents=True)
    files = tokenizer_files(tk, {**tconfig, "chat_template": template})
    for name, data in files.items():
        (folder / name).write_bytes(data)
    cfg = {**BASE, **keys, "vocab_size": tk.get_vocab_size(with_added_tokens=True) + extra, **overrides}
    (folder / "config.json").write_text(json.dumps(cfg))
    config = ModelConfig.from_dict(cfg)
    weights = random_weights(config, seed=seed, std=0.06)
    for k in [k for k in weights if k.endswith("mlp.gate.weight")]:  # decisive routing: rounding flips no expert
        weights[k] = weights[k] * np.float32(4.0)
    if config.gemma:  # Gemma scales by 1 + w: norms near 0
        weights = {k: (v - 1.0 if k.endswith("norm.weight") else v) for k, v in weights.items()}
    stored = {}
    for k, v in weights.items():  # gpt-oss's in transformers' layout
        name, _, relay = stored_layout(config, k, v.shape) or (k, None, lambda a: a)
        stored[name] = np.ascontiguousarray(relay(v))
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def make_adapter(folder, out, seed=1, r=4):
    """A PEFT adapter on every module of the folder's family (B off zero); returns its folder."""
    import krnl
    from krnl.formats import adapter as adapter_io
    from krnl.formats.hf import load_model
    from krnl.models.config import LoraConfig, ModelConfig

    config = ModelConfig.from_file(Path(folder) / "config.json")
    lora = LoraConfig(r=r, alpha=2.0 * r, target_modules=config.lora_modules())
    m = load_model(folder, krnl.device("cpu"), lora=lora)
    rng = np.random.default_rng(seed)
    st = m.lora_state()
    for k in st:
        if ".lora_B." in k or k.endswith("lora_b"):
            st[k] = (0.05 * rng.standard_normal(st[k].shape)).astype(np.float32)
    adapter_io.save_adapter(out, st, adapter_io.peft_config(lora, str(folder), model_config=config), config)
    return Path(out)
