"""What a long prompt joining a batch costs the streams already running, with and without chunked
prefill (``--prefill-chunk``, ``--join-chunk``), measured side by side in one run: one server per
setting, the same streams and prompt on each.

    python -m tools.bench_prompt_join --target PATH [--draft PATH] [--chunks 0,256,256:8] [--prompt-tokens 1500]
        [--streams 2] [--max-new-tokens 96] [-- more dovetail-run flags]

``--chunks`` lists settings: ``N`` is ``--prefill-chunk N`` with the default ``--join-chunk auto``,
``N:J`` adds ``--join-chunk J`` (``N:N``: every chunk N tokens, busy or not). Each row: the running
streams' longest gap between two tokens while the long prompt joined, their p95 inter-token
latency, the long request's time to first token, and whether every request's tokens were those of
the first row. Where the target's prompt bits do not depend on its chunks (int8 and the GGUF
precisions: ``TargetInfo.chunk_invariant``) they must be; at fp32 and bf16 a prompt's roundings
depend on its chunks, so each chunk size is its own reference. Within one server every request
gets its solo ar tokens whatever runs beside it (tests/unit/test_chunked_prefill.py, test_batched.py).
"""

from __future__ import annotations

import tempfile
import threading
import time

import click

from tools.bench_concurrent import CODE_PROMPTS, Server, one_stream, p95_itl_ms
from tools.tables import markdown_header, markdown_row


def long_prompt(tokens: int) -> str:
    """About ``tokens`` tokens of code (the demo tokenizer takes a line like this in about 14)."""
    lines = [f"    total += values[{index}] * weights[{index % 17}]" for index in range(tokens // 14 + 1)]
    return "def weighted(values, weights):\n    total = 0\n" + "\n".join(lines) + "\n    return"


def measure(args: list[str], streams: int, max_new_tokens: int, prompt: str, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as socket_dir:
        server = Server(args, socket_dir)
        try:
            one_stream(server.endpoint, {"prompt": "def warm_up():", "max_new_tokens": 4, "mode": mode}, {})
            running: list[dict] = [{} for _ in range(streams)]
            threads = [threading.Thread(target=one_stream, args=(server.endpoint, {
                "prompt": CODE_PROMPTS[index % len(CODE_PROMPTS)], "max_new_tokens": max_new_tokens,
                "mode": mode}, result)) for index, result in enumerate(running)]
            for thread in threads:
                thread.start()
            time.sleep(0.5)  # the streams are decoding when the long prompt arrives
            joined: dict = {}
            sent = time.perf_counter()
            one_stream(server.endpoint, {"prompt": prompt, "max_new_tokens": 8, "mode": mode}, joined)
            for thread in threads:
                thread.join()
        finally:
            server.stop()
    gaps = [after - before for result in running
            for (before, _), (after, _) in zip(result["times"], result["times"][1:], strict=False)]
    return {"max_gap_ms": max(gaps) * 1e3, "p95_ms": p95_itl_ms(running),
            "ttft_s": joined["times"][0][0] - sent if joined["times"] else float("nan"),
            "tokens": [result["tokens"] for result in running] + [joined["tokens"]]}


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--target", required=True)
@click.option("--draft", default=None, help="a draft head (without it the streams decode with --mode ar)")
@click.option("--chunks", default="0,256", show_default=True,
              help="comma list of N (--prefill-chunk N, 0: whole) or N:J (and --join-chunk J)")
@click.option("--prompt-tokens", type=click.IntRange(min=16), default=1500, show_default=True)
@click.option("--streams", type=click.IntRange(min=1, max=63), default=2, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=8), default=96, show_default=True)
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def main(target: str, draft: str | None, chunks: str, prompt_tokens: int, streams: int, max_new_tokens: int,
         server_args: tuple[str, ...]) -> None:
    mode = "dovetail" if draft else "ar"
    prompt = long_prompt(prompt_tokens)
    print(markdown_header(["--prefill-chunk[:--join-chunk]", "running streams' longest gap ms", "their p95 ITL ms",
                           "long prompt's TTFT s", "tokens as the first row's"]))
    first = None
    for setting in chunks.split(","):
        chunk, _, join = setting.partition(":")
        args = ["--target", target, *(["--draft", draft] if draft else ["--mode", "ar"]),
                "--max-batch", str(streams + 1), "--prefill-chunk", chunk, *(["--join-chunk", join] if join else []),
                *server_args]
        result = measure(args, streams, max_new_tokens, prompt, mode)
        first = first or result["tokens"]
        print(markdown_row([setting if setting != "0" else "0 (whole prompt)", f"{result['max_gap_ms']:.0f}",
                            f"{result['p95_ms']:.1f}",
                            f"{result['ttft_s']:.2f}", "yes" if result["tokens"] == first else "NO"]), flush=True)


if __name__ == "__main__":
    main()
