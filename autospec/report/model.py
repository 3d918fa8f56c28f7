"""The report's numbers: one ``Workload`` per (category, pair), JSON-ready."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import datetime
from typing import Any

from autospec.costs import MIN_FORWARDS  # live points need this many forwards (one rule)

K_MAX = 8  # the oracle curve S(k) spans k = 0 … max(K_MAX, largest k seen)
MIN_DRAFTED = 100  # fewer drafted tokens: "not enough traffic yet"
MIN_POSITION_DRAFTED = 20  # a draft position drafted fewer times is thin evidence (marked)
MIN_MEASURED = 5  # requests of each mode before a measured speedup decides the verdict
PAYS, LOSES = 1.05, 0.95  # a speedup above PAYS pays; below LOSES loses; between: break-even
# T_t(n)/T_t(1) up to which scoring n tokens counts as free (autospec.probe's threshold;
# not imported from there because autospec.probe imports torch)
MEMORY_BOUND_RATIO = 1.25
RECENT = 200  # the latest requests that say which policy (and k) is in force
BATCH_K_REF = 3  # the k at which "memory-bound at batch B" is judged: T_t(B, 4) / T_t(B, 1)
BATCH_FIXED_KS = (1, 2, 3, 4)  # fixed k whose predicted speedup is shown per batch size
PROBE_BATCH_HINT = "autospec probe --batch 1,2,4,8,16,32"

# -- the numbers ------------------------------------------------------------------------------

@dataclass
class Traffic:
    requests: int
    new_tokens: int
    prompt_tokens: int
    iterations: int
    first_seen: datetime
    last_seen: datetime
    tokens_per_s: float | None  # Σ new tokens / Σ wall seconds, every request


@dataclass
class SourceAcceptance:
    """The draft model's acceptance from one source within a workload: autospec's own
    requests, or an engine's scrapes that ``autospec ingest`` recorded ("vllm (ingested)")."""

    source: str
    records: int  # requests (autospec) or ingested scrapes (an engine)
    drafts: int
    drafted: int
    accepted: int
    alpha: float | None
    mean_accepted_length: float | None  # 1 + accepted / drafts (bonus included)
    by_position: list[float | None]  # accepted / drafted at draft position i = 1, 2, …
    accepted_by_position: list[int]
    drafted_by_position: list[int]


@dataclass
class Acceptance:
    drafted: int
    accepted: int
    alpha: float | None
    alpha_ci95: tuple[float, float] | None  # Wilson
    by_position: list[float | None]  # P(draft token i accepted), i = 1, 2, …
    drafted_by_position: list[int]
    conditional: list[float | None]  # P(accepted at i | accepted before i): the cost model's
    mean_accepted_length: float | None  # tokens per drafting iteration, bonus included
    accepted_by_position: list[int] = field(default_factory=list)  # counts, i = 1, 2, …
    by_position_ci95: list[tuple[float, float] | None] = field(default_factory=list)  # Wilson
    # per source where engine scrapes were ingested into the workload (autospec's own first);
    # [] where autospec's requests are the only source
    by_source: list[SourceAcceptance] = field(default_factory=list)
    # the draft model's conditional acceptance by position in a fixed-k block without early
    # stop, from its greedy traces (``history.fixed_block_acceptance``): what an engine's
    # fixed k accepts; [] where no trace says
    fixed_block: list[float | None] = field(default_factory=list)

    @property
    def fixed_k(self) -> list[float | None]:
        """The draft model's acceptance by position a fixed k is priced at — the S(k) curve,
        the batch table, section 5, every export: its greedy traces' in a fixed-k block where
        they say (``fixed_block``), else its live blocks' (``conditional``; their later
        positions are the ones an early stop let run)."""
        if any(a is not None for a in self.fixed_block):
            return list(self.fixed_block)
        return list(self.conditional)


