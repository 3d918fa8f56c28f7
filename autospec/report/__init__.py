"""The report: per workload, three questions answered from the store.

A *workload* is one (category, pair) — a pair row already names the hardware. For each:

1. how well the draft matches the target here: acceptance α with a Wilson interval, per draft
   position (accepted/drafted counts, each with its Wilson interval), and over time;
2. whether verification is memory-bound here: T_t(n) from one source (the pair's latest
   probe, else the requests' means of ≥ MIN_FORWARDS forwards), each live point shown with
   its forward count and an interval from its spread, T_t(k+1)/T_t(1), achieved bandwidth
   against the device's peak; too few forwards are reported as "N measured, M needed";
3. the speedup *including* the draft's cost against plain decoding: MEASURED where the store
   holds plain requests of the same workload (every iteration at k = 0) beside speculative
   ones — Σ tokens / Σ wall seconds of each, the token-weighted mean rate — and ESTIMATED from
   the cost model otherwise, S(k) = E[N]·T_t(1) / (k·T_d + T_t(k+1)); always labelled which.

plus the policy in force (the latest requests' policies and k, the latest ``autospec tune``
result with its provenance and its simulated gain over the untuned default), a verdict in
plain words, and the batch dimension (``Batch``): from the pair's cost grid T_t(B, n), T_d(B)
(``queries.batch_costs``: the probe's grid, else live medians), the largest batch size at
which verification is still memory-bound, the k the cost model picks at each batch size for
this workload's acceptance (every row of the batch this workload) with its predicted speedup
over plain batched decoding, the batch size from which it switches speculation off, the k a
tuned table uses, and the requests' logged batch sizes. ``build_report`` (``build``) returns
numbers (``model``); ``render_text`` (``text``), ``render_html`` (``html``, plots from
``svg``) and ``render_json`` (``model``) present them; the command is
``autospec.cli.report``. It reads only the store (no torch), aggregating in SQL
(``autospec.store.history``), so it runs beside a serving process on any store size.
"""

from autospec.report.build import (
    MIN_FORWARDS,
    at_live_level,
    batch_grid,
    batch_summary,
    batch_view,
    build_report,
    cost_inputs,
    estimate_speedup,
    requests_by_batch,
)
from autospec.report.html import render_html
from autospec.report.model import (
    K_MAX,
    MIN_DRAFTED,
    MIN_POSITION_DRAFTED,
    PROBE_BATCH_HINT,
    Acceptance,
    Batch,
    BatchPoint,
    PolicyInForce,
    Report,
    SourceAcceptance,
    Speedup,
    Traffic,
    Tuning,
    Verdict,
    Verification,
    Workload,
    render_json,
)
from autospec.report.text import render_text

__all__ = [
    "Report", "Workload", "Traffic", "Acceptance", "SourceAcceptance", "Verification",
    "PolicyInForce", "Tuning",
    "Speedup", "Verdict", "Batch", "BatchPoint", "K_MAX", "MIN_DRAFTED", "MIN_FORWARDS",
    "MIN_POSITION_DRAFTED", "PROBE_BATCH_HINT",
    "build_report", "batch_view", "batch_grid", "batch_summary", "at_live_level", "cost_inputs",
    "estimate_speedup", "requests_by_batch", "render_text", "render_html", "render_json",
]
