"""The serving workload: `krnl serve` (its engine and HTTP API on uvicorn, a local port) under 1, 4
and 16 concurrent streaming clients, each sending its requests one after another: a prompt of P
token ids for exactly M new tokens (the model has no EOS), greedy. Reported per client count:
generated tokens/s over the round, requests/s, and the requests' latency (request sent to last
chunk read) p50 and p99. The model is pref.py's (train.py's "1b" shape, random weights, LoRA r=16
on the seven projections; "quick" on the CPU).

Next to it, transformers' generate on the PEFT model with the same prompts, the C requests of a
round batched into one call (the best a client-less batch can do): tokens/s and the call's time as
every request's latency."""

import json
import threading
import time
import urllib.request

import numpy as np

from . import pref
from .qlora import with_peer

SIZES = {
    "full": dict(shape="1b", prompt=128, new=128, requests=4, clients=(1, 4, 16)),
    "quick": dict(shape="quick", prompt=6, new=8, requests=2, clients=(1, 4, 16)),
}
SKIP = "sized for the H200 (the 1b shape); --quick runs a small one here"


def krnl_tokenizer(s):
    """A word-level tokenizer of the shape's vocabulary ("t0" .. "t{V-1}"): the server decodes text."""
    import tokenizers
    from ..io.tokenizer import Tokenizer
    V = pref.train.shape(s["shape"])["V"]
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tk.decoder = tokenizers.decoders.WordPiece(prefix="##")
    return Tokenizer(tk)


def start_server(model, tok, max_batch):
    """(uvicorn server, its thread, engine, base URL): krnl serve's app on a free local port."""
    from ..serve.app import make_app, serve_in_thread
    from ..serve.engine import Engine
    engine = Engine(model, None, max_batch=max_batch, max_queue=4 * max_batch).start()
    server, thread, url = serve_in_thread(make_app(engine, tok, {"krnl": ""}, set()))
    return server, thread, engine, url


def stream(url, ids, new):
    """Seconds from sending a streamed completion request to its last chunk; checks it held `new` tokens."""
    body = json.dumps({"model": "krnl", "prompt": [int(i) for i in ids], "max_tokens": new, "temperature": 0,
                       "stream": True}).encode()
    t0 = time.perf_counter()
    req = urllib.request.Request(url + "/completions", data=body, headers={"Content-Type": "application/json"})
    chunks = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunks += bool(json.loads(line[6:])["choices"][0]["text"])
    dt = time.perf_counter() - t0
    if chunks != new:
        raise RuntimeError(f"[krnl bench] serve: a stream carried {chunks} tokens, expected {new}")
    return dt


def round_figures(label, C, s, seconds, latencies):
    lat = np.asarray(latencies) * 1e3
    n = C * s["requests"]
    return dict(impl=label, tokens_per_s=n * s["new"] / seconds, ms=float(np.percentile(lat, 50)), samples=n, peak_bytes=None,
                note=f"{n / seconds:.2f} req/s, p50 {np.percentile(lat, 50):.0f} ms, p99 {np.percentile(lat, 99):.0f} ms")


def run_krnl(dev, s, prompts, dtype, log=print):
    model = pref.krnl_model(dev, s, dtype)
    server, thread, engine, url = start_server(model, krnl_tokenizer(s), max(s["clients"]))
    rows = []
    try:
        stream(url, prompts[0], s["new"])  # warm-up: the first step's allocations
        for C in s["clients"]:
            lat = [[] for _ in range(C)]

            def client(c):
                for r in range(s["requests"]):
                    lat[c].append(stream(url, prompts[(c * s["requests"] + r) % len(prompts)], s["new"]))

            threads = [threading.Thread(target=client, args=(c,)) for c in range(C)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            row = round_figures(f"krnl serve x{C}", C, s, time.perf_counter() - t0, sum(lat, []))
            log(f"krnl bench: serve {row['impl']}: {row['tokens_per_s']:,.0f} tokens/s, {row['note']}")
            rows.append(row)
    finally:
        server.should_exit = True
        thread.join()
        engine.stop()
    return rows


def run_hf(s, prompts, on_gpu, log=print):
    import torch
    import transformers
    pm = pref.peft_model(s, on_gpu)
    pm.eval()
    cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=s["new"], min_new_tokens=s["new"],
                                        eos_token_id=None, pad_token_id=0, use_cache=True)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    rows = []
    for C in s["clients"]:
        x = torch.as_tensor(prompts[:C], dtype=torch.long, device="cuda" if on_gpu else "cpu")
        with torch.no_grad():
            pm.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=cfg)  # warm-up
            sync()
            calls = []
            for _ in range(s["requests"]):
                t0 = time.perf_counter()
                out = pm.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=cfg)
                sync()
                calls.append(time.perf_counter() - t0)
        if out.shape[1] - x.shape[1] != s["new"]:
            raise RuntimeError(f"[krnl bench] serve: transformers generated {out.shape[1] - x.shape[1]} tokens")
        row = round_figures(f"HF generate x{C}", C, s, sum(calls), [t for t in calls for _ in range(C)])
        log(f"krnl bench: serve {row['impl']}: {row['tokens_per_s']:,.0f} tokens/s, {row['note']}")
        rows.append(dict(row, base=len(rows), note=row["note"] + ", " + pref.versions()))
    return rows


def run(dev, dtype="bf16", quick=False, peers=True, log=print, profile=False):
    """Rows for the session: krnl serve at each client count, then transformers' generate."""
    s = SIZES["quick" if quick else "full"]
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return [dict(impl="krnl serve", status="skipped", reason=f"{e.name} is not installed (pip install 'krnl[serve]')")]
    n = max(s["clients"]) * s["requests"]
    prompts = pref.tokens(np.random.default_rng(0), s, n, s["prompt"])
    desc = (f"krnl serve, streamed completions of {s['prompt']} prompt ids + {s['new']} greedy tokens, "
            f"{s['requests']} requests per client, clients {'/'.join(map(str, s['clients']))}; {pref.describe(s)}")
    rows = run_krnl(dev, s, prompts, dtype, log)
    rows[0]["title"] = desc
    k = len(rows)
    return with_peer(rows, dev, peers, lambda on_gpu: pref.peer_rows("HF generate", lambda: run_hf(s, prompts, on_gpu, log),
                                                                       trl=False), first=k, name="HF generate")
