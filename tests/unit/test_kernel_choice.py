"""Kernels chosen once, when the engine is built (cpu_worker.engine.choose_kernels): the attention
and projection strategies an engine reports, the linear layers' own row-invariance, and forwards
that take the chosen kernels without testing for them again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_worker.engine import TargetEngine
from cpu_worker.kernels import attention, exact_attention, layer_ops
from cpu_worker.kernels.linear import LinearKernel, row_invariant_linears
from cpu_worker.model.fusion import fuse_projections
from cpu_worker.model.llama import AUTO_FUSED, SEPARATE, Attention
from cpu_worker.native_layers import FORCE_VARIABLE as NATIVE_LAYERS_VARIABLE
from cpu_worker.server import build_engine
from cpu_worker.target_loading import load_target_model

PROMPT = [5, 17, 230, 41, 9, 300, 77, 12]
TREE = ([40, 41, 42, 43, 44], [-1, 0, 0, 1, 3])


def outputs(engine: TargetEngine) -> list[torch.Tensor]:
    """A prefill, two decode steps and a tree's logits."""
    got = [engine.prefill(PROMPT).logits, engine.decode(3).logits, engine.decode(99).logits]
    return [*got, engine.tree_logits(*TREE)[1]]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_row_kernel_engine_reports_exact_attention_and_row_invariant_linears(demo_target, precision):
    """fp32, and bf16 (its weights widened on the same kernel): exact trees, fp32 activations."""
    engine, kernel = build_engine(str(demo_target), precision, 64)
    assert kernel == f"dovetail-{precision}"
    # Exact decodes and trees; its prompts (a GEMM from 64 rows: chunk-dependent anyway) on torch's SDPA.
    assert engine.kernels.attention is attention.EXACT_TREES and engine.kernels.attention.row_invariant
    assert engine.kernels.row_invariant_linears and engine.exact_tree and not engine.chunk_invariant
    assert set(engine.kernels.projections) == {"native-rope"}
    assert len(engine.kernels.projections) == engine.spec.num_layers
    assert all(layer.self_attn.kernel is attention.EXACT_TREES for layer in engine.model.layers)
    int8, _ = build_engine(str(demo_target), "int8", 64)
    assert int8.kernels.attention is attention.EXACT and int8.chunk_invariant


def test_plain_linears_are_not_row_invariant(demo_target):
    dense = TargetEngine(load_target_model(demo_target), max_len=64)
    assert not dense.kernels.row_invariant_linears and not dense.exact_tree
    # fp32 queries on the CPU: the kernel all the same for decodes and trees (prompts: torch's, as
    # rows of plain linears depend on their call-mates anyway)
    assert dense.kernels.attention is attention.EXACT_TREES and not dense.chunk_invariant
    assert set(dense.kernels.projections) == {"separate"}  # unfused


class RowByRow(LinearKernel):
    """A new kernel for the test: each row on its own (row-invariant by construction)."""

    row_invariant = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.cat([F.linear(row[None], self.weight, self.bias) for row in rows])
        return out.reshape(*x.shape[:-1], self.out_features)


def test_a_new_linear_kernel_is_one_class(tiny_models):
    """What a layer declares is what the engine hears: no list of types to extend."""
    model = load_target_model(tiny_models["llama-gqa-tied"])
    assert not TargetEngine(model, max_len=32).exact_tree
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in names[:-1]:
        parent, _, child = name.rpartition(".")
        dense = model.get_submodule(name)
        setattr(model.get_submodule(parent), child, RowByRow(dense.weight, dense.bias))
    assert not TargetEngine(model, max_len=32).exact_tree  # one plain nn.Linear is left
    parent, _, child = names[-1].rpartition(".")
    dense = model.get_submodule(names[-1])
    setattr(model.get_submodule(parent) if parent else model, child, RowByRow(dense.weight, dense.bias))
    engine = TargetEngine(model, max_len=32)
    assert engine.kernels.row_invariant_linears and engine.exact_tree
    assert not row_invariant_linears(nn.Sequential(nn.ReLU()))  # no linear layer: nothing promised


@pytest.mark.parametrize("precision", ["int8-row", "fp32"])
def test_forwards_take_the_kernels_chosen_at_build_and_never_ask_again(demo_target, monkeypatch, precision):
    monkeypatch.setenv(NATIVE_LAYERS_VARIABLE, "python")  # the Python layers: the ones choosing kernels
    engine, _ = build_engine(str(demo_target), precision, 64)
    assert engine.model.layer_loop is None
    assert engine.kernels.attention is (attention.EXACT_TREES if precision == "fp32" else attention.EXACT)
    reference = outputs(engine)
    calls = []
    real_attend = exact_attention.attend
    monkeypatch.setattr(exact_attention, "attend", lambda *args: calls.append(1) or real_attend(*args))

    def no_more_asking(*args: object) -> bool:
        raise AssertionError("a forward asked whether a kernel applies")

    monkeypatch.setattr(exact_attention, "applies", no_more_asking)
    monkeypatch.setattr(exact_attention, "available", no_more_asking)
    again = outputs(engine)
    assert all(torch.equal(a, b) for a, b in zip(reference, again, strict=True))
    assert len(calls) == 3 * engine.spec.num_layers  # two decodes and the tree, every layer, on the kernel


def test_an_engine_built_on_torch_s_attention_keeps_it(demo_target, monkeypatch):
    monkeypatch.setenv(NATIVE_LAYERS_VARIABLE, "python")
    monkeypatch.setenv(exact_attention.FORCE_VARIABLE, "torch")
    exact_attention.clear_cache()
    try:
        engine, _ = build_engine(str(demo_target), "int8-row", 64)
        assert engine.kernels.attention is attention.TORCH and engine.exact_tree
    finally:
        monkeypatch.delenv(exact_attention.FORCE_VARIABLE)
        exact_attention.clear_cache()
    assert exact_attention.available()

    def refused(*args: object) -> torch.Tensor:
        raise AssertionError("the kernel was called after the engine chose torch's attention")

    monkeypatch.setattr(exact_attention, "attend", refused)
    outputs(engine)  # trees row by row on torch's, as chosen


def test_a_model_keeps_the_per_call_defaults_until_an_engine_chooses(demo_target):
    """Draft heads build the same layers and never meet an engine: their layers test each call
    (they move between devices and dtypes, and train), fused layers included."""
    model = load_target_model(demo_target, "int8-row")
    layer = model.layers[0].self_attn
    assert isinstance(layer, Attention) and layer.kernel is attention.AUTO and layer.projection is AUTO_FUSED
    unfused = load_target_model(demo_target).layers[0].self_attn
    assert unfused.kernel is attention.AUTO and unfused.projection is SEPARATE
    assert fuse_projections(model) == 0  # already fused: the default stays
    TargetEngine(model, max_len=32)
    native = layer_ops.available()
    assert layer.projection.name == ("native-rope" if native else "fused") and layer.kernel is attention.EXACT
