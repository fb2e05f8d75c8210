"""dovetail_runtime.api_key and http_auth in one process: where a key comes from, which files
are refused, where a key is required, the bearer check, and that no message shows the key."""

from __future__ import annotations

import os
import time

import pytest
from fastapi.testclient import TestClient

from dovetail_runtime.api_key import ApiKey, ApiKeyError, check_exposure, load_api_key, read_key_file
from dovetail_runtime.http_auth import presented_token
from dovetail_runtime.http_server import ServedModel, build_app

KEY = "k3y-for-tests-0123456789abcdef"


def key_file(tmp_path, mode: int = 0o600, text: str = KEY + "\n"):
    path = tmp_path / "key"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_a_private_key_file_is_read_and_the_key_never_prints(tmp_path):
    key = read_key_file(key_file(tmp_path))
    assert key.reveal() == KEY  # the trailing newline is not part of it
    assert repr(key) == str(key) == f"{key!r}" == "<API key>"
    assert key.matches(KEY.encode()) and not key.matches(KEY.encode()[:-1]) and not key.matches(b"")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602])
def test_a_key_file_others_may_read_or_write_is_refused(tmp_path, mode):
    path = key_file(tmp_path, mode)
    with pytest.raises(ApiKeyError) as info:
        read_key_file(path)
    message = str(info.value)
    assert f"mode {mode:04o}" in message and f"chmod 600 {path}" in message
    assert KEY not in message and "\n" not in message


@pytest.mark.parametrize("text, says", [
    ("short\n", "needs 16 to 1024 characters"),
    ("has a space in the middle\n", "printable ASCII without spaces"),
    ("\n", "needs 16 to 1024 characters"),
    ("x" * 5000, "larger than 4096 bytes"),
    ("caf\u00e9-caf\u00e9-caf\u00e9-caf\u00e9", "printable ASCII"),
])
def test_bad_keys_are_refused_without_quoting_them(tmp_path, text, says):
    with pytest.raises(ApiKeyError) as info:
        read_key_file(key_file(tmp_path, text=text))
    assert says in str(info.value)
    assert not text.strip() or text.strip() not in str(info.value)


def test_a_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ApiKeyError, match=r"no such file; make one with: \(umask 077; "):
        read_key_file(tmp_path / "absent")
    with pytest.raises(ApiKeyError, match="not a regular file"):
        read_key_file(tmp_path)


def test_the_file_comes_first_then_the_text(tmp_path):
    assert load_api_key(None, None, "--api-key") is None
    assert load_api_key(key_file(tmp_path), "other-key-0123456789", "--api-key").reveal() == KEY
    assert load_api_key(None, f" {KEY}\n", "DOVETAIL_API_KEY").reveal() == KEY
    with pytest.raises(ApiKeyError, match="^DOVETAIL_API_KEY: an API key needs"):
        load_api_key(None, "short", "DOVETAIL_API_KEY")


@pytest.mark.parametrize("binds, http_host", [
    (["tcp://0.0.0.0:5555"], None), (["tcp://*:5555"], None), (["tcp://192.0.2.7:1"], None),
    (["tcp://eth0:1"], None), (["tcp://myhost:1"], None), ([], "0.0.0.0"), ([], "::"), ([], "example.org"),
    (["ipc:///tmp/x.sock", "tcp://[::]:1"], "127.0.0.1"),
])
def test_serving_beyond_loopback_needs_a_key(binds, http_host):
    with pytest.raises(ApiKeyError, match="without an API key"):
        check_exposure(binds, http_host, None)
    check_exposure(binds, http_host, ApiKey(KEY))


def test_loopback_and_ipc_need_no_key():
    check_exposure(["ipc:///tmp/x.sock", "tcp://127.0.0.1:1", "tcp://localhost:1", "tcp://[::1]:1",
                    "tcp://127.0.0.2:1", "inproc://x"], "127.0.0.1", None)
    check_exposure([], "localhost", None)
    check_exposure([], "::1", None)


@pytest.mark.parametrize("headers, token", [
    ([], None),
    ([(b"authorization", b"Bearer abc")], b"abc"),
    ([(b"authorization", b"bearer  abc ")], b"abc"),
    ([(b"authorization", b"Basic abc")], None),
    ([(b"authorization", b"Bearer abc"), (b"authorization", b"Bearer abc")], None),
])
def test_bearer_tokens_are_read_from_one_authorization_header(headers, token):
    assert presented_token({"headers": headers}) == token


@pytest.fixture
def http():
    model = ServedModel(name="m", context=64, default_mode="ar", created=int(time.time()))
    with TestClient(build_app("inproc://nobody-listens", model, api_key=ApiKey(KEY))) as client:
        yield client


def test_http_needs_the_bearer_key(http):
    missing = http.get("/v1/models")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == 'Bearer realm="dovetail"'
    assert missing.json()["error"]["code"] == "missing_api_key"
    assert missing.json()["error"]["type"] == "invalid_request_error"
    wrong = http.post("/v1/completions", headers={"Authorization": "Bearer wrong-key-0123456789"},
                      json={"prompt": "x"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
    assert "wrong-key" not in wrong.text
    assert http.get("/metrics", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    right = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert right.status_code == 200 and right.json()["data"][0]["id"] == "m"
