"""Shared test fixtures: tiny random checkpoints of each supported family, and the bundled demo pair.

Tests stand on the repository alone: where a trained model is needed they use ``demo/`` (the
testbed target stored in fp16, and its trained DGF head), never ``../shared``.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

# Before torch loads OpenMP: idle pool threads must sleep, not spin. On a 2-core machine a
# spinning pool in one process (a test, a worker) slows every other one by 100x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The tree planner's verify-cost cache: one per test session, never the user's ~/.cache.
if "DOVETAIL_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    from ipc.cost_cache import cache_dir

    # The kernel library stays in the user's cache (named by a hash of its sources and flags, so
    # sharing it is safe): else every session would compile it again.
    os.environ.setdefault("DOVETAIL_KERNEL_DIR", str(cache_dir() / "kernels"))
    os.environ["DOVETAIL_CACHE_DIR"] = tempfile.mkdtemp(prefix="dovetail-test-cache-")
    atexit.register(shutil.rmtree, os.environ["DOVETAIL_CACHE_DIR"], ignore_errors=True)

import pytest
import torch


def flags_for(arch: str, *extra: str) -> list[str]:
    """The kernel library's build flags with ``-march=arch`` (and ``extra`` -m flags) instead of this CPU's."""
    from cpu_worker.native import library as native_library

    return [flag for flag in native_library.FLAGS if flag != "-march=native"] + [f"-march={arch}", *extra]


def build_for(arch: str, *extra: str):
    """The kernel library built for ``-march=arch`` (and ``extra``) instead of this CPU: tests that
    compare builds. Compiled once per test session into one temporary folder: a compile takes
    seconds, and a dozen tests build the same few."""
    return _shared_build(tuple(flags_for(arch, *extra)))


@cache
def _shared_build(flags: tuple[str, ...]):
    import atexit
    import shutil
    import tempfile

    from cpu_worker.native import library as native_library

    compiler = native_library.find_compiler()
    assert compiler is not None, "the kernel tests need a C compiler"
    directory = Path(tempfile.mkdtemp(prefix="dovetail-test-build-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return native_library.build(compiler, list(flags), directory)


DEMO = Path(__file__).resolve().parents[1] / "demo"
DEMO_TARGET = DEMO / "target-code-9m"
DEMO_DRAFT = DEMO / "draft-dgf"

# Small enough to build in milliseconds, shaped to exercise every code path.
TINY_FAMILIES: dict[str, dict] = {
    "llama-mha": dict(model_type="llama"),
    "llama-gqa-tied": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True),
    "llama3-rope": dict(
        model_type="llama", num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "llama-linear-rope": dict(model_type="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=4096),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
}


def make_hf_config(model_type: str, **overrides):
    from transformers import AutoConfig

    fields = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def save_tiny_model(directory: Path, model_type: str, seed: int = 0, weight_format: str = "safetensors",
                    **overrides) -> Path:
    """Build a random transformers model and save it; ``weight_format`` is
    'safetensors', 'sharded' (several safetensors files with an index) or 'bin'."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_hf_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # Random-init biases are zero; make them count so qkv-bias handling is tested.
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    if weight_format == "bin":
        config.save_pretrained(directory)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    elif weight_format == "sharded":
        model.save_pretrained(directory, max_shard_size="40KB")
    else:
        model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: save_tiny_model(root / name, **spec) for name, spec in TINY_FAMILIES.items()}


@pytest.fixture(scope="session")
def demo_target() -> Path:
    """The trained 9M code model (weights stored in fp16; loaded in fp32 everywhere)."""
    assert (DEMO_TARGET / "config.json").exists(), f"demo target missing at {DEMO_TARGET}"
    return DEMO_TARGET


@pytest.fixture(scope="session")
def demo_draft() -> Path:
    """The trained 4-layer DGF head for the demo target."""
    assert (DEMO_DRAFT / "config.json").exists(), f"demo draft missing at {DEMO_DRAFT}"
    return DEMO_DRAFT


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Test models are tiny: one intra-op thread is fastest and leaves the other core to the
    # worker processes that the runtime tests start.
    torch.set_num_threads(1)


def save_random_head(directory: Path, target_dir: Path, layers: int = 1, fusion: str = "dgf", seed: int = 0) -> Path:
    """An untrained draft head for ``target_dir`` (embedding and lm_head come from the target)."""
    import dataclasses

    from cpu_worker.model.loading import load_spec
    from gpu_worker.checkpoint import save_head
    from gpu_worker.head import DraftHead

    torch.manual_seed(seed)
    spec = dataclasses.replace(load_spec(Path(target_dir)), num_layers=layers)
    return save_head(DraftHead(spec, fusion=fusion), directory, include_frozen=False)


def sharp_tiny_pair(root: Path, max_len: int):
    """(TargetEngine, Drafter): a target with an 8-token vocabulary (lm_head sharpened so few
    continuations carry the mass; its text repeats) and an untrained 1-layer draft head for it."""
    from cpu_worker.engine import TargetEngine
    from cpu_worker.target_loading import load_target_model
    from gpu_worker.drafter import Drafter

    target_dir = save_tiny_model(root / "target", "llama", seed=3, vocab_size=8)
    model = load_target_model(target_dir)
    model.lm_head.weight.mul_(6.0)
    head_dir = save_random_head(root / "head", target_dir, layers=1, seed=4)
    return (TargetEngine(model, max_len=max_len),
            Drafter.from_pretrained(head_dir, target_dir, max_len=max_len, device="cpu"))


@pytest.fixture(scope="session")
def demo_random_head(tmp_path_factory, demo_target) -> Path:
    """An untrained 1-layer head for the demo target (cheap; low acceptance)."""
    return save_random_head(tmp_path_factory.mktemp("heads") / "random-dgf-1", demo_target)
