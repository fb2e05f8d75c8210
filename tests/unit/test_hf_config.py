"""config.json read without transformers (cpu_worker.model.hf_config) gives the very spec transformers'
reading gives, for every family and layout it accepts; whatever it cannot vouch for goes to transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpu_worker.model.hf_config import plain_config
from cpu_worker.model.llama import LlamaSpec
from cpu_worker.model.loading import _checked_dimensions, _transformers_config, load_spec
from cpu_worker.model.model_dir import ModelLoadError
from gpu_worker.checkpoint import head_spec

from conftest import DEMO_TARGET, TINY_FAMILIES, make_hf_config

REPO = Path(__file__).resolve().parents[2]
BASE = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}

# Each stated in full, in the layouts configs come in: what plain_config accepts.
PLAIN = {
    "rope_parameters": BASE,
    "top-level rope_theta": {**{k: v for k, v in BASE.items() if k != "rope_parameters"}, "rope_theta": 5e5},
    "llama3 rope": {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64}},
    "gqa, tied, biases": {**BASE, "num_key_value_heads": 2, "tie_word_embeddings": True, "attention_bias": True,
                          "mlp_bias": True},
    "head_dim wider": {**BASE, "head_dim": 32},
    "nulls derived": {**BASE, "num_key_value_heads": None, "head_dim": None},
    "mistral window": {**BASE, "model_type": "mistral", "sliding_window": 128, "num_key_value_heads": 2},
    "mistral no window": {**BASE, "model_type": "mistral", "sliding_window": None, "num_key_value_heads": 4},
    "qwen2": {**BASE, "model_type": "qwen2", "use_sliding_window": False, "num_key_value_heads": 4},
    "qwen2 window": {**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
                     "num_key_value_heads": 1},
}

# What only transformers can say: a default, a legacy rope layout, a wrong type.
TRANSFORMERS = {
    "no rms_norm_eps": {k: v for k, v in BASE.items() if k != "rms_norm_eps"},
    "no max_position_embeddings": {k: v for k, v in BASE.items() if k != "max_position_embeddings"},
    "no rope theta": {k: v for k, v in BASE.items() if k != "rope_parameters"},
    "legacy rope_scaling": {**{k: v for k, v in BASE.items() if k != "rope_parameters"}, "rope_theta": 1e4,
                            "rope_scaling": {"type": "linear", "factor": 2.0}},
    "mistral's window unstated": {**BASE, "model_type": "mistral", "num_key_value_heads": 4},
    "qwen2's window unstated": {**BASE, "model_type": "qwen2", "use_sliding_window": True, "num_key_value_heads": 4},
    "mistral's key/value heads unstated": {**BASE, "model_type": "mistral", "sliding_window": None},
    "qwen2's key/value heads unstated": {**BASE, "model_type": "qwen2"},
    "a string size": {**BASE, "hidden_size": "64"},
    "a bool size": {**BASE, "num_hidden_layers": True},
    "a float size": {**BASE, "intermediate_size": 96.0},
    "a string flag": {**BASE, "tie_word_embeddings": "false"},
    "heads that do not split": {**BASE, "num_attention_heads": 5},
    "another family": {**BASE, "model_type": "gemma"},
}


def write(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def transformers_spec(folder: Path) -> LlamaSpec:
    raw = json.loads((folder / "config.json").read_text())
    return _checked_dimensions(LlamaSpec.from_hf_config(_transformers_config(folder, raw)), folder)


@pytest.mark.parametrize("name", list(PLAIN))
def test_a_stated_config_is_read_without_transformers_to_the_same_spec(tmp_path, name):
    folder = write(tmp_path, PLAIN[name])
    assert plain_config(PLAIN[name]) is not None
    assert load_spec(folder) == transformers_spec(folder)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_configs_transformers_saves_are_read_to_the_same_spec(tmp_path, family):
    config = json.loads(make_hf_config(**TINY_FAMILIES[family]).to_json_string(use_diff=True))
    folder = write(tmp_path, config)
    assert plain_config(config) is not None, "a config transformers saves states everything"
    assert load_spec(folder) == transformers_spec(folder)


def test_the_shipped_models_are_read_to_the_same_spec():
    for folder in [DEMO_TARGET, *sorted((REPO / "demo").glob("draft-*"))]:
        raw = json.loads((folder / "config.json").read_text())
        assert plain_config(raw, model_type_default="llama") is not None, folder
        spec = load_spec(folder) if folder == DEMO_TARGET else head_spec(folder)
        assert spec == transformers_spec(folder), folder


@pytest.mark.parametrize("name", list(TRANSFORMERS))
def test_anything_left_to_transformers_is_parsed_by_it(tmp_path, name):
    """The same spec or the same error as before this reader existed: transformers decides."""
    assert plain_config(TRANSFORMERS[name]) is None
    folder = write(tmp_path, TRANSFORMERS[name])
    try:
        expected: LlamaSpec | str = transformers_spec(folder)
    except Exception as error:  # whatever transformers or the spec raise, load_spec must raise too
        expected = type(error).__name__
    try:
        got: LlamaSpec | str = load_spec(folder)
    except (ModelLoadError, ValueError) as error:
        got = type(error).__name__
    assert got == expected or (isinstance(expected, str) and got == "ModelLoadError")
