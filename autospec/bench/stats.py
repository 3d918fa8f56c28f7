"""Benchmark arithmetic: run records → rows (medians, paired speedups, acceptance) and the
cost model's oracle; batch records → one row per (batch size, mode). Pure Python: no models,
testable on hand-made records."""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from autospec.engine.proposers import lookups

__all__ = ["RunRecord", "BatchRecord", "median_interval", "aggregate", "summarize_batches", "batch_records_of",
           "first_divergence", "oracle", "head_to_head", "OVERALL"]

OVERALL = "overall"


@dataclass
class RunRecord:
    """One timed request. ``drafted``/``accepted``/``drafts`` are None where unknown."""

    category: str
    prompt_index: int
    repeat: int
    mode: str
    k: int | None
    new_tokens: int
    wall_s: float
    tokens: list[int] = field(default_factory=list, repr=False)  # the new tokens
    target_forwards: int | None = None  # verification forwards (iterations), prefill included
    drafts: int | None = None  # iterations that drafted (unknown for transformers' modes)
    drafted: int | None = None
    accepted: int | None = None
    t_target_1: float | None = None  # s, median target forward scoring 1 token
    t_target_k1: float | None = None  # s, scoring k+1 tokens
    t_draft: float | None = None  # s, mean draft forward
    k_schedule: list[int] = field(default_factory=list, repr=False)  # autospec: k per iteration
    accepted_per_position: list[int] = field(default_factory=list, repr=False)
    drafted_per_position: list[int] = field(default_factory=list, repr=False)
    divergence: dict | None = None  # first difference from plain (greedy), see run_bench
    batch: int = 1  # batch size the request ran at (these records: always 1)
    peak_kv_bytes: int | None = None  # autospec: the loop's peak KV cache, where it reports it
    # autospec policies: per lookup proposer that drafted, by name, [its tokens proposed,
    # accepted]; NAME:k modes report their proposer's counters in drafted/accepted themselves
    lookups: dict[str, list[int]] | None = None
    # autospec, greedy: the request's traces and forwards, what perfect foresight is priced
    # from (``autospec.oracle``; not written to JSON); then its time as a share of the
    # foresight's over the proposers the mode may use, and that least time over the schedule
    # it ran priced the same way — how near its choices came (``foresight_of``)
    seen: dict | None = field(default=None, repr=False)
    foresight: float | None = None
    choices: float | None = None


def _lookups(runs: Sequence[RunRecord]) -> dict[str, dict]:
    """Per lookup proposer that drafted in ``runs`` (autospec policies), by name, in the
    registry's order: its tokens proposed (``drafted``) and accepted / proposed
    (``acceptance``), each apart from the draft model's and from the other lookups'."""
    proposed: Counter = Counter()
    accepted: Counter = Counter()
    for r in runs:
        for name, (p, a) in (r.lookups or {}).items():
            proposed[name] += p
            accepted[name] += a
    order = {n: i for i, n in enumerate(lookups())}
    return {n: {"drafted": proposed[n], "acceptance": accepted[n] / proposed[n]}
            for n in sorted(proposed, key=lambda n: (order.get(n, len(order)), n))
            if proposed[n]}


def _median(values, scale: float = 1.0) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) * scale if vals else None


def aggregate(records: Sequence[RunRecord], *, greedy: bool) -> list[dict]:
    """Rows per (category, mode), then one ``overall`` row per mode.

    tokens_per_s: median over runs of new tokens / wall time. speedup: median over runs of the
    paired ratio plain time / mode time for the same prompt and repeat, each per new token so
    that it stays fair when (sampled) outputs differ in length. acceptance: pooled accepted /
    drafted. mean_accepted_length: 1 + accepted / drafting iterations (counts the bonus
    token; autospec only). tokens_per_forward: new tokens / target forwards, which also counts
    iterations that did not draft, and is known for transformers' modes too. lookups: per
    lookup proposer that drafted beside a policy's draft model, by name, its own tokens
    drafted and acceptance (a NAME:k mode's are its acceptance columns).
    """
    plain = {(r.prompt_index, r.repeat): r for r in records if r.mode == "plain"}
    cats = list(dict.fromkeys(r.category for r in records))
    modes = list(dict.fromkeys(r.mode for r in records))
    rows = []
    for cat in [*cats, OVERALL]:
        mine = [r for r in records if cat in (OVERALL, r.category)]
        best = oracle(mine) if cat != OVERALL else None
        for mode in modes:
            runs = [r for r in mine if r.mode == mode]
            if runs:
                row = _row(cat, runs, plain, greedy)
                row["oracle_k"], row["oracle_speedup"] = best or (None, None)
                rows.append(row)
    return rows


