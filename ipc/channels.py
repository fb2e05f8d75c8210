"""ZeroMQ helpers: sockets that carry ipc.messages between processes.

- :class:`RuntimeDir`: a private directory (mode 0700) for ``ipc://`` endpoints,
  removed on close; it holds its owner's pid, so a later one removes the directories of
  owners that were killed (SIGKILL leaves them behind).
- :class:`Channel`: one peer to one peer (PAIR by default; DEALER for clients): send and
  receive whole messages with timeouts. Coordinator<->worker control channels are
  PAIR sockets over ``ipc://`` in a RuntimeDir (the coordinator binds, the worker
  connects).
- :class:`RouterServer`: the client-facing ROUTER socket. Many DEALER clients, each
  known by its routing id; a receive returns ``(peer, message)``; bad bytes raise
  ProtocolError with ``.peer`` set so the caller can answer with an ErrorReply. It can be
  bound to several endpoints; each ipc:// path is claimed first (ipc.endpoints: refused when
  another server owns it, created 0600, removed on close), and ``peer_gone`` tells whether a
  peer's connection has closed (ipc.peers). tcp:// is loopback only, unless the server has
  an API key: then its tcp:// endpoints are CURVE servers (ipc.curve).

Every socket gets LINGER 0 (closing never waits for unsent messages). Client-facing
sockets get ZMQ_MAXMSGSIZE: libzmq drops the connection of a peer that sends a bigger
message before buffering it, so a huge message cannot exhaust memory; the socket keeps
serving everyone else.

Timeouts are in milliseconds: None waits forever, 0 polls once. A receive that times out
returns None; a send that times out raises :class:`ChannelTimeout`.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import psutil
import zmq

from ipc import messages
from ipc.codec import ProtocolError, decode, encode
from ipc.curve import CurveGuard, CurveKeys
from ipc.endpoints import (
    MAX_IPC_PATH,
    EndpointError,
    IpcSocketClaim,
    ipc_path,
    is_loopback_host,
    private_runtime_dir,
    private_umask,
)
from ipc.handshake import HandshakeError, connect_checked
from ipc.messages import Message
from ipc.peers import PeerWatch

DEFAULT_CLIENT_MAX_MSG = 32 * 1024 * 1024  # a 16 MiB prompt plus room
# The file in a RuntimeDir that names its owner: "<pid> <process start time>".
OWNER_FILE = "owner.pid"


class ChannelTimeout(TimeoutError):
    """A send could not complete within its timeout (no peer, or the peer is not reading)."""


class ChannelClosed(RuntimeError):
    """The channel was used after close()."""


# --- endpoints ------------------------------------------------------------------------


def _private_base() -> str:
    """$XDG_RUNTIME_DIR when it is ours and private, else the temp directory."""
    return private_runtime_dir() or tempfile.gettempdir()


class RuntimeDir:
    """A private directory (0700) for ipc:// socket files; removed on close().

    Creating one first removes this user's runtime directories (same base and prefix) whose
    owner process is gone: a SIGKILLed server cannot clean up after itself.
    """

    def __init__(self, prefix: str = "dovetail", base: str | None = None):
        base = base or _private_base()
        if len(base) > 60:  # leave room for socket names under the 107-byte limit
            base = "/tmp"
        remove_stale_runtime_dirs(base, prefix)
        self.path = tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=base)  # mode 0700
        os.chmod(self.path, 0o700)
        with open(os.path.join(self.path, OWNER_FILE), "w") as owner:
            owner.write(f"{os.getpid()} {_start_time(os.getpid())}")
        self._closed = False

    def endpoint(self, name: str) -> str:
        """``ipc://<dir>/<name>.sock``."""
        if "/" in name or not name:
            raise ValueError(f"endpoint name must be a plain file name, got {name!r}")
        path = os.path.join(self.path, f"{name}.sock")
        if len(path.encode()) > MAX_IPC_PATH:
            raise ValueError(f"ipc path {path!r} is longer than the {MAX_IPC_PATH}-byte socket path limit")
        return "ipc://" + path

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _start_time(pid: int) -> float | None:
    """When process ``pid`` started (tells a live owner from a later process with its pid)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _owner_alive(directory: str, name_pid: int) -> bool:
    try:
        with open(os.path.join(directory, OWNER_FILE)) as owner:
            pid_text, _, started_text = owner.read().partition(" ")
        pid, started = int(pid_text), (None if started_text.strip() == "None" else float(started_text))
    except (OSError, ValueError):
        pid, started = name_pid, None  # no readable owner file (an older version, or half made)
    now_started = _start_time(pid)
    if now_started is None:
        return False
    return started is None or abs(now_started - started) < 1.0


def remove_stale_runtime_dirs(base: str, prefix: str = "dovetail") -> list[str]:
    """Remove ``<base>/<prefix>-<pid>-*`` directories of this user whose owner has exited."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-[^/]+$")
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        match = pattern.match(name)
        if match is None:
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        # Only our own private directories: never another user's, never a symlink.
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
            continue
        if not _owner_alive(path, int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def check_local_endpoint(endpoint: str) -> None:
    """Refuse a bind endpoint that would listen beyond this machine: only ipc://,
    inproc:// and tcp:// on a loopback address are allowed."""
    scheme = endpoint.split("://", 1)[0]
    if scheme in ("ipc", "inproc"):
        return
    if scheme != "tcp":
        raise ValueError(f"unsupported endpoint {endpoint!r}: use ipc:// or tcp://127.0.0.1:PORT")
    if not is_loopback_host(urlsplit(endpoint).hostname or ""):
        raise ValueError(f"refusing to listen on {endpoint!r} without an API key: only loopback (127.0.0.1, ::1) "
                         f"or ipc:// endpoints")


def configure_socket(sock: zmq.Socket, *, max_msg_size: int | None = None) -> zmq.Socket:
    """LINGER 0 always; MAXMSGSIZE when given."""
    sock.setsockopt(zmq.LINGER, 0)
    if max_msg_size is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, int(max_msg_size))
    return sock


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    check_local_endpoint(endpoint)  # only RouterServer, with CURVE, listens beyond loopback
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port for tcp://...:*


