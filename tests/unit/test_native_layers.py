"""The target's decoder layers in one foreign call (cpu_worker/native_layers.py, decoder_layers.c):
the same bits as the Python layers for decode steps, trees, prompt chunks (attending causally) and
EAGLE-3 feature rows (copied out of the same call), at int8 (fp32 and bf16 caches) and fp32; the
Python layers wherever the call or the model does not qualify; SiLU close to torch's, row-invariant
and rounding as its formula."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from cpu_worker import native_layers
from cpu_worker.engine import TargetEngine
from cpu_worker.kernels import attention, block_quant, int8_kernel, layer_ops
from cpu_worker.native import library as native_library
from cpu_worker.native_layers import NativeLayers
from cpu_worker.server import build_engine
from cpu_worker.target_loading import load_target_model

from conftest import build_for

PROMPT = [5, 17, 230, 41, 9, 300, 77, 12, 8, 150, 33, 64]
TREE_TOKENS = [40, 41, 42, 43, 44, 45, 46]
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 5]


def session(engine: TargetEngine, native: bool, loop: NativeLayers | None) -> list[torch.Tensor]:
    """Every output of a prefill in two chunks, decode steps, a tree, its verification and a decode after it,
    with the C loop on or off (on: each decode and tree must reach it, or the comparison says nothing)."""
    calls = []
    if native and loop is not None:
        original = loop.run
        loop.run = lambda *args: calls.append(1) or original(*args)  # type: ignore[method-assign]
    engine.model.layer_loop = loop if native else None
    vocab = engine.spec.vocab_size
    tree = [token % vocab for token in TREE_TOKENS]
    outputs = []
    prompt = [token % vocab for token in PROMPT]
    step = engine.prefill(prompt[:5])  # two chunks: the second attends from slot 5 on
    outputs += [step.features, step.logits]
    step = engine.prefill(prompt[5:], 5)
    outputs += [step.features, step.logits]
    for token in (3, 99, 250):
        step = engine.decode(token % vocab)
        outputs += [step.features, step.logits]
    outputs += list(engine.tree_logits(tree, TREE_PARENTS))
    outcome = engine.verify(tree, TREE_PARENTS)
    outputs.append(outcome.features)
    step = engine.decode(outcome.tokens[-1])
    outputs += [step.features, step.logits, engine.cache.keys[:, :, :, :engine.committed].float(),
                engine.cache.values[:, :, :, :engine.committed].float()]
    if native and loop is not None:
        del loop.run  # the class's method again
        # One call a forward, aux layers' streams and all: 3 decodes, the tree, its verification, 1
        # decode, and the prompt's two chunks where its bits do not depend on its chunks.
        assert len(calls) == 6 + 2 * engine.chunk_invariant
    return outputs


@pytest.mark.parametrize(("precision", "kv_dtype"), [("int8-row", "bf16"), ("int8-row", "fp32"), ("fp32", "fp32"),
                                                     ("int8", "bf16"), ("q4_0", "bf16"), ("q4_1", "fp32"),
                                                     ("q4_1-a16", "bf16")])
def test_the_c_loop_gives_the_python_layers_bits(demo_target, precision, kv_dtype):
    engine, kernel = build_engine(str(demo_target), precision, 128, kv_dtype)
    expected = {"fp32": "dovetail-fp32", "int8-row": int8_kernel.kernel_name()}.get(precision,
                                                                                    block_quant.kernel_name())
    assert kernel == expected
    loop = engine.model.layer_loop
    assert isinstance(loop, NativeLayers), "the cpu_worker's engine should take the C loop here"
    native, python = session(engine, True, loop), session(engine, False, loop)
    assert len(native) == len(python)
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["packed", "tiles"])
def test_an_engine_with_packed_or_tiled_int8_weights_gives_the_row_layout_s_bits(demo_target, monkeypatch, layout):
    """The same session on two engines: int8 weights all packed (or all in tiles: AMX where the
    CPU has it, else the VNNI or plain C loop over the same bytes), and all as [N, K]. Prefill,
    decodes, a tree and its verification agree bit for bit."""
    monkeypatch.setenv(int8_kernel.LAYOUT_VARIABLE, "rows")
    as_rows, _ = build_engine(str(demo_target), "int8-row", 128, "bf16")
    monkeypatch.setenv(int8_kernel.LAYOUT_VARIABLE, layout)
    other, _ = build_engine(str(demo_target), "int8-row", 128, "bf16")
    layouts = {engine: [module._int8.layout for module in engine.model.modules() if hasattr(module, "_int8")]
               for engine in (as_rows, other)}
    assert set(layouts[as_rows]) == {"rows"}
    assert set(layouts[other]) == {layout}, "the demo target's shapes all have packed and tile layouts"
    for a, b in zip(session(other, True, other.model.layer_loop), session(as_rows, True, as_rows.model.layer_loop),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen2", "llama3-rope", "llama-mha"])  # qkv biases; scaled rotary; MHA
def test_the_c_loop_gives_the_python_layers_bits_on_other_families(tiny_models, family):
    engine = TargetEngine(load_target_model(tiny_models[family], "int8-row"), max_len=64)
    loop = engine.model.layer_loop
    assert loop is not None
    for a, b in zip(session(engine, True, loop), session(engine, False, loop), strict=True):
        assert torch.equal(a, b)


def test_the_c_loop_takes_decode_steps_trees_and_chunk_invariant_prompts(demo_target, monkeypatch):
    engine, _ = build_engine(str(demo_target), "int8-row", 128)
    loop = engine.model.layer_loop
    assert loop is not None and engine.chunk_invariant
    calls = []
    original = loop.run
    monkeypatch.setattr(loop, "run", lambda *args: calls.append(args[0].shape[1]) or original(*args))
    engine.prefill(PROMPT)
    assert calls == [len(PROMPT)]  # the prompt, attending causally
    engine.decode(3)
    engine.tree_logits(TREE_TOKENS, TREE_PARENTS)
    engine.extend([4, 5])  # several new tokens: causal too
    assert calls == [len(PROMPT), 1, len(TREE_TOKENS), 2]
    monkeypatch.setattr(loop, "max_rows", len(PROMPT) - 1)
    engine.prefill(PROMPT)  # more rows than the loop takes: the Python layers
    assert calls == [len(PROMPT), 1, len(TREE_TOKENS), 2]


@pytest.mark.parametrize("precision", ["int8", "q4_1-a16", "int8-row", "fp32"])
def test_the_loop_s_final_norm_and_head_give_the_modules_bits(demo_target, precision):
    """``NativeLayers.finish`` (one foreign call) against the final norm and lm_head modules: every row's
    features, and logits of the rows picked as a slice, as scattered rows, or all; None for more logit
    rows than it takes (the modules then run)."""
    engine, _ = build_engine(str(demo_target), precision, 128)
    model, loop = engine.model, engine.model.layer_loop
    assert isinstance(loop, NativeLayers)
    x = torch.randn(1, 9, engine.spec.hidden_size, generator=torch.Generator().manual_seed(4)) * 3
    features = model.norm(x)[0]
    for rows in (slice(8, 9), slice(2, 5), slice(0, 9, 2), torch.tensor([6, 1, 1]), None):
        done = loop.finish(x, rows)
        assert done is not None
        assert torch.equal(done[0], features)
        assert torch.equal(done[1], model.lm_head(features if rows is None else features[rows]))
    wide = torch.randn(1, 70, engine.spec.hidden_size)
    assert loop.finish(wide, None) is None and loop.finish(wide, slice(69, 70)) is not None
    assert loop.finish(x, torch.tensor(3)) is None  # a 0-d index: the modules keep its shape
    calls = []
    original = loop.finish
    loop.finish = lambda *args: calls.append(1) or original(*args)  # type: ignore[method-assign]
    try:
        engine.decode(5)  # LlamaDecoder.finish takes it
    finally:
        del loop.finish
    assert calls == [1]


def test_a_long_prompt_chunk_s_scratch_is_not_kept(demo_target, monkeypatch):
    engine, _ = build_engine(str(demo_target), "int8", 128)
    loop = engine.model.layer_loop
    assert isinstance(loop, NativeLayers)
    shape = loop._shape(engine.cache.max_len)
    step_floats = loop.library.dovetail_decoder_scratch(ctypes.byref(shape), 1)
    assert loop.scratch.keep == native_layers.KEPT_SCRATCH_FLOATS
    monkeypatch.setattr(loop.scratch, "keep", 4 * step_floats)
    first = engine.prefill(PROMPT)  # 12 rows: more scratch than is kept
    assert loop.scratch.kept_floats == 0
    engine.decode(3)
    assert loop.scratch.kept_floats == step_floats  # a step's is kept
    monkeypatch.setattr(loop.scratch, "keep", 1 << 30)
    again = engine.prefill(PROMPT)
    assert loop.scratch.kept_floats >= 12 * step_floats
    assert torch.equal(first.logits, again.logits) and torch.equal(first.features, again.features)


def test_a_prompt_whose_bits_follow_its_chunks_runs_the_python_layers(demo_target, monkeypatch):
    engine, _ = build_engine(str(demo_target), "fp32", 128)  # fp32's prompt GEMM
    loop = engine.model.layer_loop
    assert loop is not None and not engine.chunk_invariant
    calls = []
    original = loop.run
    monkeypatch.setattr(loop, "run", lambda *args: calls.append(args[0].shape[1]) or original(*args))
    engine.prefill(PROMPT)
    engine.decode(3)
    assert calls == [1]


def test_eagle3_feature_rows_through_the_c_loop_equal_the_python_layers(demo_target):
    model = load_target_model(str(demo_target), "int8-row")
    last = model.spec.num_layers - 1
    engine = TargetEngine(model, max_len=128, aux_layers=[0, 1, last])
    loop = engine.model.layer_loop
    assert loop is not None
    native, python = session(engine, True, loop), session(engine, False, loop)
    assert native[2].shape[-1] == 3 * model.spec.hidden_size
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)


def test_captured_streams_are_checked_on_both_sides(demo_target):
    engine, _ = build_engine(str(demo_target), "int8", 64)
    loop = engine.model.layer_loop
    assert isinstance(loop, NativeLayers)
    engine.prefill(PROMPT[:8])
    layers = engine.spec.num_layers
    x = engine.model.embed_tokens(torch.tensor([3])).unsqueeze(0)
    cos, sin = engine.rotary.lookup(torch.tensor([engine.committed]))
    for capture in ([1, 1], [2, 1], [layers], [-1]):
        with pytest.raises(ValueError, match="capture layers"):
            loop.run(x, cos, sin, engine.cache, engine.committed, None, 0, layers, [], capture)
    streams: list[torch.Tensor] = []
    out = loop.run(x, cos, sin, engine.cache, engine.committed, None, 0, layers, streams, [0, layers - 1])
    assert [stream.shape for stream in streams] == [x.shape, x.shape] and torch.equal(streams[0], x)
    # Layer by layer through the same loop: the stream entering the last layer, and the same output.
    before_last = loop.run(x, cos, sin, engine.cache, engine.committed, None, 0, layers - 1)
    assert torch.equal(streams[1], before_last)
    assert torch.equal(loop.run(before_last, cos, sin, engine.cache, engine.committed, None, layers - 1, layers), out)
    # The C side refuses what the Python side would (a caller that skipped its check): no stream written.
    shape = loop._shape(engine.cache.max_len)
    captured = torch.full((1, 1, engine.spec.hidden_size), 7.0)
    bad = torch.tensor([layers], dtype=torch.int64)
    rows = x[0].clone()
    scratch = torch.empty(loop.library.dovetail_decoder_scratch(ctypes.byref(shape), 1), dtype=torch.float32)
    status = loop.library.dovetail_decoder_layers_capturing(
        rows.data_ptr(), loop._layers, layers, ctypes.byref(shape), cos.data_ptr(), sin.data_ptr(),
        loop._describe([(engine.cache, engine.committed, None)], 0, 1), 1, 0, 1, scratch.data_ptr(),
        ctypes.byref(native_library.Capture(1, bad.data_ptr(), captured.data_ptr())), 1)
    assert status == native_library.BAD_SHAPE and torch.equal(captured, torch.full_like(captured, 7.0))


def test_models_or_switches_the_loop_cannot_run_keep_the_python_layers(demo_target, monkeypatch):
    dense = TargetEngine(load_target_model(str(demo_target)), max_len=64)  # F.linear layers, unfused
    assert dense.model.layer_loop is None
    monkeypatch.setenv("DOVETAIL_NATIVE_LAYERS", "python")
    engine, _ = build_engine(str(demo_target), "int8-row", 64)
    assert engine.model.layer_loop is None
    monkeypatch.delenv("DOVETAIL_NATIVE_LAYERS")
    engine, _ = build_engine(str(demo_target), "int8-row", 64)
    loop = engine.model.layer_loop
    assert loop is not None
    x = torch.zeros(1, 1, engine.spec.hidden_size)
    assert loop.applies(x, engine.cache, None, None)
    assert not loop.applies(x.double(), engine.cache, None, None)
    prompt = torch.zeros(1, 3, engine.spec.hidden_size)
    assert loop.applies(prompt, engine.cache, None, None)  # a prompt chunk, causal in the loop
    assert not loop.applies(prompt, engine.cache, torch.ones(3, 3, dtype=torch.bool), None)  # a mask
    monkeypatch.setattr(engine.model.layers[1].self_attn, "kernel", attention.TORCH)  # one layer's prompts on torch
    assert not loop.applies(prompt, engine.cache, None, None)
    cos = sin = torch.zeros(1, engine.spec.head_dim)
    with pytest.raises(ValueError, match=r"slots \[64, 65\) outside a 64-slot cache"):
        loop.run(x, cos, sin, engine.cache, 64, None, 0, 1)
    with pytest.raises(ValueError, match="rows through layers"):
        loop.run(x, cos, sin, engine.cache, 0, None, 0, engine.spec.num_layers + 1)


@pytest.mark.parametrize("width", [7, 256, 2051])
def test_silu_mul_rounds_as_its_formula(width):
    """silu(g) u = (g * s) * u with s = 1 / (1 + e) for g >= 0, e / (1 + e) below, e = exp(-|g|) from the
    library's one exponential: each IEEE operation once, so a vectorized loop must keep these bits."""
    gate = torch.randn(3, width, generator=torch.Generator().manual_seed(width + 1)) * 8
    gate[0, :4] = torch.tensor([0.0, -0.0, 100.0, -100.0])
    up = torch.randn(3, width, generator=torch.Generator().manual_seed(width + 2))
    library = native_library.load()
    e = (-gate.abs()).contiguous()
    library.dovetail_exp_nonpositive(e.data_ptr(), e.numel())
    sigmoid = torch.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    assert torch.equal(layer_ops.silu_mul(gate, up), (gate * sigmoid) * up)


