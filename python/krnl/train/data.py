"""Fine-tuning datasets in the layout mlx-lm users have: a folder with train.jsonl, valid.jsonl and
test.jsonl, each line one sample in one of three formats, detected per file from its first line:

    {"text": "..."}                                   every token is learned
    {"prompt": "...", "completion": "..."}            the prompt is masked (mask_prompt)
    {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}   chat; tools optional

Chats are rendered with the checkpoint's chat template (krnl.io.tokenizer). With mask_prompt every
assistant turn is learned and everything else (system, user, tool turns, the template's headers)
is masked. The assistant spans are found by rendering the conversation up to each assistant turn
with the generation prompt and up to the end of that turn: the text between the two renderings is
the turn. prompt/completion samples go through the chat template as a user and an assistant turn
when the checkpoint has one (as mlx-lm does), else they are the BOS-prefixed prompt followed by
the completion and EOS.

Samples longer than max_seq_length are truncated (counted). Batches (krnl.train.batches) are either
packed (several samples per row, each with its own attention segment and positions restarting at
0, so no token attends across a sample boundary) or length-sorted (samples of similar length
batched together, padded to the longest in the batch).

Errors name the file and line.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Packing and the batch sources are in batches.py (the trainer uses them too); the names stay
# importable from here.
from .batches import IGNORE_INDEX, Batches, DataError, LengthSortedBatches, Packed, pack, pad_batch  # noqa: F401

SPLITS = ("train", "valid", "test")
FORMATS = ("text", "completions", "chat")


@dataclass
class Sample:
    ids: np.ndarray     # (n,) int32
    learn: np.ndarray   # (n,) bool: the token is a loss target (predicted from the ones before it)
    line: int = 0

    def __len__(self):
        return len(self.ids)

    def targets(self):
        """(n,) int32 next-token targets: position t predicts token t+1 where it is learned."""
        t = np.full(len(self.ids), IGNORE_INDEX, np.int32)
        t[:-1] = np.where(self.learn[1:], self.ids[1:], IGNORE_INDEX)
        return t

    @property
    def n_targets(self):
        return int(self.learn[1:].sum())


# ---------------------------------------------------------------------------------------------
# Reading and validating


def _fail(path, line, msg):
    raise DataError(f"[data] {path}:{line}: {msg}" if line else f"[data] {path}: {msg}")


def read_jsonl(path):
    """[(line number, object)] of the non-blank lines of a JSONL file."""
    path = Path(path)
    out = []
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"[data] cannot read {path}: {e}") from e
    lines = []
    for n, bline in enumerate(raw.split(b"\n"), 1):  # decoded per line: an error names its line
        try:
            lines.append(bline.decode("utf-8-sig" if n == 1 else "utf-8"))
        except UnicodeDecodeError as e:
            _fail(path, n, f"not UTF-8 text (byte 0x{bline[e.start]:02x} at column {e.start + 1}); "
                  "save the file as UTF-8")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            _fail(path, n, f"malformed JSON ({e.msg} at column {e.colno})")
        if not isinstance(obj, dict):
            _fail(path, n, f"expected a JSON object, got {type(obj).__name__}")
        out.append((n, obj))
    return out


def detect_format(obj, path, line):
    if "messages" in obj:
        return "chat"
    if "prompt" in obj or "completion" in obj:
        return "completions"
    if "text" in obj:
        return "text"
    _fail(path, line, f"cannot tell the format from the keys {sorted(obj)}: expected 'text', "
                      "'prompt' and 'completion', or 'messages'")


def _check_str(obj, key, path, line, fmt):
    if key not in obj:
        _fail(path, line, f"missing key {key!r} (the file's format is {fmt!r}, detected from its first line)")
    if not isinstance(obj[key], str):
        _fail(path, line, f"key {key!r} must be a string, got {type(obj[key]).__name__}")


def _check_chat(obj, path, line):
    if "messages" not in obj:
        _fail(path, line, "missing key 'messages' (the file's format is 'chat', detected from its first line)")
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        _fail(path, line, "'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            _fail(path, line, f"messages[{i}] must be an object, got {type(m).__name__}")
        if "role" not in m:
            _fail(path, line, f"messages[{i}] has no 'role'")
        if not isinstance(m["role"], str):
            _fail(path, line, f"messages[{i}].role must be a string, got {type(m['role']).__name__}")
        c = m.get("content")
        if c is None and not m.get("tool_calls"):
            _fail(path, line, f"messages[{i}] has no 'content'" + ("" if "content" in m else " key"))
        if c is not None and not isinstance(c, str):
            _fail(path, line, f"messages[{i}].content must be a string, got {type(c).__name__}")
        if "tool_calls" in m and not isinstance(m["tool_calls"], list):
            _fail(path, line, f"messages[{i}].tool_calls must be a list")
    tools = obj.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        _fail(path, line, "'tools' must be a list of objects")


# ---------------------------------------------------------------------------------------------
# Tokenizing


def assistant_spans(tok, messages, tools=None):
    """(full text, [(start, end)] character spans of each assistant turn in it). Each span is the
    text between the rendering up to the turn with the generation prompt and the rendering up to
    the end of the turn; both must be prefixes of the whole rendering."""
    full = tok.apply_chat_template(messages, tools=tools)
    spans = []
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = tok.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True)
        after = tok.apply_chat_template(messages[:k + 1], tools=tools)
        if not after.startswith(before) or not full.startswith(after):
            raise DataError(f"the chat template does not render this conversation incrementally (the rendering "
                            f"up to turn {k} is not a prefix of the whole), so the assistant turns cannot be "
                            "located for masking; use mask_prompt=False or a template that renders prefixes")
        spans.append((len(before), len(after)))
    return full, spans


def chat_sample(tok, messages, tools=None, mask=True):
    """Sample of a conversation: with mask, only the tokens of assistant turns are learned."""
    full, spans = assistant_spans(tok, messages, tools) if mask else (
        tok.apply_chat_template(messages, tools=tools), None)
    ids, offsets = tok.encode_with_offsets(full)
    learn = np.ones(len(ids), bool)
    if mask:
        starts = np.array([o[0] for o in offsets], np.int64)
        learn[:] = False
        for a, b in spans:
            learn |= (starts >= a) & (starts < b)
    return Sample(np.asarray(ids, np.int32), learn)


def text_sample(tok, text):
    ids = tok.encode(text)
    if tok.eos_id is not None and (not ids or ids[-1] != tok.eos_id):
        ids.append(tok.eos_id)
    return Sample(np.asarray(ids, np.int32), np.ones(len(ids), bool))


def completion_sample(tok, prompt, completion, mask=True):
    if tok.has_chat_template:
        return chat_sample(tok, [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                           mask=mask)
    p = tok.encode(prompt)
    c = tok.encode(completion, add_special_tokens=False)
    if tok.eos_id is not None:
        c.append(tok.eos_id)
    learn = np.concatenate([np.full(len(p), not mask), np.ones(len(c), bool)])
    return Sample(np.asarray(p + c, np.int32), learn)


@dataclass
class Split:
    name: str
    path: str
    format: str
    samples: list
    max_seq_length: int
    pad_id: int = 0
    pack: bool = False
    n_lines: int = 0
    n_truncated: int = 0
    n_dropped: int = 0        # samples with no learned token left (after masking and truncation)
    _packed: object = field(default=None, repr=False)

    @property
    def n_tokens(self):
        return int(sum(len(s) for s in self.samples))

    @property
    def n_targets(self):
        return int(sum(s.n_targets for s in self.samples))

    def summary(self):
        s = (f"{self.name}: {len(self.samples)} samples ({self.format}) from {self.path}, {self.n_tokens} tokens, "
             f"{self.n_targets} learned")
        if self.n_truncated:
            s += f"; {self.n_truncated} truncated to {self.max_seq_length} tokens"
        if self.n_dropped:
            s += f"; {self.n_dropped} dropped (nothing left to learn)"
        return s

    def packed(self):
        if self._packed is None:
            self._packed = pack(self.samples, self.max_seq_length, self.pad_id)
        return self._packed

    def batches(self, batch_size, seed):
        """The training batch source (next(), state(), load_state()): shuffled packed rows when
        packing, else shuffled length-sorted batches."""
        if self.pack:
            p = self.packed()
            if len(p.ids) < batch_size:
                raise DataError(f"[data] {self.path}: {len(self.samples)} samples pack into {len(p.ids)} rows of "
                                f"{self.max_seq_length} tokens, fewer than one batch of {batch_size}")
            return Batches(p.ids, p.targets, batch_size, seed, segments=p.segments, positions=p.positions)
        return LengthSortedBatches(self.samples, batch_size, seed, self.pad_id, where=self.path)

    def eval_batches(self, batch_size):
        """All samples once, in a fixed order: [(ids, targets[, segments, positions])]."""
        if self.pack:
            p = self.packed()
            return [tuple(a[i:i + batch_size] for a in (p.ids, p.targets, p.segments, p.positions))
                    for i in range(0, len(p.ids), batch_size)]
        lsb = LengthSortedBatches(self.samples, 1, 0, self.pad_id, where=self.path)
        return [pad_batch([self.samples[i] for i in lsb.order[j:j + batch_size]], self.pad_id)
                for j in range(0, len(lsb.order), batch_size)]


def load_split(path, tok, max_seq_length, mask_prompt=True, vocab_size=None, name=None, pack=False):
    path = Path(path)
    if max_seq_length < 2:
        raise DataError(f"[data] max_seq_length must be >= 2, got {max_seq_length}")
    records = read_jsonl(path)
    if not records:
        raise DataError(f"[data] {path}: the split is empty (no samples)")
    fmt = detect_format(records[0][1], path, records[0][0])
    samples, n_trunc, n_drop = [], 0, 0
    for line, obj in records:
        try:
            if fmt == "text":
                _check_str(obj, "text", path, line, fmt)
                s = text_sample(tok, obj["text"])
            elif fmt == "completions":
                _check_str(obj, "prompt", path, line, fmt)
                _check_str(obj, "completion", path, line, fmt)
                s = completion_sample(tok, obj["prompt"], obj["completion"], mask_prompt)
            else:
                _check_chat(obj, path, line)
                s = chat_sample(tok, obj["messages"], obj.get("tools"), mask_prompt)
        except DataError as e:
            if str(e).startswith("[data]"):
                raise
            raise DataError(f"[data] {path}:{line}: {e}") from e
        except Exception as e:  # template errors (raise_exception), tokenizer errors
            raise DataError(f"[data] {path}:{line}: cannot render or tokenize the sample: "
                            f"{type(e).__name__}: {e}") from e
        s.line = line
        if vocab_size is not None and len(s.ids) and int(s.ids.max()) >= vocab_size:
            _fail(path, line, f"token id {int(s.ids.max())} is outside the model's vocabulary of {vocab_size}: "
                              "the tokenizer does not match the model")
        if len(s) > max_seq_length:
            s = Sample(s.ids[:max_seq_length], s.learn[:max_seq_length], line)
            n_trunc += 1
        if s.n_targets == 0:
            n_drop += 1
            continue
        samples.append(s)
    if not samples:
        raise DataError(f"[data] {path}: no sample has anything to learn (all {len(records)} are fully masked"
                        + (f" after truncation to {max_seq_length} tokens)" if n_trunc else ")"))
    return Split(name or path.stem, str(path), fmt, samples, int(max_seq_length), pad_id=int(tok.pad_id), pack=pack,
                 n_lines=len(records), n_truncated=n_trunc, n_dropped=n_drop)


def load_dataset(folder, tokenizer, max_seq_length, mask_prompt=True, pack=False, vocab_size=None,
                 splits=SPLITS, required=("train",)):
    """{split name: Split or None} from folder/{name}.jsonl. Splits in `required` must exist;
    every existing file must hold at least one sample."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"[data] {folder} is not a folder (expected train.jsonl, valid.jsonl, test.jsonl in it)")
    if vocab_size is not None:
        tokenizer.check_vocab(vocab_size)
    out = {}
    for name in splits:
        p = folder / f"{name}.jsonl"
        if not p.exists():
            if name in required:
                raise DataError(f"[data] {folder}: no {name}.jsonl")
            out[name] = None
            continue
        out[name] = load_split(p, tokenizer, max_seq_length, mask_prompt=mask_prompt, vocab_size=vocab_size,
                               name=name, pack=pack)
    return out
