"""``dovetail-run --http HOST:PORT``: an OpenAI-compatible HTTP front end that is a ZMQ client.

Like vLLM's API server in front of its engine core, the front end holds no model and no
queue of its own: uvicorn serves a FastAPI app in a thread of the dovetail-run process, and
every HTTP request opens its own DEALER socket to the coordinator's ROUTER (over ``inproc://``,
the same ZMQ context, no socket file) and sends the GenerateRequest/Cancel messages any ZMQ
client sends. So the coordinator sees each HTTP request as one more client, HTTP and ZMQ
clients share one queue, and a disconnecting HTTP client is a Cancel like any other.

Why a thread and not a child process: the front end only parses JSON and moves messages
(the coordinator waits on sockets, releasing the GIL), inproc needs no socket file, and the
HTTP port is bound before the models load, so a taken port fails at once.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (see ``openai_api``),
``GET /v1/models`` and ``GET /v1/models/{id}``, ``GET /health`` (200 when both workers are up,
else 503; while the models first load every path answers 503 with Retry-After), ``GET /metrics``
(Prometheus text from the coordinator's MetricsReply), and llama-server's ``POST /tokenize`` and
``POST /detokenize`` (``tokenize_api``). With an API key every path but ``/health`` needs it as a
bearer token (``http_auth``); with CORS origins (``--cors-origin``) browsers on those origins may
call the API. Nothing here imports torch.

The front end tokenizes on its own (the coordinator's tokenizer object, in a thread of the pool,
never in the event loop) for /tokenize, /detokenize, and to refuse a ``max_tokens`` that cannot
fit the context with the prompt before the request takes its turn in the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from ipc import messages as m
from ipc.channels import configure_socket
from ipc.codec import ProtocolError, decode, encode
from ipc.endpoints import is_loopback_host

from . import openai_api as api
from . import tokenize_api
from .api_key import ApiKey
from .chat_template import ChatTemplateError, encode_chat
from .http_auth import BearerAuth
from .http_counts import CountResponses, HttpCounts
from .metrics import PrometheusExport

if TYPE_CHECKING:
    from .chat_template import ChatTemplate
    from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A body is refused (413) beyond room for the longest prompt that can fit the context with every
# character JSON-escaped (\uXXXX: 6 bytes), plus BODY_SLACK for the rest of the request (a chat's
# 16,384 messages included); never beyond what the ZMQ socket accepts.
MAX_BODY_BYTES = 32 * 1024 * 1024
BODY_SLACK = 4 * 1024 * 1024
DISCONNECT_POLL_MS = 250  # how often a waiting request checks that its HTTP client is still there
# HTTP requests talking to the coordinator at once, each with its own ZMQ socket: a ZMQ context
# holds at most 1023 sockets (the coordinator's own included), and a flood beyond them failed
# with 500s. Beyond this, a request is refused at once with busy (429), as a full queue is.
MAX_CALLS = 512
# Sockets beyond MAX_CALLS kept for /health and /metrics: a busy server (every slot held by requests
# waiting their turn) still answers a liveness probe or a scrape, not 429.
PROBE_CALLS = 16
PROBE_TIMEOUT_MS = 5000  # /health and /metrics: the coordinator answers between cycles
STARTUP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServedModel:
    name: str  # the id clients send as "model"
    context: int  # max_len: prompt plus new tokens
    default_mode: str  # "dovetail" with a draft head, else the server's --mode ("ar" or "lookup")
    created: int
    max_body_bytes: int = MAX_BODY_BYTES
    tokenizer: Tokenizer | None = None  # the coordinator's: /tokenize, /detokenize, max_tokens vs the context
    chat_template: ChatTemplate | None = None


def body_limit(prompt_chars: int | None) -> int:
    """The largest request body served, given the most characters a prompt that fits can have."""
    return MAX_BODY_BYTES if prompt_chars is None else min(MAX_BODY_BYTES, 6 * prompt_chars + BODY_SLACK)


# --- the link to the coordinator ---------------------------------------------------------


class CallSlots:
    """Counts the open Calls (all in the event loop's thread); refuses one beyond the limit, a probe
    (/health, /metrics) only beyond PROBE_CALLS more."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, probe: bool = False) -> None:
        if self.used >= self.limit + (PROBE_CALLS if probe else 0):
            raise api.ApiError(429, f"the server is busy: {self.limit} HTTP requests are in flight; try again later",
                               code="busy")
        self.used += 1

    def give(self) -> None:
        self.used -= 1


class Call:
    """One HTTP request's own DEALER socket to the coordinator."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, slots: CallSlots, probe: bool = False):
        slots.take(probe)
        self.slots = slots
        try:
            self.socket: zmq.asyncio.Socket = context.socket(zmq.DEALER)
        except zmq.ZMQError as error:  # out of sockets or files all the same
            slots.give()
            raise api.ApiError(503, f"cannot reach the coordinator now: {error}; try again later",
                               code="unavailable") from None
        configure_socket(self.socket)
        self.socket.connect(endpoint)
        self.pending: str | None = None  # a request sent and not yet answered to the end

    async def send(self, message: m.Message) -> None:
        await self.socket.send(encode(message))
        if isinstance(message, m.GenerateRequest):
            self.pending = message.request_id

    async def recv(self, timeout_ms: int | None = None) -> m.Message | None:
        if timeout_ms is not None and not await self.socket.poll(timeout_ms):
            return None
        reply = decode(await self.socket.recv(), m.COORDINATOR_TO_CLIENT)
        if isinstance(reply, (m.GenerateDone, m.ErrorReply)) and reply.request_id in (self.pending, None):
            self.pending = None
        return reply

    async def reply_to(self, request_id: str, timeout_ms: int | None = None) -> m.Message | None:
        """The next TokenChunk, GenerateDone or ErrorReply of ``request_id`` (None on timeout)."""
        while True:
            reply = await self.recv(timeout_ms)
            if reply is None:
                return None
            if isinstance(reply, (m.TokenChunk, m.GenerateDone)) and reply.request_id == request_id:
                return reply
            if isinstance(reply, m.ErrorReply) and reply.request_id in (request_id, None):
                return reply

    def close(self) -> None:
        """Cancel an unfinished request (its client left), then close. Not a coroutine: it must
        also run inside a cancelled task, where every await would be cancelled again."""
        if self.socket.closed:
            return
        self.slots.give()
        linger = 0
        if self.pending is not None:
            try:
                zmq.Socket.shadow(self.socket.underlying).send(encode(m.Cancel(request_id=self.pending)),
                                                               zmq.NOBLOCK)
                linger = 1000  # let the Cancel leave before the socket goes
            except zmq.ZMQError:
                log.warning("could not cancel request %s", self.pending)
            self.pending = None
        self.socket.close(linger=linger)


class CallStream(StreamingResponse):
    """A streamed response that owns its Calls: closed (and cancelled) however the stream ends,
    even if the client left before the first byte."""

    def __init__(self, content: AsyncIterator[bytes], calls: Sequence[Call]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.calls = calls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for call in self.calls:
                call.close()


async def merged_replies(calls: Sequence[Call], firsts: Sequence[m.Message | None],
                         request_ids: Sequence[str]) -> AsyncGenerator[tuple[int, m.Message], None]:
    """Each Call's replies (its TokenChunks, then its GenerateDone or ErrorReply), tagged with the
    Call's index, in the order they come, starting from ``firsts``; ends once every Call has ended
    or one has failed. A client that leaves cancels this; the waits still open go with it."""
    ready: list[tuple[int, m.Message | None]] = list(enumerate(firsts))
    waiting: dict[asyncio.Future, int] = {}
    try:
        while ready:
            for index, reply in ready:
                assert reply is not None  # no timeout was asked for
                yield index, reply
                if isinstance(reply, m.ErrorReply):
                    return
                if isinstance(reply, m.TokenChunk):
                    waiting[asyncio.ensure_future(calls[index].reply_to(request_ids[index]))] = index
            ready = []
            if waiting:
                finished, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                ready = [(waiting.pop(future), future.result()) for future in finished]
    finally:
        for future in waiting:
            future.cancel()


# --- the app -------------------------------------------------------------------------------


def error_response(error: api.ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body; 413 as soon as it is known to exceed ``limit`` bytes (before it is read
    when Content-Length says so)."""
    too_large = api.ApiError(413, f"the request body is larger than {limit} bytes, the most this server reads (a "
                                  f"prompt that fits its context is far smaller)", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large
    return bytes(body)


def build_app(endpoint: str, model: ServedModel, context: zmq.asyncio.Context | None = None,
              api_key: ApiKey | None = None, max_calls: int = MAX_CALLS,
              cors_origins: Sequence[str] = (), http_counts: HttpCounts | None = None) -> FastAPI:
    """The FastAPI app, talking to the coordinator at ``endpoint``; with ``api_key`` every
    path but /health needs it (``Authorization: Bearer``); with ``cors_origins`` (``*``: any)
    browsers on those origins may call it. Every response is counted in ``http_counts`` (a new
    count unless given) and shown by /metrics."""
    counts = http_counts if http_counts is not None else HttpCounts()
    routes = Routes(endpoint, model, context or zmq.asyncio.Context(shadow=zmq.Context.instance()),
                    CallSlots(max_calls), counts)
    app = FastAPI(title="Dovetail", summary="OpenAI-compatible API of a Dovetail server", openapi_url=None)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)
    if cors_origins:  # added last, so outermost: preflights carry no key, and a 401 gets CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    app.add_middleware(CountResponses, counts=counts)  # outermost: the 401s and CORS answers count too
    app.add_exception_handler(api.ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, _client_left)
    app.add_exception_handler(Exception, _internal)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.one_model)
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
    app.api_route("/health", methods=["GET", "HEAD"])(routes.health)
    app.get("/metrics")(routes.metrics)
    return app


