"""ipc.curve and ipc.handshake in one process: the CURVE keys an API key gives, a RouterServer
whose tcp:// endpoints need them, and the one-line errors a client gets for a wrong key, no
key, a key the server does not use, or nobody there."""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq

from ipc import messages as M
from ipc.channels import RouterServer, connect_client
from ipc.curve import CurveError, CurveKeys, derive_secret_key
from ipc.handshake import HandshakeError, server_mechanism

KEY = b"right-key-0123456789abcdef"
WRONG = b"wrong-key-0123456789abcdef"
HANDSHAKE_S = 5.0


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def answers(server: RouterServer, client, nonce: int) -> bool:
    """Send a Ping through ``client``; the server echoes a Pong; whether it came back."""
    client.send(M.Ping(nonce=nonce), timeout_ms=2000)
    received = server.recv(timeout_ms=5000)
    if received is None:
        return False
    peer, message = received
    assert message == M.Ping(nonce=nonce)
    server.send(peer, M.Pong(nonce=nonce))
    return client.recv(timeout_ms=5000) == M.Pong(nonce=nonce)


def test_keys_are_derived_from_the_secret_alone_and_never_printed():
    keys, again, other = CurveKeys.from_secret(KEY), CurveKeys.from_secret(KEY), CurveKeys.from_secret(WRONG)
    assert keys.server_public == again.server_public and keys.client_secret == again.client_secret
    assert keys.server_public != other.server_public and keys.client_public != other.client_public
    assert keys.server_public != keys.client_public
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert all(len(key) == 40 for key in (keys.server_public, keys.server_secret, keys.client_public,
                                          keys.client_secret))
    assert repr(keys) == "CurveKeys(<redacted>)" and KEY.decode() not in repr(keys)


def test_the_test_vector_in_docs_protocol_md():
    # docs/protocol.md gives these so that a client in another language can check its derivation.
    secret = b"dovetail-example-key-0123456789"
    keys = CurveKeys.from_secret(secret)
    assert derive_secret_key(secret, b"dovetail curve client key v1") == keys.client_secret
    documented = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text(encoding="utf-8")
    for value in (keys.server_public, keys.client_public, keys.client_secret):
        assert f"`{value.decode()}`" in documented
    raw = hmac.new(secret, b"dovetail curve client key v1", hashlib.sha256).hexdigest()
    assert f"hex `{raw}`" in documented


def test_tcp_needs_the_key_and_ipc_does_not(ctx, tmp_path):
    keys = CurveKeys.from_secret(KEY)
    ipc = f"ipc://{tmp_path}/s.sock"
    with RouterServer(["tcp://127.0.0.1:*", ipc], ctx=ctx, curve=keys) as server:
        tcp = server.endpoints[0]
        assert tcp.startswith("tcp://127.0.0.1:") and server.endpoints[1] == ipc  # the order given
        with connect_client(tcp, ctx=ctx, curve=keys, handshake_timeout_s=HANDSHAKE_S) as client:
            assert answers(server, client, 1)
        with connect_client(ipc, ctx=ctx) as client:
            assert answers(server, client, 2)


@pytest.mark.parametrize("client_keys, says", [
    (CurveKeys.from_secret(WRONG), "broke off the CURVE handshake: wrong API key?"),
    (None, "requires an API key (CURVE)"),
])
def test_a_wrong_or_missing_key_is_a_clear_error_soon(ctx, caplog, client_keys, says):
    caplog.set_level(logging.WARNING, logger="ipc.curve")
    with RouterServer("tcp://127.0.0.1:*", ctx=ctx, curve=CurveKeys.from_secret(KEY)) as server:
        started = time.monotonic()
        with pytest.raises(HandshakeError) as info:
            connect_client(server.endpoint, ctx=ctx, curve=client_keys, handshake_timeout_s=30)
        assert time.monotonic() - started < 10  # the refusal itself, not the timeout
        assert says in str(info.value) and server.endpoint in str(info.value) and "\n" not in str(info.value)
        assert server.recv(timeout_ms=200) is None  # nothing got through
        deadline = time.monotonic() + 5  # the server says so too (its authenticator thread logs it)
        while "failed the" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    # A keyless client may hang up before the server reads its mechanism: then the server saw less.
    assert ("failed the CURVE handshake: wrong API key" if client_keys else "a ZMQ client on") in caplog.text
    assert KEY.decode() not in caplog.text and WRONG.decode() not in caplog.text


def test_the_servers_mechanism_is_read_from_its_greeting(ctx):
    with RouterServer("tcp://127.0.0.1:*", ctx=ctx) as plain, \
            RouterServer("tcp://127.0.0.1:*", ctx=ctx, curve=CurveKeys.from_secret(KEY)) as keyed:
        assert server_mechanism(plain.endpoint, 5) == "NULL"
        assert server_mechanism(keyed.endpoint, 5) == "CURVE"
        assert server_mechanism(keyed.endpoint, 5, ours="CURVE") == "CURVE"
        assert server_mechanism("ipc:///tmp/not-tcp", 5) is None
    with not_zmq() as endpoint:
        assert server_mechanism(endpoint, 5) is None
    with socket.socket() as held:  # bound, not listening: nobody there
        held.bind(("127.0.0.1", 0))
        assert server_mechanism(f"tcp://127.0.0.1:{held.getsockname()[1]}", 5) is None


