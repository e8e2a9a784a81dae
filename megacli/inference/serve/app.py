"""The HTTP side of megacli serve (FastAPI): OpenAI's /v1/models, /v1/completions and
/v1/chat/completions (streamed as server-sent events with sse-starlette), /health and /metrics.
Requests become ``batcher.Sequence``s; their tokens come back through an asyncio queue per
sequence. Every failure is answered as OpenAI's error JSON: {"error": {"message", "type", "param",
"code"}}.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import threading
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from megacli.errors import UserError
from megacli.inference.serve.batcher import Batcher, QueueFull, Sampling, Sequence, Token, TooBig
from megacli.inference.serve.grammar import GrammarError, Grammars
from megacli.inference.serve.protocol import ChatRequest, CompletionRequest

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                503: "overloaded_error", 500: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass
class Served:
    """What the routes need: the model's name, tokenizer (a ``generator.Generator`` for encoding
    prompts as `megacli generate` does), context length, the batcher, metrics, the API key."""

    name: str
    generator: object
    context: int
    batcher: Batcher
    default_max_tokens: int
    api_key: str | None
    chat_template: object  # callable(messages) -> prompt text, or None
    shutdown_grace: float
    grammars: Grammars | None = None  # response_format's JSON schemas


class _Mailbox:
    """Events from the batcher's thread to the event loop's queues, with one wake-up of the loop for
    all that arrive before it takes them (a decoding step emits a few per sequence)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.called = False  # a wake-up is on its way

    def put(self, queue: asyncio.Queue, item) -> None:  # the batcher's thread
        with self.lock:
            self.items.append((queue, item))
            if self.called:
                return
            self.called = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop is closed: the server stopped, nobody waits for this
            pass

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.called = self.items, collections.deque(), False
        for queue, item in items:
            queue.put_nowait(item)


class _Choice:
    """One sequence's events, gathered on the event loop."""

    def __init__(self, mailbox: _Mailbox):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.mailbox = mailbox

    def emit(self, kind: str, value) -> None:  # the batcher's thread
        self.mailbox.put(self.queue, (kind, value))


