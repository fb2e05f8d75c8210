"""The loop both worker processes run: handshake, serve requests, exit with the coordinator.

A worker connects to the coordinator's control endpoint, loads its model, says ``Ready``
(or ``WorkerError(fatal=True)`` with the load error), then answers one request at a time.
It exits on ``Shutdown``, and by itself when the coordinator is gone, even after SIGKILL:
the kernel sends SIGKILL to the worker when its parent dies (PR_SET_PDEATHSIG on Linux),
and the loop also checks its parent pid every receive timeout as a portable fallback.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from ipc.channels import Channel
from ipc.codec import ProtocolError, decode_settings, encode_info
from ipc.messages import Message, Nested, Ping, Pong, Ready, Shutdown, WorkerError, WorkerSettings

log = logging.getLogger(__name__)

POLL_MS = 250
# A request handler returns its reply, or None for fire-and-forget messages (ReleaseSequence).
Handler = Callable[[Any], Message | None]
Handlers = dict[type[Message], Handler]
S = TypeVar("S", bound=WorkerSettings)
# A worker's loader: from its settings, (its ready info, a handler per request type).
Loader = Callable[[S], tuple[Nested, Handlers]]


class SequenceError(ValueError):
    """A request that fails for its own reasons (bad tree, context full): the worker replies
    with a non-fatal WorkerError and keeps serving."""


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def worker_main(worker: str, allowed: tuple[type[Message], ...], settings_type: type[S], load: Loader[S]) -> int:
    """A worker process's entry point: ``--endpoint``, ``--parent-pid`` and ``--settings`` (a
    ``settings_type`` as JSON) from the coordinator, then ``serve``. Settings it cannot read
    are its startup error, reported to the coordinator like a model that fails to load."""
    parser = argparse.ArgumentParser(description=f"Dovetail {worker} (started by dovetail-run)")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--settings", required=True, help=f"{settings_type.__name__} as JSON")
    args = parser.parse_args()
    # The coordinator decides when a worker stops (Shutdown, or its death): a stray SIGINT
    # (a terminal's Ctrl-C sent to a whole process group) must not end it with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def start() -> tuple[Nested, Handlers]:
        try:
            settings = decode_settings(args.settings, settings_type)
        except ProtocolError:
            configure_logging("info", worker)  # to say why it cannot start
            raise
        configure_logging(settings.log_level, worker)
        return load(settings)

    return serve(worker, args.endpoint, args.parent_pid, allowed, start)


def configure_logging(level: str, worker: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format=f"%(asctime)s {worker}[%(process)d] %(levelname)s %(name)s: %(message)s")


def serve(worker: str, endpoint: str, parent_pid: int, allowed: tuple[type[Message], ...],
          load: Callable[[], tuple[Nested, Handlers]]) -> int:
    """Run a worker: ``load()`` returns (ready info, handler per request type)."""
    die_with_parent()
    channel = Channel.connect(endpoint, allowed=allowed)
    try:
        try:
            info, handlers = load()
            ready = Ready(worker=worker, pid=os.getpid(), info=encode_info(info))
        except Exception as error:  # every load failure goes back to the coordinator
            log.error("%s failed to start: %s", worker, error)
            channel.send(WorkerError(worker=worker, message=f"{type(error).__name__}: {error}"[:60000], fatal=True),
                         timeout_ms=5000)
            # A send only queues the message: closing at LINGER 0 right away could drop the one
            # message that says why (seen on a loaded machine), so let libzmq deliver it first.
            channel.close(linger_ms=2000)
            return 1
        channel.send(ready, timeout_ms=5000)
        while True:
            try:
                request = channel.recv(timeout_ms=POLL_MS)
            except ProtocolError as error:
                channel.send(WorkerError(worker=worker, message=f"bad message: {error}"))
                continue
            if request is None:
                if os.getppid() != parent_pid:
                    log.warning("coordinator %d is gone; exiting", parent_pid)
                    return 1
                continue
            if isinstance(request, Shutdown):
                return 0
            if isinstance(request, Ping):
                channel.send(Pong(nonce=request.nonce))
                continue
            reply = handle(worker, handlers, request)
            if reply is not None:
                try:
                    channel.send(reply)
                except ProtocolError as error:  # a reply the protocol refuses: say so, keep serving
                    log.error("%s made an invalid %s: %s", worker, type(reply).__name__, error)
                    channel.send(WorkerError(worker=worker, message=f"invalid reply: {error}"[:60000],
                                             seq_id=getattr(request, "seq_id", None)))
    finally:
        channel.close()


def exit_process(code: int) -> NoReturn:
    """End a worker process. After a clean stop (code 0) at once, skipping the interpreter's
    teardown: with torch loaded that takes 0.8 s and delays every stop (a one-shot run's exit)
    for nothing. The channel is closed (LINGER 0) and a ring it attached is not its to unlink,
    so only the log and the standard streams need flushing. Any other exit takes the normal way:
    a failed start's last message may still be in libzmq's queue (closed with a linger)."""
    if code != 0:
        raise SystemExit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)


def handle(worker: str, handlers: Handlers, request: Message) -> Message | None:
    """One request's reply; a failure becomes a WorkerError (the worker keeps serving)."""
    try:
        return handlers[type(request)](request)
    except SequenceError as error:
        return WorkerError(worker=worker, message=str(error), seq_id=getattr(request, "seq_id", None))
    except Exception as error:  # a bug in one request must not take the worker down
        log.error("%s failed on %s:\n%s", worker, type(request).__name__, traceback.format_exc())
        return WorkerError(worker=worker, message=f"{type(error).__name__}: {error}"[:60000],
                           seq_id=getattr(request, "seq_id", None))
