"""ipc.channels: private runtime dirs, ROUTER serving several clients over ipc:// and
loopback tcp://, worker PAIR channels, timeouts, and MAXMSGSIZE."""

from __future__ import annotations

import os
import stat
import time

import msgpack
import msgspec
import pytest
import zmq

from ipc import messages as M
from ipc.channels import (
    Channel,
    ChannelClosed,
    ChannelTimeout,
    RouterServer,
    RuntimeDir,
    check_local_endpoint,
    connect_client,
)
from ipc.codec import ProtocolError
from ipc.handshake import HandshakeError


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    # A failed test leaves its sockets open, and term() would then wait for them forever:
    # close them here so the failure is reported instead of a hang.
    left_open = [sock for sock in list(getattr(context, "_sockets", ())) if not sock.closed]
    for sock in left_open:
        sock.close(0)
    t0 = time.monotonic()
    context.term()  # LINGER 0 everywhere: never hangs on unsent messages
    assert time.monotonic() - t0 < 2
    assert not left_open, f"{len(left_open)} socket(s) left open"


@pytest.fixture
def rundir():
    with RuntimeDir() as d:
        yield d


def test_runtime_dir_is_private_and_removed():
    d = RuntimeDir()
    mode = os.stat(d.path).st_mode
    assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == 0o700
    assert os.path.basename(d.path).startswith(f"dovetail-{os.getpid()}-")
    ep = d.endpoint("cpu")
    assert ep == f"ipc://{d.path}/cpu.sock"
    with pytest.raises(ValueError):
        d.endpoint("../evil")
    with pytest.raises(ValueError, match="socket path limit"):
        d.endpoint("x" * 200)
    open(os.path.join(d.path, "cpu.sock"), "w").close()
    d.close()
    d.close()
    assert not os.path.exists(d.path)


def test_only_local_endpoints_are_bound(ctx):
    for ok in ("ipc:///tmp/x.sock", "tcp://127.0.0.1:5555", "tcp://127.0.0.2:1", "tcp://[::1]:5555", "tcp://localhost:1"):
        check_local_endpoint(ok)
    for bad in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "udp://127.0.0.1:1", "tcp://eth0:5555"):
        with pytest.raises(ValueError):
            check_local_endpoint(bad)
    with pytest.raises(ValueError, match="refusing"):
        RouterServer("tcp://*:0", ctx=ctx)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_router_serves_two_dealer_clients(ctx, rundir, transport):
    endpoint = rundir.endpoint("client") if transport == "ipc" else "tcp://127.0.0.1:*"
    with RouterServer(endpoint, ctx=ctx) as server:
        if transport == "tcp":
            assert server.endpoint.startswith("tcp://127.0.0.1:") and not server.endpoint.endswith("*")
        a = connect_client(server.endpoint, ctx=ctx)
        b = connect_client(server.endpoint, ctx=ctx)
        request = M.GenerateRequest(request_id="A", prompt="alpha", stream=True, max_new_tokens=8, stop=["\n"],
                                    sampling=M.Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=3))
        a.send(request)
        b.send(M.GenerateRequest(request_id="B", prompt="beta"))
        peers = {}
        for _ in range(2):
            peer, msg = server.recv(timeout_ms=2000)
            peers[msg.request_id] = peer
            if msg.request_id == "A":
                assert msg == request
        assert peers["A"] != peers["B"]
        # Replies go to the right client, interleaved.
        assert server.send(peers["B"], M.TokenChunk(request_id="B", token_ids=[2], text="b"))
        assert server.send(peers["A"], M.TokenChunk(request_id="A", token_ids=[1], text="a"))
        stats = M.RequestStats(new_tokens=1, cycles=0, wall_ms=5.0)
        assert server.send(peers["A"], M.GenerateDone(request_id="A", token_ids=[1], text="a", finish_reason="stop",
                                                      stats=stats))
        assert a.recv(2000) == M.TokenChunk(request_id="A", token_ids=[1], text="a")
        done = a.recv(2000)
        assert done.finish_reason == "stop" and done.stats == stats
        assert b.recv(2000) == M.TokenChunk(request_id="B", token_ids=[2], text="b")
        assert a.recv(0) is None and b.recv(0) is None
        a.close()
        b.close()


def test_timeouts(ctx, rundir):
    with RouterServer(rundir.endpoint("client"), ctx=ctx) as server:
        t0 = time.monotonic()
        assert server.recv(timeout_ms=50) is None
        assert 0.04 <= time.monotonic() - t0 < 1.0
        assert server.recv(timeout_ms=0) is None
    lonely = Channel.bind(rundir.endpoint("cpu"), ctx=ctx)  # no worker connected
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout):
        lonely.send(M.Ping(nonce=1), timeout_ms=50)
    assert time.monotonic() - t0 < 1.0
    assert lonely.recv(timeout_ms=20) is None
    lonely.close()
    with pytest.raises(ChannelClosed):
        lonely.recv(0)


