"""``dovetail-run`` (coordinator + workers) and ``dovetail-client``.

Neither imports torch: the client is a ZMQ socket and the coordinator handles text, token ids
and messages (the workers it starts hold the models).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import io
import json
import logging
import os
import secrets
import signal
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec
from click.core import ParameterSource

from ipc import messages as m
from ipc.dtypes import KV_DTYPES, TARGET_PRECISIONS
from ipc.endpoints import EndpointError, ipc_path, normalize_endpoint, private_runtime_dir
from ipc.placement import CoreSpecError, parse_core_list
from ipc.tree import MAX_DEPTH, MAX_TOP_K, MAX_TREE_TOKENS, TreeError, TreeShape

from .api_key import ENV_VAR, ApiKey, ApiKeyError, check_exposure, load_api_key
from .cli_options import (
    ClientRequestOptions,
    OneShotOptions,
    RunOptions,
    ServingOptions,
    client_options,
    run_options,
)
from .click_types import FiniteFloatRange
from .demo_models import CODE_DRAFT, CODE_TARGET, FETCH_HINT, SMOLLM2_DRAFT, SMOLLM2_GGUF, real_pair_present
from .generation import DEFAULT_PREFILL_CHUNK
from .lookup import DEFAULT_LOOKUP_TOKENS
from .tree_planner import TREE_SIZES, AutoTree

if TYPE_CHECKING:
    from ipc.channels import RouterServer

    from .client import DovetailClient
    from .coordinator import RuntimeSettings
    from .http_server import HttpFrontend
    from .serving import ServeLimits

log = logging.getLogger("dovetail")
# Requests a server runs at once by default: on a 2-core machine 4 sequences' decode steps cost
# 1.7-2.8x one sequence's (docs/performance.md), so 4 streams share each pass over the weights.
DEFAULT_MAX_BATCH = 4


LOG_LEVELS = ("debug", "info", "warning", "error")
DRAFT_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8", "q4_0")  # --draft-dtype (int8, q4_0: CPU only)
FIXED_DEPTH = 6  # --depth's default with a fixed --tree-tokens
MAX_LOOKUP_TOKENS = 16  # --lookup-tokens: rows of a ring slot the longest branch may need
AUTO_MAX_DEPTH = 10  # the deepest tree --tree-tokens auto tries unless --depth says otherwise


def read_text_file(path: Path, param_hint: str) -> str:
    """A file the user gave as text ("-": stdin), read as dovetail-train reads a corpus (``read_corpus_text``:
    a byte-order mark names the encoding and is dropped, else UTF-8); other bytes are a usage error."""
    from gpu_worker.train.corpus import CorpusError, decode_text, read_corpus_text

    try:
        if str(path) == "-":
            return decode_text(sys.stdin.buffer.read(), "stdin", strict=True)
        return read_corpus_text(path, strict=True)
    except CorpusError as error:
        raise click.BadParameter(str(error), param_hint=param_hint) from None


def read_prompt_file(path: Path) -> list[str]:
    """JSONL objects with a "prompt" field (every non-blank line starts with "{"), else one prompt per
    line (a line of C or JSON-like text is a prompt; one that is a {"prompt": ...} object is read as one);
    UTF-8 text, or text in the encoding its byte-order mark names (the mark is not part of the first prompt)."""
    text, where = read_text_file(path, "--prompt-file"), shown_path(path)
    # Lines end at "\n" (and "\r\n") only: str.splitlines also cuts at U+2028, U+0085 and form feeds, which
    # JSON (json.dumps(..., ensure_ascii=False)) and source code hold inside a line.
    split = (line.removesuffix("\r") for line in text.split("\n"))
    lines = [(number, line) for number, line in enumerate(split, start=1) if line.strip()]
    if not lines:  # else no prompt means serving: a server that never exits
        raise click.BadParameter(f"{where} holds no prompts (it is empty or all blank lines)",
                                 param_hint="--prompt-file")
    jsonl = all(line.lstrip().startswith("{") for _, line in lines)
    return [json_prompt(where, number, line, strict=jsonl) for number, line in lines]


def shown_path(path: Path) -> str:
    """A file option's value as messages name it ("-" is stdin)."""
    return "stdin" if str(path) == "-" else str(path)


def json_prompt(where: str, number: int, line: str, strict: bool) -> str:
    """A prompt file's line: its "prompt" where it is a JSON object with one, else the line itself, or
    (``strict``: a JSONL file) a usage error naming the line."""
    try:
        record = json.loads(line) if line.lstrip().startswith("{") else None
    except json.JSONDecodeError as error:
        if strict:
            raise click.BadParameter(f"{where}:{number}: invalid JSON: {error}", param_hint="--prompt-file") from None
        record = None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"]
    if strict:
        raise click.BadParameter(f"{where}:{number}: a JSON line needs a string \"prompt\" field",
                                 param_hint="--prompt-file")
    return line


def check_prompts_text(prompts: list[str]) -> None:
    """A prompt the tokenizer can read: an argument that is not UTF-8 reaches Python as lone surrogates
    (so does a JSON line's "\\ud800"), which no tokenizer encodes; refused before anything loads."""
    for index, prompt in enumerate(prompts, 1):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            raise click.BadParameter(f"prompt {index} is not valid text (character {error.start}: "
                                     f"{error.reason}); give UTF-8", param_hint="--prompt/--prompt-file") from None


def resolve_models(target: str | None, draft: str | None, mode: str) -> tuple[str, str | None]:
    """A demo pair stands in for a missing --target (and then for a missing --draft): the real chat
    model where its fixture has been fetched, else the bundled 9M code pair, saying how to get the real one."""
    if target is None:
        if real_pair_present():
            target, default_draft = str(SMOLLM2_GGUF), SMOLLM2_DRAFT
        elif CODE_TARGET.is_dir():
            target, default_draft = str(CODE_TARGET), CODE_DRAFT
            click.echo(f"dovetail-run: no --target: the 9M code demo (demo/{CODE_TARGET.name}); for the real chat "
                       f"model (SmolLM2-135M-Instruct) run {FETCH_HINT} once", err=True)
        else:
            raise click.UsageError(f"--target is required: no demo model at {SMOLLM2_GGUF} or {CODE_TARGET}")
        if draft is None and mode == "dovetail" and default_draft.is_dir():
            draft = str(default_draft)
    if mode == "dovetail" and not draft:
        raise click.UsageError("--draft is required in dovetail mode (or use --mode lookup, which needs no draft "
                               "head, or --mode ar)")
    return target, draft


