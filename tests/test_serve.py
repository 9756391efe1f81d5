"""krnl serve against the official OpenAI client: a tiny Llama folder with a chat template and two
adapters (different alphas), served on a local port. Each answer is checked against krnl's own
generation of the same ids (greedy, or sampled with the request's seed): chat and completions,
streamed and whole, stop strings, n choices, adapters switched per request, log-probabilities
against a float64 log-softmax of the uncached forward, OpenAI-style errors, a full queue (429), a
client that leaves, and concurrent streams equal to their sequential runs."""

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the OpenAI client (pip install openai) drives the server")
pytest.importorskip("uvicorn", reason="krnl serve needs the serve extra (uvicorn, starlette)")
pytest.importorskip("starlette", reason="krnl serve needs the serve extra (uvicorn, starlette)")

import krnl  # noqa: E402
from krnl.formats.adapter import peft_config, save_adapter  # noqa: E402
from krnl.formats.hf import load_model  # noqa: E402
from krnl.models.config import LoraConfig  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
MSGS = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w9 w2"}]


def adapter(model, folder, seed, alpha):
    rng = np.random.default_rng(seed)
    lora = LoraConfig(r=2, alpha=alpha)
    tensors = {k: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.lora_state().items()}
    save_adapter(folder, tensors, peft_config(lora, base_model="", model_config=model.config), model.config)
    return folder


def post(url, body, stream=False):
    """(status, parsed JSON body) of a POST of raw bytes (or the open response, to read lines, with stream)."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        r = urllib.request.urlopen(req, timeout=30)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    return (r.status, r) if stream else (r.status, json.loads(r.read()))


class Server:
    def __init__(self, tmp, hf_folder, **opts):
        from krnl.cli.serve import build
        from krnl.serve.app import make_app, serve_in_thread

        cfg = json.loads((hf_folder / "tokenizer_config.json").read_text())
        (hf_folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
        plain = load_model(hf_folder, krnl.device("cpu"), lora=LoraConfig(r=2, alpha=4.0))
        self.paths = {"a1": adapter(plain, tmp / "a1", 1, 4.0), "a2": adapter(plain, tmp / "a2", 2, 8.0)}
        args = type("Args", (), dict(model=str(hf_folder), adapter_path=None, dtype="f32", device="cpu", q_bits=None,
                                     q_group_size=None, q_mode="affine", max_batch=8, max_queue=64, max_tokens=12,
                                     adapters=[f"{k}={v}" for k, v in self.paths.items()], **opts))
        self.engine, self.tok, names, eos = build(args)
        self.base = hf_folder.name
        assert names == {"a1": "a1", "a2": "a2", self.base: ""}
        self.server, self.thread, self.url = serve_in_thread(make_app(self.engine, self.tok, names, eos, 12))
        self.client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0)
        self.models = {name: load_model(hf_folder, krnl.device("cpu"), adapter=path) for name, path in
                       self.paths.items()}
        self.models[self.base] = load_model(hf_folder, krnl.device("cpu"))

    def close(self):
        self.server.should_exit = True
        self.thread.join()
        self.engine.stop()

    def chat_ids(self, msgs=MSGS):
        return self.tok.encode(self.tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)

    def expect(self, name, ids, max_tokens=12, temperature=0.0, seed=0):
        """krnl's own generation (text, tokens) of `ids` with model `name`."""
        out = self.models[name].generate(ids, max_tokens, temperature, seed=seed, eos_id=self.tok.eos_id)
        text_ids = out[:-1] if out and out[-1] == self.tok.eos_id else out
        return self.tok.decode(text_ids), out


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from conftest import write_hf_folder

    tmp = tmp_path_factory.mktemp("serve")
    s = Server(tmp, write_hf_folder(tmp))
    yield s
    s.close()


def test_models_and_greedy_chat_per_adapter(srv):
    assert {m.id for m in srv.client.models.list().data} == {"a1", "a2", srv.base}
    ids = srv.chat_ids()
    texts = set()
    for name in ("a1", "a2", srv.base, "a1"):  # switched per request, and back
        r = srv.client.chat.completions.create(model=name, messages=MSGS, temperature=0, max_tokens=12)
        want, toks = srv.expect(name, ids)
        assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(toks)
        assert r.choices[0].finish_reason == ("stop" if toks[-1] == srv.tok.eos_id else "length")
        texts.add(want)
    assert len(texts) == 3  # the three models answer differently