async def _api_error(_request: Request, error: api.ApiError) -> JSONResponse:
    return error_response(error)


async def _http_error(_request: Request, error: HTTPException) -> JSONResponse:
    response = error_response(api.ApiError(error.status_code, str(error.detail), code=None))
    response.headers.update(error.headers or {})  # a 405's Allow: the methods the path takes (RFC 9110)
    return response


async def _client_left(_request: Request, _error: Exception) -> Response:
    return Response(status_code=499)  # it left while sending its body: nobody to answer, nothing wrong here


async def _internal(_request: Request, error: Exception) -> JSONResponse:
    log.exception("HTTP request failed")
    return error_response(api.ApiError(500, f"internal error: {type(error).__name__}: {error}", code="internal"))


class Routes:
    """The API's endpoints; each HTTP request talks to the coordinator over a Call of its own."""

    def __init__(self, endpoint: str, model: ServedModel, context: zmq.asyncio.Context, slots: CallSlots,
                 http_counts: HttpCounts):
        self.endpoint = endpoint
        self.model = model
        self.context = context
        self.slots = slots
        self.nonces = itertools.count(1)
        self.export = PrometheusExport(model.name, http_counts.snapshot)
        # The coordinator's bound: a longer prompt cannot fit, and is refused there untokenized.
        self.prompt_chars = None if model.tokenizer is None else model.context * model.tokenizer.max_chars_per_token()

    def token_text(self, token: int) -> str:
        """A token's own text for logprobs (special tokens shown; a piece of a multi-byte
        character shows as U+FFFD)."""
        tokenizer = self.model.tokenizer
        return f"<{token}>" if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)

    def check_model(self, name: str | None) -> None:
        model = self.model
        if name is not None and name != model.name:
            shown = repr(name) if len(name) <= 200 else repr(name[:200]) + "..."  # never echo a megabyte
            raise api.ApiError(404, f"the model {shown} does not exist: this server serves {model.name!r}",
                               code="model_not_found", param="model")

    async def run(self, request: Request, plan: api.Plan, chat: bool) -> Response:
        """Send the plan's requests (one per choice, each over its own Call), answer when the first
        replies say how it goes: an error before any text is a proper HTTP error."""
        ids = api.ResponseIds.now(plan.request.request_id, self.model.name, self.token_text)
        decodes = plan.decoded()
        calls: list[Call] = []
        handed_over = False
        try:
            for decode in decodes:
                calls.append(Call(self.context, self.endpoint, self.slots))
                try:
                    await calls[-1].send(decode.request)
                except ProtocolError as error:  # a value the schema let through but the protocol refuses
                    raise api.ApiError(400, str(error), code="invalid_request") from None
            async with asyncio.TaskGroup() as group:  # one failing cancels the others' waits
                waits = [group.create_task(self.first_reply(request, call, decode.request.request_id))
                         for call, decode in zip(calls, decodes, strict=True)]
            firsts = [wait.result() for wait in waits]
            if any(first is None for first in firsts):
                return Response(status_code=499)  # nobody to answer; close() cancels the requests
            if failed := next((first for first in firsts if isinstance(first, m.ErrorReply)), None):
                raise api.error_from_reply(failed)
            if not plan.stream:
                finished = [first for first in firsts if isinstance(first, m.GenerateDone)]  # all, not streamed
                dones = api.per_choice(decodes, finished)
                body = api.chat_body if chat else api.completion_body
                return JSONResponse(body(ids, dones, plan.choices))
            handed_over = True
            stream = api.EventStream(ids, chat, plan.include_usage, plan.total_choices, plan.choices)
            return CallStream(self.events(calls, firsts, decodes, stream), calls)
        finally:
            if not handed_over:
                for call in calls:
                    call.close()

    @staticmethod
    async def first_reply(request: Request, call: Call, request_id: str) -> m.Message | None:
        """The request's first reply; None when the HTTP client left before it came."""
        while (first := await call.reply_to(request_id, DISCONNECT_POLL_MS)) is None:
            if await request.is_disconnected():
                return None
        return first

    async def events(self, calls: Sequence[Call], firsts: Sequence[m.Message | None], decodes: Sequence[api.Decode],
                     stream: api.EventStream) -> AsyncIterator[bytes]:
        """Every choice's events as its request's replies come (a greedy prompt's one request answers
        all its choices)."""
        for event in stream.start():
            yield event
        dones: dict[int, m.GenerateDone] = {}
        request_ids = [decode.request.request_id for decode in decodes]
        # aclosing: however this ends, the merge's open waits end with it (not when collected).
        async with contextlib.aclosing(merged_replies(calls, firsts, request_ids)) as replies:
            async for index, reply in replies:
                if isinstance(reply, m.ErrorReply):
                    for event in stream.error(api.error_from_reply(reply)):
                        yield event
                    return
                for choice in decodes[index].choices:
                    events = stream.text(reply, choice) if isinstance(reply, m.TokenChunk) else []
                    if isinstance(reply, m.GenerateDone):
                        events, dones[choice] = stream.done(reply, choice), reply
                    for event in events:
                        yield event
        for event in stream.end([dones[choice] for choice in range(stream.choices)]):
            yield event

    async def completions(self, request: Request) -> Response:
        params = api.parse_request(await read_body(request, self.model.max_body_bytes), api.CompletionRequest)
        self.check_model(params.model)
        plan = api.plan_completion(params, f"cmpl-{uuid.uuid4().hex}", self.model.default_mode)
        await self.check_context(plan)
        return await self.run(request, plan, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        params = api.parse_request(await read_body(request, self.model.max_body_bytes), api.ChatRequest)
        self.check_model(params.model)
        plan = api.plan_chat(params, f"chatcmpl-{uuid.uuid4().hex}", self.model.default_mode)
        await self.check_context(plan)
        return await self.run(request, plan, chat=True)

    async def check_context(self, plan: api.Plan) -> None:
        """A max_tokens the client set must fit the context with the prompt (the prompt is
        tokenized here as the coordinator will tokenize it)."""
        if plan.limit_field is None or self.prompt_chars is None:
            return
        for request in plan.per_prompt():
            chars = len(request.prompt or "") + sum(len(turn.content) for turn in request.messages or ())
            if chars > self.prompt_chars:  # the coordinator's prompt_too_long, without tokenizing megabytes
                continue
            count = await run_in_threadpool(self.prompt_tokens, request)
            if count is not None:
                api.check_context(plan, count, self.model.context)

    def prompt_tokens(self, request: m.GenerateRequest) -> int | None:
        """The prompt's token count, as the coordinator will tokenize it (None: not known here)."""
        tokenizer, template = self.model.tokenizer, self.model.chat_template
        assert tokenizer is not None
        if request.messages is None:
            return len(tokenizer.encode(request.prompt or ""))
        if template is None:
            return None
        try:
            return len(encode_chat(tokenizer, template, request.messages))
        except ChatTemplateError as error:
            raise api.ApiError(400, str(error), code=error.code) from None

    def model_card(self) -> dict[str, Any]:
        model = self.model
        return {"id": model.name, "object": "model", "created": model.created, "owned_by": "dovetail",
                "max_model_len": model.context}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    async def one_model(self, model_id: str) -> dict[str, Any]:
        self.check_model(model_id)
        return self.model_card()

    def tokenizer(self) -> Tokenizer:
        if self.model.tokenizer is None:
            raise api.ApiError(503, "this server has no tokenizer loaded yet", code="unavailable")
        return self.model.tokenizer

    async def tokenize(self, request: Request) -> dict[str, Any]:
        params = tokenize_api.parse_tokenize(await read_body(request, self.model.max_body_bytes))
        return await run_in_threadpool(tokenize_api.tokenize_body, self.tokenizer(), params)

    async def detokenize(self, request: Request) -> dict[str, str]:
        params = tokenize_api.parse_detokenize(await read_body(request, self.model.max_body_bytes))
        return await run_in_threadpool(tokenize_api.detokenize_body, self.tokenizer(), params)

    async def probe(self, message: m.Message, expect: type[m.Message]) -> Any:
        call = Call(self.context, self.endpoint, self.slots, probe=True)
        try:
            await call.send(message)
            deadline = time.monotonic() + PROBE_TIMEOUT_MS / 1000
            while (left := deadline - time.monotonic()) > 0:
                reply = await call.recv(int(left * 1000))
                if isinstance(reply, expect):
                    return reply
            raise api.ApiError(503, f"the coordinator did not answer within {PROBE_TIMEOUT_MS / 1000:.0f} s "
                                    f"(loading or restarting a worker?)", code="unavailable")
        finally:
            call.close()

    async def health(self) -> dict[str, str]:
        pong = await self.probe(m.Ping(nonce=next(self.nonces)), m.Pong)
        if not pong.ready:  # a worker loads, died or restarts: requests would wait or fail
            raise api.ApiError(503, "a worker is starting or restarting; try again later", code="unavailable")
        return {"status": "ok"}

    async def metrics(self, request: Request) -> Response:
        reply = await self.probe(m.MetricsRequest(), m.MetricsReply)
        body, content_type = self.export.render(reply, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})


