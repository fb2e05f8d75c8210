"""What an endpoint string means, and who owns an ``ipc://`` socket file.

- :func:`normalize_endpoint`: ``localhost:5555`` and ``:5555`` mean ``tcp://``, a path means
  ``ipc://``; anything unclear is refused with a one-line error instead of a ZMQError.
- :class:`IpcSocketClaim`: before a server binds ``ipc://PATH`` it claims PATH. libzmq's bind
  unlinks whatever file is there, so a second server would silently take the first one's
  traffic; the claim refuses instead. A lock file beside the socket (``PATH.lock``, flock held
  for the server's life) says "a server owns this path"; a socket file without a live lock is
  checked by connecting to it (a listener answers: refused, nobody: the stale file of a killed
  server, removed). The socket is created 0600 whatever the umask, and removed on release
  only while it is still the file this claim bound.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import os
import re
import socket
import stat
from collections.abc import Iterator

# Unix socket paths are at most 107 bytes on Linux (108 with the NUL).
MAX_IPC_PATH = 107
_TCP = re.compile(r"^tcp://\S+:(\d+|\*)$")
_HOST_PORT = re.compile(r"^(?P<host>[^/\s]*):(?P<port>\d{1,5}|\*)$")


class EndpointError(ValueError):
    """An endpoint that cannot be used; the message is one line for the user."""


def normalize_endpoint(text: str) -> str:
    """``tcp://``/``ipc://``/``inproc://`` as given; ``HOST:PORT`` or ``:PORT`` or ``PORT`` -> tcp
    (an empty host is 127.0.0.1); a path (absolute, ./relative or ending in .sock) -> ipc.
    Anything else: EndpointError."""
    text = text.strip()
    if "://" in text:
        scheme = text.split("://", 1)[0]
        if scheme not in ("tcp", "ipc", "inproc"):
            raise EndpointError(f"unsupported endpoint {text!r}: use tcp://HOST:PORT or ipc://PATH")
        # Else libzmq's 'Invalid argument' at bind, or for tcp:// the API-key refusal of a wildcard host.
        if scheme == "tcp" and not _TCP.match(text):
            raise EndpointError(f"{text!r} is not tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555 (port 0 or * picks a "
                                "free one)")
        if text == f"{scheme}://":
            raise EndpointError(f"{text!r} names nothing: use e.g. ipc:///tmp/dovetail.sock")
        return check_tcp_port(text) if scheme == "tcp" else text
    if text.isdigit():
        text = ":" + text
    match = _HOST_PORT.match(text)
    if match:
        return check_tcp_port(f"tcp://{match['host'] or '127.0.0.1'}:{match['port']}")
    if text.startswith(("/", "./", "../", "~")) or text.endswith(".sock"):
        return "ipc://" + os.path.abspath(os.path.expanduser(text))
    raise EndpointError(f"cannot tell what endpoint {text!r} means: use tcp://HOST:PORT or ipc://PATH")


def check_tcp_port(endpoint: str) -> str:
    """``endpoint`` itself, unless its port is past 65535: libzmq would bind that port modulo
    65536 (tcp://127.0.0.1:99999 served on 34463) without a word."""
    port = endpoint.rpartition(":")[2]
    if port.isdigit() and int(port) > 65535:
        raise EndpointError(f"port {int(port)} in {endpoint!r} is out of range: the port must be 1-65535 "
                            "(0 or * picks a free one)")
    return endpoint


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback; names other
    than localhost, wildcards (``*``, ``0.0.0.0``) and interface names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def private_runtime_dir() -> str | None:
    """$XDG_RUNTIME_DIR where it is a folder of ours, private and writable; None otherwise (unset, or
    inherited through su/sudo naming another user's, or gone since that user logged out)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if not xdg:
        return None
    try:
        st = os.stat(xdg)
    except OSError:
        return None
    private = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
    return xdg if private and os.access(xdg, os.W_OK) else None


def ipc_path(endpoint: str) -> str | None:
    """The file path of an ``ipc://`` endpoint, else None."""
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Files created inside get mode 0600 (sockets included): the umask is process-wide, and
    libzmq creates the socket file in the calling thread during bind."""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def _listener_answers(path: str) -> bool:
    """Whether something accepts connections on the Unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as error:
        # EAGAIN: a listener whose backlog is full is still a listener.
        return error.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
    finally:
        probe.close()


class IpcSocketClaim:
    """Ownership of one ipc socket path for a server's lifetime (see the module doc)."""

    def __init__(self, path: str):
        self.path = path
        self.lock_path = path + ".lock"
        self._lock_fd: int | None = None
        self._socket_id: tuple[int, int] | None = None

    @classmethod
    def acquire(cls, path: str) -> IpcSocketClaim:
        claim = cls(path)
        claim._acquire()
        return claim

    def _acquire(self) -> None:
        path = self.path
        if len(path.encode()) > MAX_IPC_PATH:
            raise EndpointError(f"ipc path {path!r} is longer than the {MAX_IPC_PATH}-byte socket path limit")
        directory = os.path.dirname(path) or "."
        if not os.path.isdir(directory):
            raise EndpointError(f"cannot serve on ipc://{path}: directory {directory} does not exist")
        self._lock()
        try:
            self._clear_stale_socket()
        except BaseException:
            self.release()
            raise

    def _lock(self) -> None:
        while True:
            try:
                with private_umask():
                    fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as error:
                raise EndpointError(f"cannot serve on ipc://{self.path}: {error.strerror} "
                                    f"(creating {self.lock_path})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                raise EndpointError(f"ipc://{self.path} is already served by another dovetail-run"
                                    f"{f' (pid {owner})' if owner else ''}") from None
            # The previous owner may have unlinked the lock file between our open and flock:
            # then we hold a lock on a dead inode and must try again on the new file.
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
                self._lock_fd = fd
                return
            os.close(fd)

    def _clear_stale_socket(self) -> None:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise EndpointError(f"cannot serve on ipc://{self.path}: the path exists and is not a socket")
        if _listener_answers(self.path):
            raise EndpointError(f"ipc://{self.path} is already served by another process")
        os.unlink(self.path)  # left behind by a server that was killed

    def bound(self) -> None:
        """After the bind: make the socket 0600 (the umask did, unless the file system ignores
        it) and remember which file is ours."""
        os.chmod(self.path, 0o600)
        st = os.stat(self.path)
        self._socket_id = (st.st_dev, st.st_ino)

    def release(self) -> None:
        """Remove our socket file (only if it is still ours) and the lock. Idempotent."""
        if self._socket_id is not None:
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self._socket_id:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._socket_id = None
        if self._lock_fd is not None:
            try:
                if os.stat(self.lock_path).st_ino == os.fstat(self._lock_fd).st_ino:
                    os.unlink(self.lock_path)
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None