def test_streaming_stop_and_usage(srv):
    want, _ = srv.expect("a2", srv.chat_ids())
    chunks = list(srv.client.chat.completions.create(model="a2", messages=MSGS, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices
    words = want.split()
    assert len(words) >= 3
    stop = " ".join(words[1:3])
    for stream in (False, True):
        r = srv.client.chat.completions.create(model="a2", messages=MSGS, temperature=0, stop=[stop, "zz"],
                                               stream=stream)
        if stream:
            r = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in r)
            reason = [c.choices[0].finish_reason for c in r if c.choices[0].finish_reason][0]
        else:
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert text == want[:want.index(stop)] and reason == "stop"


def test_seed_and_n_choices(srv):
    ids = srv.chat_ids()
    runs = [srv.client.chat.completions.create(model="a1", messages=MSGS, temperature=1.0, seed=5, max_tokens=12)
            for _ in range(2)]
    assert runs[0].choices[0].message.content == runs[1].choices[0].message.content
    assert runs[0].choices[0].message.content == srv.expect("a1", ids, temperature=1.0, seed=5)[0]
    r = srv.client.chat.completions.create(model="a1", messages=MSGS, temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1


def test_completions_and_logprobs_against_float64(srv):
    m = srv.models["a1"]
    ids = srv.tok.encode("w7 w8 w9")
    r = srv.client.completions.create(model="a1", prompt="w7 w8 w9", temperature=0, max_tokens=4, logprobs=2)
    want, toks = srv.expect("a1", ids, max_tokens=4)
    assert r.choices[0].text == want
    z = np.asarray(m.logits(np.array([ids]))[0, -1], np.float64)
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] == pytest.approx(logp[toks[0]], abs=1e-4)
    assert sorted(lp.top_logprobs[0].values(), reverse=True) == pytest.approx(np.sort(logp)[::-1][:2], abs=1e-4)
    c = srv.client.chat.completions.create(model="a1", messages=MSGS, temperature=0, max_tokens=3, logprobs=True,
                                           top_logprobs=3)
    first = c.choices[0].logprobs.content[0]
    assert len(first.top_logprobs) == 3 and first.logprob == pytest.approx(first.top_logprobs[0].logprob)


def test_errors_are_openai_json(srv):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        srv.client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
        srv.client.chat.completions.create(model="a1", messages=MSGS, temperature="hot")
    with pytest.raises(openai.BadRequestError, match="messages"):
        srv.client.chat.completions.create(model="a1", messages=[])
    with pytest.raises(openai.BadRequestError, match="max_position_embeddings"):
        srv.client.completions.create(model="a1", prompt="w1 " * 70, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        srv.client.chat.completions.create(model="a1", messages=MSGS, presence_penalty=1.0)
    status, body = post(srv.url + "/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert post(srv.url + "/nowhere", b"{}")[0] == 404
    # still serving
    assert srv.client.completions.create(model="a1", prompt="w2", max_tokens=2).choices[0].text is not None


def test_concurrent_streams_equal_sequential_runs(srv):
    prompts = [f"w{i} w{i + 3} w{2 * i + 1}" for i in range(1, 9)]
    names = ["a1", "a2", srv.base, "a1", "a2", "a1", srv.base, "a2"]

    def stream(k):
        r = srv.client.completions.create(model=names[k], prompt=prompts[k], temperature=0, max_tokens=10, stream=True)
        return "".join(c.choices[0].text for c in r)

    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(stream, range(8)))
    assert got == [srv.expect(n, srv.tok.encode(p), max_tokens=10)[0] for n, p in zip(names, prompts)]


def test_a_client_that_leaves_frees_its_slot(srv):
    body = {"model": "a1", "prompt": "w1", "max_tokens": 40, "stream": True, "temperature": 1.0}
    status, r = post(srv.url + "/completions", json.dumps(body).encode(), stream=True)
    assert status == 200 and r.readline().startswith(b"data: ")
    r.close()
    t0 = time.time()
    while srv.engine.running and time.time() - t0 < 10:
        time.sleep(0.02)
    assert not srv.engine.running


def test_a_full_queue_answers_429(srv):
    from krnl.serve.app import make_app, serve_in_thread
    from krnl.serve.engine import Engine

    idle = Engine(srv.models["a1"], None, max_batch=1, max_queue=1)  # never started: requests only wait
    server, thread, url = serve_in_thread(make_app(idle, srv.tok, {"a1": ""}, {srv.tok.eos_id}))
    try:
        body = json.dumps({"model": "a1", "prompt": "w1", "max_tokens": 2, "stream": True}).encode()
        threading.Thread(target=lambda: post(url + "/completions", body, stream=True), daemon=True).start()
        t0 = time.time()
        while idle.pending.qsize() < 1 and time.time() - t0 < 10:
            time.sleep(0.01)
        status, err = post(url + "/completions", body)
        assert status == 429 and err["error"]["type"] == "rate_limit_exceeded"
    finally:
        server.should_exit = True
        thread.join(5)


def test_cli_serve_options(tmp_path):
    """The command line: its options parsed, bad values refused in one line, and --adapters checked."""
    from krnl.cli.args import parse_args
    from krnl.cli.main import main
    from krnl.serve.adapters import parse_adapters

    a = parse_args(["serve", "--model", "m", "--adapters", "x=a", "y=b", "--port", "9", "--max-batch", "4"],
                   {k: None for k in ("devices", "train", "eval", "generate", "fuse", "quantize", "w1", "tune", "bench",
                                      "doctor", "serve")})
    assert (a.model, a.adapters, a.port, a.max_batch, a.host) == ("m", ["x=a", "y=b"], 9, 4, "127.0.0.1")
    assert main(["serve", "--model", str(tmp_path), "--max-batch", "0"]) == 1
    (tmp_path / "ad").mkdir()
    assert parse_adapters([f"n={tmp_path / 'ad'}", str(tmp_path / "ad")]) == {"n": str(tmp_path / "ad"),
                                                                               "ad": str(tmp_path / "ad")}
    for bad, msg in (([f"n={tmp_path}", f"n={tmp_path}"], "given twice"), (["n=/nowhere"], "no adapter folder"),
                     (["=x"], "expected name=path")):
        with pytest.raises(ValueError, match=msg):
            parse_adapters(bad)
