"""The tree planner offline: ``--tree-tokens auto`` replayed on a real pair's own trees beside fixed
trees, with a model of what cycles cost on a shared host.

Why: on a shared host a run's speed moves by 20-40%, so a planner change worth a few percent takes
many rounds of the 7B benchmark to see (docs/performance.md, the eleventh session: six rounds of ten
minutes). Here every planner meets the same acceptance and the same (seeded) noise, in seconds:

- ``dump`` records, at every position of the target's greedy answers to the held-out chat prompts,
  the head's largest tree for each beam width the planner tries (the auto envelope: 64 nodes, depth
  10), teacher-forced: the head fed the answer's own tokens and the target's features of one prefill
  of prompt + answer. The tree of any smaller shape is the root and the first nodes no deeper than
  its depth (``gpu_worker.tree``: nodes come in selection order), so one record answers every shape.
  (The runtime's features come from its verify passes: where rounding flips a close pick, its tree
  can differ from the recorded one.)
- ``run`` walks each answer cycle by cycle as the runtime does, prompt lookup's branch grafted as
  ``--lookup-tokens`` says (with the planner, as much of it as ``BranchPolicy`` finds pays, on trees
  and plain steps alike; ``auto-whole``: the planner with whole branches on its trees, as before
  that policy; a fixed tree, whole branches): the planner (``TreePlanner``, built as the coordinator
  builds it) or a fixed shape picks the tree; the accepted path is where the answer's tokens lead through it; the
  cycle costs the draft's time at its depth plus the verify time of all its rows plus the rest of a
  cycle, times the host's level (regimes that switch now and then, and per-cycle jitter). The planner
  is told the times as the workers would report them, and starts from startup curves with some
  sizes timed during a busy spell. Not modelled: the draft's reading of the prompt (a first cycle
  costs as any), and plain steps' edges (the runtime's one root-only step before a tree that follows
  plain steps, a first plain plan still drafted): they matter only where the plain fallback runs,
  never at the default costs.

    python -m tools.sim_planner dump --out /tmp/trees.json     # the real pair (scripts/fetch_fixture.sh)
    python -m tools.sim_planner run --trees /tmp/trees.json --shapes auto,3/2/4,4/3/4 --seeds 8

Default costs: the llama2-7b chat stand-in at q4_0 on two Zen 4 cores (its cached startup verify
curve; the draft's ms per depth as ``tools.bench_real`` saw them), where trees pay and the choice
matters. The answers are the real pair's, so tau is the stand-in's (inflation is exact).
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from dovetail_runtime.demo_models import SMOLLM2_DIR, SMOLLM2_DRAFT
from dovetail_runtime.lookup import PromptLookup, copied, graft, shared_prefix
from dovetail_runtime.lookup_policy import BranchPolicy
from dovetail_runtime.tree_planner import AutoTree, TreePlanner, extrapolate
from ipc.tree import TreeShape, children_by_token, tree_depths
from tools.options import load_errors_in_one_line
from tools.tables import markdown_header, markdown_row

# The llama2-7b chat stand-in's startup curve at q4_0, 2 threads (the cost cache, 2026-12-06), ms.
STANDIN_VERIFY_MS = {1: 111.3, 2: 118.6, 3: 125.4, 4: 142.0, 5: 153.7, 6: 175.7, 7: 174.7, 8: 200.6, 9: 215.4,
                     10: 241.7, 11: 234.6, 12: 214.4, 16: 387.8, 24: 578.8, 32: 779.3, 48: 1151.1, 64: 1448.7}
# Its head's draft per cycle: 13.5 ms at depth 1, 19 at depth 2 (bench_real, twelfth session).
STANDIN_DRAFT_MS = (13.0, 6.5)  # the first level, each further one
STANDIN_REST_MS = 2.0  # a cycle's round trips and the coordinator's work
ENVELOPE = AutoTree()  # what dovetail-run's --tree-tokens auto plans within by default
AUTO_WHOLE = "auto-whole"  # the planner, whole lookup branches grafted onto its trees
PLAIN = "plain"  # no draft: plain steps with lookup's branches as they pay (--mode lookup)
Policy = TreeShape | str | None  # a fixed tree, AUTO_WHOLE, PLAIN, or None: the planner as the runtime runs it


# --- the recorded trees ----------------------------------------------------------------------


def subtree(tokens: Sequence[int], parents: Sequence[int], size: int, depth: int) -> tuple[list[int], list[int]]:
    """The tree of ``size`` nodes (root included) and ``depth`` inside a larger one recorded in selection
    order: its root and first ``size - 1`` nodes no deeper than ``depth``."""
    depths = tree_depths(parents)
    kept = [0] + [node for node in range(1, len(tokens)) if depths[node] <= depth][:size - 1]
    index = {node: position for position, node in enumerate(kept)}
    return [int(tokens[node]) for node in kept], [-1 if node == 0 else index[parents[node]] for node in kept]


def followed(tokens: Sequence[int], parents: Sequence[int], truth: Sequence[int]) -> list[int]:
    """The tokens of ``truth`` a greedy target accepts from this tree: the path its tokens lead along."""
    children = children_by_token(tokens, parents)
    node, accepted = 0, []
    for token in truth:
        child = children.get(node, {}).get(int(token))
        if child is None:
            break
        accepted.append(int(token))
        node = child
    return accepted


# --- costs and the host ----------------------------------------------------------------------


@dataclass(frozen=True)
class CycleCosts:
    """What a cycle costs on a quiet host: verify ms per tree size, draft ms per level, the rest."""

    verify_ms: dict[int, float] = field(default_factory=lambda: dict(STANDIN_VERIFY_MS))
    draft_first_ms: float = STANDIN_DRAFT_MS[0]
    draft_level_ms: float = STANDIN_DRAFT_MS[1]
    rest_ms: float = STANDIN_REST_MS

    def verify(self, rows: int) -> float:
        return extrapolate(self.verify_ms, rows)  # rows past the curve (a branch on the largest tree) cost

    def draft(self, depth: int) -> float:
        return self.draft_first_ms + self.draft_level_ms * (depth - 1)


class Host:
    """A shared host's speed: a level that switches now and then (another tenant's load comes and goes)
    times per-cycle jitter; level 1 is the quiet host the costs were measured on."""

    def __init__(self, seed: int, quiet: bool = False, switch: float = 0.04,
                 levels: Sequence[float] = (1.0, 1.0, 1.1, 1.25, 1.4), jitter: float = 0.06):
        self.rng = random.Random(seed)
        self.quiet, self.switch, self.levels, self.jitter = quiet, switch, tuple(levels), jitter
        self.level = 1.0

    def factor(self) -> float:
        """The next cycle's slowdown."""
        if self.quiet:
            return 1.0
        if self.rng.random() < self.switch:
            self.level = self.rng.choice(self.levels)
        return self.level * math.exp(self.rng.gauss(0.0, self.jitter))

    def startup(self, measured: float) -> float:
        """A startup measurement: now and then timed during a busy spell."""
        return measured if self.quiet else measured * self.rng.choice((1.0, 1.0, 1.0, 1.3))


