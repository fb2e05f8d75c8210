"""CURVE security for the client sockets on tcp://, keyed by one shared secret (the API key).

Why one secret and not key files: a user hands out one API key (the same one HTTP clients
send as a bearer token), and every holder of it can derive the rest. The secret gives, by
HMAC-SHA256 with two fixed labels, two Curve25519 secret keys: the server's and the one client
key the server accepts (public keys are ``zmq_curve_public`` of those). So a client with the
key knows the server's public key (no key exchange to arrange) and presents the client key;
one without it cannot complete the handshake: its box for the server does not open (a wrong
key), its mechanism does not match (no key), or the ZAP handler refuses its client key (an
implementation that derived the server key but not the client key). Traffic is encrypted
with per-connection keys (CurveZMQ), so an eavesdropper learns nothing; every key holder can
act as the server, which is fine: they are all trusted alike. A guessable secret could be
found offline from a recorded handshake: keys are required to be long (see api_key).

:class:`CurveGuard` runs pyzmq's ZAP handler (RFC 27, ``zmq.auth``) in the server's ZMQ context,
admitting the API key's client key alone, and logs the handshakes that fail (a client with a wrong
key, or none, or a key the handler refused), at most once per LOG_EVERY_S each kind. The API key is
never logged; the keys' reprs are redacted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

SERVER_LABEL = b"dovetail curve server key v1"
CLIENT_LABEL = b"dovetail curve client key v1"
ZAP_DOMAIN = b"dovetail"
LOG_EVERY_S = 10.0
_POLL_MS = 100
_WATCHED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class CurveError(RuntimeError):
    """CURVE cannot be used: no libsodium in this libzmq, or the authenticator cannot start."""


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveError(f"this libzmq ({zmq.zmq_version()}) has no CURVE support, which an API key on tcp:// "
                               f"needs: install a pyzmq wheel (they bundle libsodium)")


def derive_secret_key(secret: bytes, label: bytes) -> bytes:
    """A Z85 Curve25519 secret key: HMAC-SHA256(key=secret, msg=label), Z85-encoded."""
    return z85.encode(hmac.new(secret, label, hashlib.sha256).digest())


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """The server keypair and the accepted client keypair of one shared secret (Z85 bytes)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> CurveKeys:
        require_curve()
        server_secret = derive_secret_key(secret, SERVER_LABEL)
        client_secret = derive_secret_key(secret, CLIENT_LABEL)
        return cls(server_public=zmq.curve_public(server_secret), server_secret=server_secret,
                   client_public=zmq.curve_public(client_secret), client_secret=client_secret)

    def __repr__(self) -> str:
        return "CurveKeys(<redacted>)"

    def configure_server(self, sock: zmq.Socket) -> None:
        """Make the next binds of ``sock`` CURVE servers whose clients the ZAP handler checks.
        libzmq copies a socket's options into each listener at bind time, so endpoints bound
        before this stay as they were."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        # Without a ZAP handler libzmq would accept any client: fail closed instead.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def configure_client(self, sock: zmq.Socket) -> None:
        """Make ``sock``'s next connects CURVE clients of the server this secret gives."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


class _Throttle:
    """Log one kind of line at most once per LOG_EVERY_S, saying how many were left out."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warn(self, kind: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        log.warning("%s%s", text, f" ({skipped} more since the last such line)" if skipped else "")


class _ApiKeyClients:
    """pyzmq's CURVE credentials callback: admit the API key's client key alone (constant time)."""

    def __init__(self, client_public: bytes):
        self._client_public = client_public

    def callback(self, domain: str, client_public: bytes) -> bool:
        return domain == ZAP_DOMAIN.decode() and hmac.compare_digest(client_public, self._client_public)


class CurveGuard:
    """The ZAP handler of ``ctx`` (pyzmq's ThreadAuthenticator, admitting the API key's client key
    alone), plus a watch on the server socket's failed handshakes, logged.

    ``start`` starts the authenticator (before the server binds, so no connection slips through);
    ``watch`` attaches to the server socket's monitor; ``stop`` ends both threads. The watch thread
    owns its socket: it creates, uses and closes it.
    """

    def __init__(self, keys: CurveKeys, ctx: zmq.Context):
        self._ctx = ctx
        # pyzmq logs every decision at debug with the client's public key: not a secret, but
        # kept under our logger so that one switch silences it.
        self._authenticator = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self._clients = _ApiKeyClients(keys.client_public)
        self._stop = threading.Event()
        self._monitor_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        self._throttle = _Throttle()

    def start(self) -> None:
        # A handler closed a moment ago (the server before this one) holds the ZAP address
        # until libzmq's reaper runs.
        deadline = time.monotonic() + 1.0
        while True:
            try:
                self._authenticator.start()
                break
            except zmq.ZMQError as error:
                self._authenticator.stop()
                if error.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise CurveError(f"cannot start the CURVE authenticator: {error}") from None
                time.sleep(0.01)
        self._authenticator.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=self._clients)

    def watch(self, server: zmq.Socket) -> None:
        """Log the failed handshakes of ``server`` (its monitor feeds the watch thread)."""
        endpoint = f"inproc://dovetail-curve-monitor-{id(self)}"
        server.monitor(endpoint, _WATCHED)
        self._monitor_endpoint = endpoint
        self._thread = threading.Thread(target=self._watch, name="dovetail-curve-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)
        self._authenticator.stop()

    def _watch(self) -> None:
        assert self._monitor_endpoint is not None
        monitor = self._ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        try:
            monitor.connect(self._monitor_endpoint)
            while not self._stop.is_set():
                if monitor.poll(_POLL_MS):
                    self._report(monitor.recv_multipart())
        except zmq.ContextTerminated:
            pass
        finally:
            monitor.close(0)

    def _report(self, frames: list[bytes]) -> None:
        try:
            event = parse_monitor_message(frames)
        except Exception:  # never let a surprise in a log line stop the watch
            return
        endpoint = event["endpoint"].decode(errors="replace")
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._throttle.warn("zap", f"refused a ZMQ client on {endpoint}: it did not present the API key's "
                                       f"CURVE client key")
        elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            self._throttle.warn("mismatch", f"a ZMQ client on {endpoint} failed the handshake: it uses no API key "
                                            f"(or this endpoint has none)")
        elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                event["value"] == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            self._throttle.warn("crypto", f"a ZMQ client on {endpoint} failed the CURVE handshake: wrong API key")
        else:
            self._throttle.warn("other", f"a ZMQ client on {endpoint} failed the handshake (not a Dovetail "
                                         f"client?)")
