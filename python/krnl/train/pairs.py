"""Preference data (krnl train --train-mode dpo, orpo, simpo): each line of a split's jsonl a pair, in
TRL's formats,

    {"prompt": "...", "chosen": "...", "rejected": "..."}                         standard
    {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}     conversational

or in the layouts mlx-lm-lora's DPO, CPO and ORPO datasets read (mlx_lm_lora/trainer/datasets.py,
DPODataset and ORPODataset), each read as the conversation mlx-lm-lora renders:

    {"system": "...", "prompt": "...", ...}      the system message, then the prompt as the user's turn
    "chosen", "rejected" as {"messages": [m]},   one assistant message m after a string prompt
        {"content": "..."} or [m]
    {"question": "...", ...}                     the prompt, where "prompt" is absent
    {..., "preference_score": 8.0}               --train-mode orpo only: the number (> 0) the chosen
        completion's mean log-probability is multiplied by in the odds ratio (orpo_trainer.py's
        orpo_loss); a mode that has no use for it refuses the line

and, with a keys mapping (the CLI's --prompt-feature, --chosen-feature, ...: mlx-lm-lora's
prompt_feature, chosen_feature, ... options), under other key names.

Pairs are tokenized as SFT's samples are (data.py: the chat template where the tokenizer has one),
each completion learned and its prompt masked; batches of P pairs are 2P rows, the chosen ones
first and their rejected ones after in the same order (TRL's layout, krnl.train.preference), and
the pairs' preference scores (P,) where the split has any.

GRPO's data is prompt-only lines (load_prompts, PromptBatches): TRL's {"prompt": text or messages,
...}, or mlx-lm-lora's GRPODataset layout {"prompt", "answer", "system", "type"}: a "system" is the
system message before the prompt's user turn, and every key but "prompt" goes to the reward
functions under its name (answer=, type=, system=; None where a line lacks a key another has). A
line without "system" is the prompt alone: mlx-lm-lora's default <think>/<answer> system prompt
is not added (give it as "system")."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .batches import DataError, pad_batch
from .data import Sample, _check_chat, _check_str, _fail, completion_sample, read_jsonl

KEYS = ("prompt", "chosen", "rejected")
# the keys whose names mlx-lm-lora's *_feature options change (prompt_feature, ...)
FEATURES = ("prompt", "chosen", "rejected", "system", "preference_score", "answer", "type")


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


def renamed(obj, keys, path, line):
    """The line with its keys as krnl names them: keys {krnl's name: the line's} (mlx-lm-lora's
    *_feature options)."""
    out = dict(obj)
    for k, theirs in (keys or {}).items():
        if theirs != k and theirs in out:
            if k in out:
                _fail(path, line, f"has both {theirs!r} (read as {k!r}) and {k!r}")
            out[k] = out.pop(theirs)
    return out


def _with_system(obj, path, line):
    """The line's prompt, mlx-lm-lora's "system" key made its system message: [system, user] messages
    of a string prompt."""
    prompt, system = obj["prompt"], obj.get("system")
    if system is None:
        return prompt
    if not isinstance(prompt, str):
        _fail(path, line, "'system' goes with a string prompt (a prompt of messages holds its own system message)")
    _check_str(obj, "system", path, line, "system")
    return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]


def _completion(obj, k, path, line):
    """A completion as a string or messages: mlx-lm-lora's ORPO also gives it as {"messages": [...]}
    or as one message {"content": ...}, the assistant's."""
    c = obj[k]
    if not isinstance(c, dict):
        return c
    if "messages" in c:
        return c["messages"]
    if "content" not in c:
        _fail(path, line, f"{k!r} as an object needs 'messages' or 'content'")
    return [{"role": "assistant", "content": c["content"]}]


def _one_assistant_message(c, k, path, line):
    """A completion after a string prompt as messages: a string is the assistant's message; messages
    must be that one message (mlx-lm-lora reads the last message's content, or all of them after a
    system message: the same only then)."""
    if isinstance(c, str):
        return [{"role": "assistant", "content": c}]
    if not (isinstance(c, list) and len(c) == 1 and isinstance(c[0], dict) and c[0].get("role") == "assistant"):
        _fail(path, line, f"{k!r} after a string prompt must be a string or one assistant message (more turns: "
                          "give the prompt as messages, TRL's conversational format)")
    return c


def _score(obj, path, line, scored):
    """The line's preference_score (mlx-lm-lora's ORPO), or None."""
    if "preference_score" not in obj:
        return None
    s = obj["preference_score"]
    if not scored:
        _fail(path, line, "'preference_score' weights ORPO's chosen log-probability (mlx-lm-lora's); only "
                          "--train-mode orpo reads it")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < float("inf"):
        _fail(path, line, f"'preference_score' must be a number > 0, got {s!r}")
    return float(s)


def pair(tok, obj, path, line, scored=False, keys=None):
    """(chosen Sample, rejected Sample, preference score or None) of one line; scored: the mode reads
    preference scores (ORPO)."""
    obj = renamed(obj, keys, path, line)
    if "prompt" not in obj and "question" in obj:
        obj["prompt"] = obj.pop("question")  # mlx-lm-lora's ORPO reads a question where there is no prompt
    for k in KEYS:
        if k not in obj:
            _fail(path, line, f"missing key {k!r} (a preference pair has {', '.join(KEYS)})")
    score = _score(obj, path, line, scored)
    prompt, comps = _with_system(obj, path, line), [_completion(obj, k, path, line) for k in KEYS[1:]]
    if isinstance(prompt, str) and all(isinstance(c, str) for c in comps):
        return (*(completion_sample(tok, prompt, c) for c in comps), score)
    if isinstance(obj["prompt"], str):  # mlx-lm-lora's layouts of a string prompt: one assistant message each
        prompt = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        comps = [_one_assistant_message(c, k, path, line) for c, k in zip(comps, KEYS[1:])]
    if not tok.has_chat_template:
        _fail(path, line, "conversational pairs need a tokenizer with a chat template (a 'system' or a "
                          "completion of messages makes a pair conversational)")
    for m in (prompt, *comps):
        _check_chat({"messages": m}, path, line)
    return (*(_conversation(tok, prompt, c) for c in comps), score)


