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
  features/speculative_decoding/draft_model).
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
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone

log = logging.getLogger(__name__)

__all__ = ["ENGINES", "Plan", "plan_for", "render", "ExportError"]

ENGINES = ("vllm", "sglang", "trtllm", "llamacpp")


class ExportError(ValueError):
    """The store cannot answer what the export needs (no such workload, several to choose)."""


@dataclass
class Plan:
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
             engine_hardware: str | None = None, engine_model: str | None = None) -> Plan:
    """The workload's plan from the store (read-only). ``source``: "costmodel", "tuned"
    (the tuned policy's table or fixed k; an error if there is none) or "auto" (tuned where
    stored, else the cost model)."""
    from autospec.report import build_report

    report = build_report(store, category=category, pair_id=pair_id)
    work = report.workloads
    if not work:
        raise ExportError("no workload in the store" + (f" for category {category!r}"
                                                        if category else "")
                          + ": serve some traffic (or `autospec ingest`) first")
    if len(work) > 1:
        names = ", ".join(f"{w.category!r} (pair {w.pair['id']})" for w in work[:8])
        raise ExportError(f"{len(work)} workloads in the store — choose one with --category "
                          f"(and --pair-id): {names}")
    w = work[0]
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
    plan = Plan(
        category=w.category, target=w.pair["target"], draft=w.pair["draft"],
        hardware=w.pair["hardware"], dtype=w.pair["dtype"], requests=w.traffic.requests,
        first_seen=w.traffic.first_seen, last_seen=w.traffic.last_seen,
        source="cost model", grid_source=batch.source if points else None)
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
        else:
            why = (w.verification.cost_note or (batch.note if batch is not None else None)
                   or "measure acceptance and costs first (`autospec probe`)")
            raise ExportError(f"the cost model has no k for this workload yet: {why}")
        plan.notes.append("no batch cost grid: one k, measured at batch 1 (`autospec probe "
                          "--batch` measures T_t(B, n) for a batch-size table)")
    elif batch is not None and batch.note:
        plan.notes.append(batch.note)
    plan.max_batch = max(max_batch or 0, plan.table[-1][0])
    if tuned is not None:
        es = tuned.params.get("early_stop")
        if isinstance(es, (int, float)) and not isinstance(es, bool):
            plan.early_stop = float(es)
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


def _short(name: str) -> str:
    return str(name).rstrip("/").rsplit("/", 1)[-1]


def _header(plan: Plan, engine: str, prefix: str = "# ") -> list[str]:
    lines = [
        f"autospec export --engine {engine}: speculation settings for the traffic in the store",
        f"workload: category {plan.category!r}, {plan.requests} requests, "
        f"{plan.first_seen:%Y-%m-%d %H:%M} – {plan.last_seen:%Y-%m-%d %H:%M} UTC",
        f"pair: target {plan.target}, draft {plan.draft}; hardware {plan.hardware} "
        f"({plan.dtype})",
        f"k from: {plan.source}; costs: "
        f"{plan.grid_source or 'T_t(n) at batch 1'}",
        "batch size → k, estimated speedup over plain decoding at that batch size:",
    ]
    for b, k, s in plan.table:
        lines.append(f"  B={b}: k={k}" + (f", S≈{s:.2f}×" if s is not None else ""))
    if len(plan.table) > 1 or plan.max_batch > plan.table[-1][0]:
        lines.append(f"(each k holds up to the next measured batch size; the last up to "
                     f"B={plan.max_batch})")
    if plan.early_stop is not None:
        lines.append(f"tuned early stop: stop drafting below draft probability "
                     f"{plan.early_stop:g}")
    lines += [f"note: {n}" for n in plan.notes]
    lines += [f"WARNING: {w}" for w in plan.warnings]
    lines.append(f"written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    return [prefix + line for line in lines]


def vllm_config(plan: Plan) -> dict | None:
    ranges = plan.ranges()
    k_max = max(k for *_, k in ranges)
    if k_max == 0:
        return None
    cfg = {"model": plan.draft, "method": "draft_model", "num_speculative_tokens": k_max}
    if len(ranges) > 1:
        cfg["num_speculative_tokens_per_batch_size"] = [list(r) for r in ranges]
    return cfg


def trtllm_config(plan: Plan) -> dict | None:
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


def render(plan: Plan, engine: str, *, batch: int = 1) -> str:
    """The engine's configuration text. ``batch``: for engines that take one k (SGLang,
    llama.cpp), the batch size whose k to use."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    head = _header(plan, engine)
    if engine == "vllm":
        cfg = vllm_config(plan)
        cmd = ["vllm", "serve", plan.target]
        if cfg is None:
            head.append("# speculation does not pay at any batch size: serve without it")
        else:
            cmd += ["--speculative-config", json.dumps(cfg, separators=(", ", ": "))]
        return "\n".join(["#!/bin/sh", *head, shlex.join(cmd) + ' "$@"', ""])
    if engine == "trtllm":
        cfg = trtllm_config(plan)
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
        if k > 0:
            cmd += ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                    plan.draft, "--speculative-num-steps", str(k), "--speculative-eagle-topk",
                    "1", "--speculative-num-draft-tokens", str(k + 1)]
        else:
            head.append("# speculation does not pay here: serve without it")
        return "\n".join(["#!/bin/sh", *head, shlex.join(cmd) + ' "$@"', ""])
    cmd = ["llama-server", "-m", plan.target]
    if k > 0:
        cmd += ["-md", plan.draft, "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
        if plan.early_stop is not None:
            cmd += ["--spec-draft-p-min", f"{plan.early_stop:g}"]
    else:
        head.append("# speculation does not pay here: serve without it")
    return "\n".join(["#!/bin/sh", *head, shlex.join(cmd) + ' "$@"', ""])
