"""The training loop: AdamW, warmup + cosine, clipping, feature noise, held-out evaluation,
resumable checkpoints, and the final head written with ``save_head``.

Input-feature noise: EAGLE trains on the target's exact features but drafts from its own
(slightly wrong) predictions after the first step; uniform noise on the input features
makes the head tolerate that. The amplitude is ``noise`` x the RMS of the stored features
(U(-a, a), a = noise * rms), so one flag value means the same thing for targets whose
final norm leaves features at different scales (the testbed's RMS is about 1.5, so the
default 0.1 gives U(-0.15, 0.15), close to EAGLE's U(-0.1, 0.1) on unit-scale features).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cpu_worker.model import load_spec, resolve_model_dir
from cpu_worker.model.embedding import table
from gpu_worker.checkpoint import load_target_frozen, save_head
from gpu_worker.head import DraftHead

from .data import Batch, batch_at, batches_per_epoch, eval_batches
from .forward import rotary_rows, train_forward
from .loss import draft_loss
from .schedule import check_finite, lr_at
from .shards import FeatureSet, check_token_ids, load_features
from .state_file import read_train_state, trim_log

STATE_NAME = "train_state.pt"
LOG_NAME = "train_log.jsonl"


@dataclass
class TrainConfig:
    fusion: str = "dgf"
    layers: int = 1
    batch_size: int = 8  # windows per step
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 0.5
    noise: float = 0.1
    epochs: float = 1.0
    steps: int | None = None  # overrides epochs
    max_tokens: int | None = None  # use only the first N tokens of the training features
    eval_every: int = 200
    eval_tokens: int = 65536
    save_every: int = 200
    seed: int = 0
    bf16: bool = False  # autocast matmuls to bf16 (weights, optimizer and loss reductions stay fp32)
    save_dtype: str = "fp32"
    include_frozen: bool = False

    def total_steps(self, data: FeatureSet) -> int:
        if self.steps is not None:
            return self.steps
        per_epoch = max(1, batches_per_epoch(data.num_windows, self.batch_size))
        return max(1, math.ceil(per_epoch * self.epochs))


def new_head(target_dir: Path, fusion: str, layers: int, seed: int) -> DraftHead:
    """A freshly initialised head whose frozen embedding and lm_head come from the target."""
    torch.manual_seed(seed)
    spec = dataclasses.replace(load_spec(target_dir), num_layers=layers, sliding_window=None)
    head = DraftHead(spec, fusion=fusion)
    frozen = load_target_frozen(target_dir)
    with torch.no_grad():
        table(head.embed_tokens).copy_(frozen["embed_tokens.weight"].float())
        assert isinstance(head.lm_head, torch.nn.Linear)  # a fresh head is never quantized
        head.lm_head.weight.copy_(frozen["lm_head.weight"].float())
    return head


def trainable_state(head: DraftHead) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in head.named_parameters() if p.requires_grad}


@torch.no_grad()
def evaluate_loss(head: DraftHead, data: FeatureSet, batch_size: int = 8) -> dict[str, float]:
    """Held-out loss parts and top-1 agreement (no noise), row-weighted over all windows."""
    head.eval()
    sums = {"loss": 0.0, "feature": 0.0, "token": 0.0, "top1": 0.0}
    rows = 0
    for batch in eval_batches(data, batch_size):
        predicted = train_forward(head, batch.features, batch.tokens)
        parts = draft_loss(head, predicted, batch.targets, batch.weight)
        for key, value in (("loss", float(parts.loss)), ("feature", parts.feature), ("token", parts.token),
                           ("top1", parts.top1)):
            sums[key] += value * parts.rows
        rows += parts.rows
    head.train()
    return {key: value / max(rows, 1) for key, value in sums.items()}


def add_noise(batch: Batch, amplitude: float, generator: torch.Generator) -> torch.Tensor:
    if amplitude <= 0:
        return batch.features
    noise = torch.rand(batch.features.shape, generator=generator) * (2 * amplitude) - amplitude
    return batch.features + noise


@dataclass
class _Run:
    """A training run's state, what its checkpoint (``STATE_NAME``) holds, and its log."""

    config: TrainConfig
    head: DraftHead
    parameters: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    out_dir: Path
    step: int = 0
    elapsed: float = 0.0

    def resume_or_start(self, resume: bool) -> None:
        """Continue from the saved state when asked and there is one (same settings only), else
        start a fresh log."""
        state_path, log_path = self.out_dir / STATE_NAME, self.out_dir / LOG_NAME
        if resume and state_path.exists():
            state = read_train_state(state_path)
            if state["config"] != dataclasses.asdict(self.config):
                raise ValueError(f"{state_path} was written with other settings; use another --out or --restart")
            self.head.load_state_dict(state["head"], strict=False)
            self.optimizer.load_state_dict(state["optimizer"])
            self.generator.set_state(state["generator"])
            self.step, self.elapsed = state["step"], state["elapsed"]
            trim_log(log_path, self.step)
        elif log_path.exists():
            log_path.unlink()

    def save_state(self) -> None:
        state_path = self.out_dir / STATE_NAME
        temporary = state_path.with_suffix(".tmp")
        torch.save({"config": dataclasses.asdict(self.config), "head": trainable_state(self.head),
                    "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                    "step": self.step, "elapsed": self.elapsed}, temporary)
        temporary.replace(state_path)

    def log(self, record: dict[str, Any]) -> None:
        with (self.out_dir / LOG_NAME).open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def one_step(self, data: FeatureSet, amplitude: float, rotary: tuple[torch.Tensor, torch.Tensor],
                 total_steps: int) -> tuple[Any, dict[str, Any]]:
        """One optimizer step on the run's next batch; returns its loss parts and its log record."""
        config = self.config
        batch = batch_at(data, self.step, config.batch_size, config.seed)
        lr = lr_at(self.step, total_steps, config.lr, config.warmup, config.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
            predicted = train_forward(self.head, add_noise(batch, amplitude, self.generator), batch.tokens, rotary)
            parts = draft_loss(self.head, predicted, batch.targets, batch.weight)
        self.optimizer.zero_grad(set_to_none=True)
        parts.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, config.clip))
        check_finite(self.step + 1, lr, float(parts.loss.detach()), grad_norm)
        self.optimizer.step()
        self.step += 1
        return parts, {"step": self.step, "lr": lr, "loss": float(parts.loss.detach()), "feature": parts.feature,
                       "token": parts.token, "top1": parts.top1, "grad_norm": grad_norm}

    def after_step(self, last: dict[str, Any], heldout: FeatureSet | None, total_steps: int, started: float,
                   bar: Any) -> None:
        """The step's log line, held-out evaluation and checkpoint, each when due."""
        step, config = self.step, self.config
        if step % 20 == 0 or step == 1 or step == total_steps:
            self.elapsed = time.perf_counter() - started
            self.log(dict(last, kind="train", seconds=round(self.elapsed, 1)))
        if heldout is not None and (step % config.eval_every == 0 or step == total_steps):
            result = evaluate_loss(self.head, heldout)
            self.elapsed = time.perf_counter() - started
            self.log(dict(result, kind="eval", step=step, seconds=round(self.elapsed, 1)))
            bar.write(f"step {step}: held-out loss {result['loss']:.4f} (feature {result['feature']:.4f}, "
                      f"token {result['token']:.3f}), top-1 {result['top1']:.3f}")
        if step % config.save_every == 0 and step < total_steps:
            self.elapsed = time.perf_counter() - started
            self.save_state()


def train(target: str | Path, train_dir: Path, out_dir: Path, config: TrainConfig,
          heldout_dir: Path | None = None, progress: bool = True, resume: bool = True,
          on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train a head and write it to ``out_dir`` (config.json + model.safetensors, loadable by
    ``dovetail-run --draft out_dir``). Resumes from ``out_dir/train_state.pt`` if present.
    ``on_step`` is called after each step (tests use it to interrupt a run)."""
    target_dir = resolve_model_dir(target)
    data = load_features(train_dir, config.max_tokens, "--max-tokens")
    heldout = load_features(heldout_dir, config.eval_tokens, "--eval-tokens") if heldout_dir else None
    vocab_size = load_spec(target_dir).vocab_size
    for folder, features in ((train_dir, data), (heldout_dir, heldout)):
        if features is not None:
            check_token_ids(features, vocab_size, folder)
    out_dir.mkdir(parents=True, exist_ok=True)  # after the data checks: a refused run leaves no empty folder
    total_steps = config.total_steps(data)
    head = new_head(target_dir, config.fusion, config.layers, config.seed)
    head.train()
    parameters = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    amplitude = config.noise * data.feature_rms()
    run = _Run(config, head, parameters, optimizer, torch.Generator().manual_seed(config.seed + 1), out_dir)
    run.resume_or_start(resume)
    rotary = rotary_rows(head, int((data.offsets[1:] - data.offsets[:-1]).max()))
    bar = tqdm(total=total_steps, initial=run.step, desc=f"train {config.fusion}-{config.layers}", unit="step",
               disable=None if progress else True, dynamic_ncols=True)  # off where stderr is no terminal
    tokens_seen = 0
    last: dict[str, Any] = {}
    started = time.perf_counter() - run.elapsed
    try:
        while run.step < total_steps:
            parts, last = run.one_step(data, amplitude, rotary, total_steps)
            tokens_seen += parts.rows
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", top1=f"{parts.top1:.3f}", lr=f"{last['lr']:.1e}")
            run.after_step(last, heldout, total_steps, started, bar)
            if on_step is not None:
                on_step(run.step)
    finally:
        bar.close()
    run.elapsed = time.perf_counter() - started
    run.save_state()
    final = head if config.save_dtype == "fp32" else copy.deepcopy(head).to(torch.float16)
    save_head(final, out_dir, include_frozen=config.include_frozen)
    summary = {"steps": total_steps, "seconds": round(run.elapsed, 1), "train_tokens": data.num_tokens,
               "pairs_per_step": round(tokens_seen / max(1, run.step), 1), "last": last,
               "config": dataclasses.asdict(config)}
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