def build_app(served: Served) -> FastAPI:
    app = FastAPI(title="megacli serve", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    routes = _Routes(served)

    @app.get("/health")
    async def health():
        if served.batcher.error is not None:
            return error_response(500, f"the model failed: {served.batcher.error}")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request):
        return PlainTextResponse(served.batcher.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "megacli"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await routes.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await routes.chat(body, request)

    app.add_middleware(_Gate, api_key=served.api_key, metrics=served.batcher.metrics,
                       endpoints=frozenset(route.path for route in app.routes))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure answered as OpenAI's error JSON."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc)
        message = first.get("msg", "invalid request")
        return error_response(400, f"{where}: {message}" if where else message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(500, f"{type(exc).__name__}: {exc}")


class _Routes:
    """The completion routes: a request's prompts encoded and checked, submitted to the batcher as
    sequences, and their tokens answered whole or streamed."""

    def __init__(self, served: Served):
        self.served = served
        self.tok = served.generator.tok
        self.mailbox: _Mailbox | None = None  # for the server's event loop, once it runs

    def check_model(self, name: str) -> None:
        if name != self.served.name:
            raise ApiError(404, f"model {name!r} does not exist; this server has {self.served.name!r}", "model")

    def check_size(self, count: int, param: str) -> None:
        try:
            self.served.batcher.check_size(count)
        except TooBig as exc:
            raise ApiError(400, str(exc), param) from None

    def encode(self, prompt, param: str) -> list[int]:
        served = self.served
        if isinstance(prompt, list):
            bad = [i for i in prompt if not 0 <= i < served.generator.model.vocab_size]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{served.generator.model.vocab_size - 1})", param)
            if not prompt:
                raise ApiError(400, "a prompt has no tokens", param)
            return list(prompt)
        try:
            return served.generator.encode(prompt)
        except UserError as exc:
            raise ApiError(400, str(exc), param) from None

    def budget(self, ids: list[int], asked: int | None, *, default: int | None) -> int:
        """max_tokens for a prompt: as asked (or the default, or what the context leaves)."""
        context = self.served.context
        room = context - len(ids)
        if room <= 0 or (asked is not None and asked > room):
            raise ApiError(400, f"the prompt has {len(ids)} tokens" + (f" and max_tokens is {asked}" if asked else "")
                           + f": more than the model's context of {context} tokens", "prompt" if room <= 0 else "max_tokens")
        if asked is not None:
            return asked
        return room if default is None else min(default, room)

    def logit_bias(self, req) -> dict[int, float]:
        vocab = self.served.generator.model.vocab_size
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        bad = [t for t in bias if t >= vocab]
        if bad:
            raise ApiError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "logit_bias")
        return bias

    def grammar(self, req) -> str | None:
        if (req.response_format or {}).get("type", "text") == "text":
            return None
        try:
            if self.served.grammars is None:
                raise GrammarError("response_format is not available on this server")
            return self.served.grammars.compile(req.response_format)
        except GrammarError as exc:
            raise ApiError(400, str(exc), "response_format") from None

    def sequences(self, req, encoded: list[list[int]], limits: list[int], *, logprobs, echo: bool, loop):
        seqs, choices = [], []
        bias = self.logit_bias(req)
        grammar = self.grammar(req)
        for ids, limit in zip(encoded, limits):
            for j in range(req.n):
                params = Sampling(max_tokens=limit, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  seed=None if req.seed is None else req.seed + j, stop=req.stop_list(),
                                  logprobs=logprobs, echo=echo, presence_penalty=req.presence_penalty,
                                  frequency_penalty=req.frequency_penalty, logit_bias=bias)
                if self.mailbox is None or self.mailbox.loop is not loop:
                    self.mailbox = _Mailbox(loop)
                choice = _Choice(self.mailbox)
                constraint = self.served.grammars.constraint(grammar) if grammar is not None else None
                seqs.append(Sequence(ids=ids, params=params, emit=choice.emit, constraint=constraint))
                choices.append(choice)
        self.check_size(len(seqs), "n" if req.n > 1 else "prompt")
        try:
            self.served.batcher.submit(seqs)
        except QueueFull as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry later", headers={"Retry-After": "1"}) from None
        return seqs, choices

    async def gather(self, request: Request, seqs, choices) -> list[dict]:
        """Every choice's tokens, text and finish reason; a client gone meanwhile cancels them."""
        results = []
        checked = time.monotonic()
        try:
            for seq, choice in zip(seqs, choices):
                tokens, text = [], []
                while True:
                    try:
                        kind, value = await asyncio.wait_for(choice.queue.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        kind = value = None
                    if time.monotonic() - checked > 0.5:
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            raise ApiError(499, "the client went away")  # nobody reads it; the sequences are cancelled
                    if kind is None:
                        continue
                    if kind == "token":
                        tokens.append(value)
                    elif kind == "text":
                        text.append(value)
                    elif kind == "error":
                        raise ApiError(500, value)
                    else:
                        results.append({"tokens": tokens, "text": "".join(text), "finish_reason": value})
                        break
        finally:
            for seq in seqs:
                if len(results) < len(seqs):
                    self.served.batcher.cancel(seq)
        return results

    def piece(self, t: int) -> str:
        return self.tok.decode([t])

    async def completions(self, body: CompletionRequest, request: Request):
        served, tok = self.served, self.tok
        self.check_model(body.model)
        prompts = body.prompts()
        self.check_size(len(prompts) * body.n, "n" if body.n > 1 else "prompt")
        encoded = [self.encode(p, "prompt") for p in prompts]
        limits = [self.budget(ids, body.max_tokens, default=served.default_max_tokens) for ids in encoded]
        loop = asyncio.get_running_loop()
        seqs, choices = self.sequences(body, encoded, limits, logprobs=body.logprobs, echo=body.echo, loop=loop)
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        prompt_texts = [p if isinstance(p, str) else tok.decode(p) for p in prompts for _ in range(body.n)]

        if body.stream:
            async def events():
                async for index, kind, value, tokens in _stream(request, seqs, choices):
                    if kind == "start":
                        if body.echo:
                            yield _chunk(rid, "text_completion", created, served.name,
                                         [{"index": index, "text": prompt_texts[index], "logprobs": None, "finish_reason": None}])
                        continue
                    text, reason = (value, None) if kind == "text" else ("", value)
                    lp = None if body.logprobs is None else _completion_logprobs(tokens, self.piece, "")
                    yield _chunk(rid, "text_completion", created, served.name,
                                 [{"index": index, "text": text, "logprobs": lp, "finish_reason": reason}])
                if body.include_usage():
                    yield {"data": json.dumps({"id": rid, "object": "text_completion", "created": created,
                                               "model": served.name, "choices": [], "usage": _stream_usage(encoded, body.n, seqs)})}
                yield {"data": "[DONE]"}

            return EventSourceResponse(events(), ping=15, shutdown_grace_period=served.shutdown_grace)

        results = await self.gather(request, seqs, choices)
        out = []
        for index, r in enumerate(results):
            text = (prompt_texts[index] if body.echo else "") + r["text"]
            lp = None
            if body.logprobs is not None:
                lp = _completion_logprobs(r["tokens"], self.piece, prompt_texts[index] if body.echo else "")
            out.append({"index": index, "text": text, "logprobs": lp, "finish_reason": r["finish_reason"]})
        generated = sum(len(s.generated) for s in seqs)
        prompt_tokens = sum(map(len, encoded)) * body.n
        return {"id": rid, "object": "text_completion", "created": created, "model": served.name, "choices": out,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                          "total_tokens": prompt_tokens + generated}}

    async def chat(self, body: ChatRequest, request: Request):
        served = self.served
        self.check_model(body.model)
        if served.chat_template is None:
            raise ApiError(400, "the model's tokenizer has no chat template (chat_template.jinja, or chat_template in its tokenizer_config.json); "
                                "use /v1/completions", "messages")
        try:
            prompt = served.chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        except Exception as exc:  # the template's own raise_exception, or a template error
            raise ApiError(400, f"the chat template refused these messages: {exc}", "messages") from None
        ids = self.encode(prompt, "messages")
        limit = self.budget(ids, body.limit(), default=None)
        top = (body.top_logprobs or 0) if body.logprobs else None
        loop = asyncio.get_running_loop()
        seqs, choices = self.sequences(body, [ids], [limit], logprobs=top, echo=False, loop=loop)
        created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"

        if body.stream:
            async def events():
                async for index, kind, value, tokens in _stream(request, seqs, choices):
                    if kind == "start":
                        delta, reason = {"role": "assistant", "content": ""}, None
                    elif kind == "text":
                        delta, reason = {"content": value}, None
                    else:
                        delta, reason = {}, value
                    lp = {"content": [_chat_logprob(t, self.piece) for t in tokens]} if body.logprobs and tokens else None
                    yield _chunk(rid, "chat.completion.chunk", created, served.name,
                                 [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}])
                if body.include_usage():
                    yield {"data": json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                               "model": served.name, "choices": [], "usage": _stream_usage([ids], body.n, seqs)})}
                yield {"data": "[DONE]"}

            return EventSourceResponse(events(), ping=15, shutdown_grace_period=served.shutdown_grace)

        results = await self.gather(request, seqs, choices)
        out = []
        for index, r in enumerate(results):
            lp = None
            if body.logprobs:
                lp = {"content": [_chat_logprob(t, self.piece) for t in r["tokens"]]}
            out.append({"index": index, "message": {"role": "assistant", "content": r["text"]}, "logprobs": lp,
                        "finish_reason": r["finish_reason"]})
        generated = sum(len(s.generated) for s in seqs)
        return {"id": rid, "object": "chat.completion", "created": created, "model": served.name, "choices": out,
                "usage": {"prompt_tokens": len(ids) * body.n, "completion_tokens": generated,
                          "total_tokens": len(ids) * body.n + generated}}


