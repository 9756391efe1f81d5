"""Tokenizers, chat templates and datasets (krnl.io.tokenizer, krnl.train.data): a tiny byte-level BPE
tokenizer trained here, chat templates in the Llama-3 and ChatML styles and the plain fallback;
masking of every non-assistant token of chats checked against the rendered template, prompt
masking, format detection per file, truncation counts, packing with attention segments (the
real model never lets a token see across a sample boundary), length-sorted batches, the trainer
over both, and every error naming its file and line."""

import importlib.util
import json

import numpy as np
import pytest

from krnl.train.data import (IGNORE_INDEX, DataError, LengthSortedBatches, Sample, chat_sample, completion_sample,
                       load_dataset, load_split, pack, text_sample)
from krnl.io.tokenizer import Tokenizer

from conftest import tiny_lora_model

tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<pad>"]

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{%- if tools is not none %}\n"
    "    {{- 'You may call these tools:\\n' }}\n"
    "    {%- for t in tools %}\n"
    "        {{- t | tojson }}\n"
    "        {{- '\\n' }}\n"
    "    {%- endfor %}\n"
    "{%- endif %}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}\n"
    "        {{- raise_exception('unknown role ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {%- if message.role == 'assistant' and message.tool_calls is defined %}\n"
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "        {%- for tc in message.tool_calls %}\n"
    "            {{- '{\"name\": \"' + tc.function.name + '\", \"parameters\": ' }}\n"
    "            {{- tc.function.arguments | tojson }}\n"
    "            {{- '}' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|eot_id|>' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}\n"
    "    {%- else %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is the weather in paris today? it is sunny and warm.",
    "you are a helpful assistant. answer briefly.",
    "system user assistant tool ipython name parameters city",
    "hello there, how are you? I am fine, thank you!",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "Two plus two is four. Three times three is nine.",
] * 3

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "hello there, how are you?"},
    {"role": "assistant", "content": "I am fine, thank you!"},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": " Two plus two is four. "},
]

TOOL_CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "what is the weather in paris today?"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                            "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"weather": "sunny"}'},
    {"role": "assistant", "content": "It is sunny in Paris."},
    {"role": "user", "content": "thank you!"},
    {"role": "assistant", "content": "You are welcome."},
]


def _train_tokenizer():
    from tokenizers import Tokenizer as Tk, decoders, models, pre_tokenizers, trainers

    tk = Tk(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, tr)
    return tk


