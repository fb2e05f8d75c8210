"""Inflate an EAGLE-3 head (``eagle3`` or ``dgf-eagle3``, ``gpu_worker.eagle3``) to a stand-in shape.

``../shared/testbed/inflate.py`` inflates a small target to a real model's shape without changing
what it computes, and its ``head`` command does the same for Dovetail's DGF and fc heads; this is
the same construction for the EAGLE-3 layout, reusing inflate.py's geometry (``Geometry``: which
big rows and columns hold the small ones, norm weights / sqrt(s), query scale, RoPE theta):

- every H-wide input (the token's embedding, the head's feature, each of the three target rows)
  carries the small values in its first h dims and zeros elsewhere, as the inflated target's
  residual streams do; so ``fc`` [h, 3h] lands in [H, 3H] block by block, and the attention's
  q/k/v, which read [embedding; feature] (2h wide), read [0, h) and [H, H + h) of a 2H row;
- the DGF gate (``W_1``, ``W_2`` [h, h], ``W_z`` [2h, h]) goes top-left, ``W_z``'s two row blocks at
  0 and H (on padded dims z = sigmoid(0) multiplies zeros);
- the draft vocabulary, ``d2t`` and ``t2d`` are unchanged; ``lm_head`` gets zero columns.

So the inflated head proposes the small head's trees on the inflated target's rows, at a 7B-13B
head's cost::

    python -m tools.inflate_eagle3 HEAD DST --target-src SMALL_TARGET --shape llama2-7b
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import torch

REPO = Path(__file__).resolve().parents[1]
# The shared testbed's script beside the repo; DOVETAIL_INFLATE points elsewhere (a device machine
# gets the repo alone, so tools/device_check.sh carries a copy).
INFLATE = Path(os.environ.get("DOVETAIL_INFLATE") or REPO.parent / "shared" / "testbed" / "inflate.py")


def inflate_path() -> Path:
    """The shared testbed's ``inflate.py`` (a clear error when it is not there)."""
    if not INFLATE.is_file():
        raise click.ClickException(f"{INFLATE} is missing: this needs the shared testbed's inflate.py "
                                   "(a checkout with shared/ beside the repo, or DOVETAIL_INFLATE)")
    return INFLATE


