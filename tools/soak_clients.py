"""The four kinds of soak client: ZMQ or HTTP, streamed or not. Each sends one greedy request
and returns what came back, timed; the soak (tools/soak.py) judges it against the reference.

A streamed answer is only whole when its pieces agree with its end: the chunks' token ids and
text must add up to the final ones (ZMQ), the events must end in a finish and ``[DONE]`` (HTTP).
Anything else (an error, a timeout, a broken stream) is an answer that was lost.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from dovetail_runtime.client import DovetailClient, GenerationError
from ipc import messages as m

KINDS = ("zmq", "zmq-stream", "http", "http-stream")


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]
    text: str
    seconds: float  # from sending the request to its last byte
    first_s: float | None  # to the first streamed text (streams only)


class Lost(Exception):
    """No whole answer: an error reply, a timeout, a broken stream."""


@dataclass(frozen=True)
class Request:
    prompt: str
    max_new_tokens: int
    mode: str  # "dovetail" or "ar"


class SoakClient:
    """One client of one kind: its own ZMQ connection or HTTP connection pool, used serially."""

    def __init__(self, kind: str, zmq_endpoint: str | None, http_url: str | None, timeout_s: float):
        if kind not in KINDS:
            raise ValueError(f"unknown client kind {kind!r}")
        self.kind = kind
        self.timeout_s = timeout_s
        self.zmq: DovetailClient | None = None
        self.http: httpx.Client | None = None
        address = zmq_endpoint if kind.startswith("zmq") else http_url
        if address is None:
            raise ValueError(f"a {kind} client needs the server's {kind.split('-')[0].upper()} address")
        if kind.startswith("zmq"):
            self.zmq = DovetailClient(address, timeout_s=timeout_s)
        else:
            self.http = httpx.Client(base_url=address, timeout=timeout_s)

    def close(self) -> None:
        if self.zmq is not None:
            self.zmq.close()
        if self.http is not None:
            self.http.close()

    def ask(self, request: Request) -> Answer:
        try:
            if self.zmq is not None:
                return self._zmq(request)
            return self._http(request)
        except (GenerationError, TimeoutError, httpx.HTTPError, ValueError, KeyError) as error:
            raise Lost(f"{type(error).__name__}: {error}") from None

    def _zmq(self, request: Request) -> Answer:
        assert self.zmq is not None
        started = time.monotonic()
        params = dict(max_new_tokens=request.max_new_tokens, mode=request.mode)
        if self.kind == "zmq":
            done = self.zmq.generate(request.prompt, **params)
            return Answer(done.token_ids, done.text, time.monotonic() - started, None)
        ids: list[int] = []
        text: list[str] = []
        first = None
        for event in self.zmq.events(request.prompt, **params):
            if isinstance(event, m.TokenChunk):
                if first is None and event.text:
                    first = time.monotonic() - started
                ids += event.token_ids
                text.append(event.text)
            else:
                if ids != event.token_ids or "".join(text) != event.text:
                    raise Lost("the streamed chunks do not add up to the final answer")
                return Answer(event.token_ids, event.text, time.monotonic() - started, first)
        raise Lost("the stream ended without a GenerateDone")

    def _http(self, request: Request) -> Answer:
        assert self.http is not None
        body = {"prompt": request.prompt, "max_tokens": request.max_new_tokens, "temperature": 0,
                "mode": request.mode, "stream": self.kind == "http-stream"}
        started = time.monotonic()
        if self.kind == "http":
            response = self.http.post("/v1/completions", json=body)
            if response.status_code != 200:
                raise Lost(f"HTTP {response.status_code}: {response.text[:300]}")
            done = response.json()
            return Answer(done["dovetail"]["token_ids"], done["choices"][0]["text"], time.monotonic() - started,
                          None)
        text: list[str] = []
        first = None
        finish: dict | None = None
        with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise Lost(f"HTTP {response.status_code}: {response.read()[:300]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    if finish is None:
                        raise Lost("[DONE] without a finish")
                    return Answer(finish["dovetail"]["token_ids"], "".join(text), time.monotonic() - started, first)
                event = json.loads(data)
                if "error" in event:
                    raise Lost(f"error event: {event['error']}")
                choice = event["choices"][0]
                if choice["text"] and first is None:
                    first = time.monotonic() - started
                text.append(choice["text"])
                if choice["finish_reason"] is not None:
                    finish = event
        raise Lost("the event stream ended without [DONE]")
