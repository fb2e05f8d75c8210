"""Lossless sampling: the acceptance rule by exact enumeration and by sampled tests.

The tree's children are chosen deterministically (top-k by draft score). The rule under test
(``accept_path``): at each node the target samples its next token from its own processed
distribution and the walk follows the child carrying it; the sampled token ends the walk
when no child carries it. Deliberately wrong rules ride along to show that every check here
can fail.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable

import msgpack
import msgspec
import pytest
import torch

from cpu_worker.acceptance import accept_path, children_lists
from cpu_worker.sampling import Sampler, position_seed, processed_probs, top_token, top_tokens
from ipc import messages as m
from ipc.codec import ProtocolError, decode, encode
from ipc.messages import MIN_TEMPERATURE, Sampling
from ipc.tree import TreeShape

VOCAB = 5
# The 0.999 quantile of chi-square with VOCAB - 1 = 4 degrees of freedom.
CHI2_4DF_999 = 18.467


# --- two wrong rules, for showing the checks have teeth ---------------------------------


def accept_textbook(tokens, parents, probs_at, chooser, draft_probs_at):
    """The p/q rule with a max(p - q, 0) residual: right when children are sampled from the
    draft, biased when they are chosen deterministically as here."""
    children = children_lists(parents)
    node, path = 0, [0]
    while True:
        p = probs_at(node).double()
        q = draft_probs_at(node).double()
        accepted = None
        for child in children[node]:
            token = int(tokens[child])
            if chooser.bernoulli(min(1.0, float(p[token] / max(q[token], 1e-30)))):
                accepted = child
                break
            residual = (p - q).clamp(min=0)
            p = residual / residual.sum() if residual.sum() > 0 else p
        if accepted is None:
            return path, chooser.categorical(p / p.sum())
        path.append(accepted)
        node = accepted


def accept_without_renormalising(tokens, parents, probs_at, chooser, _draft_probs_at=None):
    """Tries children with p(c) but samples a full rejection from the untouched p."""
    children = children_lists(parents)
    node, path = 0, [0]
    while True:
        p = probs_at(node).double()
        accepted = next((c for c in children[node] if chooser.bernoulli(float(p[int(tokens[c])]))), None)
        if accepted is None:
            return path, chooser.categorical(p / p.sum())
        path.append(accepted)
        node = accepted


def correct_rule(tokens, parents, probs_at, chooser, _draft_probs_at=None):
    return accept_path(tokens, parents, lambda node: chooser.categorical(probs_at(node)))


class SeededChooser:
    """Random decisions from one seeded stream (for the sampled tests of the rules)."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def bernoulli(self, probability: float) -> bool:
        return float(torch.rand((), generator=self.generator)) < probability

    def categorical(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))


RULES = {"lossless": correct_rule, "textbook-p/q": accept_textbook, "no-renormalise": accept_without_renormalising}


# --- a small synthetic world: target and draft distributions for every prefix ----------


def table_distribution(prefix: tuple[int, ...], salt: int, params: Sampling) -> torch.Tensor:
    return _table_distribution(prefix, salt, params).clone()


@functools.cache  # fixed per prefix: the sampled tests ask for the same few hundred thousands of times
def _table_distribution(prefix: tuple[int, ...], salt: int, params: Sampling) -> torch.Tensor:
    generator = torch.Generator().manual_seed(hash((salt,) + prefix) % (2**31))
    logits = torch.randn(VOCAB, generator=generator, dtype=torch.float64) * 1.5
    return processed_probs(logits, params).double()


def draft_tree(prefix: tuple[int, ...], shape: list[int], params: Sampling) -> tuple[list[int], list[int]]:
    """A tree whose shape is fixed and whose children are the draft's top tokens (deterministic)."""
    tokens, parents = [prefix[-1]], [-1]
    paths = {0: prefix}
    for parent in shape:
        siblings = [tokens[i] for i in range(1, len(tokens)) if parents[i] == parent]
        ranked = table_distribution(paths[parent], 2, params).argsort(descending=True).tolist()
        token = next(t for t in ranked if t not in siblings)
        tokens.append(token)
        parents.append(parent)
        paths[len(tokens) - 1] = paths[parent] + (token,)
    return tokens, parents


