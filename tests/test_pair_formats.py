"""mlx-lm-lora's data layouts for preference and GRPO training (krnl.train.pairs): each tokenizes to the
rows its TRL equivalent gives and to the rows written out here by hand from the chat template (what
mlx-lm-lora's DPODataset, ORPODataset and GRPODataset render); a malformed line is named by file and
line; ORPO's preference score is mlx-lm-lora's orpo_loss; and the CLI trains on such a folder."""

import json
import re

import numpy as np
import pytest

from krnl.train import preference
from krnl.train.batches import DataError

# Each role a word of the tiny vocabulary (w50 system, w51 user, w52 assistant, also the generation
# prompt), so that a row shows its turns: "w51 w3 w52 w4 w5" is the user's w3, the assistant's w4 w5.
TEMPLATE = ("{% for m in messages %}{{ {'system': 'w50', 'user': 'w51', 'assistant': 'w52'}[m['role']] }} "
            "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w52 {% endif %}")
SYS, USER, ASSISTANT = 50, 51, 52


def tokenizer(tmp_path, template=TEMPLATE):
    from mlx_folders import make_base
    from krnl.formats import hf

    folder = tmp_path / "base"
    if not folder.exists():
        make_base(folder)
    cfg = {**json.loads((folder / "tokenizer_config.json").read_text()), "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return hf.load_tokenizer(folder)


def write(path, *lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def load(tmp_path, tok, *lines, **kw):
    """The rows (ids, targets[, scores]) of one batch of the lines' pairs."""
    from krnl.train.pairs import load_pairs

    return load_pairs(write(tmp_path / "p.jsonl", *lines), tok, 64, **kw).eval_batches(len(lines))[0]


def row(prompt, completion):
    """(ids, targets) of one row written out: the tokens, and the completion's as targets."""
    ids = np.array(prompt + completion)
    tg = np.full(len(ids), -100)
    tg[len(prompt) - 1:-1] = completion
    return ids, tg


def assert_rows(got, want):
    """got (ids, targets) of one pair == want [(ids, targets) chosen, rejected], padding aside."""
    for b, (ids, tg) in enumerate(want):
        assert list(got[0][b][:len(ids)]) == list(ids) and list(got[1][b][:len(tg)]) == list(tg), b
        assert np.all(got[1][b][len(tg):] == -100)


A = lambda text: {"role": "assistant", "content": text}
U = {"role": "user", "content": "w3"}
S = {"role": "system", "content": "w1 w2"}
TRL_STANDARD = {"prompt": "w3", "chosen": "w4 w5", "rejected": "w6"}
TRL_SYSTEM = {"prompt": [S, U], "chosen": [A("w4 w5")], "rejected": [A("w6")]}
PLAIN = [row([USER, 3, ASSISTANT], [4, 5]), row([USER, 3, ASSISTANT], [6])]
WITH_SYSTEM = [row([SYS, 1, 2, USER, 3, ASSISTANT], [4, 5]), row([SYS, 1, 2, USER, 3, ASSISTANT], [6])]

LAYOUTS = {  # mlx-lm-lora's line: (its TRL equivalent, the rows mlx-lm-lora's dataset renders)
    "dpo system": ({"system": "w1 w2", "prompt": "w3", "chosen": "w4 w5", "rejected": "w6"}, TRL_SYSTEM,
                   WITH_SYSTEM),
    "orpo messages": ({"prompt": "w3", "chosen": {"messages": [A("w4 w5")]}, "rejected": {"messages": [A("w6")]}},
                      TRL_STANDARD, PLAIN),
    "orpo content": ({"prompt": "w3", "chosen": A("w4 w5"), "rejected": {"content": "w6"}}, TRL_STANDARD, PLAIN),
    "orpo one message": ({"prompt": "w3", "chosen": [A("w4 w5")], "rejected": "w6"}, TRL_STANDARD, PLAIN),
    "orpo question": ({"question": "w3", "chosen": "w4 w5", "rejected": "w6"}, TRL_STANDARD, PLAIN),
    "orpo system messages": ({"system": "w1 w2", "prompt": "w3", "chosen": {"messages": [A("w4 w5")]},
                              "rejected": [A("w6")]}, TRL_SYSTEM, WITH_SYSTEM),
    "conversational messages": ({"prompt": [S, U], "chosen": {"messages": [A("w4 w5")]},
                                 "rejected": {"messages": [A("w6")]}}, TRL_SYSTEM, WITH_SYSTEM),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mlx_lm_lora_layouts_tokenize_as_their_trl_lines(tmp_path, name):
    theirs, trl, want = LAYOUTS[name]
    tok = tokenizer(tmp_path)
    got = load(tmp_path, tok, theirs)
    assert len(got) == 2 and all(np.array_equal(a, b) for a, b in zip(got, load(tmp_path, tok, trl)))
    assert_rows(got, want)


def test_feature_options_rename_the_keys(tmp_path):
    tok = tokenizer(tmp_path)
    keys = {"prompt": "q", "chosen": "preferred", "rejected": "dispreferred", "system": "instruction"}
    got = load(tmp_path, tok, {"instruction": "w1 w2", "q": "w3", "preferred": "w4 w5", "dispreferred": "w6"},
               keys=keys)
    assert_rows(got, WITH_SYSTEM)


def test_orpo_reads_preference_scores_and_the_others_refuse_them(tmp_path):
    tok = tokenizer(tmp_path)
    ids, tg, scores = load(tmp_path, tok, {**TRL_STANDARD, "preference_score": 8}, TRL_STANDARD, scored=True)
    assert list(scores) == [8.0, 1.0] and ids.shape[0] == 4
    assert len(load(tmp_path, tok, TRL_STANDARD, scored=True)) == 2  # no scores: TRL's rows
    with pytest.raises(DataError, match=r"p.jsonl:2: 'preference_score' weights ORPO's .* only --train-mode orpo"):
        load(tmp_path, tok, TRL_STANDARD, {**TRL_STANDARD, "preference_score": 8})
    for bad in (0, -1.5, "8", True, None):
        with pytest.raises(DataError, match=r"p.jsonl:1: 'preference_score' must be a number > 0"):
            load(tmp_path, tok, {**TRL_STANDARD, "preference_score": bad}, scored=True)


BAD = {
    "system not text": ({**TRL_STANDARD, "system": 5}, "key 'system' must be a string, got int"),
    "system with messages": ({**TRL_SYSTEM, "system": "w1"}, "'system' goes with a string prompt"),
    "object without messages": ({**TRL_STANDARD, "chosen": {"text": "w4"}},
                                "'chosen' as an object needs 'messages' or 'content'"),
    "two messages": ({**TRL_STANDARD, "chosen": [A("w4"), A("w5")]},
                     "'chosen' after a string prompt must be a string or one assistant message"),
    "a user's message": ({**TRL_STANDARD, "rejected": {"messages": [U]}},
                         "'rejected' after a string prompt must be a string or one assistant message"),
    "content not text": ({**TRL_STANDARD, "chosen": {"content": 4}}, r"messages\[0\].content must be a string"),
    "no prompt": ({"chosen": "w4", "rejected": "w5"}, "missing key 'prompt'"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_lines_are_named(tmp_path, name):
    line, msg = BAD[name]
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'p.jsonl'}:2: ") + msg):
        load(tmp_path, tokenizer(tmp_path), TRL_STANDARD, line)


def test_conversational_layouts_need_a_chat_template_and_renames_no_clash(tmp_path):
    tok = tokenizer(tmp_path, template=None)
    with pytest.raises(DataError, match="p.jsonl:1: conversational pairs need a tokenizer with a chat template"):
        load(tmp_path, tok, LAYOUTS["dpo system"][0])
    with pytest.raises(DataError, match="p.jsonl:1: has both 'question' \\(read as 'prompt'\\) and 'prompt'"):
        load(tmp_path, tok, {**TRL_STANDARD, "question": "w9"}, keys={"prompt": "question"})


def test_preference_score_is_mlx_lm_loras_orpo_loss():
    """orpo() with scores: its odds-ratio term as orpo_loss computes it (the chosen per-token
    log-probability times the score), written out here; its weights the loss's derivative."""
    rng = np.random.default_rng(0)
    n = rng.integers(1, 20, 6)
    logp, s, beta = -rng.uniform(0.2, 3.0, 6) * n, np.array([8.0, 0.5, 1.0]), 0.3
    loss, w, m = preference.orpo(logp, n, beta, nll=0.7, scores=s)
    c, r = s * logp[:3] / n[:3], logp[3:] / n[3:]
    log_odds = (c - r) - (np.log(1 - np.exp(c)) - np.log(1 - np.exp(r)))
    assert loss == pytest.approx(0.7 - beta * np.mean(-np.log1p(np.exp(-log_odds))), rel=1e-12)
    assert m["rewards/chosen"] == pytest.approx(beta * c.mean()) and m["logps/chosen"] == pytest.approx(
        (logp[:3] / n[:3]).mean())
    for i in range(6):
        e = np.zeros(6)
        e[i] = 1e-6
        fd = (preference.orpo(logp - e, n, beta, 0.7, s)[0] - preference.orpo(logp + e, n, beta, 0.7, s)[0]) / 2e-6
        assert w[i] == pytest.approx(fd, rel=1e-6, abs=1e-9), i
    assert preference.orpo(logp, n, beta, 0.7, np.ones(3))[0] == preference.orpo(logp, n, beta, 0.7)[0]
    with pytest.raises(ValueError, match=r"\[dpo\] preference scores weigh ORPO's odds ratio"):
        preference.Pairwise("dpo", 0.1).loss(np.zeros((2, 3)), np.zeros((2, 3)), np.ones((2, 3), bool),
                                             np.zeros(2), scores=np.ones(1))


# ---------------------------------------------------------------------------------------------
# GRPO

GRPO_LINES = ({"prompt": "w3", "answer": "w9", "system": "w1 w2", "type": "math"}, {"prompt": "w4", "answer": 42})


def test_grpo_reads_mlx_lm_loras_layout(tmp_path):
    """GRPODataset's {prompt, answer, system, type}: the system message before the user's turn, every
    key on every line (None where absent), renamed by the feature options; bad lines named."""
    from krnl.train.pairs import load_prompts

    tok = tokenizer(tmp_path)
    got = load_prompts(write(tmp_path / "g.jsonl", *GRPO_LINES), tok, 64)
    assert [ids for ids, _ in got] == [[SYS, 1, 2, USER, 3, ASSISTANT], [USER, 4, ASSISTANT]]
    assert [line for _, line in got] == [GRPO_LINES[0], {"prompt": "w4", "answer": 42, "system": None, "type": None}]
    renamed = load_prompts(write(tmp_path / "r.jsonl", {"question": "w3", "solution": "w9", "system": "w1 w2"}),
                           tok, 64, keys={"prompt": "question", "answer": "solution"})
    assert renamed == [([SYS, 1, 2, USER, 3, ASSISTANT], {"prompt": "w3", "answer": "w9", "system": "w1 w2"})]
    for bad, msg in (({"prompt": [U], "system": "w1"}, "'system' goes with a string prompt"),
                     ({"prompt": "w3", "system": ["w1"]}, "key 'system' must be a string, got list"),
                     ({"answer": "w9"}, "missing key 'prompt'")):
        with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'b.jsonl'}:2: ") + msg):
            load_prompts(write(tmp_path / "b.jsonl", GRPO_LINES[1], bad), tok, 64)


def test_grpo_rewards_get_the_answer_type_and_system(tmp_path):
    """The reward functions are called with each completion's line's answer=, type= and system=, as TRL
    passes a dataset's extra columns (mlx-lm-lora's functions take answer= too)."""
    import krnl
    from krnl.formats import hf
    from krnl.models.config import LoraConfig
    from krnl.train.grpo import GRPO
    from krnl.train.pairs import load_prompts

    tok = tokenizer(tmp_path)
    model = hf.load_model(tmp_path / "base", krnl.device("cpu"), lora=LoraConfig(r=2, alpha=4.0))
    seen = {}

    def reward(prompts, completions, completion_ids, **kw):
        seen.update(kw, prompts=prompts)
        return [0.0] * len(completions)

    GRPO(tok, [("r", reward)], num_generations=2, max_completion_length=2).run(
        model, load_prompts(write(tmp_path / "g.jsonl", *GRPO_LINES), tok, 64))
    assert seen == {"prompts": ["w3", "w3", "w4", "w4"], "answer": ["w9", "w9", 42, 42],
                    "system": ["w1 w2", "w1 w2", None, None], "type": ["math", "math", None, None]}


# ---------------------------------------------------------------------------------------------
# CLI

def mlx_lm_lora_pairs(n, seed):
    """n pairs in mlx-lm-lora's layouts (a system under --system-feature's name, or completions as
    message objects), the chosen completion always w5 w6 and the rejected w7 w8."""
    rng = np.random.default_rng(seed)
    lines = []
    for k in range(n):
        prompt = " ".join(f"w{i}" for i in rng.integers(10, 40, rng.integers(1, 4)))
        lines.append({"instruction": "w1", "prompt": prompt, "chosen": "w5 w6", "rejected": "w7 w8"} if k % 2 else
                     {"prompt": prompt, "chosen": {"messages": [A("w5 w6")]}, "rejected": A("w7 w8"),
                      "preference_score": 1.0 + 4 * (k % 3)})
    return lines


@pytest.mark.parametrize("mode", ["dpo", "orpo"])
def test_cli_trains_on_a_mlx_lm_lora_folder(tmp_path, mode, capsys):
    """krnl train --train-mode dpo (scores dropped) and orpo (with them) on a folder of mlx-lm-lora
    lines: the validation loss goes down; dpo refuses the scores, naming the line."""
    from krnl.cli.main import main

    tokenizer(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    strip = (lambda x: {k: v for k, v in x.items() if k != "preference_score"}) if mode == "dpo" else (lambda x: x)
    write(data / "train.jsonl", *map(strip, mlx_lm_lora_pairs(32, 1)))
    write(data / "valid.jsonl", *map(strip, mlx_lm_lora_pairs(8, 2)))
    out = tmp_path / "ad"
    args = ["train", "--model", str(tmp_path / "base"), "--data", str(data), "--device", "cpu", "--train-mode", mode,
            "--system-feature", "instruction", "--beta", "0.5", "--iters", "8", "--batch-size", "4",
            "--learning-rate", "1e-2", "--steps-per-eval", "1", "--quiet", "--no-tune", "--adapter-path", str(out)]
    assert main(args) == 0
    vals = [r["val_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert len(vals) == 8 and vals[-1] < vals[0] - 0.01, vals
    if mode == "orpo":  # the validation loss is the scored pairs' (their scores in the batches)
        import krnl
        from krnl.formats import hf
        from krnl.train.pairs import load_pairs

        split = load_pairs(data / "valid.jsonl", tokenizer(tmp_path), 64, scored=True, keys={"system": "instruction"})
        m, obj = hf.load_model(tmp_path / "base", krnl.device("cpu"), adapter=out), preference.Pairwise("orpo", 0.5)
        batches = split.eval_batches(4)
        assert len(batches[0]) == 3 and len(batches) == 2
        assert np.mean([obj.evaluate(m, *b) for b in batches]) == pytest.approx(vals[-1], rel=1e-7)
        assert abs(np.mean([obj.evaluate(m, *b[:2]) for b in batches]) - vals[-1]) > 1e-4
    if mode == "dpo":
        write(data / "train.jsonl", *mlx_lm_lora_pairs(2, 1))
        assert main(args) != 0
        assert f"{data / 'train.jsonl'}:1: 'preference_score' weights ORPO's" in capsys.readouterr().err


def test_feature_options_are_refused_in_sft():
    from collections import defaultdict
    from krnl.cli import objectives
    from krnl.cli.args import parse_args

    args = parse_args(["train", "--answer-feature", "solution"], defaultdict(lambda: None))
    with pytest.raises(ValueError, match="--answer-feature names a key of --train-mode dpo, orpo, simpo or grpo"):
        objectives.config_fields(args)
