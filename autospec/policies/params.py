"""Every number the ``auto`` policy (``CostModelPolicy``) and its live statistics
(``LiveStats``) decide by, in one object: ``Parameters``. The defaults are the untuned
``"auto"``; ``autospec tune`` searches the fields marked ``tuned`` and keeps the rest at their
defaults, for the reason each field's ``why_fixed`` gives (docs/parameters.md lists both).

Numbers that are formats rather than choices — the largest k the API accepts, the n-gram
trace's reach, the match-length buckets the store keeps counts in — live with the formats
(``autospec.traces``): changing them changes what a stored trace or counter means. How the
cost table settles and guards its timings is the table's (``autospec.costs.measure``).

``RETIRED`` names the parameters earlier versions had: a stored tuned setting that carries
one is read without it (``current``), with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace

__all__ = ["Parameters", "DEFAULTS", "parameter_docs", "TUNED", "markdown_table", "RETIRED",
           "current", "Constants", "CONSTANTS", "constants_table"]

log = logging.getLogger(__name__)

# parameters earlier versions had → what became of them (docs/policy.md, "What was cut")
RETIRED = {
    "z": "acceptance is read at its posterior mean (an optimistic reading lost in replay)",
    "discount": "one discount, the statistics' own (acceptance_discount)",
    "reprobe_every": "the re-probe is cut", "probe_k": "the re-probe is cut",
    "reprobe_steps": "the re-probe is cut", "trial_gain": "the trial is cut",
    "request_prior_points": "the request's own match share is cut",
    "unmatched_prior": "a constant (params.CONSTANTS)",
    "unknown_alpha": "the prior's mean", "prior_hits": "a constant (params.CONSTANTS.prior)",
    "prior_misses": "a constant (params.CONSTANTS.prior)",
    "rate_tokens": "a constant (params.CONSTANTS)",
    "calibration_prior": "a constant (params.CONSTANTS)",
    **{name: "the cost table's (autospec.costs.measure)" for name in (
        "cost_ema", "cost_settle", "cost_noise", "catch_up_discount", "catch_up_spread",
        "marginal", "shape_floor", "level_move", "level_run", "scatter", "scatter_window",
        "busy_hold", "remeasure_every", "recent")},
}


def _p(default, doc: str, *, tuned: bool = False, why_fixed: str = ""):
    return field(default=default, metadata={"doc": doc, "tuned": tuned, "why_fixed": why_fixed})


_FORMAT = "how evidence is pooled, not what it says: no traffic can tell it apart"


@dataclass(frozen=True)
class Parameters:
    """The ``auto`` policy's numbers. Immutable: ``DEFAULTS.but(min_gain=0.05)``."""

    # -- the decision ------------------------------------------------------------------------
    k_cap: int | None = _p(None, "the largest k it chooses (None: the request's k_max)",
                           tuned=True)
    min_gain: float = _p(0.0, "speculate only when the predicted S(k) ≥ 1 + min_gain (the k = 0 "
                              "switch point: noise in T_t makes marginal gains illusory)",
                         tuned=True)
    optimistic: bool = _p(True, "an unmeasured T_t(n) at its cheapest value consistent with the "
                                "measured points (else linear between them)", tuned=True)
    suffix_whole: bool = _p(True, "a suffix-decoding block is its whole draft (its own length "
                                  "rule: while the walk's path probability holds, at most "
                                  "max_spec_factor × the match) where that pays, rather than "
                                  "the k of best S over it", tuned=True)
    stop_rule: bool = _p(True, "at batch 1 a draft-model block runs to at most k_cap tokens "
                               "and stops at the first past which one more does not pay, by the "
                               "draft's confidence in the tokens so far (policies.stopping)",
                         tuned=True)
    initial_k: int = _p(3, "the k of an exploring block (what is not measured priced at its "
                           "bound; the first measures T_d and T_t(k + 1))",
                        why_fixed="any k measures the costs; a longer exploring block costs "
                                  "more where it fails")
    # -- evidence ---------------------------------------------------------------------------
    acceptance_discount: float = _p(0.995, "acceptance counts are multiplied by this per block "
                                           "(half-life ln 2 / (1 − d) blocks): how fast a "
                                           "category forgets",
                                    why_fixed="the controller's statistics serve every policy "
                                              "and category alike, tuned or not")
    cold_start: float = _p(8.0, "a category the store knows nothing of starts as this many "
                                "blocks of the pair's other categories' pooled acceptance; "
                                "below this many draft-model blocks (ever, the store's and the "
                                "pool's included) a forecast stands for its acceptance",
                           why_fixed="the first blocks' evidence, not a choice traffic can "
                                     "tune: below 8 the Beta posterior is mostly prior")
    stored_weight: float = _p(200.0, "most blocks' worth of evidence a stored history warms a "
                                     "category with", why_fixed=_FORMAT)
    request_prior_tokens: float = _p(16.0, "a request's own rate (seconds per token) counts "
                                           "against its category's as if the category's were "
                                           "this many of the request's tokens",
                                     why_fixed=_FORMAT)
    request_prior_blocks: float = _p(4.0, "the same for its lookup blocks' acceptance",
                                     why_fixed=_FORMAT)

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"parameter {name} must be {rule}, got {getattr(self, name)!r}")
        if not 0 < self.acceptance_discount <= 1:
            bad("acceptance_discount", "in (0, 1]")
        if self.initial_k < 0:
            bad("initial_k", "≥ 0")
        if self.k_cap is not None and self.k_cap < 0:
            bad("k_cap", "≥ 0 or None")

    def but(self, **changes) -> Parameters:
        """A copy with ``changes``; an unknown name is refused with the known ones listed."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            gone = "".join(f"; {n} is retired: {RETIRED[n]}" for n in unknown if n in RETIRED)
            raise ValueError(f"unknown policy parameter(s) {', '.join(unknown)}: the parameters "
                             f"are {', '.join(sorted(known))}{gone}")
        return replace(self, **changes)


DEFAULTS = Parameters()


@dataclass(frozen=True)
class Constants:
    """Numbers of the live statistics that are not the policy's to choose: how evidence is
    pooled, not what it says (no traffic can tell the alternatives apart). Documented with the
    parameters (docs/parameters.md); not settable per policy."""

    prior: tuple[float, float] = _p((1.0, 1.0), "Beta prior of a position's acceptance "
                                                "(pseudo-accepts, pseudo-rejects): uniform")
    rate_tokens: float = _p(8.0, "tokens before a category's realized rate (seconds per token) "
                                 "is read")
    unmatched_prior: float = _p(2.0, "a lookup's share of decision points without a match "
                                     "starts as this many points without one (the draft "
                                     "model may serve it all)")
    width_reach: float = _p(2.0, "at B > 1 a block scores at most this many times the widest n "
                                 "the batch grid has at B (k + 1 ≤ this · n): past it T_t(B, n) "
                                 "is extrapolated over B times the tokens measured")
    lengths_kept: float = _p(64.0, "a category's latest ended requests whose lengths are kept")
    lengths_min: float = _p(3.0, "a category's ended requests that ran past a row's tokens "
                                 "before their lengths say how many more the row is expected "
                                 "to generate (fewer: all it may)")
    calibration_prior: float = _p(2.0, "a confidence bin's acceptance starts as this many "
                                       "tokens accepted as often as the draft was confident "
                                       "(policies.stopping)")

    @property
    def prior_mean(self) -> float:
        """The prior's mean: the acceptance of a row with no statistics and no forecast."""
        return self.prior[0] / sum(self.prior)