SHAPES = [[0, 0, 1, 1, 2, 3], [0, 1, 2, 3], [0, 0, 0, 0], [0]]


def one_cycle(prefix, shape, params, rule, chooser) -> list[int]:
    tokens, parents = draft_tree(prefix, shape, params)

    def path_prefix(node):
        path = []
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        return prefix + tuple(reversed(path))

    nodes, last = rule(tokens, parents, lambda node: table_distribution(path_prefix(node), 1, params), chooser,
                       lambda node: table_distribution(path_prefix(node), 2, params))
    return [tokens[n] for n in nodes[1:]] + [last]


def generate(prefix, shape, params, rule, chooser, count: int) -> tuple[int, ...]:
    emitted: list[int] = []
    while len(emitted) < count:
        new = one_cycle(prefix + tuple(emitted), shape, params, rule, chooser)
        emitted += new
    return tuple(emitted[:count])


# --- exact enumeration of every random choice ---------------------------------------------


class Branch(Exception):
    def __init__(self, options: list[tuple[object, float]]):
        self.options = options


class ScriptedChooser:
    """Replays a list of decisions; at the first undecided choice, raises Branch with
    every outcome and its probability."""

    def __init__(self, script: list):
        self.script = script
        self.position = 0

    def _next(self, options):
        if self.position < len(self.script):
            value = self.script[self.position]
            self.position += 1
            return value
        raise Branch(options)

    def bernoulli(self, probability: float) -> bool:
        return self._next([(True, probability), (False, 1.0 - probability)])

    def categorical(self, probs: torch.Tensor) -> int:
        return self._next([(i, float(p)) for i, p in enumerate(probs.tolist()) if p > 0])


def enumerate_outcomes(run: Callable[[ScriptedChooser], tuple]) -> dict[tuple, float]:
    """The exact distribution of run()'s result over all random decisions."""
    result: dict[tuple, float] = Counter()
    stack: list[tuple[list, float]] = [([], 1.0)]
    while stack:
        script, probability = stack.pop()
        if probability == 0.0:
            continue
        try:
            outcome = run(ScriptedChooser(script))
        except Branch as branch:
            stack.extend((script + [value], probability * p) for value, p in branch.options)
            continue
        result[outcome] += probability
    return result


def exact_target(prefix, params, count) -> dict[tuple, float]:
    out = {}
    for tokens in itertools.product(range(VOCAB), repeat=count):
        probability = 1.0
        for i in range(count):
            probability *= float(table_distribution(prefix + tokens[:i], 1, params)[tokens[i]])
        if probability > 0:
            out[tokens] = probability
    return out


PARAMS = [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=3),
          Sampling(temperature=1.3, top_p=0.8)]


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("params", PARAMS)
def test_exact_enumeration_equals_target_distribution(shape, params, count):
    prefix = (3, 1)
    got = enumerate_outcomes(lambda chooser: generate(prefix, shape, params, correct_rule, chooser, count))
    expected = exact_target(prefix, params, count)
    assert set(got) <= set(expected)
    assert max(abs(got.get(key, 0.0) - value) for key, value in expected.items()) < 1e-9
    assert abs(sum(got.values()) - 1.0) < 1e-9


@pytest.mark.parametrize("rule", ["textbook-p/q", "no-renormalise"])
def test_exact_enumeration_exposes_wrong_rules(rule):
    prefix, params = (3, 1), PARAMS[0]
    worst = 0.0
    for shape in SHAPES[:3]:
        got = enumerate_outcomes(lambda chooser, shape=shape: generate(prefix, shape, params, RULES[rule], chooser, 1))
        expected = exact_target(prefix, params, 1)
        worst = max(worst, max(abs(got.get(key, 0.0) - value) for key, value in expected.items()))
    assert worst > 0.02


