"""Hostile input against one real ``dovetail-run`` (the demo pair, ZMQ over ipc and tcp, and HTTP):
10,000 malformed ZMQ messages one at a time and 2,000 more in bursts, 2,000 malformed HTTP requests,
malformed HTTP itself, and the biggest messages and bodies. Every one gets a clear answer (an
ErrorReply with the right code; a JSON error with the right status), the server never dies or
restarts a worker or logs a traceback, and correct requests sent before, during and after get the
greedy answer of ``mode: ar`` computed before any fuzzing.

The cases come from tests/fuzz_cases.py (seeded: the same every run). Nothing here generates with
the model except the correct requests: the malformed ones are refused before they run.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from dovetail_runtime.client import DovetailClient, GenerationError
from dovetail_runtime.tokenizer import Tokenizer
from ipc import messages as m
from ipc.channels import DEFAULT_CLIENT_MAX_MSG

from conftest import DEMO_DRAFT, DEMO_TARGET
from fuzz_cases import (
    BODY_LIMIT,
    CHAT,
    COMPLETIONS,
    DEMO_PROMPT_CHARS,
    RAW_HTTP,
    HttpCase,
    ZmqCase,
    http_cases,
    pipelined_cases,
    zmq_cases,
)
from runtime_harness import TEST_PROMPTS, Server

ZMQ_CASES, PIPELINED_CASES, HTTP_CASES = 10_000, 2_000, 2_000
BURST = 200  # pipelined messages sent before their answers are read (well under the send queue)
CHECK_EVERY_ZMQ, CHECK_EVERY_HTTP = 1_000, 250  # a correct request after this many malformed ones
PROMPTS = TEST_PROMPTS[:3]
NEW_TOKENS = 24
ANSWER_S = 30.0  # the longest any one answer may take (a 50k-token prompt is tokenized, then refused)
SHOWN = 20  # problems listed when a test fails
FLOOD = 1_500  # HTTP requests at once


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    socket_dir = tmp_path_factory.mktemp("fuzz")
    running = Server("--target", str(DEMO_TARGET), "--draft", str(DEMO_DRAFT), "--cpu-cores", "0",
                     "--bind", f"ipc://{socket_dir}/dovetail.sock", "--bind", "tcp://127.0.0.1:0",
                     "--http", "127.0.0.1:0")
    yield running
    assert running.stop() == 0, running.log_text()[-3000:]


def endpoint(server: Server, scheme: str) -> str:
    return next(each for each in server.endpoints if each.startswith(scheme))


@pytest.fixture(scope="module")
def reference(server: Server) -> dict[str, list[int]]:
    """Greedy ``mode: ar`` token ids per prompt, asked before any fuzzing."""
    with DovetailClient(endpoint(server, "ipc://"), timeout_s=120) as client:
        return {prompt: client.generate(prompt, max_new_tokens=NEW_TOKENS, mode="ar").token_ids
                for prompt in PROMPTS}


@pytest.fixture(scope="module")
def workers_at_start(server: Server, reference) -> dict[str, int]:
    return {name: process.pid for name, process in server.workers().items()}


def assert_correct(server: Server, reference: dict[str, list[int]], turn: int) -> None:
    """One correct request, its kind chosen by ``turn``: ZMQ or HTTP, streamed or not, dovetail
    or ar, greedy or sampled with a top_p so small that only the likeliest token is left; its
    tokens must be the reference's."""
    assert server.process.poll() is None, "the server died:\n" + server.log_text()[-3000:]
    prompt = PROMPTS[turn % len(PROMPTS)]
    kind = turn % 7
    if kind < 4:  # ZMQ: plain/streamed x dovetail/ar
        with DovetailClient(endpoint(server, "tcp://" if kind % 2 else "ipc://"), timeout_s=120) as client:
            mode = "ar" if kind >= 2 else "dovetail"
            if kind % 2:
                events = list(client.events(prompt, max_new_tokens=NEW_TOKENS, mode=mode))
                streamed = [token for event in events[:-1] for token in event.token_ids]
                assert streamed == events[-1].token_ids
                token_ids = events[-1].token_ids
            else:
                token_ids = client.generate(prompt, max_new_tokens=NEW_TOKENS, mode=mode).token_ids
    else:
        body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": kind == 5}
        if kind == 6:
            body.update(temperature=1.0, top_p=1e-300, seed=turn)
        response = httpx.post(http_url(server) + COMPLETIONS, json=body, timeout=120)
        assert response.status_code == 200, response.text
        if kind == 5:
            bodies = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
                      if line.startswith("data: {")]
            token_ids = bodies[-1]["dovetail"]["token_ids"]
        else:
            token_ids = response.json()["dovetail"]["token_ids"]
    assert token_ids == reference[prompt], f"turn {turn}: wrong answer for {prompt!r}"


