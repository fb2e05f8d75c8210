"""End-to-end speed of the two-process runtime: dovetail vs --mode ar, measured side by side
(requests alternate between the modes, so machine noise hits both alike).

    python -m tools.bench_e2e --target PATH --draft PATH [--temperatures 0,0.7,1.0] [--prompts N]

Prompts default to the start of held-out CPython stdlib files (the testbed's split) when
the stdlib is found, else to a few built-in code prompts.
"""

from __future__ import annotations

import statistics
import uuid
from collections import defaultdict

import click
import msgspec

from cpu_worker.model.model_dir import ModelLoadError
from dovetail_runtime.coordinator import Coordinator, RuntimeSettings, TooManyRestarts
from dovetail_runtime.workers import WorkerFailed, WorkerRequestError
from gpu_worker.train.corpus import stdlib_files
from ipc import messages as m
from ipc.tree import MAX_DEPTH, MAX_TOP_K, MAX_TREE_TOKENS, TreeShape
from tools.options import comma_list
from tools.tables import markdown_header, markdown_row

FALLBACK_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\nimport sys\n\ndef main(argv):",
                    "for i in range(10):", "def parse_args(argv=None):", "class Config(dict):"]


def heldout_prompts(count: int, chars: int = 1000) -> list[str]:
    """Beginnings of held-out stdlib files, in sorted path order; the split and the file
    listing are the training corpus's (gpu_worker.train.corpus), so the bench never sees train files."""
    prompts = []
    for path in stdlib_files("heldout"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) > chars:
            # End at the end of a line, without its newline: BPE merges a newline with the next
            # line's indentation, so a prompt ending in a bare newline is out of distribution.
            prompts.append(text[:chars].rsplit("\n", 1)[0])
        if len(prompts) == count:
            break
    return prompts or FALLBACK_PROMPTS[:count]


def measure(settings: RuntimeSettings, prompts: list[str], temperatures: list[float], max_new_tokens: int,
            seed: int) -> list[tuple[float, dict[str, dict[str, list[float]]]]]:
    """Every prompt in both modes at each temperature: per temperature, each mode's stats lists."""
    rows = []
    with Coordinator(settings) as coordinator:
        warmup = coordinator.generate(m.GenerateRequest(request_id="warmup", prompt=prompts[0], max_new_tokens=8))
        if isinstance(warmup, m.ErrorReply):
            raise click.ClickException(f"warm-up: {warmup.code}: {warmup.message}")
        for temperature in temperatures:
            totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
            for index, prompt in enumerate(prompts):
                for mode in ("dovetail", "ar"):
                    reply = coordinator.generate(m.GenerateRequest(
                        request_id=uuid.uuid4().hex, prompt=prompt, max_new_tokens=max_new_tokens, mode=mode,
                        sampling=m.Sampling(temperature=temperature, seed=seed + index)))
                    if isinstance(reply, m.ErrorReply):
                        raise click.ClickException(f"{mode}: {reply.code}: {reply.message}")
                    for key, value in msgspec.to_builtins(reply.stats).items():
                        if not isinstance(value, list):
                            totals[mode][key].append(value)
            rows.append((temperature, totals))
    return rows


def parse_temperatures(context: click.Context, parameter: click.Parameter, text: str) -> list[float]:
    """The temperatures, each one a request may carry (checked here, before the workers start)."""
    temperatures = comma_list(float, minimum=0.0)(context, parameter, text)
    for temperature in temperatures:
        try:
            msgspec.convert({"temperature": temperature}, m.Sampling)
        except (msgspec.ValidationError, ValueError) as error:
            raise click.BadParameter(str(error)) from None
    return temperatures


@click.command()
@click.option("--target", required=True, help="target model folder")
@click.option("--draft", required=True, help="draft head folder")
@click.option("--temperatures", default="0", show_default=True, callback=parse_temperatures,
              help="comma list of temperatures")
@click.option("--prompts", "prompt_count", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--tree-tokens", type=click.IntRange(1, MAX_TREE_TOKENS), default=16, show_default=True)
@click.option("--depth", type=click.IntRange(1, MAX_DEPTH), default=6, show_default=True,
              help="deepest level (at most T - 1: the header shows the shape that ran)")
@click.option("--tree-top-k", "top_k", type=click.IntRange(1, MAX_TOP_K), default=8, show_default=True)
@click.option("--cpu-threads", type=click.IntRange(min=1), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
def main(target, draft, temperatures: list[float], prompt_count, max_new_tokens, tree_tokens, depth, top_k,
         cpu_threads, seed) -> None:
    prompts = heldout_prompts(prompt_count)
    shape = TreeShape.clamped(tree_tokens, depth, top_k)  # depth at most T - 1: the header shows what ran
    settings = RuntimeSettings(target=target, draft=draft, cpu_threads=cpu_threads, log_level="warning", tree=shape)
    try:
        rows = measure(settings, prompts, temperatures, max_new_tokens, seed)
    except (ModelLoadError, WorkerFailed, WorkerRequestError, TooManyRestarts, OSError) as error:
        raise click.ClickException(str(error)) from None  # as dovetail-run says it: one line
    print(f"target {target}, draft {draft}, T={shape.tree_tokens} depth={shape.depth} top_k={shape.top_k}, "
          f"{len(prompts)} prompts x {max_new_tokens} new tokens")
    print(markdown_header(["temperature", "mode", "tokens/s", "tau", "draft ms/cycle", "verify ms/cycle",
                           "ipc ms/cycle"]))
    for temperature, totals in rows:
        rates, per_cycle = {}, {}
        for mode in ("dovetail", "ar"):
            t = totals[mode]
            tokens, wall = sum(t["new_tokens"]), sum(t["wall_ms"]) / 1e3
            cycles = sum(t["cycles"]) or 1
            rates[mode] = tokens / wall
            tau = statistics.fmean(t["tau"])
            per_cycle[mode] = (tau, sum(t["verify_ms"]) / cycles, sum(t["ipc_ms"]) / cycles)
            print(markdown_row([f"{temperature:g}", mode, f"{rates[mode]:.1f}", f"{tau:.2f}",
                                *(f"{sum(t[key]) / cycles:.2f}" for key in ("draft_ms", "verify_ms", "ipc_ms"))]))
        print(markdown_row([f"{temperature:g}", "speedup dovetail / ar", f"{rates['dovetail'] / rates['ar']:.2f}x",
                            *[""] * 4]))
        # DESIGN.md 9: speedup = tau * t_ar / t_cycle; with a draft that costs ~0 (a GPU), t_cycle = verify + ipc.
        tau, verify, ipc = per_cycle["dovetail"]
        t_ar = per_cycle["ar"][1] + per_cycle["ar"][2]
        print(markdown_row([f"{temperature:g}", "model, draft time 0 (tau x t_ar / (verify + ipc))",
                            f"{tau * t_ar / (verify + ipc):.2f}x", *[""] * 4]))


if __name__ == "__main__":
    main()
