"""Self-distilled chat data for a draft head: prompts written from topic lists, answered by the target.

A head predicts what its target says next, so the best training text is the target's own answers
(self-distillation, as EAGLE-3 and Medusa-2 train): prompts from ``chat_prompts`` (training
topics only; the held-out topics are never answered here) rendered with the target's chat
template, answered greedily and by sampling (temperature 0.7, top-p 0.9, the sampler users run),
written as ShareGPT records that ``dovetail-train features --input`` renders again with the same
template. Resumable: a rerun appends only the prompts its file lacks::

    python -m tools.chat_data --target ~/.cache/dovetail/fixtures/smollm2-135m-instruct \\
        --out data/smollm2-chat.jsonl --prompts 1200
    python -m tools.chat_data --heldout --out data/heldout-prompts.jsonl   # prompts only, for eval
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import click
from tqdm import tqdm

from dovetail_runtime.train_cli import check_device
from tools.chat_prompts import heldout_prompts, training_prompts


def _done(out: Path) -> set[tuple[str, int]]:
    """(prompt, answer index) pairs ``out`` already holds (a torn last line from an interrupted run
    is dropped; records from before ``--answers`` are answer 0)."""
    done: set[tuple[str, int]] = set()
    if not out.exists():
        return done
    lines = out.read_text(encoding="utf-8").splitlines(keepends=True)
    good = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        try:
            done.add((record["conversations"][0]["value"], int(record.get("answer", 0))))
        except (TypeError, KeyError, IndexError, ValueError):  # another file (held-out prompts?): never append to it
            raise click.ClickException(f"{out}:{number} is not a record this tool writes (ShareGPT "
                                       "\"conversations\"): give --out a file of its own") from None
        good.append(line)
    if len(good) != len(lines):
        out.write_text("".join(good), encoding="utf-8")
    return done


def refuse_to_overwrite_answers(out: Path) -> None:
    """--heldout rewrites ``out`` (a rerun rewrites the same prompts); a file with anything else in it (the
    answers a run took hours to write, when --out names the wrong file) is refused instead."""
    if not out.exists():
        return
    for number, line in enumerate(out.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if line.strip() and not (isinstance(record, dict) and set(record) == {"prompt"}):
            raise click.ClickException(f"{out}:{number} is not a held-out prompt line: --heldout would overwrite "
                                       "it (give --out a file of its own)")


def work_items(prompts: list[str], answers: int, sampled: float, seed: int) -> list[tuple[str, int, bool]]:
    """(prompt, answer index, sampled?) in the order they are answered: every prompt's first
    answer (greedy or sampled, a seeded ``sampled`` share of them sampled), then every prompt's
    second (always sampled), and so on, so a run cut short covers the prompts evenly."""
    chooser = random.Random(seed)
    first_sampled = {p: chooser.random() < sampled for p in prompts}
    return [(p, index, index > 0 or first_sampled[p]) for index in range(answers) for p in prompts]


def answer(model, tokenizer, prompts: list[str], sample: bool, max_new_tokens: int, seed: int) -> list[str]:
    """The target's answers to ``prompts`` in one left-padded batch (on the model's device)."""
    import torch

    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    torch.manual_seed(seed)
    options = {"do_sample": True, "temperature": 0.7, "top_p": 0.9} if sample else {"do_sample": False}
    with torch.inference_mode():
        output = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                **options)
    new = output[:, batch["input_ids"].shape[1]:]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--target", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The target's HF folder (transformers generates in batches). Not needed with --heldout.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="ShareGPT .jsonl to write (appended to on a rerun).")
@click.option("--prompts", "count", type=click.IntRange(1), default=1200, show_default=True,
              help="Training prompts to answer (drawn without repeats from the topic lists).")
@click.option("--answers", type=click.IntRange(1), default=1, show_default=True,
              help="Answers per prompt: the first greedy or sampled (--sampled), the others sampled; every "
                   "prompt's first answer comes before any prompt's second.")
@click.option("--sampled", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="Fraction of prompts whose first answer is sampled (the rest greedy).")
@click.option("--max-new-tokens", type=click.IntRange(1), default=192, show_default=True)
@click.option("--batch", type=click.IntRange(1), default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Precision the answers are generated in (bf16: ~3x faster on CPUs with AMX or avx512_bf16; the "
                   "head learns the model's habits, which the precision barely moves).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the target generates (a GPU answers hundreds of prompts a batch).")
@click.option("--seconds", type=click.FloatRange(0, min_open=True), default=None,
              help="Start no new batch after this many seconds (a rerun continues where it stopped).")
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True)
@click.option("--heldout", is_flag=True, help="Write the held-out prompts ({\"prompt\": ...} lines) and stop.")
def main(target: Path | None, out: Path, count: int, answers: int, sampled: float, max_new_tokens: int, batch: int,
         seed: int, dtype: str, device: str, seconds: float | None, threads: int, heldout: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if heldout:
        refuse_to_overwrite_answers(out)
        out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in heldout_prompts()), encoding="utf-8")
        click.echo(f"{out}: {len(heldout_prompts())} held-out prompts")
        return
    if target is None:
        raise click.UsageError("--target is required (the folder that answers the prompts)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device(device)
    torch.set_num_threads(threads)
    items = work_items(training_prompts(count, seed), answers, sampled, seed)
    done = _done(out)
    todo = [item for item in items if item[:2] not in done]
    tokenizer = AutoTokenizer.from_pretrained(target, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers types .to oddly
    deadline = None if seconds is None else time.monotonic() + seconds
    with out.open("a", encoding="utf-8") as sink, tqdm(total=len(items), initial=len(items) - len(todo),
                                                       unit="answer", desc="answering") as bar:
        for start in range(0, len(todo), batch):
            if deadline is not None and time.monotonic() > deadline:
                bar.write(f"--seconds {seconds:g} spent: stopping; rerun to continue")
                break
            for sample in (False, True):  # one batch per decoding mode: generate takes one mode a call
                group = [item for item in todo[start:start + batch] if item[2] == sample]
                if not group:
                    continue
                replies = answer(model, tokenizer, [p for p, _, _ in group], sample, max_new_tokens, seed + start)
                for (prompt, index, _), reply in zip(group, replies, strict=True):
                    record = {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}],
                              "sampled": sample, "answer": index}
                    sink.write(json.dumps(record) + "\n")
                sink.flush()
                bar.update(len(group))


if __name__ == "__main__":
    main()
