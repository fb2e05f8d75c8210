"""Checkpoint formats, load errors, precision modes and CPU placement of the target engine."""

from __future__ import annotations

import json
import multiprocessing
import os
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

from cpu_worker.engine import TargetEngine, greedy_decode
from cpu_worker.model import ModelLoadError
from cpu_worker.precision import apply_precision
from cpu_worker.target_loading import load_target_model
from ipc.placement import CoreSpecError, parse_core_list

from conftest import TINY_FAMILIES, save_tiny_model


@pytest.mark.parametrize("weight_format", ["sharded", "bin"])
def test_other_weight_formats_load_the_same_weights(tmp_path, weight_format):
    single = save_tiny_model(tmp_path / "single", "llama", seed=5)
    other = save_tiny_model(tmp_path / weight_format, "llama", seed=5, weight_format=weight_format)
    if weight_format == "sharded":
        assert (other / "model.safetensors.index.json").exists()
    expected = load_target_model(single).state_dict()
    got = load_target_model(other).state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_unknown_model_type_names_what_was_found(tmp_path):
    path = save_tiny_model(tmp_path / "m", "llama")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_target_model(path)


@pytest.mark.parametrize("edit, message", [
    ({"hidden_size": "256"}, "expected int, got str"),  # transformers' StrictDataclass error: was a traceback
    ({"num_attention_heads": 0}, "integer modulo by zero"),  # a ZeroDivisionError traceback
    ({"num_hidden_layers": -1}, "num_hidden_layers -1; each must be a positive integer"),  # failed in the load
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
])
def test_a_config_with_impossible_sizes_is_a_load_error(tmp_path, edit, message):
    path = save_tiny_model(tmp_path / "m", "llama", num_attention_heads=4, num_key_value_heads=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | edit))
    with pytest.raises(ModelLoadError, match=message):
        load_target_model(path)
    (path / "config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match="is not a JSON object"):  # was an AttributeError on list.get
        load_target_model(path)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_weights_the_config_does_not_describe_are_a_load_error(tmp_path, precision):
    path = save_tiny_model(tmp_path / "m", "llama")
    config = json.loads((path / "config.json").read_text())
    hidden = config.pop("hidden_size")  # transformers' default (4096) stands in: the model loaded anyway
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"has shape \(.*{hidden}\), but the config implies \(.*4096\)"):
        load_target_model(path, precision)


def test_a_corrupt_index_or_bin_checkpoint_is_a_load_error(tmp_path):
    path = save_tiny_model(tmp_path / "m", "llama")
    (path / "model.safetensors.index.json").write_text('{"weight_map": ')  # was a JSONDecodeError traceback
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json is not a shard index"):
        load_target_model(path)
    (path / "model.safetensors.index.json").unlink()
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not a checkpoint" * 8)  # was torch's UnpicklingError traceback
    with pytest.raises(ModelLoadError, match="pytorch_model.bin cannot be read as a PyTorch checkpoint"):
        load_target_model(path)


def test_folder_without_weights_lists_its_files(tmp_path):
    path = save_tiny_model(tmp_path / "m", "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights.*config.json"):
        load_target_model(path)


@pytest.mark.parametrize("damage, message", [
    (lambda data: struct.pack("<Q", 10**12) + data[8:], "its header would be 1,000,000,000,000 bytes"),
    (lambda data: data[:5], "5 bytes, too short for a header"),
    (lambda data: data[:8] + b"\xff" + data[9:], "its header is not JSON"),
])
def test_a_corrupt_safetensors_header_is_a_load_error(tmp_path, damage, message):
    path = save_tiny_model(tmp_path / "m", "llama")
    weights = path / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))  # was a MemoryError / struct.error / JSON traceback
    with pytest.raises(ModelLoadError, match=f"model.safetensors is not a valid safetensors file: {message}"):
        load_target_model(path)


def test_a_folder_holding_a_gguf_file_names_it(tmp_path):
    (tmp_path / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF")  # a download folder given instead of its file
    with pytest.raises(ModelLoadError, match="has no config.json; it holds SmolLM2.Q4_1.gguf: give the .gguf file"):
        load_target_model(tmp_path)  # was "has no config.json" alone


def test_missing_folder_and_missing_hub_id_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_target_model(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="local Hugging Face cache"):
        load_target_model("no-such-org/no-such-model")


def test_unimplemented_rope_scaling_is_refused(tmp_path):
    path = save_tiny_model(tmp_path / "m", "llama")
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    config.pop("rope_parameters", None)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="dynamic"):
        load_target_model(path)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tmp_path / "m", "llama")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.1.mlp.up_proj.weight"):
        load_target_model(path)


@pytest.mark.parametrize("dtype", ["bf16", "int8-row"])
def test_reduced_precision_runs_and_mostly_agrees(demo_target, dtype):
    prompt = [1, 802, 527, 380, 317, 279]
    reference = greedy_decode(TargetEngine(load_target_model(demo_target), max_len=128), prompt, 32)
    model, activation_dtype = apply_precision(load_target_model(demo_target), dtype)
    engine = TargetEngine(model, max_len=128, activation_dtype=activation_dtype)
    got = greedy_decode(engine, prompt, 32)
    assert len(got) == 32 and all(0 <= token < engine.spec.vocab_size for token in got)
    # Reduced precision may drift later on; the first tokens must still be the model's.
    assert got[:4] == reference[:4]
    agreement = sum(a == b for a, b in zip(got, reference)) / len(reference)
    print(f"{dtype}: greedy agreement with fp32 over 32 tokens: {agreement:.2f}")


