"""Starting, talking to and stopping one worker process from the coordinator.

Every wait for a worker is cut into short slices: between them the handle checks that the
process lives, that its reply deadline (``reply_timeout_s``, the --worker-timeout) has not
passed, and calls ``on_wait``, through which the coordinator keeps answering its clients
while a worker computes, loads or hangs. A worker that misses its deadline is killed (SIGKILL
also ends a stopped process) and reported as WorkerFailed; the coordinator restarts it.

Workers run in their own process group: a Ctrl-C in the terminal reaches the coordinator
alone, which then stops them in order (no KeyboardInterrupt tracebacks from the workers).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Generic, TypeVar

import msgspec

from ipc.channels import Channel, ChannelTimeout, RuntimeDir
from ipc.codec import ProtocolError, decode_info, encode_settings
from ipc.messages import Message, Nested, Ready, Shutdown, WorkerError, WorkerSettings

log = logging.getLogger(__name__)

# How often a wait for a reply checks the worker's life and deadline and calls on_wait.
LIVENESS_MS = 100
R = TypeVar("R", bound=Message)
Info = TypeVar("Info", bound=Nested)  # what the worker reports in its Ready


class WorkerFailed(RuntimeError):
    """The worker died, failed to start, or reported a fatal error."""


class WorkerRequestError(RuntimeError):
    """The worker refused or failed one request and keeps serving."""


def code_root_env(environ: Mapping[str, str]) -> dict[str, str]:
    """PYTHONPATH for a worker started with ``-P`` where this process found its packages only as its
    script's folder or its working directory, which ``-P`` leaves out (a checkout run without
    installing): that folder, so the worker runs the coordinator's code. Else nothing."""
    root = Path(__file__).resolve().parents[1]
    if not sys.path or Path(sys.path[0] or os.getcwd()).resolve() != root:
        return {}
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), environ.get("PYTHONPATH")]))}


