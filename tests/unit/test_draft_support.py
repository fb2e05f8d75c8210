"""Shared helpers for the draft tests (no tests here): tiny heads, a plain-torch reference
of the head's forward, tiny transformers targets, and a brute-force EAGLE-2 tree."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from cpu_worker.model.llama import LlamaSpec
from gpu_worker.head import DraftHead

from tree_paths import path_to

VOCAB = 101
HIDDEN = 64


def tiny_spec(layers: int = 2, kv_heads: int = 2, hidden: int = HIDDEN, vocab: int = VOCAB) -> LlamaSpec:
    return LlamaSpec(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_layers=layers,
                     num_heads=4, num_kv_heads=kv_heads, head_dim=hidden // 4, rms_norm_eps=1e-6,
                     rope_theta=10000.0, max_position_embeddings=512)


def tiny_head(fusion: str = "dgf", layers: int = 2, seed: int = 0, sharpen: float = 1.0,
              fc_bias: bool = True, kv_heads: int = 2, vocab: int = VOCAB) -> DraftHead:
    """A random head; norms and biases perturbed so every weight matters; ``sharpen``
    scales lm_head so the top-k order is robust to 1e-6 noise."""
    torch.manual_seed(seed)
    head = DraftHead(tiny_spec(layers, kv_heads, vocab=vocab), fusion=fusion, fc_bias=fc_bias)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
        head.embed_tokens.weight.normal_()
        head.lm_head.weight.normal_(0, sharpen / math.sqrt(HIDDEN))
    return head.eval()


# ---------------------------------------------------------------- plain reference

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2).double() / dim))
    angles = positions.double()[:, None] * inv[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1).float()
    sin = torch.cat([angles.sin(), angles.sin()], -1).float()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def reference_head(weights: dict[str, torch.Tensor], config: dict, fusion: str,
                   features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Output features [S, d] for pairs at positions 0..S-1, full causal attention, no cache.
    ``config``: a Llama-style config dict (hidden_size, heads, kv heads, layers, eps, theta)."""
    w = {name: tensor.float() for name, tensor in weights.items()}
    eps = config["rms_norm_eps"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"]
    hd = d // heads
    emb = w["embed_tokens.weight"][tokens]
    if fusion == "fc":
        x = torch.cat([emb, features], -1) @ w["fc.weight"].T
        if "fc.bias" in w:
            x = x + w["fc.bias"]
    else:
        h1 = features @ w["W_1"]
        h2 = F.silu(_rms(emb, w["input_layernorm.weight"], eps) @ w["W_2"])
        z = torch.sigmoid(torch.cat([h1, h2], -1) @ w["W_z"])
        x = z * h1 + (1 - z) * h2
    size = x.shape[0]
    positions = torch.arange(size)
    causal = torch.ones(size, size).tril().bool()
    for layer in range(config["num_hidden_layers"]):
        p = f"layers.{layer}."
        a = x if layer == 0 else _rms(x, w[p + "input_layernorm.weight"], eps)
        q = (a @ w[p + "self_attn.q_proj.weight"].T).view(size, heads, hd).transpose(0, 1)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).view(size, kv, hd).transpose(0, 1)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).view(size, kv, hd).transpose(0, 1)
        q, k = _rope(q, positions, config["rope_theta"]), _rope(k, positions, config["rope_theta"])
        k = k.repeat_interleave(heads // kv, 0)
        v = v.repeat_interleave(heads // kv, 0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(hd)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + attn.transpose(0, 1).reshape(size, d) @ w[p + "self_attn.o_proj.weight"].T
        m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = m @ w[p + "mlp.gate_proj.weight"].T
        up = m @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return x


def spec_config(spec: LlamaSpec) -> dict:
    return dict(hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, num_hidden_layers=spec.num_layers,
                rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta)


class PathOracle:
    """The head's output feature and log-probs after the committed pairs plus a tree path,
    recomputed from scratch with ``reference_head`` (memoised by path)."""

    def __init__(self, head: DraftHead, features: torch.Tensor, tokens: torch.Tensor):
        self.weights = head.state_dict()
        self.config = spec_config(head.spec)
        self.fusion = head.fusion
        self.features, self.tokens = features, tokens
        self.memo: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, path: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if path not in self.memo:
            # Node path[i] pairs with the head's output one step earlier (the prefix path[:i]).
            feats = torch.cat([self.features] + [self(path[:i])[0][None] for i in range(len(path))])
            toks = torch.cat([self.tokens, torch.tensor(path, dtype=torch.long)])
            out = reference_head(self.weights, self.config, self.fusion, feats, toks)[-1]
            log_probs = torch.log_softmax(out @ self.weights["lm_head.weight"].float().T, -1)
            self.memo[path] = (out, log_probs)
        return self.memo[path]


def brute_force_tree(oracle: PathOracle, tree_tokens: int, depth: int, top_k: int) -> dict[tuple[int, ...], float]:
    """EAGLE-2 selection written out node by node: {path of tokens below the root: score}."""
    if tree_tokens == 1:
        return {}
    levels = min(depth, tree_tokens - 1)
    root_lp = oracle(())[1]
    values, indices = root_lp.topk(top_k)
    beam = [((int(t),), float(v)) for v, t in zip(values, indices)]
    candidates = list(beam)
    for level in range(1, levels):
        children = []
        for path, score in beam:
            values, indices = oracle(path)[1].topk(top_k)
            children += [(path + (int(t),), score + float(v)) for v, t in zip(values, indices)]
        candidates += children
        if level + 1 < levels:
            beam = sorted(children, key=lambda c: -c[1])[:top_k]
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i][1], i))[:tree_tokens - 1]
    return {candidates[i][0]: candidates[i][1] for i in order}


def tree_paths(tree) -> dict[tuple[int, ...], float]:
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    return {tuple(tokens[n] for n in path_to(parents, node)[1:]): float(tree.scores[node])
            for node in range(1, len(tokens))}


# ---------------------------------------------------------------- tiny targets

def save_tiny_target(directory: Path, hidden: int = HIDDEN, vocab: int = VOCAB, weight_format: str = "safetensors",
                     tied: bool = False, seed: int = 0) -> Path:
    """A random transformers LlamaForCausalLM: 'safetensors', 'sharded' or 'bin'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    if weight_format == "bin":
        config.save_pretrained(directory)
        state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        torch.save(state, directory / "pytorch_model.bin")
    elif weight_format == "sharded":
        model.save_pretrained(directory, max_shard_size="20KB")
    else:
        model.save_pretrained(directory)
    return directory


def target_frozen(directory: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    return model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()


def write_eagle_checkpoint(directory: Path, weights: dict[str, torch.Tensor], config: dict,
                           weight_format: str = "bin") -> Path:
    """The published EAGLE-1/2 layout: llama config naming no fusion, fp16 weights."""
    directory.mkdir(parents=True, exist_ok=True)
    published = {
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "initializer_range": 0.02, "model_type": "llama", "pad_token_id": 0, "pretraining_tp": 1,
        "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.28.1", "use_cache": True, "intermediate_size": 96,
        "max_position_embeddings": 2048, "vocab_size": VOCAB,
    }
    published.update(config)
    (directory / "config.json").write_text(json.dumps(published))
    weights = {k: v.half().contiguous() for k, v in weights.items()}
    if weight_format == "bin":
        torch.save(weights, directory / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(weights, str(directory / "model.safetensors"))
    return directory
