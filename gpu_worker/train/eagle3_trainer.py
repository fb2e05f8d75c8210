"""Training of EAGLE-3 heads (``--recipe eagle3`` and ``--recipe dgf-eagle3``).

As in EAGLE-3: the inputs are the target's three-layer rows (``dovetail-train features
--aux-layers``), the head is unrolled for K steps on its own outputs (``gpu_worker.train.ttt``), and
the loss is only the cross-entropy against the target's next-token distribution restricted to
the draft vocabulary (renormalised over it), no feature regression; step k's loss is weighted
0.8^k, and a row whose target argmax lies outside the draft vocabulary does not count (the
head could not propose it anyway). The draft vocabulary is the ``draft_vocab`` target ids most
frequent among the tokens the training windows predict.
"""

from __future__ import annotations

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

from cpu_worker.model import RotaryTable, load_spec, resolve_model_dir
from cpu_worker.model.embedding import table
from gpu_worker.checkpoint import load_target_frozen
from gpu_worker.eagle3 import Eagle3Head

from .data import batches_per_epoch, epoch_order
from .eagle3_io import save_eagle3_head
from .schedule import check_finite, lr_at
from .shards import FeatureSet, check_token_ids, features_on_device, load_features
from .state_file import read_train_state, trim_log
from .ttt import ttt_forward

STEP_DECAY = 0.8  # EAGLE-3's weight of step k: 0.8 ** k
LOG_NAME = "train_log.jsonl"
STATE_NAME = "train_state.pt"  # head, optimizer and step: a stopped run resumes exactly


@dataclass
class Eagle3Config:
    fusion: str = "eagle3"
    layers: int = 1  # decoder layers: the EAGLE-3 one, then layers - 1 plain ones (Dovetail's deeper head)
    draft_vocab: int = 4096
    ttt_steps: int = 7
    batch_size: int = 4
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 0.5
    epochs: float = 1.0
    steps: int | None = None
    max_tokens: int | None = None
    eval_every: int = 200
    eval_tokens: int = 32768
    save_every: int = 200  # steps between writes of the head folder (a stopped run leaves a usable head)
    seed: int = 0
    bf16: bool = False
    save_dtype: str = "fp32"
    device: str = "cpu"
    # Seconds of steps for this run: once a few steps are timed the plan shrinks to what fits,
    # and the learning rate decays over the shrunk plan (a run that ends early would not decay).
    time_budget: float | None = None
    # Keep the features in host memory on CUDA (else they move to the GPU when they fit).
    features_on_host: bool = False


BUDGET_PROBE_STEPS = 20  # steps timed before a --time-budget run sizes its plan
BUDGET_WARMUP_STEPS = 5  # steps before those, untimed: a GPU's first steps (kernel choice, allocator) run slow
# Settings that may differ between a run and its resumption: where it runs and for how long.
RUN_ONLY_SETTINGS = ("device", "time_budget", "features_on_host")