# --- serving in a thread ---------------------------------------------------------------------


def parse_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ``PORT`` or ``:PORT`` alone is loopback's
    (as --bind reads them), and a pasted ``http://HOST:PORT/`` is read as its address."""
    address = value.removeprefix("http://").removesuffix("/")
    if address.isdigit():
        address = ":" + address
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]") or ("127.0.0.1" if sep else "")
    if not sep or not host or "/" in host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--http {value!r}: expected HOST:PORT, e.g. 127.0.0.1:8000 (port 0 picks a free one)")
    return host, int(port)


LOADING_RETRY_AFTER_S = 5


async def loading_app(scope: dict, receive: Any, send: Any) -> None:
    """The ASGI app while the models load: 503 for every request, /health included."""
    if scope["type"] != "http":
        return
    response = error_response(api.ApiError(503, "the server is loading its models; try again shortly",
                                           code="unavailable"))
    response.headers["Retry-After"] = str(LOADING_RETRY_AFTER_S)
    await response(scope, receive, send)


class SwappableApp:
    """An ASGI app that forwards to ``inner``, which may be replaced while uvicorn serves (the loading
    app, then the API once the models are up)."""

    def __init__(self, inner: Any):
        self.inner = inner

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.inner(scope, receive, send)


class HttpFrontend:
    """The HTTP listener, bound at construction (before any model loads): 503 to everything while the
    models load (``serve_loading``), the API after ``start``.
    Only loopback without an API key; with one, every address, and every request needs it."""

    def __init__(self, address: str, api_key: ApiKey | None = None, cors_origins: Sequence[str] = ()):
        host, port = parse_address(address)
        if not is_loopback_host(host):
            if api_key is None:
                raise ValueError(f"refusing to serve HTTP on {host!r} without an API key: only loopback "
                                 f"(127.0.0.1, ::1, localhost)")
            log.warning("HTTP on %s is not encrypted: the API key and the text cross the network in the clear "
                        "(put a TLS proxy in front on an untrusted network)", host)
        self.api_key = api_key
        self.cors_origins = tuple(cors_origins)
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE)[0]
        self.socket = socket.socket(family, kind, proto)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(sockaddr)
            self.socket.listen(128)
        except OSError as error:
            self.socket.close()
            raise OSError(f"cannot serve HTTP on {address}: {error.strerror or error}") from None
        bound_host, self.port = self.socket.getsockname()[:2]
        self.host = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
        # The coordinator binds this too; HTTP requests connect to it (same process, same ZMQ context).
        self.zmq_endpoint = f"inproc://dovetail-http-{os.getpid()}"
        self.http_counts = HttpCounts()  # the loading 503s and the API's answers alike
        self._app = SwappableApp(CountResponses(loading_app, self.http_counts))
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve_loading(self, log_level: str = "info") -> None:
        """Answer at once while the models load: every path 503 ``unavailable`` with Retry-After, so
        a health check or a client learns the server is starting instead of hanging on the bound port."""
        if self._server is not None:
            return
        config = uvicorn.Config(self._app, log_config=None, log_level=log_level, access_log=log_level == "debug",
                                lifespan="off", loop="asyncio", http="h11", ws="none", timeout_graceful_shutdown=3)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="dovetail-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.01)

    def start(self, model: ServedModel, log_level: str = "info") -> None:
        """Serve the API (in a daemon thread, started here unless ``serve_loading`` started it); returns
        once uvicorn accepts connections."""
        self._app.inner = build_app(self.zmq_endpoint, model, api_key=self.api_key, cors_origins=self.cors_origins,
                                    http_counts=self.http_counts)
        self.serve_loading(log_level)

    def _serve(self) -> None:
        assert self._server is not None
        try:
            self._server.run(sockets=[self.socket])
        except Exception:  # the coordinator keeps serving ZMQ clients; say why HTTP stopped
            log.exception("the HTTP server stopped")

    def close(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout=5)
        self.socket.close()


__all__ = ["HttpFrontend", "ServedModel", "body_limit", "build_app", "parse_address"]