def cores_option(_ctx, _param, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return parse_core_list(value)
    except CoreSpecError as error:
        raise click.BadParameter(str(error)) from None


def model_option(_ctx, param, value: str | None) -> str | None:
    """--target/--draft: ``--target --draft X`` hands --target the text '--draft' (and X is left
    over); an empty value would pass for a missing one. Both refused, naming the option."""
    if value is not None and value.startswith("--"):
        raise click.BadParameter(f"needs a value, but got the option {value!r}")
    if value is not None and not value.strip():
        raise click.BadParameter("is empty: give a model folder, a GGUF file or a cached hub id")
    return value


def http_option(_ctx, _param, value: str | None) -> str | None:
    """--http HOST:PORT with a port past 65535: say so, not that the syntax is wrong."""
    port = (value or "").rpartition(":")[2]
    if port.isdigit() and int(port) > 65535:
        raise click.BadParameter(f"{value!r}: port {int(port)} is out of range: the port must be 1-65535 "
                                 "(0 picks a free one)")
    return value


def stops_option(_ctx, _param, value: tuple[str, ...]) -> tuple[str, ...]:
    """--stop '' would be dropped without a word: an empty stop string matches nothing."""
    if any(stop == "" for stop in value):
        raise click.BadParameter("an empty stop string matches nothing: give the text to stop at, or leave "
                                 "--stop out")
    return value


def client_stops_option(ctx, param, value: tuple[str, ...]) -> tuple[str, ...]:
    """dovetail-client's --stop: as dovetail-run's, within the protocol's bounds (beyond them the
    request failed to encode, in a traceback)."""
    value = stops_option(ctx, param, value)
    if len(value) > m.MAX_STOPS:
        raise click.BadParameter(f"{len(value)} stop strings: a request takes at most {m.MAX_STOPS}")
    if any(len(stop) > m.MAX_STOP_CHARS for stop in value):
        raise click.BadParameter(f"a stop string of more than {m.MAX_STOP_CHARS} characters: that is the "
                                 "protocol's limit")
    return value


def utf8_option(_ctx, _param, value: str | None) -> str | None:
    """An argument that is not UTF-8 reaches Python as lone surrogates, which no message can carry:
    refused here in one line instead of failing as the request is encoded."""
    try:
        if value is not None:
            value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise click.BadParameter(f"is not valid text (character {error.start}: {error.reason}); give UTF-8") from None
    return value


def default_bind() -> str:
    """ipc://$XDG_RUNTIME_DIR/dovetail-UID.sock, or in /tmp where that variable is unset or names no
    private folder of ours (one inherited through su or sudo, or gone: serving failed with 'directory
    ... does not exist' on a path the user never named); dovetail-client reaches the same default."""
    base = private_runtime_dir() or "/tmp"
    return f"ipc://{base}/dovetail-{os.getuid()}.sock"


def endpoints_option(_ctx, _param, value):
    """``localhost:5555`` means tcp://, a path means ipc://; anything unclear is refused here."""
    try:
        if isinstance(value, tuple):
            return without_repeats(tuple(normalize_endpoint(each) for each in value))
        return None if value is None else normalize_endpoint(value)
    except EndpointError as error:
        raise click.BadParameter(str(error)) from None


def without_repeats(endpoints: tuple[str, ...]) -> tuple[str, ...]:
    """--bind's endpoints. inproc://, which no client can reach, is refused, and so is one endpoint given
    twice (``/tmp/x.sock`` and ``ipc:///tmp/./x.sock``): its second bind was refused as 'already served by
    another dovetail-run', with this process's pid."""
    seen: set[str] = set()
    for endpoint in endpoints:
        if endpoint.startswith("inproc://"):  # was served, unreachable, as 'dovetail serving on ' and nothing
            raise EndpointError(f"{endpoint} is reachable only inside this process: serve on ipc://PATH or "
                                "tcp://HOST:PORT")
        path = ipc_path(endpoint)
        key = "ipc://" + os.path.realpath(path) if path else endpoint  # symlinked folders too
        if key in seen:
            raise EndpointError(f"{endpoint} is given twice")
        seen.add(key)
    return endpoints


def connect_option(ctx, param, value: str | None) -> str | None:
    """--connect: as --bind's spellings, but inproc:// (reachable only inside the server's own
    process: the client waited out --timeout) is refused."""
    endpoint = endpoints_option(ctx, param, value)
    if endpoint is not None and endpoint.startswith("inproc://"):
        raise click.BadParameter(f"{endpoint} is reachable only inside the server's process: use the server's "
                                 "ipc://PATH or tcp://HOST:PORT")
    return endpoint


def version() -> str:
    try:
        return importlib.metadata.version("dovetail")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def sampling_options(command):
    """--temperature/--sample-top-k/--top-p/--seed, shared by dovetail-run and dovetail-client."""
    options = [
        click.option("--temperature", type=FiniteFloatRange(min=0.0, max=1000.0), default=0.0,
                     help=f"Sampling temperature; 0 = greedy (exactly the target's greedy decode), else >= "
                          f"{m.MIN_TEMPERATURE}."),
        click.option("--sample-top-k", type=click.IntRange(min=0, max=2**31 - 1), default=0,
                     help="Sample only among the k most likely tokens (0 = off). Not the tree's --tree-top-k."),
        click.option("--top-p", type=FiniteFloatRange(min=0.0, max=1.0, min_open=True), default=1.0,
                     help="Nucleus sampling: the smallest set of tokens with this much mass (1 = off)."),
        click.option("--seed", type=click.IntRange(min=0, max=2**63 - 1), default=None,
                     help="Random seed: the same seed and settings repeat the output (per mode)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def refuse_ambiguous_top_k(_ctx, _param, value: str | None) -> None:
    """``--top-k`` means sampling in llama.cpp and vLLM but was the tree's beam width here: refuse it."""
    if value is not None:
        raise click.BadParameter(f"--top-k {value} is ambiguous: use --tree-top-k {value} for the draft tree's "
                                 f"beam width, or --sample-top-k {value} to sample among the k likeliest tokens")


def api_key_options(command):
    """--api-key-file/--api-key (DOVETAIL_API_KEY), shared by dovetail-run and dovetail-client."""
    options = [
        click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="A file holding the API key (one line, at least 16 characters; yours alone: mode 0600). "
                          "Make one: (umask 077; python3 -c 'import secrets; print(secrets.token_urlsafe(32))' "
                          "> FILE)."),
        click.option("--api-key", envvar=ENV_VAR, show_envvar=True, default=None, metavar="KEY",
                     help="The API key itself. On the command line every user of the machine can read it (ps): "
                          "prefer --api-key-file, or the environment variable."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def resolve_api_key(key_file: Path | None, key_text: str | None) -> ApiKey | None:
    """The key from the options (a file first, then --api-key or DOVETAIL_API_KEY). The
    variable is then removed from this process's environment, so no child inherits it."""
    source = click.get_current_context().get_parameter_source("api_key")
    on_command_line = source == ParameterSource.COMMANDLINE
    os.environ.pop(ENV_VAR, None)
    if key_file is not None and key_text is not None and on_command_line:
        raise click.UsageError("give the API key once: --api-key-file or --api-key")
    key = load_api_key(key_file, key_text, "--api-key" if on_command_line else ENV_VAR)
    if key is not None and key_file is None and on_command_line:
        click.echo("warning: --api-key on the command line is visible to every user of this machine (ps): prefer "
                   f"--api-key-file or {ENV_VAR}", err=True)
    return key


def refuse_allow_remote(_ctx, _param, value: bool) -> None:
    """--allow-remote used to open a non-loopback bind with no authentication at all."""
    if value:
        raise click.BadParameter("is gone: serving beyond loopback now needs an API key instead "
                                 "(--api-key-file PATH or DOVETAIL_API_KEY)")


def make_sampling(temperature: float, sample_top_k: int, top_p: float, seed: int | None) -> m.Sampling:
    try:
        return m.Sampling(temperature=temperature, top_k=sample_top_k, top_p=top_p, seed=seed)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--temperature") from None


class TreeTokens(click.ParamType):
    """``auto`` (the planner picks T up to 64), ``auto:N`` (up to N), or a fixed T."""

    name = "auto|auto:N|N"

    def convert(self, value, param, ctx):
        if isinstance(value, int | tuple):
            return value
        text = str(value).strip().lower()
        auto = text == "auto" or text.startswith("auto:")
        number = text.removeprefix("auto:") if text.startswith("auto:") else text
        if text == "auto":
            return ("auto", TREE_SIZES[-1])
        try:
            size = int(number)
        except ValueError:
            self.fail(f"{value!r} is not 'auto', 'auto:N' or a tree size N", param, ctx)
        if auto and not 2 <= size <= MAX_TREE_TOKENS:
            self.fail(f"auto:N needs 2 <= N <= {MAX_TREE_TOKENS}, got {size}", param, ctx)
        if not auto and not 1 <= size <= MAX_TREE_TOKENS:
            self.fail(f"the tree size must be in 1..{MAX_TREE_TOKENS}, got {size}", param, ctx)
        return ("auto", size) if auto else size


class JoinChunk(click.ParamType):
    """``auto`` (sized by the running requests' cycle) or a number of prompt tokens."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value == "auto":
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        try:
            size = int(text)
        except ValueError:
            self.fail(f"{value!r} is not 'auto' or a number of prompt tokens", param, ctx)
        if size < 1:
            self.fail(f"a chunk needs at least 1 prompt token, got {size}", param, ctx)
        return size


def make_tree(tree_tokens: int | tuple[str, int], depth: int | None, tree_top_k: int) -> TreeShape | AutoTree:
    try:
        if isinstance(tree_tokens, tuple):
            return AutoTree(max_tree_tokens=tree_tokens[1], max_depth=depth or AUTO_MAX_DEPTH, top_k=tree_top_k)
        return TreeShape.clamped(tree_tokens, depth or FIXED_DEPTH, tree_top_k)
    except (TreeError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="--tree-tokens/--depth/--tree-top-k") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(version(), "--version", prog_name="dovetail-run", message="%(prog)s %(version)s")
@click.option("--target", default=None, callback=model_option,
              help="Target model: a local Hugging Face folder, or a hub id already in the local cache "
              "(never downloaded), or a GGUF file.  [default: the SmolLM2-135M-Instruct demo "
              f"({FETCH_HINT} fetches it), else the bundled code model demo/target-code-9m]")
@click.option("--draft", default=None, callback=model_option,
              help="Draft head folder, or a hub id already in the local cache (Dovetail DGF/fc/EAGLE-3, or a "
              "published EAGLE-1/2 or EAGLE-3 head). Required with your own --target unless --mode ar.  [default "
              "without --target: the demo target's head, demo/draft-smollm2 or demo/draft-dgf]")
@click.option("--bind", "binds", multiple=True, callback=endpoints_option,
              help="Client endpoint to serve on (repeatable): ipc://PATH or tcp://127.0.0.1:PORT (HOST:PORT and "
                   "paths are understood). A socket another server already serves is refused. tcp:// on an address "
                   "other than loopback needs an API key; with one, every tcp:// endpoint uses CURVE (ipc:// is "
                   "protected by its 0600 socket file). [default: ipc://$XDG_RUNTIME_DIR/dovetail-UID.sock]")
@click.option("--http", "http_address", default=None, metavar="HOST:PORT", callback=http_option,
              help="Also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                   "/health, /metrics) here, e.g. 127.0.0.1:8000 (a port alone: on loopback). With --bind both "
                   "serve one queue; without, only HTTP is served. An address other than loopback needs an API "
                   "key; with one, every request but GET /health must send it (Authorization: Bearer KEY), "
                   "whatever the address.")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="With --http: let web pages from ORIGIN (e.g. http://localhost:3000; repeatable; * for any) "
                   "call the HTTP API from a browser (CORS). The API key, if any, is still needed. [default: no "
                   "CORS headers: browsers refuse cross-origin calls]")
@click.option("--served-model-name", default=None, metavar="NAME",
              help="With --http: the model's name in the API (/v1/models, and the 'model' field requests may give), "
                   "e.g. the same name on every replica behind a router. [default: the target folder's or file's "
                   "name]")
@api_key_options
@click.option("--allow-remote", is_flag=True, expose_value=False, hidden=True, callback=refuse_allow_remote,
              help="Refused: serving beyond loopback needs an API key.")
@click.option("--cpu-threads", type=click.IntRange(min=1, max=m.MAX_THREADS), default=None,
              help="Intra-op threads of the target worker. [default: one per pinned core, else torch's (one per "
                   "core), at most a container's CPU quota]")
@click.option("--cpu-cores", callback=cores_option, default=None,
              help="Pin every target-worker thread to these cores: a list with ranges, e.g. 0-7,16-23.")
@click.option("--target-dtype", type=click.Choice(("auto", *TARGET_PRECISIONS)), default="auto",
              help="Target precision on the CPU. auto: a GGUF file's own blocks, as stored, times 16-bit "
                   "activations (q4_1-a16 for a Q4_1 file, int8 for Q8_0; give q4_1 or q8_0 for llama.cpp's "
                   "8-bit activations: verification a third faster, text further from fp32's), fp32 for a "
                   "model folder (int8, else q4_0, where fp32 would take over 90% of this machine's memory; a "
                   "precision that does not fit the memory free now gets a warning naming what would; without a C "
                   "compiler int8-row instead of a block format). "
                   "int8: 8-bit weights in blocks of 32 "
                   "(Q8_0's) times activations quantized to 16 bits per block, the 8-bit that keeps a real "
                   "model's text. q8_0, q4_0 (alias int4) and q4_1: llama.cpp's block formats and arithmetic "
                   "(activations int8 per block). "
                   "int8-row: one scale per weight row and per token, the fastest 8-bit with AMX but the "
                   "coarsest. bf16: bf16 weights (half of fp32's memory and bytes a step: SmolLM2-135M on a "
                   "Zen 4 decodes in 14-16 ms a step against fp32's 22-23, int8's 5.5) with fp32 activations, "
                   "on any x86 CPU. The integer formats, bf16 and fp32 (our row kernel; fp32 without a C "
                   "compiler: MKL's packed sgemm where a load-time check passes) give exactly --mode ar's "
                   "tokens; the startup log says 'trees verified bit-exact'. Without a C compiler (and MKL, "
                   "for fp32) fp32 and bf16 verify trees with kernels that round differently from one-token "
                   "decoding (~1e-6), so they can differ from --mode ar where two tokens nearly tie.")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default="auto",
              help="The target's KV cache dtype. bf16 halves its memory and the bytes attention reads per step; "
                   "attention reads the cached keys and values back (our kernel widens them to fp32 exactly). "
                   "auto: bf16 for a bf16 target, and for an integer one where the native library builds or the "
                   "CPU has native bf16; else fp32. bf16 K/V keeps an exact target (integer, fp32, bf16) exact "
                   "against --mode ar with the same --kv-dtype; with a target verified to float tolerance it "
                   "amplifies ~1e-6 to ~1e-2.")
@click.option("--draft-device", default="auto",
              help="Draft device: auto (CUDA if present, else CPU), cpu, cuda, cuda:N.")
@click.option("--draft-dtype", type=click.Choice(DRAFT_DTYPES), default="auto",
              help="Draft precision: auto = fp16 on CUDA; on the CPU, where the draft shares the memory bus with the "
                   "target, the fastest of fp32, int8 (W8A8) and q4_0 as measured there (q4_0 only where clearly "
                   "faster). q4_0 (CPU): 4-bit projections, ~0.6x int8's bytes.")
@click.option("--draft-threads", type=click.IntRange(min=1, max=m.MAX_THREADS), default=None,
              help="Intra-op threads of the draft worker. [default: one for a CUDA draft, else one per "
                   "--draft-cores core, else torch's]")
@click.option("--draft-cores", callback=cores_option, default=None,
              help="Pin every draft-worker thread to these cores (a CPU draft should not share the target's).")
@click.option("--tree-tokens", type=TreeTokens(), default="auto",
              help="Tree size T: tokens verified per cycle, root included. auto: chosen each cycle to maximise "
                   "tokens/s from t_verify(T) and t_draft(depth, top_k) (each measured at the first start and "
                   "cached in ~/.cache/dovetail) and the acceptance seen so far; auto:N caps T at N.")
@click.option("--depth", type=click.IntRange(min=1, max=MAX_DEPTH), default=None,
              help="Most draft tokens on one tree path (at most T - 1 are used); with --tree-tokens auto, the "
                   f"deepest tree tried.  [default: {FIXED_DEPTH}, or {AUTO_MAX_DEPTH} with auto]")
@click.option("--tree-top-k", type=click.IntRange(min=1, max=MAX_TOP_K), default=8,
              help="The draft tree's beam width: children kept per node and nodes per level. With "
                   "--tree-tokens auto, the widest beam tried (auto also tries half of it).")
@click.option("--lookup-tokens", type=click.IntRange(min=0, max=MAX_LOOKUP_TOKENS), default=DEFAULT_LOOKUP_TOKENS,
              show_default=True,
              help="Prompt lookup: the longest branch of tokens copied onto each draft tree from what followed "
                   "the last 2-4 tokens' latest earlier occurrence in the prompt or the answer (free to draft; "
                   "verified like the draft's own nodes, so the output never changes), and with --mode lookup "
                   "(or a lookup request) onto each plain step; with --tree-tokens auto only as many of its "
                   "rows as pay at the measured costs. 0: off (--mode lookup needs at least 1).")
@click.option("--top-k", expose_value=False, hidden=True, callback=refuse_ambiguous_top_k,
              help="Refused: say --tree-top-k or --sample-top-k.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, help="New tokens per one-shot prompt.")
@click.option("--max-len", type=click.IntRange(min=2), default=None,
              help="Context length (KV cache) in tokens: prompt plus new tokens. The cache is reserved for it "
                   "and committed as it fills.  [default: the model's context, at most 4096]")
@click.option("--prefill-chunk", type=click.IntRange(min=0, max=1 << 20), default=DEFAULT_PREFILL_CHUNK,
              show_default=True,
              help="Prompt tokens per prefill pass. A longer prompt is run in chunks, one per cycle of the running "
                   "requests (in their pass over the weights), so it delays them by one chunk at a time: smaller "
                   "chunks, shorter stalls, a later first token for the long prompt. Every request and mode takes "
                   "the same chunks (its tokens never depend on what runs beside it). 0: each prompt in one pass.")
@click.option("--join-chunk", type=JoinChunk(), default="auto", show_default=True,
              help="Serving: prompt tokens per pass while other requests run (at most --prefill-chunk). auto: sized "
                   "from the measured costs so each chunk delays the running requests by about one of their "
                   "cycles. Where a prompt's bits do not depend on how it is cut (int8 and GGUF precisions on "
                   "the exact kernels), so its tokens never depend on the load; elsewhere (fp32, bf16) a prompt "
                   "always takes --prefill-chunk pieces.")
@click.option("--mode", type=click.Choice(["dovetail", "ar", "lookup"]), default="dovetail",
              help="dovetail: speculative decoding; ar: plain autoregressive decoding by the target (baseline); "
                   "lookup: speculation without a draft head: each step also verifies the tokens that followed "
                   "the last few tokens' earlier occurrence in the prompt or the answer (--lookup-tokens), which "
                   "pays where text repeats (editing, quoting, code); the same tokens as ar.")
@click.option("--prompt", "prompts", multiple=True, help="One-shot: generate for this prompt and exit (repeatable).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, allow_dash=True, path_type=Path),
              default=None, help="One-shot: prompts from a file (- reads stdin), one per line or JSONL with a "
              "\"prompt\" field.")
@click.option("--chat", is_flag=True, help="One-shot: send each prompt as a user message, rendered with the model's "
              "chat template (a chat model answers it), and print only the answer.")
@click.option("--stop", "stops", multiple=True, callback=stops_option, help="One-shot: stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="One-shot: print one JSON object per prompt on stdout.")
@click.option("--compare-ar", is_flag=True, help="One-shot: also run each prompt in --mode ar and print both speeds "
              "(and whether the tokens are the same).")
@click.option("--startup-timeout", type=FiniteFloatRange(min=1), default=300.0, help="Seconds to wait for workers.")
@click.option("--worker-timeout", type=FiniteFloatRange(min=0.1), default=None,
              help="Seconds a worker may take to answer one step (a prefill is one step) before it counts as hung: "
                   "its request fails with worker_failed and it is killed and restarted.  [default: 4x the longest "
                   "step the measured costs predict (a prompt that fills the context), at least 30 s; 300 s where "
                   "nothing is measured (--mode ar, a fixed --tree-tokens) and while measuring]")
@click.option("--max-restarts", type=click.IntRange(min=0), default=3,
              help="Worker restarts allowed in ten minutes; one more and the server answers every request and exits.")
@click.option("--max-batch", type=click.IntRange(min=1, max=64), default=DEFAULT_MAX_BATCH, show_default=True,
              help="Serving: requests that run at once. Each cycle their trees (or decode steps) are verified in one "
                   "pass of the target, each request getting exactly the tokens it would get alone; the others wait "
                   "in the queue. 1: one request at a time.")
@click.option("--kv-memory", type=FiniteFloatRange(min=0.001, max=1e6), default=None,
              help="Serving: GB of KV cache the running requests may reserve together. A request reserves what its "
                   "prompt plus max_new_tokens can grow to; one that does not fit waits at the head of the queue "
                   "until enough running requests end, and one that could not fit alone is refused "
                   "(kv_budget_exceeded).  [default: 80% of the memory free once the models are loaded]")
@click.option("--max-queue", type=click.IntRange(min=1), default=64,
              help="Serving: requests that may wait in all; beyond it a request is refused at once with 'busy'.")
@click.option("--max-queue-per-client", type=click.IntRange(min=1), default=16,
              help="Serving: requests one client (connection) may have waiting; beyond it 'busy'. Users (a "
                   "request's 'user', else its connection) take turns: one request each, round-robin.")
@click.option("--request-timeout", type=FiniteFloatRange(min=0.001), default=None,
              help="Serving: every request must be answered within this many seconds of its arrival (queueing "
                   "included), else it ends with 'deadline_exceeded'; a request's own deadline_ms can be shorter. "
                   "[default: no limit]")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", help="Log level (logs go to stderr).")
@sampling_options
def run_main(**values: Any) -> None:
    """Serve a target model on the CPU with a draft head on the GPU (lossless speculative decoding).

    With --prompt/--prompt-file it generates, prints and exits; otherwise it serves clients
    (dovetail-client, or dovetail_runtime.client.DovetailClient) until SIGINT/SIGTERM.
    """
    from .preflight import PreflightError, check_chat_template, check_settings, check_target, placement_warnings

    options = run_options(values)
    logging.basicConfig(level=getattr(logging, options.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s coordinator[%(process)d] %(levelname)s %(name)s: %(message)s")
    serving, one_shot = options.serving, options.one_shot
    try:
        if options.models.target is not None:
            check_target(options.models.target)  # a missing target is named before the draft it would need
    except PreflightError as error:
        log.error("%s", error)
        sys.exit(2)
    target, draft = resolve_models(options.models.target, options.models.draft, options.models.mode)
    if options.models.mode == "lookup" and options.tree.lookup_tokens == 0:
        raise click.UsageError("--mode lookup copies up to --lookup-tokens tokens a step: give at least 1 (0 is "
                               "--mode ar)")
    log.info("target %s, draft %s", target, draft or f"none (--mode {options.models.mode})")
    all_prompts = list(one_shot.prompts) + (read_prompt_file(one_shot.prompt_file) if one_shot.prompt_file else [])
    check_prompts_text(all_prompts)
    if serving.http_address is not None and all_prompts:
        raise click.UsageError("--http serves clients; it cannot be combined with --prompt/--prompt-file")
    warn_ignored_options(one_shot_run=bool(all_prompts), mode=options.models.mode)
    key = None
    if not all_prompts:  # a one-shot run serves nobody: its key (a flag, DOVETAIL_API_KEY) is never read
        try:
            key = resolve_api_key(serving.api_key_file, serving.api_key)
        except ApiKeyError as error:
            log.error("%s", error)
            sys.exit(2)
    http_only = options_given(("served_model_name", "cors_origins"))
    if serving.http_address is None and http_only and not all_prompts:
        log.warning("%s: only with --http: ignored", ", ".join(http_only))
    sampling = make_sampling(**dataclasses.asdict(options.sampling))
    if one_shot.compare_ar and options.models.mode != "ar" and sampling.temperature > 0 and sampling.seed is None:
        # Each run would draw its own seed and so its own tokens: "same tokens: no" would read as a loss.
        sampling = msgspec.structs.replace(sampling, seed=secrets.randbits(63))
        log.info("--compare-ar with sampling: both modes draw with --seed %d", sampling.seed)
    settings = runtime_settings(options, target, draft)
    try:
        check_settings(settings)  # before anything loads
        if one_shot.chat and all_prompts:
            check_chat_template(target)
    except PreflightError as error:
        stood_in = options.models.target is None and options.models.draft is not None
        log.error("%s%s", error, f" (no --target was given, so the demo target {target} stood in for the model "
                  "your --draft was trained for: name that with --target)" if stood_in else "")
        sys.exit(2)
    for warning in placement_warnings(settings):
        log.warning("%s", warning)
    if not all_prompts:
        sys.exit(serve_clients(settings, list(serving.binds), key, serve_limits(serving), serving.http_address,
                               options.log_level, serving.cors_origins, serving.served_model_name))
    sys.exit(run_one_shot(settings, all_prompts, one_shot, sampling))


# Options only one-shot runs read, and options only serving reads (click's parameter names).
ONE_SHOT_ONLY = ("as_json", "compare_ar", "chat", "stops", "max_new_tokens", "temperature", "sample_top_k", "top_p",
                 "seed")
SERVING_ONLY = ("binds", "api_key_file", "api_key", "max_queue", "max_queue_per_client", "request_timeout",
                "max_batch", "kv_memory", "served_model_name", "cors_origins", "join_chunk")
DRAFT_ONLY = ("draft", "draft_device", "draft_dtype", "draft_threads", "draft_cores", "tree_tokens", "depth",
              "tree_top_k", "lookup_tokens")


def options_given(names: tuple[str, ...]) -> list[str]:
    """The flags among ``names`` typed on the command line, as the user wrote them (--json)."""
    context = click.get_current_context()
    return [param.opts[0] for param in context.command.params
            if param.name in names and context.get_parameter_source(param.name) == ParameterSource.COMMANDLINE]


def warn_ignored_options(one_shot_run: bool, mode: str) -> None:
    """Say which options this run will not use, instead of dropping them without a word."""
    ignored = options_given(SERVING_ONLY if one_shot_run else ONE_SHOT_ONLY)
    if ignored:
        applies = "applies" if len(ignored) == 1 else "apply"
        why = (f"only {applies} to serving: ignored with --prompt/--prompt-file" if one_shot_run else
               f"only {applies} to one-shot runs (--prompt/--prompt-file): ignored while serving (clients send "
               "their own)")
        log.warning("%s %s", ", ".join(ignored), why)
    greedy = greedy_sampling_warning(click.get_current_context().params["temperature"]) if one_shot_run else None
    if greedy:
        log.warning("%s", greedy)
    if mode == "dovetail":
        return
    if mode == "ar" and one_shot_run and options_given(("compare_ar",)):
        log.warning("--compare-ar compares --mode dovetail with ar: with --mode ar there is nothing to compare "
                    "(ignored; leave out --mode ar to compare)")
    # --lookup-tokens serves lookup decoding: a lookup run's, and a server's lookup requests (any --mode).
    uses_lookup = mode == "lookup" or not one_shot_run
    draft_only = tuple(name for name in DRAFT_ONLY if name != "lookup_tokens") if uses_lookup else DRAFT_ONLY
    unused = options_given(draft_only)
    if unused:
        log.warning("%s: no draft runs with --mode %s (the target decodes alone): ignored", ", ".join(unused), mode)


def greedy_sampling_warning(temperature: float) -> str | None:
    """--seed/--sample-top-k/--top-p shape sampling; at --temperature 0 (greedy) they do nothing."""
    unused = options_given(("sample_top_k", "top_p", "seed")) if temperature == 0 else []
    if not unused:
        return None
    return (f"{', '.join(unused)}: no sampling at --temperature 0 (greedy decoding): ignored; give a --temperature "
            "above 0 to sample")


def runtime_settings(options: RunOptions, target: str, draft: str | None) -> RuntimeSettings:
    """What the coordinator runs, from the options and the resolved model folders (one-shot runs
    take their prompts one at a time)."""
    from .coordinator import RuntimeSettings

    models, placement, tree, workers = options.models, options.placement, options.tree, options.workers
    one_shot = bool(options.one_shot.prompts or options.one_shot.prompt_file)
    return RuntimeSettings(target=target, draft=draft if models.mode == "dovetail" else None,
                           target_dtype=models.target_dtype, kv_dtype=models.kv_dtype,
                           cpu_threads=placement.cpu_threads, cpu_cores=placement.cpu_cores,
                           draft_device=models.draft_device, draft_dtype=models.draft_dtype,
                           draft_threads=placement.draft_threads, draft_cores=placement.draft_cores,
                           tree=make_tree(tree.tree_tokens, tree.depth, tree.tree_top_k),
                           lookup_tokens=tree.lookup_tokens, mode=models.mode,
                           max_len=models.max_len, prefill_chunk=models.prefill_chunk or None,
                           log_level=options.log_level,
                           startup_timeout_s=workers.startup_timeout, max_restarts=workers.max_restarts,
                           worker_timeout_s="auto" if workers.worker_timeout is None else workers.worker_timeout,
                           max_batch=1 if one_shot else options.serving.max_batch,
                           join_chunk=options.serving.join_chunk,
                           kv_memory_bytes=(None if options.serving.kv_memory is None
                                            else int(options.serving.kv_memory * 1e9)))


def serve_limits(serving: ServingOptions) -> ServeLimits:
    from .serving import ServeLimits

    return ServeLimits(max_queue=serving.max_queue, max_queue_per_client=serving.max_queue_per_client,
                       request_timeout_s=serving.request_timeout)


def run_one_shot(settings: RuntimeSettings, prompts: list[str], one_shot: OneShotOptions,
                 sampling: m.Sampling) -> int:
    """Start the workers, generate for each prompt, print, stop: the exit status (1 when a
    prompt failed, 2 when the server could not run)."""
    from cpu_worker.model.model_dir import ModelLoadError

    from .coordinator import Coordinator, TooManyRestarts
    from .workers import WorkerFailed, WorkerRequestError

    received = [signal.SIGINT]  # Ctrl-C raises KeyboardInterrupt by itself

    def on_signal(signum, _frame):
        received[0] = signum
        log.info("signal %d: stopping", signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    coordinator = Coordinator(settings)
    try:
        coordinator.start()
        params = dict(max_new_tokens=one_shot.max_new_tokens, stop=list(one_shot.stops), mode=settings.mode,
                      sampling=sampling)
        failures = run_prompts(coordinator, prompts, params, one_shot.as_json,
                               compare_ar=one_shot.compare_ar and settings.mode != "ar", chat=one_shot.chat)
        return 1 if failures else 0
    except KeyboardInterrupt:
        # Not a success: what was printed may stop mid-answer (`dovetail-run ... > out && use out`).
        if OpenCompletion.text:
            end_completion(one_shot.as_json)
        log.warning("interrupted by %s: the output is incomplete", signal.Signals(received[0]).name)
        return 128 + received[0]  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM
    except BrokenPipeError:  # was 'ERROR [Errno 32] Broken pipe' and exit 2, "could not start"
        return stdout_reader_left()
    except (ModelLoadError, WorkerFailed, WorkerRequestError, TooManyRestarts, ValueError, OSError) as error:
        log.error("%s", error)
        return 2
    finally:
        coordinator.close()
        signal.signal(signal.SIGTERM, previous)


def served_model(target: str, coordinator, mode: str, name: str | None = None):
    """How the HTTP API names and describes the model: ``name``, else the target folder's name."""
    import time

    from .http_server import ServedModel, body_limit

    return ServedModel(name=name or Path(target.rstrip("/")).name or target, context=coordinator.max_len,
                       default_mode=mode, created=int(time.time()),
                       max_body_bytes=body_limit(coordinator.max_prompt_chars()), tokenizer=coordinator.tokenizer,
                       chat_template=coordinator.chat_template)


def serve_clients(settings: RuntimeSettings, binds: list[str], key: ApiKey | None, limits: ServeLimits,
                  http_address: str | None = None, log_level: str = "info", cors_origins: tuple[str, ...] = (),
                  model_name: str | None = None) -> int:
    """Bind the client socket (and the HTTP port) first, so a taken port or path, or an address
    beyond loopback without an API key, fails in a second, not after the models load; then
    start the workers and serve until SIGINT/SIGTERM. The exit status."""
    import zmq

    from cpu_worker.model.model_dir import ModelLoadError

    from .coordinator import Coordinator, TooManyRestarts
    from .serving import Serving
    from .workers import WorkerFailed

    stop = StopSignals()
    bound = bind_clients(binds, key, http_address, cors_origins)
    if bound is None:
        return 2
    server, frontend = bound
    coordinator = Coordinator(settings)
    serving = Serving(coordinator, server, limits, should_stop=lambda: stop.asked)

    def ready(endpoints: list[str]) -> None:
        shown = [endpoint for endpoint in endpoints if not endpoint.startswith("inproc://")]
        if frontend is not None:
            frontend.start(served_model(settings.target, coordinator, coordinator.default_mode, model_name),
                           log_level)
            shown.append(frontend.url)
        print(f"dovetail serving on {' '.join(shown)}", file=sys.stderr, flush=True)

    code = 0
    try:
        if frontend is not None:  # 503 "loading" until the models are up, not a port that hangs
            frontend.serve_loading(log_level)
        serving.run(ready=ready)
    except KeyboardInterrupt:
        pass
    except (ModelLoadError, WorkerFailed, TooManyRestarts, ValueError, OSError) as error:
        log.error("%s", error)
        code = 2
    except Exception:
        log.exception("serving stopped on an internal error")
        code = 2
    finally:
        if frontend is not None:  # after serving answered everyone: HTTP clients get those answers
            frontend.close()
        server.close(linger_ms=2000)  # the last answers may still leave...
        coordinator.close()
        zmq.Context.instance().destroy(linger=0)  # ...and are waited for here (up to the linger)
    return code


class StopSignals:
    """SIGINT and SIGTERM ask serving to stop (it answers everyone first); a second one stops
    waiting for anything."""

    def __init__(self) -> None:
        self.asked = False
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if self.asked:
            raise KeyboardInterrupt
        log.info("signal %d: shutting down", signum)
        self.asked = True


def bind_clients(binds: list[str], key: ApiKey | None, http_address: str | None,
                 cors_origins: tuple[str, ...] = ()) -> tuple[RouterServer, HttpFrontend | None] | None:
    """The client socket on ``binds`` (default: dovetail-run's ipc endpoint, unless only HTTP
    is served) and the HTTP listener, refusing an address beyond loopback without an API key.
    None, the error logged, when one cannot be bound."""
    from ipc.channels import RouterServer
    from ipc.curve import CurveError

    frontend = None
    try:
        endpoints = binds or ([] if http_address is not None else [default_bind()])
        if http_address is not None:
            from .http_server import HttpFrontend, parse_address

            check_exposure(endpoints, parse_address(http_address)[0], key)
            frontend = HttpFrontend(http_address, api_key=key, cors_origins=cors_origins)
        else:
            check_exposure(endpoints, None, key)
        # HTTP requests reach the coordinator as ZMQ clients of an inproc endpoint.
        server = RouterServer(endpoints + ([frontend.zmq_endpoint] if frontend is not None else []),
                              curve=key.curve_keys() if key is not None else None)
    except (EndpointError, ValueError, OSError, CurveError) as error:
        if frontend is not None:
            frontend.close()
        log.error("%s", error)
        return None
    return server, frontend


def stats_line(mode: str, stats: m.RequestStats) -> str:
    plain = stats.trees.get("1/0/0", 0)
    # Plain steps: where no tree paid (the planner's fallback alone, a busy batch); lookup has no others.
    steps = f" ({plain} of {sum(stats.trees.values())} steps plain)" if plain and mode == "dovetail" else ""
    lookup = f", {stats.lookup_tokens} by lookup" if stats.lookup_tokens else ""
    return (f"[{mode}: {stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, tau {stats.tau:.2f}{steps}"
            f"{lookup}, draft {stats.draft_ms:.0f} ms, verify {stats.verify_ms:.0f} ms, ipc {stats.ipc_ms:.0f} ms]")


def escape_unencodable_stdout() -> None:
    """Text stdout's encoding cannot hold (PYTHONIOENCODING=ascii, a Latin-1 locale, an answer with an
    emoji) is written as a backslash escape, as Python does on stderr: it raised UnicodeEncodeError
    mid-answer, which ended the run (exit 2) with the remaining prompts unanswered."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")


def run_prompts(coordinator, prompts: list[str], params: dict, as_json: bool, compare_ar: bool = False,
                chat: bool = False) -> int:
    """One-shot generation; with ``compare_ar`` each prompt runs again in --mode ar (same
    workers, same seed) and the two speeds are printed side by side; with ``chat`` each prompt
    is a user message (the chat template renders it). stdout gets each completion alone, ended
    by a newline (so it pipes), or with ``as_json`` one JSON object per prompt; the stats lines
    go to stderr with the logs."""
    escape_unencodable_stdout()
    failures = 0
    for prompt in prompts:
        if chat:
            request = m.GenerateRequest(request_id=uuid.uuid4().hex,
                                        messages=[m.ChatMessage(role="user", content=prompt)], **params)
        else:
            request = m.GenerateRequest(request_id=uuid.uuid4().hex, prompt=prompt, **params)
        def show(_ids, text, _logprobs):
            if not as_json and text:
                sys.stdout.write(text)
                sys.stdout.flush()
                OpenCompletion.text = True
            return False

        reply = coordinator.generate(request, show)
        baseline = None
        if compare_ar and not isinstance(reply, m.ErrorReply):
            baseline = coordinator.generate(msgspec.structs.replace(request, request_id=uuid.uuid4().hex, mode="ar"))
            reply = baseline if isinstance(baseline, m.ErrorReply) else reply
        if isinstance(reply, m.ErrorReply):
            failures += 1
            end_completion(as_json)  # a failure can follow streamed text
            log.error("prompt failed (%s): %s", reply.code, reply.message)
            if as_json:
                print(json.dumps({"prompt": prompt, "error": {"code": reply.code, "message": reply.message}}))
            continue
        record: dict = {"prompt": prompt, "text": reply.text, "token_ids": reply.token_ids,
                        "finish_reason": reply.finish_reason, "stats": msgspec.to_builtins(reply.stats)}
        if baseline is not None:
            record["ar"] = {"stats": msgspec.to_builtins(baseline.stats),
                            "same_tokens": baseline.token_ids == reply.token_ids}
        if as_json:
            print(json.dumps(record), flush=True)
            continue
        end_completion(as_json)
        print_stats(request.mode or "dovetail", reply.stats, baseline.stats if baseline is not None else None,
                    same_tokens=bool(record.get("ar", {}).get("same_tokens")))
    return failures


class OpenCompletion:
    """Whether stdout holds a completion's text without its ending newline (what a Ctrl-C may leave)."""

    text = False


def end_completion(as_json: bool) -> None:
    """The newline that ends a streamed completion on stdout (none in --json output)."""
    if not as_json:
        sys.stdout.write("\n")
        sys.stdout.flush()
    OpenCompletion.text = False


def print_stats(mode: str, stats: m.RequestStats, ar_stats: m.RequestStats | None, same_tokens: bool) -> None:
    """The stats lines, on stderr so that stdout is the completion alone; with --compare-ar
    the ar run's line and the speedup too."""
    lines = [stats_line(mode, stats)]
    if ar_stats is not None:
        speedup = stats.tokens_per_s / max(ar_stats.tokens_per_s, 1e-9)
        lines += [stats_line("ar", ar_stats),
                  f"[{mode} / ar: {speedup:.2f}x; same tokens: {'yes' if same_tokens else 'no'}]"]
    print("\n".join(lines), file=sys.stderr, flush=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(version(), "--version", prog_name="dovetail-client", message="%(prog)s %(version)s")
@click.option("--connect", "endpoint", default=None, callback=connect_option,
              help="Server endpoint: ipc://PATH or tcp://HOST:PORT (HOST:PORT and paths are understood). "
              "[default: dovetail-run's default ipc endpoint]")
@click.option("--prompt", default=None, callback=utf8_option, help="Prompt text (with --chat: the user's message).")
@click.option("--chat", is_flag=True, help="Send --prompt as a user message: the server applies the model's chat "
              "template.")
@click.option("--system", default=None, callback=utf8_option, help="With --chat: a system message before the user's.")
@click.option("--messages", "messages_file", type=click.Path(exists=True, dir_okay=False, allow_dash=True,
                                                             path_type=Path),
              default=None, help="A chat from a JSON file (- reads stdin): a list of {\"role\": ..., \"content\": "
              "...} (instead of --prompt).")
@click.option("--max-new-tokens", type=click.IntRange(min=1, max=m.MAX_NEW_TOKENS), default=128)
@click.option("--stop", "stops", multiple=True, callback=client_stops_option, help="Stop string (repeatable).")
@click.option("--mode", type=click.Choice(["dovetail", "ar", "lookup"]), default=None,
              help="dovetail: speculative decoding; ar: plain decoding; lookup: plain decoding that also verifies "
              "tokens copied from earlier in the text (no draft head). The same tokens in each.  [default: the "
              "server's own: dovetail where it has a draft head, else its --mode]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, token_ids and stats.")
@click.option("--timeout", type=FiniteFloatRange(min=0.1), default=600.0, help="Seconds to wait for the server.")
@click.option("--deadline", type=FiniteFloatRange(min=0.001, max=m.MAX_DEADLINE_MS / 1000), default=None,
              help="Seconds the server has to answer, queueing included (else deadline_exceeded). [default: none]")
@api_key_options
@sampling_options
def client_main(**values: Any) -> None:
    """Send a prompt (or a chat) to a running dovetail-run server and stream the completion to stdout.

    Without --prompt or --messages the prompt is read from stdin, or, with --chat in a terminal, a
    conversation starts: each line you type is a turn (/reset starts over, /exit or Ctrl-D ends it).

    A server's tcp:// endpoints need its API key when it was started with one (ipc:// never does)."""
    from .client import DovetailClient, GenerationError, HandshakeError

    options = client_options(values)
    connect, request = options.connect, options.request
    greedy = greedy_sampling_warning(options.sampling.temperature)
    if greedy:
        click.echo(f"warning: {greedy}", err=True)
    conversation = request.prompt is None and request.messages_file is None and sys.stdin.isatty()
    if conversation and (not request.chat or options.as_json):
        raise click.UsageError("give --prompt or --messages (or pipe the prompt in; --chat alone in a terminal "
                               "starts a conversation)")
    if request.prompt is None and request.messages_file is None and not conversation:
        request = dataclasses.replace(request, prompt=read_stdin_prompt())
    messages = None if conversation else chat_messages(request.prompt, request.chat, request.system,
                                                       request.messages_file)
    try:
        key = resolve_api_key(connect.api_key_file, connect.api_key)
    except ApiKeyError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(2)
    endpoint = connect.endpoint or default_bind()
    path = ipc_path(endpoint)
    if path is not None and not os.path.exists(path):
        click.echo(f"error: no server at {endpoint} (no such socket file; is dovetail-run running?)", err=True)
        sys.exit(1)
    try:
        client = DovetailClient(endpoint, timeout_s=connect.timeout, api_key=key,
                                connect_timeout_s=min(connect.timeout, 10.0))
    except HandshakeError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:  # while waiting up to 10 s for the handshake: 130, as mid-stream (click: 1)
        sys.exit(130)
    with client:
        try:
            sampling = make_sampling(**dataclasses.asdict(options.sampling))
            if conversation:
                from .conversation import converse

                sys.exit(converse(client, request_params(request, sampling), request.system, sys.stdout,
                                  sys.stderr))
            stream_or_print(client, request, messages, sampling, options.as_json)
        except (GenerationError, TimeoutError) as error:
            if OpenCompletion.text:  # the error may follow streamed text: not on its line
                end_completion(as_json=False)
            click.echo(f"error: {error}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:  # closing the connection cancels the request on the server
            if OpenCompletion.text:
                end_completion(as_json=False)
            sys.exit(130)
        except BrokenPipeError:  # was a traceback and exit 1
            sys.exit(stdout_reader_left())


def stdout_reader_left() -> int:
    """stdout's reader left (`dovetail-run ... | head`): nothing more reaches it, so stop quietly with the
    status a process SIGPIPE ends would have (141)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def stream_or_print(client: DovetailClient, request: ClientRequestOptions, messages: list[m.ChatMessage] | None,
                    sampling: m.Sampling, as_json: bool) -> None:
    """Generate: the text streamed to stdout as it comes, or one JSON object at the end."""
    prompt = request.prompt
    params = request_params(request, sampling)
    if messages is not None:
        params["messages"], prompt = messages, None
    if as_json:
        done = client.generate(prompt, **params)
        print(json.dumps({"prompt": prompt, "messages": None if messages is None else
                          [msgspec.to_builtins(turn) for turn in messages], "text": done.text,
                          "token_ids": done.token_ids,
                          "finish_reason": done.finish_reason, "stats": msgspec.to_builtins(done.stats)}))
        return
    for event in client.events(prompt, **params):
        if isinstance(event, m.TokenChunk) and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
            OpenCompletion.text = True
    end_completion(as_json=False)


def request_params(request: ClientRequestOptions, sampling: m.Sampling) -> dict[str, Any]:
    """The GenerateRequest fields dovetail-client's options set (all but the prompt or messages)."""
    return dict(max_new_tokens=request.max_new_tokens, stop=list(request.stops), mode=request.mode,
                sampling=sampling,
                deadline_ms=None if request.deadline is None else max(1, round(request.deadline * 1000)))


def read_stdin_prompt() -> str:
    """The prompt piped in (``echo ... | dovetail-client``): UTF-8 (a byte-order mark dropped), one
    trailing newline dropped as the shell adds it."""
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise click.UsageError(f"stdin is not UTF-8 text (byte {data[error.start]:#04x} at offset {error.start})") \
            from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise click.UsageError("no prompt: give --prompt or --messages, or pipe the prompt in")
    return text


def chat_messages(prompt: str | None, chat: bool, system: str | None,
                  messages_file: Path | None) -> list[m.ChatMessage] | None:
    """dovetail-client's chat options as messages, or None for a plain prompt."""
    if (prompt is None) == (messages_file is None):
        raise click.UsageError("give either --prompt or --messages")
    if system is not None and not chat:
        raise click.UsageError("--system needs --chat")
    if system is not None and messages_file is not None:  # it was dropped without a word
        raise click.UsageError("--system goes with --chat --prompt: with --messages, put the system message "
                               "first in the file")
    if messages_file is None:
        if not chat:
            return None
        turns = [m.ChatMessage(role="system", content=system)] if system is not None else []
        return [*turns, m.ChatMessage(role="user", content=prompt or "")]
    try:
        # A byte-order mark, as some editors save UTF-8, is not JSON: skipped, as --prompt-file skips it.
        messages = msgspec.json.decode(read_text_file(messages_file, "--messages"), type=list[m.ChatMessage])
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise click.BadParameter(f"{shown_path(messages_file)}: {error}", param_hint="--messages") from None
    if not messages:
        raise click.BadParameter(f"{shown_path(messages_file)}: the chat has no messages", param_hint="--messages")
    if len(messages) > m.MAX_CHAT_MESSAGES:
        raise click.BadParameter(f"{shown_path(messages_file)}: {len(messages)} messages; a request takes at most "
                                 f"{m.MAX_CHAT_MESSAGES}", param_hint="--messages")
    return messages
