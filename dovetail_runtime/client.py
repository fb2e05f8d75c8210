"""Python client for a running ``dovetail-run`` server.

    with DovetailClient("ipc:///run/user/1000/dovetail.sock") as client:
        result = client.generate("def fibonacci(n):", max_new_tokens=64)
        for chunk in client.stream("class Stack:", temperature=0.7, seed=1):
            print(chunk.text, end="", flush=True)
        answer = client.chat([{"role": "user", "content": "Hi!"}], max_new_tokens=64)

Keyword arguments are GenerateRequest's fields (``max_new_tokens``, ``stop``, ``mode``,
``sampling``, ``messages``, ``deadline_ms``) or, for short, Sampling's (``temperature``,
``top_k``, ``top_p``, ``seed``). ``messages`` (dicts with ``role`` and ``content``, or
ChatMessage) replaces the prompt: the server renders them with the model's chat template.
A request the caller stops waiting for (a stream left with ``break``, a TimeoutError, Ctrl-C)
is cancelled on the server.
The endpoint may be written ``HOST:PORT`` (tcp) or as a path (ipc).

``api_key``: the server's API key (a string or an ApiKey), for tcp:// endpoints of a server
started with one: the client then connects as its CURVE client (ipc:// needs no key: the
socket file's mode protects it). The constructor waits until the server has accepted the
connection (at most ``connect_timeout_s``) and raises HandshakeError, one line, when it refuses
it (wrong key, missing key) or nobody answers: on ipc:// too, where a socket file left by a
killed server (or no file at all) would otherwise leave every send waiting out ``timeout_s``.
No torch here: the client is a ZMQ socket and the message types.
"""

from __future__ import annotations

import collections
import contextlib
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import zmq

from ipc import messages as m
from ipc.channels import ChannelClosed, ChannelTimeout, connect_client
from ipc.endpoints import normalize_endpoint
from ipc.handshake import HandshakeError

from .api_key import ApiKey

SAMPLING_FIELDS = tuple(m.Sampling.__struct_fields__)
Reply = m.TokenChunk | m.GenerateDone | m.ErrorReply  # what a request is answered with
__all__ = ["DovetailClient", "GenerationError", "HandshakeError"]