def inflate_module() -> ModuleType:
    """``inflate.py`` imported as a module (its SHAPES, Geometry, read, ...): one source of truth."""
    spec = importlib.util.spec_from_file_location("_dovetail_inflate", inflate_path())
    if spec is None or spec.loader is None:
        raise click.ClickException(f"cannot import {INFLATE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks(weight: torch.Tensor, block: int, big_block: int) -> torch.Tensor:
    """``weight``'s columns in blocks of ``block``, block j moved to column j * ``big_block`` (zeros between)."""
    blocks = weight.shape[1] // block
    out = torch.zeros(weight.shape[0], blocks * big_block)
    for j in range(blocks):
        out[:, j * big_block:j * big_block + block] = weight[:, j * block:(j + 1) * block]
    return out


def inflate_attention(geo: Any, small: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The midlayer's attention: q/k/v read [embedding; feature] (2h -> 2H), o_proj writes H."""
    H, h, hd = geo.H, geo.h, geo.hd
    q_small, k_small, v_small = (_blocks(small[prefix + f"{name}_proj.weight"], h, H) for name in "qkv")
    q = torch.zeros(geo.nh * hd, 2 * H)
    q[geo.q_rows] = q_small * geo.q_scale
    k = torch.zeros(geo.nkv * hd, 2 * H)
    k[geo.kv_dst] = k_small[geo.kv_src]
    v = torch.zeros(geo.nkv * hd, 2 * H)
    v[geo.kv_dst] = v_small[geo.kv_src]
    o = torch.zeros(H, geo.nh * hd)
    o[:h, geo.q_rows] = small[prefix + "o_proj.weight"]
    return {prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v,
            prefix + "o_proj.weight": o}


def inflate_mlp(geo: Any, small: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    H, h = geo.H, geo.h
    gate = torch.zeros(geo.inter, H)
    gate[:geo.sinter, :h] = small[prefix + "gate_proj.weight"]
    up = torch.zeros(geo.inter, H)
    up[:geo.sinter, :h] = small[prefix + "up_proj.weight"]
    down = torch.zeros(H, geo.inter)
    down[:h, :geo.sinter] = small[prefix + "down_proj.weight"]
    return {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up, prefix + "down_proj.weight": down}


def inflate_eagle3_weights(geo: Any, small: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of a one-layer EAGLE-3 head folder at ``geo``'s shape."""
    if any(name.startswith("post_layers.") for name in small):
        raise click.ClickException("only one-layer EAGLE-3 heads inflate here (this one has post_layers)")
    H, h = geo.H, geo.h
    fc = torch.zeros(H, 3 * H)
    fc[:h] = _blocks(small["fc.weight"], h, H)  # each target row's h values lead its H-wide block
    out = {"fc.weight": fc}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        out[norm + ".weight"] = geo.norm(small[norm + ".weight"])
    out.update(inflate_attention(geo, small, "midlayer.self_attn."))
    out.update(inflate_mlp(geo, small, "midlayer.mlp."))
    if "W_z" in small:  # dgf-eagle3: [in, out] layout
        for name in ("W_1", "W_2"):
            out[name] = torch.zeros(H, H)
            out[name][:h, :h] = small[name]
        out["W_z"] = torch.zeros(2 * H, H)
        out["W_z"][:h, :h] = small["W_z"][:h]
        out["W_z"][H:H + h, :h] = small["W_z"][h:]
    out["lm_head.weight"] = torch.zeros(small["lm_head.weight"].shape[0], H)
    out["lm_head.weight"][:, :h] = small["lm_head.weight"]
    expected = set(small) - {"d2t", "t2d"}
    if set(out) != expected:
        raise click.ClickException(f"unexpected head tensors: missing {sorted(expected - set(out))}, "
                                   f"made {sorted(set(out) - expected)}")
    return out


def inflate_eagle3_head(src: Path, dst: Path, target_src: Path, shape: str, dtype: str = "fp16") -> Path:
    """Write ``dst`` (config.json + model.safetensors): the head in ``src`` for the small target
    ``target_src`` inflated to ``shape`` (one of inflate.py's SHAPES)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    inflate = inflate_module()
    if shape not in inflate.SHAPES:
        raise click.ClickException(f"unknown shape {shape!r}; inflate.py knows {', '.join(sorted(inflate.SHAPES))}")
    for folder in (target_src, src):
        if not (folder / "config.json").is_file():
            raise click.ClickException(f"{folder} has no config.json: not a model folder")
    small_target = json.loads((target_src / "config.json").read_text())
    head_config = json.loads((src / "config.json").read_text())
    if "draft_vocab_size" not in head_config:
        raise click.ClickException(f"{src} is not an EAGLE-3 head folder (its config names no draft_vocab_size)")
    # A head for another target fails deep in the tensor copies (a RuntimeError about expanded sizes).
    trained_for = head_config.get("target_hidden_size", head_config.get("hidden_size"))
    if trained_for != small_target.get("hidden_size"):
        raise click.ClickException(f"{src} reads a target of hidden size {trained_for}; {target_src} has "
                                   f"{small_target.get('hidden_size')}: give the target the head was trained for")
    # The layer count is the target's business (Geometry refuses fewer than the source's): not the head's.
    geo = inflate.Geometry(small_target, shape, max(inflate.SHAPES[shape][5], small_target["num_hidden_layers"]))
    small: dict[str, torch.Tensor] = {}
    with safe_open(str(src / "model.safetensors"), "pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open is no dict)
            small[key] = handle.get_tensor(key)
    maps = {name: small.pop(name) for name in ("d2t", "t2d") if name in small}
    weights = inflate_eagle3_weights(geo, {name: tensor.float() for name, tensor in small.items()})
    store = inflate.DTYPES[dtype]
    tensors = {name: tensor.to(store).contiguous() for name, tensor in weights.items()} | maps
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = geo.config(head_config, int(head_config.get("num_hidden_layers", 1)))
    config.update(target_hidden_size=geo.H, torch_dtype={"fp16": "float16", "bf16": "bfloat16",
                                                          "fp32": "float32"}[dtype])
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


@click.command(help=__doc__.split("\n\n")[0])
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option("--target-src", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The small target the head was trained for (its HF folder).")
@click.option("--shape", default="llama2-7b", show_default=True, help="One of inflate.py's SHAPES.")
@click.option("--dtype", type=click.Choice(["fp16", "bf16", "fp32"]), default="fp16", show_default=True)
def main(src: Path, dst: Path, target_src: Path, shape: str, dtype: str) -> None:
    click.echo(inflate_eagle3_head(src, dst, target_src, shape, dtype))


if __name__ == "__main__":
    main()
