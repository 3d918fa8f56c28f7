"""Whose step costs an export prices k with: the engine's own, where the store holds them, or
autospec's (the transformers loop's probe or live timings, ``autospec.costs.stored``).

vLLM's are the only engine costs the store holds, from two sources:

- the ``custom_class`` proposer (``autospec.fleet.vllm_proposer``) records the seconds of
  vLLM's steps per request, path "vllm", on the pair (served model, no draft model;
  ``autospec.fleet.vllm_sink``). A request that ran alone carries its steps as T_t(n) (n: the
  tokens it scored, 1 + its draft), pooled over every category into the pair's batch-1 costs
  (``pair_costs``), read here by the same rule as every other reader (``stored_costs``, live
  source): a point counts only with ``autospec.costs.MIN_FORWARDS`` steps behind it, through
  the shape guard (``engine_costs``);
- ``autospec ingest --baseline`` of a window in which vLLM served a draft model at a fixed k
  one request at a time records vLLM's seconds per step at that k by its own clock
  (``fleet.ingest.engine_step``) on the pair with that draft model, path "vllm+draft"
  (``ENGINE_STEP_PATHS``), n = k + 1, drafting included (``engine_steps``).

What they price, and what they do not:

- a lookup export (prompt lookup, suffix decoding): its k is priced by the report's own rule
  (``report.build.proposers_view``: its traces' match rate and acceptance, its host seconds
  per token) over vLLM's T_t(n) instead of autospec's. Lookups are priced at batch 1, so the
  steps of requests that shared the batch are not read;
- a draft-model export: its one k at batch 1 over vLLM's T_t(n) with the draft's cost at
  the share of a plain step autospec measured for the pair (T_d = c · T_t(1), c from the
  transformers loop's probe or timings): the custom_class proposer runs no draft model, so it
  never times vLLM's. vLLM's own steps with that draft model, where ingested, are listed
  beside (one server per k priced worse, measured: docs/fleet.md, "Whose costs price k"),
  and price the k where the store has no custom_class steps. The header says which. A tuned
  k is exported as tuned, on autospec's costs;
- which proposer ``--proposer auto`` exports stays the report's choice (section 5, priced on
  autospec's costs, where the draft model can be priced too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["COSTS_FROM", "ENGINE_PATHS", "ENGINE_STEP_PATHS", "EngineCosts", "engine_costs",
           "engine_steps", "lookups_priced", "autospec_costs_label"]

COSTS_FROM = ("auto", "engine", "autospec")
# engine → the execution path its recorded steps carry (engines absent: none recorded)
ENGINE_PATHS = {"vllm": "vllm"}
# engine → the path its own steps with its draft model are kept on (``autospec ingest`` of a
# scrape window at a fixed k: ``fleet.ingest.engine_step``); n = k + 1, drafting included
ENGINE_STEP_PATHS = {"vllm": "vllm+draft"}
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM",
                "llamacpp": "llama.cpp"}


@dataclass(frozen=True)
class EngineCosts:
    """An engine's own batch-1 step costs for one pair, as the store holds them."""

    engine: str
    pair_id: int
    path: str
    t_target: dict[int, float]  # n → T_t(n), seconds of a step scoring n tokens
    steps: dict[int, int]  # n → steps behind that point
    held_out: dict[int, float] = field(default_factory=dict)  # points the shape guard held out
    # the engine's own steps with the draft model of the pair being exported (``engine_steps``):
    # n = k + 1 → (seconds per step, steps); empty: none recorded
    draft_steps: dict[int, tuple[float, int]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        ratio = self.t_target[max(self.t_target)] / self.t_target[1]
        return (f"{ENGINE_NAMES[self.engine]}'s own steps ({sum(self.steps.values())} steps, "
                f"path {self.path}, pair #{self.pair_id}: T_t(1) {self.t_target[1] * 1e3:.1f} "
                f"ms, T_t({max(self.t_target)})/T_t(1) {ratio:.2f})")


def _short(name: str) -> str:
    return str(name).rstrip("/").rsplit("/", 1)[-1]


def engine_costs(session, engine: str, *, target: str, hardware: str, dtype: str,
                 min_forwards: int | None = None) -> tuple[EngineCosts | None, str]:
    """``engine``'s own batch-1 step costs for ``target`` on ``hardware`` in ``dtype`` (the
    target named as the store or the engine names it: the full name or its last part), from
    the pair with the most steps on the engine's path: (costs, "") where some pair has
    T_t(1) and at least one n > 1 resting on ``min_forwards`` steps each (None:
    ``autospec.costs.MIN_FORWARDS``), else (None, why not)."""
    from autospec.costs import MIN_FORWARDS
    from autospec.costs.stored import stored_costs
    from autospec.store import queries

    name = ENGINE_NAMES.get(engine, engine)
    path = ENGINE_PATHS.get(engine)
    if path is None:
        return None, (f"{name}'s own step costs are never recorded in the store (only vLLM's, "
                      f"by the custom_class proposer, path vllm)")
    need = MIN_FORWARDS if min_forwards is None else int(min_forwards)
    rows = queries.path_costs(session)
    pairs = {p.id: p for p in queries.pairs(session)}
    found: list[EngineCosts] = []
    seen: list[str] = []
    for (pid, p_path), row in rows.items():
        pair = pairs.get(pid)
        if p_path != path or pair is None or pair.hardware != hardware or pair.dtype != dtype:
            continue
        if pair.target != target and _short(pair.target) != _short(target):
            continue
        got = stored_costs(session, pid, path=path, source="live", min_forwards=need,
                           parts={"batch1"})
        counts = {int(n): int(c) for n, c in (row.target_count_by_n or {}).items()}
        seen.append(f"pair #{pid}: " + (", ".join(f"n={n}: {c}" for n, c in
                                                  sorted(counts.items())) or "none"))
        if 1 in got.t_target and len(got.t_target) >= 2:
            found.append(EngineCosts(engine, pid, path, dict(got.t_target),
                                     {n: counts.get(n, 0) for n in got.t_target},
                                     dict(got.held_out)))
    if found:
        return max(found, key=lambda c: sum(c.steps.values())), ""
    where = f"target {target} on {hardware} ({dtype})"
    if not seen:
        return None, f"the store holds no {name} steps (path {path}) for {where}"
    return None, (f"too few {name} steps (path {path}) for {where} — steps per tokens scored, "
                  f"of requests that ran alone: {'; '.join(seen)}; the cost model needs "
                  f"T_t(1) and one n > 1 with ≥ {need} steps each")


def engine_steps(session, engine: str, pair_id: int, *, min_forwards: int | None = None
                 ) -> dict[int, tuple[float, int]]:
    """``engine``'s own steps with the pair's draft model, as ``autospec ingest`` recorded
    them from its metrics (``ENGINE_STEP_PATHS``): n (= k + 1) → (seconds per step, steps),
    the points resting on at least ``min_forwards`` steps (None: ``autospec.costs.MIN_FORWARDS``);
    empty where none do."""
    from autospec.costs import MIN_FORWARDS
    from autospec.store import queries

    path = ENGINE_STEP_PATHS.get(engine)
    row = queries.path_costs(session, pair_id).get((pair_id, path)) if path else None
    if row is None:
        return {}
    need = MIN_FORWARDS if min_forwards is None else int(min_forwards)
    sums, counts = row.target_s_sum_by_n or {}, row.target_count_by_n or {}
    return {int(n): (float(sums[n]) / int(c), int(c)) for n, c in sorted(
        counts.items(), key=lambda kv: int(kv[0])) if int(c) >= need and n in sums}


def lookups_priced(session, w, curve: dict[int, float]):
    """Workload ``w``'s section 5 (``report.model.Proposers``) with its lookups priced over
    ``curve`` (n → T_t(n)) by the report's own rule — its traces, its live blocks, its host
    seconds per token, the report's window and k limit — and the draft model not priced (no
    T_d beside these costs): only ``.lookups`` is meant to be read."""
    from autospec.report.build import _lookup_profiles, proposers_view
    from autospec.report.model import K_MAX, RECENT
    from autospec.store import queries

    pid = w.pair["id"]
    sums = queries.category_summaries(session, category=w.category, pair_id=pid)
    if not sums:
        return None
    sm = sums[0]
    return proposers_view(sm, _lookup_profiles(session, w.category, pid, RECENT),
                          list(w.acceptance.conditional), curve, None,
                          k_max=max([K_MAX, *sm.k_counts]),
                          t_lookup=queries.lookup_seconds_per_token(session, pid, w.category))


def autospec_costs_label(session, w, grid_source: str | None) -> str:
    """What autospec's own costs behind an export are: the batch grid's source where the k
    comes from the grid, else batch 1's (the probe of the serving path, or live timings)."""
    from autospec.costs.stored import stored_costs

    if grid_source:
        return f"autospec's own timings (transformers loop): T_t(B, n) from {grid_source}"
    got = stored_costs(session, w.pair["id"], w.category, parts={"batch1"})
    who = ("vLLM's own steps, as the workload's records carry them" if got.path in
           ENGINE_PATHS.values() else "autospec's own timings (transformers loop)")
    return f"{who}: T_t(n) at batch 1 from {got.source}"
