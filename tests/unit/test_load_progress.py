"""Loading a target shows a progress bar on a terminal's stderr, nothing elsewhere (logs, pipes,
tests), and the same weights either way, from a folder (quantized at load or not) and a GGUF."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_support import write_gguf

from cpu_worker.engine import TargetEngine
from cpu_worker.target_loading import load_target_model

from conftest import save_tiny_model


class Terminal(io.StringIO):
    """A stderr that says it is a terminal (80 columns), as the user's is."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    folder = save_tiny_model(root / "tiny", "llama", seed=4)
    gguf = write_gguf(folder, root / "tiny.gguf", {"proj": Q.Q4_0, "embd": Q.Q8_0})
    return {"folder": folder, "gguf": gguf}


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, and what quantized layers keep outside them (packed blocks, scales)."""
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("target,precision", [("folder", "fp32"), ("folder", "int8-row"), ("folder", "q4_0-a16"),
                                              ("gguf", "q4_0-a16")])
def test_the_bar_shows_only_on_a_terminal_and_the_weights_are_the_same(targets, precision, target, capfd,
                                                                        monkeypatch):
    quiet = load_target_model(targets[target], precision)
    assert "tensor" not in capfd.readouterr().err  # stderr is no terminal here: no bar at all
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    shown = load_target_model(targets[target], precision)
    assert f"{targets[target].name}:" in terminal.getvalue() and "tensor" in terminal.getvalue()
    expected, got = _state(quiet), _state(shown)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    prompt = [3, 17, 42, 5]
    assert torch.equal(TargetEngine(quiet, max_len=16).prefill(prompt).logits,
                       TargetEngine(shown, max_len=16).prefill(prompt).logits)  # packed weights too


def test_the_fp32_engines_fusing_and_packing_show_bars_only_on_a_terminal(targets, capfd, monkeypatch):
    from cpu_worker.server import build_engine

    quiet, _ = build_engine(str(targets["folder"]), "fp32", 16)
    assert "layer" not in capfd.readouterr().err
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    shown, kernel = build_engine(str(targets["folder"]), "fp32", 16)
    assert "fuse q/k/v and gate/up" in terminal.getvalue()
    if kernel == "dovetail-fp32":  # the row kernel (a C compiler was found): its weights moved onto huge pages
        assert "fp32 row kernel" in terminal.getvalue()
    prompt = [3, 17, 42, 5]
    assert torch.equal(quiet.prefill(prompt).logits, shown.prefill(prompt).logits)
