"""End to end on a tiny random target: features -> train -> a head that dovetail-run and the
drafter load as is; training resumes exactly; the tau evaluation is lossless."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cpu_worker.engine import TargetEngine, greedy_decode
from cpu_worker.target_loading import load_target_model
from dovetail_runtime.train_cli import main as train_cli
from gpu_worker.checkpoint import load_head
from gpu_worker.drafter import Drafter
from gpu_worker.train.shards import load_features
from gpu_worker.train.trainer import TrainConfig, evaluate_loss, new_head, train
from ipc.tree import TreeShape

from test_train_support import tiny_corpus, tiny_target  # noqa: F401 (fixtures)

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def feature_dirs(tmp_path_factory, tiny_target, tiny_corpus) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("train-features")
    for name, split in (("train", "all"), ("heldout", "all")):
        result = CliRunner().invoke(train_cli, [
            "features", "--target", str(tiny_target), "--out", str(root / name), "--input", str(tiny_corpus),
            "--window", "64", "--split", split, "--threads", "1",
            "--shuffle-seed", "0" if name == "train" else "1"])
        assert result.exit_code == 0, result.output
    return root / "train", root / "heldout"


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory, tiny_target, feature_dirs) -> Path:
    out = tmp_path_factory.mktemp("heads") / "dgf-2"
    train_dir, heldout_dir = feature_dirs
    result = CliRunner().invoke(train_cli, [
        "train", "--target", str(tiny_target), "--features", str(train_dir), "--heldout", str(heldout_dir),
        "--out", str(out), "--fusion", "dgf", "--layers", "2", "--batch-size", "4", "--steps", "60",
        "--lr", "3e-3", "--warmup", "5", "--eval-every", "30", "--save-every", "30", "--threads", "1"])
    assert result.exit_code == 0, result.output
    return out


def test_training_lowers_the_loss(tiny_target, feature_dirs, trained_head):
    records = [json.loads(line) for line in (trained_head / "train_log.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert train_losses[-1] < 0.7 * train_losses[0]
    heldout = load_features(feature_dirs[1])
    before = evaluate_loss(new_head(tiny_target, "dgf", 2, seed=0), heldout)
    after = evaluate_loss(load_head(trained_head, tiny_target), heldout)
    assert after["loss"] < 0.7 * before["loss"]
    assert after["top1"] > before["top1"]


def test_trained_head_loads_without_frozen_weights(tiny_target, trained_head):
    config = json.loads((trained_head / "config.json").read_text())
    assert config["dovetail_fusion"] == "dgf" and config["num_hidden_layers"] == 2
    from safetensors import safe_open

    with safe_open(str(trained_head / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "lm_head.weight" not in keys and "embed_tokens.weight" not in keys and "W_z" in keys
    drafter = Drafter.from_pretrained(trained_head, tiny_target, max_len=64, device="cpu")
    model = load_target_model(tiny_target).eval()
    engine = TargetEngine(model, max_len=64)
    prompt = [1, 70, 71, 72]
    step = engine.prefill(prompt)
    first = int(step.logits.argmax())
    drafter.extend(step.features, prompt[1:] + [first])
    tree = drafter.propose(TreeShape.clamped(8, 4, 3))
    assert len(tree.tokens) == 8 and int(tree.tokens[0]) == first
    assert all(int(tree.parents[i]) < i for i in range(1, 8))


def test_dovetail_run_with_trained_head_is_lossless(tiny_target, trained_head):
    from transformers import AutoTokenizer

    prompt = "def add(a, b):"
    result = subprocess.run([str(BIN / "dovetail-run"), "--target", str(tiny_target), "--draft", str(trained_head),
                             "--prompt", prompt, "--json", "--max-new-tokens", "8", "--draft-device", "cpu",
                             "--log-level", "error"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout.splitlines()[-1])
    ids = AutoTokenizer.from_pretrained(str(tiny_target))(prompt)["input_ids"]
    engine = TargetEngine(load_target_model(tiny_target).eval(), max_len=64)
    assert reply["token_ids"] == greedy_decode(engine, ids, 8, eos_token_id=2)[:len(reply["token_ids"])]
    assert len(reply["token_ids"]) == 8 or reply["token_ids"][-1] == 2


def test_training_resumes_exactly(tmp_path, tiny_target, feature_dirs):
    train_dir, _ = feature_dirs
    config = TrainConfig(fusion="fc", layers=1, batch_size=2, steps=8, warmup=2, lr=3e-3, save_every=3)
    train(tiny_target, train_dir, tmp_path / "whole", config, progress=False)

    class Stop(Exception):
        pass

    def stop_at_four(step: int) -> None:
        if step == 4:
            raise Stop

    with pytest.raises(Stop):
        train(tiny_target, train_dir, tmp_path / "resumed", config, progress=False, on_step=stop_at_four)
    with (tmp_path / "resumed" / "train_log.jsonl").open("a") as log:  # as if logged past the checkpoint
        log.write(json.dumps({"kind": "train", "step": 4, "loss": 1.0}) + "\n")
    steps: list[int] = []
    train(tiny_target, train_dir, tmp_path / "resumed", config, progress=False, on_step=steps.append)
    assert steps == [4, 5, 6, 7, 8]  # restarted from the checkpoint of step 3
    logged = [[(r["kind"], r.get("step")) for r in map(json.loads, (tmp_path / run / "train_log.jsonl").open())]
              for run in ("whole", "resumed")]
    assert logged[0] == logged[1]  # the steps done again are logged once
    a = load_head(tmp_path / "whole", tiny_target).state_dict()
    b = load_head(tmp_path / "resumed", tiny_target).state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    with pytest.raises(ValueError, match="other settings"):
        train(tiny_target, train_dir, tmp_path / "resumed", TrainConfig(fusion="fc", steps=9), progress=False)


def test_eval_cli_reports_tau_and_checks_losslessness(tiny_target, tiny_corpus, trained_head):
    result = CliRunner().invoke(train_cli, [
        "eval", "--target", str(tiny_target), "--draft", str(trained_head), "--input", str(tiny_corpus),
        "--pattern", "*.txt", "--split", "all", "--files", "2", "--prompt-tokens", "24", "--new-tokens", "20",
        "--tree-tokens", "8", "--depth", "4", "--tree-top-k", "3", "--tree", "4,3,2", "--json", "--threads", "1"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    first, second = report["results"]
    assert (first["tree_tokens"], first["depth"], first["top_k"]) == (8, 4, 3)
    assert (second["tree_tokens"], second["depth"], second["top_k"]) == (4, 3, 2)
    for entry in report["results"]:
        assert entry["files"] == 2 and entry["cycles"] > 0
        assert entry["tau"] == pytest.approx(entry["cycle_tokens"] / entry["cycles"], abs=1e-3)
        assert 1.0 <= entry["tau"] <= entry["depth"] + 1
        # Each file emits 20 tokens: the prefill's first and 19 from cycles.
        assert entry["cycle_tokens"] == 2 * 19
        assert sum(entry["accepted_hist"]) == entry["cycles"]