class GenerationError(RuntimeError):
    """The server answered a request with an error."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class DovetailClient:
    def __init__(self, endpoint: str, timeout_s: float = 600.0, api_key: str | ApiKey | None = None,
                 connect_timeout_s: float = 10.0):
        self.endpoint = normalize_endpoint(endpoint)
        self.timeout_ms = timeout_s * 1000
        tcp = self.endpoint.startswith("tcp://")
        key = ApiKey(api_key) if isinstance(api_key, str) else api_key
        # inproc:// has no handshake to wait for (and its peer is in this process).
        checked = not self.endpoint.startswith("inproc://")
        self.channel = connect_client(self.endpoint, curve=key.curve_keys() if key is not None and tcp else None,
                                      handshake_timeout_s=connect_timeout_s if checked else None)
        # Replies read for one request that belong to another one in flight on this connection (two
        # streams read in turns): kept for it, not dropped.
        self._inbox: dict[str, collections.deque[Reply]] = {}

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> DovetailClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, prompt: str | None, stream: bool, **params: Any) -> str:
        request_id = params.pop("request_id", None) or uuid.uuid4().hex
        flat = {key: params.pop(key) for key in SAMPLING_FIELDS if key in params}
        if flat:
            if "sampling" in params:
                raise TypeError(f"pass either sampling= or {', '.join(sorted(flat))}, not both")
            params["sampling"] = m.Sampling(**flat)
        if params.get("messages") is not None:
            params["messages"] = [turn if isinstance(turn, m.ChatMessage) else m.ChatMessage(**turn)
                                  for turn in params["messages"]]
        self.channel.send(m.GenerateRequest(request_id=request_id, prompt=prompt, stream=stream, **params),
                          timeout_ms=self.timeout_ms)
        self._inbox[request_id] = collections.deque()
        return request_id

    def _next(self, request_id: str) -> m.TokenChunk | m.GenerateDone:
        """The request's next reply: one kept from an earlier read, or the next one read now."""
        inbox = self._inbox.get(request_id)
        reply = inbox.popleft() if inbox else self._read_for(request_id)
        if isinstance(reply, m.ErrorReply):
            raise GenerationError(reply.code, reply.message)
        return reply

    def _read_for(self, request_id: str) -> Reply:
        """Read until a reply for ``request_id`` (or an ErrorReply for no request) comes."""
        while True:
            reply = self.channel.recv(timeout_ms=self.timeout_ms)
            if reply is None:
                raise TimeoutError(f"no answer from {self.endpoint} within {self.timeout_ms / 1000:g} s")
            if isinstance(reply, (m.TokenChunk, m.GenerateDone, m.ErrorReply)) \
                    and reply.request_id in (request_id, None):
                return reply
            self._keep(reply)

    def _keep(self, reply: m.Message) -> None:
        """Keep a reply for the request in flight it belongs to; drop anything else (a request left
        or answered already, a Pong nobody waits for)."""
        if isinstance(reply, (m.TokenChunk, m.GenerateDone, m.ErrorReply)) and reply.request_id is not None:
            inbox = self._inbox.get(reply.request_id)
            if inbox is not None:
                inbox.append(reply)

    def events(self, prompt: str | None = None, **params: Any) -> Iterator[m.TokenChunk | m.GenerateDone]:
        """Stream: every TokenChunk as it arrives, then the GenerateDone. Leaving the loop before
        the GenerateDone (break, an exception, a timeout) cancels the request on the server."""
        request_id = self._request(prompt, stream=True, **params)
        with self._cancelled_if_left(request_id):
            while not isinstance(reply := self._next(request_id), m.GenerateDone):
                yield reply
        yield reply

    def stream(self, prompt: str | None = None, **params: Any) -> Iterator[m.TokenChunk]:
        """Only the streamed chunks (text and token ids)."""
        for event in self.events(prompt, **params):
            if isinstance(event, m.TokenChunk):
                yield event

    def generate(self, prompt: str | None = None, **params: Any) -> m.GenerateDone:
        """Wait for the whole result: token_ids, text, finish_reason and stats."""
        request_id = self._request(prompt, stream=False, **params)
        with self._cancelled_if_left(request_id):
            while not isinstance(reply := self._next(request_id), m.GenerateDone):
                pass
        return reply

    def chat(self, messages: Sequence[Mapping[str, str] | m.ChatMessage], **params: Any) -> m.GenerateDone:
        """The assistant's reply to chat ``messages`` (the model's chat template makes the prompt)."""
        return self.generate(messages=list(messages), **params)

    def cancel(self, request_id: str) -> None:
        self.channel.send(m.Cancel(request_id=request_id), timeout_ms=self.timeout_ms)

    @contextlib.contextmanager
    def _cancelled_if_left(self, request_id: str) -> Iterator[None]:
        """Cancel ``request_id`` when the caller stops waiting for it (a stream left early, a
        timeout, Ctrl-C): else the server would generate on for nobody, holding a batch slot and
        its KV memory up to max_new_tokens. Not after an ErrorReply: that request has ended."""
        try:
            yield
        except GenerationError:
            raise
        except BaseException:
            self._cancel_quietly(request_id)
            raise
        finally:
            self._inbox.pop(request_id, None)  # what comes for it from now on is dropped

    def _cancel_quietly(self, request_id: str) -> None:
        """A best-effort Cancel: never blocks, never raises (the server may be gone, the client closed)."""
        try:
            self.channel.send(m.Cancel(request_id=request_id), timeout_ms=0)
        except (ChannelTimeout, ChannelClosed, zmq.ZMQError):
            pass

    def ping(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers a Ping within ``timeout_s`` (it does even mid-request). Replies
        of this client's requests read meanwhile are kept for them."""
        nonce = uuid.uuid4().int >> 65
        self.channel.send(m.Ping(nonce=nonce), timeout_ms=timeout_s * 1000)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            reply = self.channel.recv(timeout_ms=left * 1000)
            if isinstance(reply, m.Pong) and reply.nonce == nonce:
                return True
            if reply is not None:
                self._keep(reply)
        return False
