"""A quantized target keeps its embedding table as the checkpoint stores it (fp16/bf16 values, a GGUF
file's blocks) and widens looked-up rows to fp32: the rows, and so the logits, of an fp32 table."""

from __future__ import annotations

import copy

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_support import write_gguf
from torch import nn

from cpu_worker.engine import TargetEngine
from cpu_worker.model.embedding import BlockEmbedding, StoredEmbedding, output_dtype
from cpu_worker.model.gguf_file import GGUFFile
from cpu_worker.model.gguf_loading import gguf_tensors, read_float
from cpu_worker.native import library as native
from cpu_worker.target_loading import load_target_model
from gpu_worker.drafter import Drafter
from ipc.tree import TreeShape

from conftest import DEMO_DRAFT, DEMO_TARGET, save_tiny_model
from eagle3_folders import save_published_eagle3

Q = GGMLQuantizationType
PROMPT = [3, 17, 42, 5, 88, 60, 2, 9, 31]


def logits(model: nn.Module) -> torch.Tensor:
    return TargetEngine(model, max_len=64).prefill(PROMPT).logits


def with_fp32_table(model: nn.Module, table: torch.Tensor) -> torch.Tensor:
    """The model's logits with its embedding swapped for an ordinary fp32 one holding ``table``."""
    model.embed_tokens = nn.Embedding.from_pretrained(table.float(), freeze=True)
    return logits(model)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama saved in fp32 and again in fp16 and bf16 (with a tied embedding: the lm_head comes
    from the stored table too)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("embedding")
    fp32 = save_tiny_model(root / "fp32", "llama", seed=4, tie_word_embeddings=True)
    made = {"fp32": fp32}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        AutoModelForCausalLM.from_pretrained(fp32, dtype=dtype).save_pretrained(root / name)
        made[name] = root / name
    return made


@pytest.mark.parametrize("stored", ["fp16", "bf16"])
@pytest.mark.parametrize("precision", ["q8_0", "q4_0-a16", "int8-row"])
def test_a_quantized_folder_keeps_its_narrow_table_with_the_fp32_tables_logits(folders, stored, precision):
    model = load_target_model(folders[stored], precision)
    embedding = model.embed_tokens
    assert isinstance(embedding, StoredEmbedding) and embedding.weight.dtype == getattr(torch, {
        "fp16": "float16", "bf16": "bfloat16"}[stored])
    assert output_dtype(embedding) == torch.float32
    ids = torch.tensor([0, 5, 5, embedding.weight.shape[0] - 1])
    assert torch.equal(embedding(ids), embedding.weight[ids].float())
    assert embedding(ids).dtype == torch.float32
    assert torch.equal(logits(model), with_fp32_table(model, embedding.weight.detach()))


def test_fp32_folders_and_unquantized_models_keep_an_ordinary_table(folders):
    assert type(load_target_model(folders["fp32"], "q8_0").embed_tokens) is nn.Embedding
    fp16_at_fp32 = load_target_model(folders["fp16"], "fp32")  # the tied lm_head needs the fp32 table itself
    assert type(fp16_at_fp32.embed_tokens) is nn.Embedding
    assert fp16_at_fp32.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("stored, kind", [(Q.Q8_0, BlockEmbedding), (Q.Q4_0, BlockEmbedding), (Q.Q4_1, BlockEmbedding),
                                          (Q.F16, StoredEmbedding), (Q.F32, nn.Embedding)])
def test_a_quantized_gguf_keeps_its_files_table_with_the_dequantized_tables_logits(folders, tmp_path, stored, kind):
    path = write_gguf(folders["fp32"], tmp_path / "m.gguf", {"proj": Q.Q4_0, "embd": stored, "output": Q.Q8_0})
    model = load_target_model(path, "q4_0")
    assert type(model.embed_tokens) is kind
    with GGUFFile(path) as file:
        table = read_float(file, file.tensors["token_embd.weight"])  # the whole table, dequantized at once
    ids = torch.tensor([[1, 2], [table.shape[0] - 1, 1]])
    assert torch.equal(model.embed_tokens(ids), table[ids])
    assert torch.equal(logits(model), with_fp32_table(model, table))
    assert type(load_target_model(path, "fp32").embed_tokens) is nn.Embedding  # floats: a float table


