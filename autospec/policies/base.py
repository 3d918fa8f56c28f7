"""The policy contract: ``choose(context) -> k`` then ``update(context, k, outcome)``.

Every iteration the loop calls ``choose`` once, runs the iteration with the returned k
(clamped to the tokens left and the models' context) and calls ``update`` once with the k
actually run and its outcome. k = 0 is a plain decoding step; a policy never changes what is
generated, only how fast. One policy object may serve several controllers: one that keeps
state guards it. ``choose`` returns an int in ``0 … context.k_max``; neither method may raise
(an exception propagates: generation stops rather than silently changing speed).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from autospec.traces import CONFIDENCE_SCALE, K_LIMIT, MATCH_REACH, batch_bucket

__all__ = ["Context", "Outcome", "Policy", "as_policy", "CallablePolicy", "EarlyStop",
           "Choice", "HYBRID", "proposer_of", "batch_bucket", "early_stop_of",
           "stops_drafting", "K_LIMIT", "check_k", "wanted", "params_of", "parse_fixed"]
# K_LIMIT (autospec.traces): the one limit on the lookahead k, everywhere (docs/policy.md).


def check_k(k, what: str = "k") -> int:
    """``k`` as an int in 0 … K_LIMIT (0 is plain decoding); ValueError naming ``what``
    otherwise (a bool, a float or anything else that is not a whole number included)."""
    try:
        if isinstance(k, bool):
            raise TypeError
        k = operator.index(k)  # an int, or an integer type such as numpy's
    except TypeError:
        raise ValueError(f"{what} must be a whole number of draft tokens in 0..{K_LIMIT} "
                         f"(0 = plain decoding), got {k!r}") from None
    if not 0 <= k <= K_LIMIT:
        raise ValueError(f"{what} must be in 0..{K_LIMIT} (0 = plain decoding), got {k}")
    return int(k)


@dataclass(frozen=True)
class Context:
    """What the policy may look at when choosing k for the next iteration. The per-row fields
    (plural names, ``rows``, ``requests``) hold one entry per running row, at every batch size
    (``engine.decide.make_context``); the scalar ones are the batch's."""

    category: str = "default"
    k_max: int = 16
    batch_size: int = 1
    generated: int = 0  # tokens generated so far in this request
    remaining: int = 1  # tokens this request may still generate
    live: Any = None  # the category's LiveStats (its acceptance and rate), if any
    predicted_alpha: float | None = None  # this request's acceptance forecast (categoriser)
    categories: tuple[str, ...] = ()  # each row's category
    rows: tuple = ()  # each row's category's LiveStats
    # the pair's costs at this iteration's execution path and batch size: the row of the
    # controller's cost table (``autospec.costs.table.CostTable.at``); None: none measured
    costs: Any = None
    remaining_rows: tuple[int, ...] = ()  # each row's tokens left (empty: ``remaining``)
    generated_rows: tuple[int, ...] = ()  # each row's tokens generated (empty: ``generated``)
    # the proposers this request can use, by name (``autospec.engine.proposers``), and the
    # one of them that is a model (the draft model: drafts every row from a distribution,
    # catching up after a stretch without it; None: none) — every other one is a lookup
    proposers: tuple[str, ...] = ("draft",)
    model: str | None = "draft"
    # per lookup proposer, each row's match length now (0: none) and the tokens its draft
    # holds (a block never exceeds them)
    matches: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    sizes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    whole: tuple[str, ...] = ()  # lookups whose block is first offered whole (their draft)
    gap: int = 0  # tokens the model proposer has not seen (its catch-up; the widest row's)
    # this request's own LiveStats: its rate, match points, lookup blocks and shadow; per row
    # in ``requests``, as the forecasts in ``predicted_alphas``
    request: Any = None
    requests: tuple = ()
    predicted_alphas: tuple[float | None, ...] = ()
    # where the engine asks why: the list the policy appends its decision record to
    # (``policies.explain``); None: nobody asks, and the policy builds no record
    why: list | None = None