def test_bad_client_bytes_get_an_error_reply_and_the_server_survives(ctx, rundir):
    with RouterServer(rundir.endpoint("client"), ctx=ctx) as server:
        bad = Channel.connect(server.endpoint, kind=zmq.DEALER, ctx=ctx)
        good = connect_client(server.endpoint, ctx=ctx)
        for raw, pattern in (
            (b"\xc1garbage", "not a valid msgpack message"),
            (b"\x80\x04garbage", "missing required field `type`"),
            (msgpack.packb({"type": "Shutdown"}), "'Shutdown'.*accepted here: GenerateRequest, Cancel, Ping"),
            (msgpack.packb({"v": 9, "type": "Cancel", "request_id": "x"}), "protocol version 9"),
            (msgpack.packb({"type": "GenerateRequest", "request_id": "x", "prompt": "p", "max_new_tokens": 0}),
             r"at `\$\.max_new_tokens`"),
            (b"\x82\xa1x" + b"\x91" * 100_000 + b"\x00\xa4type\xa4Ping", "msgpack"),  # deeper than the stack
        ):
            bad.socket.send(raw)
            with pytest.raises(ProtocolError, match=pattern) as info:
                server.recv(timeout_ms=2000)
            assert info.value.peer is not None
            assert server.send_error(info.value.peer, None, "bad_message", str(info.value))
            reply = bad.recv(2000)
            assert isinstance(reply, M.ErrorReply) and reply.code == "bad_message" and reply.request_id is None
        bad.socket.send_multipart([b"two", b"frames"])
        with pytest.raises(ProtocolError, match="one frame"):
            server.recv(timeout_ms=2000)
        good.send(M.Cancel(request_id="r"))
        peer, msg = server.recv(timeout_ms=2000)
        assert msg == M.Cancel(request_id="r")
        bad.close()
        good.close()


def test_send_to_departed_client_returns_false(ctx, rundir):
    with RouterServer(rundir.endpoint("client"), ctx=ctx) as server:
        client = connect_client(server.endpoint, ctx=ctx)
        client.send(M.Ping(nonce=1))
        peer, _ = server.recv(2000)
        client.close()
        deadline = time.monotonic() + 5
        while server.send(peer, M.Pong(nonce=1)):  # until the server notices the disconnect
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert server.send(b"never-connected", M.Pong(nonce=1)) is False


def test_oversize_message_is_dropped_without_killing_the_socket(ctx, rundir):
    with RouterServer(rundir.endpoint("client"), ctx=ctx, max_msg_size=64 * 1024) as server:
        assert server.socket.getsockopt(zmq.MAXMSGSIZE) == 64 * 1024
        assert server.socket.getsockopt(zmq.LINGER) == 0
        big = connect_client(server.endpoint, ctx=ctx)
        small = connect_client(server.endpoint, ctx=ctx)
        small.send(M.Ping(nonce=1))
        peer_small, _ = server.recv(2000)
        big.send(M.GenerateRequest(request_id="big", prompt="x" * (1 << 20)))
        assert server.recv(timeout_ms=300) is None  # refused before it was buffered
        # The other client is still served on the same socket.
        small.send(M.Ping(nonce=2))
        peer, msg = server.recv(2000)
        assert peer == peer_small and msg == M.Ping(nonce=2)
        assert server.send(peer, M.Pong(nonce=2)) and small.recv(2000) == M.Pong(nonce=2)
        # The offender's connection was dropped; its DEALER reconnects and may go on.
        big.send(M.Ping(nonce=3))
        peer, msg = server.recv(3000)
        assert msg == M.Ping(nonce=3)
        big.close()
        small.close()


def test_worker_pair_channel_round_trip(ctx, rundir):
    endpoint = rundir.endpoint("cpu")
    coordinator = Channel.bind(endpoint, allowed=M.FROM_CPU_WORKER, ctx=ctx)
    worker = Channel.connect(endpoint, allowed=M.TO_CPU_WORKER, ctx=ctx)
    assert coordinator.socket.getsockopt(zmq.LINGER) == 0 and worker.socket.getsockopt(zmq.LINGER) == 0
    info = msgspec.Raw(msgpack.packb({"hidden": 64}))
    worker.send(M.Ready(worker="cpu", pid=os.getpid(), info=info), timeout_ms=2000)
    assert coordinator.recv(2000) == M.Ready(worker="cpu", pid=os.getpid(), info=info)
    coordinator.send(M.VerifyRequest(seq_id=1, tokens=[5, 6], parents=[-1, 0]), timeout_ms=2000)
    assert worker.recv(2000) == M.VerifyRequest(seq_id=1, tokens=[5, 6], parents=[-1, 0])
    ring_ref = M.RingRef(ring="dovetail-1-x", slot=0, seq=1, rows=2, cols=64, dtype="float16")
    worker.send(M.VerifyResult(seq_id=1, accepted_tokens=[6, 9], features=ring_ref))
    assert coordinator.recv(2000).features == ring_ref
    # Direction is enforced: a worker does not accept a worker's own messages.
    coordinator.send(M.Ready(worker="x", pid=1))
    with pytest.raises(ProtocolError, match=r"'Ready'.*accepted here: PrefillRequest") as info:
        worker.recv(2000)
    assert info.value.peer is None  # a PAIR has one peer
    # ...and the channel keeps working after a refused message (the worker loop relies on it).
    coordinator.send(M.Ping(nonce=7))
    assert worker.recv(2000) == M.Ping(nonce=7)
    worker.send(M.Pong(nonce=7))
    assert coordinator.recv(2000) == M.Pong(nonce=7)
    coordinator.close()
    worker.close()