def http_url(server: Server) -> str:
    return endpoint(server, "http://")


# --- ZMQ -----------------------------------------------------------------------------------


class RawDealer:
    """A DEALER that sends any frames and reads replies as plain msgpack (not through ipc.codec,
    so the replies' shape on the wire is checked too)."""

    def __init__(self, context: zmq.Context, address: str):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, frames: list[bytes]) -> None:
        # Never block for good: a DEALER with no connection (reconnecting) holds its sends.
        assert self.socket.poll(int(ANSWER_S * 1000), zmq.POLLOUT), "could not send: no connection to the server"
        self.socket.send_multipart(frames, zmq.NOBLOCK)

    def recv(self, timeout_s: float = ANSWER_S) -> dict[str, Any] | None:
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        reply = msgpack.unpackb(self.socket.recv(), raw=False)
        assert isinstance(reply, dict) and reply.get("v") == 2, reply
        return reply

    def close(self) -> None:
        self.socket.close(0)


def label(reply: dict[str, Any]) -> str:
    return reply["code"] if reply["type"] == "ErrorReply" else reply["type"]


def problem(case: ZmqCase, reply: dict[str, Any] | None) -> str | None:
    """What is wrong with ``reply`` as the answer to ``case`` (None: nothing)."""
    if reply is None:
        return f"{case.kind}: no answer within {ANSWER_S} s"
    if label(reply) not in case.expect:
        return f"{case.kind}: got {label(reply)} ({reply.get('message', '')[:200]}), expected {sorted(case.expect)}"
    if reply["type"] != "ErrorReply":
        return None
    if set(reply) != {"type", "v", "request_id", "code", "message"}:
        return f"{case.kind}: an ErrorReply with fields {sorted(reply)}"
    if not reply["message"] or "Traceback" in reply["message"]:
        return f"{case.kind}: an unclear message {reply['message'][:300]!r}"
    if reply["code"] == "bad_message" and reply["request_id"] is not None:
        return f"{case.kind}: bad_message names request {reply['request_id']!r}"
    if case.request_id is not None and reply["request_id"] not in (case.request_id, None):
        return f"{case.kind}: the answer names {reply['request_id']!r}, not {case.request_id!r}"
    return None


@pytest.fixture(scope="module")
def zmq_context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_demo_prompt_bound_is_what_the_cases_assume():
    assert Tokenizer.from_dir(DEMO_TARGET).max_chars_per_token() * 2048 == DEMO_PROMPT_CHARS


