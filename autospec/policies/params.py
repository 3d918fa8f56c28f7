"""Every number the ``auto`` policy (``CostModelPolicy``) and its live statistics
(``LiveStats``) decide by, in one object: ``Parameters``. The defaults are the untuned
``"auto"``; ``autospec tune`` searches the fields marked ``tuned`` and keeps the rest at their
defaults, for the reason each field's ``why_fixed`` gives (docs/parameters.md lists both).

Numbers that are formats rather than choices — the largest k the API accepts, the n-gram
trace's reach, the match-length buckets the store keeps counts in — live with the formats
(``autospec.traces``): changing them changes what a stored trace or counter means.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

__all__ = ["Parameters", "DEFAULTS", "parameter_docs", "TUNED", "markdown_table"]


def _p(default, doc: str, *, tuned: bool = False, why_fixed: str = ""):
    return field(default=default, metadata={"doc": doc, "tuned": tuned, "why_fixed": why_fixed})


_NOISE = ("a guard against timing noise: searching it on logged traffic would fit the noise "
          "of the logging machine")
_FORMAT = "how evidence is pooled, not what it says: no traffic can tell it apart"


@dataclass(frozen=True)
class Parameters:
    """The ``auto`` policy's numbers. Immutable: ``dataclasses.replace(DEFAULTS, z=0.5)``."""

    # -- the decision ------------------------------------------------------------------------
    k_cap: int | None = _p(None, "the largest k it chooses (None: the request's k_max)",
                           tuned=True)
    z: float = _p(0.0, "acceptance is read at posterior mean + z · sd (z > 0 explores, "
                       "z < 0 is cautious)", tuned=True)
    min_gain: float = _p(0.0, "speculate only when the predicted S(k) ≥ 1 + min_gain (the k = 0 "
                              "switch point: noise in T_t makes marginal gains illusory)",
                         tuned=True)
    optimistic: bool = _p(True, "an unmeasured T_t(n) at its cheapest value consistent with the "
                                "measured points (else linear between them)", tuned=True)
    discount: float | None = _p(None, "keep the policy's own draft-model acceptance per "
                                      "category with this discount per block (None: read the "
                                      "controller's)", tuned=True)
    suffix_whole: bool = _p(True, "a suffix-decoding block is its whole draft (its own length "
                                  "rule: while the walk's path probability holds, at most "
                                  "max_spec_factor × the match) where that pays, rather than "
                                  "the k of best S over it", tuned=True)
    stop_rule: bool = _p(True, "at batch 1 a draft-model block runs to at most k_cap tokens "
                               "and stops at the first past which one more does not pay, by the "
                               "draft's confidence in the tokens so far (policies.stopping)",
                         tuned=True)
    # -- exploration ------------------------------------------------------------------------
    initial_k: int = _p(3, "k while the draft model's costs are unmeasured, and the longest "
                           "trial block", why_fixed="a first block measures T_d and T_t(k + 1) "
                                                    "at any k; the trial rule shortens it where "
                                                    "only a short block can pay")
    reprobe_every: int = _p(64, "consecutive iterations without the draft model before one "
                                "block at probe_k refreshes its acceptance", tuned=True)
    probe_k: int = _p(1, "the k of the one block a re-probe runs", tuned=True)
    cold_start: float = _p(8.0, "a category the store knows nothing of starts as this many "
                                "blocks of the pair's other categories' pooled acceptance; "
                                "below this many draft-model blocks (ever, the store's and the "
                                "pool's included) a forecast stands for its acceptance, and "
                                "without one the draft model is tried before it is switched "
                                "off", why_fixed="the first blocks' evidence, not a choice "
                                                 "traffic can tune: below 8 the Beta posterior "
                                                 "is mostly prior")
    trial_gain: float = _p(0.1, "the trial of an untried draft model (a probe at perfect "
                                "acceptance) needs S ≥ 1 + this there", why_fixed=_NOISE)
    reprobe_steps: float = _p(2.0, "what a re-probe may cost, in plain steps, per reprobe_every "
                                   "iterations off: a dearer one waits proportionally longer",
                              why_fixed="reprobe_every is searched; this only scales it for "
                                        "dear probes")
    unknown_alpha: float = _p(0.5, "the acceptance of a batch row with no statistics and no "
                                   "forecast", why_fixed="the uniform prior's mean (prior_hits "
                                                         "= prior_misses)")
    # -- a request against its category ----------------------------------------------------
    request_prior_tokens: float = _p(16.0, "a request's own rate (seconds per token) counts "
                                           "against its category's as if the category's were "
                                           "this many of the request's tokens",
                                     why_fixed=_FORMAT)
    request_prior_points: float = _p(8.0, "the same for its share of decision points with an "
                                          "n-gram match", why_fixed=_FORMAT)
    request_prior_blocks: float = _p(4.0, "the same for its lookup blocks' acceptance",
                                     why_fixed=_FORMAT)
    unmatched_prior: float = _p(2.0, "a category's share of decision points without an n-gram "
                                     "match starts as this many points without one (the draft "
                                     "model may serve it all)", why_fixed=_FORMAT)
    # -- live statistics ---------------------------------------------------------------------
    acceptance_discount: float = _p(0.995, "the controller's acceptance counts are multiplied by "
                                           "this per block (half-life ln 2 / (1 − d) blocks)",
                                    why_fixed="tune searches the policy's own discount "
                                              "(discount) instead")
    prior_hits: float = _p(1.0, "Beta prior of a position's acceptance: pseudo-accepts",
                           why_fixed=_FORMAT)
    prior_misses: float = _p(1.0, "Beta prior of a position's acceptance: pseudo-rejects",
                             why_fixed=_FORMAT)
    cost_ema: float = _p(0.2, "weight of a new timing in a cost point's moving average",
                         why_fixed=_NOISE)
    cost_settle: int = _p(3, "a cost point is the median of its first this many live samples, "
                             "then the moving average (a process's first forwards run slow)",
                          why_fixed=_NOISE)
    cost_noise: float = _p(0.25, "a live T_t's spread relative to T_t(1): growth within it reads "
                                 "as none when unmeasured points are priced optimistically",
                           why_fixed=_NOISE)
    catch_up_discount: float = _p(0.98, "the draft model's catch-up fit forgets at this rate per "
                                        "catch-up", why_fixed=_FORMAT)
    catch_up_spread: float = _p(0.05, "catch-up sizes vary enough to fit a line (a + b·g) when "
                                      "their sd exceeds this share of their mean; else C ∝ g",
                                why_fixed=_NOISE)
    rate_tokens: float = _p(8.0, "tokens before a category's realized rate (seconds per token) is "
                                 "read", why_fixed=_NOISE)
    calibration_prior: float = _p(2.0, "a confidence bin's acceptance starts as this many "
                                       "tokens accepted as often as the draft was confident "
                                       "(policies.stopping)", why_fixed=_FORMAT)
    stored_weight: float = _p(200.0, "most blocks' worth of evidence a stored history warms a "
                                     "category with", why_fixed=_FORMAT)
    # -- a busy machine (docs/policy.md, "When the machine is busy") ---------------------------
    marginal: float = _p(0.1, "while busy, a block's last token must be accepted with at least "
                              "this probability (k bounded by acceptance alone)",
                         why_fixed=_NOISE)
    shape_floor: float = _p(0.7, "the least T_t(n) / T_t(1), n > 1, trusted from live timings "
                                 "(a probe is exempt)",
                            why_fixed="a physical bound with a margin, not a preference")
    level_move: float = _p(1.3, "the factor by which recent plain steps must differ from the "
                                "level the other points were measured at for the level to count "
                                "as moved", why_fixed=_NOISE)
    level_run: int = _p(3, "plain steps whose median is the recent level", why_fixed=_NOISE)
    scatter: float = _p(0.2, "recent timings of one n with interquartile range above this share "
                             "of their median say the machine is busy", why_fixed=_NOISE)
    scatter_window: int = _p(32, "iterations the scatter looks back over", why_fixed=_NOISE)
    busy_hold: int = _p(32, "iterations the machine counts as busy after a level move or a "
                            "held-out shape", why_fixed=_NOISE)
    remeasure_every: int = _p(32, "at most one re-measure of the level per this many iterations "
                                  "when a shape is held out", why_fixed=_NOISE)
    recent: int = _p(8, "raw timings kept per n for the scatter", why_fixed=_NOISE)

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"parameter {name} must be {rule}, got {getattr(self, name)!r}")
        if self.discount is not None and not 0 < self.discount <= 1:
            bad("discount", "in (0, 1] or None")
        if not 0 < self.acceptance_discount <= 1:
            bad("acceptance_discount", "in (0, 1]")
        for name in ("reprobe_every", "cost_settle", "level_run", "scatter_window", "recent"):
            if getattr(self, name) < 1:
                bad(name, "≥ 1")
        for name in ("initial_k", "probe_k"):
            if getattr(self, name) < 0:
                bad(name, "≥ 0")
        if self.k_cap is not None and self.k_cap < 0:
            bad("k_cap", "≥ 0 or None")
        for name in ("cost_ema", "catch_up_discount", "shape_floor", "unknown_alpha",
                     "marginal"):
            if not 0 <= getattr(self, name) <= 1:
                bad(name, "in [0, 1]")
        if self.level_move <= 1:
            bad("level_move", "> 1")

    def but(self, **changes) -> Parameters:
        """A copy with ``changes``; an unknown name is refused with the known ones listed."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown policy parameter(s) {', '.join(unknown)}: the parameters "
                             f"are {', '.join(sorted(known))}")
        return replace(self, **changes)


DEFAULTS = Parameters()
TUNED = tuple(f.name for f in fields(Parameters) if f.metadata["tuned"])


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
