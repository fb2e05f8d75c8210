"""Serving through real dovetail-run processes: no client can take the server down or starve
the others, every request gets an answer, and mistakes fail fast in one line.

Most tests share one --mode ar server (started with umask 0, small queues, one request at a time:
--max-batch 1); the ones that stop, hang or kill a process get their own. Requests side by side:
tests/system/test_batched_serving.py. A "blocker" is a long streaming request that keeps the
server busy so that what is sent after it must wait; cancelling it lets the rest run.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import stat
import subprocess
import time

import psutil
import pytest
import zmq

from dovetail_runtime.client import DovetailClient, GenerationError
from ipc import messages as m
from ipc.channels import Channel, connect_client

from runtime_harness import BIN, TEST_PROMPTS, Server, descendants_gone, dovetail_run, our_segments

WAIT_MS = 120_000
# Generates to max_new_tokens (no end-of-sequence token within 2000) with the demo target.
LONG_PROMPT = TEST_PROMPTS[1]


def send(client: Channel, request_id: str, prompt: str = LONG_PROMPT, **fields) -> None:
    client.send(m.GenerateRequest(request_id=request_id, prompt=prompt, mode="ar", **fields), timeout_ms=5000)


def final(client: Channel, request_id: str, timeout_ms: int = WAIT_MS) -> m.GenerateDone | m.ErrorReply:
    """The final answer for ``request_id`` (its chunks and other messages skipped)."""
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        reply = client.recv(timeout_ms=max(0.0, deadline - time.monotonic()) * 1000)
        assert reply is not None, f"no answer for {request_id}"
        if isinstance(reply, (m.GenerateDone, m.ErrorReply)) and reply.request_id == request_id:
            return reply


def first_chunk(client: Channel, request_id: str) -> None:
    while True:
        reply = client.recv(timeout_ms=WAIT_MS)
        assert isinstance(reply, m.TokenChunk) and reply.request_id == request_id, reply
        return


def read_by_server(client: Channel, nonce: int) -> None:
    """A Pong proves the server has read everything this client sent before the Ping."""
    client.send(m.Ping(nonce=nonce), timeout_ms=5000)
    while True:
        reply = client.recv(timeout_ms=WAIT_MS)
        assert reply is not None, "no Pong"
        if reply == m.Pong(nonce=nonce):
            return


def blocker(endpoint: str, request_id: str = "blocker") -> Channel:
    """A client whose long streaming request is running (first chunk seen)."""
    client = connect_client(endpoint)
    send(client, request_id, LONG_PROMPT, max_new_tokens=2000, stream=True)
    first_chunk(client, request_id)
    return client


def stop_blocker(client: Channel, request_id: str = "blocker") -> None:
    client.send(m.Cancel(request_id=request_id), timeout_ms=5000)
    assert final(client, request_id).finish_reason == "cancelled"


@pytest.fixture(scope="module")
def ar_server(tmp_path_factory, demo_target):
    socket_dir = tmp_path_factory.mktemp("serve")
    running = Server("--target", str(demo_target), "--mode", "ar", "--max-batch", "1",
                     "--bind", f"ipc://{socket_dir}/ar.sock",
                     "--bind", "localhost:0", "--max-queue", "4", "--max-queue-per-client", "3",
                     umask=0)
    yield running
    assert running.stop() == 0
    assert not os.path.exists(f"{socket_dir}/ar.sock") and not os.path.exists(f"{socket_dir}/ar.sock.lock")


def test_socket_is_0600_under_umask_0_and_a_second_server_is_refused_before_loading(ar_server, demo_target):
    path = ar_server.endpoints[0].removeprefix("ipc://")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    second = dovetail_run("--target", str(demo_target), "--mode", "ar", "--bind", ar_server.endpoints[0],
                          timeout=120)
    assert second.returncode == 2
    assert f"already served by another dovetail-run (pid {ar_server.pid})" in second.stderr
    assert "cpu_worker" not in second.stderr  # refused before any worker started
    with DovetailClient(ar_server.endpoints[0], timeout_s=60) as client:  # the first one is untouched
        assert client.ping()


def test_dovetail_client_takes_the_servers_own_mode_unless_told(ar_server):
    """A server without a draft head decodes plainly for a client that names no mode (it used to
    default to dovetail and be refused); a client that asks for dovetail is told why not."""
    args = [str(BIN / "dovetail-client"), "--connect", ar_server.endpoints[0], "--prompt", TEST_PROMPTS[0],
            "--max-new-tokens", "4", "--json"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    stats = json.loads(plain.stdout)["stats"]
    assert stats["new_tokens"] == 4 and stats["draft_ms"] == 0.0 and stats["tau"] == 1.0  # ar: nothing drafted
    refused = subprocess.run([*args, "--mode", "dovetail"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "without a draft head" in refused.stderr, refused.stderr


def test_a_flooding_client_waits_for_its_turn(ar_server):
    endpoint = ar_server.endpoints[0]
    busy = blocker(endpoint)
    flood, single = connect_client(endpoint), connect_client(endpoint)
    try:
        send(flood, "flood-0", max_new_tokens=3)
        send(flood, "flood-1", max_new_tokens=2000)  # long: still running when "single" is answered
        send(flood, "flood-2", max_new_tokens=2000)
        read_by_server(flood, 1)
        send(single, "single", max_new_tokens=3)
        read_by_server(single, 2)
        stop_blocker(busy)
        assert final(single, "single").finish_reason == "length"
        # Round-robin: one flood request ran before the single one; in arrival order, all three would have.
        answered = []
        while flood.socket.poll(0):
            reply = flood.recv(timeout_ms=0)
            if isinstance(reply, (m.GenerateDone, m.ErrorReply)):
                answered.append(reply.request_id)
        assert answered == ["flood-0"]
        for request_id in ("flood-1", "flood-2"):
            flood.send(m.Cancel(request_id=request_id), timeout_ms=5000)
            assert final(flood, request_id).finish_reason == "cancelled"
    finally:
        for client in (busy, flood, single):
            client.close()


def test_beyond_the_queue_bounds_requests_get_busy_at_once(ar_server):
    endpoint = ar_server.endpoints[0]
    busy = blocker(endpoint)
    a, b, c = connect_client(endpoint), connect_client(endpoint), connect_client(endpoint)
    try:
        for index in range(4):
            send(a, f"a{index}", max_new_tokens=2)
        refused = final(a, "a3")  # 3 per client
        assert isinstance(refused, m.ErrorReply) and refused.code == "busy"
        send(b, "b0", max_new_tokens=2)
        read_by_server(b, 3)
        send(c, "c0", max_new_tokens=2)
        refused = final(c, "c0")  # 4 in all
        assert isinstance(refused, m.ErrorReply) and refused.code == "busy" and "server's limit" in refused.message
        stop_blocker(busy)
        for client, request_id in ((a, "a0"), (a, "a1"), (a, "a2"), (b, "b0")):
            assert final(client, request_id).finish_reason == "length"
    finally:
        for client in (busy, a, b, c):
            client.close()


def test_a_streaming_client_that_stops_reading_is_dropped_and_others_are_served(ar_server):
    endpoint = ar_server.endpoints[0]
    silent = connect_client(endpoint)
    other = DovetailClient(ar_server.endpoints[1], timeout_s=120)
    try:
        send(silent, "unread", LONG_PROMPT, max_new_tokens=2000, stream=True)
        # Never read again; Pings fill the answer queues until a send to it would block.
        deadline = time.monotonic() + 120
        while "is not reading its replies" not in ar_server.log_text():
            assert time.monotonic() < deadline, "the silent client was never dropped"
            for nonce in range(500):
                silent.send(m.Ping(nonce=nonce), timeout_ms=10_000)
        assert ar_server.wait_for_log("and the one in flight cancelled", within_s=5)
        assert other.ping()
        reference = other.generate(LONG_PROMPT, max_new_tokens=8, mode="ar")
        assert reference.finish_reason == "length" and len(reference.token_ids) == 8
        assert ar_server.process.poll() is None
    finally:
        silent.close()
        other.close()


def test_a_prompt_too_large_is_refused_without_tokenizing(ar_server):
    with DovetailClient(ar_server.endpoints[0], timeout_s=120) as client:
        with pytest.raises(GenerationError, match="prompt_too_long: prompt of 16777216 characters .* not tokenized"):
            client.generate("x" * (16 * 1024 * 1024), max_new_tokens=4, mode="ar")
        assert client.ping()
        assert client.generate(LONG_PROMPT, max_new_tokens=4, mode="ar").finish_reason == "length"


def test_a_request_past_its_deadline_ends_with_deadline_exceeded(ar_server):
    with DovetailClient(ar_server.endpoints[0], timeout_s=120) as client:
        with pytest.raises(GenerationError, match="deadline_exceeded"):
            for _ in client.stream(LONG_PROMPT, max_new_tokens=2000, mode="ar", deadline_ms=300):
                pass
        assert client.generate(LONG_PROMPT, max_new_tokens=2, mode="ar").finish_reason == "length"


def test_a_client_that_disconnects_has_its_request_cancelled(ar_server):
    endpoint = ar_server.endpoints[0]
    leaver = connect_client(endpoint)
    send(leaver, "leaving", LONG_PROMPT, max_new_tokens=2000)  # not streaming: no send would fail
    read_by_server(leaver, 9)
    leaver.close()
    # Noticed while it runs, or (if the close came first) when its turn came.
    deadline = time.monotonic() + 30
    while not re.search(r"request leaving cancelled: its client is gone|left: 1 waiting request\(s\) cancelled",
                        ar_server.log_text()):
        assert time.monotonic() < deadline, "the departed client's request was not cancelled"
        time.sleep(0.05)
    with DovetailClient(endpoint, timeout_s=120) as client:
        assert client.generate(LONG_PROMPT, max_new_tokens=2, mode="ar").finish_reason == "length"


def test_the_client_cli_understands_host_port(ar_server):
    port = ar_server.endpoints[1].rsplit(":", 1)[1]
    for spelling in (f"localhost:{port}", f"127.0.0.1:{port}"):
        done = subprocess.run([str(BIN / "dovetail-client"), "--connect", spelling, "--prompt", TEST_PROMPTS[0],
                               "--max-new-tokens", "3", "--mode", "ar", "--json"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert '"finish_reason": "length"' in done.stdout


def test_a_hung_worker_fails_its_request_within_the_timeout_and_pings_are_answered(demo_target, demo_random_head,
                                                                                   tmp_path):
    running = Server("--target", str(demo_target), "--draft", str(demo_random_head), "--worker-timeout", "4",
                     "--bind", f"ipc://{tmp_path}/hang.sock")
    try:
        with DovetailClient(running.endpoints[0], timeout_s=120) as client, \
                DovetailClient(running.endpoints[0], timeout_s=120) as pinger:
            before = client.generate(TEST_PROMPTS[8], max_new_tokens=16)
            victim = running.workers()["cpu_worker"]
            events = client.events(LONG_PROMPT, max_new_tokens=2000)
            assert isinstance(next(events), m.TokenChunk)
            os.kill(victim.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            assert pinger.ping(timeout_s=3.0)  # answered while the worker hangs
            assert time.monotonic() - stopped_at < 4.0
            with pytest.raises(GenerationError, match="worker_failed: .*did not answer .* within 4 s"):
                for _ in events:
                    pass
            assert time.monotonic() - stopped_at < 4.0 + 15.0
            assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
            after = client.generate(TEST_PROMPTS[8], max_new_tokens=16)  # on a restarted worker
            assert after.token_ids == before.token_ids
        pids = [running.pid] + [worker.pid for worker in running.workers().values()]
    except BaseException:
        print(running.log_text()[-6000:])
        raise
    finally:
        code = running.stop()
    assert code == 0
    assert descendants_gone(pids)


def _health(url: str) -> int:
    import httpx

    return httpx.get(url + "/health", timeout=30).status_code


def test_a_worker_killed_while_idle_makes_health_503_until_it_is_back(demo_target, tmp_path):
    running = Server("--target", str(demo_target), "--mode", "ar", "--http", "127.0.0.1:0",
                     "--bind", f"ipc://{tmp_path}/idle.sock")
    try:
        url = next(endpoint for endpoint in running.endpoints if endpoint.startswith("http://"))
        assert _health(url) == 200
        victim = running.workers()["cpu_worker"]
        victim.kill()
        killed_at = time.monotonic()
        # The spec's bound; a dead worker is seen at the next Ping, not after a polling period.
        while _health(url) != 503:
            assert time.monotonic() - killed_at < 2.0, "/health still 200 two seconds after the worker died"
            time.sleep(0.05)
        deadline = time.monotonic() + 120
        while _health(url) != 200:  # restarted by the idle server, no request needed
            assert time.monotonic() < deadline, "the dead worker was not restarted"
            time.sleep(0.2)
        assert running.workers()["cpu_worker"].pid != victim.pid
    except BaseException:
        print(running.log_text()[-6000:])
        raise
    finally:
        assert running.stop() == 0


def test_sigterm_answers_every_request_in_flight_and_waiting(demo_target, tmp_path):
    running = Server("--target", str(demo_target), "--mode", "ar", "--max-batch", "1",
                     "--bind", f"ipc://{tmp_path}/term.sock")
    endpoint = running.endpoints[0]
    busy = blocker(endpoint)
    a, b = connect_client(endpoint), connect_client(endpoint)
    try:
        send(a, "a0")
        send(a, "a1")
        read_by_server(a, 1)
        send(b, "b0")
        read_by_server(b, 2)
        pids = [running.pid] + [worker.pid for worker in running.workers().values()]
        running.process.send_signal(signal.SIGTERM)
        for client, request_id in ((busy, "blocker"), (a, "a0"), (a, "a1"), (b, "b0")):
            reply = final(client, request_id, timeout_ms=30_000)
            assert isinstance(reply, m.ErrorReply) and reply.code == "shutting_down", reply
        assert running.process.wait(timeout=30) == 0
    finally:
        for client in (busy, a, b):
            client.close()
        running.stop()
    assert descendants_gone(pids)
    assert not os.path.exists(f"{tmp_path}/term.sock") and our_segments(running.pid) == []


def test_giving_up_after_too_many_restarts_answers_everyone(demo_target, tmp_path):
    running = Server("--target", str(demo_target), "--mode", "ar", "--max-restarts", "0", "--max-batch", "1",
                     "--bind", f"ipc://{tmp_path}/giveup.sock")
    endpoint = running.endpoints[0]
    busy = blocker(endpoint)
    waiting = connect_client(endpoint)
    try:
        send(waiting, "w0")
        send(waiting, "w1")
        read_by_server(waiting, 1)
        os.kill(running.workers()["cpu_worker"].pid, signal.SIGKILL)
        reply = final(busy, "blocker", timeout_ms=30_000)
        assert isinstance(reply, m.ErrorReply) and reply.code == "worker_failed"
        for request_id in ("w0", "w1"):
            reply = final(waiting, request_id, timeout_ms=30_000)
            assert isinstance(reply, m.ErrorReply) and reply.code == "worker_failed" and "giving up" in reply.message
        assert running.process.wait(timeout=30) == 2
    finally:
        busy.close()
        waiting.close()
        running.stop()
    assert not os.path.exists(f"{tmp_path}/giveup.sock") and our_segments(running.pid) == []


def _runtime_dirs(pid: int) -> list[str]:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return glob.glob(f"{base}/dovetail-{pid}-*") + glob.glob(f"/tmp/dovetail-{pid}-*")


def test_after_sigkill_a_new_server_cleans_up_and_ctrl_c_exits_cleanly(demo_target, tmp_path):
    endpoint = f"ipc://{tmp_path}/again.sock"
    killed = Server("--target", str(demo_target), "--mode", "ar", "--bind", endpoint)
    assert killed.stop(signal.SIGKILL) == -signal.SIGKILL
    left = _runtime_dirs(killed.pid)
    assert left and os.path.exists(f"{tmp_path}/again.sock")  # what a SIGKILL leaves behind
    # Its own process group, as a terminal's foreground job: Ctrl-C reaches the whole group.
    running = Server("--target", str(demo_target), "--mode", "ar", "--bind", endpoint, start_new_session=True)
    try:
        assert not any(os.path.exists(path) for path in left)
        with DovetailClient(endpoint, timeout_s=120) as client:
            assert client.generate(LONG_PROMPT, max_new_tokens=2, mode="ar").finish_reason == "length"
        pids = [running.pid] + [worker.pid for worker in running.workers().values()]
        os.killpg(running.pid, signal.SIGINT)
        assert running.process.wait(timeout=30) == 0
    finally:
        running.stop()
    assert descendants_gone(pids)
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]
    assert os.listdir(tmp_path) == [] and _runtime_dirs(running.pid) == []


def test_mistakes_fail_fast_in_one_line_before_any_model_loads(demo_target, tmp_path):
    taken = zmq.Context.instance().socket(zmq.ROUTER)
    taken.setsockopt(zmq.LINGER, 0)
    taken.bind("tcp://127.0.0.1:*")
    port = taken.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    try:
        cases = [
            (["--bind", f"tcp://127.0.0.1:{port}"], "Address already in use"),
            (["--bind", f"127.0.0.1:{port}"], "Address already in use"),
            (["--bind", f"ipc://{tmp_path}/missing/x.sock"], "does not exist"),
            (["--bind", "tcp://0.0.0.0:5555"], "without an API key"),
            (["--cpu-cores", "4000"], "--cpu-cores: cores 4000 are not available"),
        ]
        for args, expected in cases:
            done = dovetail_run("--target", str(demo_target), "--mode", "ar", *args, timeout=120)
            assert done.returncode == 2 and expected in done.stderr, (args, done.stderr)
            assert "cpu_worker" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    finally:
        taken.close()
    done = dovetail_run("--draft-device", "cuda:99", timeout=120)  # the bundled demo pair
    assert done.returncode == 2 and "--draft-device cuda:99" in done.stderr and "cpu_worker" not in done.stderr
    done = dovetail_run("--target", str(demo_target), "--draft", str(tmp_path / "nope"), timeout=120)
    assert done.returncode == 2 and "does not exist" in done.stderr and "cpu_worker" not in done.stderr
    done = dovetail_run("--version")
    assert done.returncode == 0 and done.stdout.startswith("dovetail-run ")
    client = subprocess.run([str(BIN / "dovetail-client"), "--version"], capture_output=True, text=True)
    assert client.returncode == 0 and client.stdout.startswith("dovetail-client ")
    client = subprocess.run([str(BIN / "dovetail-client"), "--connect", f"{tmp_path}/none.sock", "--prompt", "x"],
                            capture_output=True, text=True, timeout=60)
    assert client.returncode == 1 and "no server at" in client.stderr and "Traceback" not in client.stderr


def test_a_foreign_unix_listener_is_not_taken_over(demo_target, tmp_path):
    path = f"{tmp_path}/foreign.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        done = dovetail_run("--target", str(demo_target), "--mode", "ar", "--bind", f"ipc://{path}", timeout=120)
        assert done.returncode == 2 and "already served by another process" in done.stderr
    finally:
        listener.close()
