"""EAGLE-3 heads in the runtime: the target's three-layer rows, a published folder through
``--draft`` (a local folder or a hub id from the local cache), the reduced draft vocabulary
mapped to target ids in the tree, the errors, and losslessness end to end (greedy through
real processes; sampling by the exactness machinery of test_sampling)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from cpu_worker.model.model_dir import read_config
from gpu_worker.head_layout import FeatureLayout, HeadLayoutError, feature_layout
from ipc.messages import DraftSettings, RingNames

from conftest import DEMO_TARGET, save_random_head, save_tiny_model
from eagle3_folders import save_published_eagle3
from runtime_harness import TEST_PROMPTS, dovetail_run

DEMO_AUX = [1, 3, 4]  # the 6-layer demo target is too shallow for EAGLE's rule ({2, 3, 3})


# --- which rows a head reads --------------------------------------------------------------


def test_layouts_of_each_kind_of_head(tmp_path, demo_random_head):
    config = read_config(DEMO_TARGET)
    assert feature_layout(demo_random_head, config) == FeatureLayout(256)
    head = save_published_eagle3(tmp_path / "e3", DEMO_TARGET, range(0, 8192, 64), aux_layers=DEMO_AUX)
    layout = feature_layout(head, config)
    assert layout.aux_layers == (1, 3, 4) and layout.row_width == 768
    # No draft_vocab_size in the config: the safetensors keys still tell EAGLE-3.
    raw = json.loads((head / "config.json").read_text())
    raw.pop("draft_vocab_size")
    (head / "config.json").write_text(json.dumps(raw))
    assert feature_layout(head, config).row_width == 768
    # A 32-layer target takes EAGLE's rule.
    raw.pop("eagle_aux_hidden_state_layer_ids")
    (head / "config.json").write_text(json.dumps(raw))
    assert feature_layout(head, {**config, "num_hidden_layers": 32}).aux_layers == (2, 16, 29)


def test_a_target_too_shallow_for_the_rule_is_refused_at_startup(tmp_path):
    head = save_published_eagle3(tmp_path / "e3", DEMO_TARGET, range(0, 8192, 64))
    with pytest.raises(HeadLayoutError, match=r"\[2, 3, 3\].*eagle_aux_hidden_state_layer_ids"):
        feature_layout(head, read_config(DEMO_TARGET))
    done = dovetail_run("--target", str(DEMO_TARGET), "--draft", str(head), "--prompt", "x", "--log-level", "error")
    assert done.returncode == 2
    assert "too shallow" in done.stderr and "eagle_aux_hidden_state_layer_ids" in done.stderr, done.stderr[-2000:]


# --- the target's aux rows ----------------------------------------------------------------


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory) -> Path:
    """A 6-layer tiny llama (grouped-query heads) for the aux rows."""
    return save_tiny_model(tmp_path_factory.mktemp("deep") / "t", "llama", seed=2, num_hidden_layers=6,
                           num_key_value_heads=2)


def test_aux_rows_are_the_residual_streams_entering_the_layers(deep_target):
    """Against transformers' hidden_states (entry i: the input of layer i), on a prefill and on
    the accepted rows of a tree verification; logits stay those of the last-layer engine."""
    from transformers import AutoModelForCausalLM

    from cpu_worker.engine import TargetEngine
    from cpu_worker.target_loading import load_target_model

    layers = (0, 2, 5)
    model = load_target_model(deep_target)
    aux = TargetEngine(model, max_len=64, aux_layers=layers)
    plain = TargetEngine(model, max_len=64)
    reference = AutoModelForCausalLM.from_pretrained(str(deep_target), dtype=torch.float32).eval()
    prompt = [3, 14, 15, 92, 65, 35]
    step = aux.prefill(prompt)
    with torch.no_grad():
        states = reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[index][0] for index in layers], dim=-1)
    assert step.features.shape == (len(prompt), 3 * 64)
    torch.testing.assert_close(step.features, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(step.logits, plain.prefill(prompt).logits)
    # A tree whose path 0 -> 2 -> 3 carries the target's greedy tokens is accepted; its rows
    # are the streams at those positions of the whole sequence.
    first = int(step.logits.argmax())
    with torch.no_grad():
        greedy = reference.generate(torch.tensor([prompt + [first]]), max_new_tokens=2, do_sample=False,
                                    pad_token_id=0)[0, len(prompt) + 1:].tolist()
    tokens = [first, (greedy[0] + 1) % 97, greedy[0], greedy[1]]
    outcome = aux.verify(tokens, [-1, 0, 0, 2])
    assert outcome.accepted_nodes[:3] == [0, 2, 3]
    sequence = prompt + [first] + greedy
    with torch.no_grad():
        states = reference(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[index][0, len(prompt):len(prompt) + 3] for index in layers], dim=-1)
    torch.testing.assert_close(outcome.features[:3], expected, rtol=1e-5, atol=1e-5)


# --- loading a published folder -----------------------------------------------------------


def test_a_published_folder_loads_by_name_with_the_targets_embedding(tmp_path):
    from safetensors.torch import load_file

    from gpu_worker.checkpoint import load_head
    from gpu_worker.eagle3 import Eagle3Head

    ids = list(range(7, 8192, 97))
    folder = save_published_eagle3(tmp_path / "e3", DEMO_TARGET, ids, aux_layers=DEMO_AUX)
    head = load_head(folder, DEMO_TARGET)
    assert isinstance(head, Eagle3Head) and head.fusion == "eagle3"
    assert head.feature_size == 768 and head.draft_vocab_size == len(ids) and head.vocab_size == 8192
    files = load_file(folder / "model.safetensors")
    loaded = head.state_dict()
    for name, tensor in files.items():
        assert torch.equal(loaded[name], tensor.to(loaded[name].dtype)), name
    target = load_file(DEMO_TARGET / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(head.embed_tokens.weight, target.float())
    assert head.target_draft_ids().tolist() == ids


def test_the_tree_holds_target_ids_chosen_over_the_draft_vocabulary(tmp_path):
    """The root's children are the head's top-k draft ids mapped through d2t, and every node is
    in the draft vocabulary (a tree of raw draft ids would sit in 0..Vd-1)."""
    from cpu_worker.engine import TargetEngine
    from cpu_worker.target_loading import load_target_model
    from gpu_worker.drafter import Drafter
    from ipc.tree import TreeShape

    ids = sorted(torch.randperm(8192, generator=torch.Generator().manual_seed(1))[:300].tolist())
    folder = save_published_eagle3(tmp_path / "e3", DEMO_TARGET, ids, aux_layers=DEMO_AUX, seed=3)
    drafter = Drafter.from_pretrained(folder, DEMO_TARGET, max_len=128, device="cpu", dtype="fp32")
    engine = TargetEngine(load_target_model(DEMO_TARGET), max_len=128, aux_layers=DEMO_AUX)
    prompt = [1, 400, 1200, 33, 7]
    step = engine.prefill(prompt)
    first = int(step.logits.argmax())
    drafter.extend(step.features, prompt[1:] + [first])
    tree = drafter.propose(TreeShape.clamped(24, 5, 6))
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    assert len(tokens) == 24 and tokens[0] == first
    assert set(tokens[1:]) <= set(ids)
    root_children = {tokens[i] for i in range(1, 24) if parents[i] == 0}
    with torch.no_grad():
        best = drafter._root_log_probs.topk(6).indices  # the head's own scores over its draft ids
    assert root_children <= {ids[int(d)] for d in best}


# --- errors name the right side -----------------------------------------------------------


def edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


def test_errors_name_the_side_that_disagrees(tmp_path, demo_random_head):
    from safetensors.torch import load_file, save_file

    from gpu_worker.checkpoint import DraftCheckpointError, load_head

    ids = list(range(0, 8192, 4))  # a draft vocabulary of 2048
    folder = save_published_eagle3(tmp_path / "e3", DEMO_TARGET, ids, aux_layers=DEMO_AUX)
    # The head's draft vocabulary is its own: never reported as the target's.
    edit_config(folder, draft_vocab_size=1000)
    with pytest.raises(DraftCheckpointError) as error:
        load_head(folder, DEMO_TARGET)
    assert str(error.value) == (f"draft head draft_vocab_size 1000 (its config.json) does not match lm_head.weight "
                                f"in the draft folder {folder}, which has 2048 rows")
    edit_config(folder, draft_vocab_size=2048, vocab_size=32000)
    with pytest.raises(DraftCheckpointError, match=r"^draft head vocab_size 32000 \(its config.json\) does not match "
                                                   r"the target's vocab_size 8192$"):
        load_head(folder, DEMO_TARGET)
    edit_config(folder, vocab_size=8192)
    state = load_file(folder / "model.safetensors")
    twice = state["d2t"].clone()
    twice[1] = -1  # draft id 1 -> target id 0, as draft id 0
    save_file({**state, "d2t": twice}, str(folder / "model.safetensors"))
    with pytest.raises(DraftCheckpointError, match="d2t .* does not map the 2048 draft ids to distinct target ids"):
        load_head(folder, DEMO_TARGET)
    save_file({**state, "t2d": ~state["t2d"]}, str(folder / "model.safetensors"))
    with pytest.raises(DraftCheckpointError, match="t2d .* does not mark exactly the target ids d2t maps to"):
        load_head(folder, DEMO_TARGET)
    # An EAGLE-1/2-style head whose own lm_head has 2048 rows against its config's 8192: the
    # message used to call 2048 "the target's vocab size".
    own = tmp_path / "dgf"
    own.mkdir()
    (own / "config.json").write_text((demo_random_head / "config.json").read_text())
    dgf = load_file(demo_random_head / "model.safetensors")
    save_file({**dgf, "lm_head.weight": torch.zeros(2048, 256)}, str(own / "model.safetensors"))
    with pytest.raises(DraftCheckpointError) as error:
        load_head(own, DEMO_TARGET)
    assert str(error.value) == (f"draft head vocab size 8192 (its config.json) does not match lm_head.weight in the "
                                f"draft folder {own}, which has 2048 rows")


def test_the_gpu_worker_refuses_rows_it_was_not_built_for(tmp_path):
    """A published head stored as .bin without draft_vocab_size cannot be told from its files
    alone: the coordinator sizes last-layer rows, and the worker says why it cannot read them."""
    from safetensors.torch import load_file

    from gpu_worker.server import load_service

    folder = save_published_eagle3(tmp_path / "e3", DEMO_TARGET, range(0, 8192, 8), aux_layers=DEMO_AUX)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("draft_vocab_size")
    (folder / "config.json").write_text(json.dumps(raw))
    layout = feature_layout(folder, read_config(DEMO_TARGET))
    assert layout.row_width == 256
    settings = DraftSettings(draft=str(folder), target=str(DEMO_TARGET), max_len=64, scratch_len=8, device="cpu",
                             dtype="fp32", threads=1, row_width=layout.row_width, layout=layout.describe(),
                             rings=RingNames(cycle="unused", prefill="unused"))
    with pytest.raises(ValueError, match="reads target rows of 768 floats, but its folder was read as last-layer "
                                         "rows of 256"):
        load_service(settings)


# --- end to end: greedy through real processes, --draft as a hub id ------------------------


def frequent_ids(count: int) -> list[int]:
    """The demo tokenizer's most frequent ids over some of this repository's Python: a draft
    vocabulary the target often predicts, so even a random head gets drafts accepted."""
    from dovetail_runtime.tokenizer import Tokenizer

    root = Path(__file__).resolve().parents[2]
    text = "".join((root / name).read_text() for name in ("cpu_worker/engine.py", "gpu_worker/drafter.py"))
    return [token for token, _ in Counter(Tokenizer.from_dir(DEMO_TARGET).encode(text)).most_common(count)]


def cache_as_hub_id(cache: Path, repo: str, folder: Path) -> None:
    """Place ``folder`` in a Hugging Face cache at ``cache`` as the snapshot of ``repo``."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    base = cache / f"models--{repo.replace('/', '--')}"
    snapshot = base / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(revision)