def auto_planner(costs: CycleCosts, host: Host, clock: Callable[[], float]) -> TreePlanner:
    """A planner as ``Coordinator.plan_trees`` builds one, from startup curves the host disturbed."""
    verify = {size: host.startup(costs.verify(size)) for size in ENVELOPE.tree_sizes}
    draft = {top_k: {depth: host.startup(costs.draft(depth)) for depth in range(1, ENVELOPE.max_depth + 1)}
             for top_k in ENVELOPE.top_ks}
    planner = TreePlanner(ENVELOPE, verify, draft[ENVELOPE.top_k], draft_ms_by_top_k=draft)
    planner.fallback.clock = clock  # plain steps are timed on the simulated clock
    return planner


# --- one run ---------------------------------------------------------------------------------


@dataclass
class Run:
    """What one policy did over every answer."""

    tokens: int = 0
    ms: float = 0.0
    cycles: int = 0
    chosen: Counter[tuple[int, int, int]] = field(default_factory=Counter)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.ms * 1e3

    @property
    def tau(self) -> float:
        return self.tokens / self.cycles


def simulate(answers: Sequence[dict[str, Any]], shape: Policy, costs: CycleCosts, seed: int,
             lookup_tokens: int, quiet: bool = False) -> Run:
    """Every answer decoded in cycles with ``shape`` (None or AUTO_WHOLE: the planner, one for the whole
    run, as a server keeps one); the same seed gives every policy the same host."""
    host, run = Host(seed, quiet), Run()
    fixed = TreeShape.clamped(1, 1, ENVELOPE.top_k) if shape == PLAIN else shape
    fixed = fixed if isinstance(fixed, TreeShape) else None
    planner = auto_planner(costs, host, lambda: run.ms / 1e3) if fixed is None else None
    for answer in answers:
        truth: list[int] = answer["answer"]
        lookup = PromptLookup([*answer["prompt"], truth[0]], lookup_tokens)
        # Per request, as the runtime's (generation.dovetail_steps), on the planner's startup curve;
        # plain steps alone on the quiet curve (--mode lookup measures its own at start).
        policy = (BranchPolicy(planner.verify_ms) if planner is not None
                  else BranchPolicy(costs.verify_ms) if shape == PLAIN else None)
        position = 1
        while position < len(truth):
            planned = planner.shape() if planner is not None else fixed
            assert planned is not None
            emitted = cycle(planner, planned, answer, position, lookup, costs, host, run,
                            Branches(policy, whole_on_trees=shape == AUTO_WHOLE))
            lookup.extend(emitted)
            position += len(emitted)
    return run


