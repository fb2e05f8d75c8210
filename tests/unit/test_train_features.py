"""Feature extraction: corpus formats, loss masks, the held-out split rule, resumability."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoTokenizer

from cpu_worker.target_loading import load_target_model
from dovetail_runtime.train_cli import main as train_cli
from gpu_worker.train.corpus import (
    CorpusError,
    expand_inputs,
    folder_files,
    is_heldout,
    read_corpus_text,
    read_documents,
)
from gpu_worker.train.data import make_batch
from gpu_worker.train.features import cut_windows, extract_features
from gpu_worker.train.shards import MANIFEST, load_features

from test_train_support import make_tiny_target, tiny_corpus, tiny_target  # noqa: F401 (fixtures)

CONVERSATION = {"conversations": [
    {"from": "system", "value": "be brief"},
    {"from": "human", "value": "add two numbers"},
    {"from": "gpt", "value": "def add(a, b): return a + b"},
    {"from": "human", "value": "and three?"},
    {"from": "gpt", "value": "def add3(a, b, c): return a + b + c"},
]}
REPLIES = ["def add(a, b): return a + b", "def add3(a, b, c): return a + b + c"]


class Interrupted(Exception):
    pass


def windows_of(target: Path, files: list[Path], window: int = 40):
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return cut_windows(read_documents(files, tokenizer), window)


def test_heldout_rule_is_sha1_of_the_relative_path(tmp_path):
    names = [f"m{i}.py" for i in range(200)]
    expected = {n for n in names if int(hashlib.sha1(n.encode()).hexdigest(), 16) % 20 == 0}
    assert expected and len(expected) < len(names)  # the sample has both sides
    assert {n for n in names if is_heldout(n)} == expected
    assert is_heldout("pkg/x.py") == (int(hashlib.sha1(b"pkg/x.py").hexdigest(), 16) % 20 == 0)
    root = tmp_path / "lib"
    (root / "sub").mkdir(parents=True)
    for name in names:
        (root / name).write_text("x = 1\n")
        (root / "sub" / name).write_text("y = 2\n")
    (root / "skip").mkdir()
    (root / "skip" / "m0.py").write_text("z = 3\n")
    held = folder_files(root, "*.py", exclude=["skip/*"], split="heldout")
    train = folder_files(root, "*.py", exclude=["skip/*"], split="train")
    # The rule sees paths relative to the folder, never the absolute path.
    assert {p.relative_to(root).as_posix() for p in held} == \
        {n for n in names if is_heldout(n)} | {f"sub/{n}" for n in names if is_heldout(f"sub/{n}")}
    assert len(held) + len(train) == 2 * len(names)
    assert set(expand_inputs([str(root)], "*.py", ["skip/*"], "heldout")) == set(held)


def test_extraction_resumes_to_the_same_result(tmp_path, tiny_target, tiny_corpus):
    files = sorted(tiny_corpus.rglob("*.txt"))
    windows = windows_of(tiny_target, files)
    model = load_target_model(tiny_target).eval()
    config = {"test": 1}
    whole = extract_features(model, windows, tmp_path / "whole", config, shard_tokens=100, progress=False)
    assert len(whole["shards"]) >= 4

    def stop_after_two(index: int) -> None:
        if index == 1:
            raise Interrupted

    with pytest.raises(Interrupted):
        extract_features(model, windows, tmp_path / "resumed", config, shard_tokens=100,
                         on_shard=stop_after_two, progress=False)
    partial = json.loads((tmp_path / "resumed" / MANIFEST).read_text())
    assert not partial["complete"] and [s["index"] for s in partial["shards"]] == [0, 1]
    computed: list[int] = []
    resumed = extract_features(model, windows, tmp_path / "resumed", config, shard_tokens=100,
                               on_shard=computed.append, progress=False)
    assert computed == list(range(2, len(whole["shards"])))  # finished shards were not redone
    assert resumed["shards"] == whole["shards"] and resumed["complete"]
    for entry in whole["shards"]:
        a = load_file(str(tmp_path / "whole" / entry["file"]))
        b = load_file(str(tmp_path / "resumed" / entry["file"]))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    # A rerun of a finished folder computes nothing; other settings are refused.
    again: list[int] = []
    extract_features(model, windows, tmp_path / "resumed", config, shard_tokens=100, on_shard=again.append,
                     progress=False)
    assert again == []
    with pytest.raises(ValueError, match="different settings"):
        extract_features(model, windows, tmp_path / "resumed", {"test": 2}, shard_tokens=100, progress=False)


def test_features_are_the_targets_final_hidden_states(tmp_path, tiny_target, tiny_corpus):
    from transformers import AutoModelForCausalLM

    files = sorted(tiny_corpus.rglob("*.txt"))[:2]
    windows = windows_of(tiny_target, files, window=30)
    model = load_target_model(tiny_target).eval()
    extract_features(model, windows, tmp_path / "f", {}, dtype="fp32", progress=False)
    data = load_features(tmp_path / "f")
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_target)).eval()
    ids, feats, _ = data.window(1)
    with torch.no_grad():
        hidden = reference(ids[None], output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(feats, hidden, rtol=1e-4, atol=1e-4)
    assert data.features.dtype == torch.float32
    assert data.num_tokens == sum(len(w.tokens) for w in windows)


def test_stored_features_are_the_engines_prefill_bit_for_bit(tmp_path, demo_target):
    """Extraction runs on the model box alone (no cpu_worker.engine): its rows equal what the
    target engine's prefill gives each window, bit for bit, windows of every length included."""
    from cpu_worker.engine import TargetEngine
    from gpu_worker.train.features import Window

    model = load_target_model(demo_target).eval()
    generator = torch.Generator().manual_seed(0)
    lengths = [2, 7, 64, 130]
    windows = [Window(torch.randint(0, model.spec.vocab_size, (n,), generator=generator).int().numpy(),
                      torch.ones(n, dtype=torch.bool).numpy()) for n in lengths]
    extract_features(model, windows, tmp_path / "f", {}, dtype="fp32", progress=False)
    data = load_features(tmp_path / "f")
    engine = TargetEngine(model, max_len=max(lengths))
    for index, window in enumerate(windows):
        assert torch.equal(data.window(index)[1], engine.prefill(window.tokens.tolist()).features)