def test_malformed_zmq_messages_each_get_one_clear_answer(server, reference, workers_at_start, zmq_context):
    dealer = RawDealer(zmq_context, endpoint(server, "ipc://"))
    problems: list[str] = []
    try:
        for index, case in enumerate(zmq_cases(seed=20261130, count=ZMQ_CASES)):
            dealer.send(case.frames)
            found = problem(case, dealer.recv())
            if found is not None:
                problems.append(f"#{index} {found}")
            if (index + 1) % CHECK_EVERY_ZMQ == 0:
                assert_correct(server, reference, index // CHECK_EVERY_ZMQ)
        stray = dealer.recv(timeout_s=0.5)
        assert stray is None, f"an answer no message asked for: {stray}"
    finally:
        dealer.close()
    assert not problems, f"{len(problems)} of {ZMQ_CASES} cases:\n" + "\n".join(problems[:SHOWN])
    assert_correct(server, reference, 0)


def test_malformed_zmq_messages_in_bursts(server, reference, zmq_context):
    dealer = RawDealer(zmq_context, endpoint(server, "tcp://"))
    cases = pipelined_cases(seed=5, count=PIPELINED_CASES)
    problems: list[str] = []
    try:
        for start in range(0, len(cases), BURST):
            burst = cases[start:start + BURST]
            for case in burst:
                dealer.send(case.frames)
            for offset, case in enumerate(burst):  # all bad_message, answered as they are read
                found = problem(case, dealer.recv())
                if found is not None:
                    problems.append(f"#{start + offset} {found}")
        assert dealer.recv(timeout_s=0.5) is None
    finally:
        dealer.close()
    assert not problems, f"{len(problems)} of {len(cases)} cases:\n" + "\n".join(problems[:SHOWN])
    assert_correct(server, reference, 1)


@pytest.mark.parametrize("scheme", ["ipc://", "tcp://"])
def test_a_message_beyond_the_size_limit_drops_only_its_connection(server, reference, zmq_context, scheme):
    # Documented (docs/protocol.md, Transport): libzmq drops the connection before buffering it,
    # nothing is answered, the DEALER reconnects by itself, and everyone else is served.
    dealer = RawDealer(zmq_context, endpoint(server, scheme))
    try:
        dealer.send([msgpack.packb({"type": "Ping", "nonce": 1}), b""])  # connected: answered
        assert label(dealer.recv()) == "bad_message"
        dealer.send([b"\x00" * (DEFAULT_CLIENT_MAX_MSG + 1)])
        assert dealer.recv(timeout_s=2) is None
        assert_correct(server, reference, 2)
        deadline = time.monotonic() + ANSWER_S
        while True:  # the reconnected DEALER is served again
            dealer.send([msgpack.packb({"type": "Ping", "nonce": 2})])
            reply = dealer.recv(timeout_s=1)
            if reply is not None:
                assert reply == {"type": "Pong", "v": 2, "nonce": 2, "ready": True}
                break
            assert time.monotonic() < deadline, "not served again after reconnecting"
    finally:
        dealer.close()


def test_the_biggest_prompts_a_message_can_hold(server, zmq_context):
    dealer = RawDealer(zmq_context, endpoint(server, "ipc://"))
    limit = 16 * 1024 * 1024  # the schema's prompt length, in characters
    try:
        for prompt, expect in (("x" * limit, "prompt_too_long"), ("x" * (limit + 1), "bad_message")):
            started = time.monotonic()
            dealer.send([msgpack.packb({"type": "GenerateRequest", "request_id": "big", "prompt": prompt})])
            reply = dealer.recv()
            assert reply is not None and label(reply) == expect, reply
            assert time.monotonic() - started < 10  # refused by its length, never tokenized
    finally:
        dealer.close()


def test_a_50k_token_prompt_is_refused_without_running(server, reference):
    with DovetailClient(endpoint(server, "ipc://"), timeout_s=60) as client:
        for prompt in ("a " * 50_000, "def f(x):\n    return x\n" * 10_000):
            started = time.monotonic()
            with pytest.raises(GenerationError) as refused:
                client.generate(prompt, max_new_tokens=1)
            assert refused.value.code == "prompt_too_long"
            assert time.monotonic() - started < 10
    assert_correct(server, reference, 3)


# --- HTTP ----------------------------------------------------------------------------------


def http_problem(case: HttpCase, response: httpx.Response) -> str | None:
    if response.status_code != case.status:
        return f"{case.kind}: status {response.status_code}, expected {case.status}: {response.text[:300]}"
    if not response.headers.get("content-type", "").startswith("application/json"):
        return f"{case.kind}: content-type {response.headers.get('content-type')!r}"
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{case.kind}: not an OpenAI error body: {response.text[:300]}"
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return f"{case.kind}: an unclear error {error}"
    if "Traceback" in response.text:
        return f"{case.kind}: a traceback in the answer"
    if error["code"] not in case.codes:
        expected = sorted(map(str, case.codes))
        return f"{case.kind}: code {error['code']!r} ({error['message'][:200]}), expected {expected}"
    if case.param is not None and not (error["param"] or "").startswith(case.param):
        return f"{case.kind}: param {error['param']!r}, expected {case.param!r}"
    return None


def test_malformed_http_requests_each_get_a_clear_error(server, reference, workers_at_start):
    problems: list[str] = []
    with httpx.Client(base_url=http_url(server), timeout=ANSWER_S) as http:
        for index, case in enumerate(http_cases(seed=7, count=HTTP_CASES)):
            try:
                response = http.request(case.method, case.path, content=case.body, headers=case.headers)
            except httpx.HTTPError as error:
                problems.append(f"#{index} {case.kind}: {type(error).__name__}: {error}")
                continue
            found = http_problem(case, response)
            if found is not None:
                problems.append(f"#{index} {found}")
            if (index + 1) % CHECK_EVERY_HTTP == 0:
                assert_correct(server, reference, index // CHECK_EVERY_HTTP)
    assert not problems, f"{len(problems)} of {HTTP_CASES} cases:\n" + "\n".join(problems[:SHOWN])


def test_a_flood_of_http_requests_is_answered_not_failed(server, reference):
    # Found by fuzzing: 2,000 requests at once ran the server out of ZMQ sockets (500s, tracebacks).
    async def flood() -> collections.Counter[tuple[int, str]]:
        limits = httpx.Limits(max_connections=FLOOD, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=http_url(server), timeout=120, limits=limits) as http:
            async def one() -> tuple[int, str]:  # reaches the coordinator, which refuses it at once
                response = await http.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})
                return response.status_code, response.json()["error"]["code"]

            return collections.Counter(await asyncio.gather(*(one() for _ in range(FLOOD))))

    answers = asyncio.run(flood())
    assert set(answers) <= {(400, "no_chat_template"), (429, "busy")}, answers
    assert sum(answers.values()) == FLOOD
    assert_correct(server, reference, 5)