def _write_folder(path, tk, config, post_bos=False):
    from tokenizers import processors

    path.mkdir(parents=True, exist_ok=True)
    if post_bos:
        bos = "<|begin_of_text|>"
        tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                          special_tokens=[(bos, tk.token_to_id(bos))])
    else:
        tk.post_processor = None
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    tk = _train_tokenizer()
    llama = _write_folder(root / "llama3", tk, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                                "chat_template": LLAMA3_TEMPLATE}, post_bos=True)
    chatml = _write_folder(root / "chatml", tk, {"bos_token": None, "eos_token": "<|im_end|>",
                                                 "pad_token": "<pad>", "chat_template": CHATML_TEMPLATE})
    plain = _write_folder(root / "plain", tk, {"add_bos_token": True,
                                               "bos_token": {"content": "<|begin_of_text|>", "special": True},
                                               "eos_token": "<|end_of_text|>"})
    (plain / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>"}))
    return {"llama3": llama, "chatml": chatml, "plain": plain}


@pytest.fixture(scope="module")
def toks(folders):
    return {k: Tokenizer.from_folder(v) for k, v in folders.items()}


def learned_runs(tok, s):
    """Decoded text of each maximal run of learned tokens."""
    runs, cur = [], []
    for i, l in zip(s.ids, s.learn):
        if l:
            cur.append(int(i))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


# ---------------------------------------------------------------------------------------------
# Tokenizer


def test_special_tokens_and_bos_as_the_checkpoint_defines(toks):
    ll, cm, pl = toks["llama3"], toks["chatml"], toks["plain"]
    bos = ll.tk.token_to_id("<|begin_of_text|>")
    assert ll.bos_id == bos and ll.eos_id == ll.tk.token_to_id("<|eot_id|>")
    assert ll.add_bos and not ll.add_eos            # from the post-processor
    assert ll.encode("hello")[0] == bos and ll.encode("hello", add_special_tokens=False)[0] != bos
    assert cm.bos_id is None and not cm.add_bos and cm.pad_id == cm.tk.token_to_id("<pad>")
    assert cm.encode("hello") == cm.encode("hello", add_special_tokens=False)
    assert pl.add_bos and pl.encode("hello")[0] == bos   # add_bos_token, AddedToken dict
    assert pl.pad_id == pl.tk.token_to_id("<pad>")       # special_tokens_map.json
    assert ll.pad_id == ll.eos_id                        # no pad token: the end token pads
    assert ll.decode(ll.encode("hello there, how are you?")) == "hello there, how are you?"
    assert pl.has_chat_template is False and ll.has_chat_template


def test_fallback_template_renders_prefixes(toks):
    pl = toks["plain"]
    text = pl.apply_chat_template(CHAT[:3])
    assert text == ("<|begin_of_text|>system: You are a helpful assistant.\nuser: hello there, how are you?\n"
                    "assistant: I am fine, thank you!<|end_of_text|>\n")
    assert pl.apply_chat_template(CHAT[:2], add_generation_prompt=True) == text[:text.index(" I am")]


def test_template_errors_and_generation_tag(folders, tmp_path):
    tk = tokenizers.Tokenizer.from_file(str(folders["chatml"] / "tokenizer.json"))
    tpl = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
           "{% else %}{{ m.content }}{% endif %}{% endfor %}")
    tok = Tokenizer(tk, {"eos_token": "<|im_end|>"}, chat_template=tpl)
    assert tok.apply_chat_template(CHAT[1:3]) == "hello there, how are you?I am fine, thank you!"
    with pytest.raises(Exception, match="unknown role"):
        Tokenizer.from_folder(folders["llama3"]).apply_chat_template([{"role": "robot", "content": "x"}])


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_rendering_matches_transformers(folders, toks, name):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(folders[name]))
    tok = toks[name]
    for msgs, tools in ((CHAT, None), (CHAT[:2], None), (TOOL_CHAT, TOOLS)):
        if name == "chatml" and tools:
            continue  # the ChatML template here has no tool calls
        for gen in (False, True):
            ours = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen)
            theirs = hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False)
            assert ours == theirs
        ids = hf.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        assert list(chat_sample(tok, msgs, tools).ids) == list(ids)
    assert tok.encode("hello there") == hf("hello there")["input_ids"]


# ---------------------------------------------------------------------------------------------
# Samples and masking


@pytest.mark.parametrize("name", ["llama3", "chatml", "plain"])
def test_chat_mask_covers_exactly_every_assistant_turn(toks, name):
    tok = toks[name]
    end = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>\n", "plain": "<|end_of_text|>\n"}[name]
    strip = name == "llama3"  # that template trims contents
    convs = [(CHAT, None)] + ([(TOOL_CHAT, TOOLS)] if name != "chatml" else [])
    for msgs, tools in convs:
        s = chat_sample(tok, msgs, tools)
        full = tok.apply_chat_template(msgs, tools=tools)
        assert tok.decode(s.ids, skip_special_tokens=False) == full
        expected = []
        for m in msgs:
            if m["role"] != "assistant":
                continue
            if m.get("tool_calls"):
                f = m["tool_calls"][0]["function"]
                body = '{"name": "' + f["name"] + '", "parameters": ' + json.dumps(f["arguments"]) + "}"
                if name == "plain":
                    body = json.dumps(f)
            else:
                body = m["content"].strip() if strip else m["content"]
            if name == "plain":
                body = " " + body
            expected.append(body + end)
        runs = learned_runs(tok, s)
        assert runs == expected, (runs, expected)
        # Every learned run sits where the template put an assistant turn, in order.
        pos = 0
        for r in runs:
            pos = full.index(r, pos) + len(r)
        # Targets: position t predicts token t+1 exactly where that token is learned.
        t = s.targets()
        assert np.array_equal(t[:-1] != IGNORE_INDEX, s.learn[1:]) and t[-1] == IGNORE_INDEX
        assert np.array_equal(t[:-1][s.learn[1:]], s.ids[1:][s.learn[1:]])
        # Without masking every token is learned.
        assert chat_sample(tok, msgs, tools, mask=False).learn.all()


