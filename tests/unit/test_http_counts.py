"""The HTTP front end's response counter (dovetail_runtime.http_counts): what it counts when an app
fails before answering, or its client leaves first."""

from __future__ import annotations

import asyncio

import pytest

from dovetail_runtime.http_counts import CountResponses, HttpCounts, route_of


def scope(method: str, path: str) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": []}


async def receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


async def send(_message: dict) -> None:
    pass


def test_an_answer_counts_its_status():
    async def teapot(_scope, _receive, send_) -> None:
        await send_({"type": "http.response.start", "status": 418, "headers": []})
        await send_({"type": "http.response.body", "body": b""})

    counts = HttpCounts()
    asyncio.run(CountResponses(teapot, counts)(scope("BREW", "/v1/models/a/b"), receive, send))
    assert counts.snapshot() == {("other", "/v1/models/{model_id}", "418"): 1}


def test_an_app_that_fails_before_answering_counts_500_and_one_cancelled_499():
    async def fails(_scope, _receive, _send) -> None:
        raise RuntimeError("boom")

    async def waits(_scope, _receive, _send) -> None:
        await asyncio.sleep(60)

    async def scenario(counts: HttpCounts) -> None:
        with pytest.raises(RuntimeError):
            await CountResponses(fails, counts)(scope("POST", "/v1/completions"), receive, send)
        task = asyncio.ensure_future(CountResponses(waits, counts)(scope("POST", "/v1/completions"), receive, send))
        await asyncio.sleep(0.05)
        task.cancel()  # the server cancels a request whose client left
        with pytest.raises(asyncio.CancelledError):
            await task

    counts = HttpCounts()
    asyncio.run(scenario(counts))
    assert counts.snapshot() == {("POST", "/v1/completions", "500"): 1, ("POST", "/v1/completions", "499"): 1}


def test_websockets_and_lifespan_pass_through_uncounted():
    seen = []

    async def app(scope_, _receive, _send) -> None:
        seen.append(scope_["type"])

    counts = HttpCounts()
    asyncio.run(CountResponses(app, counts)({"type": "lifespan"}, receive, send))
    assert seen == ["lifespan"] and counts.snapshot() == {}


def test_routes_are_the_api_paths_and_other():
    assert route_of("/v1/chat/completions") == "/v1/chat/completions"
    assert route_of("/v1/models/HuggingFaceTB/SmolLM2") == "/v1/models/{model_id}"
    assert route_of("/admin") == route_of("/v1/completions/x") == "other"
