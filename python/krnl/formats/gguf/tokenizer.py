"""The tokenizer a GGUF file describes in its `tokenizer.*` metadata, built with the `tokenizers`
library and wrapped in krnl.io.tokenizer.Tokenizer (docs/architecture.md, 'GGUF files'):

- `tokenizer.ggml.model` "llama": a SentencePiece BPE vocabulary (tokens, scores, token types).
  Its merges are implied by the scores: every split of a token into two tokens is a merge, the
  higher the merged token's score the earlier it applies. Spaces become "▁", one is prepended to
  the text (unless `add_space_prefix` is false), unknown bytes fall back to the <0xNN> tokens.
- "gpt2": byte-level BPE from tokens and merges, split first by the regex that
  `tokenizer.ggml.pre` names (llama3's, qwen2's, tekken's, gpt-4o's; GPT-2's own otherwise, with a
  note).
- tokens typed 3 (control) are special added tokens, 4 (user-defined) plain added ones; the BOS,
  EOS, unknown and padding ids, add_bos / add_eos and `tokenizer.chat_template` come along.
This is the layout transformers builds from the same file (AutoTokenizer with gguf_file)."""

import json
import sys

from .file import open_reader, read_metadata
from ...io.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex tokenizer.json splits with (the first name of a regex is the one
# the exporter writes); tekken: Mistral Nemo's files (arch llama); gpt-4o: gpt-oss's o200k
SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "qwen2": _QWEN2,
          "deepseek-r1-qwen": _QWEN2, "tekken": _TEKKEN, "gpt-4o": _GPT4O}


def spm_merges(tokens, scores):
    """The merges of a SentencePiece BPE vocabulary: (left, right) for every token that splits
    into two tokens, best merged score first; ties by the pieces' lengths (longer first), then
    by the ids of the merged token and of the pieces."""
    ids = {t: i for i, t in enumerate(tokens)}  # a repeated token: its last id, as transformers has it
    found = []
    for t, i in ids.items():
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in ids and b in ids:
                found.append((-float(scores[i]), -len(a), -len(b), i, ids[a], ids[b], a, b))
    found.sort(key=lambda m: m[:6])
    return [(m[6], m[7]) for m in found]


def _byte_alphabet():
    """GPT-2's printable spelling of the 256 bytes."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def build_tokenizer(md, source="<gguf>"):
    """A tokenizers.Tokenizer and its tokenizer_config dict (special tokens, add_bos_token,
    add_eos_token, chat_template) from GGUF metadata."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors, Tokenizer as Tk
    from tokenizers.models import BPE

    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"[gguf] {source}: the file holds no tokenizer (tokenizer.ggml.tokens)")
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}

    def tok(key):
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    if kind == "llama":
        scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = tok("unknown_token_id") or ("<unk>" if "<unk>" in vocab else None)
        tk = Tk(BPE(vocab=vocab, merges=spm_merges(tokens, scores), unk_token=unk, fuse_unk=True, byte_fallback=True))
        prefix = md.get("tokenizer.ggml.add_space_prefix", True)
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                    split=False)
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tk.decoder = decoders.Sequence(dec + ([decoders.Strip(content=" ", left=1)] if prefix else []))
        add_bos_default = True  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say
        spelled = None
    elif kind == "gpt2":
        merges = md.get("tokenizer.ggml.merges")
        if merges is None:
            raise ValueError(f"[gguf] {source}: a gpt2 tokenizer without tokenizer.ggml.merges")
        merges = [tuple(m.split(" ", 1)) for m in merges]
        alpha = _byte_alphabet()
        spelled = set(alpha.values())
        # Tokens are stored in GPT-2's byte spelling; any other (a mislabelled special) is respelled.
        vocab = {(t if set(t) <= spelled else "".join(alpha[b] for b in t.encode("utf-8"))): i
                 for i, t in enumerate(tokens)}
        tk = Tk(BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = md.get("tokenizer.ggml.pre")
        split = SPLITS.get(pre)
        if split is None:
            if pre not in (None, "default", "gpt2", "gpt-2"):
                print(f"note: {source}: pre-tokenizer {pre!r} is unknown to krnl; text is split as GPT-2 splits it, "
                      "which may tokenize some text differently from llama.cpp", file=sys.stderr)
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
        add_bos_default = False
    else:
        raise ValueError(f"[gguf] {source}: tokenizer model {kind!r} is not supported (krnl reads 'llama' and 'gpt2')")
    special = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty == CONTROL and (spelled is None or set(t) <= spelled)]
    tk.add_special_tokens(special)
    tk.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                   if ty == USER_DEFINED])
    config = {"bos_token": tok("bos_token_id"), "eos_token": tok("eos_token_id"), "unk_token": tok("unknown_token_id"),
              "pad_token": tok("padding_token_id")}
    config = {k: v for k, v in config.items() if v is not None}
    add_bos = md.get("tokenizer.ggml.add_bos_token")
    config["add_bos_token"] = bool(add_bos_default if add_bos is None else add_bos) and "bos_token" in config
    config["add_eos_token"] = bool(md.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in config
    template = md.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tk, config


def load_gguf_tokenizer(path, md=None):
    """krnl's Tokenizer for the GGUF file at `path` (md: its metadata, when already read)."""
    if md is None:
        md = read_metadata(open_reader(path))
    tk, config = build_tokenizer(md, source=path)
    return Tokenizer(tk, config, chat_template=config.get("chat_template"), source=path)


def tokenizer_files(tk, config):
    """{file name: bytes} of an HF tokenizer (tokenizer.json, tokenizer_config.json) for fuse."""
    cfg = dict(config)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["clean_up_tokenization_spaces"] = False
    return {"tokenizer.json": tk.to_str(pretty=False).encode("utf-8"),
            "tokenizer_config.json": (json.dumps(cfg, indent=2, ensure_ascii=False) + "\n").encode("utf-8")}
