"""The embedded default job: a tiny Llama-architecture model and a task generated
deterministically, so that `krnl train` with no arguments is a real LoRA fine-tune that visibly
learns in minutes on a laptop CPU, and `krnl generate` shows what it learned.

The task, "skip counting": the prompt "+2c>" asks for the letters after c in steps of 2, and the
answer is "egikm" followed by the end token. The base model is random (frozen); the adapters
must learn to read the step from the prompt (attention) and to count in it (MLP).
"""

import numpy as np

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
IGNORE = -100


class CharTokenizer:
    """One token per character of a fixed alphabet, plus pad, begin and end tokens."""

    def __init__(self, chars=ALPHABET + "0123456789+>"):
        self.chars = chars
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._index = {c: i + 3 for i, c in enumerate(chars)}
        self.vocab_size = len(chars) + 3

    def encode(self, text, bos=True):
        bad = sorted({c for c in text if c not in self._index})
        if bad:
            raise ValueError(f"[tokenizer] characters {bad} are not in the vocabulary {self.chars!r}")
        return ([self.bos_id] if bos else []) + [self._index[c] for c in text]

    def decode(self, ids):
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= 3:
                out.append(self.chars[i - 3])
        return "".join(out)


def skip_count_sample(rng, max_len=6):
    step = int(rng.integers(1, 4))
    n = int(rng.integers(3, max_len + 1))
    start = int(rng.integers(0, 26 - step * n))
    prompt = f"+{step}{ALPHABET[start]}>"
    answer = "".join(ALPHABET[start + step * (i + 1)] for i in range(n))
    return prompt, answer


def make_split(tok, n, seed, seq_len=12):
    """(ids, targets) int32 arrays of shape (n, seq_len): next-token targets on the answer and
    the end token only (the prompt is masked), pads ignored."""
    rng = np.random.default_rng(seed)
    ids = np.full((n, seq_len), tok.pad_id, np.int32)
    targets = np.full((n, seq_len), IGNORE, np.int32)
    for i in range(n):
        prompt, answer = skip_count_sample(rng)
        p = tok.encode(prompt)
        full = p + tok.encode(answer, bos=False) + [tok.eos_id]
        if len(full) > seq_len:
            raise ValueError(f"[default_task] sample of {len(full)} tokens exceeds seq_len {seq_len}")
        ids[i, :len(full)] = full
        # position t predicts token t+1; only answer tokens (and the end) are learned
        targets[i, len(p) - 1:len(full) - 1] = full[len(p):]
    return ids, targets


def tiny_config(vocab_size):
    """An HF-style config.json dict of a tiny Llama (GQA, 2 layers)."""
    return {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "max_position_embeddings": 64,
    }


def base_weights(config, seed):
    """The frozen random base: projections scaled 1/sqrt(fan_in) so signals keep their size
    through the layers, and an LM head large enough that a hidden state aligned with a token's
    row can make that token confident (with 0.02-std weights the logits stay within about +-1
    and no adapter can push the loss below ~2.5)."""
    from ..models.config import random_weights

    w = random_weights(config, seed=seed, std=1.0)
    for k, v in w.items():
        if v.ndim == 2 and not k.endswith("embed_tokens.weight"):
            w[k] = (v / np.sqrt(v.shape[1])).astype(np.float32)
    w["lm_head.weight"] *= np.float32(4.0)
    return w
