"""Test helpers: tiny HF checkpoints written as GGUF files the way llama.cpp's converter writes one
(``tools.gguf_standin``: its tensor names, its q/k row permutation for Llama, ``gguf``'s writer and
quantizer); and the real fixture's paths."""

from __future__ import annotations

import pytest

from dovetail_runtime.demo_models import FIXTURES, SMOLLM2_DIR, SMOLLM2_GGUF
from tools.gguf_standin import converter_permute, gguf_name, tokenizer_metadata, write_gguf

__all__ = ["FIXTURES", "SMOLLM2_DIR", "SMOLLM2_GGUF", "converter_permute", "gguf_name", "need_fixture",
           "tokenizer_metadata", "write_gguf"]


def need_fixture() -> None:
    """The real-model tests need scripts/fetch_fixture.sh's files (scripts/test.sh, and so CI, fetches
    them first): without them a test fails saying so, never passes by skipping."""
    if not (SMOLLM2_GGUF.is_file() and (SMOLLM2_DIR / "model.safetensors").is_file()):
        pytest.fail(f"the SmolLM2 fixture is not at {FIXTURES}: run bash scripts/fetch_fixture.sh")