@dataclass
class PairSplit:
    name: str
    path: str
    pairs: list              # [(chosen Sample, rejected Sample[, preference score])]
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


def load_pairs(path, tok, max_seq_length, vocab_size=None, name=None, scored=False, keys=None):
    """A PairSplit of the jsonl at path; a completion cut to max_seq_length tokens keeps its prompt
    (a pair left with nothing to learn on a side is an error naming its line). Its pairs are
    (chosen, rejected), or (chosen, rejected, preference score) where any line has a score (the
    others' 1, mlx-lm-lora's default); scored and keys as pair()'s."""
    records = read_jsonl(path)
    if not records:
        raise DataError(f"[data] {path}: the split is empty (no pairs)")
    out, n_trunc = [], 0
    for line, obj in records:
        try:
            *p, score = pair(tok, obj, path, line, scored, keys)
        except DataError as e:
            if str(e).startswith("[data]"):
                raise
            raise DataError(f"[data] {path}:{line}: {e}") from e
        except Exception as e:  # template or tokenizer errors
            raise DataError(f"[data] {path}:{line}: cannot render or tokenize the pair: {type(e).__name__}: {e}") from e
        if vocab_size is not None and max(int(s.ids.max()) for s in p) >= vocab_size:
            _fail(path, line, f"a token id is outside the model's vocabulary of {vocab_size}")
        if max(len(s) for s in p) > max_seq_length:
            p, n_trunc = [Sample(s.ids[:max_seq_length], s.learn[:max_seq_length]) for s in p], n_trunc + 1
        if min(s.n_targets for s in p) == 0:
            _fail(path, line, f"its chosen or rejected completion has no token left to learn within "
                              f"{max_seq_length} tokens")
        out.append((*p, score))
    scores = any(s is not None for *_, s in out)
    out = [(c, r, 1.0 if s is None else s) if scores else (c, r) for c, r, s in out]
    return PairSplit(name or str(path), str(path), out, int(tok.pad_id), n_trunc)


def rows(pairs, pad_id=0):
    """(ids, targets) (2P, T): the chosen rows, then the rejected ones; and the pairs' scores (P,)
    where they have them."""
    ids, targets = pad_batch([p[0] for p in pairs] + [p[1] for p in pairs], pad_id)
    return (ids, targets, np.array([p[2] for p in pairs], np.float64)) if len(pairs[0]) > 2 else (ids, targets)


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


def load_pair_dataset(folder, tok, max_seq_length, vocab_size=None, scored=False, keys=None):
    """{"train": PairSplit, "valid": PairSplit or None} from folder/train.jsonl and valid.jsonl."""
    folder = Path(folder)
    if not (folder / "train.jsonl").is_file():
        raise DataError(f"[data] {folder}: no train.jsonl (preference pairs)")
    if vocab_size is not None:
        tok.check_vocab(vocab_size)
    return {name: load_pairs(folder / f"{name}.jsonl", tok, max_seq_length, vocab_size, name, scored, keys)
            if (folder / f"{name}.jsonl").is_file() else None for name in ("train", "valid")}


def prompt_ids(tok, prompt):
    """Token ids of a GRPO prompt: a string (as the user's turn where the tokenizer has a chat template)
    or a list of messages, rendered up to the assistant's turn."""
    if isinstance(prompt, str):
        if not tok.has_chat_template:
            return tok.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    return tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True), add_special_tokens=False)


def load_prompts(path, tok, max_prompt_length, vocab_size=None, keys=None):
    """[(token ids, the line)] of a jsonl of {"prompt": str or messages, ...} lines (TRL's prompt-only
    format, or mlx-lm-lora's with "system"; keys as pair()'s). The lines' other keys go to the reward
    functions as theirs, every line holding every key (None where it has none, as a dataset's
    column)."""
    records = [(line, renamed(obj, keys, path, line)) for line, obj in read_jsonl(path)]
    if not records:
        raise DataError(f"[data] {path}: the split is empty (no prompts)")
    columns = dict.fromkeys(k for _, obj in records for k in obj)
    out = []
    for line, obj in records:
        if "prompt" not in obj:
            _fail(path, line, "missing key 'prompt' (GRPO reads prompt-only lines)")
        prompt = _with_system(obj, path, line)
        if not isinstance(prompt, str):
            _check_chat({"messages": prompt}, path, line)
        ids = prompt_ids(tok, prompt)[-max_prompt_length:]  # TRL keeps a long prompt's end
        if not ids or (vocab_size is not None and max(ids) >= vocab_size):
            _fail(path, line, "the prompt tokenizes to nothing or outside the model's vocabulary")
        out.append((ids, {**dict.fromkeys(columns), **obj}))
    return out


class PromptBatches(PairBatches):
    """Batches of batch_size prompts (load_prompts' items), shuffled each epoch: next(), state(), load_state()."""
    noun = "prompts"

    def next(self):
        return self._items()