def select_draft_vocab(data: FeatureSet, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids among the predicted tokens (every window position but
    the first, loss mask on), sorted by id; ties go to the smaller id, and ids never seen fill
    up in id order when the corpus has fewer distinct tokens than ``size``."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"--draft-vocab {size} must be in 1..{vocab_size} (the target's vocabulary)")
    predicted = data.loss_mask.clone()
    predicted[data.offsets[:-1]] = False  # a window's first token is never a prediction target
    counts = torch.bincount(data.tokens[predicted], minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices  # stable: equal counts keep id order
    return torch.sort(order[:size]).values


def vocab_coverage(data: FeatureSet, target_ids: torch.Tensor, vocab_size: int) -> float:
    """Fraction of predicted tokens that the draft vocabulary holds."""
    predicted = data.loss_mask.clone()
    predicted[data.offsets[:-1]] = False
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[target_ids] = True
    tokens = data.tokens[predicted]
    return float(inside[tokens].float().mean()) if tokens.numel() else 0.0


def new_eagle3_head(target_dir: Path, fusion: str, draft_ids: torch.Tensor, seed: int, layers: int = 1) -> Eagle3Head:
    """A fresh head on the target's shape with ``layers`` decoder layers; embedding frozen from
    the target, lm_head started from the target's rows of the draft vocabulary (trainable, as in
    EAGLE-3)."""
    torch.manual_seed(seed)
    spec = dataclasses.replace(load_spec(target_dir), num_layers=layers, sliding_window=None)
    head = Eagle3Head(spec, target_hidden_size=spec.hidden_size, draft_vocab_size=int(draft_ids.numel()),
                      fusion=fusion)
    head.set_draft_vocab(draft_ids)
    frozen = load_target_frozen(target_dir)
    with torch.no_grad():
        table(head.embed_tokens).copy_(frozen["embed_tokens.weight"].float())
        assert isinstance(head.lm_head, torch.nn.Linear)
        head.lm_head.weight.copy_(frozen["lm_head.weight"].float()[head.target_draft_ids()])
    return head


@dataclass
class Eagle3Batch:
    rows: torch.Tensor  # [B, S, 3Ht] inputs a_0..a_{S-1}
    tokens: torch.Tensor  # [B, S + K - 1]: column i holds x_{i+1}
    next_features: torch.Tensor  # [B, S + K - 1, H]: column i holds f_{i+1} (scores x_{i+2})
    valid: torch.Tensor  # [B, S + K - 1] bool: column i is inside the window and its loss mask is on


def make_eagle3_batch(data: FeatureSet, windows: list[int], steps: int) -> Eagle3Batch:
    if data.aux is None:
        raise ValueError("these features have no three-layer rows: extract them with "
                         "`dovetail-train features --aux-layers ...`")
    lengths = [int(data.offsets[w + 1] - data.offsets[w]) for w in windows]
    rows_len = max(lengths) - 1
    cols = rows_len + steps - 1
    batch = len(windows)
    device = data.aux.device  # the GPU when the features live there (see features_on_device)
    rows = torch.zeros(batch, rows_len, data.aux.shape[1], device=device)
    tokens = torch.zeros(batch, cols, dtype=torch.long, device=device)
    nexts = torch.zeros(batch, cols, data.features.shape[1], device=device)
    valid = torch.zeros(batch, cols, dtype=torch.bool, device=device)
    for b, window in enumerate(windows):
        begin, end = int(data.offsets[window]), int(data.offsets[window + 1])
        n = end - begin
        rows[b, :n - 1] = data.aux[begin:end - 1].float()
        tokens[b, :n - 1] = data.tokens[begin + 1:end]
        nexts[b, :n - 2] = data.features[begin + 1:end - 1].float()
        # Column i scores x_{i+2}: it counts when x_{i+2} exists and carries loss.
        valid[b, :n - 2] = data.loss_mask[begin + 2:end]
    return Eagle3Batch(rows, tokens, nexts, valid)


@dataclass
class StepLosses:
    loss: torch.Tensor
    per_step: list[float]  # CE of each step
    top1: list[float]
    rows: int
    entropy: list[float]  # the target distributions' own entropy per step: the CE floor

    def excess(self) -> float:
        """Summed CE above the floor (the KL to the target over the draft vocabulary)."""
        return sum(ce - h for ce, h in zip(self.per_step, self.entropy, strict=True))


def ttt_loss(head: Eagle3Head, target_head: torch.Tensor, batch: Eagle3Batch, steps: int,
             rotary: tuple[torch.Tensor, torch.Tensor]) -> StepLosses:
    """Weighted sum over steps of the soft CE on the draft vocabulary. ``target_head``: the
    target's lm_head weight [V, Ht] (frozen)."""
    length = batch.rows.shape[1]
    outs = ttt_forward(head, batch.rows, batch.tokens, steps, *rotary)
    with torch.no_grad():
        logits = batch.next_features @ target_head.T  # [B, cols, V]
        inside = head.t2d[logits.argmax(-1)]
        counted = batch.valid & inside
        probs = torch.softmax(logits[..., head.target_draft_ids()].float(), dim=-1)
    total = torch.zeros((), device=batch.rows.device)
    per_step, top1, entropy = [], [], []
    rows = 0
    for step, out in enumerate(outs):
        keep = counted[:, step:step + length]
        count = int(keep.sum())
        if count == 0:
            per_step.append(0.0)
            top1.append(0.0)
            entropy.append(0.0)
            continue
        log_probs = head.log_probs(out[keep])
        want = probs[:, step:step + length][keep]
        ce = -(want * log_probs).sum(-1).mean()
        total = total + (STEP_DECAY ** step) * ce
        per_step.append(float(ce.detach()))
        top1.append(float((log_probs.argmax(-1) == want.argmax(-1)).float().mean()))
        entropy.append(float(-(want * want.clamp(min=1e-30).log()).sum(-1).mean()))
        rows += count
    return StepLosses(total, per_step, top1, rows, entropy)


@torch.no_grad()
def evaluate(head: Eagle3Head, target_head: torch.Tensor, data: FeatureSet, steps: int,
             rotary: tuple[torch.Tensor, torch.Tensor], device: str, batch_size: int = 4) -> dict[str, Any]:
    head.eval()
    sums = [0.0] * steps
    agree = [0.0] * steps
    batches = 0
    for begin in range(0, data.num_windows, batch_size):
        windows = list(range(begin, min(begin + batch_size, data.num_windows)))
        batch = to_device(make_eagle3_batch(data, windows, steps), device)
        parts = ttt_loss(head, target_head, batch, steps, rotary)
        sums = [a + b for a, b in zip(sums, parts.per_step, strict=True)]
        agree = [a + b for a, b in zip(agree, parts.top1, strict=True)]
        batches += 1
    head.train()
    return {"ce": [round(v / max(batches, 1), 4) for v in sums],
            "top1": [round(v / max(batches, 1), 4) for v in agree]}


def to_device(batch: Eagle3Batch, device: str) -> Eagle3Batch:
    if device == "cpu":
        return batch
    return Eagle3Batch(*(getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)))


class StopTraining(Exception):
    """Raised by ``on_step`` to stop at a step boundary: the run saves its state and can resume."""


def _settings(config: Eagle3Config) -> dict[str, Any]:
    """The settings a resumed run must share with the saved one (the device and budget may change)."""
    return {name: value for name, value in dataclasses.asdict(config).items() if name not in RUN_ONLY_SETTINGS}


class _Eagle3Run:
    """A training run: the head and its optimizer, where the run stands (``done`` steps,
    ``pairs`` trained on), its checkpoint (``STATE_NAME``), its log and the head folder."""

    def __init__(self, target_dir: Path, data: FeatureSet, out_dir: Path, config: Eagle3Config,
                 heldout: FeatureSet | None = None):
        self.target_dir, self.data, self.out_dir, self.config = target_dir, data, out_dir, config
        spec = load_spec(target_dir)
        draft_ids = select_draft_vocab(data, config.draft_vocab, spec.vocab_size)
        self.coverage = vocab_coverage(data, draft_ids, spec.vocab_size)
        device = config.device
        self.head = new_eagle3_head(target_dir, config.fusion, draft_ids, config.seed, config.layers).to(device)
        self.head.train()
        self.target_head = load_target_frozen(target_dir)["lm_head.weight"].float().to(device)
        self.parameters = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=config.weight_decay)
        # Positions for the held-out windows too: longer ones than training's failed at the first evaluation.
        longest = max(int((rows.offsets[1:] - rows.offsets[:-1]).max()) for rows in filter(None, (data, heldout)))
        table = RotaryTable(self.head.spec, longest + config.ttt_steps, torch.float32, device)
        self.rotary = (table.cos, table.sin)
        if not config.features_on_host:
            self.data = features_on_device(data, device)
        self.per_epoch = max(1, batches_per_epoch(data.num_windows, config.batch_size))
        self.total_steps = config.steps or max(1, math.ceil(self.per_epoch * config.epochs))
        self.pairs, self.done, self.started = 0, 0, 0.0
        self.probe_started = 0.0  # when the steps a time budget is sized from began
        self.last: dict[str, Any] = {}

    def log(self, record: dict[str, Any]) -> None:
        with (self.out_dir / LOG_NAME).open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def resume_or_start(self, resume: bool) -> None:
        """Continue from the saved state when asked and there is one (same settings only), else
        start a fresh log; the run's clock starts here, counting the time already spent."""
        state_path, config = self.out_dir / STATE_NAME, self.config
        elapsed = 0.0
        if resume and state_path.exists():
            state = read_train_state(state_path, config.device)
            if {"layers": 1, **state["config"]} != _settings(config):  # states from before --layers: one layer
                raise ValueError(f"{state_path} was written with other settings; use another --out or --restart")
            self.head.load_state_dict(state["head"], strict=False)
            self.optimizer.load_state_dict(state["optimizer"])
            self.pairs, self.done, elapsed = state["pairs"], state["step"], state["elapsed"]
            trim_log(self.out_dir / LOG_NAME, self.done)
        else:
            (self.out_dir / LOG_NAME).unlink(missing_ok=True)
            assert self.data.aux_layers is not None
            self.log({"kind": "vocab", "draft_vocab": config.draft_vocab, "coverage": round(self.coverage, 5),
                      "aux_layers": list(self.data.aux_layers)})
        self.started = time.perf_counter() - elapsed

    def save_state(self) -> None:
        state_path = self.out_dir / STATE_NAME
        temporary = state_path.with_suffix(".tmp")
        torch.save({"config": _settings(self.config), "head": self.head.file_state_dict(),
                    "optimizer": self.optimizer.state_dict(), "step": self.done, "pairs": self.pairs,
                    "elapsed": time.perf_counter() - self.started}, temporary)
        temporary.replace(state_path)

    def write(self, final: bool) -> dict[str, Any]:
        """The head folder and ``train_summary.json`` as the run stands; returns the summary."""
        data, config = self.data, self.config
        assert data.aux_layers is not None
        dtype = torch.float16 if config.save_dtype == "fp16" else torch.float32
        save_eagle3_head(self.head, self.out_dir, self.target_dir, data.aux_layers, dtype)
        summary = {"steps": self.done, "planned_steps": self.total_steps, "finished": final,
                   "seconds": round(time.perf_counter() - self.started, 1), "train_tokens": data.num_tokens,
                   "pairs": self.pairs, "draft_vocab_coverage": round(self.coverage, 5), "last": self.last,
                   "config": dataclasses.asdict(config)}
        (self.out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary

    def one_step(self, step: int) -> StepLosses:
        """Step ``step``: its batch (the epoch's window order), the TTT loss and the update."""
        config, data = self.config, self.data
        epoch, index = divmod(step, self.per_epoch)
        order = epoch_order(data.num_windows, config.seed, epoch)
        windows = order[index * config.batch_size:(index + 1) * config.batch_size]
        batch = to_device(make_eagle3_batch(data, windows, config.ttt_steps), config.device)
        lr = lr_at(step, self.total_steps, config.lr, config.warmup, config.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(config.device, dtype=torch.bfloat16, enabled=config.bf16):
            parts = ttt_loss(self.head, self.target_head, batch, config.ttt_steps, self.rotary)
        self.optimizer.zero_grad(set_to_none=True)
        grad_norm = 0.0
        # A batch none of whose rows count (every target argmax outside a small --draft-vocab) has a
        # constant loss without a graph: no update (its backward raised a RuntimeError mid-run).
        if parts.rows:
            parts.loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, config.clip))
            check_finite(step + 1, lr, float(parts.loss.detach()), grad_norm)
            self.optimizer.step()
        self.pairs += int(batch.valid[:, :batch.rows.shape[1]].sum())
        self.last = {"step": step + 1, "lr": lr, "loss": float(parts.loss.detach()), "ce": parts.per_step,
                     "top1": parts.top1, "grad_norm": grad_norm}
        return parts

    def fit_to_budget(self, run_steps: int, loop_started: float) -> None:
        """With a time budget: past BUDGET_WARMUP_STEPS steps, time BUDGET_PROBE_STEPS steps, then
        plan only the steps that fit. ``run_steps``: steps done by this run (not a resumed one's)."""
        budget = self.config.time_budget
        if budget is None:
            return
        if run_steps == BUDGET_WARMUP_STEPS:
            self.probe_started = time.perf_counter()
        elif run_steps == BUDGET_WARMUP_STEPS + BUDGET_PROBE_STEPS:
            now = time.perf_counter()
            per_step = (now - self.probe_started) / BUDGET_PROBE_STEPS
            affordable = self.done + max(0, int((budget - (now - loop_started)) / per_step))
            if affordable < self.total_steps:
                self.log({"kind": "budget", "seconds": budget, "step_seconds": round(per_step, 4),
                          "planned_steps": self.total_steps, "now_planned": affordable})
                self.total_steps = affordable

    def after_step(self, step: int, heldout: FeatureSet | None, bar: Any) -> None:
        """Step ``step``'s log line, held-out evaluation and checkpoint, each when due."""
        config, total_steps = self.config, self.total_steps
        if (step + 1) % 20 == 0 or step == 0 or step + 1 == total_steps:
            self.log(dict(self.last, kind="train", seconds=round(time.perf_counter() - self.started, 1)))
        if heldout is not None and ((step + 1) % config.eval_every == 0 or step + 1 == total_steps):
            result = evaluate(self.head, self.target_head, heldout, config.ttt_steps, self.rotary, config.device)
            self.log(dict(result, kind="eval", step=step + 1, seconds=round(time.perf_counter() - self.started, 1)))
            bar.write(f"step {step + 1}: held-out CE per step {result['ce']}, top-1 {result['top1']}")
        self.done = step + 1
        if self.done % config.save_every == 0 and self.done < total_steps:
            self.save_state()
            self.write(final=False)


def train_eagle3(target: str | Path, train_dir: Path, out_dir: Path, config: Eagle3Config,
                 heldout_dir: Path | None = None, progress: bool = True, resume: bool = True,
                 on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train and write the head folder (config.json + model.safetensors) to ``out_dir``.

    Every ``save_every`` steps, and when stopped (SIGINT/SIGTERM via the CLI), the head, the
    optimizer's state and the step go to ``out_dir/train_state.pt``; with ``resume`` the same
    command continues from there, with the same result as an uninterrupted run (the window order
    is a function of seed and epoch). So a long run can share a machine: stop it, resume it later.
    ``on_step(step)`` is called after each step; raising ``StopTraining`` there stops the run
    cleanly (the CLI does on SIGINT/SIGTERM)."""
    target_dir = resolve_model_dir(target)
    data = load_features(train_dir, config.max_tokens, "--max-tokens")
    if data.aux is None or data.aux_layers is None:
        raise ValueError(f"{train_dir} has no three-layer rows: extract them with "
                         "`dovetail-train features --aux-layers a,b,c`")
    heldout = load_features(heldout_dir, config.eval_tokens, "--eval-tokens") if heldout_dir else None
    if heldout is not None and heldout.aux_layers != data.aux_layers:
        raise ValueError(f"held-out rows come from layers {heldout.aux_layers}, training rows from {data.aux_layers}")
    vocab_size = load_spec(target_dir).vocab_size
    for folder, features in ((train_dir, data), (heldout_dir, heldout)):
        if features is not None:
            check_token_ids(features, vocab_size, folder)
    out_dir.mkdir(parents=True, exist_ok=True)  # after the data checks: a refused run leaves no empty folder
    run = _Eagle3Run(target_dir, data, out_dir, config, heldout)
    del data  # the run's copy stands (on the GPU when it fits there): no second one held
    run.resume_or_start(resume)
    bar = tqdm(total=run.total_steps, initial=run.done, desc=f"train {config.fusion}", unit="step",
               disable=None if progress else True, dynamic_ncols=True)  # off where stderr is no terminal
    first_step, loop_started = run.done, time.perf_counter()
    try:
        while run.done < run.total_steps:
            step = run.done
            parts = run.one_step(step)
            bar.update(1)
            bar.set_postfix(loss=f"{run.last['loss']:.3f}", top1=f"{parts.top1[0]:.3f}", lr=f"{run.last['lr']:.1e}")
            run.after_step(step, heldout, bar)
            run.fit_to_budget(run.done - first_step, loop_started)
            bar.total = run.total_steps
            if on_step is not None:
                on_step(run.done)
    except StopTraining:
        # Stopped between steps (a deadline, a machine needed for something else): keep what was
        # learned and exactly where it stopped; the same command resumes from there.
        bar.close()
        run.save_state()
        return run.write(final=False)
    except KeyboardInterrupt:
        # Stopped mid-step: an update may be half applied, so the state of the last checkpoint
        # stands (a resume repeats the steps since); the head as it is still gets written.
        bar.close()
        return run.write(final=False)
    finally:
        bar.close()
    run.save_state()
    return run.write(final=True)