def test_a_published_head_from_the_hub_cache_is_lossless_end_to_end(tmp_path, monkeypatch):
    """--draft org/name resolved offline from the local cache; greedy dovetail == --mode ar on
    the same workers, with drafts accepted, and both equal to transformers' greedy decode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = save_published_eagle3(tmp_path / "e3", DEMO_TARGET, frequent_ids(24), aux_layers=DEMO_AUX, seed=5)
    cache = tmp_path / "hub"
    cache_as_hub_id(cache, "dovetail-test/eagle3-tiny", folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = TEST_PROMPTS[:3]
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    done = dovetail_run("--target", str(DEMO_TARGET), "--draft", "dovetail-test/eagle3-tiny", "--compare-ar",
                        "--prompt-file", str(prompt_file), "--max-new-tokens", "40", "--json", "--log-level", "info",
                        "--tree-tokens", "16", "--depth", "6", "--tree-top-k", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rows of 768 = the inputs of target layers [1, 3, 4]" in done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    model = AutoModelForCausalLM.from_pretrained(str(DEMO_TARGET), dtype=torch.float32).eval()
    accepted = 0
    for line, prompt in zip(lines, prompts, strict=True):
        assert line["ar"]["same_tokens"] is True
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, pad_token_id=0)
        assert line["token_ids"] == out[0, len(ids):].tolist()
        accepted += line["stats"]["new_tokens"] - 1 - line["stats"]["cycles"]
    assert accepted > 0  # some cycles took draft tokens: the d2t-mapped tree reached the target


def test_draft_hub_ids_resolve_like_target_ones(tmp_path, monkeypatch):
    from dovetail_runtime.preflight import PreflightError, check_draft_dir

    folder = save_published_eagle3(tmp_path / "e3", DEMO_TARGET, range(0, 8192, 64), aux_layers=DEMO_AUX)
    cache = tmp_path / "hub"
    cache_as_hub_id(cache, "someone/eagle3-head", folder)
    import huggingface_hub.constants

    # Read at call time (the environment only when huggingface_hub was first imported).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    check_draft_dir("someone/eagle3-head")
    with pytest.raises(PreflightError, match="--draft: model 'someone/other' is neither a local folder nor in the "
                                             "local Hugging Face cache"):
        check_draft_dir("someone/other")


# --- sampling: exact in distribution with a draft that proposes a subset of the vocabulary --


@pytest.fixture(scope="module")
def subset_pair(tmp_path_factory):
    """The test_sampling target shape (8-token vocabulary, sharpened lm_head) with 4 layers, and
    a random EAGLE-3 head whose draft vocabulary is 5 of the 8 tokens."""
    from cpu_worker.engine import TargetEngine
    from cpu_worker.target_loading import load_target_model
    from gpu_worker.drafter import Drafter

    root = tmp_path_factory.mktemp("eagle3-sampling")
    target_dir = save_tiny_model(root / "target", "llama", seed=3, vocab_size=8, num_hidden_layers=4)
    model = load_target_model(target_dir)
    model.lm_head.weight.mul_(6.0)
    layers = [0, 1, 3]
    engine = TargetEngine(model, max_len=64, aux_layers=layers)
    head_dir = save_published_eagle3(root / "head", target_dir, [0, 2, 3, 5, 6], aux_layers=layers, seed=4)
    drafter = Drafter.from_pretrained(head_dir, target_dir, max_len=64, device="cpu", dtype="fp32")
    assert drafter.draft_vocab_size == 5
    return engine, drafter


def test_sampled_continuations_follow_the_target_with_a_subset_draft(subset_pair):
    from ipc.messages import Sampling

    from test_sampling import E2E_SAMPLES, chi_square_threshold, exact_continuations, pooled_chi_square, sample_dovetail

    engine, drafter = subset_pair
    params = Sampling(temperature=1.0)
    prompt = [1, 5, 2, 7]
    expected = exact_continuations(engine, prompt, 3, params)
    # Continuations with tokens the draft can never propose carry real mass: the test covers them.
    assert sum(p for key, p in expected.items() if set(key) - {0, 2, 3, 5, 6}) > 0.2
    counts = Counter(sample_dovetail(engine, drafter, prompt, 3, params, seed) for seed in range(E2E_SAMPLES))
    statistic, df = pooled_chi_square(counts, expected, E2E_SAMPLES)
    print(f"chi-square {statistic:.1f} with {df} df, threshold {chi_square_threshold(df):.1f}")
    assert statistic < chi_square_threshold(df), (statistic, df)


def test_seeded_dovetail_equals_seeded_ar_with_a_subset_draft(subset_pair):
    from ipc.messages import Sampling
    from ipc.tree import TreeShape

    from test_sampling import run_cycle, sample_ar

    engine, drafter = subset_pair
    prompt = [1, 5, 2, 7]
    params = Sampling(temperature=0.8, top_k=4)
    for seed in range(6):
        ar = sample_ar(engine, prompt, 16, params, seed)
        for shape in (TreeShape.clamped(7, 3, 2), TreeShape.clamped(12, 5, 5)):
            assert run_cycle(engine, drafter, prompt, 16, params, seed, shape) == ar, (seed, shape)


def test_a_random_dgf_head_still_reads_last_layer_rows(tmp_path):
    """The existing heads' path is unchanged: no aux layers, rows of the hidden size."""
    folder = save_random_head(tmp_path / "dgf", DEMO_TARGET)
    assert feature_layout(folder, read_config(DEMO_TARGET)) == FeatureLayout(256)