@pytest.mark.parametrize("stored", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_the_native_row_lookup_gives_ggufs_floats_bit_for_bit(stored):
    """Random block bytes (any finite fp16 scale and minimum: subnormal, negative, zero), every row
    widened by block_rows.c and by gguf's own dequantizer: the same bits, signed zeros included."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES

    block, block_bytes = GGML_QUANT_SIZES[stored]
    rows, width = 64, 4 * block
    generator = np.random.default_rng(5)
    table = generator.integers(0, 256, size=(rows, width // block * block_bytes), dtype=np.uint8)
    halves = table.reshape(rows, -1, block_bytes)[:, :, :4].copy().view(np.uint16)
    halves[(halves & 0x7C00) == 0x7C00] &= 0x3FFF  # no inf or NaN scales: a file's scales are finite
    table.reshape(rows, -1, block_bytes)[:, :, :4] = halves.view(np.uint8)
    native_rows = BlockEmbedding(table, stored, width)
    assert native_rows._native_type is not None and native.load() is not None  # the native path runs
    gguf_rows = copy.deepcopy(native_rows)  # a copy works (a trainer copies a head): no library held
    gguf_rows._native_type = None  # gguf.quants.dequantize, as for types the library does not read
    ids = torch.arange(rows).flip(0).reshape(2, -1)
    ours, theirs = native_rows(ids), gguf_rows(ids)
    assert ours.shape == (2, rows // 2, width)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    with pytest.raises(ValueError, match="bytes a row"):  # a table whose rows are not the width's blocks
        BlockEmbedding(table[:, :-1], stored, width)


def test_a_block_table_refuses_ids_outside_the_vocabulary(folders, tmp_path):
    path = write_gguf(folders["fp32"], tmp_path / "m.gguf", {"proj": Q.Q8_0, "embd": Q.Q8_0, "output": Q.Q8_0})
    embedding = load_target_model(path, "q8_0").embed_tokens
    assert isinstance(embedding, BlockEmbedding)
    for bad in (-1, embedding.num_embeddings):
        with pytest.raises(IndexError, match="token ids must be in"):
            embedding(torch.tensor([0, bad]))
        with pytest.raises(IndexError, match="token ids must be in"):  # one id: a decode step's check
            embedding(torch.tensor([bad]))
    assert embedding(torch.tensor([], dtype=torch.long)).shape == (0, embedding.hidden_size)
    last = embedding.num_embeddings - 1
    assert torch.equal(embedding(torch.tensor([last])), embedding(torch.tensor([0, last]))[1:])


@pytest.mark.parametrize("projections", ["int8", "q4_0"])
@pytest.mark.parametrize("layout", ["dgf", "eagle3"])
def test_a_quantized_cpu_head_keeps_an_fp16_targets_table_with_the_fp32_tables_tree(projections, layout, tmp_path):
    """The demo target is stored in fp16: a quantized head on the CPU (read tensor by tensor, or an
    EAGLE-3 head read whole) keeps that table and drafts the tree it drafts over an fp32 copy of it."""
    draft = DEMO_DRAFT if layout == "dgf" else \
        save_published_eagle3(tmp_path / "e3", DEMO_TARGET, range(0, 8192, 64), aux_layers=[1, 3, 4])
    heads = [Drafter.from_pretrained(draft, DEMO_TARGET, max_len=256, device="cpu", dtype=projections)
             for _ in range(2)]
    stored = heads[0].head.embed_tokens
    assert isinstance(stored, StoredEmbedding) and stored.weight.dtype == torch.float16
    assert heads[0].dtype == torch.float32
    heads[1].head.embed_tokens = nn.Embedding.from_pretrained(stored.weight.detach().float(), freeze=True)
    assert_same_trees(heads)


def assert_same_trees(heads: list[Drafter]) -> None:
    """Both drafters, given the same rows, draft the same tree with the same scores."""
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(12, heads[0].feature_size, generator=generator)
    tokens = torch.randint(0, heads[0].head.spec.vocab_size, (12,), generator=generator)
    trees = []
    for drafter in heads:
        drafter.extend(features, tokens)
        trees.append(drafter.propose(TreeShape.clamped(8, 4, 4)))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    assert torch.equal(trees[0].scores, trees[1].scores)


@pytest.fixture(scope="module")
def demo_ggufs(tmp_path_factory):
    """The demo target as GGUF files whose embedding is Q8_0, F16 or F32."""
    root = tmp_path_factory.mktemp("demo-gguf")
    return {stored: write_gguf(DEMO_TARGET, root / f"{stored.name}.gguf",
                               {"proj": Q.Q8_0, "embd": stored, "output": Q.Q8_0})
            for stored in (Q.Q8_0, Q.F16, Q.F32)}


@pytest.mark.parametrize("stored, kind", [(Q.Q8_0, BlockEmbedding), (Q.F16, StoredEmbedding), (Q.F32, nn.Embedding)])
@pytest.mark.parametrize("layout", ["dgf", "eagle3"])
def test_a_quantized_cpu_head_keeps_a_gguf_targets_table_as_the_file_stores_it(demo_ggufs, stored, kind, layout,
                                                                                tmp_path):
    """A quantized head on the CPU takes a GGUF target's embedding in the file's blocks (or its fp16
    values), not as an fp32 copy, and drafts the tree the whole table dequantized gives; a float head
    keeps an ordinary fp32 table."""
    target = demo_ggufs[stored]
    draft = DEMO_DRAFT if layout == "dgf" else \
        save_published_eagle3(tmp_path / "e3", DEMO_TARGET, range(0, 8192, 64), aux_layers=[1, 3, 4])
    heads = [Drafter.from_pretrained(draft, target, max_len=256, device="cpu", dtype="int8") for _ in range(2)]
    assert type(heads[0].head.embed_tokens) is kind
    assert heads[0].device == torch.device("cpu") and heads[0].dtype == torch.float32
    table = gguf_tensors(target, {"model.embed_tokens.weight"})["model.embed_tokens.weight"]
    assert table.dtype == torch.float32
    heads[1].head.embed_tokens = nn.Embedding.from_pretrained(table, freeze=True)
    assert_same_trees(heads)
    float_head = Drafter.from_pretrained(draft, target, max_len=256, device="cpu", dtype="fp32").head
    assert type(float_head.embed_tokens) is nn.Embedding and float_head.embed_tokens.weight.dtype == torch.float32
