"""A krnl Tokenizer (tokenizer.json and its config) as GGUF `tokenizer.*` metadata, what llama.cpp's
vocabulary loader reads (llama-vocab.cpp) and tokenizer.py reads back:

- byte-level BPE (Llama 3, Qwen, Mistral's tekken, gpt-oss, OLMoE): `tokenizer.ggml.model` "gpt2",
  the tokens in GPT-2's byte spelling, the merges, and `tokenizer.ggml.pre` named after the
  regex tokenizer.json splits with (tokenizer.SPLITS read backwards; GPT-2's own regex is
  "gpt-2"). A regex llama.cpp does not know is refused: its tokens would differ.
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral v0.1-0.3, Gemma, Phi-3): "llama",
  the "▁" pieces, the <0xNN> byte tokens typed as bytes, and scores that make llama.cpp merge in
  tokenizer.json's merge order (llama.cpp joins the pair whose join scores highest: a token's
  score is minus the rank of its first merge). `add_space_prefix` is whether the Metaspace
  pre-tokenizer (or a Prepend normalizer) puts "▁" before the text.
- token types: special added tokens CONTROL, other added tokens USER_DEFINED (SentencePiece's
  with spaces for "▁", as llama.cpp's converter writes them), ids the embedding has beyond the
  tokenizer `[PADi]`, UNUSED (llama.cpp wants one token per embedding row).
- BOS, EOS, unknown and padding ids, add_bos / add_eos, and the chat template (named templates as
  `tokenizer.chat_template.NAME`).
"""

import json
import re

from .tokenizer import SPLITS

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_GPT2_SPLIT = "gpt-2"  # ByteLevel(use_regex=True): GPT-2's regex, llama.cpp's "gpt-2"
_PRE_NAMES = {}
for _name, _regex in SPLITS.items():
    _PRE_NAMES.setdefault(_regex, _name)


def _parts(node):
    """The components of a tokenizer.json pre-tokenizer / normalizer / decoder (a Sequence's, or itself)."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [p for sub in node.get("pretokenizers") or node.get("normalizers") or node.get("decoders") or []
                for p in _parts(sub)]
    return [node]


def _pre_name(pre, source):
    """tokenizer.ggml.pre for a byte-level BPE's pre-tokenizer."""
    parts = _parts(pre)
    levels = [p for p in parts if p.get("type") == "ByteLevel"]
    splits = [p for p in parts if p.get("type") == "Split"]
    if len(levels) == 1 and not splits and levels[0].get("use_regex", True):
        return _GPT2_SPLIT
    if len(splits) == 1 and len(parts) == 2 and levels and not levels[0].get("use_regex", True):
        regex = (splits[0].get("pattern") or {}).get("Regex")
        if regex in _PRE_NAMES:
            return _PRE_NAMES[regex]
        raise ValueError(f"[gguf] {source}: the tokenizer splits text with the regex {regex!r}, which krnl cannot "
                         f"name for llama.cpp (it knows {', '.join(sorted(set(_PRE_NAMES.values())))} and GPT-2's)")
    raise ValueError(f"[gguf] {source}: the tokenizer's pre-tokenizer {[p.get('type') for p in parts]} has no "
                     "llama.cpp equivalent krnl knows")


def _space_prefix(j):
    """Whether a SentencePiece-style tokenizer.json puts "▁" before the text."""
    for p in _parts(j.get("pre_tokenizer")):
        if p.get("type") == "Metaspace":
            return p.get("prepend_scheme", "always" if p.get("add_prefix_space", True) else "never") != "never"
    return any(p.get("type") == "Prepend" for p in _parts(j.get("normalizer")))


def _looks_special(t):
    """Added tokens llama.cpp's converter types CONTROL although not flagged special."""
    return t.startswith("<|") and t.endswith("|>")


def tokenizer_metadata(tok, vocab_size, source="<tokenizer>"):
    """{GGUF key: value} of krnl Tokenizer `tok` for a model whose embedding has vocab_size rows."""
    j = json.loads(tok.tk.to_str())
    model = j.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"[gguf] {source}: a {model.get('type')} tokenizer has no GGUF form krnl writes (it writes "
                         "byte-level BPE as 'gpt2' and SentencePiece-style BPE as 'llama')")
    vocab = dict(model.get("vocab") or {})
    added = {int(t["id"]): t for t in j.get("added_tokens") or []}
    for i, t in added.items():
        vocab.setdefault(t["content"], i)
    top = max(vocab.values())
    if top >= vocab_size:
        raise ValueError(f"[gguf] {source}: the tokenizer has ids up to {top} but the embedding only {vocab_size} rows")
    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [UNUSED] * vocab_size
    for t, i in vocab.items():
        tokens[i], types[i] = t, NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    byte_level = any(p.get("type") == "ByteLevel" for p in _parts(j.get("pre_tokenizer")) + _parts(j.get("decoder")))
    md = {}
    if byte_level:
        md["tokenizer.ggml.model"] = "gpt2"
        md["tokenizer.ggml.pre"] = _pre_name(j.get("pre_tokenizer"), source)
        md["tokenizer.ggml.merges"] = merges
    elif model.get("byte_fallback"):
        md["tokenizer.ggml.model"] = "llama"
        md["tokenizer.ggml.pre"] = "default"
        md["tokenizer.ggml.add_space_prefix"] = _space_prefix(j)
        rank = {}
        for r, m in enumerate(merges):
            rank.setdefault(m.replace(" ", "", 1), r)
        lowest = -float(len(merges) + 1)
        md["tokenizer.ggml.scores"] = [-float(rank[t]) if t in rank else lowest for t in tokens]
        for i, t in enumerate(tokens):
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t):
                types[i] = BYTE
        if model.get("unk_token") in vocab:
            types[vocab[model["unk_token"]]] = UNKNOWN
    else:
        raise ValueError(f"[gguf] {source}: a BPE tokenizer that is neither byte-level nor SentencePiece-style "
                         "(byte fallback) has no GGUF form llama.cpp reads")
    for i, t in added.items():
        if t.get("special") or _looks_special(t["content"]):
            types[i] = CONTROL
        elif types[i] != BYTE:
            types[i] = USER_DEFINED
            if not byte_level:  # llama.cpp matches user-defined SentencePiece tokens as plain text
                tokens[i] = t["content"].replace("\u2581", " ")
    md["tokenizer.ggml.tokens"] = tokens
    md["tokenizer.ggml.token_type"] = types
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
           "unknown_token_id": vocab.get(model.get("unk_token") or tok.special_tokens.get("unk_token")),
           "padding_token_id": vocab.get(tok.pad_token) if tok.pad_token is not None else None}
    md.update({f"tokenizer.ggml.{k}": int(v) for k, v in ids.items() if v is not None})
    md["tokenizer.ggml.add_bos_token"] = bool(tok.add_bos)
    md["tokenizer.ggml.add_eos_token"] = bool(tok.add_eos)
    t = tok.chat_template
    if isinstance(t, dict):
        md.update({f"tokenizer.chat_template.{k}": v for k, v in t.items() if k != "default"})
        md["tokenizer.chat_templates"] = [k for k in t if k != "default"]
        t = t.get("default")
    if t is not None:
        md["tokenizer.chat_template"] = t
    return md