@dataclass
class Verification:
    """Is scoring k+1 tokens about as cheap as scoring one (memory-bound) here?"""

    t_target_s_by_n: dict[int, float]  # the cost model's curve: one source (cost_inputs)
    source_by_n: dict[int, str]  # "probe" or "requests"
    t_draft_s: float | None
    draft_ratio: float | None  # c = T_d / T_t(1)
    k: int | None  # the k the ratio is taken at (in force, else the most used k > 0)
    cost_ratio: float | None  # T_t(k+1) / T_t(1) (interpolated where unmeasured)
    memory_bound_up_to: int | None  # largest measured n with T_t(n)/T_t(1) ≤ 1.25
    memory_bound: bool | None  # at k + 1
    bandwidth_bytes_per_s: float | None  # achieved by the requests' target forwards
    bandwidth_peak_bytes_per_s: float | None
    bandwidth_utilisation: float | None
    nvml_mem_busy_pct: float | None
    nvml_sm_util_pct: float | None
    probe: dict[str, Any] | None  # the pair's latest probe: id, time, bandwidth, its verdict
    live_by_n: dict[int, tuple[float, int]] = field(default_factory=dict)  # requests: (mean s,
    # forwards) per n, shown beside the curve whatever it was taken from
    live_ratio_ci95: dict[int, tuple[float, float]] = field(default_factory=dict)  # n > 1:
    # ≈95 % interval of the live T_t(n)/T_t(1), from the spread of the latest requests' forwards
    cost_note: str | None = None  # what the cost model lacks, with the forwards it has and needs
    min_forwards: int = MIN_FORWARDS  # live points with fewer forwards are not used


@dataclass
class Tuning:
    """The latest ``autospec tune`` row of the workload: in force for the "tuned" policy."""

    id: int
    created_at: datetime
    family: str
    params: dict[str, Any]
    tokens_per_s: float  # simulated, tuning window
    baseline_tokens_per_s: float | None  # the untuned default, same window
    gain: float | None  # tokens_per_s / baseline
    holdout_tokens_per_s: float | None  # provenance["holdout"], on traces not tuned on
    holdout_baseline_tokens_per_s: float | None
    holdout_gain: float | None
    holdout_traces: int | None
    provenance: dict[str, Any]


@dataclass
class PolicyInForce:
    recent_requests: int  # how many of the latest requests the figures below cover
    recent_since: datetime | None
    policies: dict[str, int]  # policy name → requests, among the recent ones
    recent_k_counts: dict[int, int]  # k → iterations, among the recent requests
    k_in_force: int | None  # the k the recent requests ran most
    k_counts: dict[int, int]  # k → iterations, all time (CategorySummary.k_counts)
    tuned: Tuning | None


@dataclass
class Rate:
    requests: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float | None


@dataclass
class Speedup:
    """Against plain decoding, the draft's cost included. ``value``/``source`` is the one the
    verdict uses: "measured" where both modes have ≥ MIN_MEASURED requests, else
    "estimated" (cost model at ``k``), else None."""

    plain: Rate | None
    speculative: Rate | None
    measured: float | None  # speculative tokens/s ÷ plain tokens/s
    k: int | None  # the k the estimate is for (in force; else the most used k > 0)
    estimated: float | None  # S(k)
    oracle_k: int | None  # argmax S
    oracle: float | None
    curve: dict[int, float]  # S(k), k = 0 … K, at the acceptance of a fixed-k block
    flat_oracle: float | None  # max S if verification cost nothing extra (T_t(n) = T_t(1))
    source: str | None
    value: float | None


@dataclass
class Verdict:
    kind: str  # pays | break_even | low_acceptance | compute_bound | not_enough | no_drafts
    #          | switched_off_but_would_pay | unknown
    text: str
    switched_off: bool = False
    # the speedup the verdict rests on where it is not section 3's (the draft model's): the
    # proposer that pays, from section 5 (estimated), as (value, "n-gram" | "hybrid")
    figure: tuple[float, str] | None = None


@dataclass
class BatchPoint:
    """One batch size of the cost grid, for one workload (every row of the batch from it)."""

    batch: int
    t_target_1_s: float  # T_t(B, 1): one plain batched decoding step
    cost_ratio: float | None  # T_t(B, BATCH_K_REF + 1) / T_t(B, 1)
    t_draft_s: float | None  # T_d(B), per proposed token (interpolated in B where unmeasured)
    k: int | None  # the cost model's k (batch_best_k); None without acceptance or T_d(B)
    speedup: float | None  # its predicted speedup over plain batched decoding at B
    speedup_by_k: dict[int, float]  # the same at each fixed k of BATCH_FIXED_KS
    tuned_k: int | None  # the k the tuned table (if any) runs at B


@dataclass
class Batch:
    """The batch dimension of a workload: the cost grid read through the cost model."""

    source: str  # where the grid came from ("probe #3", "live", "none")
    points: list[BatchPoint]  # ascending batch sizes of the grid
    memory_bound_up_to: int | None  # largest grid B up to which (every B' ≤ B) T_t(B, 4) /
    #                                 T_t(B, 1) ≤ MEMORY_BOUND_RATIO; None: not even the first
    crossover: int | None  # smallest grid B from which on the cost model's k is 0; None: k > 0
    #                        at the largest B (or k unknown)
    tuned: str | None  # the tuned table in force for this workload, as stored
    requests_by_batch: dict[int, int]  # logged requests per batch size
    note: str | None  # why something is missing, and what to run


