"""Bearer-token authentication for the HTTP API, as OpenAI's API does it.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would stand between a
streaming response and the disconnect it must notice). Every path needs
``Authorization: Bearer <key>`` except the open ones (``/health``: load balancers probe it,
and it tells only whether the server is up). A missing or wrong key is a 401 with an
OpenAI-style error and ``WWW-Authenticate: Bearer``; the key presented is never echoed or
logged, and it is compared in constant time.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .api_key import ApiKey
from .openai_api import ApiError

OPEN_PATHS = frozenset({"/health"})


def presented_token(scope: Scope) -> bytes | None:
    """The bearer token of a request: None when there is no Authorization header, several of
    them, or another scheme."""
    values = [value for name, value in scope.get("headers", ()) if name == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


class BearerAuth:
    def __init__(self, app: ASGIApp, key: ApiKey, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.key = key
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = presented_token(scope)
        if token is not None and self.key.matches(token):
            await self.app(scope, receive, send)
            return
        if token is None:
            error = ApiError(401, "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                             code="missing_api_key")
            challenge = 'Bearer realm="dovetail"'
        else:
            error = ApiError(401, "incorrect API key", code="invalid_api_key")
            challenge = 'Bearer realm="dovetail", error="invalid_token"'
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": challenge})
        await response(scope, receive, send)
