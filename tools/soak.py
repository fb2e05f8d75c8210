"""Soak a server: concurrent clients for minutes, every greedy answer checked against ``mode: ar``.

    python -m tools.soak                                  # starts the demo pair itself, 8 clients, 600 s
    python -m tools.soak --duration 60 --target T --draft D
    python -m tools.soak --connect ipc:///tmp/d.sock --http http://127.0.0.1:8000 [--pid PID]

First the reference: the server's greedy ``mode: ar`` answer to each prompt. Then ``--clients``
threads run until ``--duration`` has passed, the client kinds dealt round-robin (ZMQ, ZMQ
streamed, HTTP, HTTP streamed; tools/soak_clients.py), each sending greedy requests (``--mode``,
dovetail by default) for prompts picked at random (the held-out stdlib files' beginnings when
the stdlib is found, else built-in code prompts; or ``--prompt-file``). Every answer must equal
the reference, token for token and in text.

One table: per kind the requests, wrong (an answer that differs), lost (no whole answer: an
error, a timeout, a broken stream), p50/p99 latency and time to the first streamed text; then
the resident memory of the coordinator and its workers after a warm-up and at the end (goal:
0 wrong, 0 lost, under 5% growth). Exit status 1 when anything was wrong or lost or the server
died. Not run in CI: it takes minutes.
"""

from __future__ import annotations

import math
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import click
import psutil

from dovetail_runtime.cli import read_prompt_file
from dovetail_runtime.client import DovetailClient
from dovetail_runtime.demo_models import CODE_DRAFT, CODE_TARGET
from ipc import messages as m
from ipc.endpoints import ipc_path, normalize_endpoint
from tools.bench_e2e import heldout_prompts
from tools.soak_clients import KINDS, Answer, Lost, Request, SoakClient
from tools.tables import markdown_header, markdown_row

WORKERS = ("cpu_worker", "gpu_worker")
RSS_GOAL = 0.05
SHOWN_PROBLEMS = 10


# --- the server under test ------------------------------------------------------------------


@dataclass
class Target:
    zmq: str | None
    http: str | None
    pid: int | None  # the coordinator (dovetail-run), when known
    process: subprocess.Popen[bytes] | None = None  # when the soak started it
    log: Path | None = None

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return self.pid is None or psutil.pid_exists(self.pid)


def start_server(target: str, draft: str | None, extra: list[str], workdir: Path, wait_s: float) -> Target:
    """``dovetail-run`` serving ZMQ (ipc) and HTTP, its log in ``workdir``; returns once it serves."""
    program = Path(sys.executable).parent / "dovetail-run"
    args = [str(program), "--target", target, "--bind", f"ipc://{workdir}/soak.sock", "--http", "127.0.0.1:0",
            "--log-level", "warning", *(["--draft", draft] if draft else ["--mode", "ar"]), *extra]
    log = workdir / "server.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=sink, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while True:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("dovetail serving on "):
                served = line.removeprefix("dovetail serving on ").split()
                return Target(zmq=next((e for e in served if e.startswith(("ipc://", "tcp://"))), None),
                              http=next((e for e in served if e.startswith("http://")), None), pid=process.pid,
                              process=process, log=log)
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise click.ClickException(f"dovetail-run did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def stop_server(target: Target) -> int | None:
    if target.process is None:
        return None
    if target.process.poll() is None:
        target.process.send_signal(signal.SIGTERM)
    try:
        return target.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        target.process.kill()
        return target.process.wait()


def listener_pid(address: str) -> int | None:
    """The process listening on a tcp:// or http:// port or an ipc:// path (ours to see)."""
    path = ipc_path(address)
    port = None if path is not None else urlsplit(address).port
    try:
        for conn in psutil.net_connections(kind="unix" if path is not None else "tcp"):
            if path is not None and conn.laddr == path and conn.pid:
                return conn.pid
            if port is not None and conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr[1] == port:
                return conn.pid
    except psutil.Error:
        pass
    return None


def resident(pid: int | None) -> dict[str, int]:
    """RSS in bytes of the coordinator and each worker it runs (by name)."""
    if pid is None:
        return {}
    try:
        coordinator = psutil.Process(pid)
        found = {"coordinator": coordinator.memory_info().rss}
        for child in coordinator.children(recursive=True):
            command = " ".join(child.cmdline())
            for name in WORKERS:
                if f"{name}.server" in command:
                    found[name] = child.memory_info().rss
    except psutil.Error:
        return {}
    return found


# --- the run -----------------------------------------------------------------------------


@dataclass
class Tally:
    clients: int = 0
    requests: int = 0
    wrong: int = 0
    lost: int = 0
    seconds: list[float] = field(default_factory=list)
    first_s: list[float] = field(default_factory=list)


@dataclass
class Run:
    tallies: dict[str, Tally]
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, kind: str, prompt: str, answer: Answer | Lost, expected: tuple[list[int], str]) -> None:
        with self.lock:
            tally = self.tallies[kind]
            tally.requests += 1
            if isinstance(answer, Lost):
                tally.lost += 1
                self._problem(f"{kind}: lost ({answer}) for {prompt[:40]!r}")
                return
            tally.seconds.append(answer.seconds)
            if answer.first_s is not None:
                tally.first_s.append(answer.first_s)
            if (answer.token_ids, answer.text) != expected:
                tally.wrong += 1
                self._problem(f"{kind}: wrong answer for {prompt[:40]!r}: {answer.token_ids[:12]}... "
                              f"expected {expected[0][:12]}...")

    def _problem(self, text: str) -> None:
        if len(self.problems) < SHOWN_PROBLEMS:
            self.problems.append(text)


