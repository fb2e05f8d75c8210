"""API keys against real dovetail-run processes: nobody gets in by default.

Without a key, a bind beyond loopback is refused before anything loads (no server is ever
exposed without one). The keyed server listens on 0.0.0.0 (ZMQ with CURVE, HTTP with a bearer
key) and on an ipc socket, and is reached through loopback: the openai client, curl,
DovetailClient and dovetail-client, with the right key, a wrong one and none. The key must
never show up in the server's log, in its workers' command lines or environments, or in any
error.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import openai
import psutil
import pytest

from dovetail_runtime.client import DovetailClient, HandshakeError

from runtime_harness import BIN, Server, dovetail_run

KEY = "test-key-9f8e7d6c5b4a39281706"
WRONG = "not-the-key-0123456789abcdef"
NEW_TOKENS = 12
PROMPT = "def fibonacci(n):"


def non_loopback_ipv4() -> str | None:
    """An address of this machine that others could reach, if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


def private_file(path, text: str, mode: int = 0o600):
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return path


def client_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dovetail-client"), *args], capture_output=True, text=True, timeout=120,
                          env=env if env is not None else {k: v for k, v in os.environ.items()
                                                           if k != "DOVETAIL_API_KEY"})


# --- refusals before anything loads ----------------------------------------------------------


def exposed_without_key() -> list[list[str]]:
    cases = [["--bind", "tcp://0.0.0.0:0"], ["--bind", "*:0"], ["--http", "0.0.0.0:0"],
             ["--bind", "ipc:///tmp/never-bound.sock", "--http", "[::]:0"]]
    address = non_loopback_ipv4()
    if address is not None:
        cases += [["--bind", f"tcp://{address}:0"], ["--http", f"{address}:0"]]
    return cases


@pytest.mark.parametrize("args", exposed_without_key())
def test_serving_beyond_loopback_without_a_key_is_refused(demo_target, args):
    started = time.monotonic()
    done = dovetail_run("--target", str(demo_target), "--mode", "ar", *args, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "without an API key" in errors[0] and "--api-key-file" in errors[0], done.stderr
    assert "cpu_worker" not in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 60  # refused, not loaded and served
    assert not os.path.exists("/tmp/never-bound.sock")


def test_allow_remote_alone_no_longer_opens_anything(demo_target):
    done = dovetail_run("--target", str(demo_target), "--mode", "ar", "--allow-remote", "--bind", "tcp://0.0.0.0:0",
                        timeout=120)
    assert done.returncode == 2 and "--allow-remote" in done.stderr and "API key" in done.stderr, done.stderr
    assert "cpu_worker" not in done.stderr


def test_a_key_file_others_can_read_is_refused(demo_target, tmp_path):
    for mode in (0o644, 0o640):
        path = private_file(tmp_path / "key", KEY, mode)
        done = dovetail_run("--target", str(demo_target), "--mode", "ar", "--api-key-file", str(path),
                            "--bind", "tcp://0.0.0.0:0", timeout=120)
        assert done.returncode == 2, done.stderr
        assert f"others may read or write it (mode {mode:04o})" in done.stderr and f"chmod 600 {path}" in done.stderr
        assert KEY not in done.stderr and "cpu_worker" not in done.stderr
    done = dovetail_run("--api-key-file", str(tmp_path / "absent"), "--bind", "tcp://0.0.0.0:0", timeout=120)
    assert done.returncode == 2 and "no such file; make one with" in done.stderr
    client = client_run("--connect", "127.0.0.1:1", "--prompt", "x", "--api-key-file", str(path))
    assert client.returncode == 2 and "chmod 600" in client.stderr and KEY not in client.stderr


def test_a_key_on_the_command_line_is_warned_about_and_never_repeated(demo_target, tmp_path):
    done = dovetail_run("--target", str(demo_target), "--mode", "ar", "--api-key", KEY,
                        "--bind", f"ipc://{tmp_path}/missing/x.sock", timeout=120)
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert "visible to every user of this machine (ps)" in done.stderr and KEY not in done.stderr
    done = dovetail_run("--api-key", "short-key", "--bind", "tcp://0.0.0.0:0", timeout=120)
    assert done.returncode == 2 and "needs 16 to 1024 characters" in done.stderr and "short-key" not in done.stderr
    both = dovetail_run("--api-key", KEY, "--api-key-file", str(private_file(tmp_path / "k", KEY)), timeout=120)
    assert both.returncode == 2 and "give the API key once" in both.stderr and KEY not in both.stderr


# --- a server with a key ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, demo_target):
    """--mode ar, the key from DOVETAIL_API_KEY, ZMQ and HTTP on 0.0.0.0, and an ipc socket."""
    folder = tmp_path_factory.mktemp("auth")
    running = Server("--target", str(demo_target), "--mode", "ar", "--bind", "tcp://0.0.0.0:0",
                     "--bind", f"ipc://{folder}/s.sock", "--http", "0.0.0.0:0",
                     env={**os.environ, "DOVETAIL_API_KEY": KEY})
    yield running
    assert running.stop() == 0
    assert KEY not in running.log_text()


def local(server: Server, scheme: str) -> str:
    """The server's endpoint of that scheme, reached through loopback."""
    endpoint = next(each for each in server.endpoints if each.startswith(scheme))
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def test_it_serves_on_every_interface_once_it_has_a_key(keyed):
    assert any(each.startswith("tcp://0.0.0.0:") for each in keyed.endpoints)
    assert any(each.startswith("http://0.0.0.0:") for each in keyed.endpoints)
    assert "HTTP on 0.0.0.0 is not encrypted" in keyed.log_text()


def test_zmq_over_tcp_needs_the_key_and_ipc_does_not(keyed):
    tcp, ipc = local(keyed, "tcp://"), local(keyed, "ipc://")
    with DovetailClient(tcp, timeout_s=120, api_key=KEY) as client:
        over_tcp = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, mode="ar")
    with DovetailClient(ipc, timeout_s=120) as client:
        over_ipc = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, mode="ar")
    assert over_tcp.token_ids == over_ipc.token_ids and len(over_tcp.token_ids) == NEW_TOKENS
    for key, says in ((WRONG, "broke off the CURVE handshake: wrong API key?"), (None, "requires an API key")):
        started = time.monotonic()
        with pytest.raises(HandshakeError) as info:
            DovetailClient(tcp, timeout_s=120, api_key=key, connect_timeout_s=30)
        assert says in str(info.value) and time.monotonic() - started < 15, str(info.value)
        assert KEY not in str(info.value) and WRONG not in str(info.value)
    # The server logs it too. (Without a key the client may hang up before the server has read which
    # mechanism it wanted, so what the server saw of that one is not checked.)
    assert keyed.wait_for_log("failed the CURVE handshake: wrong API key")


