"""``dovetail-train``: features -> train -> eval for a draft head (DESIGN.md sections 7, 10).

The commands compose what lives below: features and training in ``gpu_worker.train`` (the
model box alone), ``eval`` in ``dovetail_runtime.draft_eval`` (the whole draft/verify cycle).
Each command's options arrive as one typed settings object.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ipc.tree import MAX_DEPTH, MAX_TOP_K, MAX_TREE_TOKENS

from .click_types import FiniteFloatRange

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ConfigT = TypeVar("ConfigT")

# --seed's bound: the window order seeds torch with seed * 1,000,003 + epoch (gpu_worker.train.data.epoch_order),
# which must fit 64 bits; a larger seed failed with "Overflow when unpacking long long" once the features had loaded.
SEED_LIMIT = 1 << 42

CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def check_device(device: str) -> str:
    """``--device``: cpu, or cuda when torch sees a CUDA device (a clear error otherwise)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False; "
                               f"this torch is {torch.__version__}); use --device cpu")
    return device


def warn_if_bf16_is_emulated(bf16: bool, device: str) -> bool:
    """``--bf16`` on a CPU without native bf16 (AVX512-BF16 or AMX): torch then runs the bf16
    matmuls on a generic path, and a step costs many times an fp32 one; say so before the run.
    Returns whether it warned."""
    from cpu_worker.precision import cpu_has_native_bf16

    if not bf16 or device != "cpu" or cpu_has_native_bf16():
        return False
    click.echo("warning: --bf16 on a CPU without AVX512-BF16 or AMX: bf16 matmuls run on a slow generic path "
               f"here ({BF16_EMULATED_NOTE}); --fp32 trains the same head far faster on this CPU", err=True)
    return True


# Measured with dovetail-train train --recipe dgf-eagle3 --batch-size 8 --threads 2 (docs/training.md).
BF16_EMULATED_NOTE = "on a 2-core AMD EPYC a dgf-eagle3 step of 8 windows took 212 s, against 10-13 s at --fp32"


def parse_aux_layers(value: str | None, num_layers: int) -> tuple[int, int, int] | None:
    """``--aux-layers``: 'auto' (EAGLE's rule {2, L//2, L-3}) or three ids 'a,b,c'; None: not asked."""
    from gpu_worker.eagle3 import resolve_aux_layers

    if value is None:
        return None
    try:
        override = None if value == "auto" else [int(part) for part in value.split(",")]
        return resolve_aux_layers(num_layers, override, option="--aux-layers")
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--aux-layers") from None


