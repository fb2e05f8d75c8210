"""tools.gguf_standin: a model folder written as a GGUF file from the command line."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from cpu_worker.engine import TargetEngine
from cpu_worker.model.gguf_file import GGUFFile
from cpu_worker.target_loading import load_target_model
from dovetail_runtime.tokenizer import Tokenizer
from tools.gguf_standin import main

from conftest import DEMO_TARGET

PROMPT = [3, 17, 42, 5, 88, 60, 2, 9, 31]


def logits(path) -> torch.Tensor:
    return TargetEngine(load_target_model(path, "fp32"), max_len=64).prefill(PROMPT).logits


def test_a_float_file_with_its_tokenizer_decodes_as_its_folder(tmp_path):
    out = tmp_path / "demo.gguf"
    assert main([str(DEMO_TARGET), str(out), "--proj", "f32", "--embd", "f32", "--output", "f32", "--tokenizer"]) == 0
    with GGUFFile(out) as file:
        assert {info.type for info in file.tensors.values()} == {GGMLQuantizationType.F32}
        assert "tokenizer.ggml.tokens" in file.metadata
    assert torch.equal(logits(out), logits(DEMO_TARGET))  # q/k rows permuted as llama.cpp's, and back
    text = "def walk(path):\n    return os.listdir(path)"
    assert Tokenizer.from_dir(out).encode(text) == Tokenizer.from_dir(DEMO_TARGET).encode(text)


def test_types_by_role(tmp_path):
    out = tmp_path / "demo.gguf"
    main([str(DEMO_TARGET), str(out), "--proj", "q4_1", "--embd", "q8_0"])
    with GGUFFile(out) as file:
        kinds = {name: info.type for name, info in file.tensors.items()}
        assert "tokenizer.ggml.tokens" not in file.metadata
    assert kinds["token_embd.weight"] == GGMLQuantizationType.Q8_0
    assert kinds["blk.0.ffn_down.weight"] == GGMLQuantizationType.Q4_1
    assert kinds["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32


@pytest.mark.parametrize("args, message", [
    (["--proj", "q9_9"], "unknown GGUF type"),
    (["--proj", "q5_k"], "the gguf package cannot write it"),  # was a NotImplementedError after reading the model
    (["--embd", "iq2_xxs"], "the gguf package cannot write it"),
    ([], "exists"),
])
def test_bad_arguments_are_refused(tmp_path, capsys, args, message):
    out = tmp_path / "taken.gguf"
    out.write_bytes(b"")
    with pytest.raises(SystemExit):
        main([str(DEMO_TARGET), str(out), *args])
    assert message in capsys.readouterr().err
    assert out.read_bytes() == b""  # an existing file is never overwritten


def test_a_folder_without_a_config_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path), str(tmp_path / "out.gguf")])
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "out.gguf").exists()


def test_an_output_in_a_missing_folder_is_refused(tmp_path, capsys):
    """It read the checkpoint, then died in a FileNotFoundError traceback."""
    with pytest.raises(SystemExit):
        main([str(DEMO_TARGET), str(tmp_path / "nowhere" / "out.gguf")])
    assert f"{tmp_path / 'nowhere'} is not a folder" in capsys.readouterr().err


def test_bench_real_writes_a_targets_gguf_once_and_reuses_it(tmp_path):
    """bench_real --gguf: the inflated folder written as a GGUF beside it (via a partial file), then
    reused as it is; it carries the folder's tokenizer."""
    import shutil

    from tools.bench_real import gguf_target

    folder = shutil.copytree(DEMO_TARGET, tmp_path / "target-demo")
    path = gguf_target(folder, "q8_0")
    assert path == tmp_path / "target-demo.q8_0.gguf" and path.is_file()
    assert not (tmp_path / "target-demo.q8_0.gguf.partial").exists()
    with GGUFFile(path) as file:
        assert file.tensors["blk.0.ffn_up.weight"].type == GGMLQuantizationType.Q8_0
        assert file.tensors["token_embd.weight"].type == GGMLQuantizationType.Q8_0
    made = path.stat().st_mtime_ns
    assert gguf_target(folder, "q8_0") == path and path.stat().st_mtime_ns == made
    text = "import os"
    assert Tokenizer.from_dir(path).encode(text) == Tokenizer.from_dir(folder).encode(text)
