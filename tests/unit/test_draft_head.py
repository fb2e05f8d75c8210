"""Draft head forward against a plain reference, checkpoints (Dovetail and EAGLE layouts),
target embedding/lm_head fetching, mismatch errors, device and dtype choice."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from test_draft_support import (
    HIDDEN,
    VOCAB,
    reference_head,
    save_tiny_target,
    spec_config,
    target_frozen,
    tiny_head,
    tiny_spec,
    write_eagle_checkpoint,
)

from cpu_worker.model.llama import KVCache, RotaryTable
from gpu_worker.checkpoint import DraftCheckpointError, load_head, save_head
from gpu_worker.device import resolve_device, resolve_dtype
from gpu_worker.drafter import Drafter
from gpu_worker.head import DraftHead
from gpu_worker.head_formats import quantize_projections
from ipc.tree import TreeShape

TOL = 1e-5


def run_head(head: DraftHead, features: torch.Tensor, tokens: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Outputs of every pair, fed through the KV cache in chunks (exercises start > 0)."""
    spec = head.spec
    cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, 64, torch.float32)
    rotary = RotaryTable(spec, 64, torch.float32)
    outs, start = [], 0
    with torch.no_grad():
        for size in chunks:
            end = start + size
            cos, sin = rotary.lookup(torch.arange(start, end))
            outs.append(head(features[start:end], tokens[start:end], cos, sin, cache, start, None))
            start = end
    return torch.cat(outs)


def random_pairs(count: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, HIDDEN, generator=generator), torch.randint(0, VOCAB, (count,), generator=generator)


