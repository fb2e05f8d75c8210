"""EAGLE-3 training on a tiny random target: three-layer feature rows, the training-time-test
forward against step-by-step inference, the frequency draft vocabulary, training lowers the loss,
and a trained folder round-trips and evaluates greedily identical to the target."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cpu_worker.model.llama import LlamaSpec, RotaryTable
from dovetail_runtime.train_cli import main as train_cli
from gpu_worker.eagle3 import Eagle3Head
from gpu_worker.train.eagle3_io import load_eagle3_head
from gpu_worker.train.eagle3_trainer import make_eagle3_batch, new_eagle3_head, select_draft_vocab, ttt_loss
from gpu_worker.train.shards import FeatureSet, features_on_device, load_features
from gpu_worker.train.ttt import ttt_forward

from test_train_support import make_tiny_target, tiny_corpus  # noqa: F401 (fixtures)

LAYERS = (0, 2, 3)


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory) -> Path:
    """The tiny character-level target with 4 layers (three distinct aux layers)."""
    return make_tiny_target(tmp_path_factory.mktemp("e3-target") / "target", num_hidden_layers=4)


@pytest.fixture(scope="module")
def aux_features(tmp_path_factory, deep_target, tiny_corpus) -> Path:
    out = tmp_path_factory.mktemp("e3-features") / "train"
    result = CliRunner().invoke(train_cli, [
        "features", "--target", str(deep_target), "--out", str(out), "--input", str(tiny_corpus), "--window", "48",
        "--aux-layers", ",".join(map(str, LAYERS)), "--dtype", "fp32", "--threads", "1"])
    assert result.exit_code == 0, result.output
    return out


def test_aux_rows_are_the_residual_streams(deep_target, aux_features):
    from transformers import AutoModelForCausalLM

    data = load_features(aux_features)
    assert data.aux is not None and data.aux_layers == LAYERS
    reference = AutoModelForCausalLM.from_pretrained(str(deep_target), torch_dtype=torch.float32).eval()
    for window in (0, data.num_windows - 1):
        tokens, features, _ = data.window(window)
        begin, end = int(data.offsets[window]), int(data.offsets[window + 1])
        with torch.no_grad():
            # transformers: hidden_states[i] is the input of layer i; the last one is after the final norm.
            states = reference(tokens[None], output_hidden_states=True).hidden_states
        want = torch.cat([states[layer][0] for layer in LAYERS], dim=-1)
        torch.testing.assert_close(data.aux[begin:end], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(features, states[-1][0], rtol=1e-4, atol=1e-4)


def test_windows_in_one_padded_batch_give_each_window_its_own_rows(deep_target):
    """The GPU path of feature extraction (windows batched, right-padded) against one at a time."""
    from cpu_worker.target_loading import load_target_model
    from gpu_worker.train.features import WindowRows

    target = load_target_model(deep_target).eval()
    rows = WindowRows(target, 40, LAYERS, torch.float32)
    windows = [np.arange(length, dtype=np.int64) % 50 + 3 for length in (40, 7, 23)]
    with torch.inference_mode():
        batched = rows.many(windows)
        for window, (last, aux) in zip(windows, batched, strict=True):
            alone_last, alone_aux = rows(window)
            assert last.shape == alone_last.shape == (len(window), target.spec.hidden_size)
            torch.testing.assert_close(last, alone_last, rtol=1e-5, atol=1e-5)
            assert aux is not None and alone_aux is not None
            torch.testing.assert_close(aux, alone_aux, rtol=1e-5, atol=1e-5)
    assert not rows.batched  # on the CPU extraction keeps one window at a time


def test_aux_layer_errors_name_the_option_and_the_key(deep_target, tiny_corpus, tmp_path):
    result = CliRunner().invoke(train_cli, [
        "features", "--target", str(deep_target), "--out", str(tmp_path / "f"), "--input", str(tiny_corpus),
        "--aux-layers", "auto"])
    assert result.exit_code != 0
    assert "--aux-layers" in result.output and "eagle_aux_hidden_state_layer_ids" in result.output
    if not torch.cuda.is_available():
        result = CliRunner().invoke(train_cli, [
            "features", "--target", str(deep_target), "--out", str(tmp_path / "g"), "--input", str(tiny_corpus),
            "--device", "cuda"])
        assert result.exit_code != 0 and "torch sees no CUDA device" in result.output


def tiny_eagle3(kv_heads: int, fusion: str, vocab: int = 50, seed: int = 0, layers: int = 1) -> Eagle3Head:
    torch.manual_seed(seed)
    spec = LlamaSpec(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_layers=layers, num_heads=4,
                     num_kv_heads=kv_heads, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=128)
    head = Eagle3Head(spec, target_hidden_size=16, draft_vocab_size=20, fusion=fusion)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if parameter.dim() == 2 and not name.startswith("W_"):
                parameter.normal_(0, 0.3)
    return head.eval()


@pytest.mark.parametrize("fusion,kv_heads,layers", [("eagle3", 4, 1), ("dgf-eagle3", 2, 1), ("dgf-eagle3", 2, 2)])
def test_training_time_test_equals_step_by_step_inference(fusion, kv_heads, layers):
    steps, lengths = 4, (9, 6)  # two windows, the second padded
    head = tiny_eagle3(kv_heads, fusion, layers=layers)
    gen = torch.Generator().manual_seed(1)
    rows_len = max(lengths)
    rows = torch.randn(2, rows_len, 48, generator=gen)
    tokens = torch.randint(0, 50, (2, rows_len + steps - 1), generator=gen)
    table = RotaryTable(head.spec, 64, torch.float32)
    with torch.no_grad():
        outs = ttt_forward(head, rows, tokens, steps, table.cos, table.sin)
        for b, length in enumerate(lengths):
            # Inference: step 0 is the committed context; step k the depth-k node of every
            # position's chain, one masked call per step, keys in slots k * length + j.
            cache = head.new_cache(steps * length, torch.float32)
            cos, sin = table.lookup(torch.arange(length))
            feature = head(rows[b, :length], tokens[b, :length], cos, sin, cache, 0, None)
            torch.testing.assert_close(outs[0][b, :length], feature, rtol=1e-5, atol=1e-5)
            for k in range(1, steps):
                mask = torch.zeros(length, (k + 1) * length, dtype=torch.bool)
                mask[:, :length] = torch.ones(length, length, dtype=torch.bool).tril()
                for i in range(1, k + 1):
                    mask[:, i * length:(i + 1) * length] = torch.eye(length, dtype=torch.bool)
                cos, sin = table.lookup(torch.arange(length) + k)
                feature = head(feature, tokens[b, k:k + length], cos, sin, cache, k * length, mask)
                # Batched and masked calls round differently (different GEMM shapes), by up to
                # 1.5e-5 on an AVX2 EPYC; a wrong mask or position is off by ~1e-1.
                torch.testing.assert_close(outs[k][b, :length], feature, rtol=1e-4, atol=5e-5)


def test_draft_vocabulary_is_the_most_frequent_predicted_tokens():
    # Two windows; the first token of each is never predicted, loss-masked tokens do not count.
    tokens = torch.tensor([9, 5, 5, 5, 7, 7, 3, 9, 9, 9, 9, 7, 1, 2])
    mask = torch.ones(14, dtype=torch.bool)
    mask[12] = False  # the 1 is masked out
    data = FeatureSet(tokens, torch.zeros(14, 4), mask, torch.tensor([0, 7, 14]))
    # Predicted counts: 9 -> 3 (index 0 is a window start), 5 -> 3, 7 -> 3, 3 -> 1, 2 -> 1.
    assert select_draft_vocab(data, 3, 12).tolist() == [5, 7, 9]
    assert select_draft_vocab(data, 4, 12).tolist() == [2, 5, 7, 9]  # 2 and 3 tie: the smaller id
    assert select_draft_vocab(data, 6, 12).tolist() == [0, 2, 3, 5, 7, 9]  # unseen ids fill in id order
    assert select_draft_vocab(data, 12, 12).tolist() == list(range(12))
    with pytest.raises(ValueError, match="--draft-vocab"):
        select_draft_vocab(data, 13, 12)
    spec = LlamaSpec(vocab_size=12, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                     num_kv_heads=4, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64)
    head = Eagle3Head(spec, target_hidden_size=16, draft_vocab_size=4)
    head.set_draft_vocab(torch.tensor([9, 3, 7, 5]))
    assert head.d2t.tolist() == [3, 4, 5, 6]  # draft id d is target id d + d2t[d]
    assert head.draft_to_target(torch.arange(4)).tolist() == [3, 5, 7, 9]
    assert head.t2d.nonzero().flatten().tolist() == [3, 5, 7, 9]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, deep_target, aux_features) -> Path:
    out = tmp_path_factory.mktemp("e3-heads") / "dgf-eagle3"
    result = CliRunner().invoke(train_cli, [
        "train", "--target", str(deep_target), "--features", str(aux_features), "--heldout", str(aux_features),
        "--out", str(out), "--recipe", "dgf-eagle3", "--draft-vocab", "60", "--ttt-steps", "3", "--batch-size", "4",
        "--steps", "40", "--lr", "5e-3", "--warmup", "5", "--eval-every", "40", "--threads", "1"])
    assert result.exit_code == 0, result.output
    return out


def test_training_lowers_the_loss_and_the_folder_round_trips(deep_target, aux_features, trained):
    config = json.loads((trained / "config.json").read_text())
    assert config["draft_vocab_size"] == 60 and config["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    assert config["dovetail_fusion"] == "dgf-eagle3" and config["num_hidden_layers"] == 1
    data = load_features(aux_features)
    batch = make_eagle3_batch(data, list(range(min(8, data.num_windows))), 3)
    table = RotaryTable(load_eagle3_head(trained, deep_target)[0].spec, 64, torch.float32)
    from gpu_worker.checkpoint import load_target_frozen

    target_head = load_target_frozen(deep_target)["lm_head.weight"].float()
    loaded, layers = load_eagle3_head(trained, deep_target)
    assert layers == LAYERS
    fresh = new_eagle3_head(deep_target, "dgf-eagle3", loaded.target_draft_ids(), seed=0)
    with torch.no_grad():
        before = ttt_loss(fresh, target_head, batch, 3, (table.cos, table.sin))
        after = ttt_loss(loaded, target_head, batch, 3, (table.cos, table.sin))
    # The random target is nearly uniform, so compare the CE above its floor (the target's entropy).
    assert after.excess() < 0.5 * before.excess()
    assert min(after.top1) > max(before.top1) + 0.2
    # The saved vocabulary is the training features' most frequent predicted tokens.
    assert loaded.target_draft_ids().tolist() == select_draft_vocab(data, 60, loaded.vocab_size).tolist()


def test_features_stay_on_the_host_off_cuda(aux_features):
    data = load_features(aux_features)
    assert features_on_device(data, "cpu") is data
    batch = make_eagle3_batch(data, list(range(min(6, data.num_windows))), 3)
    assert {getattr(batch, f.name).device.type for f in dataclasses.fields(batch)} == {"cpu"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (tools/device_train_head.sh runs it first)")
def test_features_on_the_gpu_cut_the_same_batches_as_on_the_host(aux_features):
    data = load_features(aux_features)
    windows = list(range(min(6, data.num_windows)))
    host = make_eagle3_batch(data, windows, 3)
    assert features_on_device(data, "cuda", share=0.0) is data  # "does not fit": stays put
    resident = features_on_device(data, "cuda")
    assert resident.aux is not None and resident.aux.is_cuda and resident.tokens.is_cuda
    assert not resident.offsets.is_cuda
    on_gpu = make_eagle3_batch(resident, windows, 3)
    for field in dataclasses.fields(host):
        assert torch.equal(getattr(on_gpu, field.name).cpu(), getattr(host, field.name)), field.name


def test_a_trained_head_evaluates_greedily_identical_to_the_target(deep_target, tiny_corpus, trained):
    result = CliRunner().invoke(train_cli, [
        "eval", "--target", str(deep_target), "--draft", str(trained), "--input", str(tiny_corpus),
        "--pattern", "*.txt", "--split", "all", "--prompt-tokens", "24", "--new-tokens", "24",
        "--tree-tokens", "8", "--depth", "4", "--tree-top-k", "3", "--tree", "4,3,2", "--json", "--threads", "1"])
    assert result.exit_code == 0, result.output  # a divergence from greedy raises LosslessError
    report = json.loads(result.stdout)
    for row in report["results"]:
        assert row["files"] > 0 and row["cycles"] > 0
        assert row["tau"] >= 1.0


def test_a_deeper_head_trains_from_the_cli_and_stays_lossless(tmp_path, deep_target, tiny_corpus, aux_features):
    """--layers 2: the EAGLE-3 layer and one plain layer, trained end to end by the CLI (its
    own key sets in the training-time test), written with its depth and greedy-exact in eval."""
    out = tmp_path / "deep"
    result = CliRunner().invoke(train_cli, [
        "train", "--target", str(deep_target), "--features", str(aux_features), "--out", str(out),
        "--recipe", "dgf-eagle3", "--layers", "2", "--draft-vocab", "60", "--ttt-steps", "2", "--batch-size", "4",
        "--steps", "6", "--lr", "5e-3", "--warmup", "2", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    head, _ = load_eagle3_head(out, deep_target)
    assert len(head.post_layers) == 1
    fresh = new_eagle3_head(deep_target, "dgf-eagle3", head.target_draft_ids(), seed=0, layers=2)
    trained_weight = head.post_layers[0].mlp.down_proj.weight
    assert not torch.equal(trained_weight, fresh.post_layers[0].mlp.down_proj.weight)  # the plain layer learned
    result = CliRunner().invoke(train_cli, [
        "eval", "--target", str(deep_target), "--draft", str(out), "--input", str(tiny_corpus),
        "--pattern", "*.txt", "--split", "all", "--prompt-tokens", "24", "--new-tokens", "16",
        "--tree-tokens", "8", "--depth", "4", "--tree-top-k", "3", "--json", "--threads", "1"])
    assert result.exit_code == 0, result.output  # a divergence from greedy raises LosslessError


def test_training_stops_and_resumes_to_the_uninterrupted_result(tmp_path, deep_target, aux_features):
    """A run stopped between steps saves head, optimizer and step; the same call resumes there
    and ends with exactly the uninterrupted run's head. A mid-step interrupt keeps the last
    checkpoint's state, so its resume repeats the steps since and still ends the same."""
    from gpu_worker.train.eagle3_trainer import LOG_NAME, STATE_NAME, Eagle3Config, StopTraining, train_eagle3

    config = Eagle3Config(fusion="dgf-eagle3", draft_vocab=60, ttt_steps=2, batch_size=4, steps=7, lr=5e-3,
                          warmup=2, save_every=3)
    train_eagle3(deep_target, aux_features, tmp_path / "whole", config, progress=False)

    def stop_at(when: int, error: type[BaseException]):
        def on_step(step: int) -> None:
            if step == when:
                raise error
        return on_step

    stopped = train_eagle3(deep_target, aux_features, tmp_path / "resumed", config, progress=False,
                           on_step=stop_at(4, StopTraining))
    assert stopped["steps"] == 4 and not stopped["finished"]
    assert torch.load(tmp_path / "resumed" / STATE_NAME, weights_only=True)["step"] == 4
    # Interrupted hard at step 5: the state of step 4 (the stop) stands, not a half-done update.
    train_eagle3(deep_target, aux_features, tmp_path / "resumed", config, progress=False,
                 on_step=stop_at(5, KeyboardInterrupt))
    assert torch.load(tmp_path / "resumed" / STATE_NAME, weights_only=True)["step"] == 4
    # A record the hard-stopped run logged after its checkpoint (a step it will do again).
    with (tmp_path / "resumed" / LOG_NAME).open("a") as log:
        log.write(json.dumps({"kind": "train", "step": 5, "loss": 1.0}) + "\n")
    steps: list[int] = []
    finished = train_eagle3(deep_target, aux_features, tmp_path / "resumed", config, progress=False,
                            on_step=steps.append)
    assert steps == [5, 6, 7] and finished["finished"]
    logged = [[json.loads(line) for line in (tmp_path / run / LOG_NAME).read_text().splitlines()]
              for run in ("whole", "resumed")]
    assert [(r["kind"], r.get("step")) for r in logged[0]] == [(r["kind"], r.get("step")) for r in logged[1]]
    whole, _ = load_eagle3_head(tmp_path / "whole", deep_target)
    resumed, _ = load_eagle3_head(tmp_path / "resumed", deep_target)
    a, b = whole.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    with pytest.raises(ValueError, match="other settings"):
        train_eagle3(deep_target, aux_features, tmp_path / "resumed", dataclasses.replace(config, lr=1e-3),
                     progress=False)