def _poll_ms(timeout_ms: float | None) -> int | None:
    return None if timeout_ms is None else max(0, int(timeout_ms))


def _decode_frames(frames: list, allowed: tuple[type[Message], ...], peer: bytes | None = None) -> Message:
    if len(frames) != 1:
        raise ProtocolError(f"expected one frame per message, got {len(frames)}", peer=peer)
    try:
        return decode(frames[0].buffer, allowed)
    except ProtocolError as exc:
        exc.peer = peer
        raise


def _send_frames(sock: zmq.Socket, frames: list, timeout_ms: float | None, what: str) -> None:
    if sock.poll(_poll_ms(timeout_ms), zmq.POLLOUT) == 0:
        raise ChannelTimeout(f"{what}: could not send within {timeout_ms} ms")
    try:
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
    except zmq.Again:
        raise ChannelTimeout(f"{what}: send would block") from None


# --- one to one -----------------------------------------------------------------------


class _OwnsSocket:
    """close() (idempotent, LINGER 0) and the context manager, for the socket wrappers."""

    socket: zmq.Socket | None

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket (``linger_ms``: how long libzmq may still deliver what was sent last).
        Idempotent."""
        if self.socket is not None:
            self.socket.close(linger_ms)
            self.socket = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Channel(_OwnsSocket):
    """A PAIR (or DEALER) socket that sends and receives whole messages."""

    def __init__(self, sock: zmq.Socket, *, allowed: tuple[type[Message], ...] = messages.ALL_MESSAGES,
                 endpoint: str | None = None):
        self.socket: zmq.Socket | None = sock
        self.allowed = allowed
        self.endpoint = endpoint

    @classmethod
    def bind(cls, endpoint: str, *, allowed: tuple[type[Message], ...] = messages.ALL_MESSAGES, kind: int = zmq.PAIR,
             ctx: zmq.Context | None = None, max_msg_size: int | None = None) -> Channel:
        sock = configure_socket((ctx or zmq.Context.instance()).socket(kind), max_msg_size=max_msg_size)
        try:
            real = _bind(sock, endpoint)
        except BaseException:
            sock.close(0)
            raise
        return cls(sock, allowed=allowed, endpoint=real)

    @classmethod
    def connect(cls, endpoint: str, *, allowed: tuple[type[Message], ...] = messages.ALL_MESSAGES, kind: int = zmq.PAIR,
                ctx: zmq.Context | None = None, max_msg_size: int | None = None) -> Channel:
        sock = configure_socket((ctx or zmq.Context.instance()).socket(kind), max_msg_size=max_msg_size)
        sock.connect(endpoint)
        return cls(sock, allowed=allowed, endpoint=endpoint)

    def _sock(self) -> zmq.Socket:
        if self.socket is None:
            raise ChannelClosed("channel is closed")
        return self.socket

    def send(self, msg: Message, timeout_ms: float | None = None) -> None:
        """Encode and send one message; ChannelTimeout if it cannot leave in time."""
        _send_frames(self._sock(), [encode(msg)], timeout_ms, "channel")

    def recv(self, timeout_ms: float | None = None) -> Message | None:
        """The next message, or None after ``timeout_ms``; ProtocolError on bad bytes."""
        sock = self._sock()
        if sock.poll(_poll_ms(timeout_ms), zmq.POLLIN) == 0:
            return None
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        return _decode_frames(frames, self.allowed)



def connect_client(endpoint: str, *, ctx: zmq.Context | None = None, curve: CurveKeys | None = None,
                   handshake_timeout_s: float | None = None) -> Channel:
    """A client's DEALER channel to a coordinator's RouterServer. ``curve``: connect as the
    CURVE client of an API key (tcp:// endpoints of a server with that key). With
    ``handshake_timeout_s`` it returns only once the server accepted the connection, and
    raises HandshakeError (one line: wrong key, no key, nobody there) otherwise."""
    sock = configure_socket((ctx or zmq.Context.instance()).socket(zmq.DEALER))
    try:
        if "[" in endpoint:  # an IPv6 address literal (tcp://[::1]:5555): libzmq refuses it without IPV6
            sock.setsockopt(zmq.IPV6, 1)
        if curve is not None:
            curve.configure_client(sock)
        if handshake_timeout_s is None:
            sock.connect(endpoint)
        else:
            connect_checked(sock, endpoint, handshake_timeout_s, keyed=curve is not None)
    except zmq.ZMQError as error:  # an address libzmq cannot connect to: no port, a wildcard, a path after it
        sock.close(0)
        raise HandshakeError(f"cannot connect to {endpoint}: {zmq.strerror(error.errno or 0)} (give the server's "
                             "tcp://HOST:PORT or ipc://PATH)") from None
    except BaseException:
        sock.close(0)
        raise
    return Channel(sock, allowed=messages.COORDINATOR_TO_CLIENT, endpoint=endpoint)


# --- client-facing server -------------------------------------------------------------


class RouterServer(_OwnsSocket):
    """The coordinator's client socket: a ROUTER bound to ipc:// and tcp:// endpoints.

    tcp:// endpoints are loopback only, unless ``curve`` (the CURVE keys of an API key) is
    given: then every tcp:// endpoint, loopback or not, is a CURVE server whose clients must
    present the key's client key (checked by a ZAP handler, CurveGuard, in this context),
    while ipc:// (a 0600 socket file) and inproc:// endpoints stay as they are. libzmq takes a
    listener's security from the socket's options at bind time, so those are bound first.

    recv() -> (peer, message) or None on timeout; raises ProtocolError with ``.peer``.
    send(peer, message) -> True, or False when that peer is gone; ChannelTimeout when that
    peer's queue stays full (it is not reading).
    """

    def __init__(self, endpoint: str | Sequence[str], *,
                 allowed: tuple[type[Message], ...] = messages.CLIENT_TO_COORDINATOR,
                 ctx: zmq.Context | None = None, max_msg_size: int = DEFAULT_CLIENT_MAX_MSG,
                 curve: CurveKeys | None = None):
        context = ctx or zmq.Context.instance()
        sock = configure_socket(context.socket(zmq.ROUTER), max_msg_size=max_msg_size)
        # Sends to an unknown/departed peer fail loudly instead of vanishing.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket: zmq.Socket | None = sock
        self.allowed = allowed
        self.curve = curve
        self.endpoints: list[str] = []
        self.peers = PeerWatch()
        self._claims: list[IpcSocketClaim] = []
        self._guard: CurveGuard | None = None
        self._secured = False  # CURVE is on for the binds from now on
        wanted = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        try:
            if curve is not None:
                self._guard = CurveGuard(curve, context)
                self._guard.start()  # before any bind: no connection may pass unchecked
                self._guard.watch(sock)
            # Plain endpoints first; the endpoints are listed in the order given.
            order = sorted(range(len(wanted)), key=lambda index: wanted[index].startswith("tcp://"))
            bound = {index: self.bind(wanted[index]) for index in order}
            self.endpoints = [bound[index] for index in range(len(wanted))]
        except BaseException:
            self.close()
            raise

    @property
    def endpoint(self) -> str:
        """The first bound endpoint (tcp://...:* resolved to its port)."""
        return self.endpoints[0]

    def bind(self, endpoint: str) -> str:
        """Bind one more endpoint; EndpointError (one line) when it cannot be served."""
        sock = self._sock()
        tcp = endpoint.startswith("tcp://")
        if self.curve is None or not tcp:
            check_local_endpoint(endpoint)
        if tcp and self.curve is not None and not self._secured:
            self.curve.configure_server(sock)
            self._secured = True
        elif not tcp and self._secured:
            raise ValueError(f"bind {endpoint} before the tcp:// endpoints: they share the socket's CURVE options")
        path = ipc_path(endpoint)
        claim = IpcSocketClaim.acquire(path) if path is not None else None
        try:
            if "[" in endpoint:  # an IPv6 address literal
                sock.setsockopt(zmq.IPV6, 1)
            try:
                with private_umask():
                    sock.bind(endpoint)
            except zmq.ZMQError as error:
                raise EndpointError(f"cannot serve on {endpoint}: {error.strerror}") from None
            if claim is not None:
                claim.bound()
        except BaseException:
            if claim is not None:
                claim.release()
            raise
        if claim is not None:
            self._claims.append(claim)
        real = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port for tcp://...:*
        self.endpoints.append(real)
        return real

    def _sock(self) -> zmq.Socket:
        if self.socket is None:
            raise ChannelClosed("server is closed")
        return self.socket

    def recv(self, timeout_ms: float | None = None) -> tuple[bytes, Message] | None:
        sock = self._sock()
        if sock.poll(_poll_ms(timeout_ms), zmq.POLLIN) == 0:
            return None
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        peer = frames[0].bytes
        if len(frames) > 1:
            self.peers.saw(peer, frames[1])
        return peer, _decode_frames(frames[1:], self.allowed, peer)

    def peer_gone(self, peer: bytes) -> bool:
        """Whether the connection ``peer`` last sent on has closed (see ipc.peers)."""
        return self.peers.gone(peer)

    def send(self, peer: bytes, msg: Message, timeout_ms: float | None = 1000) -> bool:
        data = encode(msg)
        sock = self._sock()
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            try:
                sock.send_multipart([peer, data], zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:  # that client's queue is full: it is not reading
                if deadline is not None and time.monotonic() >= deadline:
                    raise ChannelTimeout(f"client {peer!r} is not reading") from None
                time.sleep(0.001)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    return False
                raise

    def send_error(self, peer: bytes, request_id: str | None, code: str, message: str) -> bool:
        """Answer with an ErrorReply (message truncated to the schema's limit)."""
        return self.send(peer, messages.ErrorReply(request_id=request_id, code=code, message=message[:8000]))

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket (``linger_ms``: how long libzmq may still deliver what was sent
        last, while the context lives), then remove our ipc socket files. Idempotent."""
        if self.socket is not None:
            self.socket.close(linger_ms)
            self.socket = None
        if self._guard is not None:
            self._guard.stop()
            self._guard = None
        for claim in self._claims:
            claim.release()
        self._claims = []


__all__ = [
    "RuntimeDir", "Channel", "RouterServer", "ChannelTimeout", "ChannelClosed", "connect_client",
    "configure_socket", "check_local_endpoint", "remove_stale_runtime_dirs", "DEFAULT_CLIENT_MAX_MSG",
    "EndpointError",
]