@dataclass(frozen=True)
class Branches:
    """How much of lookup's branch a cycle grafts: all of it without a policy, else what the policy
    finds pays (on plain steps always; on trees unless ``whole_on_trees``)."""

    policy: BranchPolicy | None = None
    whole_on_trees: bool = False

    def cut(self, branch: list[int], planner: TreePlanner | None, shape: TreeShape, tokens: Sequence[int],
            parents: Sequence[int]) -> list[int]:
        if self.policy is None or not branch:
            return branch
        if shape.tree_tokens == 1:
            return self.policy.choose(branch)
        if planner is None or self.whole_on_trees:
            return branch
        terms = planner.branch_terms(shape)
        return self.policy.choose_grafted(branch, shared_prefix(tokens, parents, branch), terms.tree_tokens,
                                          terms.tree_ms, terms.extra_ms)

    def observe(self, branch: Sequence[int], emitted: Sequence[int]) -> None:
        if self.policy is not None:
            self.policy.observe(copied(branch, emitted))


def cycle(planner: TreePlanner | None, shape: TreeShape, answer: dict[str, Any], position: int,
          lookup: PromptLookup, costs: CycleCosts, host: Host, run: Run, branches: Branches = Branches()) -> list[int]:
    """One cycle at ``position`` (the tree's root is the answer's token before it): the tokens it emits."""
    truth: list[int] = answer["answer"]
    size, depth, top_k = shape.tree_tokens, shape.depth, shape.top_k
    room = len(truth) - position - 1  # draft tokens that can still be accepted before the last one
    if size > 1:
        recorded_tokens, recorded_parents = answer["trees"][str(top_k)][position - 1]
        tokens, parents = subtree(recorded_tokens, recorded_parents, size, depth)
    else:
        tokens, parents = [truth[position - 1]], [-1]
    drafted = len(tokens)
    branch = branches.cut(lookup.continuation(room), planner, shape, tokens, parents)
    tokens, parents = graft(tokens, parents, branch)
    accepted = followed(tokens, parents, truth[position:])[:room]
    emitted = [*accepted, truth[position + len(accepted)]]
    branches.observe(branch, emitted)
    factor = host.factor()
    draft_ms = costs.draft(depth) * factor if size > 1 else 0.0
    verify_ms = costs.verify(len(tokens)) * factor
    cycle_ms = draft_ms + verify_ms + costs.rest_ms * factor
    run.ms += cycle_ms
    run.tokens += len(emitted)
    run.cycles += 1
    run.chosen[(size, depth, top_k)] += 1
    if planner is not None and size > 1:
        # As generation.tree_cycle: a sequence's first draft step also reads the prompt, so its times mislead.
        planner.observe(shape, tokens, parents, emitted, draft_ms, verify_ms, cycle_ms, timed=position > 1,
                        drafted=drafted)
    elif planner is not None:
        planner.plain_stepped()  # as generation.told_planner: a plain step counts toward the next probe
    return emitted


def parse_shapes(text: str) -> list[Policy]:
    """``auto,auto-whole,3/2/4,...``: None for the planner, AUTO_WHOLE, T/depth/top_k for a fixed tree."""
    shapes: list[Policy] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item in ("auto", AUTO_WHOLE, PLAIN):
            shapes.append(None if item == "auto" else item)
            continue
        try:
            size, depth, top_k = (int(value) for value in item.split("/"))
        except ValueError:
            raise click.BadParameter(f"{item!r}: expected auto, {AUTO_WHOLE}, {PLAIN} or T/depth/top_k, e.g. 3/2/4",
                                     ) from None
        if not (2 <= size <= ENVELOPE.max_tree_tokens and 1 <= depth <= min(size - 1, ENVELOPE.max_depth)
                and top_k in ENVELOPE.top_ks):
            beams = " or ".join(map(str, ENVELOPE.top_ks))
            raise click.BadParameter(f"{item!r}: the recorded trees hold T 2-{ENVELOPE.max_tree_tokens}, depth "
                                     f"1-{ENVELOPE.max_depth} (below T), top_k {beams}")
        shapes.append(TreeShape.clamped(size, depth, top_k))
    if not shapes:
        raise click.BadParameter("no shapes")
    return shapes


