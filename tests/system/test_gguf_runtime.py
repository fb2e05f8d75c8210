"""dovetail-run on GGUF targets end to end: the demo target written as a Q4_0 GGUF runs at its own
precision, lossless against --mode ar with the trained head, and gives the folder's tokens at
q4_0; the real fixture with a random head (where scripts/fetch_fixture.sh fetched it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from gguf_support import SMOLLM2_GGUF, need_fixture, tokenizer_metadata, write_gguf

from dovetail_runtime.chat_template import ChatTemplate
from dovetail_runtime.tokenizer import Tokenizer

from conftest import save_random_head, save_tiny_model
from runtime_harness import FIXED_TREE, TEST_PROMPTS, dovetail_run
from tokenizer_folders import sentencepiece_gguf_metadata

NEW_TOKENS = 48
CHATS = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion in one sentence."]


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory, demo_target) -> Path:
    # Q4_0, whose reference quantizer our q4_0 matches bit for bit. (Q8_0's rounds x.5 away from zero,
    # BlockWeights.quantize's q8_0 to even: the demo's fp16 weights hit such ties, so the folder at q8_0
    # holds other blocks than the file.) The output matrix F32: the folder's lm_head is quantized alike.
    return write_gguf(demo_target, tmp_path_factory.mktemp("gguf") / "demo.Q4_0.gguf",
                      {"proj": GGMLQuantizationType.Q4_0}, extra=tokenizer_metadata(demo_target))


def run_json(*args: str) -> list[dict]:
    done = dovetail_run(*args, "--max-new-tokens", str(NEW_TOKENS), "--json", "--log-level", "warning")
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def prompt_file(directory: Path, prompts: list[str]) -> Path:
    path = directory / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": prompt}) for prompt in prompts) + "\n")
    return path


def test_a_gguf_target_is_lossless_and_gives_its_folders_tokens(tmp_path, demo_gguf, demo_target, demo_draft):
    prompts = str(prompt_file(tmp_path, TEST_PROMPTS))
    ours = run_json("--target", str(demo_gguf), "--draft", str(demo_draft), "--compare-ar", "--prompt-file", prompts,
                    *FIXED_TREE)
    # auto: the file's Q4_0 blocks with 16-bit activations, as the folder quantized to q4_0-a16
    folder = run_json("--target", str(demo_target), "--target-dtype", "q4_0-a16", "--mode", "ar", "--prompt-file",
                      prompts)
    assert [line["token_ids"] for line in ours] == [line["token_ids"] for line in folder]
    assert all(line["ar"]["same_tokens"] for line in ours)
    assert sum(line["stats"]["tau"] for line in ours) / len(ours) > 1.5  # the trained head drafts for it


def test_a_sentencepiece_gguf_target_serves_losslessly(tmp_path):
    """A Llama-2-style GGUF (a SentencePiece vocabulary by scores, byte fallback) runs end to end: its
    prompt tokenized and its answer decoded from the file's own vocabulary, dovetail equal to ar."""
    metadata = sentencepiece_gguf_metadata(tmp_path / "vocab")
    folder = save_tiny_model(tmp_path / "hf", "llama", vocab_size=len(metadata["tokenizer.ggml.tokens"]))
    target = write_gguf(folder, tmp_path / "spm.Q4_0.gguf", {"proj": GGMLQuantizationType.Q4_0}, extra=metadata)
    head = save_random_head(tmp_path / "head", target)
    prompt = "The capital of Italy is Rome, and the capital of Spain is"
    [line] = run_json("--target", str(target), "--draft", str(head), "--compare-ar", "--prompt", prompt, *FIXED_TREE)
    tokenizer = Tokenizer.from_dir(target)
    assert line["ar"]["same_tokens"] and line["token_ids"]
    # (Its text is the stream's: a random model's stray byte tokens can rewrite a shown character, which a
    # stream cannot take back, so it is not compared with one decode of all the ids.)
    assert line["text"].strip()
    assert line["stats"]["prompt_tokens"] == len(tokenizer.encode(prompt))


def test_the_fixture_gguf_is_lossless_with_a_head(tmp_path):
    need_fixture()
    head = save_random_head(tmp_path / "head", SMOLLM2_GGUF)
    template = ChatTemplate.from_dir(SMOLLM2_GGUF, Tokenizer.from_dir(SMOLLM2_GGUF).special_tokens)
    chats = [template.render([{"role": "user", "content": text}]) for text in CHATS]
    lines = run_json("--target", str(SMOLLM2_GGUF), "--draft", str(head), "--compare-ar", "--tree-tokens", "8",
                     "--prompt-file", str(prompt_file(tmp_path, chats)))
    assert all(line["ar"]["same_tokens"] for line in lines) and len(lines) == len(CHATS)


def test_dovetail_train_takes_a_gguf_target(tmp_path, demo_gguf):
    """features, train (an EAGLE-3 head: its config comes from the file's metadata) and eval with the
    GGUF as --target; eval checks every output against the target's greedy decode."""
    from click.testing import CliRunner

    from dovetail_runtime.train_cli import main as train_cli

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number, prompt in enumerate(TEST_PROMPTS):
        (corpus / f"{number}.txt").write_text((prompt + "\n    return None\n") * 12)
    steps = [
        ["features", "--target", str(demo_gguf), "--out", str(tmp_path / "features"), "--input", str(corpus),
         "--window", "64", "--aux-layers", "0,1,2", "--threads", "1"],
        ["train", "--target", str(demo_gguf), "--features", str(tmp_path / "features"), "--out", str(tmp_path / "head"),
         "--recipe", "dgf-eagle3", "--draft-vocab", "256", "--ttt-steps", "2", "--batch-size", "4", "--steps", "4",
         "--threads", "1"],
        ["eval", "--target", str(demo_gguf), "--draft", str(tmp_path / "head"), "--input", str(corpus), "--split",
         "all", "--pattern", "*.txt", "--files", "2", "--prompt-tokens", "16", "--new-tokens", "12", "--tree-tokens",
         "8", "--depth", "3", "--tree-top-k", "3", "--json", "--threads", "1"],
    ]
    for args in steps:
        result = CliRunner().invoke(train_cli, args)
        assert result.exit_code == 0, (args[0], result.output)
    assert json.loads((tmp_path / "head" / "config.json").read_text())["target_hidden_size"] > 0
    report = json.loads(result.output[result.output.index("{"):])
    assert report["results"][0]["files"] == 2


def test_the_fixture_in_lookup_mode_gives_ar_tokens_and_copies(tmp_path):
    """--mode lookup on the real chat model: no head; editing prompts whose answers copy the prompt
    take branches, and every answer is ar's."""
    need_fixture()
    template = ChatTemplate.from_dir(SMOLLM2_GGUF, Tokenizer.from_dir(SMOLLM2_GGUF).special_tokens)
    edits = ["Repeat this list exactly, one item per line: apples, bananas, cherries, dates, figs, grapes.",
             "Quote this line back word for word: To be, or not to be, that is the question."]
    chats = [template.render([{"role": "user", "content": text}]) for text in [*edits, CHATS[0]]]
    lines = run_json("--target", str(SMOLLM2_GGUF), "--mode", "lookup", "--lookup-tokens", "8", "--compare-ar",
                     "--prompt-file", str(prompt_file(tmp_path, chats)))
    assert len(lines) == len(chats) and all(line["ar"]["same_tokens"] for line in lines)
    assert sum(line["stats"]["lookup_tokens"] for line in lines[:2]) > 0
