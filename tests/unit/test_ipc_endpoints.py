"""ipc.endpoints and the RouterServer's binds: what endpoint strings mean, who owns an ipc
socket file (a second server is refused, a stale file is replaced), 0600 whatever the umask,
files removed on close; ipc.peers: noticing a client that left; stale runtime directories."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

from ipc import messages as M
from ipc.channels import OWNER_FILE, RouterServer, RuntimeDir, connect_client, remove_stale_runtime_dirs
from ipc.endpoints import EndpointError, normalize_endpoint


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.mark.parametrize("given, meant", [
    ("localhost:5555", "tcp://localhost:5555"),
    ("127.0.0.1:5555", "tcp://127.0.0.1:5555"),
    (":5555", "tcp://127.0.0.1:5555"),
    ("5555", "tcp://127.0.0.1:5555"),
    ("127.0.0.1:*", "tcp://127.0.0.1:*"),
    ("tcp://127.0.0.1:1", "tcp://127.0.0.1:1"),
    ("ipc:///tmp/x.sock", "ipc:///tmp/x.sock"),
    ("/tmp/x.sock", "ipc:///tmp/x.sock"),
    ("x.sock", "ipc://" + os.path.abspath("x.sock")),
])
def test_endpoint_spellings(given, meant):
    assert normalize_endpoint(given) == meant


@pytest.mark.parametrize("bad", ["localhost", "http://127.0.0.1:80", "udp://x:1", "", "host:port",
                                 # were libzmq's 'Invalid argument' at bind, or (tcp://) the API-key refusal
                                 "tcp://", "tcp://127.0.0.1", "tcp://localhost:abc", "ipc://"])
def test_unclear_endpoints_are_refused_in_one_line(bad):
    with pytest.raises(EndpointError) as info:
        normalize_endpoint(bad)
    assert "\n" not in str(info.value)


def test_ipc_socket_is_0600_whatever_the_umask_and_removed_on_close(ctx, tmp_path):
    path = tmp_path / "s.sock"
    old = os.umask(0)
    try:
        server = RouterServer(f"ipc://{path}", ctx=ctx)
    finally:
        os.umask(old)
    assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(f"{path}.lock").st_mode) == 0o600
    server.close()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_second_server_on_the_same_path_is_refused(ctx, tmp_path):
    endpoint = f"ipc://{tmp_path}/s.sock"
    with RouterServer(endpoint, ctx=ctx) as first:
        with pytest.raises(EndpointError, match=rf"already served by another dovetail-run \(pid {os.getpid()}\)"):
            RouterServer(endpoint, ctx=ctx)
        # The first one still has its traffic.
        client = connect_client(endpoint, ctx=ctx)
        client.send(M.Ping(nonce=4))
        peer, message = first.recv(timeout_ms=2000)
        assert message == M.Ping(nonce=4)
        client.close()
    # Released: a new server may take the path.
    RouterServer(endpoint, ctx=ctx).close()


def test_a_stale_socket_file_is_replaced_and_a_foreign_listener_refused(ctx, tmp_path):
    path = str(tmp_path / "s.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # a killed server's file: nobody listens
    dead.close()
    assert os.path.exists(path)
    with RouterServer(f"ipc://{path}", ctx=ctx) as server:
        client = connect_client(server.endpoint, ctx=ctx)
        client.send(M.Ping(nonce=1))
        assert server.recv(timeout_ms=2000)[1] == M.Ping(nonce=1)
        client.close()
    other = tmp_path / "other.sock"
    foreign = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    foreign.bind(str(other))
    foreign.listen(1)
    try:
        with pytest.raises(EndpointError, match="already served by another process"):
            RouterServer(f"ipc://{other}", ctx=ctx)
        assert os.path.exists(other)  # not taken over
    finally:
        foreign.close()
    (tmp_path / "file.sock").write_text("not a socket")
    with pytest.raises(EndpointError, match="not a socket"):
        RouterServer(f"ipc://{tmp_path}/file.sock", ctx=ctx)
    with pytest.raises(EndpointError, match="does not exist"):
        RouterServer(f"ipc://{tmp_path}/missing/s.sock", ctx=ctx)
    with pytest.raises(EndpointError, match="socket path limit"):
        RouterServer(f"ipc://{tmp_path}/{'x' * 120}.sock", ctx=ctx)


def test_a_taken_port_is_one_clear_error_and_releases_what_was_bound(ctx, tmp_path):
    taken = ctx.socket(zmq.ROUTER)
    taken.bind("tcp://127.0.0.1:*")
    port = taken.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    with pytest.raises(EndpointError, match=f"cannot serve on tcp://127.0.0.1:{port}: Address already in use"):
        RouterServer([f"ipc://{tmp_path}/s.sock", f"tcp://127.0.0.1:{port}"], ctx=ctx)
    assert os.listdir(tmp_path) == []  # the ipc bind that succeeded first was undone
    taken.close()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_the_server_notices_a_client_that_left(ctx, tmp_path, transport):
    endpoint = f"ipc://{tmp_path}/s.sock" if transport == "ipc" else "tcp://127.0.0.1:*"
    with RouterServer(endpoint, ctx=ctx) as server:
        leaver, stayer = connect_client(server.endpoint, ctx=ctx), connect_client(server.endpoint, ctx=ctx)
        leaver.send(M.Ping(nonce=1))
        stayer.send(M.Ping(nonce=2))
        peers = {}
        for _ in range(2):
            peer, message = server.recv(timeout_ms=2000)
            peers[message.nonce] = peer
        assert not server.peer_gone(peers[1]) and not server.peer_gone(peers[2])
        assert not server.peer_gone(b"never seen")
        leaver.close()
        deadline = time.monotonic() + 5
        while not server.peer_gone(peers[1]):
            assert time.monotonic() < deadline, "the disconnect was not noticed"
            time.sleep(0.01)
        assert not server.peer_gone(peers[2])
        stayer.close()


@pytest.fixture
def short_dir():
    """A base directory short enough that RuntimeDir uses it (pytest's tmp_path is too long)."""
    path = tempfile.mkdtemp(prefix="rd-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_stale_runtime_dirs_are_removed_and_live_ones_kept(short_dir):
    tmp_path = short_dir
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(exited.stdout)
    stale = tmp_path / f"dovetail-{dead_pid}-abc"
    stale.mkdir(mode=0o700)
    (stale / OWNER_FILE).write_text(f"{dead_pid} 12345.0")
    (stale / "cpu_worker.sock").write_text("")
    # Our own pid but another start time: the pid was reused by a later process.
    reused = tmp_path / f"dovetail-{os.getpid()}-old"
    reused.mkdir(mode=0o700)
    (reused / OWNER_FILE).write_text(f"{os.getpid()} 1.0")
    nameless = tmp_path / f"dovetail-{dead_pid}-nofile"  # an older layout: the pid is in the name only
    nameless.mkdir(mode=0o700)
    shared = tmp_path / f"dovetail-{dead_pid}-shared"  # not private: not ours to remove
    shared.mkdir(mode=0o755)
    other = tmp_path / "something-else"
    other.mkdir(mode=0o700)
    live = RuntimeDir(base=str(tmp_path))
    try:
        assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(live.path), shared.name, other.name])
        # A live owner's directory is kept.
        assert remove_stale_runtime_dirs(str(tmp_path)) == []
        assert os.path.isdir(live.path)
    finally:
        live.close()


def test_the_default_socket_is_in_xdg_runtime_dir_only_where_that_is_a_private_folder_of_ours(tmp_path, monkeypatch):
    """XDG_RUNTIME_DIR inherited through su/sudo (another user's folder) or gone since logout: serving
    without --bind failed with 'directory ... does not exist' on a path the user never named."""
    from dovetail_runtime.cli import default_bind

    mine = tmp_path / "run"
    mine.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(mine))
    assert default_bind() == f"ipc://{mine}/dovetail-{os.getuid()}.sock"
    for unusable in (tmp_path / "gone", tmp_path / "file"):
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(unusable))
        assert default_bind() == f"ipc:///tmp/dovetail-{os.getuid()}.sock"
    mine.chmod(0o755)  # readable by others: not a runtime folder
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(mine))
    assert default_bind() == f"ipc:///tmp/dovetail-{os.getuid()}.sock"
