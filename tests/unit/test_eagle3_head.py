"""The EAGLE-3 head module against a reference forward written here from the equations (plain
torch ops): with a KV cache, incremental calls and a tree mask, for both fusions and for a deeper
head (plain layers after the EAGLE-3 one); the draft vocabulary mapping; int8 rows independent of
their call-mates; the aux-layer rule's errors."""

from __future__ import annotations

import math

import pytest
import torch

from cpu_worker.model.llama import LlamaSpec, RotaryTable
from gpu_worker.eagle3 import Eagle3Head, resolve_aux_layers

H, TARGET_H, VOCAB, DRAFT_VOCAB, HEADS, HEAD_DIM, FFN = 32, 24, 97, 40, 4, 8, 48


def tiny_spec(kv_heads: int, layers: int = 1) -> LlamaSpec:
    return LlamaSpec(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_layers=layers, num_heads=HEADS,
                     num_kv_heads=kv_heads, head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=256)


def tiny_eagle3(fusion: str, kv_heads: int = 4, seed: int = 0, layers: int = 1) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(tiny_spec(kv_heads, layers), target_hidden_size=TARGET_H, draft_vocab_size=DRAFT_VOCAB,
                      fusion=fusion)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            # Non-trivial norms too, so a swapped norm cannot pass.
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
            elif parameter.dim() == 2 and not name.startswith("W_"):
                parameter.normal_(0, 0.3)
    head.set_draft_vocab(torch.randperm(VOCAB)[:DRAFT_VOCAB])
    return head.eval()


# -- the reference: the published equations, nothing from the module ------------------------


def ref_rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))