def saved_trained_head(folder: Path, fusion: str, layers: int, draft_ids: list[int], seed: int = 0) -> Path:
    """A random head in the shape dovetail-train writes, saved as it saves one."""
    import dataclasses

    from cpu_worker.model.loading import load_spec
    from gpu_worker.eagle3 import Eagle3Head
    from gpu_worker.train.eagle3_io import save_eagle3_head

    torch.manual_seed(seed)
    spec = dataclasses.replace(load_spec(DEMO_TARGET), num_layers=layers)
    trained = Eagle3Head(spec, target_hidden_size=256, draft_vocab_size=len(draft_ids), fusion=fusion)
    trained.set_draft_vocab(torch.tensor(draft_ids))
    return save_eagle3_head(trained, folder, DEMO_TARGET, tuple(DEMO_AUX))


@pytest.mark.parametrize("fusion,layers", [("eagle3", 1), ("dgf-eagle3", 1), ("dgf-eagle3", 2)])
def test_a_head_written_by_dovetail_train_loads_for_the_runtime(tmp_path, fusion, layers):
    """dovetail-train's EAGLE-3 folders (gpu_worker.train.eagle3_io) load through --draft's loader
    with every tensor as written, and say which layers they read; a deeper head keeps its depth."""
    from safetensors.torch import load_file

    from gpu_worker.checkpoint import DraftCheckpointError, load_head
    from gpu_worker.eagle3 import Eagle3Head

    folder = saved_trained_head(tmp_path / fusion, fusion, layers, torch.randperm(8192)[:300].tolist())
    assert feature_layout(folder, read_config(DEMO_TARGET)).aux_layers == (1, 3, 4)
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == layers
    head = load_head(folder, DEMO_TARGET)
    assert isinstance(head, Eagle3Head) and head.fusion == fusion
    assert head.spec.num_layers == layers and len(head.post_layers) == layers - 1
    written = load_file(str(folder / "model.safetensors"))
    assert written.keys() == head.file_state_dict().keys()
    for name, tensor in written.items():
        assert torch.equal(head.state_dict()[name], tensor), name
    if layers > 1:  # a config that disagrees with the weights is named
        edit_config(folder, num_hidden_layers=layers + 1)
        with pytest.raises(DraftCheckpointError, match=f"num_hidden_layers {layers + 1}, its weights hold {layers}"):
            load_head(folder, DEMO_TARGET)
    else:  # a one-layer head whose config copied the target's depth still loads as published ones do
        edit_config(folder, num_hidden_layers=6)
        assert load_head(folder, DEMO_TARGET).spec.num_layers == 1


def test_a_deeper_dgf_eagle3_head_is_lossless_end_to_end(tmp_path):
    """A two-layer dgf-eagle3 head (Dovetail's own depth) through the real workers: greedy
    dovetail gives --mode ar's tokens, with drafts accepted."""
    folder = saved_trained_head(tmp_path / "deep", "dgf-eagle3", 2, frequent_ids(24), seed=5)
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TEST_PROMPTS[:2]))
    done = dovetail_run("--target", str(DEMO_TARGET), "--draft", str(folder), "--compare-ar",
                        "--prompt-file", str(prompt_file), "--max-new-tokens", "32", "--json",
                        "--tree-tokens", "16", "--depth", "6", "--tree-top-k", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 2 and all(line["ar"]["same_tokens"] is True for line in lines)
    assert sum(line["stats"]["new_tokens"] - 1 - line["stats"]["cycles"] for line in lines) > 0
