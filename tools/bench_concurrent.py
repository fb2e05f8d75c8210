"""Many users at once through a real ``dovetail-run`` server: aggregate tokens/s of N concurrent
streams (dovetail and ar) against one solo ar stream, measured side by side in one run, with each
stream's p95 inter-token latency and whether every stream's tokens equal its solo ar run.

    python -m tools.bench_concurrent --target PATH [--draft PATH] [--streams 1,2,4,8] [--max-new-tokens 64]
        [--rounds 1] [-- more dovetail-run flags, e.g. --target-dtype int8 --cpu-threads 2]

The server runs with --max-batch at the largest stream count. Greedy requests, one prompt per
stream (held-out chat prompts through the chat template when the target has one, else code prompts).
Each stream count runs in ar and then at once in dovetail mode, so the two rows of a pair share the
host's moment (a shared machine's memory speed moves by a third within minutes); ``--rounds`` repeats
the pairs and prints the median of their ratios.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from dovetail_runtime.client import DovetailClient, GenerationError
from ipc import messages as m
from tools.chat_prompts import heldout_prompts as chat_prompts
from tools.options import comma_list
from tools.tables import markdown_header, markdown_row

CODE_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\nimport sys\n\ndef main(argv):", "for i in range(10):",
                "def parse_args(argv=None):", "class Config(dict):", "with open(path) as f:", "def __init__(self):"]


class Server:
    def __init__(self, args: list[str], socket_dir: str):
        endpoint = f"ipc://{socket_dir}/bench.sock"
        self.process = subprocess.Popen([str(Path(sys.executable).parent / "dovetail-run"), *args, "--bind", endpoint,
                                         "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
        self.endpoint = endpoint
        assert self.process.stderr is not None
        for line in self.process.stderr:
            sys.stderr.write(line)
            if line.startswith("dovetail serving on "):
                break
        else:
            raise SystemExit("dovetail-run did not start")
        threading.Thread(target=lambda: [None for _ in self.process.stderr or ()], daemon=True).start()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def has_chat_template(endpoint: str) -> bool:
    """Whether the server takes chat messages (its target has a chat template); warms it up too."""
    with DovetailClient(endpoint, timeout_s=3600) as probe:
        try:
            probe.chat([{"role": "user", "content": "hello"}], max_new_tokens=2, mode="ar")
        except GenerationError:
            probe.generate("hello", max_new_tokens=2, mode="ar")
            return False
    return True


def one_stream(endpoint: str, fields: dict, out: dict) -> None:
    """Run one streaming request; record its tokens and when each chunk arrived."""
    times: list[tuple[float, int]] = []
    tokens: list[int] = []
    with DovetailClient(endpoint, timeout_s=3600) as client:
        for event in client.events(**fields):
            if isinstance(event, m.TokenChunk) and event.token_ids:
                times.append((time.perf_counter(), len(event.token_ids)))
                tokens.extend(event.token_ids)
            elif isinstance(event, m.GenerateDone):
                tokens = event.token_ids
                out["stats"] = event.stats
    out["tokens"], out["times"] = tokens, times


def run_streams(endpoint: str, requests: list[dict]) -> tuple[float, list[dict]]:
    """All requests at once; (wall seconds, per-stream results)."""
    results: list[dict] = [{} for _ in requests]
    threads = [threading.Thread(target=one_stream, args=(endpoint, fields, result))
               for fields, result in zip(requests, results, strict=True)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, results


def format_ms(ms: float) -> str:
    return "- (too few tokens)" if math.isnan(ms) else f"{ms:.1f}"


def p95_itl_ms(results: list[dict]) -> float:
    """95th percentile of every stream's time per token between its chunks (a chunk's tokens share its gap);
    nan with fewer than two gaps (each stream answered in one chunk)."""
    gaps = []
    for result in results:
        times = result["times"]
        for (before, _), (after, count) in zip(times, times[1:], strict=False):
            gaps += [(after - before) / count * 1e3] * count
    return statistics.quantiles(gaps, n=20)[-1] if len(gaps) >= 2 else float("nan")


def tree_cycles(results: list[dict]) -> str:
    """How many of the streams' cycles verified a tree (more than one node), and their tokens per cycle."""
    stats = [result["stats"] for result in results if "stats" in result]
    trees = sum(count for stat in stats for shape, count in stat.trees.items() if not shape.startswith("1/"))
    cycles = sum(stat.cycles for stat in stats)
    return f"{trees} of {cycles}"


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--target", required=True)
@click.option("--draft", default=None, help="a draft head (without it only ar is measured)")
@click.option("--streams", default="1,2,4,8", show_default=True, callback=comma_list(int, minimum=1),
              help="comma list of concurrent stream counts (the server's --max-batch is the largest)")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--chat/--code", default=None, help="chat or code prompts  [default: chat when the target has a chat "
              "template]")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="times to run every (stream count, mode) pair; the median dovetail / ar ratio per count at the end")
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def main(target: str, draft: str | None, streams: list[int], max_new_tokens: int, chat: bool | None, rounds: int,
         server_args: tuple[str, ...]) -> None:
    counts = sorted(set(streams))
    args = ["--target", target, *(["--draft", draft] if draft else ["--mode", "ar"]), "--max-batch", str(max(counts)),
            *server_args]
    modes = ["ar", "dovetail"] if draft else ["ar"]
    with tempfile.TemporaryDirectory() as socket_dir:
        server = Server(args, socket_dir)
        try:
            use_chat = has_chat_template(server.endpoint) if chat is None else chat
            prompts = chat_prompts(max(counts)) if use_chat else CODE_PROMPTS
            requests = [({"messages": [m.ChatMessage(role="user", content=text)]} if use_chat
                         else {"prompt": text}) | {"max_new_tokens": max_new_tokens}
                        for text in (prompts * max(counts))[:max(counts)]]
            # Solo ar, one request at a time: each stream's reference tokens and the baseline speed.
            solo_wall, solo_tokens = 0.0, []
            for fields in requests:
                wall, (result,) = run_streams(server.endpoint, [fields | {"mode": "ar"}])
                solo_wall += wall
                solo_tokens.append(result["tokens"])
            solo_tps = sum(len(tokens) for tokens in solo_tokens) / solo_wall
            print(markdown_header(["mode", "streams", "aggregate tok/s", "x solo ar", "x ar just before",
                                   "p95 ITL ms", "same tokens", "cycles with a tree"]))
            print(markdown_row(["ar (solo, one at a time)", 1, f"{solo_tps:.1f}", "1.00x", "", "", "reference", ""]))
            ratios: dict[int, list[float]] = {count: [] for count in counts}
            for _ in range(rounds):
                for count in counts:
                    rates = {}
                    for mode in modes:
                        wall, results = run_streams(server.endpoint, [fields | {"mode": mode} for fields in
                                                                      requests[:count]])
                        total = sum(len(result["tokens"]) for result in results)
                        rates[mode] = total / wall
                        same = all(result["tokens"] == solo_tokens[index] for index, result in enumerate(results))
                        versus_ar = f"{rates[mode] / rates['ar']:.2f}x" if mode == "dovetail" else ""
                        print(markdown_row([mode, count, f"{rates[mode]:.1f}", f"{rates[mode] / solo_tps:.2f}x",
                                            versus_ar, format_ms(p95_itl_ms(results)), "yes" if same else "NO",
                                            tree_cycles(results) if mode == "dovetail" else ""]), flush=True)
                    if "dovetail" in rates:
                        ratios[count].append(rates["dovetail"] / rates["ar"])
            if draft and rounds > 1:
                print("dovetail / ar just before, median of rounds: " + ", ".join(
                    f"{count} streams {statistics.median(values):.2f}x ({', '.join(f'{v:.2f}' for v in values)})"
                    for count, values in ratios.items()))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