Expected = dict[str, tuple[list[int], str]]  # prompt -> (token ids, text)


def open_client(kind: str, target: Target, timeout_s: float) -> SoakClient:
    """A client of ``kind``; a server that does not answer the ZMQ handshake is one line, not a traceback."""
    try:
        return SoakClient(kind, target.zmq, target.http, timeout_s)
    except OSError as error:  # HandshakeError is a ConnectionError
        raise click.ClickException(str(error)) from None


def reference(target: Target, prompts: list[str], new_tokens: int, timeout_s: float) -> Expected:
    """The server's greedy ``mode: ar`` answer per prompt."""
    client = open_client("zmq" if target.zmq else "http", target, timeout_s)
    try:
        answers: Expected = {}
        for prompt in dict.fromkeys(prompts):
            try:
                answer = client.ask(Request(prompt, new_tokens, "ar"))
            except Lost as error:
                raise click.ClickException(f"the reference (mode ar) failed for {prompt[:40]!r}: {error}") from None
            answers[prompt] = (answer.token_ids, answer.text)
        return answers
    finally:
        client.close()


def client_loop(run: Run, client: SoakClient, prompts: list[str], expected: Expected,
                new_tokens: int, mode: str, until: float, seed: int) -> None:
    rng = random.Random(seed)
    try:
        while time.monotonic() < until:
            prompt = rng.choice(prompts)
            try:
                answer: Answer | Lost = client.ask(Request(prompt, new_tokens, mode))
            except Lost as error:
                answer = error
            run.record(client.kind, prompt, answer, expected[prompt])
    finally:
        client.close()


def worker_restarts(target: Target) -> int | None:
    if target.zmq is None:
        return None
    try:
        with DovetailClient(target.zmq, timeout_s=10) as client:
            client.channel.send(m.MetricsRequest(), timeout_ms=10_000)
            while (reply := client.channel.recv(timeout_ms=10_000)) is not None:
                if isinstance(reply, m.MetricsReply):
                    return reply.worker_restarts
    except (TimeoutError, OSError):
        pass
    return None


# --- the report ------------------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile: the ceil(fraction * n)-th smallest value (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    # ceil, not round(x + 0.5): round() goes to the even neighbour, so where fraction * n is an odd whole
    # number it took the next value up (p50 of six took the 4th). The inner round() drops float dust
    # (0.07 * 100 = 7.000000000000001).
    rank = math.ceil(round(fraction * len(ordered), 9))
    return ordered[min(len(ordered), max(1, rank)) - 1]


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(run: Run, memory: tuple[dict[str, int], dict[str, int], dict[str, int]]) -> list[str]:
    rows = [markdown_header(["what", "clients", "requests", "wrong", "lost", "p50 s", "p99 s", "first text p50 s",
                             "RSS start MB", "RSS end MB", "RSS peak MB", "growth"])]
    total = Tally()
    for kind, tally in run.tallies.items():
        if not tally.clients:
            continue
        rows.append(markdown_row([kind, tally.clients, tally.requests, tally.wrong, tally.lost,
                                  seconds(percentile(tally.seconds, 0.5)), seconds(percentile(tally.seconds, 0.99)),
                                  seconds(statistics.median(tally.first_s) if tally.first_s else None), *[""] * 4]))
        total.clients += tally.clients
        total.requests += tally.requests
        total.wrong += tally.wrong
        total.lost += tally.lost
        total.seconds += tally.seconds
    rows.append(markdown_row(["all", total.clients, total.requests, total.wrong, total.lost,
                              seconds(percentile(total.seconds, 0.5)), seconds(percentile(total.seconds, 0.99)),
                              *[""] * 5]))
    start, end, peak = memory
    for name in start:
        if name in end:
            growth = (end[name] - start[name]) / start[name]
            megabytes = (f"{size / 2**20:.1f}" for size in (start[name], end[name], peak.get(name, end[name])))
            rows.append(markdown_row([f"RSS {name}", *[""] * 7, *megabytes, f"{growth:+.1%}"]))
    return rows


def watch(target: Target, run: Run, peak: dict[str, int], stop: threading.Event, every_s: float = 30.0) -> None:
    """Track the peak memory; say how it goes every ``every_s`` (on stderr)."""
    started = last = time.monotonic()
    while not stop.wait(2.0):
        for name, rss in resident(target.pid).items():
            peak[name] = max(peak.get(name, 0), rss)
        if time.monotonic() - last >= every_s:
            last = time.monotonic()
            with run.lock:
                counts = [sum(getattr(t, key) for t in run.tallies.values()) for key in ("requests", "wrong", "lost")]
            print(f"soak: {last - started:.0f} s, {counts[0]} requests, {counts[1]} wrong, {counts[2]} lost",
                  file=sys.stderr, flush=True)