class not_zmq:
    """A TCP server that answers every connection with an HTTP error: not a ZMQ server."""

    def __enter__(self) -> str:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(64))

    def __exit__(self, *exc) -> None:
        self.listener.close()


def test_a_server_that_hangs_up_before_its_greeting_is_read_is_still_named(ctx):
    """The race CI lost: a keyed server closes the connection before the client has read its
    greeting, so libzmq reports no reason. Played here by a server that hangs up on ZMQ clients
    (they send 10 bytes and wait) and greets, as CURVE, only the probe (which sends 11)."""
    listener = socket.create_server(("127.0.0.1", 0))
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"CURVE".ljust(20, b"\x00") + b"\x01" + bytes(31)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(0.5)
                got = b""
                try:
                    while len(got) < 11 and (chunk := conn.recv(11 - len(got))):
                        got += chunk
                except OSError:
                    pass
                if len(got) == 11:
                    conn.sendall(greeting)
                    time.sleep(0.2)

    threading.Thread(target=serve, daemon=True).start()
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        started = time.monotonic()
        with pytest.raises(HandshakeError, match="requires an API key"):
            connect_client(endpoint, ctx=ctx, handshake_timeout_s=30)
        assert time.monotonic() - started < 3  # at once, not after the grace for a clearer reconnect
    finally:
        listener.close()


def test_the_zap_handler_refuses_a_client_key_that_is_not_the_api_keys(ctx, caplog):
    """A client that knows the server key (derived it) but brings its own keypair."""
    keys = CurveKeys.from_secret(KEY)
    public, secret = zmq.curve_keypair()
    stranger = CurveKeys(server_public=keys.server_public, server_secret=b"", client_public=public,
                         client_secret=secret)
    caplog.set_level(logging.WARNING, logger="ipc.curve")
    with RouterServer("tcp://127.0.0.1:*", ctx=ctx, curve=keys) as server:
        with pytest.raises(HandshakeError, match="refused this client's key"):
            connect_client(server.endpoint, ctx=ctx, curve=stranger, handshake_timeout_s=HANDSHAKE_S)
        assert server.recv(timeout_ms=200) is None  # nothing got through
        deadline = time.monotonic() + 5  # the watch thread logs it from the server socket's monitor
        while f"refused a ZMQ client on {server.endpoint}" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"refused a ZMQ client on {server.endpoint}: it did not present" in caplog.text


def test_a_key_for_a_server_without_one_and_nobody_there(ctx):
    with RouterServer("tcp://127.0.0.1:*", ctx=ctx) as server:
        with pytest.raises(HandshakeError, match="does not use an API key"):
            connect_client(server.endpoint, ctx=ctx, curve=CurveKeys.from_secret(KEY), handshake_timeout_s=HANDSHAKE_S)
        with connect_client(server.endpoint, ctx=ctx, handshake_timeout_s=HANDSHAKE_S) as client:  # no key: fine
            assert answers(server, client, 3)
    # A port held (bound, not listening), so that no other process can start serving on it meanwhile.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        started = time.monotonic()
        with pytest.raises(HandshakeError, match="no answer from .* within 1 s"):
            connect_client(f"tcp://127.0.0.1:{held.getsockname()[1]}", ctx=ctx, handshake_timeout_s=1)
        assert time.monotonic() - started < 5


def test_beyond_loopback_only_with_curve(ctx):
    with pytest.raises(ValueError, match="without an API key"):
        RouterServer("tcp://0.0.0.0:*", ctx=ctx)
    keys = CurveKeys.from_secret(KEY)
    with RouterServer("tcp://0.0.0.0:*", ctx=ctx, curve=keys) as server:
        port = server.endpoint.rsplit(":", 1)[1]
        with pytest.raises(HandshakeError, match="requires an API key"):
            connect_client(f"tcp://127.0.0.1:{port}", ctx=ctx, handshake_timeout_s=HANDSHAKE_S)
        with connect_client(f"tcp://127.0.0.1:{port}", ctx=ctx, curve=keys, handshake_timeout_s=HANDSHAKE_S) as ok:
            assert answers(server, ok, 4)


def test_a_second_keyed_server_in_one_context_is_refused_and_the_handler_is_released(ctx):
    keys = CurveKeys.from_secret(KEY)
    with RouterServer("tcp://127.0.0.1:*", ctx=ctx, curve=keys), \
            pytest.raises(CurveError, match="CURVE authenticator"):
        RouterServer("tcp://127.0.0.1:*", ctx=ctx, curve=keys)
    # Closed, the first one's handler is gone too.
    with RouterServer("tcp://127.0.0.1:*", ctx=ctx, curve=keys) as server, \
            connect_client(server.endpoint, ctx=ctx, curve=keys, handshake_timeout_s=HANDSHAKE_S) as client:
        assert answers(server, client, 5)


def test_without_its_authenticator_the_server_lets_nobody_in(ctx):
    """ZAP_ENFORCE_DOMAIN: libzmq would otherwise accept every CURVE client when no ZAP handler runs."""
    keys = CurveKeys.from_secret(KEY)
    with RouterServer("tcp://127.0.0.1:*", ctx=ctx, curve=keys) as server:
        assert server._guard is not None
        server._guard.stop()
        with pytest.raises(HandshakeError):
            connect_client(server.endpoint, ctx=ctx, curve=keys, handshake_timeout_s=2)
        assert server.recv(timeout_ms=200) is None
