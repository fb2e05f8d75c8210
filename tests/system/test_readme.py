"""Every code block of the README runs, in order, against the demo models, as a newcomer pastes them
after the quick start: shell blocks in bash from the repository root with the venv's commands on PATH,
Python blocks in the venv's Python; each must exit 0, and every block that compares with plain
decoding (`--compare-ar`, the demo) must say "same tokens: yes".

A block right after `<!-- readme-test: server -->` is a server: it starts in the background, the blocks
after it run once its /health answers, and at the end it gets Ctrl-C (SIGINT) and must exit cleanly.
Its port, socket and the training block's /tmp folders are moved into this test's own (so a busy port
or a rerun never interferes). Blocks marked `text` are diagrams. One block is not run here: the test
command, which runs this very suite; it is checked to be exactly what `.ci/run` runs."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from gguf_support import need_fixture

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<tag>[a-z]+) -->\n)?```(?P<language>[a-z]*)\n(?P<code>.*?)```", re.S)
TEST_COMMAND = "bash scripts/test.sh"


@dataclass
class Block:
    language: str
    code: str
    tag: str | None


def readme_blocks() -> list[Block]:
    return [Block(match["language"], match["code"], match["tag"]) for match in BLOCK.finditer(README.read_text())]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def localized(code: str, tmp_path: Path, port: int) -> str:
    """The block with the README's port, socket and scratch folders moved into this test's."""
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    code = code.replace("/tmp/dovetail-demo.sock", str(tmp_path / "demo.sock"))
    return re.sub(r"/tmp/(dovetail-[a-z]+)", lambda match: str(tmp_path / match[1]), code)


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def command(block: Block) -> list[str]:
    if block.language == "bash":
        return ["bash", "-euo", "pipefail", "-c", block.code]
    assert block.language == "python", f"a README block in {block.language!r}: tell this test how to run it"
    return [sys.executable, "-c", block.code]


def wait_healthy(server: subprocess.Popen, port: int, within_s: float = 300) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the README's server exited with {server.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the README's server did not answer /health within {within_s} s")


def stop(server: subprocess.Popen) -> str:
    """Ctrl-C, as the README says; the server's whole output."""
    os.killpg(server.pid, signal.SIGINT)
    try:
        output, _ = server.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        output, _ = server.communicate()
        raise AssertionError(f"the README's server ignored Ctrl-C for 60 s:\n{output[-3000:]}") from None
    return output


def check_output(block: Block, done: subprocess.CompletedProcess) -> None:
    shown = done.stdout + done.stderr
    assert done.returncode == 0, f"README block failed ({done.returncode}):\n{block.code}\n{shown[-4000:]}"
    if "--compare-ar" in block.code or "demo.sh" in block.code:
        assert "same tokens: yes" in shown and "same tokens: no" not in shown, f"{block.code}\n{shown[-3000:]}"


def test_the_test_command_is_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    (block,) = [block for block in readme_blocks() if TEST_COMMAND in block.code]
    assert block.code.strip() == TEST_COMMAND and ci[-1].strip() == TEST_COMMAND


def test_every_readme_block_runs_against_the_demo(tmp_path):
    need_fixture()
    blocks = [block for block in readme_blocks() if block.language != "text" and block.code.strip() != TEST_COMMAND]
    assert sum(block.tag == "server" for block in blocks) == 1 and len(blocks) >= 8, "the README's blocks changed"
    port, env, server = free_port(), environment(), None
    try:
        for block in blocks:
            block = Block(block.language, localized(block.code, tmp_path, port), block.tag)
            if block.tag == "server":
                server = subprocess.Popen(command(block), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
                wait_healthy(server, port)
                continue
            done = subprocess.run(command(block), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            check_output(block, done)
    finally:
        if server is not None and server.poll() is None:
            output = stop(server)
            assert server.returncode == 0, f"the server exited with {server.returncode}:\n{output[-3000:]}"
    assert not (tmp_path / "demo.sock").exists(), "the server left its socket file behind"


def test_the_readme_names_only_files_a_clone_has():
    text = README.read_text()
    assert "(docs/results.png)" in text and (REPO / "docs/results.png").is_file()
    for path in re.findall(r"`((?:docs|tools|scripts|demo)/[\w./-]+)`", text):
        assert (REPO / path).exists(), f"the README names {path}, which a clone does not have"


def test_the_results_table_is_the_charts():
    from tools.plot_results import markdown_rows

    rows = [line for line in README.read_text().splitlines() if line.startswith("| ") and "x |" in line]
    assert rows == markdown_rows()