# --- the command -------------------------------------------------------------------------------


@click.command(context_settings={"show_default": True})
@click.option("--duration", type=click.FloatRange(min=1), default=600.0, help="Seconds the clients run.")
@click.option("--clients", type=click.IntRange(min=1), default=8, help="Concurrent clients (kinds dealt "
              "round-robin: zmq, zmq-stream, http, http-stream).")
@click.option("--connect", default=None, help="Soak a running server's ZMQ endpoint (HOST:PORT, a path or a URL).")
@click.option("--http", "http_url", default=None, help="Soak a running server's HTTP API, e.g. http://127.0.0.1:8000.")
@click.option("--pid", type=int, default=None, help="With --connect/--http: the server's pid, for its memory "
              "[default: the process listening there]")
@click.option("--target", default=str(CODE_TARGET), help="Without --connect/--http: the target to serve.")
@click.option("--draft", default=str(CODE_DRAFT), help="Without --connect/--http: the draft head ('' for --mode ar).")
@click.option("--server-args", default="", help="Without --connect/--http: more dovetail-run arguments, e.g. "
              "'--cpu-cores 0 --target-dtype int8'.")
@click.option("--mode", type=click.Choice(["dovetail", "ar"]), default="dovetail", help="The requests' mode.")
@click.option("--prompts", "prompt_count", type=click.IntRange(min=1), default=12, help="Held-out prompts.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Prompts from a file instead (one per line, or JSONL with a \"prompt\" field).")
@click.option("--prompt-chars", type=click.IntRange(min=16), default=600, help="Held-out prompts' length at most.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32)
@click.option("--timeout", type=click.FloatRange(min=1), default=300.0, help="Seconds one answer may take.")
@click.option("--seed", type=int, default=0, help="Seeds the clients' choices of prompts.")
def main(duration, clients, connect, http_url, pid, target, draft, server_args, mode, prompt_count, prompt_file,
         prompt_chars, max_new_tokens, timeout, seed) -> None:
    prompts = read_prompt_file(prompt_file) if prompt_file is not None else heldout_prompts(prompt_count, prompt_chars)
    workdir = None
    if connect is None and http_url is None:
        workdir = Path(tempfile.mkdtemp(prefix="dovetail-soak-"))
        server = start_server(target, draft or None, shlex.split(server_args), workdir, wait_s=600)
        print(f"soak: started dovetail-run (pid {server.pid}, log {server.log})", file=sys.stderr)
    else:
        zmq = normalize_endpoint(connect) if connect else None
        server = Target(zmq=zmq, http=http_url, pid=pid or listener_pid(zmq or http_url))
    kinds = [kind for kind in KINDS if (server.zmq if kind.startswith("zmq") else server.http)]
    try:
        expected = reference(server, prompts, max_new_tokens, timeout)
        run = Run({kind: Tally() for kind in KINDS})
        soak_clients = [open_client(kinds[i % len(kinds)], server, timeout) for i in range(clients)]
        for client in soak_clients:  # warm-up: one request each, not counted, before memory is measured
            run.tallies[client.kind].clients += 1
            try:
                client.ask(Request(prompts[0], max_new_tokens, mode))
            except Lost as error:
                run.record(client.kind, prompts[0], error, expected[prompts[0]])
        start = resident(server.pid)
        peak = dict(start)
        stop = threading.Event()
        sampler = threading.Thread(target=watch, args=(server, run, peak, stop), daemon=True)
        sampler.start()
        until = time.monotonic() + duration
        threads = [threading.Thread(target=client_loop, args=(run, client, prompts, expected, max_new_tokens, mode,
                                                              until, seed + index), daemon=True)  # Ctrl-C ends all
                   for index, client in enumerate(soak_clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stop.set()
        end = resident(server.pid)
        alive = server.alive()
        restarts = worker_restarts(server) if alive else None
    finally:
        code = stop_server(server)
    print(f"soak: {clients} clients for {duration:.0f} s, mode {mode}, {len(expected)} prompts x {max_new_tokens} "
          f"new tokens, greedy, checked against mode ar")
    print("\n".join(table(run, (start, end, peak))))
    growth = max(((end[name] - start[name]) / start[name] for name in start if name in end), default=None)
    wrong = sum(t.wrong for t in run.tallies.values())
    lost = sum(t.lost for t in run.tallies.values())
    print(f"wrong {wrong}, lost {lost}, RSS growth at most "
          f"{'n/a' if growth is None else f'{growth:+.1%}'} (goal: 0, 0, under {RSS_GOAL:.0%}); "
          f"worker restarts {'n/a' if restarts is None else restarts}; server "
          f"{'alive' if alive else 'DIED'}{'' if code is None else f', exit status {code} after SIGTERM'}")
    for text in run.problems:
        print(f"  {text}")
    failed = bool(wrong or lost or not alive or code not in (None, 0))
    if server.log is not None and failed:
        print(f"the server's log: {server.log}")
    elif workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
