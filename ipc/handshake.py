"""Connecting a client socket and waiting until the ZMTP handshake is through.

ZeroMQ connects in the background and retries forever: a server that refuses the handshake
(wrong API key, no key, not a ZMQ server at all) would leave a client waiting out its whole
request timeout. :func:`connect_checked` watches the socket's monitor during its first
connection and turns the outcome into a one-line :class:`HandshakeError` within
``timeout_s``, or returns once the handshake succeeded.

When libzmq reports only that the connection dropped (it does when the server hangs up before
this side has read the server's greeting, a race on a loaded machine), a plain TCP connection
reads the server's ZMTP 3 greeting, whose mechanism field (NULL or CURVE) says which side lacks
the key: the error is then the same whichever side of the race won.
"""

from __future__ import annotations

import itertools
import socket
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_monitor_ids = itertools.count()
# A handshake that drops without a reason, on a server whose mechanism the probe could not
# read, is often followed on the automatic reconnect by one that says why: wait this long for it.
NO_DETAIL_GRACE_S = 5.0
# ZMTP 3 (RFC 23): a 10-byte signature, then the version; a peer that has read our version byte
# sends the rest of its 64-byte greeting, whose bytes 12..32 name its mechanism, NUL-padded.
_SIGNATURE_AND_MAJOR = b"\xff" + bytes(8) + b"\x7f" + b"\x03"
_GREETING_BYTES = 64
_MECHANISM_FIELD = slice(12, 32)


class HandshakeError(ConnectionError):
    """The server could not be reached or refused this client; the message is one line."""


def _failure(endpoint: str, event: int, value: int, keyed: bool) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"{endpoint} refused this client's key (status {value}): wrong API key"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if keyed:
            return f"{endpoint} does not use an API key (it was started without one): connect without a key"
        return f"{endpoint} requires an API key (CURVE): give --api-key-file / DOVETAIL_API_KEY (api_key= in Python)"
    if keyed:
        return f"{endpoint} broke off the CURVE handshake: wrong API key? (or not a Dovetail server)"
    if not endpoint.startswith("tcp://"):  # ipc:// never asks for a key: the socket file's mode guards it
        return f"{endpoint} broke off the ZMQ handshake: not a Dovetail server?"
    return f"{endpoint} broke off the ZMQ handshake: does it need an API key? (or not a Dovetail server)"


def server_mechanism(endpoint: str, timeout_s: float, ours: str = "NULL") -> str | None:
    """The security mechanism ("NULL", "CURVE", ...) a ZMQ server on the tcp:// ``endpoint`` offers,
    read from its greeting over a plain TCP connection; None when that cannot be read (not tcp://,
    nothing listening, or not a ZMTP 3 server). The rest of our greeting, naming ``ours``, is sent
    only after the server's has been read, so that the server logs the same mismatch the client
    would have caused."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
            conn.sendall(_SIGNATURE_AND_MAJOR)
            greeting = b""
            while len(greeting) < _GREETING_BYTES:
                chunk = conn.recv(_GREETING_BYTES - len(greeting))
                if not chunk:
                    return None
                greeting += chunk
            try:
                conn.sendall(b"\x00" + ours.encode().ljust(20, b"\x00") + bytes(32))  # minor, mechanism, client, filler
            except OSError:
                pass  # it hung up: what it sent is all that was needed
    except (OSError, ValueError):
        return None
    if greeting[0] != 0xFF or greeting[9] != 0x7F or greeting[10] < 3:
        return None
    return greeting[_MECHANISM_FIELD].rstrip(b"\x00").decode("ascii", errors="replace")


def _mismatch(endpoint: str, keyed: bool, timeout_s: float) -> str | None:
    """The clear reason for a handshake that dropped without one, where the server's greeting
    shows that exactly one side uses a key; None otherwise."""
    mechanism = server_mechanism(endpoint, timeout_s, ours="CURVE" if keyed else "NULL")
    if (mechanism == "CURVE") == keyed or mechanism not in ("NULL", "CURVE"):
        return None
    return _failure(endpoint, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, keyed)


def connect_checked(sock: zmq.Socket, endpoint: str, timeout_s: float, keyed: bool) -> None:
    """``sock.connect(endpoint)``, then wait for its handshake: return when it succeeds, raise
    HandshakeError when it fails or nothing answers within ``timeout_s``."""
    monitor_endpoint = f"inproc://dovetail-handshake-{next(_monitor_ids)}"
    sock.monitor(monitor_endpoint, _EVENTS)
    monitor = sock.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.LINGER, 0)
    try:
        monitor.connect(monitor_endpoint)
        sock.connect(endpoint)
        deadline = time.monotonic() + timeout_s
        vague: str | None = None  # the connection dropped without a reason: wait a little for a clearer one
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(max(1, int(left * 1000))):
                break
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            reason = _failure(endpoint, event["event"], event["value"], keyed)
            if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                raise HandshakeError(reason)
            if vague is None and (clear := _mismatch(endpoint, keyed, min(max(left, 0.1), NO_DETAIL_GRACE_S))):
                raise HandshakeError(clear)
            if vague is None:
                vague = reason
                deadline = min(deadline, time.monotonic() + NO_DETAIL_GRACE_S)
        if vague is not None:
            raise HandshakeError(vague)
        raise HandshakeError(f"no answer from {endpoint} within {timeout_s:g} s: is a dovetail-run serving there?")
    finally:
        sock.monitor(None, 0)
        monitor.close(0)
