"""Connecting a client socket and waiting until the ZMTP handshake is through.

ZeroMQ connects in the background and retries forever: a server that refuses the handshake
(wrong API key, no key, not a ZMQ server at all) would leave a client waiting out its whole
request timeout. :func:`connect_checked` watches the socket's monitor during its first
connection and turns the outcome into a one-line :class:`HandshakeError` within
``timeout_s``, or returns once the handshake succeeded.
"""

from __future__ import annotations

import itertools
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_monitor_ids = itertools.count()
# A handshake that drops without a reason is often followed, on the automatic reconnect, by
# one that says why (a mechanism mismatch): wait this long for it. 2 s was seen to be too short
# on a loaded 2-core machine (the vague message came instead of "requires an API key").
NO_DETAIL_GRACE_S = 5.0


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
    return f"{endpoint} broke off the ZMQ handshake: does it need an API key? (or not a Dovetail server)"


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
            if vague is None:
                vague = reason
                deadline = min(deadline, time.monotonic() + NO_DETAIL_GRACE_S)
        if vague is not None:
            raise HandshakeError(vague)
        raise HandshakeError(f"no answer from {endpoint} within {timeout_s:g} s: is a dovetail-run serving there?")
    finally:
        sock.monitor(None, 0)
        monitor.close(0)
