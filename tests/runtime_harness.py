"""Starting a real ``dovetail-run`` for tests and watching its processes."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from dovetail_runtime.demo_models import CODE_DRAFT, CODE_TARGET

BIN = Path(sys.executable).parent
TEST_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os", "for i in range(10):", "def __init__(self):",
                "if __name__ == '__main__':", "with open(path) as f:", "try:", "return", "@property"]

# A fixed tree, for tests that check the trees (their verification, the head's acceptance):
# --tree-tokens auto decodes plainly where the costs leave trees no room (the 9M code pair on two
# cores: a two-node cycle costs ~3 plain steps) and the trees run slower than plain steps.
FIXED_TREE = ("--tree-tokens", "8", "--depth", "4")


def code_pair(args: tuple[str, ...]) -> list[str]:
    """``args`` naming the 9M code pair where they name no target: without --target, dovetail-run
    takes the real chat pair when its fixture is fetched (as CI does), and these tests want the fast one."""
    if any(arg == "--target" or arg.startswith("--target=") for arg in args):
        return list(args)
    named = ["--target", str(CODE_TARGET)]
    ar = any(a == "--mode" and b == "ar" for a, b in zip(args, args[1:])) or "--mode=ar" in args
    if not ar and not any(arg == "--draft" or arg.startswith("--draft=") for arg in args):
        named += ["--draft", str(CODE_DRAFT)]
    return named + list(args)


def dovetail_run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dovetail-run"), *code_pair(args)], capture_output=True, text=True,
                          timeout=timeout)


class Server:
    """``dovetail-run`` serving in the background; ``endpoints`` are what it bound."""

    def __init__(self, *args: str, startup_s: float = 300, **popen):
        """``popen``: more subprocess.Popen arguments (umask, start_new_session, ...)."""
        self.process = subprocess.Popen([str(BIN / "dovetail-run"), "--log-level", "info", *code_pair(args)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
        self.log: list[str] = []
        self._endpoints: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._ready.wait(startup_s):
            self.stop()
            raise RuntimeError("dovetail-run did not start:\n" + "".join(self.log[-40:]))

    def _drain(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            if line.startswith("dovetail serving on "):
                self._endpoints = line.removeprefix("dovetail serving on ").split()
                self._ready.set()
        self._ready.set()

    @property
    def endpoints(self) -> list[str]:
        """What the server bound; a server that exited before serving raises, with its log."""
        if not self._endpoints and self.process.poll() is not None:
            raise RuntimeError(f"dovetail-run exited with {self.process.returncode} before serving:\n"
                               + "".join(self.log[-40:]))
        return self._endpoints

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        return "".join(self.log)

    def wait_for_log(self, text: str, within_s: float = 30) -> bool:
        deadline = time.monotonic() + within_s
        while text not in self.log_text():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def workers(self) -> dict[str, psutil.Process]:
        found = {}
        for child in psutil.Process(self.pid).children(recursive=True):
            command = " ".join(child.cmdline())
            for name in ("cpu_worker", "gpu_worker"):
                if f"{name}.server" in command:
                    found[name] = child
        return found

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def our_segments(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/dovetail-{pid}-*")


def descendants_gone(pids: list[int], within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in pids):
            return True
        time.sleep(0.1)
    return False


def thread_affinities(process: psutil.Process) -> set[tuple[int, ...]]:
    return {tuple(sorted(os.sched_getaffinity(thread.id))) for thread in process.threads()}
