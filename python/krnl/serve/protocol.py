"""OpenAI's request and response bodies for /v1/chat/completions and /v1/completions: a request
checked into (prompt ids, Sampling, adapter name, stream options), and the JSON of responses,
stream chunks and errors, shaped as the official client reads them."""

import math
import time
import uuid
from dataclasses import dataclass

from .engine import Sampling


class ApiError(Exception):
    """An error answered as {"error": {...}} with an HTTP status (400, 404, 422, 429, 500)."""

    def __init__(self, status, message, param=None, kind="invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self):
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Call:
    ids: list
    sampling: Sampling
    adapter: str
    model: str
    stream: bool
    usage_in_stream: bool


def _number(body, key, default, lo, hi, integer=False):
    v = body.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise ApiError(422, f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
    if not (lo <= v <= hi) or not math.isfinite(v):
        raise ApiError(400, f"'{key}' must be between {lo} and {hi}, got {v!r}", key)
    return int(v) if integer else float(v)


def _stop(body):
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise ApiError(422, "'stop' must be a string or a list of at most 4 strings", "stop")
    return tuple(s for s in stop if s)


def _unsupported(body, keys):
    for key, neutral in keys:
        if body.get(key, neutral) not in (neutral, None):
            raise ApiError(400, f"'{key}' = {body[key]!r} is not supported by krnl serve", key)


def parse(body, chat, models, tok, default_max_tokens):
    """Call of a request body; models {served name: adapter name ("" for the base model)}."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if name is None:
        name = next(iter(models))
    if not isinstance(name, str):
        raise ApiError(422, "'model' must be a string", "model")
    if name not in models:
        raise ApiError(404, f"the model '{name}' does not exist; this server has {', '.join(models)}", "model",
                       code="model_not_found")
    _unsupported(body, (("frequency_penalty", 0), ("presence_penalty", 0), ("echo", False), ("suffix", None),
                        ("best_of", 1), ("logit_bias", None), ("tools", None)))
    ids = _chat_ids(body, tok) if chat else _completion_ids(body, tok)
    if chat:
        want = body.get("logprobs", False)
        if not isinstance(want, bool):
            raise ApiError(422, "'logprobs' must be a boolean", "logprobs")
        logprobs = _number(body, "top_logprobs", 0, 0, 20, True) if want else -1
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        logprobs = -1 if body.get("logprobs") is None else _number(body, "logprobs", 0, 0, 5, True)
        limit = body.get("max_tokens", 16)
    s = Sampling(max_tokens=_number({"max_tokens": limit}, "max_tokens", default_max_tokens, 1, 1 << 20, True),
                 temperature=_number(body, "temperature", 1.0, 0, 2), top_p=_number(body, "top_p", 1.0, 0, 1),
                 top_k=_number(body, "top_k", 0, 0, 1 << 20, True), n=_number(body, "n", 1, 1, 128, True),
                 seed=None if body.get("seed") is None else _number(body, "seed", 0, -(1 << 63), (1 << 63) - 1, True),
                 stop=_stop(body), logprobs=logprobs)
    if s.top_p == 0:
        raise ApiError(400, "'top_p' must be above 0", "top_p")
    if s.seed is not None and s.seed < 0:
        s.seed = s.seed % (1 << 64)  # numpy's generators take non-negative seeds
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(422, "'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(422, "'stream_options' must be an object", "stream_options")
    return Call(ids, s, models[name], name, stream, bool(opts.get("include_usage")))


def _content(m, i):
    c = m.get("content")
    if isinstance(c, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
        return "".join(p["text"] for p in c)
    if c is None and m.get("role") == "assistant":
        return ""
    if not isinstance(c, str):
        raise ApiError(422, f"messages[{i}].content must be a string or a list of text parts", "messages")
    return c


def _chat_ids(body, tok):
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user, assistant, developer or tool",
                           "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m, i)})
    if not tok.has_chat_template:
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        text = tok.apply_chat_template(out, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001: the template's own checks (raise_exception) name the problem
        raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
    return tok.encode(text, add_special_tokens=False)


def _completion_ids(body, tok):
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str) and p:
        return tok.encode(p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise ApiError(400, "'prompt' must be a non-empty string, a list of token ids, or a list of one of them", "prompt")


def new_id(chat):
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def envelope(rid, chat, model, choices, usage=None, chunk=False):
    out = {"id": rid, "object": ("chat.completion" + (".chunk" if chunk else "")) if chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt, completion):
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def logprobs_json(tok, chat, tokens, offset=0):
    """The logprobs of a choice's Tokens (engine.Token with logprob/top) as each endpoint writes them."""
    def piece(i):
        return tok.decode([i])

    if chat:
        return {"content": [{"token": piece(t.id), "logprob": t.logprob, "bytes": list(piece(t.id).encode()),
                             "top_logprobs": [{"token": piece(i), "logprob": lp, "bytes": list(piece(i).encode())}
                                              for i, lp in t.top]} for t in tokens]}
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [piece(t.id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{piece(i): lp for i, lp in t.top} for t in tokens], "text_offset": offsets}