def chi_square(counts: Counter, expected: dict[tuple, float], samples: int) -> float:
    return sum((counts.get(key, 0) - samples * p) ** 2 / (samples * p) for key, p in expected.items())


# Power: with 20,000 samples, shifting 0.05 of probability between two tokens gives a
# noncentrality of at least 20000 * (0.05**2 / p1 + 0.05**2 / p2) >= 100, so the test at
# the 0.999 quantile (18.5, 4 df) misses it with probability below 1e-9.
SAMPLES = 20_000


@pytest.mark.parametrize("rule", list(RULES))
def test_sampled_first_token_chi_square(rule):
    prefix, params, shape = (2, 4), Sampling(temperature=1.0), SHAPES[0]
    sampler = SeededChooser(11)
    counts = Counter(generate(prefix, shape, params, RULES[rule], sampler, 1) for _ in range(SAMPLES))
    statistic = chi_square(counts, exact_target(prefix, params, 1), SAMPLES)
    if rule == "lossless":
        assert statistic < CHI2_4DF_999, statistic
    else:
        assert statistic > 5 * CHI2_4DF_999, statistic


def test_top_tokens_are_torch_s_argmax_ties_and_nans_included():
    """numpy's argmax in place of torch's: the same index on random rows, on ties (the first), with
    infinities and with NaNs (the first NaN), for one row, several, fp32 and other dtypes."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 49152, generator=generator)
    rows[1, [7, 900, 40000]] = 50.0  # a three-way tie
    rows[2, :] = 0.0  # all equal
    rows[3, [5, 17]] = float("inf")
    rows[4, [300, 20]] = float("nan")
    rows[5, :] = float("-inf")
    for chosen in (rows, rows.double(), rows[:, ::3], rows.bfloat16()):
        assert top_tokens(chosen) == chosen.argmax(dim=-1).tolist()
        assert [top_token(row) for row in chosen] == [int(row.argmax()) for row in chosen]
    assert top_tokens(rows)[1:5] == [7, 0, 5, 20]
    assert top_token(rows[1:2]) == int(rows[1:2].argmax())  # a [1, V] row, flat as argmax


def test_sampler_is_keyed_by_seed_and_position_and_filters_hold():
    logits = torch.zeros(50)  # uniform: a coincidence would need 10 equal draws in 50
    params = Sampling(temperature=1.0, seed=123)
    fresh = [Sampler(params).pick(logits, position) for position in range(10, 20)]
    sampler = Sampler(params)
    for position in range(40):  # other draws first: a position's token must not depend on them
        sampler.pick(logits, position)
    assert [sampler.pick(logits, position) for position in range(10, 20)] == fresh
    assert [Sampler(Sampling(temperature=1.0, seed=124)).pick(logits, p) for p in range(10, 20)] != fresh
    filtered = Sampling(temperature=0.9, top_k=2, seed=123)
    scores = torch.randn(50, generator=torch.Generator().manual_seed(0))
    allowed = set(scores.topk(2).indices.tolist())
    assert {Sampler(filtered).pick(scores, position) for position in range(500)} == allowed
    coin = Sampling(temperature=1.0, seed=5)
    ones = sum(Sampler(coin).pick(torch.zeros(2), position) for position in range(4000))
    assert 1800 < ones < 2200  # positions give independent fair draws (binomial sd ~32)
    assert len({position_seed(seed, position) for seed in range(30) for position in range(30)}) == 900


@pytest.mark.parametrize("params", [Sampling(temperature=0.6, top_k=5),
                                    Sampling(temperature=1.2, top_p=0.7),
                                    Sampling(temperature=1.0, top_k=20, top_p=0.9)])
def test_processed_probs_match_transformers_warpers(params):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)
    got = processed_probs(logits, params)
    assert torch.equal(got > 0, expected > 0)
    assert (got - expected).abs().max() < 1e-6


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-46, 1e-30])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    # Found by fuzzing: top_p below fp32's range compared as 0, dropped every token and made NaN.
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    probs = processed_probs(logits, Sampling(temperature=1000.0, top_p=top_p))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 300).float())
    assert Sampler(Sampling(temperature=1.0, top_p=top_p, seed=1)).pick(logits[0], 5) == int(logits[0].argmax())


BAD_SAMPLING = [{"temperature": -1.0}, {"temperature": 1.0, "top_p": 0.0}, {"temperature": 1.0, "top_p": 1.5},
                {"temperature": 1.0, "top_k": -2}, {"temperature": 1e-9}, {"temperature": float("nan")},
                {"temperature": 1.0, "seed": -1}, {"temperature": 1.0, "top_k": 1.5}, {"temperature": "1.0"},
                {"temperature": 1.0, "typical_p": 0.5}]


def prefill_map(sampling: dict) -> dict:
    return {"type": "PrefillRequest", "v": m.PROTOCOL_VERSION, "seq_id": 1, "token_ids": [1, 2, 3],
            "sampling": sampling}


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.0}, {"temperature": MIN_TEMPERATURE},
                                      {"temperature": 0.7, "top_k": 3, "top_p": 0.9, "seed": 5}])
def test_valid_sampling_params_pass_the_protocol(sampling):
    message = decode(msgpack.packb(prefill_map(sampling)))
    assert isinstance(message, m.PrefillRequest) and message.sampling == Sampling(**sampling)
    assert decode(encode(message)) == message


@pytest.mark.parametrize("sampling", BAD_SAMPLING, ids=repr)
def test_invalid_sampling_params_are_refused_by_the_protocol(sampling):
    """Sampler trusts its params: range checks happen where a message is decoded (and
    encoded, so a sender cannot emit what its receiver would refuse)."""
    with pytest.raises(ProtocolError, match="sampling"):
        decode(msgpack.packb(prefill_map(sampling)))
    with pytest.raises(ProtocolError, match="sampling"):
        decode(msgpack.packb({"type": "GenerateRequest", "request_id": "r", "prompt": "x", "sampling": sampling}))


def test_invalid_sampling_params_cannot_be_sent():
    # Structs skip range checks on construction, so encode must refuse what decode would.
    for bad in (Sampling(temperature=-1.0), Sampling(temperature=1.0, top_p=0.0),
                Sampling(temperature=1.0, top_k=-2), Sampling(temperature=1.0, seed=-1)):
        with pytest.raises(ProtocolError, match="would be refused"):
            encode(m.PrefillRequest(seq_id=1, token_ids=[1], sampling=bad))
    # 0 < T < MIN_TEMPERATURE would overflow softmax: refused when the value is made.
    with pytest.raises(ValueError, match="temperature must be 0"):
        Sampling(temperature=1e-9)


def test_sampled_walk_emits_the_targets_own_picks_whatever_the_tree():
    # With a position-keyed stream the emitted tokens are the target's own draws, so every
    # tree shape gives the same tokens as sampling the target alone (no tree).
    params = Sampling(temperature=1.0, seed=21)
    prefix = (3, 1)

    def sampled(shape, count: int) -> tuple[int, ...]:
        sampler = Sampler(params)
        emitted: list[int] = []
        while len(emitted) < count:
            start = prefix + tuple(emitted)
            tokens, parents = draft_tree(start, shape, params)
            depths = [0] * len(parents)
            for index in range(1, len(parents)):
                depths[index] = depths[parents[index]] + 1

            def pick(node, tokens=tokens, parents=parents, depths=depths, start=start):
                path, walk = [], node
                while walk > 0:
                    path.append(tokens[walk])
                    walk = parents[walk]
                logits = table_distribution(start + tuple(reversed(path)), 1, params).log()
                return sampler.pick(logits, len(start) + depths[node])

            nodes, bonus = accept_path(tokens, parents, pick)
            emitted += [tokens[n] for n in nodes[1:]] + [bonus]
        return tuple(emitted[:count])

    alone = sampled([], 12)
    assert all(sampled(shape, 12) == alone for shape in SHAPES)


# --- end to end on a real (tiny) model: the engine and the drafter the workers run ---------


def chi_square_threshold(df: int, z: float = 3.09) -> float:
    """The 0.999 quantile of chi-square (Wilson-Hilferty; z = 3.09 is the normal's 0.999)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def run_cycle(engine, drafter, prompt: list[int], count: int, params: Sampling, seed: int,
              shape: TreeShape = TreeShape.clamped(7, 3, 2)) -> tuple[int, ...]:
    """``count`` tokens from the coordinator's own cycle (generation.py) over in-process
    workers (messages through the codec, features through shared-memory rings): dovetail
    mode with a drafter, ar mode without."""
    from dovetail_runtime.generation import Job

    job = Job(seq_id=1, prompt_ids=prompt, max_new_tokens=count, sampling=msgspec.structs.replace(params, seed=seed),
              eos_token_ids=frozenset(), max_len=engine.max_len)
    tokens, _, _ = run_job(engine, drafter, job, shape)
    return tuple(tokens)