@dataclass
class LookupEstimate:
    """One lookup proposer over a workload: its drafts at the generated positions of the
    latest greedy requests' traces (read by its own replay rule; exact for greedy traffic),
    its live blocks, and what it is estimated to pay alone."""

    name: str
    title: str  # what reports call it
    trace_requests: int  # requests whose traces the figures come from
    match_rate: float | None  # share of generated positions where it had a draft
    conditional: list[float | None]  # P(i-th proposed token accepted | a draft, i-1 were)
    live_proposed: int  # tokens it proposed live (any policy)
    live_alpha: float | None  # their acceptance
    live_by_position: list[float | None]  # live rates by position
    source: str  # where its estimate's acceptance comes from: "live blocks" or "traces"
    best: tuple[int, float] | None  # (k, S) alone: plain where it has no draft
    seconds_per_token: float | None = None  # its host seconds per proposed token


@dataclass
class Proposers:
    """Which proposer pays for this workload — the model proposer (the draft model), a lookup
    proposer alone (plain steps where it has no draft), or the hybrid (prompt lookup where
    it matches, else the draft model) — by the cost model on the measured costs."""

    draft: tuple[int, float] | None  # (k, S): the model proposer alone
    lookups: dict[str, LookupEstimate]  # every lookup something is known of, by name
    hybrid: tuple[int, int, float] | None  # (k of the lookup, k of the model, S)
    pays: str  # the model's name, a lookup's, "hybrid" or "plain"
    margin: float | None  # S of the one that pays over the next best (plain counts as 1)
    draft_trace_alpha: float | None = None  # the model's acceptance on the same requests'
    # traces (position 1; used for its estimate where nothing was drafted live)
    model: str | None = "draft"  # the model proposer's name
    hybrid_of: str | None = None  # the lookup the hybrid takes where it matches


@dataclass
class Workload:
    category: str
    pair: dict[str, Any]  # id, target, draft, dtype, hardware
    traffic: Traffic
    acceptance: Acceptance
    verification: Verification
    policy: PolicyInForce
    speedup: Speedup
    history_bucket_s: int
    history: list[dict[str, Any]]  # {start, requests, new_tokens, drafted, accepted, alpha}
    verdict: Verdict
    batch: Batch | None = None
    proposers: Proposers | None = None
    # 6. why the policy ran what it ran: the choice its latest kept decision records made most
    # often, with one record's candidates (``autospec.report.why``); None: no record kept
    why: Any = None
    # 7. each policy's time as a share of perfect foresight's over the proposers it may use,
    # from the latest greedy batch-1 requests' traces (``foresight_view``): policy →
    # {"requests", "share" (median), "choices" (median: that least time ÷ the schedule run,
    # priced alike), "proposers"}; empty: none to price
    foresight: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the execution path that served most of the workload's requests, any batch size ("eager",
    # "static", …; "vllm": a vLLM server's, through autospec's custom_class proposer); None:
    # unknown (logged before paths were stored)
    path: str | None = None


def served_by(path: str | None, short: bool = False) -> str:
    """Who served a workload, by its path: autospec's own loop (transformers, on that path;
    ``short``: without it) or vLLM."""
    if path is None:
        return "-"
    return "vLLM" if path == "vllm" else "autospec" if short else f"autospec ({path})"


@dataclass
class Report:
    store: str
    generated_at: datetime
    filters: dict[str, Any]
    workloads: list[Workload] = field(default_factory=list)
    # what the store held that could not be read and was left out (damaged rows: counters
    # outside [0, 1], tuned parameters no policy can be built from), one line each
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: datetimes as ISO strings, int keys as strings."""
        return _jsonable(self)


def _jsonable(x: Any) -> Any:
    if is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in fields(x)}
    if isinstance(x, datetime):
        return x.isoformat()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# what json.dumps(ensure_ascii=False) leaves raw but a terminal acts on: DEL, C1 controls,
# bidi marks, embeddings, overrides and isolates, line/paragraph separators
_RAW = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def render_json(report: Report) -> str:
    """The report as JSON; characters a terminal would act on are written as ``\\uXXXX``
    escapes (they occur only inside strings, so the document decodes to the same values)."""
    text = json.dumps(report.to_dict(), indent=2, ensure_ascii=False, default=str)
    return _RAW.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text) + "\n"
