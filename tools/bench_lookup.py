"""Lookup decoding (``--mode lookup``: no draft head) against plain decoding, side by side: the modes
take turns on each prompt of a set (the first mode rotating), on one server per ``--lookup-tokens``
value, and the decode speed (new tokens but the first over wall time less the prefill) is summed per
mode (``bench_real.ModeTotals``: each request's first token, the prefill's, left out). With
``--draft`` the server has a head and ``dovetail`` requests run beside them (their plain steps, where
no tree pays, carry lookup's branch too).

    python -m tools.bench_lookup --target ~/.cache/dovetail/fixtures/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m tools.bench_lookup --target T --sets chat,edit --lookup-tokens 4,16 --rounds 3
    python -m tools.bench_lookup --target T --draft demo/draft-smollm2 --modes dovetail,lookup,ar

Sets: ``chat`` (held-out chat prompts, ``tools.chat_prompts``: text that seldom repeats), ``edit``
(editing prompts whose answers copy the prompt), or a JSONL file of ``{"prompt": ...}`` lines; each
prompt is sent as a chat message. Prints a markdown table (a row per mode, against ar) and the target
worker's peak RSS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import click

from dovetail_runtime.coordinator import Coordinator, RuntimeSettings
from ipc import messages as m
from tools.bench_real import ModeTotals, proc_status_kb
from tools.chat_prompts import heldout_prompts
from tools.options import comma_list
from tools.tables import markdown_header, markdown_row

MODES = ("dovetail", "lookup", "ar")
EDIT_PROMPTS = [
    "Fix the spelling mistakes in this sentence and write it out again: The quick brown fox jumpd over the lazzy "
    "dog while the farmer was sleping in the barn.",
    "Repeat this list exactly, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes, "
    "honeydew.",
    "Rewrite this paragraph with 'car' replaced by 'bicycle': I took my car to the shop because my car was making "
    "a noise. The mechanic looked at the car and said the car needed new brakes.",
    "Add a docstring to this Python function and return the whole function:\ndef area(width, height):\n"
    "    return width * height",
    "Copy this email and add a polite closing line: Hi Sam, thanks for sending the report. I will read it tonight "
    "and send you my notes tomorrow morning.",
    "Here is a recipe: Mix two cups of flour with one cup of milk, add two eggs, stir well, and bake for thirty "
    "minutes. Write the recipe again as numbered steps.",
    "Convert this sentence to the past tense: I walk to the park, I feed the ducks, and I read my book under the "
    "big oak tree.",
    "Quote the following line back to me word for word: To be, or not to be, that is the question: whether 'tis "
    "nobler in the mind to suffer.",
]


def prompt_set(name: str) -> list[str]:
    if name == "chat":
        return heldout_prompts()
    if name == "edit":
        return list(EDIT_PROMPTS)
    path = Path(name)
    if not path.is_file():
        raise click.BadParameter(f"{name!r} is not chat, edit or a JSONL file", param_hint="--sets")
    try:
        return [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (ValueError, KeyError, TypeError) as error:
        raise click.BadParameter(f"{name}: not JSONL with a \"prompt\" field on every line ({error})",
                                 param_hint="--sets") from None


@dataclass
class ModeResult:
    totals: ModeTotals = field(default_factory=ModeTotals)
    same: int = 0  # answers with ar's tokens
    accepted: int = 0  # tokens beyond one a step: a branch's or a tree's
    branch_nodes: int = 0  # branch tokens verified
    steps: int = 0


def run_set(coordinator: Coordinator, prompts: list[str], modes: list[str], rounds: int,
            new_tokens: int) -> dict[str, ModeResult]:
    results = {mode: ModeResult() for mode in modes}
    for round_index in range(rounds):
        for index, prompt in enumerate(prompts):
            shift = (round_index + index) % len(modes)
            done: dict[str, m.GenerateDone] = {}
            for mode in modes[shift:] + modes[:shift]:
                reply = coordinator.generate(m.GenerateRequest(
                    request_id=f"{round_index}-{index}-{mode}", messages=[m.ChatMessage(role="user", content=prompt)],
                    max_new_tokens=new_tokens, mode=mode))  # type: ignore[arg-type]
                if not isinstance(reply, m.GenerateDone):
                    raise click.ClickException(f"prompt {index}, {mode}: {reply.code}: {reply.message}")
                done[mode] = reply
            for mode, reply in done.items():
                result, stats = results[mode], reply.stats
                result.totals.add(stats)
                result.same += reply.token_ids == done["ar"].token_ids
                result.accepted += max(stats.new_tokens - 1 - stats.cycles, 0)  # the prefill's token aside
                result.branch_nodes += stats.lookup_nodes
                result.steps += stats.cycles
    return results


@click.command()
@click.option("--target", required=True, help="A GGUF file or model folder.")
@click.option("--target-dtype", default="auto", show_default=True)
@click.option("--draft", default=None, help="A draft head: the server then serves dovetail requests too.")
@click.option("--modes", default=None,
              help="Comma-separated request modes, ar among them [default: lookup,ar; with --draft: "
                   "dovetail,lookup,ar].")
@click.option("--sets", default="chat,edit", show_default=True,
              help="Comma-separated: chat, edit, or JSONL files of {\"prompt\": ...}.")
@click.option("--lookup-tokens", "lookup_tokens", callback=comma_list(int), default="4", show_default=True,
              help="--lookup-tokens values, a server each.")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=96, show_default=True)
@click.option("--max-len", type=click.IntRange(min=64), default=2048, show_default=True)
def main(target: str, target_dtype: str, draft: str | None, modes: str | None, sets: str,
         lookup_tokens: list[int], rounds: int, max_new_tokens: int, max_len: int) -> None:
    """--mode lookup (and dovetail, with --draft) against --mode ar on prompt sets, side by side (decode
    speed, same tokens)."""
    prompts = {name: prompt_set(name) for name in filter(None, (item.strip() for item in sets.split(",")))}
    if not prompts:
        raise click.BadParameter("name at least one set", param_hint="--sets")
    if any(value < 1 or value > 16 for value in lookup_tokens):
        raise click.BadParameter("each value must be 1-16", param_hint="--lookup-tokens")
    chosen = [item.strip() for item in (modes or ("dovetail,lookup,ar" if draft else "lookup,ar")).split(",")]
    if "ar" not in chosen or any(mode not in MODES for mode in chosen) or len(set(chosen)) != len(chosen):
        raise click.BadParameter(f"distinct modes of {', '.join(MODES)}, ar among them", param_hint="--modes")
    if "dovetail" in chosen and not draft:
        raise click.BadParameter("dovetail requests need a --draft", param_hint="--modes")
    print(markdown_header(["set", "prompts x rounds", "--lookup-tokens", "mode", "tok/s", "x ar", "same tokens as ar",
                           "tokens a branch or tree added", "branch tokens verified", "steps",
                           "target peak RSS"]), flush=True)
    for branch in lookup_tokens:
        coordinator = Coordinator(RuntimeSettings(target=target, draft=draft, mode="dovetail" if draft else "lookup",
                                                  target_dtype=target_dtype, lookup_tokens=branch, max_len=max_len,
                                                  max_batch=1))
        try:
            coordinator.start()
            for name, texts in prompts.items():
                print_set(coordinator, name, texts, chosen, rounds, max_new_tokens, branch)
        finally:
            coordinator.close()


def print_set(coordinator: Coordinator, name: str, texts: list[str], modes: list[str], rounds: int,
              max_new_tokens: int, branch: int) -> None:
    results = run_set(coordinator, texts, modes, rounds, max_new_tokens)
    ar = results["ar"].totals.tokens_per_s() or 0.0
    assert coordinator.cpu is not None and coordinator.cpu.process is not None
    peak = proc_status_kb(coordinator.cpu.process.pid).get("VmHWM", 0)
    for mode, result in results.items():
        speed = result.totals.tokens_per_s() or 0.0
        print(markdown_row([name, f"{len(texts)} x {rounds}", branch, mode, f"{speed:.1f}",
                            f"{speed / ar:.3f}" if ar else "-", f"{result.same}/{len(texts) * rounds}",
                            result.accepted, result.branch_nodes, result.steps, f"{peak / 1024 ** 2:.2f} GB"]),
              flush=True)


if __name__ == "__main__":
    main()