def shape_label(shape: Policy) -> str:
    if isinstance(shape, TreeShape):
        return f"{shape.tree_tokens}/{shape.depth}/{shape.top_k}"
    return "auto" if shape is None else shape


def compare(answers: Sequence[dict[str, Any]], shapes: Sequence[Policy], costs: CycleCosts,
            seeds: int, lookup_tokens: int, quiet: bool) -> str:
    """A markdown table: each policy's tokens/s and tau over the seeds, and against plain steps (where
    ``PLAIN`` is among the policies) or else the best fixed tree, in the same seed (same host)."""
    runs = {shape_label(shape): [simulate(answers, shape, costs, seed, lookup_tokens, quiet) for seed in range(seeds)]
            for shape in shapes}
    fixed = [label for label in runs if label not in ("auto", AUTO_WHOLE, PLAIN)]
    best = max(fixed, key=lambda label: statistics.mean(run.tokens_per_s for run in runs[label])) if fixed else None
    reference = f"/ {PLAIN}" if PLAIN in runs else f"/ best fixed ({best})"
    best = PLAIN if PLAIN in runs else best
    lines = [markdown_header(["policy", "tok/s (mean of seeds)", "tau", f"{reference}: mean",
                              "min", "max", "trees verified (first seed, most used)"])]
    for label, results in runs.items():
        ratios = ([run.tokens_per_s / other.tokens_per_s for run, other in zip(results, runs[best])]
                  if best is not None else [float("nan")])
        chosen = ", ".join(f"{t}/{d}/{k} x{count}" for (t, d, k), count in results[0].chosen.most_common(3))
        lines.append(markdown_row([label, f"{statistics.mean(run.tokens_per_s for run in results):.3f}",
                                   f"{statistics.mean(run.tau for run in results):.3f}",
                                   f"{statistics.mean(ratios):.3f}", f"{min(ratios):.3f}", f"{max(ratios):.3f}",
                                   chosen]))
    return "\n".join(lines)


# --- recording -------------------------------------------------------------------------------