class WorkerHandle(Generic[Info]):
    """A worker process (``python -m <module> --settings JSON``) and the PAIR channel to it;
    ``info`` is what it reported in its Ready (an ``info_type``), None until then."""

    def __init__(self, name: str, module: str, settings: WorkerSettings, runtime_dir: RuntimeDir,
                 allowed_replies: tuple[type[Message], ...], info_type: type[Info], env: dict[str, str] | None = None,
                 reply_timeout_s: float | None = None, on_wait: Callable[[], None] | None = None):
        self.name = name
        self.reply_timeout_s = reply_timeout_s
        self.on_wait = on_wait
        self.env = env or {}
        self.module = module
        self.settings_json = encode_settings(settings)  # checked here: a worker refuses what it cannot read
        self.endpoint = runtime_dir.endpoint(name)
        self.allowed_replies = allowed_replies
        self.info_type = info_type
        self.process: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.info: Info | None = None
        self.ready = False  # the process has said Ready (and so reads its channel)
        self.asked_to_stop = False  # Shutdown sent; its exit not yet waited for

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self) -> None:
        """Start the process; ``wait_ready`` then waits for its handshake (both workers load at once)."""
        self.channel = Channel.bind(self.endpoint, allowed=self.allowed_replies)
        self.ready = False
        self.asked_to_stop = False
        # -P: ``-m`` would put the working directory first on sys.path, so a folder there named like one of
        # the packages a worker imports (ipc/, tools/, torch/) replaced it and the worker failed to start.
        command = [sys.executable, "-P", "-m", self.module, "--endpoint", self.endpoint,
                   "--parent-pid", str(os.getpid()), "--settings", self.settings_json]
        env = {**os.environ, **code_root_env(os.environ), **self.env}
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env, process_group=0)

    def _waited(self) -> None:
        if self.on_wait is not None:
            self.on_wait()

    def wait_ready(self, timeout_s: float) -> Info:
        """Wait for the Ready handshake; WorkerFailed with the worker's own error otherwise."""
        if self.process is None or self.channel is None:
            raise WorkerFailed(f"{self.name} was not spawned")
        process, channel = self.process, self.channel
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                reply = channel.recv(timeout_ms=LIVENESS_MS)
            except ProtocolError as error:
                self.stop()
                raise WorkerFailed(f"{self.name} sent an invalid handshake: {error}") from None
            if isinstance(reply, Ready):
                return self._ready(reply)
            if isinstance(reply, WorkerError):
                self.stop()
                raise WorkerFailed(f"{self.name} failed to start: {reply.message}")
            if not self.alive():
                code = process.returncode
                self.stop()
                # SIGKILL while loading is most often the kernel's out-of-memory killer.
                hint = " (killed: most often the system ran out of memory)" if code == -9 else ""
                raise WorkerFailed(f"{self.name} exited with code {code} before it was ready{hint} "
                                   "(see its log above)")
            self._waited()
        self.stop()
        raise WorkerFailed(f"{self.name} was not ready within {timeout_s:.0f} s")

    def _ready(self, reply: Ready) -> Info:
        try:
            info = decode_info(reply.info, self.info_type)
        except ProtocolError as error:
            self.stop()
            raise WorkerFailed(f"{self.name} sent an invalid handshake: {error}") from None
        self.info = info
        self.ready = True
        log.info("%s ready (pid %d): %s", self.name, reply.pid, msgspec.structs.asdict(info))
        return info

    def request(self, message: Message, expect: type[R]) -> R:
        """Send one request and wait for its reply, noticing a dead worker within LIVENESS_MS
        and killing one that has not answered within ``reply_timeout_s``."""
        if self.process is None or self.channel is None or not self.alive():
            raise WorkerFailed(f"{self.name} is not running")
        process, channel = self.process, self.channel
        limit = self.reply_timeout_s
        deadline = time.monotonic() + (limit if limit is not None else 30.0)
        # A PAIR send blocks while the peer is gone: retry in short slices, checking liveness.
        while True:
            try:
                channel.send(message, timeout_ms=LIVENESS_MS)
                break
            except ChannelTimeout:
                if not self.alive():
                    raise WorkerFailed(f"{self.name} (pid {self.pid}) died with exit code "
                                       f"{process.returncode}") from None
                if time.monotonic() > deadline:
                    self.kill()
                    raise WorkerFailed(f"{self.name} (pid {process.pid}) stopped taking requests; killed it") from None
                self._waited()
        while True:
            reply = channel.recv(timeout_ms=LIVENESS_MS)
            if reply is None:
                if not self.alive():
                    raise WorkerFailed(f"{self.name} (pid {self.pid}) died with exit code {process.returncode}")
                if limit is not None and time.monotonic() > deadline:
                    self.kill()
                    raise WorkerFailed(f"{self.name} (pid {process.pid}) did not answer {type(message).__name__} "
                                       f"within {limit:g} s (--worker-timeout); killed it")
                self._waited()
                continue
            if isinstance(reply, WorkerError):
                if reply.fatal:
                    raise WorkerFailed(f"{self.name}: {reply.message}")
                raise WorkerRequestError(f"{self.name}: {reply.message}")
            if not isinstance(reply, expect):
                raise WorkerFailed(f"{self.name} answered {type(reply).__name__}, expected {expect.__name__}")
            return reply

    def send(self, message: Message) -> None:
        """Fire-and-forget (no reply expected), skipped when the worker is gone."""
        if self.alive() and self.channel is not None:
            try:
                self.channel.send(message, timeout_ms=1000)
            except ChannelTimeout:
                log.warning("%s did not take %s", self.name, type(message).__name__)

    def ask_to_stop(self) -> bool:
        """Send Shutdown without waiting for the exit (``stop`` waits): the coordinator asks
        every worker first, so they exit side by side. Whether the worker was asked."""
        if self.asked_to_stop:
            return True
        if self.ready and self.channel is not None and self.alive():
            try:
                self.channel.send(Shutdown(), timeout_ms=500)
                self.asked_to_stop = True
            except Exception:  # it is being stopped either way
                pass
        return self.asked_to_stop

    def stop(self, grace_s: float = 3.0) -> None:
        """Ask the worker to exit, then terminate and kill it if it does not. One that never
        said Ready (still loading) is not reading its channel: it is terminated at once."""
        process = self.process
        if process is not None and process.poll() is None:
            asked = self.ask_to_stop()
            try:
                process.wait(timeout=grace_s if asked else 0.01)
            except subprocess.TimeoutExpired:
                process.terminate()
                self._resume()  # a stopped process acts on SIGTERM only once continued
                try:
                    process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    self.kill()
        self.ready = False
        self.asked_to_stop = False
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def kill(self) -> None:
        """SIGKILL the process and reap it (also ends a stopped or hung one at once)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _resume(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