CONSTANTS = Constants()
TUNED = tuple(f.name for f in fields(Parameters) if f.metadata["tuned"])


def current(params: dict, where: str = "a stored setting") -> dict:
    """``params`` (name → value) without the ``RETIRED`` ones, each dropped with a warning:
    a setting tuned by an earlier version still loads."""
    gone = sorted(set(params) & set(RETIRED))
    if gone:
        log.warning("%s names retired parameter(s) %s; read without them (%s)", where,
                    ", ".join(gone), "; ".join(f"{n}: {RETIRED[n]}" for n in gone))
    return {n: v for n, v in params.items() if n not in RETIRED}


def parameter_docs() -> list[tuple[str, object, str, bool, str]]:
    """(name, default, what it does, tuned, why it is fixed) for every parameter."""
    return [(f.name, f.default, f.metadata["doc"], f.metadata["tuned"], f.metadata["why_fixed"])
            for f in fields(Parameters)]


def markdown_table() -> str:
    """The parameters as the Markdown table docs/parameters.md carries (a test keeps the two
    equal: ``scripts/parameters_table.py`` prints it)."""
    rows = ["| parameter | default | what it does | tuned, or why fixed |", "|---|---|---|---|"]
    for name, default, doc, tuned, why_fixed in parameter_docs():
        rows.append(f"| `{name}` | {default!r} | {doc} | {'tuned' if tuned else why_fixed} |")
    return "\n".join(rows) + "\n"


def constants_table() -> str:
    """The live statistics' constants (``CONSTANTS``) and the cost table's measurement
    settings (``autospec.costs.measure``) as the second table of docs/parameters.md."""
    from autospec.costs.measure import measurement_docs

    rows = ["| constant | value | what it does |", "|---|---|---|"]
    for f in fields(Constants):
        rows.append(f"| `CONSTANTS.{f.name}` | {f.default!r} | {f.metadata['doc']} |")
    for name, default, doc in measurement_docs():
        rows.append(f"| `MEASURE.{name}` | {default!r} | {doc} |")
    return "\n".join(rows) + "\n"
