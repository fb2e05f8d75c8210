"""Greedy completion with the target engine alone (no draft): prints the text and tokens/s.

    python -m tools.complete_target [--target PATH] [--prompt TEXT] [--max-new-tokens N]
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from cpu_worker import TargetEngine, greedy_decode, load_target_model, resolve_model_dir

TESTBED = Path(__file__).resolve().parents[2] / "shared" / "testbed" / "target-code-9m"


@click.command()
@click.option("--target", default=str(TESTBED), show_default=True, help="model folder or cached hub id")
@click.option("--prompt", default="def fibonacci(n):", show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
def main(target: str, prompt: str, max_new_tokens: int) -> None:
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(target)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = TargetEngine(load_target_model(model_dir))
    ids = tokenizer(prompt)["input_ids"]
    start = time.perf_counter()
    generated = greedy_decode(engine, ids, max_new_tokens, tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    print(prompt + tokenizer.decode(generated, skip_special_tokens=True))
    print(f"\n[{len(generated)} tokens in {elapsed:.2f} s: {len(generated) / elapsed:.1f} tokens/s, target alone]")


if __name__ == "__main__":
    main()