@dataclass(frozen=True)
class Outcome:
    """What one iteration did. accepted ≤ drafted = k; emitted = accepted + 1 (before stops)."""

    drafted: int
    accepted: int
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    # evidence of a proposer's acceptance at a depth, (proposer, depth, value) per finding:
    # ``LiveStats.observe_evidence``
    evidence: tuple[tuple[str, int, float], ...] = ()
    # at batch > 1: each row's accepted count (``accepted`` is the floor of their mean,
    # ``drafted`` the batch's k); times are the whole batch's
    accepted_rows: tuple[int, ...] = ()
    batch_size: int = 1
    proposer: str | None = "draft"  # who drafted (the model proposer unless a lookup did)


HYBRID = "hybrid"  # a policy word: prompt lookup where its match is long enough, else the model


class Choice(int):
    """A policy's choice: k (it is an int; a plain int k is the model proposer's, the draft
    model's), and the proposer that drafts it, by its registered name
    (``autospec.engine.proposers``). A lookup proposer serves the rows where its match has at
    least ``min_match`` tokens; with ``fallback`` the model proposer serves the others, else
    they decode plainly. ``"hybrid"`` names the first lookup proposer (prompt lookup) with the
    model's fallback. Without a model proposer, the model's block is the call's first lookup's.
    ``stop``: where the model proposer's block stops before k (``policies.stopping.StopRule``:
    at the first token past which one more does not pay, by the draft's own confidence)."""

    proposer: str
    min_match: int
    fallback: bool
    stop: Any

    def __new__(cls, k: int, proposer: str = "draft", min_match: int = 1,
                fallback: bool = False, stop=None):
        if not isinstance(proposer, str) or not proposer:
            raise ValueError(f"proposer must be a proposer's name, got {proposer!r}")
        if (isinstance(min_match, bool) or not isinstance(min_match, int)
                or not 1 <= min_match <= MATCH_REACH):
            raise ValueError(f"min_match must be an int in 1..{MATCH_REACH} (match lengths are "
                             f"measured up to {MATCH_REACH}), got {min_match!r}")
        obj = super().__new__(cls, k)
        obj.proposer, obj.min_match = proposer, min_match
        obj.fallback = bool(fallback) or proposer == HYBRID
        obj.stop = stop
        return obj

    def __repr__(self) -> str:
        extra = f", min_match={self.min_match}" if self.min_match != 1 else ""
        extra += ", fallback=True" if self.fallback and self.proposer != HYBRID else ""
        extra += f", stop={self.stop!r}" if self.stop is not None else ""
        return f"Choice({int(self)}, {self.proposer!r}{extra})"

    def __reduce__(self):
        return (Choice, (int(self), self.proposer, self.min_match, self.fallback, self.stop))


def proposer_of(choice) -> tuple[str | None, int, bool]:
    """(proposer, min_match, fallback) of what ``choose`` returned: a plain int is the model
    proposer's (None)."""
    if isinstance(choice, Choice):
        return choice.proposer, choice.min_match, choice.fallback
    return None, 1, False


@runtime_checkable
class Policy(Protocol):
    name: str

    def choose(self, context: Context) -> int: ...

    def update(self, context: Context, k: int, outcome: Outcome) -> None: ...


@dataclass
class CallablePolicy:
    """Wraps ``fn(context) -> k`` as a policy that learns nothing."""

    fn: Callable[[Context], int]
    name: str = "callable"

    def choose(self, context: Context) -> int:
        return self.fn(context)  # checked where it is used (``engine.decide.check_choice``)

    def update(self, context: Context, k: int, outcome: Outcome) -> None:
        return None


