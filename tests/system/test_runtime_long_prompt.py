"""A prompt as long as a 13B model's context, at a 13B model's hidden size, through real processes.

A prefill's hidden states ([prompt, hidden] floats, 82 MB here) travel through the prefill
ring, never inside a message; before that ring existed this prompt killed the cpu_worker. The attention
is narrow (two heads of 64) and the tree fixed: the hidden size is what this test is about, and a full
13B layer's projections over 4,000 tokens, twice, took 40 s of the suite.
"""

from __future__ import annotations

import json
import shutil

import torch

from dovetail_runtime.tokenizer import Tokenizer

from conftest import DEMO_TARGET, save_random_head, save_tiny_model
from runtime_harness import dovetail_run

HIDDEN = 5120
CONTEXT = 4096


def test_4000_token_prompt_at_hidden_5120_equals_ar(tmp_path):
    target = save_tiny_model(
        tmp_path / "wide", "llama", vocab_size=8192, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=CONTEXT,
        tie_word_embeddings=True, torch_dtype=torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_TARGET / name, target / name)
    head = save_random_head(tmp_path / "head", target)
    prompt = "x = 1\n" * 1000
    prompt_tokens = len(Tokenizer.from_dir(target).encode(prompt))
    assert 3900 <= prompt_tokens < CONTEXT - 8, prompt_tokens
    done = dovetail_run("--target", str(target), "--draft", str(head), "--max-len", str(CONTEXT), "--compare-ar",
                        "--tree-tokens", "8", "--depth", "3",
                        "--prompt", prompt, "--max-new-tokens", "4", "--json", "--log-level", "warning",
                        timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout)
    assert "error" not in line, line
    assert len(line["token_ids"]) == 4 and line["ar"]["same_tokens"] is True