def test_dovetail_client_with_a_key_file_and_with_a_wrong_key(keyed, tmp_path):
    tcp = local(keyed, "tcp://")
    args = ["--connect", tcp, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--mode", "ar", "--json"]
    right = client_run(*args, "--api-key-file", str(private_file(tmp_path / "key", KEY)))
    assert right.returncode == 0, right.stderr
    wrong = client_run(*args, env={**os.environ, "DOVETAIL_API_KEY": WRONG})
    assert wrong.returncode == 1 and "wrong API key" in wrong.stderr and "Traceback" not in wrong.stderr
    assert WRONG not in wrong.stderr
    missing = client_run(*args)
    assert missing.returncode == 1 and "requires an API key" in missing.stderr


def test_http_needs_the_bearer_key(keyed):
    base = local(keyed, "http://") + "/v1"
    for key in ("unused", WRONG):
        with pytest.raises(openai.AuthenticationError) as info:
            openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60).completions.create(
                model="target-code-9m", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    api = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=300)
    done = api.completions.create(model="target-code-9m", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    with DovetailClient(local(keyed, "ipc://"), timeout_s=120) as client:
        reference = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, mode="ar")
    assert done.model_extra["dovetail"]["token_ids"] == reference.token_ids
    assert [model.id for model in api.models.list()] == ["target-code-9m"]


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "-i", "--max-time", "120", *args], capture_output=True, text=True,
                          timeout=150)


def status_of(done: subprocess.CompletedProcess) -> int:
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split(None, 2)[1])


def test_curl_with_and_without_the_key(keyed, tmp_path):
    base = local(keyed, "http://")
    # The header from a file (curl -H @FILE), so that the key is not on curl's command line either.
    header = private_file(tmp_path / "auth-header", f"Authorization: Bearer {KEY}")
    for path in ("/v1/models", "/metrics"):
        missing = curl(base + path)
        assert status_of(missing) == 401 and 'www-authenticate: Bearer realm="dovetail"' in missing.stdout
        assert '"code":"missing_api_key"' in missing.stdout
        assert status_of(curl(base + path, "-H", "Authorization: Bearer " + WRONG)) == 401
        assert status_of(curl(base + path, "-H", f"@{header}")) == 200
    assert status_of(curl(base + "/health")) == 200  # open: it says only whether the server is up
    body = '{"prompt": "import os", "max_tokens": 4, "temperature": 0}'
    assert status_of(curl(base + "/v1/completions", "-d", body)) == 401
    answer = curl(base + "/v1/completions", "-H", f"@{header}", "-H", "Content-Type: application/json", "-d", body)
    assert status_of(answer) == 200 and '"finish_reason":"length"' in answer.stdout
    metrics = curl(base + "/metrics", "-H", f"@{header}")
    assert KEY not in metrics.stdout


def test_the_key_is_in_no_log_no_worker_command_line_and_no_worker_environment(keyed):
    workers = keyed.workers()
    assert set(workers) == {"cpu_worker"}
    for worker in workers.values():
        assert KEY not in " ".join(worker.cmdline())
        assert "DOVETAIL_API_KEY" not in worker.environ() and KEY not in "".join(worker.environ().values())
    assert KEY not in keyed.log_text()


def test_a_key_file_serves_loopback_tcp_with_curve(demo_target, tmp_path):
    path = private_file(tmp_path / "key", KEY)
    running = Server("--target", str(demo_target), "--mode", "ar", "--api-key-file", str(path),
                     "--bind", "tcp://127.0.0.1:0")
    try:
        with pytest.raises(HandshakeError, match="requires an API key"):
            DovetailClient(running.endpoints[0], connect_timeout_s=30)
        with DovetailClient(running.endpoints[0], api_key=KEY, timeout_s=60) as client:
            assert client.ping()
    finally:
        assert running.stop() == 0
    assert KEY not in running.log_text() and "visible to every user" not in running.log_text()