def as_policy(spec) -> Policy:
    """A policy from its spec (docs/policy.md, "Naming a policy"): an int k, ``"fixed:K"``,
    ``"ngram:K"``, ``"suffix:K"``, ``"hybrid:K[:M]"``, ``"off"``, ``"heuristic"``,
    ``"costmodel"``, ``"bandit"``, ``"auto"``, ``"auto:SET"``, ``"tuned"``,
    ``"table:1-2:4,3-8:2,9-:0"``, any of them ``"+stop=P"``, a callable or a policy object.
    Every k given here is in 0 … ``K_LIMIT`` (ValueError otherwise)."""
    from .bandit import ThompsonBandit
    from .costmodel import CostModelPolicy
    from .fixed import FixedK
    from .heuristic import Heuristic
    from .table import TablePolicy
    from .tuned import TunedPolicy

    if isinstance(spec, bool):
        raise TypeError("policy must be an int k, a name or a policy object, not a bool")
    if isinstance(spec, int):
        try:
            return FixedK(spec)
        except ValueError as e:
            raise ValueError(f"bad policy {spec!r}: {e}") from None
    if isinstance(spec, str) and "+stop=" in spec:
        base, _, threshold = spec.partition("+stop=")
        try:
            return EarlyStop(as_policy(base), float(threshold))
        except ValueError as e:
            raise ValueError(f"bad policy {spec!r}: {e}") from None
    if isinstance(spec, str):
        name = spec.strip().lower()
        named = {"off": lambda: FixedK(0), "heuristic": Heuristic, "costmodel": CostModelPolicy,
                 "bandit": ThompsonBandit, "auto": auto_policy, "tuned": TunedPolicy}
        if name in named:
            return named[name]()
        kind, _, rest = name.partition(":")
        if rest and kind not in ("auto", "table"):
            return parse_fixed(spec)
        if name.startswith("auto:"):
            try:
                return CostModelPolicy(name=name, proposers=name.split(":", 1)[1])
            except ValueError as e:
                raise ValueError(f"bad policy {spec!r}: 'auto:SET' chooses among a set of "
                                 f"proposers — {e}") from None
        if name.startswith("table:"):
            return TablePolicy.parse(name)
        raise ValueError(
            f"unknown policy {spec!r}: use an int k, 'fixed:K', 'ngram:K', 'suffix:K', "
            "'hybrid:K[:M]', 'off', 'heuristic', 'costmodel', 'bandit', 'auto', "
            "'auto:draft+suffix', 'tuned', 'table:1-2:4,3-:0', a callable context -> k, or an "
            "object with choose()/update()")
    if hasattr(spec, "choose") and hasattr(spec, "update"):
        return spec
    if callable(spec):
        return CallablePolicy(spec)
    raise TypeError(f"cannot use {type(spec).__name__} as a policy")


def parse_fixed(spec: str) -> Policy:
    """The one parser of a fixed k from one proposer (policy specs, and bench's modes):
    ``"fixed:K"`` (the model proposer, the draft model; K in 0 … ``K_LIMIT``, 0: plain
    decoding), ``"NAME:K[:M]"`` (a proposer by its registered name — ``"ngram:4"``,
    ``"suffix:8"`` — K in 1 … ``K_LIMIT``: a block of 0 drafts nothing, that is ``"off"``; M,
    the shortest match it proposes at, default 1) and ``"hybrid:K[:M]"`` (prompt lookup where
    its match has at least M tokens, default 2, else the draft model). K and M in ASCII
    digits, M in 1 … ``MATCH_REACH``. ValueError naming the spec and the rule otherwise; a
    name no proposer is registered under is refused where a controller opens the policy."""
    from .fixed import FixedK

    kind, _, rest = spec.strip().lower().partition(":")
    k_text, _, match_text = rest.partition(":")
    form = ("expected 'fixed:K', 'NAME:K[:M]' (a proposer by name: 'ngram:4', 'suffix:8') or "
            "'hybrid:K[:M]' (K draft tokens in ASCII digits, M the shortest match used)")
    if (not kind.isidentifier() or not kind.isascii() or (kind == "fixed" and match_text)
            or not all(t.isascii() and t.isdigit()
                       for t in (k_text, *([match_text] if match_text else [])))):
        raise ValueError(f"bad policy {spec!r}: {form}")
    k = int(k_text)
    min_match = int(match_text) if match_text else 2 if kind == HYBRID else 1
    lo = 0 if kind == "fixed" else 1
    if k < lo:
        raise ValueError(f"bad policy {spec!r}: k = 0 drafts nothing ({kind} needs k in "
                         f"1..{K_LIMIT}); plain decoding is 'off' (or 'fixed:0')")
    if k > K_LIMIT:
        raise ValueError(f"bad policy {spec!r}: k must be in {lo}..{K_LIMIT}, got {k}")
    try:
        return FixedK(k, None if kind == "fixed" else kind, min_match)
    except ValueError as e:
        raise ValueError(f"bad policy {spec!r}: {e}") from None