def test_text_files_are_wrapped_and_windowed(tiny_target, tiny_corpus):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))
    path = sorted(tiny_corpus.rglob("*.txt"))[0]
    document = next(read_documents([path], tokenizer))
    text = path.read_text()
    assert document.token_ids[0] == tokenizer.bos_token_id and document.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(document.token_ids, skip_special_tokens=True) == text
    windows = cut_windows([document], 16)
    assert [len(w.tokens) for w in windows[:-1]] == [16] * (len(windows) - 1)
    assert sum(len(w.tokens) for w in windows) == len(document.token_ids)
    capped = cut_windows([document, document], 16, max_tokens=40)
    assert [len(w.tokens) for w in capped] == [16, 16, 8]


class OneTokenTokenizer:
    """Each text is one token; the texts it was given are kept."""

    eos_token_id = 2

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, text: str) -> dict[str, list[int]]:
        self.texts.append(text)
        return {"input_ids": [1]}


@pytest.mark.parametrize("name, content, message", [
    ("cut.json", '[{"text": "abc"}, ', "cut.json: invalid JSON"),
    ("numbers.json", "[1, 2]", "item 1 of the list is not a JSON object"),
    ("string.jsonl", '{"conversations": "hello"}', "string.jsonl:1: conversation is not a list of turn objects"),
    ("strings.jsonl", '{"text": "x"}\n{"messages": ["hi"]}', "strings.jsonl:2: conversation is not a list"),
])
def test_a_malformed_json_corpus_is_a_corpus_error(tmp_path, name, content, message):
    path = tmp_path / name  # each was a traceback (JSONDecodeError, AttributeError) from dovetail-train features
    path.write_text(content)
    with pytest.raises(CorpusError, match=message):
        list(read_documents([path], OneTokenTokenizer()))


def test_jsonl_text_field(tmp_path, tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"body": t, "text": "ignored"}) for t in ["a = 1", "b = 2"]) + "\n")
    documents = list(read_documents([path], tokenizer, text_field="body"))
    assert [tokenizer.decode(d.token_ids, skip_special_tokens=True) for d in documents] == ["a = 1", "b = 2"]
    assert all(all(d.loss_mask) for d in documents)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"other": 1}) + "\n")
    with pytest.raises(ValueError, match="body"):
        list(read_documents([tmp_path / "bad.jsonl"], tokenizer, text_field="body"))


def masked_text(tokenizer, document) -> list[str]:
    """Runs of consecutive masked tokens, decoded."""
    runs, current = [], []
    for token, keep in zip(document.token_ids, document.loss_mask):
        if keep:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


@pytest.mark.parametrize("key", ["conversations", "messages"])
def test_sharegpt_mask_is_assistant_only_plain(tmp_path, tiny_target, key):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))  # no chat template: "role: content" lines
    record = CONVERSATION if key == "conversations" else {"messages": [
        {"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]), "content": t["value"]}
        for t in CONVERSATION["conversations"]]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(record) + "\n")
    document = next(read_documents([path], tokenizer))
    text = tokenizer.decode(document.token_ids, skip_special_tokens=True)
    assert "user: add two numbers\nassistant: def add(a, b)" in text
    assert masked_text(tokenizer, document) == [REPLIES[0] + "\n", REPLIES[1] + "\n</s>"]


def test_sharegpt_mask_with_chat_template(tmp_path):
    target = make_tiny_target(tmp_path / "chat-target", chat_template=True)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(CONVERSATION) + "\n")
    document = next(read_documents([path], tokenizer))
    text = tokenizer.decode(document.token_ids, skip_special_tokens=False)
    assert text.startswith("<|system|>be brief</s><|user|>add two numbers</s><|assistant|>")
    # Replies and their end-of-turn marker are learned; role headers and user turns are not.
    assert masked_text(tokenizer, document) == [REPLIES[0] + "</s>", REPLIES[1] + "</s>"]
    plain = next(read_documents([path], tokenizer, chat_template=False))
    assert masked_text(tokenizer, plain)[0] == REPLIES[0] + "\n"
    # The mask reaches the training weights: pair i counts when x_{i+1} is an assistant token.
    model = load_target_model(target).eval()
    windows = cut_windows([document], 512)
    extract_features(model, windows, tmp_path / "f", {}, progress=False)
    data = load_features(tmp_path / "f")
    batch = make_batch(data, [0])
    assert torch.equal(batch.weight[0].bool(), data.loss_mask[1:])
    assert 0 < int(batch.weight.sum()) < batch.weight.numel()