def target_option(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """--target: a model folder, GGUF file or cached hub id that is there, and not a draft head (a head
    given as --target was called a folder without a tokenizer); else one line, not a traceback."""
    from dovetail_runtime.preflight import PreflightError, check_target

    try:
        check_target(value)
    except PreflightError as error:
        raise click.BadParameter(str(error).removeprefix("--target: ")) from None
    return value


def draft_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """--draft: a head folder with a config.json that reads as JSON (else one line, not a traceback)."""
    from cpu_worker.model.model_dir import ModelLoadError, read_config, resolve_model_dir

    if value is None:
        return None
    try:
        folder = resolve_model_dir(value)
    except ModelLoadError as error:
        raise click.BadParameter(str(error).replace("model folder", "draft head folder")) from None
    if not (folder / "config.json").is_file():
        raise click.BadParameter(f"{folder} has no config.json: not a draft head folder (dovetail-train train "
                                 "writes one)")
    try:
        read_config(folder)  # a config.json that is not JSON was a JSONDecodeError traceback from eval/export
    except ModelLoadError as error:
        raise click.BadParameter(str(error)) from None
    return value


def features_option(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    """--features/--heldout: a finished feature folder (else one line, not a traceback from loading it)."""
    from gpu_worker.train.shards import MANIFEST, read_manifest

    if value is None:
        return None
    try:
        manifest = read_manifest(value)
    except (OSError, ValueError) as error:
        raise click.BadParameter(f"{value / MANIFEST} cannot be read: {error}") from None
    if not isinstance(manifest, dict):
        raise click.BadParameter(f"{value} is not a feature folder (no {MANIFEST}): make one with "
                                 f"dovetail-train features --out {value}")
    if not manifest.get("complete"):
        raise click.BadParameter(f"{value}: feature extraction did not finish; rerun the same "
                                 "dovetail-train features command to resume")
    return value


def out_dir_option(_ctx: click.Context, _param: click.Parameter, value: Path) -> Path:
    """--out: a folder that can be made (or is there) and written: a path under a file, or a read-only
    place, failed with a traceback from mkdir only after the target had loaded."""
    import os

    existing = value.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise click.BadParameter(f"{existing} is a file, so {value} cannot be a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise click.BadParameter(f"{existing} is not writable")
    return value


def check_features_match_target(target: str, folders: list[Path | None]) -> None:
    """Features are the target's hidden states: made with another target, they fail deep in the first
    step with a shape error ("mat1 and mat2 shapes cannot be multiplied"); said up front instead."""
    from cpu_worker.model.model_dir import ModelLoadError, read_config, resolve_model_dir
    from gpu_worker.train.shards import read_manifest

    try:
        hidden = int(read_config(resolve_model_dir(target))["hidden_size"])
    except (ModelLoadError, OSError, KeyError, ValueError, TypeError):
        return  # the target's own check says what is wrong with it
    for folder in filter(None, folders):
        stored = (read_manifest(folder) or {}).get("hidden_size")
        if stored is not None and int(stored) != hidden:
            raise click.UsageError(f"{folder} holds features of a target with hidden size {stored}, but --target "
                                   f"{target} has {hidden}: extract them with this --target")


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"


# A draft head is one to a few layers; past this a typo (--layers 1000) filled memory after the features loaded.
MAX_HEAD_LAYERS = 32


class TrainCommands(click.Group):
    """dovetail-train's commands: a bad corpus (a missing input, a malformed JSON line) or a target or
    head that cannot load (no config.json or weights, a corrupt file, an unsupported architecture)
    is the user's error, said in one line like any bad option, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from cpu_worker.model.model_dir import ModelLoadError
        from gpu_worker.checkpoint import DraftCheckpointError
        from gpu_worker.train.corpus import CorpusError

        try:
            return super().invoke(ctx)
        except (CorpusError, ModelLoadError, DraftCheckpointError) as error:
            raise click.ClickException(str(error)) from None


@click.group(cls=TrainCommands, context_settings=CONTEXT)
def main() -> None:
    """Train a draft head for a target model: extract features, train, measure tau."""


@main.command(context_settings=CONTEXT)
@click.option("--target", required=True, callback=target_option,
              help="Target model folder (Hugging Face layout) or cached hub id.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              callback=out_dir_option,
              help="Feature folder (shards + manifest.json); rerun the same command to resume.")
@click.option("--input", "inputs", multiple=True, help="Text file, folder, glob, .jsonl (text field or "
              "ShareGPT conversations) or .json list; repeatable.")
@click.option("--stdlib", is_flag=True, help="Use this Python's standard library (.py files outside "
              "site-packages: the testbed's corpus) as the input.")
@click.option("--pattern", default="*.txt", help="File-name glob for folders given with --input "
              "(--stdlib uses *.py).")
@click.option("--exclude", multiple=True, help="Glob on paths relative to an input folder to leave out.")
@click.option("--split", type=click.Choice(["train", "heldout", "all"]), default="all",
              help="For folders: keep one side of the testbed rule int(sha1(relative path)) % 20 == 0 -> heldout.")
@click.option("--text-field", default="text", help="JSONL field holding plain text.")
@click.option("--chat-template/--no-chat-template", default=True,
              help="Render conversations with the tokenizer's chat template when it has one "
              "(else plain 'role: content' lines).")
@click.option("--window", type=click.IntRange(min=2), default=512, help="Tokens per window (each prefilled from "
              "position 0; the testbed was trained on 512).")
@click.option("--dtype", type=click.Choice(["fp16", "fp32", "bf16"]), default="fp16", help="Stored feature "
              "precision; bf16 also runs the target in bf16 (for 7B-13B targets on a GPU).")
@click.option("--aux-layers", default=None, help="Also store EAGLE-3's three-layer rows: the residual streams "
              "entering target layers 'a,b,c' (distinct, increasing), or 'auto' for EAGLE's rule {2, L//2, L-3}. "
              "Needed by --recipe eagle3 / dgf-eagle3.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", help="Where the target runs.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=None, help="Stop after this many tokens.")
@click.option("--shuffle-seed", type=int, default=0, help="Shuffle the file order with this seed (so --max-tokens "
              "samples the whole corpus); -1 keeps the sorted order.")
@click.option("--shard-tokens", type=click.IntRange(min=1), default=131072, help="Tokens per shard (resume unit).")
@click.option("--overwrite", is_flag=True, help="Start over if the folder holds features made with other settings.")
@click.option("--threads", type=click.IntRange(min=1), default=2, help="torch intra-op threads.")
def features(**options: Any) -> None:
    """Run the target over a corpus and store token ids + last hidden states (after the final norm)."""
    run_features(FeatureSettings(**options))


@dataclass(frozen=True)
class FeatureSettings:
    """``dovetail-train features``' options."""

    target: str
    out_dir: Path
    inputs: tuple[str, ...]
    stdlib: bool
    pattern: str
    exclude: tuple[str, ...]
    split: str
    text_field: str
    chat_template: bool
    window: int
    dtype: str
    aux_layers: str | None
    device: str
    max_tokens: int | None
    shuffle_seed: int
    shard_tokens: int
    overwrite: bool
    threads: int


# Files one of which a folder needs for transformers to build its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def gguf_training_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """transformers' tokenizer API (offsets, chat templates) over the runtime's own GGUF tokenizer:
    the same ids, offsets, special tokens and template as ``AutoTokenizer.from_pretrained(folder,
    gguf_file=name)`` (tests/unit/test_gguf_tokenizer.py), built in ~0.3 s where transformers'
    conversion of the file's metadata took ~9 s of every training command on SmolLM2's GGUF."""
    from transformers import PreTrainedTokenizerFast

    from .gguf_tokenizer import gguf_chat_template
    from .tokenizer import Tokenizer

    ours = Tokenizer.from_dir(path)
    return PreTrainedTokenizerFast(tokenizer_object=ours.backend, chat_template=gguf_chat_template(path),
                                   **ours.special_tokens)


def target_tokenizer(target_dir: Path):
    """transformers' tokenizer for a target folder, or for a GGUF file (built from its metadata);
    a ModelLoadError when there is none (transformers' own error spoke of sentencepiece)."""
    from transformers import AutoTokenizer

    from cpu_worker.model.model_dir import ModelLoadError, is_gguf, read_config

    if is_gguf(target_dir):
        read_config(target_dir)  # our reader's one-line error for a file that is not GGUF, not transformers'
    elif not any((target_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{target_dir} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the model's "
                             "tokenizer files into it")
    tokenizer: Any  # transformers' class for it differs between its versions
    try:
        if is_gguf(target_dir):
            tokenizer = gguf_training_tokenizer(target_dir)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    except Exception as error:  # the GGUF reader's TokenizerLoadError (merges, scores missing); transformers' own
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        what = " (its tokenizer.ggml metadata is incomplete)" if is_gguf(target_dir) else ""
        raise ModelLoadError(f"cannot load the tokenizer of {target_dir}{what}: {reason}") from None
    # Whole documents are tokenized, then cut into windows or prompts that fit: transformers' warning
    # that a document is longer than the model's context ("will result in indexing errors") is wrong here.
    tokenizer.model_max_length = sys.maxsize
    return tokenizer


def run_features(settings: FeatureSettings) -> None:
    import torch

    from cpu_worker.model import load_decoder, load_spec, resolve_model_dir
    from gpu_worker.train.corpus import STDLIB_EXCLUDE, STDLIB_PATTERN, expand_inputs, shuffled, stdlib_root
    from gpu_worker.train.features import extract_features, folder_bytes

    set_threads(settings.threads)
    inputs, pattern, exclude = settings.inputs, settings.pattern, settings.exclude
    if settings.stdlib:
        inputs = (str(stdlib_root()),) + tuple(inputs)
        pattern, exclude = STDLIB_PATTERN, tuple(exclude) + STDLIB_EXCLUDE
    if not inputs:
        raise click.UsageError("give --input (repeatable) or --stdlib")
    target_dir = resolve_model_dir(settings.target)
    check_device(settings.device)
    spec = load_spec(target_dir)
    aux = parse_aux_layers(settings.aux_layers, spec.num_layers)
    split = None if settings.split == "all" else settings.split
    files = expand_inputs(inputs, pattern, exclude, split)
    if not files:  # the usual cause: a folder searched for the default *.txt
        raise click.UsageError(f"the inputs name no files (folders are searched for --pattern {pattern}, "
                               f"--split {settings.split})")
    files = shuffled(files, None if settings.shuffle_seed < 0 else settings.shuffle_seed)
    tokenizer = target_tokenizer(target_dir)
    windows = _windows(files, tokenizer, settings)
    check_window_fits(windows, spec)
    config = {"target": str(target_dir.resolve()), "inputs": [str(Path(i).resolve()) for i in inputs],
              "pattern": pattern, "exclude": list(exclude), "split": settings.split,
              "text_field": settings.text_field, "chat_template": settings.chat_template, "window": settings.window,
              "max_tokens": settings.max_tokens, "shuffle_seed": settings.shuffle_seed, "files": len(files)}
    # The target in bf16 for bf16 features, else in fp32 (no int8 here: features are the target's own).
    dtype = torch.bfloat16 if settings.dtype == "bf16" else torch.float32
    model = load_decoder(target_dir, dtype, spec=spec).to(settings.device)
    try:
        manifest = extract_features(model, windows, settings.out_dir, config, dtype=settings.dtype,
                                    shard_tokens=settings.shard_tokens, overwrite=settings.overwrite, aux_layers=aux)
    except ValueError as error:  # --out holds features made with other settings
        raise click.UsageError(str(error)) from None
    click.echo(f"{manifest['tokens']:,} tokens in {manifest['windows']:,} windows from {len(files):,} files "
               f"({manifest['loss_tokens']:,} with loss), {len(manifest['shards'])} shards; "
               f"disk use {human_bytes(folder_bytes(settings.out_dir))} in {settings.out_dir}")


def check_window_fits(windows: list[Any], spec: Any) -> None:
    """Windows longer than the target's context are refused before it loads: the default path failed
    after writing a manifest (so the fixed command was then refused as "other settings"), and the
    --aux-layers / bf16 path stored rows for positions the target was never trained on."""
    longest, limit = max(len(window.tokens) for window in windows), spec.context_limit
    if longest > limit:
        raise click.BadParameter(f"windows of up to {longest} tokens, past the target's context of {limit} "
                                 f"(max_position_embeddings); use --window {limit} or less", param_hint="--window")


def _windows(files: list[Path], tokenizer: Any, settings: FeatureSettings) -> list[Any]:
    """The corpus tokenized and cut into windows, with a progress bar; a usage error when none."""
    from tqdm import tqdm

    from gpu_worker.train.corpus import read_documents
    from gpu_worker.train.features import cut_windows

    # Closed even when capped early; off where stderr is no terminal (a log), as the features bar is.
    with tqdm(files, desc="tokenize", unit="file", dynamic_ncols=True, disable=None) as bar:
        documents = read_documents(bar, tokenizer, text_field=settings.text_field,
                                   chat_template=settings.chat_template)
        windows = cut_windows(documents, settings.window, settings.max_tokens)
    if not windows:
        raise click.UsageError("the inputs hold no window of 2 or more tokens")
    return windows


@main.command(context_settings=CONTEXT)
@click.option("--target", required=True, callback=target_option,
              help="Target model folder (Hugging Face layout) or cached hub id.")
@click.option("--features", "train_dir", required=True, callback=features_option,
              type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Training feature folder (from `dovetail-train features`).")
@click.option("--heldout", "heldout_dir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              callback=features_option,
              help="Held-out feature folder for periodic evaluation (loss, top-1 agreement).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              callback=out_dir_option,
              help="Head folder: config.json + model.safetensors (use as dovetail-run --draft), plus "
              "train_state.pt (resume) and train_log.jsonl.")
@click.option("--recipe", type=click.Choice(["eagle1", "eagle3", "dgf-eagle3"]), default="eagle1",
              help="eagle1: --fusion head on last-layer features (feature + token loss, teacher-forced); eagle3 / "
              "dgf-eagle3: EAGLE-3 head on three-layer rows (--aux-layers features), training-time test, "
              "CE on a --draft-vocab vocabulary.")
@click.option("--fusion", type=click.Choice(["dgf", "fc"]), default="dgf", help="eagle1 recipe: dgf (Dovetail) "
              "or fc (EAGLE-1/2).")
@click.option("--draft-vocab", type=click.IntRange(min=1), default=4096, help="eagle3 recipes: draft vocabulary "
              "size (the most frequent predicted tokens of the training features; d2t/t2d in the head).")
@click.option("--ttt-steps", type=click.IntRange(min=1), default=7, help="eagle3 recipes: training-time-test "
              "steps (EAGLE-3 unrolls 7).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", help="eagle3 recipes: where to train.")
@click.option("--layers", type=click.IntRange(min=1, max=MAX_HEAD_LAYERS), default=1,
              help="Decoder layers in the head (eagle3 recipes: the EAGLE-3 layer, then plain ones; published "
                   "EAGLE-3 heads have 1).")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, help="Windows per step.")
@click.option("--lr", type=FiniteFloatRange(min=0, min_open=True),
              default=1e-3, help="Peak learning rate (AdamW, betas 0.9/0.95).")
@click.option("--warmup", type=click.IntRange(min=0), default=100, help="Linear warmup steps.")
@click.option("--min-lr-ratio", type=FiniteFloatRange(min=0, max=1),
              default=0.1, help="Cosine decays to this fraction of --lr.")
@click.option("--weight-decay", type=FiniteFloatRange(min=0), default=0.0)
@click.option("--clip", type=FiniteFloatRange(min=0, min_open=True, infinity=True),
              default=0.5, help="Gradient-norm clipping (inf: none).")
@click.option("--noise", type=FiniteFloatRange(min=0),
              default=0.1, help="Input-feature noise U(-a, a), a = NOISE x feature RMS.")
@click.option("--epochs", type=FiniteFloatRange(min=0, min_open=True),
              default=1.0, help="Passes over the (capped) training windows.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Train exactly this many steps "
              "(overrides --epochs).")
@click.option("--max-tokens", type=click.IntRange(min=2), default=None,
              help="Use only the first N tokens of the training features (a fixed budget for ablations).")
@click.option("--time-budget", type=FiniteFloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="eagle3 recipes: train for about this long: after 20 timed steps the plan (--epochs or "
                   "--steps) shrinks to the steps that fit, the learning rate decaying over them.")
@click.option("--features-on-host", is_flag=True, help="eagle3 recipes on CUDA: keep the training features in host "
              "memory (by default they move to the GPU when they take at most half its free memory, and each "
              "step's batch is cut there).")
@click.option("--eval-every", type=click.IntRange(min=1), default=200, help="Steps between held-out evaluations.")
@click.option("--eval-tokens", type=click.IntRange(min=2), default=65536, help="Held-out tokens per evaluation.")
@click.option("--save-every", type=click.IntRange(min=1), default=200, help="Steps between resumable checkpoints.")
@click.option("--seed", type=click.IntRange(min=-SEED_LIMIT, max=SEED_LIMIT), default=0,
              help="Initialisation, noise and window order.")
@click.option("--bf16/--fp32", "bf16", default=False, help="bf16 autocast for the matmuls (CPUs with avx512_bf16/AMX: "
              "~30% faster; elsewhere many times slower, and the run says so); weights and optimizer stay fp32.")
@click.option("--save-dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", help="Precision of the saved head.")
@click.option("--include-frozen", is_flag=True, help="Also store the embedding and lm_head (else they load from "
              "the target folder).")
@click.option("--restart", is_flag=True, help="Ignore an existing train_state.pt in --out.")
@click.option("--threads", type=click.IntRange(min=1), default=2, help="torch intra-op threads.")
def train(**options: Any) -> None:
    """Train a draft head on stored features; the result loads with dovetail-run --draft OUT."""
    settings = TrainSettings(**options)
    check_train_out(settings)
    check_features_match_target(settings.target, [settings.train_dir, settings.heldout_dir])
    set_threads(settings.threads)
    check_device(settings.device)
    warn_if_bf16_is_emulated(settings.bf16, settings.device)
    if settings.recipe != "eagle1":
        run_eagle3_training(settings)
        return
    from gpu_worker.train.trainer import TrainConfig
    from gpu_worker.train.trainer import train as run_training

    if settings.device != "cpu":
        raise click.UsageError("--device cuda is for the eagle3 recipes")
    if settings.time_budget is not None:
        raise click.UsageError("--time-budget is for the eagle3 recipes")
    config = config_from(TrainConfig, settings)
    try:
        summary = run_training(settings.target, settings.train_dir, settings.out_dir, config,
                               heldout_dir=settings.heldout_dir, resume=not settings.restart)
    except ValueError as error:  # --out's train_state.pt has other settings (as the eagle3 recipes say)
        raise click.UsageError(str(error)) from None
    click.echo(f"{summary['steps']} steps in {summary['seconds']:.0f} s on {summary['train_tokens']:,} tokens; "
               f"head written to {settings.out_dir}")


@dataclass(frozen=True)
class TrainSettings:
    """``dovetail-train train``'s options (the recipes' configs take theirs by name)."""

    target: str
    train_dir: Path
    heldout_dir: Path | None
    out_dir: Path
    recipe: str
    fusion: str
    draft_vocab: int
    ttt_steps: int
    device: str
    layers: int
    batch_size: int
    lr: float
    warmup: int
    min_lr_ratio: float
    weight_decay: float
    clip: float
    noise: float
    epochs: float
    steps: int | None
    max_tokens: int | None
    time_budget: float | None
    features_on_host: bool
    eval_every: int
    eval_tokens: int
    save_every: int
    seed: int
    bf16: bool
    save_dtype: str
    include_frozen: bool
    restart: bool
    threads: int


def check_train_out(settings: TrainSettings) -> None:
    """--out must not hold a model this run cannot be resuming: a run writes config.json and
    model.safetensors there, and overwrote the target's own (--out T) or a finished head from
    elsewhere (an exported or downloaded one, which has no train_state.pt) without a word."""
    from cpu_worker.model import resolve_model_dir
    from gpu_worker.train.trainer import LOG_NAME, STATE_NAME

    out = settings.out_dir
    if out.resolve() == resolve_model_dir(settings.target).resolve():
        raise click.BadParameter("is the target's folder: the head would overwrite its config.json and weights",
                                 param_hint="--out")
    ours = any((out / name).exists() for name in (STATE_NAME, LOG_NAME))  # a run's folder, resumable or not
    if (out / "config.json").exists() and not ours and not settings.restart:
        raise click.BadParameter(f"{out} already holds a model (config.json) and no {STATE_NAME} to resume: name a "
                                 "new folder, or add --restart to overwrite it", param_hint="--out")


def config_from(config_type: type[ConfigT], settings: Any, **overrides: Any) -> ConfigT:
    """A config dataclass with each field taken from the settings field of its name, or from ``overrides``."""
    names = [field.name for field in dataclasses.fields(config_type)]  # type: ignore[arg-type]
    values = {name: getattr(settings, name) for name in names if name not in overrides}
    return config_type(**values, **overrides)


def run_eagle3_training(settings: TrainSettings) -> None:
    """The eagle3 / dgf-eagle3 recipes; SIGTERM or Ctrl-C stops at the end of the step (resumable)."""
    import signal

    from gpu_worker.train.eagle3_trainer import Eagle3Config, StopTraining, train_eagle3

    eagle3 = config_from(Eagle3Config, settings, fusion=settings.recipe)
    received: list[int] = []  # the signal that asked to stop, if one did

    def stop(signum: int, _frame: object) -> None:
        if received:  # asked twice: stop now (the last checkpoint's state stands)
            raise KeyboardInterrupt
        received.append(signum)  # at the end of this step: the state saved there resumes exactly

    def between_steps(_step: int) -> None:
        if received:
            raise StopTraining

    # SIGTERM too: a background job started by a script ignores SIGINT.
    previous = {number: signal.signal(number, stop) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = train_eagle3(settings.target, settings.train_dir, settings.out_dir, eagle3,
                              heldout_dir=settings.heldout_dir, resume=not settings.restart, on_step=between_steps)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    stopped = "" if result["finished"] else \
        f" (stopped early: {result['steps']} of {result['planned_steps']} steps)"
    click.echo(f"{result['steps']} steps{stopped} in {result['seconds']:.0f} s on {result['train_tokens']:,} "
               "tokens "
               f"(draft vocabulary covers {result['draft_vocab_coverage']:.2%} of them); head written to "
               f"{settings.out_dir}")
    if received:  # cut short: not a success, so `train && cp head ...` or a `set -e` script stops here (130/143)
        sys.exit(128 + received[0])


def parse_tree(value: str) -> tuple[int, int, int]:
    """T,DEPTH,TOP_K within the tree's bounds (a T of 0 or a negative depth was a TreeError traceback
    after the models had loaded)."""
    from ipc.tree import TreeError, TreeShape

    try:
        tree_tokens, depth, top_k = (int(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected T,DEPTH,TOP_K such as 16,6,8; got {value!r}") from None
    try:
        TreeShape.clamped(tree_tokens, depth, top_k)
    except TreeError as error:
        raise click.BadParameter(f"{value}: {error}") from None
    return tree_tokens, depth, top_k


def trees_option(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """--tree: each value checked before anything loads (run_eval parses them again)."""
    for value in values:
        parse_tree(value)
    return values


@main.command("eval", context_settings=CONTEXT)
@click.option("--target", required=True, callback=target_option,
              help="Target model folder (Hugging Face layout) or cached hub id.")
@click.option("--draft", required=True, callback=draft_option, help="Draft head folder.")
@click.option("--input", "inputs", multiple=True, help="Files/folders/globs of plain text to take prompts from "
              "[default: the stdlib held-out split, the testbed protocol].")
@click.option("--pattern", default="*.py", help="File-name glob for folders given with --input.")
@click.option("--chat", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A .jsonl of chat prompts ({\"prompt\": ...} lines, e.g. from python -m tools.chat_data "
                   "--heldout): each rendered with the target's chat template, instead of --input's files.")
@click.option("--split", type=click.Choice(["train", "heldout", "all"]), default="heldout",
              help="For folders: one side of the sha1 % 20 rule.")
@click.option("--files", type=click.IntRange(min=1), default=None, help="Use the first N eligible files (sorted).")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=256, help="Prompt = the first N tokens.")
@click.option("--new-tokens", type=click.IntRange(min=1), default=128, help="Greedy tokens to generate.")
@click.option("--tree-tokens", type=click.IntRange(min=1, max=MAX_TREE_TOKENS), default=16,
              help="Tree size T (root included).")
@click.option("--depth", type=click.IntRange(min=1, max=MAX_DEPTH), default=6, help="Most draft tokens on one path.")
@click.option("--tree-top-k", "top_k", type=click.IntRange(min=1, max=MAX_TOP_K), default=8,
              help="The draft tree's beam width: children kept per node and nodes per level.")
@click.option("--tree", "trees", multiple=True, callback=trees_option,
              help="Extra tree settings T,DEPTH,TOP_K (repeatable), e.g. 7,4,4.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the table.")
@click.option("--threads", type=click.IntRange(min=1), default=2, help="torch intra-op threads.")
def evaluate(**options: Any) -> None:
    """Greedy tau of a head (testbed protocol by default), checked lossless against the target."""
    from dovetail_runtime.preflight import PreflightError, check_pair

    settings = EvalSettings(**options)
    try:
        check_pair(settings.target, settings.draft)  # a head for another model: named, not a shape error
    except PreflightError as error:
        raise click.UsageError(str(error)) from None
    run_eval(settings)


@dataclass(frozen=True)
class EvalSettings:
    """``dovetail-train eval``'s options."""

    target: str
    draft: str
    inputs: tuple[str, ...]
    pattern: str
    chat: Path | None
    split: str
    files: int | None
    prompt_tokens: int
    new_tokens: int
    tree_tokens: int
    depth: int
    top_k: int
    trees: tuple[str, ...]
    as_json: bool
    threads: int


def run_eval(settings: EvalSettings) -> None:
    from cpu_worker.engine import TargetEngine
    from cpu_worker.model import resolve_model_dir
    from cpu_worker.target_loading import load_target_model
    from dovetail_runtime.draft_eval import format_table, measure_tau
    from gpu_worker.drafter import Drafter
    from gpu_worker.train.eagle3_io import is_eagle3_folder
    from ipc.tree import TreeShape

    set_threads(settings.threads)
    target_dir = resolve_model_dir(settings.target)
    tokenizer = target_tokenizer(target_dir)
    prompts = _eval_prompts(tokenizer, settings)
    trees = [(settings.tree_tokens, settings.depth, settings.top_k)] + [parse_tree(value) for value in settings.trees]
    longest = max(len(ids) for _, ids in prompts)  # chat prompts run past --prompt-tokens
    room = max(settings.prompt_tokens, longest) + settings.new_tokens + max(t for t, _, _ in trees) + 1
    check_room(room, target_dir)
    model = load_target_model(target_dir).eval()
    engine = TargetEngine(model, max_len=room)
    scratch = max(TreeShape.clamped(*tree).scratch_slots for tree in trees)
    eos = tokenizer.eos_token_id
    if is_eagle3_folder(settings.draft):
        results = eagle3_tau(engine, settings.draft, target_dir, prompts, settings.new_tokens, eos, trees,
                             room, scratch)
    else:
        drafter = Drafter.from_pretrained(settings.draft, target_dir, max_len=room, device="cpu",
                                          scratch_len=scratch)
        results = measure_tau(engine, drafter, prompts, settings.new_tokens, eos, trees)
    if settings.as_json:
        click.echo(json.dumps({"target": str(target_dir), "draft": str(settings.draft),
                               "prompt_tokens": settings.prompt_tokens, "new_tokens": settings.new_tokens,
                               "results": [r.as_dict() for r in results]}, indent=1))
        return
    click.echo(format_table(results))
    ties = sum(len(r.near_ties) for r in results)
    click.echo("lossless: every output equals the target's greedy decode"
               + (f" ({ties} near-tie divergences, top-2 gap < 1e-4)" if ties else ""))


def check_room(room: int, target_dir: Path) -> None:
    """A prompt, its new tokens and the largest tree must fit the target's context: past it the engine
    refused with "max_len must be in 1..N" in a traceback, after the target had loaded."""
    from cpu_worker.model import load_spec

    limit = load_spec(target_dir).context_limit
    if room > limit:
        raise click.UsageError(f"the longest prompt, --new-tokens and the largest tree need {room} positions, past "
                               f"the target's context of {limit}: ask for fewer --new-tokens or --prompt-tokens")


def _eval_prompts(tokenizer: Any, settings: EvalSettings) -> list[tuple[str, list[int]]]:
    """The prompts ``eval`` measures on (the stdlib's held-out files by default); a usage error when none."""
    from dovetail_runtime.draft_eval import file_prompts
    from gpu_worker.train.corpus import expand_inputs, stdlib_files, stdlib_root

    if settings.chat is not None:
        return chat_prompts(tokenizer, settings.chat, settings.files)
    split = None if settings.split == "all" else settings.split
    if settings.inputs:
        paths, root = expand_inputs(settings.inputs, settings.pattern, (), split), None
    else:
        root = stdlib_root()
        paths = stdlib_files(split, root)
    if not paths:  # was "no file has more than N tokens", as if files had been read
        raise click.UsageError(f"the inputs name no files (folders are searched for --pattern {settings.pattern}, "
                               f"--split {settings.split})")
    prompts = file_prompts(paths, tokenizer, settings.prompt_tokens, settings.files, root)
    if not prompts:
        raise click.UsageError(f"no file has more than {settings.prompt_tokens} tokens")
    return prompts


def user_turn_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as a user turn with the generation prompt, through the model's chat template (transformers')."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def chat_prompts(tokenizer: Any, path: Path, limit: int | None) -> list[tuple[str, list[int]]]:
    """(prompt, ids) for each ``{"prompt": ...}`` line of ``path``, rendered as a user turn with the
    generation prompt; a usage error for a line that is not such an object."""
    from gpu_worker.train.chat import has_chat_template
    from gpu_worker.train.corpus import read_corpus_text

    if not has_chat_template(tokenizer):  # transformers' ValueError came as a traceback from the first prompt
        raise click.UsageError(f"--chat {path}: the target's tokenizer has no chat template to render the prompts "
                               "with; give plain-text prompts with --input")
    prompts = []
    for number, line in enumerate(read_corpus_text(path, strict=True).splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise click.UsageError(f"{path}:{number}: expected a JSON object with a \"prompt\" string") from None
        if not isinstance(text, str):
            raise click.UsageError(f"{path}:{number}: expected a JSON object with a \"prompt\" string")
        prompts.append((text, user_turn_ids(tokenizer, text)))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise click.UsageError(f"{path} holds no prompts")
    return prompts


def eagle3_tau(engine, draft, target_dir, prompts, new_tokens, eos, settings, room, scratch):
    """measure_tau for an EAGLE-3 head: its three-layer rows come from hooks on the in-process target."""
    from dovetail_runtime.draft_eval import measure_tau
    from dovetail_runtime.eagle3_eval import AuxRows, eagle3_drafter, speculative_greedy_eagle3
    from gpu_worker.eagle3 import resolve_aux_layers
    from gpu_worker.train.eagle3_io import load_eagle3_head

    head, layers = load_eagle3_head(draft, target_dir)
    aux = AuxRows(engine.model, resolve_aux_layers(engine.spec.num_layers, layers))
    drafter = eagle3_drafter(head, room, scratch)

    def speculate(engine, drafter, prompt, new_tokens, eos, tree_tokens, depth, top_k, result):
        return speculative_greedy_eagle3(engine, aux, drafter, prompt, new_tokens, eos, tree_tokens, depth, top_k,
                                         result)

    try:
        return measure_tau(engine, drafter, prompts, new_tokens, eos, settings, speculate=speculate)
    finally:
        aux.close()


def check_export(target_dir: Path, draft: str | None, out_dir: Path) -> None:
    """What export cannot do, refused before it writes: each was a traceback after a partial write
    (a GGUF target: model.safetensors, then NotADirectoryError; --out the target's own folder: its
    weights rewritten in place, then SameFileError) or after loading (an EAGLE-3 head)."""
    from cpu_worker.model.model_dir import is_gguf
    from gpu_worker.train.eagle3_io import is_eagle3_folder

    source = Path(draft) if draft else target_dir
    if out_dir.resolve() == source.resolve():
        raise click.BadParameter(f"{out_dir} is the folder it would export from: name a new folder",
                                 param_hint="--out")
    if draft is None and is_gguf(target_dir):
        raise click.UsageError(f"--target {target_dir} is a GGUF file: export copies a model folder (config.json, "
                               "safetensors, tokenizer files)")
    if draft is not None and is_eagle3_folder(draft):
        raise click.UsageError(f"{draft} is an EAGLE-3 head: dovetail-train train --save-dtype fp16 writes those "
                               "in 16 bits")


@main.command(context_settings=CONTEXT)
@click.option("--target", required=True, callback=target_option, help="Target model folder.")
@click.option("--draft", default=None, callback=draft_option, help="Head folder to export instead of the target "
              "(its embedding and lm_head are left out: they load from --target).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              callback=out_dir_option)
@click.option("--dtype", type=click.Choice(["fp16", "bf16", "fp32"]), default="fp16", help="Stored precision.")
def export(target, draft, out_dir, dtype) -> None:
    """Write a small copy of a target (weights in --dtype + config + tokenizer) or of a head."""
    from cpu_worker.model import resolve_model_dir
    from gpu_worker.train.export import export_head, export_target
    from ipc.dtypes import torch_dtype

    stored = torch_dtype(dtype)
    target_dir = resolve_model_dir(target)
    check_export(target_dir, draft, out_dir)
    if draft:
        export_head(Path(draft), target_dir, out_dir, stored)
    else:
        export_target(target_dir, out_dir, stored)
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    click.echo(f"wrote {out_dir} ({human_bytes(size)})")


if __name__ == "__main__":
    sys.exit(main())
