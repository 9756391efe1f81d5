"""Preference data (krnl train --train-mode dpo, orpo, simpo): each line of a split's jsonl a pair, in
TRL's formats,

    {"prompt": "...", "chosen": "...", "rejected": "..."}                         standard
    {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}     conversational

tokenized as SFT's samples are (data.py: the chat template where the tokenizer has one), each
completion learned and its prompt masked; and batches of P pairs as 2P rows, the chosen ones first
and their rejected ones after in the same order (TRL's layout, krnl.train.preference). GRPO's data is
prompt-only lines (load_prompts, PromptBatches)."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .batches import DataError, pad_batch
from .data import Sample, _check_chat, _check_str, _fail, completion_sample, read_jsonl

KEYS = ("prompt", "chosen", "rejected")


def _conversation(tok, prompt, completion):
    """A Sample of messages prompt + completion whose learned tokens are the completion's: those
    the template renders after the prompt with its generation prompt."""
    head = tok.apply_chat_template(prompt, add_generation_prompt=True)
    full = tok.apply_chat_template(prompt + completion)
    if not full.startswith(head):
        raise DataError("the chat template does not render the prompt as the start of the conversation")
    ids, offsets = tok.encode_with_offsets(full)
    learn = np.array([o[0] >= len(head) for o in offsets], bool)
    return Sample(np.asarray(ids, np.int32), learn)


def pair(tok, obj, path, line):
    """(chosen Sample, rejected Sample) of one line."""
    for k in KEYS:
        if k not in obj:
            _fail(path, line, f"missing key {k!r} (a preference pair has {', '.join(KEYS)})")
    if isinstance(obj["prompt"], str):
        for k in KEYS:
            _check_str(obj, k, path, line, "preference")
        return tuple(completion_sample(tok, obj["prompt"], obj[k]) for k in KEYS[1:])
    if not tok.has_chat_template:
        _fail(path, line, "conversational pairs need a tokenizer with a chat template")
    for k in KEYS:
        _check_chat({"messages": obj[k]}, path, line)
    return tuple(_conversation(tok, obj["prompt"], obj[k]) for k in KEYS[1:])


@dataclass
class PairSplit:
    name: str
    path: str
    pairs: list              # [(chosen Sample, rejected Sample)]
    pad_id: int = 0
    n_truncated: int = 0

    @property
    def samples(self):
        return self.pairs  # a pair is one training sample (epochs, batches)

    def summary(self):
        s = f"{self.name}: {len(self.pairs)} preference pairs from {self.path}"
        return s + (f"; {self.n_truncated} truncated" if self.n_truncated else "")

    def batches(self, batch_size, seed):
        return PairBatches(self.pairs, batch_size, seed, self.pad_id, self.path)

    def eval_batches(self, batch_size):
        return [rows(self.pairs[i:i + batch_size], self.pad_id) for i in range(0, len(self.pairs), batch_size)]


def load_pairs(path, tok, max_seq_length, vocab_size=None, name=None):
    """A PairSplit of the jsonl at path; a completion cut to max_seq_length tokens keeps its prompt
    (a pair left with nothing to learn on a side is an error naming its line)."""
    records = read_jsonl(path)
    if not records:
        raise DataError(f"[data] {path}: the split is empty (no pairs)")
    out, n_trunc = [], 0
    for line, obj in records:
        try:
            p = pair(tok, obj, path, line)
        except DataError as e:
            if str(e).startswith("[data]"):
                raise
            raise DataError(f"[data] {path}:{line}: {e}") from e
        except Exception as e:  # template or tokenizer errors
            raise DataError(f"[data] {path}:{line}: cannot render or tokenize the pair: {type(e).__name__}: {e}") from e
        if vocab_size is not None and max(int(s.ids.max()) for s in p) >= vocab_size:
            _fail(path, line, f"a token id is outside the model's vocabulary of {vocab_size}")
        if max(len(s) for s in p) > max_seq_length:
            p, n_trunc = tuple(Sample(s.ids[:max_seq_length], s.learn[:max_seq_length]) for s in p), n_trunc + 1
        if min(s.n_targets for s in p) == 0:
            _fail(path, line, f"its chosen or rejected completion has no token left to learn within "
                              f"{max_seq_length} tokens")
        out.append(p)
    return PairSplit(name or str(path), str(path), out, int(tok.pad_id), n_trunc)


def rows(pairs, pad_id=0):
    """(ids, targets) (2P, T): the chosen rows, then the rejected ones."""
    return pad_batch([c for c, _ in pairs] + [r for _, r in pairs], pad_id)


class PairBatches:
    """Batches of batch_size pairs, shuffled each epoch from (seed, epoch): next(), state(), load_state()."""
    noun = "pairs"

    def __init__(self, items, batch_size, seed, pad_id=0, where="<data>"):
        if len(items) < batch_size:
            raise DataError(f"[data] {where}: {len(items)} {self.noun} are fewer than one batch of {batch_size}")
        self.items, self.batch_size, self.seed, self.pad_id = items, int(batch_size), seed, pad_id
        self.n_batches = len(items) // batch_size  # the incomplete last batch is left out
        self.epoch, self.index = 0, 0

    def _items(self):
        """The next batch's items, in the epoch's shuffled order."""
        if self.index >= self.n_batches:
            self.epoch, self.index = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.items))
        b, self.index = self.index, self.index + 1
        return [self.items[i] for i in order[b * self.batch_size:(b + 1) * self.batch_size]]

    def next(self):
        return rows(self._items(), self.pad_id)

    def state(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, s):
        self.epoch, self.index = int(s["epoch"]), int(s["index"])


def load_pair_dataset(folder, tok, max_seq_length, vocab_size=None):
    """{"train": PairSplit, "valid": PairSplit or None} from folder/train.jsonl and valid.jsonl."""
    folder = Path(folder)
    if not (folder / "train.jsonl").is_file():
        raise DataError(f"[data] {folder}: no train.jsonl (preference pairs)")
    if vocab_size is not None:
        tok.check_vocab(vocab_size)
    return {name: load_pairs(folder / f"{name}.jsonl", tok, max_seq_length, vocab_size, name)
            if (folder / f"{name}.jsonl").is_file() else None for name in ("train", "valid")}


def prompt_ids(tok, prompt):
    """Token ids of a GRPO prompt: a string (as the user's turn where the tokenizer has a chat template)
    or a list of messages, rendered up to the assistant's turn."""
    if isinstance(prompt, str):
        if not tok.has_chat_template:
            return tok.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    return tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True), add_special_tokens=False)


def load_prompts(path, tok, max_prompt_length, vocab_size=None):
    """[(token ids, the prompt as the line gives it)] of a jsonl of {"prompt": str or messages, ...}
    lines (TRL's prompt-only format; the line's other keys go to the reward functions as theirs)."""
    records = read_jsonl(path)
    if not records:
        raise DataError(f"[data] {path}: the split is empty (no prompts)")
    out = []
    for line, obj in records:
        if "prompt" not in obj:
            _fail(path, line, "missing key 'prompt' (GRPO reads prompt-only lines)")
        if not isinstance(obj["prompt"], str):
            _check_chat({"messages": obj["prompt"]}, path, line)
        ids = prompt_ids(tok, obj["prompt"])[-max_prompt_length:]  # TRL keeps a long prompt's end
        if not ids or (vocab_size is not None and max(ids) >= vocab_size):
            _fail(path, line, "the prompt tokenizes to nothing or outside the model's vocabulary")
        out.append((ids, obj))
    return out


class PromptBatches(PairBatches):
    """Batches of batch_size prompts (load_prompts' items), shuffled each epoch: next(), state(), load_state()."""
    noun = "prompts"

    def next(self):
        return self._items()