class _Gate:
    """ASGI middleware (a plain one: Starlette's BaseHTTPMiddleware would hide a client's disconnect
    from the routes): everything but /health needs the key, when one is set, before the body is
    read; every answer is counted by endpoint (one of the app's routes, or "unmatched": never a
    path a client wrote) and status."""

    def __init__(self, app, *, api_key: str | None, metrics, endpoints: frozenset[str]):
        self.app, self.key, self.metrics, self.endpoints = app, api_key, metrics, endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status = scope["path"], {}

        async def counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.key is not None and path != "/health" and not self._key_matches(scope):
                response = error_response(401, "missing or wrong API key (send the header Authorization: Bearer KEY)")
                await response(scope, receive, counted)
            else:
                await self.app(scope, receive, counted)
        finally:
            endpoint = path if path in self.endpoints else "unmatched"
            self.metrics.requests[(endpoint, status.get("code", 500))] += 1

    def _key_matches(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.key.encode())


async def _stream(request: Request, seqs: list[Sequence], choices: list[_Choice]):
    """(choice index, kind, value, tokens) as the sequences produce them: ("start", None) once per
    choice, then ("text", delta)... and ("end", finish_reason), each with the tokens generated since
    the previous one (a text held back waits with its tokens). A client that goes away (the
    response task is cancelled) cancels every sequence still running."""
    finished = 0
    pending: dict[asyncio.Future, int] = {}
    tokens: list[list[Token]] = [[] for _ in seqs]
    try:
        for index in range(len(seqs)):
            yield index, "start", None, []
        pending.update({asyncio.ensure_future(c.queue.get()): i for i, c in enumerate(choices)})
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                index = pending.pop(fut)
                kind, value = fut.result()
                if kind == "error":
                    raise RuntimeError(value)
                if kind == "token":
                    tokens[index].append(value)
                if kind in ("text", "end"):
                    yield index, kind, value, tokens[index]
                    tokens[index] = []
                if kind == "end":
                    finished += 1
                else:
                    pending[asyncio.ensure_future(choices[index].queue.get())] = index
    finally:
        for fut in pending:
            fut.cancel()
        if finished < len(seqs):
            for seq in seqs:
                seq.cancelled = True


def _chunk(rid: str, obj: str, created: int, model: str, choices: list[dict]) -> dict:
    return {"data": json.dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": choices})}


def _stream_usage(encoded: list[list[int]], n: int, seqs: list[Sequence]) -> dict:
    prompt, completion = sum(map(len, encoded)) * n, sum(len(s.generated) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(tokens: list[Token], piece, prefix: str) -> dict:
    """OpenAI's completions logprobs: tokens (as text), token_logprobs, top_logprobs, text_offset
    (echoed prompt tokens first; the first has no log-probability)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for t in tokens:
        text = piece(t.id)
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append(None if t.top is None else {piece(i): lp for i, lp in t.top.items()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_logprob(t: Token, piece) -> dict:
    text = piece(t.id)
    top = [{"token": piece(i), "logprob": lp, "bytes": list(piece(i).encode())} for i, lp in (t.top or {}).items()]
    return {"token": text, "logprob": t.logprob, "bytes": list(text.encode()), "top_logprobs": top}