def run_job(engine, drafter, job, shape: TreeShape, lookup_tokens: int = 0):
    """(tokens, logprob entries, stats) of ``job`` run alone by the coordinator's cycle over in-process
    workers: dovetail with a drafter, ar without (each with prompt lookup's ``lookup_tokens``)."""
    from dovetail_runtime.generation import generate_ar, generate_dovetail
    from dovetail_runtime.local_workers import local_workers

    tokens: list[int] = []
    entries: list[m.TokenLogprob] = []

    def emit(new: list[int], new_logprobs: list[m.TokenLogprob]) -> bool:
        tokens.extend(new)
        entries.extend(new_logprobs)
        return False

    with local_workers(engine, drafter, shape, lookup_tokens=lookup_tokens) as (cpu, gpu):
        if gpu is None:
            _, stats = generate_ar(cpu, job, emit, lookup_tokens=lookup_tokens)
        else:
            _, stats = generate_dovetail(cpu, gpu, job, shape, emit, lookup_tokens=lookup_tokens)
    return tokens, entries, stats


def sample_dovetail(engine, drafter, prompt, count, params, seed):
    return run_cycle(engine, drafter, prompt, count, params, seed)


def sample_ar(engine, prompt, count, params, seed):
    return run_cycle(engine, None, prompt, count, params, seed)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A target with an 8-token vocabulary (lm_head sharpened so few continuations carry the
    mass) and an untrained 1-layer draft head for it."""
    from conftest import sharp_tiny_pair

    return sharp_tiny_pair(tmp_path_factory.mktemp("tiny-sampling"), 64)


def exact_continuations(engine, prompt: list[int], count: int, params: Sampling) -> dict[tuple, float]:
    table: dict[tuple, float] = {(): 1.0}
    for _ in range(count):
        grown = {}
        for prefix, probability in table.items():
            probs = processed_probs(engine.prefill(prompt + list(prefix)).logits.double(), params)
            for token, p in enumerate(probs.tolist()):
                if p > 0:
                    grown[prefix + (token,)] = probability * p
        table = grown
    return table


def pooled_chi_square(counts: Counter, expected: dict[tuple, float], samples: int) -> tuple[float, int]:
    """Chi-square over outcomes expected at least 5 times, the rest pooled into one cell."""
    statistic, cells, rest_expected, rest_seen = 0.0, 0, 0.0, samples
    for key, p in expected.items():
        if samples * p >= 5:
            statistic += (counts.get(key, 0) - samples * p) ** 2 / (samples * p)
            rest_seen -= counts.get(key, 0)
            cells += 1
        else:
            rest_expected += samples * p
    if rest_expected >= 5:
        statistic += (rest_seen - rest_expected) ** 2 / rest_expected
        cells += 1
    return statistic, cells - 1


E2E_SAMPLES = 1500  # power: the wrong rule's statistic is ~2x the threshold at this size


def accept_first_child_on_any_match(tokens, parents, target_pick):
    """Wrong: when the target's pick is any child's token, takes the draft's best child."""
    children = children_lists(parents)
    node, path = 0, [0]
    while True:
        wanted = target_pick(node)
        if not any(int(tokens[child]) == wanted for child in children[node]):
            return path, wanted
        node = children[node][0]
        path.append(node)