@pytest.mark.parametrize("fusion", ["dgf", "fc"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_head_matches_reference(fusion, kv_heads):
    head = tiny_head(fusion, layers=2, kv_heads=kv_heads)
    features, tokens = random_pairs(12)
    expected = reference_head(head.state_dict(), spec_config(head.spec), fusion, features, tokens)
    for chunks in ([12], [5, 1, 6], [1] * 12):
        got = run_head(head, features, tokens, chunks)
        assert (got - expected).abs().max() < TOL, chunks
    logits = head.lm_head(got)
    assert (logits - expected @ head.lm_head.weight.T).abs().max() < TOL


def test_fc_without_bias_and_frozen_parts():
    head = tiny_head("fc", fc_bias=False)
    assert head.fc.bias is None and not head.fc_bias
    assert not head.embed_tokens.weight.requires_grad and not head.lm_head.weight.requires_grad
    assert head.layers[0].input_layernorm.__class__.__name__ == "Identity"
    features, tokens = random_pairs(6)
    expected = reference_head(head.state_dict(), spec_config(head.spec), "fc", features, tokens)
    assert (run_head(head, features, tokens, [6]) - expected).abs().max() < TOL


def test_unknown_fusion_is_an_error():
    with pytest.raises(ValueError, match="unknown draft fusion 'gated'"):
        DraftHead(tiny_spec(), fusion="gated")


@pytest.mark.parametrize("fusion", ["dgf", "fc"])
def test_save_load_round_trip(tmp_path, fusion):
    head = tiny_head(fusion, layers=3)
    save_head(head, tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["dovetail_fusion"] == fusion and config["num_hidden_layers"] == 3
    loaded = load_head(tmp_path / "draft")
    assert loaded.fusion == fusion and loaded.spec.num_layers == 3 and loaded.spec.num_kv_heads == 2
    assert not loaded.lm_head.weight.requires_grad
    features, tokens = random_pairs(9)
    assert (run_head(loaded, features, tokens, [4, 5]) - run_head(head, features, tokens, [9])).abs().max() < TOL


def test_round_trip_without_frozen_needs_the_target(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    embed, lm_head = target_frozen(target)
    head = tiny_head("dgf")
    with torch.no_grad():
        head.embed_tokens.weight.copy_(embed)
        head.lm_head.weight.copy_(lm_head)
    save_head(head, tmp_path / "draft", include_frozen=False)
    with pytest.raises(DraftCheckpointError, match="target"):
        load_head(tmp_path / "draft")
    loaded = load_head(tmp_path / "draft", tmp_path / "target")
    features, tokens = random_pairs(7)
    assert (run_head(loaded, features, tokens, [7]) - run_head(head, features, tokens, [7])).abs().max() < TOL


def eagle_weights(layers: int = 1, kv_heads: int = 2, bias: bool = True, seed: int = 3,
                  with_embed: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Weights in the published EAGLE key layout (with rotary_emb.inv_freq buffers)."""
    head = tiny_head("fc", layers=layers, kv_heads=kv_heads, fc_bias=bias, seed=seed)
    weights = {k: v for k, v in head.state_dict().items() if k != "lm_head.weight"}
    if not with_embed:
        del weights["embed_tokens.weight"]
    for layer in range(layers):
        weights[f"layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.rand(HIDDEN // 8)
    config = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=kv_heads,
                  num_hidden_layers=layers, rms_norm_eps=1e-6, rope_theta=10000.0)
    return weights, config


@pytest.mark.parametrize("weight_format", ["bin", "safetensors"])
@pytest.mark.parametrize("with_embed", [True, False])
def test_eagle_checkpoint_loads_unchanged(tmp_path, weight_format, with_embed):
    target = save_tiny_target(tmp_path / "target")
    target_embed, target_head = target_frozen(target)
    weights, config = eagle_weights(with_embed=with_embed)
    draft = write_eagle_checkpoint(tmp_path / "eagle", weights, config, weight_format)
    head = load_head(draft, target)
    assert head.fusion == "fc" and head.fc_bias and head.spec.num_kv_heads == 2
    # Reference: the fp16 published weights + the target's head (and embedding if absent).
    reference = {k: v.half().float() for k, v in weights.items()}
    reference["lm_head.weight"] = target_head
    reference.setdefault("embed_tokens.weight", target_embed)
    assert torch.equal(head.embed_tokens.weight, reference["embed_tokens.weight"])
    assert torch.equal(head.lm_head.weight, target_head)
    features, tokens = random_pairs(10)
    expected = reference_head(reference, config, "fc", features, tokens)
    assert (run_head(head, features, tokens, [6, 4]) - expected).abs().max() < TOL


def test_eagle_checkpoint_without_fc_bias(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    weights, config = eagle_weights(bias=False)
    draft = write_eagle_checkpoint(tmp_path / "eagle", dict(weights), dict(config, bias=False), "safetensors")
    head = load_head(draft, target)
    assert head.fusion == "fc" and head.fc.bias is None


@pytest.mark.parametrize("weight_format,tied", [("safetensors", True), ("sharded", False), ("bin", False),
                                                 ("bin", True)])
def test_frozen_tensors_from_target_layouts(tmp_path, weight_format, tied):
    target = save_tiny_target(tmp_path / "target", weight_format=weight_format, tied=tied)
    if weight_format == "sharded":
        assert (target / "model.safetensors.index.json").exists()
    target_embed, target_head = target_frozen(target)
    if tied:
        assert torch.equal(target_embed, target_head)
    weights, config = eagle_weights(with_embed=False)
    head = load_head(write_eagle_checkpoint(tmp_path / "eagle", weights, config), target)
    assert torch.equal(head.embed_tokens.weight, target_embed)
    assert torch.equal(head.lm_head.weight, target_head)


@pytest.mark.parametrize("what,target_kwargs,numbers", [
    ("hidden size", dict(hidden=32), ("64", "32")),
    ("vocab size", dict(vocab=120), (str(VOCAB), "120")),
])
def test_mismatched_target_is_a_clear_error(tmp_path, what, target_kwargs, numbers):
    target = save_tiny_target(tmp_path / "target", **target_kwargs)
    weights, config = eagle_weights()
    draft = write_eagle_checkpoint(tmp_path / "eagle", weights, config)
    with pytest.raises(DraftCheckpointError) as error:
        load_head(draft, target)
    message = str(error.value)
    assert what in message and all(number in message for number in numbers), message


def test_unknown_or_undetectable_fusion(tmp_path):
    head = tiny_head("dgf")
    save_head(head, tmp_path / "draft")
    path = tmp_path / "draft" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(dict(config, dovetail_fusion="medusa")))
    with pytest.raises(DraftCheckpointError, match="unknown draft fusion 'medusa'"):
        load_head(tmp_path / "draft")
    del config["dovetail_fusion"]
    path.write_text(json.dumps(config))
    assert load_head(tmp_path / "draft").fusion == "dgf"  # W_1/W_2/W_z keys
    weights, eagle_config = eagle_weights()
    weights["fc2.weight"] = weights.pop("fc.weight")
    write_eagle_checkpoint(tmp_path / "odd", weights, eagle_config)
    with pytest.raises(DraftCheckpointError, match="cannot tell the draft's fusion"):
        load_head(tmp_path / "odd", tmp_path / "draft")


def test_device_and_dtype_choice(caplog):
    with caplog.at_level(logging.INFO, logger="gpu_worker.device"):
        device = resolve_device("auto")
    assert "draft device" in caplog.text
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = torch.device("cpu")
    assert resolve_dtype(cpu) == torch.float32
    with pytest.raises(ValueError, match="only supported on CUDA"):
        resolve_dtype(cpu, "fp16")
    with pytest.raises(ValueError, match="unknown float dtype 'fp8'"):
        resolve_dtype(cpu, "fp8")
    with pytest.raises(ValueError, match="unsupported draft dtype"):
        resolve_dtype(cpu, torch.float64)
    assert resolve_dtype(torch.device("cuda"), "bf16") == torch.bfloat16
    assert resolve_dtype(torch.device("cuda")) == torch.float16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_drafter_from_pretrained_on_cpu(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    weights, config = eagle_weights()
    draft = write_eagle_checkpoint(tmp_path / "eagle", weights, config)
    drafter = Drafter.from_pretrained(draft, target, max_len=32, device="cpu")
    assert drafter.device.type == "cpu" and drafter.dtype == torch.float32
    features, tokens = random_pairs(5)
    drafter.extend(features, tokens)
    tree = drafter.propose(TreeShape.clamped(6, 3, 2))
    assert len(tree) == 6 and tree.tokens[0] == tokens[-1]


@pytest.mark.parametrize(("dtype", "atol"), [("int8", 0.02), ("q4_0", 0.05)])
@pytest.mark.parametrize("fusion", ["dgf", "fc"])
def test_a_quantized_cpu_draft_head_tracks_the_fp32_head(tmp_path, demo_target, fusion, dtype, atol):
    """A CPU draft runs its projections in int8 or 4-bit blocks (it shares the memory bus with the
    target): every projection converted (q4_0's vocabulary projection at Q8_0, for its ranking),
    close to fp32, deterministic."""
    from cpu_worker.kernels.block_quant import BlockQuantLinear
    from cpu_worker.kernels.int8 import RowwiseInt8Linear

    from conftest import save_random_head

    folder = save_random_head(tmp_path / fusion, demo_target, layers=2, fusion=fusion)
    exact = Drafter.from_pretrained(folder, demo_target, max_len=64, device="cpu", dtype="fp32")
    quick = Drafter.from_pretrained(folder, demo_target, max_len=64, device="cpu", dtype=dtype)
    assert quick.head.projection_format == dtype
    assert not any(isinstance(module, torch.nn.Linear) for module in quick.head.modules())
    kinds = {name: "int8" if isinstance(module, RowwiseInt8Linear) else module.weights.kind
             for name, module in quick.head.named_modules() if isinstance(module, RowwiseInt8Linear | BlockQuantLinear)}
    # Per layer qkv, o, gate_up, down (fused: cpu_worker.model.fusion), then lm_head and the fusion's.
    assert len(kinds) == 2 * 4 + 1 + (1 if fusion == "fc" else 3)
    assert set(kinds.values()) == ({"int8"} if dtype == "int8" else {"q4_0", "q8_0"})
    if dtype == "q4_0":
        assert {name for name, kind in kinds.items() if kind == "q8_0"} == {"lm_head"}
    features = torch.randn(12, exact.head.spec.hidden_size)
    tokens = list(range(5, 17))
    outputs = []
    for drafter in (exact, quick):
        drafter.extend(features, tokens)
        outputs.append(drafter._root_log_probs)
    assert torch.allclose(outputs[0].exp(), outputs[1].exp(), atol=atol)
    shape = TreeShape.clamped(8, 3, 2)
    assert torch.equal(quick.propose(shape).tokens, quick.propose(shape).tokens)
    with pytest.raises(ValueError, match="CPU only"):
        Drafter.from_pretrained(folder, demo_target, max_len=64, device="meta", dtype=dtype)


def _old_path_head(draft, target, projections: str | None) -> DraftHead:
    """The loader before tensor-by-tensor loading: every tensor read, the head built in fp32,
    then quantised whole."""
    from cpu_worker.model.loading import read_tensors
    from gpu_worker.checkpoint import head_spec, load_target_frozen

    state = {name: tensor.float() for name, tensor in read_tensors(draft).items()}
    frozen = load_target_frozen(target)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        state.setdefault(name, frozen[name])
    with torch.device("meta"):
        head = DraftHead(head_spec(draft), fusion=json.loads((draft / "config.json").read_text())["dovetail_fusion"])
    head.load_state_dict(state, assign=True, strict=True)
    return quantize_projections(head, projections) if projections else head


def _quantized_weights(head: DraftHead) -> dict[str, tuple[torch.Tensor, ...]]:
    from cpu_worker.kernels.block_quant import BlockQuantLinear
    from cpu_worker.kernels.int8 import RowwiseInt8Linear

    found: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, module in head.named_modules():
        if isinstance(module, RowwiseInt8Linear):
            found[name] = (module.int8_weight(),)
        elif isinstance(module, BlockQuantLinear):
            found[name] = (module.weights.data, module.weights.scales)
    return found


@pytest.mark.parametrize("projections", [None, "int8", "q4_0"])
def test_tensor_by_tensor_load_equals_the_old_path(tmp_path, projections):
    """fp16 files, frozen embedding/lm_head from the target: the streamed head holds the very
    tensors (and quantized weights) the read-all-then-convert path built, and computes the same bits."""
    from safetensors.torch import load_file, save_file

    target = save_tiny_target(tmp_path / "target")
    head = tiny_head("dgf", layers=2)
    draft = save_head(head, tmp_path / "draft", include_frozen=False)
    weights = draft / "model.safetensors"
    save_file({name: tensor.half() for name, tensor in load_file(str(weights)).items()}, str(weights))
    old = _old_path_head(draft, target, projections)
    new = load_head(draft, target, projections=projections)
    assert new.projection_format == projections
    old_state, new_state = old.state_dict(), new.state_dict()
    assert old_state.keys() == new_state.keys()
    assert all(torch.equal(old_state[name], new_state[name]) and new_state[name].dtype == torch.float32
               for name in old_state)
    old_weights, new_weights = _quantized_weights(old), _quantized_weights(new)
    assert old_weights.keys() == new_weights.keys() and len(new_weights) == (2 * 4 + 1 + 3 if projections else 0)
    assert all(torch.equal(a, b) for name in old_weights for a, b in zip(old_weights[name], new_weights[name]))
    assert not new.embed_tokens.weight.requires_grad
    features, tokens = random_pairs(9)
    assert torch.equal(run_head(old, features, tokens, [5, 4]), run_head(new, features, tokens, [5, 4]))


@pytest.mark.parametrize("projections", ["int8", "q4_0"])
def test_a_quantized_eagle3_head_from_fp16_files_is_its_fp32_load_quantized(tmp_path, projections):
    """An fp16 EAGLE-3 folder at int8/q4_0 is read whole, but each projection is widened to fp32 only
    as it is quantized: the quantized weights, the other tensors' values and the trees are those of
    loading it in fp32 and quantizing after."""
    from safetensors.torch import load_file, save_file

    from conftest import DEMO_TARGET
    from eagle3_folders import save_published_eagle3

    draft = save_published_eagle3(tmp_path / "e3", DEMO_TARGET, range(0, 8192, 64), aux_layers=[1, 3, 4])
    weights = draft / "model.safetensors"
    save_file({name: tensor.half() if tensor.is_floating_point() else tensor
               for name, tensor in load_file(str(weights)).items()}, str(weights))
    new = load_head(draft, DEMO_TARGET, projections=projections)
    old = quantize_projections(load_head(draft, DEMO_TARGET), projections)
    old_weights, new_weights = _quantized_weights(old), _quantized_weights(new)
    assert old_weights.keys() == new_weights.keys() and len(new_weights) >= 6
    assert all(torch.equal(a, b) for name in old_weights for a, b in zip(old_weights[name], new_weights[name]))
    old_state, new_state = old.state_dict(), new.state_dict()
    assert old_state.keys() == new_state.keys()
    for name, tensor in new_state.items():  # the embedding stays fp16 (widened on lookup); the rest as fp32's
        assert torch.equal(tensor.to(old_state[name].dtype), old_state[name]), name
        assert tensor.dtype == old_state[name].dtype or name == "embed_tokens.weight", name
    drafters = [Drafter(head, max_len=64) for head in (old, new)]
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(10, drafters[0].feature_size, generator=generator)
    tokens = torch.randint(0, new.spec.vocab_size, (10,), generator=generator)
    trees = []
    for drafter in drafters:
        drafter.extend(features, tokens)
        trees.append(drafter.propose(TreeShape.clamped(8, 4, 4)))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].scores, trees[1].scores)


def test_misshapen_draft_weight_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    draft = save_head(tiny_head("dgf"), tmp_path / "draft")
    weights = draft / "model.safetensors"
    state = load_file(str(weights))
    state["W_1"] = state["W_1"][:, :8].contiguous()
    save_file(state, str(weights))
    with pytest.raises(DraftCheckpointError, match=r"W_1 \[64, 8\] \(expected \[64, 64\]\)"):
        load_head(draft)


@pytest.mark.parametrize("edit, message", [({"hidden_size": "64"}, "cannot parse .*expected int, got str"),
                                           ({"num_hidden_layers": 0}, "needs at least one decoder layer")])
def test_a_head_config_that_cannot_be_a_head_is_a_checkpoint_error(tmp_path, edit, message):
    draft = save_head(tiny_head("dgf"), tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | edit))  # each was a traceback from dovetail-train eval
    with pytest.raises(DraftCheckpointError, match=message):
        load_head(draft)


def test_a_one_node_tree_skips_the_heads_vocabulary_projection_and_changes_no_later_tree(demo_target):
    demo_draft = Path(__file__).resolve().parents[2] / "demo" / "draft-dgf"
    lazy = Drafter.from_pretrained(demo_draft, demo_target, max_len=64, device="cpu")
    eager = lazy.sibling()
    projections: list[int] = []
    original = lazy.head.log_probs
    lazy.head.log_probs = lambda rows: projections.append(len(rows)) or original(rows)  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(10, lazy.feature_size, generator=generator)
    tokens = torch.randint(3, 1000, (10,), generator=generator)
    for drafter in (lazy, eager):
        drafter.extend(features[:6], tokens[:6])
    root = lazy.propose(TreeShape.clamped(1, 1, 1))  # plain decoding: only the cache kept in step
    assert root.tokens.tolist() == [int(tokens[5])] and projections == []
    assert eager._root_log_probs is not None  # the projection the one-node tree skipped
    for drafter in (lazy, eager):
        drafter.extend(features[6:], tokens[6:])
    shape = TreeShape.clamped(8, 3, 4)
    lazy_tree, eager_tree = lazy.propose(shape), eager.propose(shape)
    assert projections and torch.equal(lazy_tree.tokens, eager_tree.tokens)
    assert torch.equal(lazy_tree.parents, eager_tree.parents)