def head_to_head(records: Sequence[RunRecord], rows: Sequence[dict], *,
                 batch_records: Sequence[BatchRecord] = (), batches: Sequence[dict] = (),
                 resamples: int = 2000, seed: int = 0) -> list[dict]:
    """Each adaptive policy (``policy:`` modes) against the modes a user would otherwise
    switch on, request by request at batch 1: the best fixed k of the same run (the
    ``autospec:k`` mode, k > 0, with the highest overall median speedup over plain; the
    smaller k among ties) and every prompt-lookup mode that ran (transformers'
    ``hf-lookup``, autospec's ``ngram:k`` alone). Per pair (``against``, with ``baseline``:
    "fixed-k" or "prompt-lookup"), over all requests and per category (``by_category``): the
    paired ratio of time per token (baseline / policy: above 1, the policy was faster on
    that request), its median with a 95 % bootstrap interval (``resamples`` resamples of the
    requests, seeded: the same records give the same interval), the requests where the
    policy was faster, and the ratio of throughputs (tokens over seconds, summed over the
    requests both ran). A median over 16 requests moves by a few per cent between runs of
    the same code; the interval says how far, so "auto ≥ the best fixed k" (or ≥ prompt
    lookup on the traffic that copies) can be read as more or less than noise.

    At each batch size B > 1 in ``batch_records`` (``batches``: ``summarize_batches``' rows),
    each policy against the best of plain batched decoding and every fixed k at B (the highest
    median speedup; plain's is 1), batch by batch and repeat by repeat: the same figures with
    ``batch`` B and ``baseline`` "best at batch" (``requests`` counts the batches)."""
    overall = {r["mode"]: r["speedup"] for r in rows
               if r["category"] == OVERALL and r.get("speedup") is not None}
    fixed = sorted(((-s, int(m.split(":")[1]), m) for m, s in overall.items()
                    if m.startswith("autospec:") and int(m.split(":")[1]) > 0))
    baselines = [(fixed[0][2], "fixed-k")] if fixed else []
    baselines += [(m, "prompt-lookup") for m in dict.fromkeys(r.mode for r in records)
                  if m.split(":")[0] in ("hf-lookup", *lookups())]
    by = {(r.mode, r.prompt_index, r.repeat): r for r in records if r.batch == 1}
    out = []
    for mode in dict.fromkeys(r.mode for r in records if r.mode.startswith("policy:")):
        for base, kind in baselines:
            pairs = _pairs_of(by, mode, base)
            if not pairs:
                continue
            cats = dict.fromkeys(p.category for _, p in pairs)
            out.append({"mode": mode, "against": base, "baseline": kind,
                        **_paired(pairs, resamples, seed),
                        "by_category": {c: _paired([(b, p) for b, p in pairs if p.category == c],
                                                   resamples, seed) for c in cats}})
    for size in sorted({r.batch for r in batch_records if r.batch > 1}):
        speedups = {r["mode"]: r["speedup"] for r in batches if r["batch"] == size
                    and r.get("speedup") is not None
                    and (r["mode"] == "plain" or r["mode"].startswith("autospec:"))}
        if not speedups:
            continue
        base = max(speedups, key=lambda m: (speedups[m], m == "plain"))
        by_batch = {(r.mode, r.group, r.repeat): r for r in batch_records if r.batch == size}
        for mode in dict.fromkeys(r.mode for r in batch_records
                                  if r.batch == size and r.mode.startswith("policy:")):
            pairs = _pairs_of(by_batch, mode, base)
            if pairs:
                out.append({"mode": mode, "against": base, "baseline": "best at batch",
                            "batch": size, **_paired(pairs, resamples, seed), "by_category": {}})
    return out