def test_features_cli_with_split_and_cap(tmp_path, tiny_target, tiny_corpus):
    out = tmp_path / "feat"
    args = ["features", "--target", str(tiny_target), "--out", str(out), "--input", str(tiny_corpus),
            "--window", "32", "--max-tokens", "300", "--shard-tokens", "64", "--threads", "1"]
    result = CliRunner().invoke(train_cli, args)
    assert result.exit_code == 0, result.output
    assert "disk use" in result.output
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and manifest["tokens"] == 300 and manifest["config"]["window"] == 32
    rerun = CliRunner().invoke(train_cli, args)
    assert rerun.exit_code == 0, rerun.output
    held = CliRunner().invoke(train_cli, ["features", "--target", str(tiny_target), "--out", str(tmp_path / "h"),
                                          "--input", str(tiny_corpus), "--split", "heldout", "--threads", "1"])
    heldout_files = [p for p in tiny_corpus.rglob("*.txt") if is_heldout(p.relative_to(tiny_corpus).as_posix())]
    if heldout_files:
        assert held.exit_code == 0, held.output
    else:
        assert held.exit_code != 0 and "no files" in held.output


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32"])
def test_a_corpus_file_with_a_byte_order_mark_is_read_in_its_encoding(tmp_path, encoding):
    text, jsonl = tmp_path / "notes.txt", tmp_path / "data.jsonl"  # Notepad / PowerShell files
    text.write_text("café\r\nline two\n", encoding=encoding)
    jsonl.write_text('{"text": "café"}\n', encoding=encoding)
    tokenizer = OneTokenTokenizer()
    assert len(list(read_documents([text, jsonl], tokenizer))) == 2  # JSONL: was a traceback or "invalid JSON"
    assert tokenizer.texts == ["café\nline two\n", "café"]  # text: was a BOM char first or UTF-16 mojibake


def test_a_json_corpus_that_is_not_utf8_is_a_corpus_error(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin1.jsonl: not UTF-8 text \(byte 0xe9 at offset 13\)"):
        list(read_documents([path], OneTokenTokenizer()))  # was a UnicodeDecodeError traceback
    assert read_corpus_text(path, strict=False) == '{"text": "caf\ufffd"}\n'  # plain text replaces, as before


class RewritingTemplateTokenizer(OneTokenTokenizer):
    """A chat template that trims replies and heads the chat with its turn count: no rendered prefix
    is a prefix of the whole, and a reply with surrounding spaces is not in it as written."""

    chat_template = "rewrites"

    def apply_chat_template(self, turns, tokenize: bool = False, add_generation_prompt: bool = False) -> str:
        return f"{len(turns)} turns\n" + "".join(f"{t['role']}: {t['content'].strip()}\n" for t in turns)


def test_a_reply_the_chat_template_rewrites_is_a_corpus_error(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "  hello  "}]}) + "\n")
    with pytest.raises(CorpusError, match="chat.jsonl:1: cannot locate an assistant reply"):
        list(read_documents([path], RewritingTemplateTokenizer()))  # was a ValueError traceback


def test_a_missing_or_damaged_shard_is_named_with_its_remedy(tmp_path):
    from gpu_worker.train.shards import shard_name, write_shard

    entries = []
    for index in range(2):
        write_shard(tmp_path / shard_name(index), np.arange(8), torch.zeros(8, 4), np.ones(8, dtype=bool),
                    np.array([0, 8]))
        entries.append({"index": index, "file": shard_name(index), "windows": 1, "tokens": 8})
    (tmp_path / MANIFEST).write_text(json.dumps({"complete": True, "shards": entries, "config": {}}))
    assert load_features(tmp_path).num_tokens == 16
    damaged = tmp_path / shard_name(1)
    damaged.write_bytes(damaged.read_bytes()[:100])  # was safetensors' "incomplete metadata" traceback
    with pytest.raises(ValueError, match=r"shard-00001.safetensors cannot be read .* rerun the `dovetail-train"):
        load_features(tmp_path)
    damaged.unlink()  # was a FileNotFoundError traceback
    with pytest.raises(ValueError, match=r"shard-00001.safetensors cannot be read .*missing shards are redone"):
        load_features(tmp_path)