@pytest.mark.parametrize("rule", ["lossless", "first-child-on-any-match"])
def test_dovetail_continuations_follow_the_target(tiny_pair, monkeypatch, rule):
    """3-token continuations sampled by the runtime's dovetail cycle (in-process workers)
    against the exact distribution of the target (the distribution --mode ar samples from)."""
    import cpu_worker.engine as engine_module

    engine, drafter = tiny_pair
    if rule != "lossless":
        monkeypatch.setattr(engine_module, "accept_path", accept_first_child_on_any_match)
    params = Sampling(temperature=1.0)
    prompt = [1, 5, 2, 7]
    expected = exact_continuations(engine, prompt, 3, params)
    counts = Counter(sample_dovetail(engine, drafter, prompt, 3, params, seed) for seed in range(E2E_SAMPLES))
    statistic, df = pooled_chi_square(counts, expected, E2E_SAMPLES)
    print(f"{rule}: chi-square {statistic:.1f} with {df} df, threshold {chi_square_threshold(df):.1f}")
    # One check for both: the lossless rule passes it, the wrong rule fails it.
    if rule == "lossless":
        assert statistic < chi_square_threshold(df), (statistic, df)
    else:
        assert statistic > chi_square_threshold(df), (statistic, df)


def test_ar_continuations_follow_the_target(tiny_pair):
    engine, _ = tiny_pair
    params = Sampling(temperature=1.0)
    prompt = [1, 5, 2, 7]
    expected = exact_continuations(engine, prompt, 3, params)
    counts = Counter(sample_ar(engine, prompt, 3, params, seed) for seed in range(E2E_SAMPLES))
    statistic, df = pooled_chi_square(counts, expected, E2E_SAMPLES)
    assert statistic < chi_square_threshold(df), (statistic, df)


