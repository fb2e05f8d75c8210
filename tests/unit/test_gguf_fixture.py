"""The real fixture, SmolLM2-135M-Instruct as a Q4_1 GGUF (skipped, saying so, where
scripts/fetch_fixture.sh has not fetched it): every tensor as our loader reads it equals transformers'
fp32 dequantization of the same file, and the engine at the file's own q4_1 follows the fp32 model."""

from __future__ import annotations

import pytest
import torch
from gguf_support import SMOLLM2_DIR, SMOLLM2_GGUF, need_fixture

from cpu_worker.kernels.block_quant import BlockQuantLinear
from cpu_worker.model.gguf_file import GGUFFile
from cpu_worker.model.gguf_loading import NATIVE_TYPES, _row_order, gguf_spec, read_blocks, read_float
from cpu_worker.model.gguf_model import native_precision, our_name
from cpu_worker.model.loading import read_tensors
from cpu_worker.target_loading import load_target_model
from dovetail_runtime.chat_template import ChatTemplate
from dovetail_runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def fixture_files():
    need_fixture()
    return SMOLLM2_GGUF, SMOLLM2_DIR


def test_every_tensor_equals_transformers_dequantization(fixture_files):
    gguf, folder = fixture_files
    reference = read_tensors(folder)
    with GGUFFile(gguf) as file:
        assert native_precision(file) == "q4_1"
        spec = gguf_spec(file)
        for name, info in file.tensors.items():
            ours = our_name(name)
            expected = reference[ours if ours.startswith("lm_head") else f"model.{ours}"]
            order = _row_order(file, spec, name)
            assert torch.equal(read_float(file, info, order), expected), name
            if info.type in NATIVE_TYPES:  # the blocks the kernel gets stand for the same values
                assert torch.equal(read_blocks(file, info, order).dequantize(), expected), name


@torch.inference_mode()
def test_the_q4_1_engine_follows_the_fp32_model(fixture_files):
    gguf, folder = fixture_files
    tokenizer = Tokenizer.from_dir(gguf)
    template = ChatTemplate.from_dir(gguf, tokenizer.special_tokens)
    prompt = template.render([{"role": "user", "content": "Explain why the sky is blue in two sentences."}])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    ours = load_target_model(gguf, "q4_1")  # the file's own blocks; the tied lm_head from its Q8_0 embedding
    assert isinstance(ours.lm_head, BlockQuantLinear) and ours.lm_head.weights.kind == "q8_0"
    from cpu_worker.engine import TargetEngine, greedy_decode

    q4 = TargetEngine(ours, max_len=256)
    fp32 = TargetEngine(load_target_model(folder, "fp32"), max_len=256)
    continuation = greedy_decode(fp32, ids, 32)
    teacher = ids + continuation
    agree = (q4.prefill(teacher).logits.argmax(-1) == fp32.prefill(teacher).logits.argmax(-1)).float().mean()
    assert agree > 0.9, agree
    assert greedy_decode(q4, ids, 8) == continuation[:8]
