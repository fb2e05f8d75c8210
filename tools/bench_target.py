"""Target engine speed, side by side in one run: decode tokens/s of this engine vs
transformers ``generate``, tree-verification latency against T, and the memory-bandwidth
ceiling of a decode step on this machine.

    python -m tools.bench_target [--threads 2] [--tokens 64] [--models testbed,random-110m]
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import click
import torch

from cpu_worker.engine import TargetEngine, greedy_decode
from cpu_worker.model.llama import LlamaDecoder
from cpu_worker.target_loading import load_target_model
from tools.bench_real import measure_bandwidth
from tools.tables import markdown_header, markdown_row, markdown_table

TESTBED = Path(__file__).resolve().parents[2] / "shared" / "testbed" / "target-code-9m"
TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
MAX_LEN = 512  # each engine's context
PROMPT_TOKENS = 128
MODELS = ("testbed", "random-110m")


def random_llama_110m(directory: Path) -> Path:
    """A Llama config of about 110M parameters with random weights, saved as a checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def decode_bytes(model: LlamaDecoder) -> int:
    """Bytes of weights one decode step reads: every parameter but the embedding, of which a step
    reads one row (a tied embedding is the lm_head too, so it stays)."""
    embedding = model.embed_tokens.get_parameter("weight")
    tied = any(parameter is embedding for parameter in model.lm_head.parameters())
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embedding)


def engine_decode_tps(engine: TargetEngine, prompt: list[int], tokens: int) -> float:
    """Decode steps alone: the prompt's prefill (a matrix pass, not a decode step) is outside the clock."""
    greedy_decode(engine, prompt, 4)
    token = int(engine.prefill(prompt).logits.argmax())
    start = time.perf_counter()
    for _ in range(tokens):
        token = int(engine.decode(token).logits.argmax())
    return tokens / (time.perf_counter() - start)


def hf_decode_tps(path: Path, prompt: list[int], tokens: int) -> float:
    """generate's decode steps alone: its time for tokens + 1 new tokens less its time for the first,
    which the prefill gives."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    seconds = {}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        for count in (1, tokens + 1):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=count, do_sample=False, pad_token_id=0)
            seconds[count] = time.perf_counter() - start
    return tokens / max(seconds[tokens + 1] - seconds[1], 1e-9)


def verify_latency_ms(engine: TargetEngine, prefix: list[int], size: int, repeats: int) -> float:
    rng = random.Random(size)
    parents = [-1] + [rng.randrange(index) for index in range(1, size)]
    tokens = [rng.randrange(3, engine.spec.vocab_size) for _ in range(size)]
    engine.prefill(prefix)
    engine.tree_logits(tokens, parents)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.tree_logits(tokens, parents)  # leaves `committed` unchanged: same work each time
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def parse_models(_context: click.Context, _parameter: click.Parameter, text: str) -> list[str]:
    """The model names; any other name was benchmarked as a random 110M model under that name."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        raise click.BadParameter(f"{', '.join(unknown) or 'none given'}: expected a comma list of {', '.join(MODELS)}")
    return names


@click.command()
@click.option("--threads", type=click.IntRange(min=1), default=None, help="intra-op threads (default: torch's)")
@click.option("--tokens", type=click.IntRange(8, MAX_LEN - PROMPT_TOKENS), default=64, show_default=True,
              help=f"new tokens per decode run (after a {PROMPT_TOKENS}-token prompt, in a {MAX_LEN}-token context)")
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True, help="verify repeats per T")
@click.option("--models", default="testbed,random-110m", show_default=True, callback=parse_models,
              help="comma list: testbed, random-110m")
def main(threads: int | None, tokens: int, repeats: int, models: list[str]) -> None:
    if threads:
        torch.set_num_threads(threads)
    bandwidth = measure_bandwidth(None)[0]
    print(f"threads {torch.get_num_threads()}, measured read bandwidth {bandwidth:.1f} GB/s")
    with tempfile.TemporaryDirectory() as scratch:
        for name in models:
            path = TESTBED if name == "testbed" else random_llama_110m(Path(scratch) / name)
            model = load_target_model(path)
            engine = TargetEngine(model, max_len=MAX_LEN)
            model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            step_bytes = decode_bytes(model)  # the ceiling's bytes: what a step must read
            prompt = [1] + [random.Random(0).randrange(3, engine.spec.vocab_size) for _ in range(PROMPT_TOKENS - 1)]
            ours = engine_decode_tps(engine, prompt, tokens)
            theirs = hf_decode_tps(path, prompt, tokens)
            floor_ms = step_bytes / (bandwidth * 1e9) * 1e3
            print(f"\n## {name}: {model_bytes / 1e6:.0f} MB fp32 ({step_bytes / 1e6:.0f} MB read per decode step: "
                  f"the embedding's one row aside), prompt {PROMPT_TOKENS} tokens, {tokens} new tokens")
            print(markdown_table(["decode", "tokens/s", "ms/step"], [
                ["dovetail engine", f"{ours:.1f}", f"{1e3 / ours:.2f}"],
                ["transformers generate", f"{theirs:.1f}", f"{1e3 / theirs:.2f}"],
                [f"bandwidth ceiling (bytes / {bandwidth:.1f} GB/s)", f"{1e3 / floor_ms:.1f}", f"{floor_ms:.2f}"]]))
            print(f"engine / transformers: {ours / theirs:.2f}x")
            print("\n" + markdown_header(["T", "verify ms", "vs T=1"]))
            base = None
            for size in TREE_SIZES:
                latency = verify_latency_ms(engine, prompt, size, repeats)
                base = base or latency
                print(markdown_row([size, f"{latency:.2f}", f"{latency / base:.2f}x"]))


if __name__ == "__main__":
    main()