def raw_exchange(server: Server, data: bytes, timeout_s: float = 10) -> bytes:
    """Send bytes on a fresh connection; the response, read to the end of its Content-Length, or
    until the server closes the connection or goes quiet."""
    host, port = http_url(server).removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
        raw.sendall(data)
        answer = b""
        try:
            while chunk := raw.recv(65536):
                answer += chunk
                head, end, body = answer.partition(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length: *(\d+)\r?$", head)
                if end and length is not None and len(body) >= int(length.group(1)):
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    return answer


@pytest.mark.parametrize("name,data,status", RAW_HTTP, ids=[case[0] for case in RAW_HTTP])
def test_malformed_http_itself_is_refused(server, name, data, status):
    assert raw_exchange(server, data).startswith(status)


def test_bodies_over_the_limit_are_refused_before_they_are_read(server, reference):
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BODY_LIMIT + 1}\r\n\r\n").encode()
    answer = raw_exchange(server, head + b'{"prompt": "')  # the rest never comes: not waited for
    assert answer.startswith(b"HTTP/1.1 413") and b"body_too_large" in answer

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    response = httpx.post(http_url(server) + COMPLETIONS, content=chunks(), timeout=ANSWER_S)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    # Just under the limit: read, and refused by the prompt's length, untokenized.
    body = json.dumps({"prompt": "", "max_tokens": 1}).encode()
    body = body.replace(b'""', b'"' + b"a" * (BODY_LIMIT - len(body)) + b'"')
    assert len(body) == BODY_LIMIT
    response = httpx.post(http_url(server) + COMPLETIONS, content=body, timeout=ANSWER_S)
    assert response.status_code == 400 and response.json()["error"]["code"] == "prompt_too_long"
    assert_correct(server, reference, 4)


def test_a_client_leaving_mid_body_is_not_an_error(server):
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: 1000\r\n\r\n").encode()
    host, port = http_url(server).removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(head + b'{"prompt": "def')
    assert httpx.get(http_url(server) + "/health", timeout=10).status_code == 200
    time.sleep(0.5)  # the server has noticed the disconnect by now (the last test checks the log again)
    assert "ClientDisconnect" not in server.log_text()


# --- after everything ----------------------------------------------------------------------


def test_the_server_survived_everything(server, reference, workers_at_start):
    for turn in range(7):  # every kind of correct request
        assert_correct(server, reference, turn)
    assert {name: process.pid for name, process in server.workers().items()} == workers_at_start
    with DovetailClient(endpoint(server, "ipc://")) as client:
        client.channel.send(m.MetricsRequest())
        metrics = client.channel.recv(timeout_ms=10_000)
    assert isinstance(metrics, m.MetricsReply) and metrics.worker_restarts == 0
    # Nothing failed but what was meant to: refusals, and the flood's busy.
    assert set(metrics.errors) <= {"prompt_too_long", "no_chat_template", "busy"}, metrics.errors
    log = server.log_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-5000:]
