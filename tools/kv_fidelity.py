"""What a KV cache dtype and a weight precision cost in fidelity: teacher-forced top-1 agreement
with the fp32 target (fp32 weights, fp32 cache) on held-out prompts.

    python -m tools.kv_fidelity --target ../shared/testbed/target-code-9m [--files 30] [--tokens 128]

The fp32 target decodes ``--tokens`` greedy tokens after the first 256 tokens of each held-out
stdlib file longer than that (DESIGN.md 10, the tau protocol's prompts); every other setting is
then fed the same tokens, and the table counts the positions where its argmax differs.
Losslessness is a separate matter (each setting is exact against its own ``--mode ar``); this
says how far a setting is from full precision.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from cpu_worker.engine import TargetEngine
from cpu_worker.target_loading import load_target_model
from dovetail_runtime.draft_eval import file_prompts
from gpu_worker.train.corpus import stdlib_files
from tools.options import load_errors_in_one_line, positive_int
from tools.tables import markdown_header, markdown_row

PROMPT_TOKENS = 256
SETTINGS = (("fp32", torch.float32), ("int8-row", torch.float32), ("int8-row", torch.bfloat16),
            ("fp32", torch.bfloat16))


def heldout_prompts(target: Path, files: int) -> list[list[int]]:
    """The first PROMPT_TOKENS token ids of the first ``files`` held-out files longer than that
    (the tau protocol's prompts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return [ids for _, ids in file_prompts(stdlib_files("heldout"), tokenizer, PROMPT_TOKENS, files)]


def forced_argmax(engine: TargetEngine, prompt: list[int], forced: list[int]) -> list[int]:
    """The engine's argmax after the prompt and after each forced token but the last."""
    step = engine.prefill(prompt)
    chosen = []
    for token in forced:
        chosen.append(int(step.logits.argmax()))
        step = engine.decode(token)
    return chosen


@load_errors_in_one_line
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--files", type=positive_int, default=30)
    parser.add_argument("--tokens", type=positive_int, default=128)
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {precision: load_target_model(args.target, precision) for precision in ("fp32", "int8-row")}
    max_len = PROMPT_TOKENS + args.tokens + 1
    engines = {(precision, kv): TargetEngine(models[precision], max_len=max_len, kv_dtype=kv)
               for precision, kv in SETTINGS}
    prompts = heldout_prompts(args.target, args.files)
    if not prompts:
        print("no held-out stdlib file longer than 256 tokens found", file=sys.stderr)
        return 1
    differ = dict.fromkeys(engines, 0)
    for prompt in prompts:
        reference = engines["fp32", torch.float32]
        step, forced = reference.prefill(prompt), []
        for _ in range(args.tokens):
            forced.append(int(step.logits.argmax()))
            step = reference.decode(forced[-1])
        for key, engine in engines.items():
            differ[key] += sum(got != want for got, want in zip(forced_argmax(engine, prompt, forced), forced))
    total = len(prompts) * args.tokens
    print(f"command: python -m tools.kv_fidelity {' '.join(sys.argv[1:])}")
    print(f"{len(prompts)} held-out prompts x {args.tokens} tokens, forced from the fp32 target's greedy decode")
    print(markdown_header(["weights", "KV cache", "top-1 agreement with fp32/fp32", "positions that differ"]))
    for (precision, kv), count in differ.items():
        print(markdown_row([precision, str(kv).removeprefix("torch."), f"{1 - count / total:.4f}",
                            f"{count} of {total}"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
