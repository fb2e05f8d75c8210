"""GGUF targets: our parser against the gguf package's reader, a tiny model's GGUF against its HF folder
(same logits at the same precision), the blocks taken as stored, and the q/k permutation undone."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from gguf_support import converter_permute, write_gguf

from cpu_worker.engine import TargetEngine
from cpu_worker.kernels.block_quant import BlockQuantLinear, BlockWeights
from cpu_worker.model.gguf_file import GGUFError, GGUFFile
from cpu_worker.model.gguf_loading import block_kind, read_blocks, read_float, unpermute_rows
from cpu_worker.model.gguf_model import native_precision
from cpu_worker.model.model_dir import read_config, resolve_model_dir
from cpu_worker.target_loading import load_target_model
from dovetail_runtime.coordinator import target_precision

from conftest import save_tiny_model

Q = GGMLQuantizationType
PROMPT = [3, 17, 42, 5, 88, 60, 2, 9, 31]


def logits(model, tokens=PROMPT) -> torch.Tensor:
    return TargetEngine(model, max_len=64).prefill(tokens).logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """HF folders of three shapes: Llama MHA, Llama GQA with a tied embedding, Qwen2 (q/k/v biases)."""
    root = tmp_path_factory.mktemp("gguf-tiny")
    return {"llama": save_tiny_model(root / "llama", "llama", seed=1),
            "gqa-tied": save_tiny_model(root / "gqa", "llama", seed=2, num_key_value_heads=2, tie_word_embeddings=True),
            "qwen2": save_tiny_model(root / "qwen2", "qwen2", seed=3, num_key_value_heads=2)}


def test_unpermute_rows_inverts_the_converters_permutation():
    rows = np.arange(4 * 8 * 3).reshape(4 * 8, 3)
    for heads in (1, 2, 4):
        assert np.array_equal(converter_permute(rows, heads)[unpermute_rows(32, heads)], rows)


def test_our_parser_reads_what_the_reference_reader_reads(tiny, tmp_path):
    path = write_gguf(tiny["gqa-tied"], tmp_path / "m.gguf", {"proj": Q.Q4_0, "embd": Q.Q8_0},
                      extra={"tokenizer.ggml.tokens": ["a", "b", "ç"], "tokenizer.chat_template": "{{ x }}"})
    reference = GGUFReader(path)
    with GGUFFile(path) as ours:
        assert set(ours.metadata) == set(reference.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
        for key, value in ours.metadata.items():
            expected = reference.fields[key].contents()
            assert (value.tolist() if isinstance(value, np.ndarray) else value) == pytest.approx(expected), key
        assert list(ours.tensors) == [tensor.name for tensor in reference.tensors]
        for tensor in reference.tensors:
            info = ours.tensors[tensor.name]
            assert (info.type, info.dims, info.nbytes) == (tensor.tensor_type, tuple(map(int, tensor.shape)),
                                                           tensor.n_bytes)
            assert np.array_equal(ours.data(tensor.name).reshape(-1), tensor.data.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("name", ["llama", "gqa-tied", "qwen2"])
def test_a_float_gguf_gives_its_folders_logits(tiny, tmp_path, name):
    path = write_gguf(tiny[name], tmp_path / "m.gguf")
    assert torch.equal(logits(load_target_model(path, "fp32")), logits(load_target_model(tiny[name], "fp32")))


@pytest.mark.parametrize("precision, stored", [("q8_0", Q.Q8_0), ("q4_0", Q.Q4_0), ("q4_1", Q.Q4_1)])
@pytest.mark.parametrize("name", ["llama", "gqa-tied", "qwen2"])
def test_a_block_gguf_gives_its_folders_logits_at_that_precision(tiny, tmp_path, name, precision, stored):
    """The reference quantizer (gguf.quants) wrote the file; our loader quantizes the folder the same
    way, so the same blocks reach the kernel: equal logits. The output matrix is Q8_0 in the file, as
    the folder's lm_head is at every block precision; the embedding F32 as the folder's."""
    path = write_gguf(tiny[name], tmp_path / "m.gguf", {"proj": stored, "output": Q.Q8_0})
    with GGUFFile(path) as file:
        assert native_precision(file) == precision
    ours = load_target_model(path, precision)
    assert isinstance(ours.lm_head, BlockQuantLinear)
    assert torch.equal(logits(ours), logits(load_target_model(tiny[name], precision)))
    # --target-dtype auto: the file's blocks with 16-bit activations (int8 is Q8_0's x 16 bits), the same
    # blocks as the folder's at that precision.
    wide = target_precision(path)
    assert wide == {"q8_0": "int8", "q4_0": "q4_0-a16", "q4_1": "q4_1-a16"}[precision]
    assert torch.equal(logits(load_target_model(path, wide)), logits(load_target_model(tiny[name], wide)))


def test_auto_without_a_c_compiler_takes_int8_row_not_the_files_blocks(tiny, tmp_path, monkeypatch, caplog):
    """A GGUF at --target-dtype auto took its own blocks, which run on the native kernels only: on a
    machine without a C compiler the worker failed to start ('block-quantized weights need the native
    kernel library'), the default demo included."""
    from dovetail_runtime import coordinator as coordinator_module

    path = write_gguf(tiny["llama"], tmp_path / "m.gguf", {"proj": Q.Q4_1, "output": Q.Q8_0})
    caplog.set_level(logging.INFO, logger="dovetail_runtime.coordinator")

    def settled(compiler: str | None) -> str:
        monkeypatch.setenv("CC", compiler or "")
        monkeypatch.setenv("PATH", str(tmp_path / "no-compilers-here"))  # so no cc or gcc either
        coordinator = coordinator_module.Coordinator(coordinator_module.RuntimeSettings(target=str(path), draft=None,
                                                                                  target_dtype="auto"))
        coordinator._settle_precision(path, read_config(path))
        return coordinator.settings.target_dtype

    assert settled("cc") == "q4_1-a16"
    assert settled(None) == "int8-row" and "no C compiler is found to build its kernels (q4_1-a16)" in caplog.text
    warned = [record.message for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warned) == 1 and "keeps far less of a real model's quality" in warned[0]  # said, not only logged at info


def test_blocks_go_in_as_stored_and_equal_the_reference_dequantizer(tiny, tmp_path):
    path = write_gguf(tiny["llama"], tmp_path / "m.gguf", {"proj": Q.Q4_1, "embd": Q.Q8_0})
    with GGUFFile(path) as file:
        for name in ("blk.0.attn_v.weight", "token_embd.weight"):
            info = file.tensors[name]
            weights = read_blocks(file, info)
            assert weights.kind == {Q.Q4_1: "q4_1", Q.Q8_0: "q8_0"}[info.type]
            expected = dequantize(file.data(name), info.type).reshape(info.shape)
            assert torch.equal(weights.dequantize(), torch.from_numpy(expected))
            assert torch.equal(read_float(file, info), torch.from_numpy(expected))
        # attn_q's rows come back in HF's order: the folder's weight, quantized by the file's quantizer.
        info = file.tensors["blk.0.attn_q.weight"]
        folder_q = load_target_model(tiny["llama"], "fp32").layers[0].self_attn.q_proj.weight
        assert torch.equal(read_blocks(file, info, unpermute_rows(64, 4)).dequantize(),
                           BlockWeights.quantize(folder_q, "q4_1").dequantize())


def test_which_block_type_a_weight_runs_at():
    assert block_kind("q4_1", Q.Q4_1) == "q4_1"  # as stored
    assert block_kind("q8_0", Q.Q4_1) == "q4_1"  # never widened into an approximation of itself
    assert block_kind("q4_0", Q.Q8_0) == "q4_0"  # narrower when asked
    assert block_kind("q8_0", Q.Q6_K) == "q8_0" and block_kind("q8_0", Q.Q4_K) == "q4_1"
    assert block_kind("q4_0", Q.F16) == "q4_0"


def test_other_types_are_requantized_with_one_log_line(tiny, tmp_path, caplog):
    """Q5_0 (the reference quantizer writes it) runs as q8_0, its nearest native type; the log says so once."""
    path = write_gguf(tiny["llama"], tmp_path / "m.gguf", {"proj": Q.Q5_0, "output": Q.Q8_0})
    with GGUFFile(path) as file:
        assert native_precision(file) == "q8_0"
        info = file.tensors["blk.1.ffn_down.weight"]
        expected = BlockWeights.quantize(read_float(file, info), "q8_0")
    with caplog.at_level(logging.INFO, logger="cpu_worker.model.gguf_loading"):
        model = load_target_model(path, "q8_0")
    lines = [record.getMessage() for record in caplog.records if "requantized" in record.getMessage()]
    assert len(lines) == 1 and "14 Q5_0 -> q8_0" in lines[0]
    assert torch.equal(model.layers[1].mlp.down_proj.weights.data, expected.data)


def test_a_gguf_is_a_target_with_a_config(tiny, tmp_path):
    path = write_gguf(tiny["gqa-tied"], tmp_path / "m.gguf")
    assert resolve_model_dir(path) == path
    config = read_config(path)
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"],
            config["tie_word_embeddings"], config["model_type"]) == (64, 2, 2, True, "llama")


def test_an_unsupported_architecture_is_named(tiny, tmp_path):
    path = write_gguf(tiny["llama"], tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    at = data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8
    data[at:at + 5] = b"gemma"
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="architecture 'gemma' is not supported"):
        load_target_model(path, "fp32")
