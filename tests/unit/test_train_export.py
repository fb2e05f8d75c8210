"""Small shippable copies: an fp16 target and an fp16 head without its frozen tensors."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from safetensors import safe_open

from cpu_worker.engine import TargetEngine
from cpu_worker.target_loading import load_target_model
from dovetail_runtime.train_cli import main as train_cli
from gpu_worker.checkpoint import load_head

from conftest import save_random_head
from test_train_support import tiny_target  # noqa: F401 (fixture)


def test_fp16_target_and_head_load_and_agree(tmp_path, tiny_target):
    result = CliRunner().invoke(train_cli, ["export", "--target", str(tiny_target), "--out", str(tmp_path / "t16")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "t16" / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "float16"
    assert (tmp_path / "t16" / "tokenizer.json").exists()
    with safe_open(str(tmp_path / "t16" / "model.safetensors"), "pt") as handle:
        assert all(handle.get_tensor(k).dtype == torch.float16 for k in handle.keys())  # noqa: SIM118 - safe_open is not iterable
    full = TargetEngine(load_target_model(tiny_target).eval(), max_len=32)
    small = TargetEngine(load_target_model(tmp_path / "t16").eval(), max_len=32)
    prompt = [1, 40, 41, 42, 43, 44]
    torch.testing.assert_close(small.prefill(prompt).logits, full.prefill(prompt).logits, rtol=0, atol=2e-2)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "t16")) is not None

    head_dir = save_random_head(tmp_path / "h32", tiny_target, layers=2, fusion="fc")
    result = CliRunner().invoke(train_cli, ["export", "--target", str(tiny_target), "--draft", str(head_dir),
                                            "--out", str(tmp_path / "h16")])
    assert result.exit_code == 0, result.output
    with safe_open(str(tmp_path / "h16" / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
        assert all(handle.get_tensor(k).dtype == torch.float16 for k in keys)
    assert "lm_head.weight" not in keys and "embed_tokens.weight" not in keys
    head = load_head(tmp_path / "h16", tmp_path / "t16")
    reference = load_head(head_dir, tiny_target)
    for name, tensor in head.state_dict().items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, reference.state_dict()[name], rtol=1e-3, atol=1e-3)