class _RunsCodeWhenUnpickled:
    """What a tampered train_state.pt could hold: unpickling it calls Path.touch on a marker."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_state_that_is_not_tensors_or_is_cut_is_refused_and_never_run(tmp_path, deep_target, aux_features):
    """train_state.pt is read with torch's weights-only unpickler: a file pickling anything else is
    refused before any of it runs (a plain pickle load ran it), and a cut one is one line too."""
    from gpu_worker.train.eagle3_trainer import STATE_NAME, Eagle3Config, train_eagle3

    config = Eagle3Config(fusion="dgf-eagle3", draft_vocab=60, ttt_steps=2, batch_size=4, steps=2, lr=5e-3,
                          warmup=1, save_every=1)
    out, marker = tmp_path / "run", tmp_path / "ran"
    out.mkdir()
    torch.save({"config": {}, "head": {}, "optimizer": {}, "step": 1, "payload": _RunsCodeWhenUnpickled(marker)},
               out / STATE_NAME)
    with pytest.raises(ValueError, match="cannot be resumed from .*--restart"):
        train_eagle3(deep_target, aux_features, out, config, progress=False)
    assert not marker.exists()
    train_eagle3(deep_target, aux_features, out, config, progress=False, resume=False)  # --restart: a fresh run
    state = (out / STATE_NAME).read_bytes()
    (out / STATE_NAME).write_bytes(state[:len(state) // 2])
    with pytest.raises(ValueError, match="cannot be resumed from"):
        train_eagle3(deep_target, aux_features, out, config, progress=False)


def test_sigterm_stops_the_cli_run_at_a_step_boundary(tmp_path, deep_target, aux_features, monkeypatch):
    """`dovetail-train train` stopped by SIGTERM finishes its step, saves a resumable state and
    says where it stopped; rerunning the command continues from there."""
    import os
    import signal

    from gpu_worker.train import eagle3_trainer

    schedule = eagle3_trainer.lr_at

    def signal_during_step_two(step: int, *args):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return schedule(step, *args)

    monkeypatch.setattr(eagle3_trainer, "lr_at", signal_during_step_two)
    out = tmp_path / "head"
    command = ["train", "--target", str(deep_target), "--features", str(aux_features), "--out", str(out),
               "--recipe", "eagle3", "--draft-vocab", "60", "--ttt-steps", "2", "--batch-size", "4", "--steps", "5",
               "--warmup", "1", "--threads", "1"]
    handler = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(train_cli, command)
    assert result.exit_code == 128 + signal.SIGTERM, result.output  # was 0: a script went on as if it had finished
    assert "stopped early: 2 of 5 steps" in result.output
    assert torch.load(out / eagle3_trainer.STATE_NAME, weights_only=True)["step"] == 2
    assert signal.getsignal(signal.SIGTERM) == handler  # the CLI puts the process's handlers back
    monkeypatch.setattr(eagle3_trainer, "lr_at", schedule)
    result = CliRunner().invoke(train_cli, command)
    assert result.exit_code == 0 and "5 steps in" in result.output and "stopped" not in result.output


def test_bf16_on_a_cpu_without_native_bf16_is_flagged_before_training(monkeypatch, capsys):
    """A 2-core EPYC (AVX2 only) ran a dgf-eagle3 step at --bf16 in 212 s: the run says so up front."""
    from cpu_worker import precision
    from dovetail_runtime import train_cli as cli

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert cli.warn_if_bf16_is_emulated(True, "cpu")
    assert "--fp32" in capsys.readouterr().err
    assert not cli.warn_if_bf16_is_emulated(False, "cpu")
    assert not cli.warn_if_bf16_is_emulated(True, "cuda")
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert not cli.warn_if_bf16_is_emulated(True, "cpu")
    assert capsys.readouterr().err == ""


def test_a_time_budget_shrinks_the_plan_after_its_timed_steps(tmp_path, deep_target, aux_features):
    """--time-budget: past a few warm-up steps BUDGET_PROBE_STEPS steps are timed, then only the
    steps that fit stay planned (none more here: the budget is already spent), and the run ends
    finished with its learning rate decayed over that plan. A generous budget leaves the plan alone."""
    from gpu_worker.train.eagle3_trainer import BUDGET_PROBE_STEPS, BUDGET_WARMUP_STEPS, Eagle3Config, train_eagle3

    probed = BUDGET_WARMUP_STEPS + BUDGET_PROBE_STEPS
    config = Eagle3Config(fusion="dgf-eagle3", draft_vocab=60, ttt_steps=2, batch_size=2, steps=probed + 9,
                          lr=5e-3, warmup=2, save_every=1000, time_budget=1e-6)
    steps: list[int] = []
    result = train_eagle3(deep_target, aux_features, tmp_path / "tight", config, progress=False, on_step=steps.append)
    assert steps == list(range(1, probed + 1))
    assert result["finished"] and result["planned_steps"] == probed
    log = [json.loads(line) for line in (tmp_path / "tight" / "train_log.jsonl").read_text().splitlines()]
    (budget,) = [record for record in log if record["kind"] == "budget"]
    assert budget["planned_steps"] == probed + 9 and budget["now_planned"] == probed
    generous = train_eagle3(deep_target, aux_features, tmp_path / "generous",
                            dataclasses.replace(config, time_budget=3600.0), progress=False)
    assert generous["steps"] == generous["planned_steps"] == probed + 9


def test_a_saved_head_keeps_its_targets_rope_theta(tmp_path):
    """transformers 5 writes RoPE as ``rope_parameters``; a head folder that dropped it loaded with
    the default theta (10000) while it trained with the target's: SmolLM2's head ran at 10000
    against 100000."""
    from cpu_worker.model import load_spec
    from gpu_worker.checkpoint import head_spec, load_head
    from gpu_worker.train.eagle3_io import save_eagle3_head

    target = make_tiny_target(tmp_path / "target", num_hidden_layers=4,
                              rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    assert load_spec(target).rope_theta == 50000.0
    head = new_eagle3_head(target, "dgf-eagle3", torch.arange(60), seed=0)
    save_eagle3_head(head, tmp_path / "head", target, LAYERS)
    assert head_spec(tmp_path / "head").rope_theta == 50000.0
    assert load_head(tmp_path / "head", target).spec.rope_theta == 50000.0