@pytest.mark.parametrize("params", [Sampling(temperature=1.5, top_k=2, seed=1),
                                    Sampling(temperature=1.5, top_p=0.6, seed=2)])
def test_filtered_tokens_never_appear(tiny_pair, params):
    engine, drafter = tiny_pair
    prompt = [1, 5, 2, 7]
    for seed in range(200):
        continuation = sample_dovetail(engine, drafter, prompt, 3, params, seed)
        for index, token in enumerate(continuation):
            allowed = processed_probs(engine.prefill(prompt + list(continuation[:index])).logits, params) > 0
            assert allowed[token], (continuation, index)


def test_fixed_seed_repeats_in_each_mode(tiny_pair):
    engine, drafter = tiny_pair
    params = Sampling(temperature=1.0)
    prompt = [1, 5, 2, 7]
    for run in (lambda seed: sample_dovetail(engine, drafter, prompt, 12, params, seed),
                lambda seed: sample_ar(engine, prompt, 12, params, seed)):
        assert run(99) == run(99)
        assert len({run(seed) for seed in range(6)}) > 1


@pytest.mark.parametrize("params", [Sampling(temperature=1.0), Sampling(temperature=0.8, top_k=3, top_p=0.9)])
def test_seeded_dovetail_equals_seeded_ar_for_every_tree_shape(tiny_pair, params):
    """The target's draws are keyed by position, so a seeded dovetail run emits the very
    tokens a seeded ar run does, whatever tree the draft proposed."""
    engine, drafter = tiny_pair
    prompt = [1, 5, 2, 7]
    shapes = [TreeShape.clamped(2, 1, 1), TreeShape.clamped(7, 3, 2), TreeShape.clamped(12, 5, 3)]
    for seed in range(8):
        ar = sample_ar(engine, prompt, 16, params, seed)
        for shape in shapes:
            assert run_cycle(engine, drafter, prompt, 16, params, seed, shape) == ar, (seed, shape)
