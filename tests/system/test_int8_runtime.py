"""Integer and bf16 targets through the whole runtime (dovetail-run processes): dovetail gives exactly
--mode ar's tokens at int8 (with an fp32 or a bf16 KV cache), in the block formats and at bf16 (the
in-process checks are in tests/unit/test_int8.py, tests/unit/test_block_quant.py and
tests/unit/test_bf16_rows.py)."""

from __future__ import annotations

import json

import pytest
from test_runtime_e2e import CODE_PROMPTS

from runtime_harness import FIXED_TREE, dovetail_run


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_int8_target_through_the_runtime_equals_ar(tmp_path, demo_target, demo_draft, kv_dtype):
    prompt_file = tmp_path / "code.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CODE_PROMPTS))
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_draft), "--target-dtype", "int8-row",
                        "--kv-dtype", kv_dtype, "--compare-ar", "--json", "--prompt-file", str(prompt_file),
                        "--max-new-tokens", "64", "--max-len", "2048", "--log-level", "info", *FIXED_TREE)
    assert done.returncode == 0, done.stderr[-3000:]
    # The cache reported at startup: 6 layers x (K, V) x 2048 slots x 4 heads x 64, at 4 or 2 bytes.
    name, size = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2)}[kv_dtype]
    assert f"KV cache {name} {6 * 2 * 2048 * 256 * size / 1e9:.2f} GB" in done.stderr, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == len(CODE_PROMPTS)
    for line in lines:
        assert line["ar"]["same_tokens"], f"int8 dovetail differs from int8 ar for {line['prompt']!r}"
        assert line["stats"]["tau"] > 1.5


@pytest.mark.parametrize("precision", ["int8", "q4_0", "q8_0"])
def test_block_targets_through_the_runtime_equal_ar(tmp_path, demo_target, demo_draft, precision):
    prompt_file = tmp_path / "code.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CODE_PROMPTS[:2]))
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_draft), "--target-dtype", precision,
                        "--compare-ar", "--json", "--prompt-file", str(prompt_file), "--max-new-tokens", "48",
                        "--log-level", "info", *FIXED_TREE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"target: {precision} (dovetail-blocks-" in done.stderr and "trees verified bit-exact" in done.stderr
    for line in map(json.loads, done.stdout.splitlines()):
        assert line["ar"]["same_tokens"], f"{precision} dovetail differs from {precision} ar for {line['prompt']!r}"
        assert line["stats"]["tau"] > 1.5


def test_a_bf16_target_through_the_runtime_equals_ar(tmp_path, demo_target, demo_draft):
    """bf16 weights on the row kernel: trees verified bit-exact, a bf16 KV cache by default."""
    prompt_file = tmp_path / "code.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CODE_PROMPTS[:2]))
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_draft), "--target-dtype", "bf16",
                        "--compare-ar", "--json", "--prompt-file", str(prompt_file), "--max-new-tokens", "48",
                        "--log-level", "info", *FIXED_TREE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "target: bf16 (dovetail-bf16)" in done.stderr and "trees verified bit-exact" in done.stderr
    assert "KV cache bfloat16" in done.stderr
    for line in map(json.loads, done.stdout.splitlines()):
        assert line["ar"]["same_tokens"], f"bf16 dovetail differs from bf16 ar for {line['prompt']!r}"
        assert line["stats"]["tau"] > 1.5


def test_a_q4_0_draft_through_the_runtime_equals_ar(tmp_path, demo_target, demo_draft):
    """A CPU draft in 4-bit blocks (--draft-dtype q4_0) only proposes: the tokens stay the target's."""
    prompt_file = tmp_path / "code.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CODE_PROMPTS[:2]))
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_draft), "--target-dtype", "q4_0",
                        "--draft-device", "cpu", "--draft-dtype", "q4_0", "--compare-ar", "--json", "--prompt-file",
                        str(prompt_file), "--max-new-tokens", "48", "--log-level", "info", *FIXED_TREE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'dtype': 'q4_0'" in done.stderr.split("gpu_worker ready", 1)[1].splitlines()[0], done.stderr[-3000:]
    for line in map(json.loads, done.stdout.splitlines()):
        assert line["ar"]["same_tokens"], f"dovetail with a q4_0 draft differs from ar for {line['prompt']!r}"
        assert line["stats"]["tau"] > 1.5
