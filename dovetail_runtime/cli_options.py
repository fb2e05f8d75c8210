"""The options of ``dovetail-run`` and ``dovetail-client``, grouped into typed settings.

click hands a command each of its options as a keyword; ``run_options``/``client_options``
sort them into frozen groups by what they are about (the models, CPU placement, the tree,
serving, one-shot prompts, sampling), each option into exactly one group. Nothing is checked
here beyond that: click checked each option, and the commands check what depends on several
of them, in the order they always have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

G = TypeVar("G")


@dataclass(frozen=True)
class ModelOptions:
    """What runs: the target and draft folders (None: the bundled demo pair), their
    precisions, the draft's device, the context, the decoding mode and the prefill's chunks."""

    target: str | None
    draft: str | None
    target_dtype: str
    kv_dtype: str
    draft_device: str
    draft_dtype: str
    max_len: int | None
    mode: str
    prefill_chunk: int  # prompt tokens per prefill call; 0: a whole prompt in one


@dataclass(frozen=True)
class CpuPlacement:
    """Each worker's intra-op threads and the cores they are pinned to (None: not set)."""

    cpu_threads: int | None
    cpu_cores: list[int] | None
    draft_threads: int | None
    draft_cores: list[int] | None


@dataclass(frozen=True)
class TreeOptions:
    """The draft tree: a size T (or ("auto", the largest T)), its depth and beam width."""

    tree_tokens: int | tuple[str, int]
    depth: int | None
    tree_top_k: int
    lookup_tokens: int


@dataclass(frozen=True)
class WorkerOptions:
    """How long workers may take to start and to answer, and how often they may restart."""

    startup_timeout: float
    worker_timeout: float | None  # None: fitted to the measured step costs (the coordinator's "auto")
    max_restarts: int


@dataclass(frozen=True)
class ServingOptions:
    """Where clients reach the server (ZMQ endpoints, HTTP), its API key, and its queue limits."""

    binds: tuple[str, ...]
    http_address: str | None
    cors_origins: tuple[str, ...]  # --cors-origin: browser pages allowed to call the HTTP API
    served_model_name: str | None  # the model's name in the HTTP API; None: the target's folder or file name
    api_key_file: Path | None
    api_key: str | None
    max_queue: int
    max_queue_per_client: int
    max_batch: int  # requests run at once, their steps verified together
    join_chunk: int | Literal["auto"]  # prompt tokens per pass while others run, or "auto"
    kv_memory: float | None  # GB the running requests' KV caches may reserve; None: a share of free memory
    request_timeout: float | None


@dataclass(frozen=True)
class OneShotOptions:
    """--prompt/--prompt-file: generate, print and exit."""

    prompts: tuple[str, ...]
    prompt_file: Path | None
    stops: tuple[str, ...]
    as_json: bool
    compare_ar: bool
    max_new_tokens: int
    chat: bool


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float
    sample_top_k: int
    top_p: float
    seed: int | None


@dataclass(frozen=True)
class RunOptions:
    """Every option of dovetail-run."""

    models: ModelOptions
    placement: CpuPlacement
    tree: TreeOptions
    workers: WorkerOptions
    serving: ServingOptions
    one_shot: OneShotOptions
    sampling: SamplingOptions
    log_level: str


@dataclass(frozen=True)
class ConnectOptions:
    """Which server dovetail-client talks to, with which key, and how long it waits."""

    endpoint: str | None
    api_key_file: Path | None
    api_key: str | None
    timeout: float


@dataclass(frozen=True)
class ClientRequestOptions:
    """What dovetail-client asks for: a prompt or a chat, and how to end it."""

    prompt: str | None
    chat: bool
    system: str | None
    messages_file: Path | None
    max_new_tokens: int
    stops: tuple[str, ...]
    mode: str | None
    deadline: float | None


@dataclass(frozen=True)
class ClientOptions:
    """Every option of dovetail-client."""

    connect: ConnectOptions
    request: ClientRequestOptions
    sampling: SamplingOptions
    as_json: bool


def pick(group: type[G], values: Mapping[str, Any]) -> G:
    """The ``group`` of options named by its fields."""
    assert dataclasses.is_dataclass(group)
    return group(**{field.name: values[field.name] for field in dataclasses.fields(group)})


def check_grouped(values: Mapping[str, Any], groups: tuple[type, ...], *alone: str) -> None:
    """Every option in exactly one group (or ``alone``): an option added to a command but to no
    group, or to two, fails here, at its first run."""
    names = [field.name for group in groups for field in dataclasses.fields(group)] + list(alone)
    if sorted(names) != sorted(values):
        extra, missing = sorted(set(values) - set(names)), sorted(set(names) - set(values))
        duplicated = sorted({name for name in names if names.count(name) > 1})
        raise TypeError(f"options in no group: {extra}; groups without their option: {missing}; "
                        f"in two groups: {duplicated}")


def run_options(values: Mapping[str, Any]) -> RunOptions:
    """dovetail-run's options (click's keywords) as typed groups."""
    groups = (ModelOptions, CpuPlacement, TreeOptions, WorkerOptions, ServingOptions, OneShotOptions,
              SamplingOptions)
    check_grouped(values, groups, "log_level")
    return RunOptions(models=pick(ModelOptions, values), placement=pick(CpuPlacement, values),
                      tree=pick(TreeOptions, values), workers=pick(WorkerOptions, values),
                      serving=pick(ServingOptions, values), one_shot=pick(OneShotOptions, values),
                      sampling=pick(SamplingOptions, values), log_level=values["log_level"])


def client_options(values: Mapping[str, Any]) -> ClientOptions:
    """dovetail-client's options (click's keywords) as typed groups."""
    groups = (ConnectOptions, ClientRequestOptions, SamplingOptions)
    check_grouped(values, groups, "as_json")
    return ClientOptions(connect=pick(ConnectOptions, values), request=pick(ClientRequestOptions, values),
                         sampling=pick(SamplingOptions, values), as_json=values["as_json"])