def _pairs_of(by: dict, mode: str, base: str) -> list[tuple]:
    """(``base``'s run, ``mode``'s run) of each request ``by`` (mode, request, repeat) holds for
    both, where both took time and emitted tokens."""
    pairs = [(by[(base, *key)], r) for (m, *key), r in by.items()
             if m == mode and (base, *key) in by]
    return [(b, p) for b, p in pairs
            if min(b.wall_s, p.wall_s) > 0 and min(b.new_tokens, p.new_tokens) > 0]


def median_interval(ratios: Sequence[float], resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """The 95 % bootstrap interval of the median of ``ratios`` (``resamples`` resamples,
    seeded)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[min(resamples - 1, int(0.975 * resamples))]


def _paired(pairs: Sequence[tuple[RunRecord, RunRecord]], resamples: int, seed: int) -> dict:
    """(baseline, policy) runs of the same requests → head_to_head's figures."""
    ratios = [(b.wall_s / b.new_tokens) / (p.wall_s / p.new_tokens) for b, p in pairs]
    return {"requests": len(ratios), "median_ratio": statistics.median(ratios),
            "interval": median_interval(ratios, resamples, seed),
            "faster": sum(x > 1 for x in ratios),
            "throughput_ratio": (sum(p.new_tokens for _, p in pairs)
                                 / sum(p.wall_s for _, p in pairs))
                                / (sum(b.new_tokens for b, _ in pairs)
                                   / sum(b.wall_s for b, _ in pairs))}


def oracle(records: Sequence[RunRecord], k_max: int = 16):
    """(k*, S(k*)): the cost model's best lookahead from what these runs measured — acceptance
    per draft position pooled over every autospec run, T_d and T_t(n) medians (T_t(1) from runs
    that decoded at k = 0). None when the costs needed are missing."""
    from autospec.costs.price import best_k, conditional_from_cumulative

    lookup_names = lookups()
    records = [r for r in records
               if r.mode.split(":")[0] not in lookup_names]  # the draft model's
    acc, dr = Counter(), Counter()
    for r in records:
        for i, (a, d) in enumerate(zip(r.accepted_per_position, r.drafted_per_position)):
            acc[i] += a
            dr[i] += d
    curve = {}
    t1 = _median(r.t_target_1 for r in records)
    if t1:
        curve[1] = t1
    for k in {r.k for r in records if r.k}:
        tk = _median(r.t_target_k1 for r in records if r.k == k)
        if tk:
            curve[k + 1] = tk
    td = _median(r.t_draft for r in records)
    if not dr or 1 not in curve or len(curve) < 2 or not td:
        return None
    alphas = conditional_from_cumulative(
        [acc[i] / dr[i] if dr[i] else None for i in range(max(dr) + 1)])
    top = min(k_max, max(dr) + 1)
    return best_k(alphas, td, curve, top)


def foresight_of(records: Sequence[RunRecord]) -> None:
    """Each autospec record's ``foresight``: the least time perfect foresight would have taken
    on its request (``autospec.oracle.least_seconds`` over the proposers its mode may use, from
    the record's own traces, plus its prefill) over the time it took — priced by every
    forward the run measured, pooled (the same machine state) — and ``choices``: that least
    time over the schedule it ran priced the same way (``oracle.scheduled_seconds``, plus its
    prefill). Greedy records only."""
    from autospec.oracle import Prices, least_seconds, may_use, scheduled_seconds

    seen = [r for r in records if r.seen is not None]
    prices = Prices.of(_Forwards(r.seen) for r in seen)
    if prices is None:
        return
    for r in seen:
        s = r.seen
        allowed = may_use(r.mode, s["proposers"], s["model"])
        if r.new_tokens < 2 or r.wall_s <= 0 or not allowed or not allowed <= set(s["traces"]):
            continue  # a proposer it may use left no trace: no foresight to measure
        best = s["prefill_s"] + least_seconds(r.new_tokens, s["traces"], allowed, prices,
                                              model=s["model"])
        r.foresight = best / r.wall_s
        ran = s["prefill_s"] + scheduled_seconds(s["target_s_by_n"], s["draft_forwards"],
                                                 s.get("lookup_blocks", 0), prices)
        r.choices = best / ran if ran > 0 else None


class _Forwards:
    """A record's forwards, as ``Prices.of`` reads them."""

    def __init__(self, seen: dict):
        self.target_s_by_n = seen["target_s_by_n"]
        self.draft_s, self.draft_forwards = seen["draft_s"], seen["draft_forwards"]


def _row(category: str, runs: list[RunRecord], plain: dict, greedy: bool) -> dict:
    ratios, same, divergences = [], [], []
    for r in runs:
        base = plain.get((r.prompt_index, r.repeat))
        if base is None:
            continue
        if r.wall_s > 0 and r.new_tokens > 0 and base.new_tokens > 0:
            ratios.append((base.wall_s / base.new_tokens) / (r.wall_s / r.new_tokens))
        same.append(r.tokens == base.tokens)
        if r.divergence is not None:
            divergences.append(r.divergence)
    drafted = sum(r.drafted for r in runs if r.drafted is not None)
    accepted = sum(r.accepted for r in runs if r.drafted is not None)
    with_drafts = [r for r in runs if r.drafts is not None]
    drafts = sum(r.drafts for r in with_drafts)
    with_fwd = [r for r in runs if r.target_forwards]
    row = {
        "category": category,
        "mode": runs[0].mode,
        "k": runs[0].k,
        "runs": len(runs),
        "new_tokens": _median(r.new_tokens for r in runs),
        "tokens_per_s": _median(r.new_tokens / r.wall_s for r in runs if r.wall_s > 0),
        "speedup": _median(ratios),
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": (1 + sum(r.accepted for r in with_drafts) / drafts
                                 if drafts else None),
        "tokens_per_forward": (sum(r.new_tokens for r in with_fwd) /
                               sum(r.target_forwards for r in with_fwd) if with_fwd else None),
        "t_target_1_ms": _median((r.t_target_1 for r in runs), 1e3),
        "t_target_k1_ms": _median((r.t_target_k1 for r in runs), 1e3),
        "t_draft_ms": _median((r.t_draft for r in runs), 1e3),
        "lookups": _lookups(runs),  # name → {"drafted", "acceptance"}
        "identical": all(same) if greedy and same else None,
        "k_settled": _settled(runs),
        "divergences": divergences,
        "foresight": _median(r.foresight for r in runs),
        "choices": _median(r.choices for r in runs),
    }
    # the cost model's S(k) = E[N]·T_t(1) / (k·T_d + T_t(k+1)) from this row's own measurements
    k, t1, tk, td = row["k"], row["t_target_1_ms"], row["t_target_k1_ms"], row["t_draft_ms"]
    n = row["mean_accepted_length"]
    row["predicted_speedup"] = (n * t1 / (k * td + tk) if None not in (k, t1, tk, td, n)
                                and k * td + tk > 0 else None)
    return row


