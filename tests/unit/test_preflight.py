"""dovetail_runtime.preflight: settings refused before any model loads, in one line."""

from __future__ import annotations

import os

import pytest

from dovetail_runtime import preflight
from dovetail_runtime.coordinator import RuntimeSettings
from dovetail_runtime.preflight import PreflightError, check_cores, check_draft_device, check_settings

from conftest import DEMO_DRAFT, DEMO_TARGET


def test_cores_outside_this_process_affinity_are_named():
    available = sorted(os.sched_getaffinity(0))
    check_cores(available, "--cpu-cores")
    with pytest.raises(PreflightError, match=r"--draft-cores: cores 5000-5002 are not available .*available: "):
        check_cores([available[0], 5000, 5001, 5002], "--draft-cores")


@pytest.mark.parametrize("device, dtype, message", [
    ("gpu", "auto", "use auto, cpu, cuda or cuda:N"),
    ("cuda:x", "auto", "use auto, cpu, cuda or cuda:N"),
    ("cuda", "int8", "int8 runs on the CPU only"),
    ("cpu", "fp16", "needs CUDA"),
])
def test_device_and_dtype_mistakes(device, dtype, message):
    with pytest.raises(PreflightError, match=message):
        check_draft_device(device, dtype)
    check_draft_device("cpu", "int8")


def test_a_16_bit_draft_with_auto_is_refused_up_front_only_where_no_cuda_device_is(monkeypatch):
    for count in (None, 1):  # a CUDA device, or no telling: auto may take CUDA, the worker decides
        monkeypatch.setattr(preflight, "cuda_device_count", lambda count=count: count)
        check_draft_device("auto", "fp16")
    monkeypatch.setattr(preflight, "cuda_device_count", lambda: 0)  # was found only after the models loaded
    with pytest.raises(PreflightError, match="bf16 needs CUDA and there is no CUDA device here"):
        check_draft_device("auto", "bf16")
    check_draft_device("auto", "q4_0")


def test_cuda_devices_are_counted_from_the_driver(monkeypatch):
    monkeypatch.setattr(preflight, "cuda_device_count", lambda: 0)
    with pytest.raises(PreflightError, match="no CUDA device is available here"):
        check_draft_device("cuda", "auto")
    monkeypatch.setattr(preflight, "cuda_device_count", lambda: 2)
    check_draft_device("cuda:1", "fp16")
    with pytest.raises(PreflightError, match=r"only 2 CUDA device\(s\) available \(cuda:0..cuda:1\)"):
        check_draft_device("cuda:2", "auto")
    monkeypatch.setattr(preflight, "cuda_device_count", lambda: None)  # cannot tell: the worker decides
    check_draft_device("cuda:7", "auto")


def test_settings_are_checked_in_flag_order(tmp_path):
    check_settings(RuntimeSettings(target=str(DEMO_TARGET), draft=str(DEMO_DRAFT), draft_device="cpu"))
    with pytest.raises(PreflightError, match="--draft: draft head folder .* does not exist"):
        check_settings(RuntimeSettings(target=str(DEMO_TARGET), draft=str(tmp_path / "missing")))
    with pytest.raises(PreflightError, match="has no config.json"):
        check_settings(RuntimeSettings(target=str(DEMO_TARGET), draft=str(tmp_path)))
    with pytest.raises(PreflightError, match="--cpu-cores"):
        check_settings(RuntimeSettings(target=str(DEMO_TARGET), draft=None, cpu_cores=[4096]))


def test_a_file_given_as_the_draft_is_called_a_file_and_a_folder_asked_for(tmp_path):
    """Its message once suggested a .gguf file, which is then refused: a head is a folder."""
    from dovetail_runtime.preflight import check_draft_dir

    for name, data in (("notes.txt", b"hi"), ("head.gguf", b"GGUF\x03\x00\x00\x00")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(PreflightError, match="is a file; a draft head is a folder with config.json") as info:
            check_draft_dir(str(tmp_path / name))
        assert ".gguf file" not in str(info.value)


def test_a_model_folder_given_as_the_draft_is_refused_before_loading():
    """It was found only by the gpu_worker, after the target had loaded, as "cannot tell the draft's
    fusion"; a head (whose weights are no model's) still passes."""
    from dovetail_runtime.preflight import check_draft_dir
    from gpu_worker.checkpoint import DraftCheckpointError, detect_fusion

    with pytest.raises(PreflightError, match="is a model folder, not a draft head"):
        check_draft_dir(str(DEMO_TARGET))
    check_draft_dir(str(DEMO_DRAFT))
    with pytest.raises(DraftCheckpointError, match=r"a whole model's \(model\.layers\.\*\)"):
        detect_fusion({}, ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"])