def test_invalid_message_is_refused_before_it_is_sent(ctx, rundir):
    endpoint = rundir.endpoint("gpu")
    coordinator = Channel.bind(endpoint, allowed=M.FROM_GPU_WORKER, ctx=ctx)
    worker = Channel.connect(endpoint, allowed=M.TO_GPU_WORKER, ctx=ctx)
    with pytest.raises(ProtocolError, match=r"DraftResult would be refused: .* - at `\$\.tokens\[0\]`"):
        worker.send(M.DraftResult(seq_id=1, tokens=[-1], parents=[-1]), timeout_ms=2000)
    with pytest.raises(ProtocolError, match="is not a message type"):
        worker.send(M.RingRef(ring="r", slot=0, seq=1, rows=1, cols=1, dtype="float16"), timeout_ms=2000)
    assert coordinator.recv(100) is None  # nothing left
    worker.send(M.DraftResult(seq_id=1, tokens=[4], parents=[-1]), timeout_ms=2000)
    assert coordinator.recv(2000) == M.DraftResult(seq_id=1, tokens=[4], parents=[-1])
    coordinator.close()
    worker.close()


def test_one_router_bound_to_ipc_and_tcp(ctx, rundir):
    """The coordinator binds its one client socket to every --listen endpoint."""
    with RouterServer(rundir.endpoint("client"), ctx=ctx) as server:
        server.socket.bind("tcp://127.0.0.1:*")
        tcp = server.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        over_ipc = connect_client(server.endpoint, ctx=ctx)
        over_tcp = connect_client(tcp, ctx=ctx)
        over_ipc.send(M.Ping(nonce=1))
        over_tcp.send(M.Ping(nonce=2))
        got = {}
        for _ in range(2):
            peer, msg = server.recv(2000)
            got[msg.nonce] = peer
        for nonce, peer in got.items():
            assert server.send(peer, M.Pong(nonce=nonce))
        assert over_ipc.recv(2000) == M.Pong(nonce=1) and over_tcp.recv(2000) == M.Pong(nonce=2)
        over_ipc.close()
        over_tcp.close()


def test_a_client_reaches_a_server_on_an_ipv6_loopback_address(ctx):
    """dovetail-run --bind tcp://[::1]:PORT is a loopback bind it allows: its clients must get there
    too (libzmq refuses an IPv6 literal on a socket without ZMQ_IPV6)."""
    with RouterServer("tcp://[::1]:*", ctx=ctx) as server:
        client = connect_client(server.endpoint, ctx=ctx, handshake_timeout_s=5)
        client.send(M.Ping(nonce=6), timeout_ms=2000)
        received = server.recv(5000)
        assert received is not None and received[1] == M.Ping(nonce=6)
        client.close()


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1", "tcp://*:5555", "tcp://127.0.0.1:*", "tcp://127.0.0.1:1/x"])
def test_an_address_a_client_cannot_connect_to_is_a_one_line_handshake_error(ctx, endpoint):
    for handshake_timeout_s in (None, 1.0):  # a ZMQError traceback before
        with pytest.raises(HandshakeError, match=r"^cannot connect to .*: Invalid argument \(give the server's"):
            connect_client(endpoint, ctx=ctx, handshake_timeout_s=handshake_timeout_s)


def test_client_channel_accepts_only_server_messages(ctx, rundir):
    with RouterServer(rundir.endpoint("client"), ctx=ctx) as server:
        client = connect_client(server.endpoint, ctx=ctx)
        client.send(M.Ping(nonce=1))
        peer, _ = server.recv(2000)
        server.socket.send_multipart([peer, msgpack.packb({"type": "Shutdown"})])
        with pytest.raises(ProtocolError, match="accepted here: TokenChunk, GenerateDone, ErrorReply, Pong"):
            client.recv(2000)
        client.close()


def test_close_with_unsent_messages_does_not_hang(ctx, rundir):
    client = connect_client(rundir.endpoint("nobody-listens"), ctx=ctx)
    for i in range(10):
        client.send(M.Ping(nonce=i), timeout_ms=100)  # queued, never delivered
    client.close()  # ctx fixture asserts term() returns promptly
