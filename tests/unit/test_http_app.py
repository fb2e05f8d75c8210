"""The HTTP app's own refusals, driven over ASGI without a server or a coordinator: what is
refused before any message is sent (bodies too large, clients that leave mid-body, a long model
name), found by the fuzz test (tests/system/test_fuzz.py) and pinned down here."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

import httpx
import pytest
import zmq

from dovetail_runtime.http_server import (
    BODY_SLACK,
    MAX_BODY_BYTES,
    HttpFrontend,
    ServedModel,
    body_limit,
    build_app,
    parse_address,
)
from dovetail_runtime.metrics import ServerMetrics
from ipc import messages as m
from ipc.codec import decode, encode

LIMIT = 1000
MODEL = ServedModel(name="m", context=64, default_mode="ar", created=0, max_body_bytes=LIMIT)


def call(path: str, chunks: list[bytes], headers: dict[str, str] | None = None,
         leave: bool = False) -> tuple[int, bytes, int]:
    """POST ``chunks`` as the body (the client leaves after them with ``leave``): the status,
    the response body, and how many body chunks the app read."""
    app = build_app("inproc://dovetail-test-nowhere", MODEL)
    pending = [{"type": "http.request", "body": chunk, "more_body": True} for chunk in chunks]
    pending.append({"type": "http.disconnect"} if leave else {"type": "http.request", "body": b"",
                                                                 "more_body": False})
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not pending:
            await asyncio.sleep(3600)
        read += 1
        return pending.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    start = next(message for message in sent if message["type"] == "http.response.start")
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return start["status"], body, read


def test_body_limit_leaves_room_for_the_longest_prompt_that_fits():
    assert body_limit(None) == MAX_BODY_BYTES
    assert body_limit(131072) == 6 * 131072 + BODY_SLACK  # the demo: 2048 tokens of at most 64 characters
    assert body_limit(10**9) == MAX_BODY_BYTES  # never more than the ZMQ socket takes


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_declared_body_over_the_limit_is_refused_unread(path):
    status, body, read = call(path, [b"{}"], {"content-length": str(LIMIT + 1)})
    error = json.loads(body)["error"]
    assert (status, error["code"], read) == (413, "body_too_large", 0)
    assert f"larger than {LIMIT} bytes" in error["message"]


def test_a_chunked_body_is_refused_once_it_passes_the_limit():
    status, body, read = call("/v1/completions", [b'{"prompt": "', b"a" * 600, b"a" * 600, b"a" * 600])
    assert (status, json.loads(body)["error"]["code"], read) == (413, "body_too_large", 3)  # the 4th unread
    status, body, _ = call("/v1/completions", [b'{"prompt": 1', b"}"])  # under it: read and judged
    assert (status, json.loads(body)["error"]["param"]) == (400, "prompt")


def test_a_client_leaving_mid_body_is_not_an_error(caplog):
    # Found by fuzzing: starlette's ClientDisconnect was logged as a failed request with a traceback.
    with caplog.at_level(logging.WARNING):
        status, _, _ = call("/v1/completions", [b'{"prompt": "'], {"content-length": "500"}, leave=True)
    assert status == 499
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_an_unknown_model_name_is_not_echoed_whole():
    status, body, _ = call("/v1/completions", [json.dumps({"prompt": "x", "model": "m" * 900}).encode()])
    error = json.loads(body)["error"]
    assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")
    assert len(error["message"]) < 400 and "m" * 200 in error["message"]


def test_requests_beyond_the_in_flight_limit_are_busy_and_slots_come_back():
    # Found by fuzzing: 2,000 requests at once ran the ZMQ context out of sockets: 500s and tracebacks.
    app = build_app("inproc://dovetail-test-silent", MODEL, max_calls=1)  # nobody answers there
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()

    def request(leave: asyncio.Event) -> tuple[Any, list[dict[str, Any]]]:
        sent: list[dict[str, Any]] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        return app(scope, receive, send), sent

    def status(sent: list[dict[str, Any]]) -> int | None:
        return next((message["status"] for message in sent if message["type"] == "http.response.start"), None)

    async def scenario() -> None:
        first_leaves, never = asyncio.Event(), asyncio.Event()
        first, first_sent = request(first_leaves)
        waiting = asyncio.ensure_future(first)
        await asyncio.sleep(0.3)  # sent, and waiting for an answer that does not come
        second, second_sent = request(never)
        await asyncio.wait_for(second, 10)
        error = json.loads(b"".join(m.get("body", b"") for m in second_sent if m["type"] == "http.response.body"))
        assert (status(second_sent), error["error"]["code"]) == (429, "busy")
        first_leaves.set()  # its client leaves: the request ends and gives its slot back
        await asyncio.wait_for(waiting, 10)
        assert status(first_sent) == 499
        third, third_sent = request(never)
        third_task = asyncio.ensure_future(third)
        await asyncio.sleep(0.5)
        assert status(third_sent) is None  # admitted: waiting for the coordinator like the first
        third_task.cancel()

    asyncio.run(scenario())



def test_while_the_models_load_every_path_answers_503_then_the_api_is_served():
    # The port is bound before the models load; it used to accept connections and answer nothing
    # until they were up, so a health check with a timeout hung instead of reading "not ready".
    frontend = HttpFrontend("127.0.0.1:0")
    try:
        frontend.serve_loading("warning")
        with httpx.Client(base_url=frontend.url, timeout=10) as http:
            for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
                reply = http.request(method, path, json={"prompt": "x"} if method == "POST" else None)
                assert reply.status_code == 503 and reply.headers["retry-after"] == "5", (path, reply.text)
                assert reply.json()["error"]["code"] == "unavailable" and "loading" in reply.json()["error"]["message"]
            frontend.start(MODEL, "warning")
            models = http.get("/v1/models")
            assert models.status_code == 200 and [model["id"] for model in models.json()["data"]] == ["m"]
        # /metrics shows the loading 503s beside the API's answers (one count across the swap). A response is
        # counted once its exchange ends on the server's loop, which may be just after the client read it.
        expected = {("GET", "/health", "503"): 1, ("GET", "/v1/models", "503"): 1,
                    ("POST", "/v1/completions", "503"): 1, ("GET", "/v1/models", "200"): 1}
        deadline = time.monotonic() + 5
        while frontend.http_counts.snapshot() != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert frontend.http_counts.snapshot() == expected
    finally:
        frontend.close()


def test_health_and_metrics_are_answered_while_generation_takes_every_slot():
    # /health and /metrics took a slot of the in-flight limit too: with every slot held by requests
    # waiting their turn (a busy server), a liveness probe or a Prometheus scrape got 429 busy.
    endpoint = "inproc://dovetail-test-busy-coordinator"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(endpoint)
    stop = threading.Event()

    def coordinator() -> None:  # answers probes, never a GenerateRequest (it waits its turn forever)
        while not stop.is_set():
            if not router.poll(20):
                continue
            peer, data = router.recv_multipart()
            message = decode(data, m.CLIENT_TO_COORDINATOR)
            if isinstance(message, m.Ping):
                router.send_multipart([peer, encode(m.Pong(nonce=message.nonce, ready=True))])
            elif isinstance(message, m.MetricsRequest):
                router.send_multipart([peer, encode(ServerMetrics().reply(queue_depth=1))])

    thread = threading.Thread(target=coordinator, daemon=True)
    thread.start()
    app = build_app(endpoint, MODEL, max_calls=1)

    async def scenario() -> None:
        generating = asyncio.ensure_future(asgi(app, "POST", "/v1/completions",
                                                json.dumps({"prompt": "x", "max_tokens": 1}).encode()))
        await asyncio.sleep(0.3)  # holds the one slot, waiting for its turn
        assert (await asgi(app, "POST", "/v1/completions", b'{"prompt": "y"}'))[0] == 429  # generation: busy
        assert (await asgi(app, "GET", "/health"))[0] == 200
        status, body = await asgi(app, "GET", "/metrics")
        assert status == 200 and b"dovetail_queue_depth" in body
        generating.cancel()

    try:
        asyncio.run(scenario())
    finally:
        stop.set()
        thread.join(5)
        router.close(linger=0)


async def asgi(app: Any, method: str, path: str, body: bytes = b"") -> tuple[int | None, bytes]:
    """One request to the app over ASGI: its status and body."""
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    status = next((message["status"] for message in sent if message["type"] == "http.response.start"), None)
    return status, b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")


@pytest.mark.parametrize("value,address", [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)), ("[::1]:0", ("::1", 0)), ("localhost:80", ("localhost", 80)),
    ("8000", ("127.0.0.1", 8000)), (":8000", ("127.0.0.1", 8000)),  # as --bind reads a port alone
    ("http://127.0.0.1:8000/", ("127.0.0.1", 8000)),  # a URL pasted from the startup line
])
def test_http_addresses_as_users_write_them(value, address):
    assert parse_address(value) == address


@pytest.mark.parametrize("value", ["nonsense", "127.0.0.1", "127.0.0.1:65536", "host:port", "", "https://x:1"])
def test_http_addresses_that_name_no_port_are_refused(value):
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_address(value)
