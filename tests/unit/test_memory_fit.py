"""A target's memory estimated from its config (``memory_fit``): the sums match what the loaders
hold, --target-dtype auto steps down from fp32 where a model would take most of the machine, the
coordinator warns with the precisions that would fit, and refuses one that could never load."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from gguf_support import SMOLLM2_DIR, SMOLLM2_GGUF, need_fixture

from cpu_worker.model.model_dir import read_config
from cpu_worker.target_loading import load_target_model, weight_bytes
from dovetail_runtime import memory_fit
from dovetail_runtime.coordinator import Coordinator, RuntimeSettings
from dovetail_runtime.memory_fit import TargetSize, auto_precision, gguf_need_bytes, shortfall
from ipc.dtypes import TARGET_PRECISIONS

DEMO_TARGET = Path(__file__).resolve().parents[2] / "demo" / "target-code-9m"
GB = 10 ** 9
# A Llama-2-7B's config.json (the keys the estimate reads).
LLAMA2_7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": False,
             "torch_dtype": "float16"}


def test_every_precision_has_a_size():
    assert set(TARGET_PRECISIONS) <= set(memory_fit.BYTES_PER_WEIGHT)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "q4_0", "q4_1", "int8-row"])
def test_the_estimate_is_what_the_loader_holds(precision):
    """The demo target (untied output matrix), every kind of precision: within 1% (norms and
    int8-row's scales are left out)."""
    size = TargetSize.from_config(read_config(DEMO_TARGET))
    held = weight_bytes(load_target_model(DEMO_TARGET, precision))
    assert size.weight_bytes(precision) == pytest.approx(held, rel=0.01)


def test_the_estimate_holds_for_a_tied_real_model_and_its_gguf():
    """SmolLM2-135M: tied embeddings (one table at fp32, a q8_0 output copy at int8), grouped-query
    heads; its Q4_1 GGUF loads its blocks as stored."""
    need_fixture()
    size = TargetSize.from_config(read_config(SMOLLM2_DIR))
    for precision in ("fp32", "int8"):
        held = weight_bytes(load_target_model(SMOLLM2_DIR, precision))
        assert size.weight_bytes(precision) == pytest.approx(held, rel=0.01)
    held = weight_bytes(load_target_model(SMOLLM2_GGUF, "q4_1-a16"))
    estimate = gguf_need_bytes(SMOLLM2_GGUF, size, "q4_1-a16") - memory_fit.PROCESS_BYTES
    assert estimate == pytest.approx(held, rel=0.02)
    # Run at fp32 a GGUF is dequantized: a folder's sums.
    assert gguf_need_bytes(SMOLLM2_GGUF, size, "fp32") == size.need_bytes("fp32")


def test_auto_takes_the_most_precise_that_fits_the_machine():
    size = TargetSize.from_config(LLAMA2_7B)
    assert 26.5 * GB < size.weight_bytes("fp32") < 27.5 * GB  # 6.74B weights
    assert 7 * GB < size.weight_bytes("int8") < 8 * GB and 3.5 * GB < size.weight_bytes("q4_0") < 4.2 * GB
    assert auto_precision(size, total_bytes=32 * GB) == "fp32"  # 27.6 GB of 32: fits, as before
    assert auto_precision(size, total_bytes=23 * GB) == "int8"
    assert auto_precision(size, total_bytes=6 * GB) == "q4_0"
    assert auto_precision(size, total_bytes=2 * GB) == "q4_0"  # the smallest, with a warning
    small = TargetSize.from_config(read_config(DEMO_TARGET))
    assert auto_precision(small, total_bytes=2 * GB) == "fp32"


def test_a_shortfall_names_what_would_fit():
    size = TargetSize.from_config(LLAMA2_7B)
    assert shortfall(size.need_bytes("int8"), "int8", size, available_bytes=20 * GB) is None
    warning = shortfall(size.need_bytes("fp32"), "fp32", size, available_bytes=20 * GB)
    assert warning is not None and "needs about 27.6 GB and 20.0 GB" in warning
    assert "--target-dtype int8 would fit (int8 ~7.9 GB, q4_0 ~4.7 GB)" in warning
    warning = shortfall(size.need_bytes("int8"), "int8", size, available_bytes=6 * GB)
    assert warning is not None and "--target-dtype q4_0 would fit (q4_0 ~4.7 GB)" in warning
    assert "would fit" not in (shortfall(size.need_bytes("q4_0"), "q4_0", size, available_bytes=3 * GB) or "")


def machine(monkeypatch, total_gb: float, available_gb: float, swap_gb: float = 0.0, cgroup: Path | None = None):
    """psutil's view of a machine, outside any container (or in ``cgroup``'s)."""
    monkeypatch.setattr(memory_fit, "CGROUP_ROOT", cgroup or Path("/nonexistent-cgroup"))
    memory = types.SimpleNamespace(total=int(total_gb * GB), available=int(available_gb * GB))
    monkeypatch.setattr("psutil.virtual_memory", lambda: memory)
    monkeypatch.setattr("psutil.swap_memory", lambda: types.SimpleNamespace(total=int(swap_gb * GB)))


def settled(target_dtype: str, config: dict) -> Coordinator:
    coordinator = Coordinator(RuntimeSettings(target="/t", draft=None, target_dtype=target_dtype))
    coordinator.max_len = 4096
    coordinator._settle_precision(Path("/not-a-gguf"), config)
    return coordinator


def test_the_coordinator_settles_auto_warns_and_refuses(monkeypatch, caplog):
    caplog.set_level("INFO", logger="dovetail_runtime.coordinator")
    machine(monkeypatch, total_gb=23, available_gb=20)
    assert settled("auto", LLAMA2_7B).settings.target_dtype == "int8"
    assert "target precision int8 (fp32 would take ~27.6 GB of this machine's 23.0 GB" in caplog.text
    caplog.clear()
    machine(monkeypatch, total_gb=40, available_gb=20)  # fp32 could fit the machine, not what is free now
    assert settled("fp32", LLAMA2_7B).settings.target_dtype == "fp32"  # asked for: kept, with a warning
    assert "loading may fail" in caplog.text and "--target-dtype int8 would fit" in caplog.text
    machine(monkeypatch, total_gb=16, available_gb=12, swap_gb=8)
    with pytest.raises(ValueError, match=r"needs about 27\.6 GB, more than this machine's 24\.0 GB of memory and "
                                         r"swap; try --target-dtype int8 or q4_0"):
        settled("fp32", LLAMA2_7B)


@pytest.mark.parametrize("version", [2, 1])
def test_a_container_s_memory_limit_is_the_machine(monkeypatch, tmp_path, version):
    limit, usage = ("memory.max", "memory.current") if version == 2 else (
        "memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")
    (tmp_path / "memory").mkdir()
    (tmp_path / limit).write_text(f"{16 * GB}\n")
    (tmp_path / usage).write_text(f"{4 * GB}\n")
    machine(monkeypatch, total_gb=64, available_gb=60, cgroup=tmp_path)
    assert memory_fit.machine_memory() == (16 * GB, 12 * GB)
    assert settled("auto", LLAMA2_7B).settings.target_dtype == "int8"  # fp32 fits the host, not the container
    (tmp_path / limit).write_text("max\n" if version == 2 else f"{2 ** 63 - 4096}\n")  # no limit
    assert memory_fit.machine_memory() == (64 * GB, 60 * GB)
    assert settled("auto", LLAMA2_7B).settings.target_dtype == "fp32"