def _settled(runs: Sequence[RunRecord]) -> int | None:
    """The k a policy used most in its last repeat (what it settled on)."""
    last = max((r.repeat for r in runs), default=None)
    ks = Counter(k for r in runs if r.repeat == last for k in r.k_schedule)
    return ks.most_common(1)[0][0] if ks else None


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where a and b differ (or one ends); None if equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))




# -- batches ------------------------------------------------------------------------------
@dataclass
class BatchRecord:
    """One timed ``generate`` call on a batch of prompts (rows sorted by prompt length)."""

    batch: int  # the batch size asked for (the last group may hold fewer rows)
    group: int  # which batch, in the order every mode runs them
    prompt_indices: list[int]
    repeat: int
    mode: str
    k: int | None
    new_tokens: int  # summed over rows, each counted up to its own stop (EOS or the limit)
    wall_s: float
    rows: list[list[int]] = field(default_factory=list, repr=False)  # each row's new tokens
    drafted: int | None = None
    accepted: int | None = None
    k_schedule: list[int] = field(default_factory=list, repr=False)
    peak_kv_bytes: int | None = None
    fallback: str | None = None  # autospec: why transformers' generate served the call
    # greedy rows that differ from plain's row in the same batch and repeat: the target's
    # top-2 logit margin where they first part (None: one row stops earlier), by row
    margins: dict[int, float | None] = field(default_factory=dict, repr=False)