@pytest.mark.parametrize("width", [7, 256, 2051])  # 7 and 2051: tails past the last 8 lanes
def test_silu_mul_is_close_to_torch_and_row_invariant(width):
    gate_up = torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(width)) * 6
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # beyond exp's range on both sides
    gate, up = gate_up.chunk(2, dim=-1)  # views of one tensor, as the fused projection gives them
    out = layer_ops.silu_mul(gate, up)
    assert torch.allclose(out, F.silu(gate) * up, rtol=3e-6, atol=1e-30)
    assert torch.equal(out, torch.cat([layer_ops.silu_mul(gate[r:r + 1], up[r:r + 1]) for r in range(5)]))
    assert torch.equal(out, layer_ops.silu_mul(gate.contiguous(), up.contiguous()))  # separate tensors
    assert torch.equal(out[1:4], layer_ops.silu_mul(gate[1:4].t().contiguous().t(), up[1:4]))  # other strides


def test_silu_mul_of_the_plain_c_build_gives_the_native_build_s_bits():
    plain = build_for("x86-64-v2")
    gate_up = torch.randn(300, 2 * 515, generator=torch.Generator().manual_seed(1)) * 5  # on the thread pool
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(layer_ops.silu_mul(gate, up), layer_ops.silu_mul(gate, up, library=plain))
