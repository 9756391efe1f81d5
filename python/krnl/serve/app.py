"""The HTTP side of `krnl serve` (Starlette on uvicorn, the `serve` extra): /v1/models,
/v1/chat/completions and /v1/completions, streamed as server-sent events or answered whole. A
request becomes an engine.Request whose events the engine's thread hands to this request's
asyncio queue; a client that goes away cancels its request, which frees its place in the batch."""

import asyncio
import json
import threading
import time

from .engine import QueueFull, Request
from .protocol import ApiError, envelope, logprobs_json, new_id, parse, usage


def make_app(engine, tok, models, eos_ids, default_max_tokens=512):
    """The Starlette app over a started engine; models {served name: adapter name ("" base)}."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    created = int(time.time())

    def error(e):
        return JSONResponse(e.body(), status_code=e.status)

    async def list_models(request):
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model", "created": created,
                                                          "owned_by": "krnl"} for m in models]})

    def handler(chat):
        async def complete(request):
            try:
                try:
                    body = json.loads(await request.body())
                except (ValueError, UnicodeDecodeError) as e:
                    raise ApiError(400, f"the request body is not JSON: {e}") from None
                call = parse(body, chat, models, tok, default_max_tokens)
                try:
                    engine.check(call.ids, call.sampling)
                except ValueError as e:
                    raise ApiError(400, str(e).removeprefix("[generate] ")) from None
                loop, events = asyncio.get_running_loop(), asyncio.Queue()
                req = Request(call.ids, call.sampling, lambda *ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                              call.adapter, tok, eos_ids)
                try:
                    engine.submit(req)
                except QueueFull as e:
                    raise ApiError(429, str(e), kind="rate_limit_exceeded") from None
            except ApiError as e:
                return error(e)
            run = Run(chat, call, req, events, tok)
            if call.stream:
                return StreamingResponse(run.stream(), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            try:
                return JSONResponse(await run.whole())
            except ApiError as e:
                return error(e)
            finally:
                req.cancelled = True  # a no-op once done; frees the slot of a client that left

        return complete

    async def not_found(request, exc):
        return error(ApiError(404, f"no route {request.method} {request.url.path}", kind="not_found_error"))

    async def bad_method(request, exc):
        return error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    return Starlette(routes=[Route("/v1/models", list_models, methods=["GET"]),
                             Route("/v1/chat/completions", handler(True), methods=["POST"]),
                             Route("/v1/completions", handler(False), methods=["POST"])],
                     exception_handlers={404: not_found, 405: bad_method})


def serve_in_thread(app):
    """(uvicorn server, its thread, its /v1 URL): app served on a free local port from a thread (the
    bench and the tests); server.should_exit = True, then thread.join(), stops it."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"


class Run:
    """One request's events turned into the endpoint's response or stream."""

    def __init__(self, chat, call, req, events, tok):
        self.chat, self.call, self.req, self.events, self.tok = chat, call, req, events, tok
        self.id = new_id(chat)

    def _choice(self, i, text, reason=None, tokens=None, delta=None, offset=0):
        lp = None if tokens is None or self.call.sampling.logprobs < 0 else logprobs_json(self.tok, self.chat, tokens, offset)
        if self.chat:
            body = {"delta": delta} if delta is not None else {"message": {"role": "assistant", "content": text}}
            return {"index": i, **body, "logprobs": lp, "finish_reason": reason}
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

    def _usage(self):
        return usage(len(self.call.ids), sum(len(t) for t in self.req.tokens))

    async def whole(self):
        n = self.call.sampling.n
        texts, toks, reasons = [""] * n, [[] for _ in range(n)], [None] * n
        while True:
            ev = await self.events.get()
            if ev[0] == "token":
                texts[ev[1]] += ev[2].text
                toks[ev[1]].append(ev[2])
            elif ev[0] == "finish":
                texts[ev[1]] += ev[3]
                reasons[ev[1]] = ev[2]
            elif ev[0] == "error":
                raise ApiError(500, f"generation failed: {ev[1]}", kind="server_error")
            else:
                break
        choices = [self._choice(i, texts[i], reasons[i], toks[i]) for i in range(n)]
        return envelope(self.id, self.chat, self.call.model, choices, self._usage())

    def _sse(self, choices, usage=None):
        return f"data: {json.dumps(envelope(self.id, self.chat, self.call.model, choices, usage, chunk=True))}\n\n"

    async def stream(self):
        sent = [0] * self.call.sampling.n  # characters streamed per choice: the completions' text_offset
        try:
            if self.chat:
                yield self._sse([self._choice(i, "", delta={"role": "assistant", "content": ""})
                                 for i in range(self.call.sampling.n)])
            while True:
                ev = await self.events.get()
                if ev[0] == "token":
                    i, t = ev[1], ev[2]
                    if t.text or self.call.sampling.logprobs >= 0:
                        yield self._sse([self._choice(i, t.text, tokens=[t], delta={"content": t.text}, offset=sent[i])])
                        sent[i] += len(t.text)
                elif ev[0] == "finish":
                    i, reason, rest = ev[1], ev[2], ev[3]
                    yield self._sse([self._choice(i, rest, reason, delta={"content": rest} if rest else {})])
                elif ev[0] == "error":
                    yield f"data: {json.dumps(ApiError(500, f'generation failed: {ev[1]}', kind='server_error').body())}\n\n"
                    break
                else:
                    if self.call.usage_in_stream:
                        yield self._sse([], self._usage())
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.req.cancelled = True  # the client left (or the stream ended): its slot is free