def batch_records_of(records: Sequence[RunRecord]) -> list[BatchRecord]:
    """Batch-1 run records as batches of one row, for the per-batch-size summary."""
    return [BatchRecord(batch=1, group=r.prompt_index, prompt_indices=[r.prompt_index],
                        repeat=r.repeat, mode=r.mode, k=r.k, new_tokens=r.new_tokens,
                        wall_s=r.wall_s, rows=[list(r.tokens)], drafted=r.drafted,
                        accepted=r.accepted, k_schedule=list(r.k_schedule),
                        peak_kv_bytes=r.peak_kv_bytes) for r in records]


def summarize_batches(records: Sequence[BatchRecord], *, greedy: bool,
                      unsupported: dict[tuple[int, str], str] | None = None,
                      modes: Sequence[str] = ()) -> list[dict]:
    """One row per (batch size, mode), in batch-size order, modes in ``modes`` order.

    tokens_per_s: per repeat, the new tokens of every row of every batch over the summed wall
    time, then the median over repeats. speedup: median over (batch, repeat) pairs of this
    mode's tokens/s over plain's on the same batch and repeat. identical_rows / rows: rows
    whose tokens up to their stop equal plain's row in the same batch and repeat (greedy).
    Modes in ``unsupported`` ((batch size, mode) → reason) get a row with status
    "unsupported" and no numbers; a mode that transformers' generate served gets "fallback".
    """
    unsupported = unsupported or {}
    sizes = sorted({r.batch for r in records} | {b for b, _ in unsupported})
    order = list(dict.fromkeys([*modes, *(r.mode for r in records),
                                *(m for _, m in unsupported)]))
    out = []
    for size in sizes:
        mine = [r for r in records if r.batch == size]
        plain = {(r.group, r.repeat): r for r in mine if r.mode == "plain"}
        for mode in order:
            runs = [r for r in mine if r.mode == mode]
            if runs:
                out.append(_batch_row(size, mode, runs, plain, greedy))
            elif (size, mode) in unsupported:
                out.append(_empty_row(size, mode, "unsupported", unsupported[(size, mode)]))
    return out


def _empty_row(size: int, mode: str, status: str, reason: str | None) -> dict:
    return {"batch": size, "mode": mode, "k": None, "status": status, "reason": reason,
            "runs": 0, "groups": 0, "tokens_per_s": None, "speedup": None, "acceptance": None,
            "k_counts": {}, "peak_kv_bytes": None, "identical_rows": None, "rows": None,
            "diverged_margins": None}


def _batch_row(size: int, mode: str, runs: list[BatchRecord], plain: dict, greedy: bool) -> dict:
    per_repeat = []
    for rep in sorted({r.repeat for r in runs}):
        done = [r for r in runs if r.repeat == rep]
        wall = sum(r.wall_s for r in done)
        if wall > 0:
            per_repeat.append(sum(r.new_tokens for r in done) / wall)
    ratios, same, total = [], 0, 0
    margins: list[float | None] = []
    for r in runs:
        base = plain.get((r.group, r.repeat))
        if base is None:
            continue
        if r.wall_s > 0 and base.wall_s > 0 and r.new_tokens > 0 and base.new_tokens > 0:
            ratios.append((r.new_tokens / r.wall_s) / (base.new_tokens / base.wall_s))
        total += len(r.rows)
        same += sum(a == b for a, b in zip(r.rows, base.rows, strict=False))
        margins += r.margins.values()
    known = [r for r in runs if r.drafted is not None]
    drafted = sum(r.drafted for r in known)
    peaks = [r.peak_kv_bytes for r in runs if r.peak_kv_bytes]
    fallbacks = [r.fallback for r in runs if r.fallback]
    row = _empty_row(size, mode, "fallback" if fallbacks else "ok",
                     fallbacks[0] if fallbacks else None)
    row.update(
        k=runs[0].k, runs=len(runs), groups=len({r.group for r in runs}),
        tokens_per_s=_median(per_repeat), speedup=_median(ratios),
        acceptance=sum(r.accepted for r in known) / drafted if drafted else None,
        k_counts={str(k): n for k, n in sorted(Counter(
            k for r in runs for k in r.k_schedule).items())},
        peak_kv_bytes=max(peaks) if peaks else None,
        identical_rows=same if greedy and total else None, rows=total if greedy and total else None,
        # the rows that differ, by the target's top-2 margin where they first part: below
        # NEAR_TIE a low-precision rounding flip, else worth a report (None: not measured)
        diverged_margins=sorted(m for m in margins if m is not None) or None,
    )
    return row