def ref_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [heads, S, hd]: rotate the two halves by position * theta^(-2i/hd)."""
    half = HEAD_DIM // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / HEAD_DIM)
    angle = positions.double()[:, None] * freq[None, :]
    cos, sin = angle.cos().float(), angle.sin().float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ref_attention(w: dict[str, torch.Tensor], prefix: str, x_in: torch.Tensor, kv_heads: int,
                  positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Rotary multi-head attention of rows x_in [n, width] (row r sees rows c with allowed[r, c]),
    o_proj applied."""
    n = x_in.shape[0]
    q = (x_in @ w[f"{prefix}self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM).transpose(0, 1)
    k = (x_in @ w[f"{prefix}self_attn.k_proj.weight"].T).view(n, kv_heads, HEAD_DIM).transpose(0, 1)
    v = (x_in @ w[f"{prefix}self_attn.v_proj.weight"].T).view(n, kv_heads, HEAD_DIM).transpose(0, 1)
    q, k = ref_rope(q, positions), ref_rope(k, positions)
    group = HEADS // kv_heads
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = (q @ k.transpose(1, 2)) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(~allowed, float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, HEADS * HEAD_DIM)
    return attn @ w[f"{prefix}self_attn.o_proj.weight"].T


def ref_mlp(w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    m = ref_rms(x, w[f"{prefix}post_attention_layernorm.weight"])
    gate = m @ w[f"{prefix}mlp.gate_proj.weight"].T
    up = m @ w[f"{prefix}mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}mlp.down_proj.weight"].T


def ref_forward(state: dict[str, torch.Tensor], fusion: str, kv_heads: int, features: list[torch.Tensor],
                tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """All rows at once, no cache: row r attends to rows c with allowed[r, c]. features[r] is a
    target row (3 * TARGET_H) or a head output (H)."""
    w = state
    g = torch.stack([f @ w["fc.weight"].T if f.numel() == 3 * TARGET_H else f for f in features])
    e = w["embed_tokens.weight"][tokens]
    a = ref_rms(g, w["midlayer.hidden_norm.weight"])
    b = ref_rms(e, w["midlayer.input_layernorm.weight"])
    x = g + ref_attention(w, "midlayer.", torch.cat([b, a], dim=-1), kv_heads, positions, allowed)
    if fusion == "dgf-eagle3":
        h1 = a @ w["W_1"]
        h2 = torch.nn.functional.silu(b @ w["W_2"])
        z = torch.sigmoid(torch.cat([h1, h2], -1) @ w["W_z"])
        x = x + z * h1 + (1 - z) * h2
    x = x + ref_mlp(w, "midlayer.", x)
    # A deeper head: plain pre-norm Llama layers after it, same positions and mask.
    layer = 0
    while f"post_layers.{layer}.input_layernorm.weight" in w:
        prefix = f"post_layers.{layer}."
        x = x + ref_attention(w, prefix, ref_rms(x, w[f"{prefix}input_layernorm.weight"]), kv_heads, positions,
                              allowed)
        x = x + ref_mlp(w, prefix, x)
        layer += 1
    return x


def ref_log_probs(state: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(ref_rms(out, state["norm.weight"]) @ state["lm_head.weight"].T, dim=-1)


# -- the scenario: a 7-row context in two calls, then a 4-node tree in one masked call --------

PREFIX, CHUNKS = 7, (4, 3)
# Tree nodes: parent -1 is the context's last row.
PARENTS = (-1, -1, 0, 2)


def scenario(head: Eagle3Head, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (module outputs, reference outputs) for every row of the scenario."""
    gen = torch.Generator().manual_seed(3)
    target_rows = torch.randn(PREFIX, 3 * TARGET_H, generator=gen)
    tokens = torch.randint(0, VOCAB, (PREFIX + len(PARENTS),), generator=gen)
    cache = head.new_cache(32, torch.float32)
    rotary = RotaryTable(head.spec, 32, torch.float32)
    outs, start = [], 0
    with torch.no_grad():
        for size in CHUNKS:
            cos, sin = rotary.lookup(torch.arange(start, start + size))
            outs.append(head(target_rows[start:start + size], tokens[start:start + size], cos, sin, cache, start, None))
            start += size
        context_out = torch.cat(outs)
        # Tree rows take their parent's output as the feature; depth d sits at position PREFIX - 1 + d.
        depth, features, allowed_tree = [], [], torch.zeros(len(PARENTS), PREFIX + len(PARENTS), dtype=torch.bool)
        for node, parent in enumerate(PARENTS):
            depth.append(1 if parent < 0 else depth[parent] + 1)
            features.append(context_out[-1] if parent < 0 else None)
            allowed_tree[node, :PREFIX] = True
            allowed_tree[node, PREFIX + node] = True
            if parent >= 0:
                allowed_tree[node] |= allowed_tree[parent]
        # The tree's features depend on tree outputs: feed it level by level as a drafter would,
        # each level one masked call over the rows written so far.
        tree_out: list[torch.Tensor | None] = [None] * len(PARENTS)
        for level in sorted(set(depth)):
            nodes = [n for n in range(len(PARENTS)) if depth[n] == level]
            if nodes != list(range(nodes[0], nodes[-1] + 1)):
                raise AssertionError("the scenario's levels must be contiguous")
            rows = torch.stack([context_out[-1] if PARENTS[n] < 0 else tree_out[PARENTS[n]] for n in nodes])
            positions = torch.tensor([PREFIX - 1 + depth[n] for n in nodes])
            cos, sin = rotary.lookup(positions)
            first = PREFIX + nodes[0]
            mask = allowed_tree[nodes[0]:nodes[-1] + 1, :first + len(nodes)]
            level_out = head(rows, tokens[first:first + len(nodes)], cos, sin, cache, first, mask)
            for index, n in enumerate(nodes):
                tree_out[n] = level_out[index]
        got = torch.cat([context_out, torch.stack([t for t in tree_out if t is not None])])
    # Reference: the whole scenario in one shot from the equations.
    all_features = [target_rows[i] for i in range(PREFIX)] + [
        context_out[-1] if p < 0 else got[PREFIX + p] for p in PARENTS]
    positions = torch.tensor(list(range(PREFIX)) + [PREFIX - 1 + d for d in depth])
    allowed = torch.zeros(PREFIX + len(PARENTS), PREFIX + len(PARENTS), dtype=torch.bool)
    allowed[:PREFIX, :PREFIX] = torch.ones(PREFIX, PREFIX, dtype=torch.bool).tril()
    allowed[PREFIX:] = allowed_tree
    expected = ref_forward(head.state_dict(), head.fusion, kv_heads, all_features, tokens, positions, allowed)
    return got, expected


@pytest.mark.parametrize("fusion", ["eagle3", "dgf-eagle3"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("layers", [1, 3])
def test_forward_with_cache_and_tree_mask_matches_the_equations(fusion, kv_heads, layers):
    head = tiny_eagle3(fusion, kv_heads, layers=layers)
    assert len(head.post_layers) == layers - 1
    got, expected = scenario(head, kv_heads)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.log_probs(got), ref_log_probs(head.state_dict(), expected), rtol=1e-4, atol=1e-4)


def test_the_two_fusions_differ_and_a_wrong_width_is_refused():
    eagle3, dgf = tiny_eagle3("eagle3"), tiny_eagle3("dgf-eagle3")
    a, _ = scenario(eagle3, 4)
    b, _ = scenario(dgf, 4)
    assert not torch.allclose(a, b, atol=1e-3)
    assert dgf.W_1.shape == (H, H) and dgf.W_z.shape == (2 * H, H)
    with pytest.raises(ValueError, match="width 5"):
        eagle3.reduce(torch.zeros(2, 5))


def test_parameter_names_are_the_published_layout():
    head = tiny_eagle3("eagle3")
    shapes = {name: tuple(t.shape) for name, t in head.file_state_dict().items()}
    assert shapes == {
        "fc.weight": (H, 3 * TARGET_H),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": (4 * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": (4 * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": (FFN, H), "midlayer.mlp.up_proj.weight": (FFN, H),
        "midlayer.mlp.down_proj.weight": (H, FFN),
        "norm.weight": (H,), "lm_head.weight": (DRAFT_VOCAB, H), "d2t": (DRAFT_VOCAB,), "t2d": (VOCAB,),
    }
    assert head.feature_size == 3 * TARGET_H and head.hidden_size == H and head.vocab_size == VOCAB


def test_draft_vocabulary_maps_both_ways():
    head = tiny_eagle3("eagle3")
    chosen = torch.tensor([90, 3, 17, 4, 60] + list(range(20, 55)))
    head.set_draft_vocab(chosen)
    targets = head.target_draft_ids()
    assert targets.tolist() == sorted(chosen.tolist())
    assert head.t2d.sum() == DRAFT_VOCAB and bool(head.t2d[targets].all())
    assert head.draft_to_target(torch.tensor([0, DRAFT_VOCAB - 1])).tolist() == [3, 90]
    with pytest.raises(ValueError, match="distinct target ids"):
        head.set_draft_vocab(torch.tensor([1, 1, 2]))


@pytest.mark.parametrize("fusion,layers", [("eagle3", 1), ("dgf-eagle3", 1), ("dgf-eagle3", 2)])
def test_int8_rows_do_not_depend_on_their_call_mates(fusion, layers):
    head = tiny_eagle3(fusion, layers=layers).quantize_int8()
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(6, 3 * TARGET_H, generator=gen)
    rows[2] *= 40  # one large row: a per-call scale would change every other row's rounding
    own = torch.randn(6, H, generator=gen)
    tokens = torch.randint(0, VOCAB, (6,), generator=gen)
    rotary = RotaryTable(head.spec, 8, torch.float32)
    with torch.no_grad():
        together = head.reduce(rows)
        probs = head.log_probs(own)
        # One position each, no attention between rows: the whole layer is row-wise.
        alone_mask = torch.eye(6, dtype=torch.bool)
        cos, sin = rotary.lookup(torch.zeros(6, dtype=torch.long))
        layer = head.forward(own, tokens, cos, sin, head.new_cache(8, torch.float32), 0, alone_mask)
        for r in range(6):
            assert torch.equal(head.reduce(rows[r:r + 1])[0], together[r])
            assert torch.equal(head.log_probs(own[r:r + 1])[0], probs[r])
            single = head.forward(own[r:r + 1], tokens[r:r + 1], cos[r:r + 1], sin[r:r + 1],
                                  head.new_cache(8, torch.float32), 0, None)
            assert torch.equal(single[0], layer[r])
    # And int8 stays close to the float head.
    float_head = tiny_eagle3(fusion, layers=layers)
    with torch.no_grad():
        assert torch.allclose(float_head.reduce(rows), together, rtol=0.05, atol=0.05 * float(together.abs().max()))


def test_aux_layer_rule_and_its_errors():
    assert resolve_aux_layers(32) == (2, 16, 29)
    assert resolve_aux_layers(6, [1, 3, 4]) == (1, 3, 4)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids") as error:
        resolve_aux_layers(6)
    assert "[2, 3, 3]" in str(error.value)
    with pytest.raises(ValueError, match="--aux-layers"):
        resolve_aux_layers(6, [1, 4, 6], option="--aux-layers")
    with pytest.raises(ValueError, match="exactly three"):
        resolve_aux_layers(6, [1, 2])


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="unknown EAGLE-3 fusion"):
        Eagle3Head(tiny_spec(4), target_hidden_size=TARGET_H, draft_vocab_size=10, fusion="fc")
    with pytest.raises(ValueError, match="draft vocabulary size"):
        Eagle3Head(tiny_spec(4), target_hidden_size=TARGET_H, draft_vocab_size=VOCAB + 1)