def test_unknown_dtype_is_refused(tiny_models):
    with pytest.raises(ValueError, match="fp32, bf16, int8"):
        apply_precision(load_target_model(tiny_models["llama-mha"]), "fp16")


def test_parse_core_list():
    assert parse_core_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_core_list("2,1,2") == [1, 2]
    for bad in ["", "a", "3-1", "1,,2", "-1"]:
        with pytest.raises(CoreSpecError):
            parse_core_list(bad)


def _placement_child(queue) -> None:
    from ipc.placement import apply_placement, read_placement

    placement = apply_placement(threads=2, cores=[0])
    torch.randn(256, 256) @ torch.randn(256, 256)  # let any pool threads appear
    after = read_placement()
    queue.put((placement.cores, after.cores, after.intra_op_threads, after.thread_count))


def test_placement_confines_every_thread(tmp_path):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_placement_child, args=(queue,))
    child.start()
    cores, after_cores, threads, thread_count = queue.get(timeout=60)
    child.join(timeout=30)
    assert cores == [0] and after_cores == [0]
    assert threads == 2 and thread_count >= 1
    with pytest.raises(CoreSpecError, match="not available"):
        from ipc.placement import apply_placement

        apply_placement(threads=None, cores=[os.cpu_count() + 100])


def test_a_containers_cpu_quota_caps_the_default_threads(tmp_path, monkeypatch):
    """docker --cpus 2 on a many-core host: torch took one thread per core in each worker, all
    sharing 2 CPUs' time (the same slowdown as --cpu-threads past --cpu-cores)."""
    from ipc import placement

    for name, text in (("cpu.max", "150000 100000\n"), ("cpu.max", "max 100000\n"),
                       ("cpu/cpu.cfs_quota_us", "50000\n"), ("cpu/cpu.cfs_quota_us", "-1\n")):
        root = tmp_path / f"{len(list(tmp_path.iterdir()))}"
        (root / name).parent.mkdir(parents=True)
        (root / name).write_text(text)
        (root / "cpu").mkdir(exist_ok=True)
        (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
        assert placement.cpu_quota(root) == {"150000": 2, "50000": 1}.get(text.split()[0]), text
    assert placement.cpu_quota(tmp_path / "none") is None
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(placement, "cpu_quota", lambda: 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert placement.apply_placement(threads=None, cores=None).intra_op_threads == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own count stands
        torch.set_num_threads(2)
        assert placement.apply_placement(threads=None, cores=None).intra_op_threads == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("family", ["llama-gqa-tied", "qwen2"])
@pytest.mark.parametrize("precision", ["bf16", "int8-row"])
def test_loading_converts_tensor_by_tensor_to_the_same_model(tmp_path, family, precision):
    """Converting each tensor as it is read (what keeps a 13 GB folder's load small) builds
    exactly the model that converting a whole fp32 model builds; fp16 shards, tied heads and
    qkv biases included."""
    path = save_tiny_model(tmp_path / family, weight_format="sharded", **TINY_FAMILIES[family])
    streamed, streamed_logits, converted_logits = streamed_and_converted(path, precision)
    assert torch.equal(streamed_logits, converted_logits)
    assert not any(p.is_meta for p in streamed.parameters())


def streamed_and_converted(path: Path, precision: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model loaded at ``precision`` tensor by tensor, and a prefill's and a decode's logits from it
    and from the whole fp32 model converted (``apply_precision``)."""
    streamed = load_target_model(path, precision)
    converted, dtype = apply_precision(load_target_model(path), precision)
    tokens = [3, 14, 15, 92, 65, 35]
    outputs = []
    for model in (streamed, converted):
        engine = TargetEngine(model, max_len=16, activation_dtype=dtype)
        outputs.append(torch.stack([engine.prefill(tokens).logits, engine.decode(7).logits]))
    return streamed, outputs[0], outputs[1]


@pytest.mark.parametrize("precision", ["bf16", "int8-row", "int8"])
def test_a_bias_stored_after_its_weight_is_kept(tmp_path, precision):
    """A pytorch_model.bin stores a layer's weight before its bias, and our layers keep the bias where
    their kernels read it: the streamed model's unfused o_proj and down_proj keep theirs, as
    converting the whole fp32 model does (on the C loop where a call takes it, else the Python layers)."""
    path = save_tiny_model(tmp_path / "bin", "llama", weight_format="bin", attention_bias=True, mlp_bias=True)
    streamed, streamed_logits, converted_logits = streamed_and_converted(path, precision)
    assert streamed.layers[0].self_attn.o_proj.bias is not None
    assert torch.equal(streamed_logits, converted_logits)


def test_the_loaders_skeleton_runs_no_embedding_init(tmp_path, monkeypatch):
    """The decoder the loaders fill is built on the meta device without nn.Embedding's normal_ init
    (which on meta tensors first imports torch._dynamo: 2.1 s of a process's first load), and still
    loads its checkpoint's weights."""
    folder = save_tiny_model(tmp_path / "tiny", "llama", seed=4)
    expected = load_target_model(folder, "fp32").embed_tokens.weight.clone()

    def refuse(*_args, **_kwargs):
        raise AssertionError("an init ran on the loaders' skeleton")

    monkeypatch.setattr(torch.nn.init, "normal_", refuse)
    assert torch.equal(load_target_model(folder, "fp32").embed_tokens.weight, expected)