def record_answers(target: Path, draft: Path, prompts: Sequence[str], new_tokens: int,
                   progress: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """For each prompt (a chat user turn): its tokens, the target's greedy answer, and the head's
    largest tree per beam width at every position of the answer (teacher-forced)."""
    import torch

    from cpu_worker.engine import TargetEngine
    from cpu_worker.target_loading import load_target_model
    from dovetail_runtime.draft_eval import reference_greedy
    from dovetail_runtime.eagle3_eval import AuxRows, eagle3_drafter
    from dovetail_runtime.train_cli import target_tokenizer, user_turn_ids
    from gpu_worker.eagle3 import resolve_aux_layers
    from gpu_worker.train.eagle3_io import load_eagle3_head

    tokenizer = target_tokenizer(target)
    engine = TargetEngine(load_target_model(target).eval(), max_len=2048)
    head, layers = load_eagle3_head(draft, target)
    aux = AuxRows(engine.model, resolve_aux_layers(engine.spec.num_layers, layers))
    drafter = eagle3_drafter(head, 2048, ENVELOPE.envelope.scratch_slots)
    eos = tokenizer.eos_token_id
    answers = []
    with torch.inference_mode():
        for text in prompts:
            prompt = user_turn_ids(tokenizer, text)
            truth, _ = reference_greedy(engine, prompt, new_tokens, eos)
            engine.prefill(prompt + truth)  # every position's features in one pass
            rows = aux.rows()
            trees = {str(top_k): teacher_forced_trees(drafter, rows, prompt, truth, top_k) for top_k in ENVELOPE.top_ks}
            answers.append({"prompt": prompt, "answer": truth, "trees": trees})
            progress()
    return answers


def teacher_forced_trees(drafter: Any, rows: Any, prompt: list[int], truth: list[int],
                         top_k: int) -> list[list[list[int]]]:
    """The head's envelope tree at each position 1 .. len(truth) - 1, fed the answer's own tokens."""
    shape = TreeShape.clamped(ENVELOPE.max_tree_tokens, ENVELOPE.max_depth, top_k)
    sequence = prompt + truth
    drafter.reset()
    drafter.extend(rows[:len(prompt)], sequence[1:len(prompt) + 1])  # pairs (f_i, x_i+1), as after a prefill
    trees = []
    for position in range(1, len(truth)):
        tree = drafter.propose(shape)
        trees.append([tree.tokens.tolist(), tree.parents.tolist()])
        row = len(prompt) + position - 1  # the root's (the accepted token's) feature row
        drafter.extend(rows[row:row + 1], [truth[position]])
    return trees


# --- the command -----------------------------------------------------------------------------


@click.group()
def main() -> None:
    """The tree planner replayed offline on a real pair's recorded trees."""


@main.command()
@click.option("--target", type=click.Path(exists=True, path_type=Path), default=SMOLLM2_DIR, show_default=True,
              help="The target's HF folder (the real pair's fp32 one: bash scripts/fetch_fixture.sh).")
@click.option("--draft", type=click.Path(exists=True, path_type=Path), default=SMOLLM2_DRAFT, show_default=True,
              help="An EAGLE-3 head folder.")
@click.option("--prompts", "count", type=click.IntRange(1, 24), default=24, show_default=True,
              help="How many of the held-out chat prompts (tools.chat_prompts; never trained on).")
@click.option("--new-tokens", type=click.IntRange(2, 1024), default=96, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
@load_errors_in_one_line
def dump(target: Path, draft: Path, count: int, new_tokens: int, threads: int, out: Path) -> None:
    """Record the head's trees at every position of the target's greedy answers."""
    import torch
    from tqdm import tqdm

    from tools.chat_prompts import heldout_prompts

    torch.set_num_threads(threads)
    prompts = heldout_prompts(count)
    with tqdm(total=len(prompts), desc="answers", unit="answer") as bar:
        answers = record_answers(target, draft, prompts, new_tokens, lambda: bar.update(1))
    out.write_text(json.dumps({"target": str(target), "draft": str(draft), "answers": answers}), encoding="utf-8")
    click.echo(f"{out}: {len(answers)} answers, {sum(len(a['answer']) for a in answers)} tokens")


def read_json(path: Path, option: str) -> dict[str, Any]:
    """A JSON object from ``path``; anything else is a usage error naming ``option`` (not a traceback)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise click.BadParameter(f"{path}: not JSON ({error})", param_hint=option) from None
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path}: expected a JSON object", param_hint=option)
    return data


@main.command()
@click.option("--trees", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="A file written by `dump`.")
@click.option("--shapes", default="auto,3/2/4,4/3/4,3/2/8,2/1/8", show_default=True,
              help=f"Policies: auto (the planner), {AUTO_WHOLE} (the planner, whole lookup branches on its "
                   f"trees), {PLAIN} (no draft: plain steps, lookup's branches as they pay) and fixed T/depth/top_k "
                   "trees.")
@click.option("--seeds", type=click.IntRange(1), default=8, show_default=True, help="Hosts (noise) per policy.")
@click.option("--lookup-tokens", type=click.IntRange(0, 16), default=4, show_default=True)
@click.option("--verify-curve", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="JSON {T: ms} of a quiet host's verify passes (default: the 7B chat stand-in's at q4_0).")
@click.option("--draft-ms", default=f"{STANDIN_DRAFT_MS[0]},{STANDIN_DRAFT_MS[1]}", show_default=True,
              help="The draft's ms at depth 1, and per further level.")
@click.option("--rest-ms", type=click.FloatRange(0), default=STANDIN_REST_MS, show_default=True)
@click.option("--quiet-host", is_flag=True, help="No noise: exact startup curves, every cycle at its cost.")
def run(trees: Path, shapes: str, seeds: int, lookup_tokens: int, verify_curve: Path | None, draft_ms: str,
        rest_ms: float, quiet_host: bool) -> None:
    """Replay the planner and fixed trees over the recorded answers; print how they compare."""
    answers = read_json(trees, "--trees").get("answers")
    if not isinstance(answers, list) or not answers:
        raise click.BadParameter(f"{trees} holds no answers: write it with `sim_planner dump`", param_hint="--trees")
    try:
        first, level = (float(value) for value in draft_ms.split(","))
    except ValueError:
        raise click.BadParameter(f"{draft_ms!r}: expected two numbers, e.g. 13,6.5", param_hint="--draft-ms") from None
    try:
        verify = (dict(STANDIN_VERIFY_MS) if verify_curve is None else
                  {int(size): float(ms) for size, ms in read_json(verify_curve, "--verify-curve").items()})
    except (TypeError, ValueError):
        raise click.BadParameter(f"{verify_curve}: expected a JSON object of T: ms, e.g. {{\"1\": 20.5, \"8\": 31}}",
                                 param_hint="--verify-curve") from None
    costs = CycleCosts(verify, first, level, rest_ms)
    click.echo(compare(answers, parse_shapes(shapes), costs, seeds, lookup_tokens, quiet_host))


if __name__ == "__main__":
    main()