class EarlyStop:
    """Any policy, plus draft-side early stopping (``"NAME+stop=0.4"``): drafting stops once
    the draft's probability of its own last token falls below ``early_stop``. Exact (it reads
    the draft's distribution only); a host sync per draft token."""

    def __init__(self, inner: Policy, early_stop: float):
        if not 0 < early_stop < 1:
            raise ValueError(f"early-stop threshold must be in (0, 1), got {early_stop}")
        self.inner, self.early_stop = inner, early_stop
        self.name = f"{inner.name}+stop={early_stop:g}"

    def choose(self, context: Context) -> int:
        return self.inner.choose(context)

    def update(self, context: Context, k: int, outcome: Outcome) -> None:
        self.inner.update(context, k, outcome)


def params_of(policy):
    """The ``Parameters`` a policy decides by (a wrapped policy's, ``EarlyStop.inner``), or
    the defaults: the controller keeps its live statistics by the same numbers."""
    from .params import DEFAULTS, Parameters

    while policy is not None:
        params = getattr(policy, "params", None)
        if isinstance(params, Parameters):
            return params
        policy = getattr(policy, "inner", None)
    return DEFAULTS


def early_stop_of(policy, category: str) -> float | None:
    """The early-stop threshold ``policy`` applies to ``category``'s requests, if any: a
    per-category policy (``TunedPolicy``) answers through ``early_stop_for``."""
    per_category = getattr(policy, "early_stop_for", None)
    if callable(per_category):
        return per_category(category)
    return getattr(policy, "early_stop", None)


def stops_drafting(confidence: int, early_stop: float) -> bool:
    """The one early-stopping rule, live and in replay: stop once the draft's top probability
    at its last token, quantized as stored (255: not observed), falls below ``early_stop``."""
    return confidence < CONFIDENCE_SCALE * early_stop


def auto_policy() -> Policy:
    """The default: the cost-model policy (docs/policy.md; measurements: docs/benchmarks.md)."""
    from .costmodel import CostModelPolicy

    return CostModelPolicy(name="auto")


def wanted(policy) -> set[str | None]:
    """The proposers a policy drafts with by name (itself, the policy it wraps, a tuned
    policy's), so that a controller checks them against the registry and opens what they
    need (a ``"suffix:K"`` policy: the category memory); None stands for the model proposer
    (a fixed k ≥ 1 of the draft model's: an int k, ``"fixed:K"``; the hybrid's fallback).
    Policies that choose among the proposers a call has (``auto``, ``bandit`` …) want none."""
    out: set[str | None] = set()
    proposer, k = getattr(policy, "proposer", "none"), getattr(policy, "k", 0)
    if proposer == HYBRID or (proposer is None and isinstance(k, int) and k > 0):
        out.add(None)
    elif isinstance(proposer, str) and proposer != "none":
        out.add(proposer)
    proposers = getattr(policy, "proposers", None)
    if isinstance(proposers, str) and proposers != "both":
        out.update(proposers.split("+"))
    inner = getattr(policy, "inner", None)
    if inner is not None:
        out |= wanted(inner)
    served = getattr(policy, "policies", None)
    if callable(served):
        for p in served():
            out |= wanted(p)
    return out
