"""HTTP responses counted by method, route and status, for ``/metrics``.

The coordinator counts the requests that reach it (``metrics.ServerMetrics``); the HTTP front end
refuses some before they do (a malformed body's 400, a missing key's 401, an unknown path's 404, a
too-large body's 413, the 503s while the models load). ``CountResponses`` wraps an ASGI app and
counts every response it sends, so an operator sees those too (prometheus-fastapi-instrumentator's
``http_requests_total``, which vLLM's server exports, counts the same way). Paths outside the API
count as route "other", so a scanner probing random paths adds one series, not one per path.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
                    "/metrics"})
METHODS = frozenset({"GET", "HEAD", "POST", "OPTIONS"})
CLIENT_LEFT = 499  # nginx's code: the client left before an answer was sent


def route_of(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model_id}"
    return "other"


class HttpCounts:
    """{(method, route, status): responses}, kept by the event loop's thread, read by /metrics."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def add(self, method: str, path: str, status: int) -> None:
        self.counts[(method if method in METHODS else "other", route_of(path), str(status))] += 1

    def snapshot(self) -> dict[tuple[str, str, str], int]:
        return dict(self.counts)


class CountResponses:
    """ASGI middleware: counts each HTTP request's response status in ``counts`` (500 when the app
    failed before answering, 499 when the client left first)."""

    def __init__(self, app: ASGIApp | Any, counts: HttpCounts):
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        unanswered = CLIENT_LEFT  # what counts when no status was sent: the task was cancelled (the client left)
        try:
            await self.app(scope, receive, counting_send)
        except asyncio.CancelledError:
            raise
        except BaseException:
            unanswered = 500
            raise
        finally:
            self.counts.add(scope.get("method", ""), scope.get("path", ""), status[0] if status else unanswered)