def test_prompt_completion_masking(toks):
    pl, cm = toks["plain"], toks["chatml"]
    s = completion_sample(pl, "what is two plus two?", " four")
    assert s.ids[0] == pl.bos_id and s.ids[-1] == pl.eos_id
    assert learned_runs(pl, s) == [" four<|end_of_text|>"]
    assert pl.decode(s.ids[~s.learn], skip_special_tokens=False) == "<|begin_of_text|>what is two plus two?"
    s = completion_sample(pl, "what is two plus two?", " four", mask=False)
    assert s.learn.all()
    # With a chat template, prompt and completion are a user and an assistant turn (as mlx-lm does).
    s = completion_sample(cm, "what is two plus two?", "four")
    assert cm.decode(s.ids, skip_special_tokens=False) == cm.apply_chat_template(
        [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four"}])
    assert learned_runs(cm, s) == ["four<|im_end|>\n"]


def test_text_learns_everything(toks):
    ll = toks["llama3"]
    s = text_sample(ll, "the quick brown fox")
    assert s.ids[0] == ll.bos_id and s.ids[-1] == ll.eos_id and s.learn.all()
    assert s.n_targets == len(s) - 1


def _write(folder, name, rows):
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / f"{name}.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def test_format_detected_per_file_and_truncation_counted(toks, tmp_path):
    tok = toks["llama3"]
    _write(tmp_path, "train", [{"text": "the quick brown fox jumps over the lazy dog"}, {"text": "hello"}, "",
                               {"text": "Two plus two is four. Three times three is nine. " * 4}])
    _write(tmp_path, "valid", [{"prompt": "what is two plus two?", "completion": "four"}])
    _write(tmp_path, "test", [{"messages": CHAT}, {"messages": TOOL_CHAT, "tools": TOOLS}])
    ds = load_dataset(tmp_path, tok, max_seq_length=40)
    assert [ds[k].format for k in ("train", "valid", "test")] == ["text", "completions", "chat"]
    tr = ds["train"]
    assert len(tr.samples) == 3 and tr.n_lines == 3 and [s.line for s in tr.samples] == [1, 2, 4]
    full = [len(text_sample(tok, r)) for r in ("the quick brown fox jumps over the lazy dog", "hello",
                                                "Two plus two is four. Three times three is nine. " * 4)]
    assert tr.n_truncated == sum(n > 40 for n in full) >= 1
    assert max(len(s) for s in tr.samples) == 40 and f"{tr.n_truncated} truncated to 40" in tr.summary()
    chats = [len(chat_sample(tok, CHAT)), len(chat_sample(tok, TOOL_CHAT, TOOLS))]
    assert ds["test"].n_truncated == sum(n > 40 for n in chats) >= 1
    # Missing optional splits are None; train is required.
    (tmp_path / "test.jsonl").unlink()
    assert load_dataset(tmp_path, tok, 64)["test"] is None
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(DataError, match="no train.jsonl"):
        load_dataset(tmp_path, tok, 64)


# ---------------------------------------------------------------------------------------------
# Packing and batching


def _samples(lengths, seed=0, V=61):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        learn = rng.random(n) < 0.7
        learn[-1] = True
        out.append(Sample(rng.integers(3, V, n).astype(np.int32), learn))
    return out


def test_pack_segments_positions_and_targets():
    lengths = [5, 3, 7, 2, 4, 8, 1, 6]
    ss = _samples(lengths)
    p = pack(ss, 8, pad_id=0)
    assert p.ids.shape[1] == 8 and len(p.ids) == len(p.rows) == 5   # 36 tokens: best fit needs 5 rows
    assert sorted(i for r in p.rows for i in r) == list(range(len(ss)))
    for r, members in enumerate(p.rows):
        t = 0
        for j, i in enumerate(members):
            n = lengths[i]
            assert np.array_equal(p.ids[r, t:t + n], ss[i].ids)
            assert np.array_equal(p.targets[r, t:t + n], ss[i].targets())
            assert p.targets[r, t + n - 1] == IGNORE_INDEX     # never predicts the next sample
            assert (p.segments[r, t:t + n] == j).all() and np.array_equal(p.positions[r, t:t + n], np.arange(n))
            t += n
        assert (p.ids[r, t:] == 0).all() and (p.targets[r, t:] == IGNORE_INDEX).all()
        assert (p.segments[r, t:] == len(members)).all()
    with pytest.raises(DataError, match="does not fit"):
        pack(_samples([9]), 8)


def _model(dev, vocab=61, seed=0):
    return tiny_lora_model(dev, "f32", seed, vocab_size=vocab, max_position_embeddings=64)


def test_packed_attention_never_crosses_a_sample_boundary(dev):
    m = _model(dev)
    s1, s2 = _samples([5, 6], seed=3)
    p = pack([s1, s2], 12)
    (r,) = range(len(p.ids))
    first, second = p.rows[0]
    a, b = (s1, s2) if first == 0 else (s2, s1)     # a sits first in the row
    na, nb = len(a), len(b)
    kw = dict(segments=p.segments, positions=p.positions)
    base = m.logits(p.ids, **kw)
    pert = p.ids.copy()
    pert[0, 1] = (pert[0, 1] + 7) % 61                 # change a token of the first sample
    other = m.logits(pert, **kw)
    assert not np.allclose(base[0, 1:na], other[0, 1:na])                  # it matters to its own sample
    np.testing.assert_allclose(other[0, na:na + nb], base[0, na:na + nb], rtol=0, atol=1e-6)
    alone_b = m.logits(b.ids[None])[0]
    alone_a = m.logits(a.ids[None])[0]
    np.testing.assert_allclose(base[0, na:na + nb], alone_b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(base[0, :na], alone_a, rtol=1e-4, atol=1e-5)
    # Without segments and positions the same row leaks (the test above is not vacuous).
    assert not np.allclose(m.logits(pert)[0, na:na + nb], m.logits(p.ids)[0, na:na + nb], atol=1e-4)

    # Loss and LoRA gradients of the packed row are the token-weighted mix of the samples alone.
    ta, tb = a.targets()[None], b.targets()[None]
    ka, kb = int((ta != IGNORE_INDEX).sum()), int((tb != IGNORE_INDEX).sum())
    lp = m.loss(p.ids, p.targets, **kw)
    la, lb = m.loss(a.ids[None], ta), m.loss(b.ids[None], tb)
    np.testing.assert_allclose(lp, (ka * la + kb * lb) / (ka + kb), rtol=1e-5)
    m.zero_grads()
    with dev.step():
        m.forward_backward(p.ids, p.targets, **kw)
    gp = m.lora_grads()
    m.zero_grads()
    with dev.step():
        m.forward_backward(a.ids[None], ta, loss_scale=ka / (ka + kb))
    with dev.step():
        m.forward_backward(b.ids[None], tb, loss_scale=kb / (ka + kb))
    gs = m.lora_grads()
    for k in gp:
        np.testing.assert_allclose(gp[k], gs[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_segments_and_positions_are_validated(dev):
    m = _model(dev)
    ids = np.zeros((1, 6), np.int32)
    with pytest.raises(ValueError, match="segments must be a"):
        m.logits(ids, segments=np.zeros((1, 5), np.int32), positions=np.zeros((1, 6), np.int32))
    with pytest.raises(ValueError, match="positions must lie"):
        m.logits(ids, positions=np.full((1, 6), 64, np.int32))


def test_length_sorted_batches():
    lengths = [9, 2, 5, 7, 3, 8, 4, 6, 1, 10]
    ss = _samples(lengths)
    lsb = LengthSortedBatches(ss, 3, seed=4)
    seen = []
    for _ in range(3):                                 # one epoch: 10 // 3 full batches
        ids, tg = lsb.next()
        assert ids.shape[0] == 3 and ids.shape == tg.shape
        seen.append(ids.shape[1])
    assert sorted(seen) == [3, 6, 9]                   # batches of lengths (1,2,3), (4,5,6), (7,8,9)
    st = lsb.state()
    nxt = lsb.next()
    lsb2 = LengthSortedBatches(ss, 3, seed=4)
    lsb2.load_state(st)
    assert all(np.array_equal(x, y) for x, y in zip(nxt, lsb2.next()))
    ids, tg = LengthSortedBatches(ss, 3, seed=4).next()
    for row_i, row_t in zip(ids, tg):
        s = next(s for s in ss if len(s) <= len(row_i) and np.array_equal(s.ids, row_i[:len(s)]))
        assert np.array_equal(row_t[:len(s)], s.targets()) and (row_t[len(s):] == IGNORE_INDEX).all()
    with pytest.raises(DataError, match="fewer than one batch"):
        LengthSortedBatches(ss[:2], 3, seed=0)


@pytest.mark.parametrize("packing", [True, False])
def test_trainer_runs_on_a_split(dev, toks, tmp_path, packing):
    from krnl.train.trainer import TrainConfig, Trainer

    tok = toks["chatml"]
    rows = [{"messages": [{"role": "user", "content": f"what is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a + b}"}]} for a in range(4) for b in range(3)]
    _write(tmp_path / "d", "train", rows)
    _write(tmp_path / "d", "valid", rows[:4])
    m = _model(dev, vocab=tok.vocab_size + 3)
    ds = load_dataset(tmp_path / "d", tok, 48, pack=packing, vocab_size=m.config.vocab_size)
    cfg = TrainConfig(iters=3, batch_size=2, learning_rate=1e-2, warmup=0, val_every=0, save_every=0)
    res = Trainer(m, cfg, ds["train"], ds["valid"], out_dir=tmp_path / "out", progress=False).run()
    assert np.isfinite(res["loss"]) and np.isfinite(res["val_loss"])


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("rows, match", [
    ([{"text": "hello"}, "{\"text\": \"broken", {"text": "x"}], r"train\.jsonl:2: malformed JSON"),
    ([{"text": "hello"}, "[1, 2]"], r"train\.jsonl:2: expected a JSON object"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": "c"}], r"train\.jsonl:2: missing key 'completion'"),
    ([{"text": "hello"}, {"prompt": "a", "completion": "b"}], r"train\.jsonl:2: missing key 'text'"),
    ([{"text": "hello"}, {"text": 5}], r"train\.jsonl:2: key 'text' must be a string"),
    ([{"input": "hello"}], r"train\.jsonl:1: cannot tell the format"),
    ([{"messages": []}], r"train\.jsonl:1: 'messages' must be a non-empty list"),
    ([{"messages": CHAT}, {"messages": [{"content": "hi"}]}], r"train\.jsonl:2: messages\[0\] has no 'role'"),
    ([{"messages": [{"role": "user", "content": ["a"]}]}], r"train\.jsonl:1: messages\[0\]\.content must be a string"),
    ([{"messages": CHAT}, {"messages": CHAT, "tools": "x"}], r"train\.jsonl:2: 'tools' must be a list"),
    ([{"messages": CHAT}, {"messages": [{"role": "robot", "content": "x"}]}],
     r"train\.jsonl:2: cannot render .*unknown role robot"),
    (["", "  "], r"train\.jsonl: the split is empty"),
    ([{"messages": CHAT[:2]}], r"train\.jsonl: no sample has anything to learn"),
])
def test_errors_name_file_and_line(toks, tmp_path, rows, match):
    _write(tmp_path, "train", rows)
    with pytest.raises(DataError, match=match):
        load_dataset(tmp_path, toks["llama3"], 64)


def test_empty_split_and_vocab_mismatch(toks, tmp_path):
    tok = toks["llama3"]
    _write(tmp_path, "train", [{"text": "hello"}])
    (tmp_path / "valid.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"valid\.jsonl: the split is empty"):
        load_dataset(tmp_path, tok, 64)
    (tmp_path / "valid.jsonl").unlink()
    with pytest.raises(ValueError, match=r"tokenizer has ids up to \d+ but the model's vocab_size is 100"):
        load_dataset(tmp_path, tok, 64, vocab_size=100)
    with pytest.raises(DataError, match=r"train\.jsonl:1: token id \d+ is outside the model's vocabulary of 5"):
        load_split(tmp_path / "train.jsonl", tok, 64, vocab_size=5)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    with pytest.raises(DataError, match="is not a folder"):
        load_dataset(tmp_path / "nope", tok, 64)
