"""Policies built from tuned parameters (``autospec tune`` writes one policy *family* and its
parameters per category and pair to the store), and the live ``"tuned"`` policy that serves
each category with its newest row, polling for newer ones (docs/tuning.md). It reads the store
through a fetch function it is handed, so this package imports no SQL.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .base import HYBRID, Context, EarlyStop, Outcome, Policy, auto_policy, early_stop_of
from .params import Parameters, current

__all__ = ["FAMILIES", "ROW_FAMILIES", "build_policy", "TunedPolicy"]

log = logging.getLogger(__name__)

# family → the parameters it takes (every one optional; defaults are the untuned policy's)
FAMILIES: dict[str, tuple[str, ...]] = {
    "fixed": ("k", "proposer", "min_match", "early_stop"),
    # every field of the cost model's Parameters (a stored row may set any of them)
    "costmodel": (*(f.name for f in dataclasses.fields(Parameters)), "proposers", "early_stop"),
    "bandit": ("k_max", "discount", "min_std_fraction", "early_stop"),
}
# the families a stored row may name: FAMILIES, and a batch-size → k table (tuned per batch size)
ROW_FAMILIES: dict[str, tuple[str, ...]] = {**FAMILIES, "table": ("table", "early_stop")}


def build_policy(family: str, params: Mapping[str, Any], *, name: str | None = None,
                 seed: int = 0) -> Policy:
    """A fresh policy of ``family`` with ``params`` (unknown parameters are an error: a stored
    row from a newer autospec must not be half-applied)."""
    from .bandit import ThompsonBandit
    from .costmodel import CostModelPolicy
    from .fixed import FixedK
    from .table import TablePolicy

    if family not in ROW_FAMILIES:
        raise ValueError(f"unknown policy family {family!r}: one of {sorted(ROW_FAMILIES)}")
    if family == "costmodel":  # a row tuned by an earlier version still loads
        params = current(params, f"tuned row ({family})")
    unknown = set(params) - set(ROW_FAMILIES[family])
    if unknown:
        raise ValueError(f"{family} policy has no parameter(s) {sorted(unknown)}; "
                         f"it takes {list(ROW_FAMILIES[family])}")
    label = name or f"tuned:{family}"
    params = dict(params)
    early_stop = params.pop("early_stop", None)  # every family: draft-side early stopping
    if family == "fixed":
        proposer = params.get("proposer")  # None (or the model's name): the model proposer
        # a minimum match is the hybrid's alone (a lookup's block needs a match of 1)
        min_match = int(params.get("min_match", 2)) if proposer == HYBRID else 1
        policy: Policy = FixedK(int(params.get("k", 0)), proposer, min_match)
    elif family == "table":
        table = params.get("table")
        if not table:
            raise ValueError("table policy needs a 'table' parameter, e.g. '1-3:4,4-:0'")
        policy = (TablePolicy.parse(table) if isinstance(table, str)
                  else TablePolicy.from_choices({int(b): int(k) for b, k in table.items()}))
    elif family == "bandit":
        policy = ThompsonBandit(name=label, seed=seed, **params)
    else:
        policy = CostModelPolicy(name=label, **params)
    return policy if early_stop is None else EarlyStop(policy, float(early_stop))


class TunedPolicy:
    """Per category, the policy of the newest tuned parameters for this pair.

    ``attach(fetch)``: ``fetch(after_id)`` returns the tuned rows newer than ``after_id``
    (``id``, ``category``, ``family``, ``params``, and ``problem``: why a damaged row cannot
    be applied, None otherwise), newest first; a thread applies them every ``refresh_s``
    seconds (``reload``). A failed fetch keeps those in force; a row that cannot be applied
    is logged once and passed over (the next fetch starts after it). A category
    nobody tuned gets ``fallback`` (``auto``); a batch, its most common category's policy."""

    name = "tuned"

    def __init__(self, *, refresh_s: float = 30.0, fallback: Policy | None = None):
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be positive, got {refresh_s}")
        self.refresh_s = refresh_s
        self.fallback = fallback or auto_policy()
        self._policies: dict[str, Policy] = {}  # category → policy in force
        self.params: dict[str, Any] = {}  # category → the TunedRow in force
        self._last_id = 0
        self._fetch: Callable[[int], Sequence[Any]] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reload_failures = 0  # failed fetches

    # -- wiring ---------------------------------------------------------------------------
    def attach(self, fetch: Callable[[int], Sequence[Any]]) -> None:
        """Follow the tuned rows ``fetch(after_id)`` returns: read them now, start the poller."""
        if not callable(fetch):
            raise TypeError("attach takes a fetch function: fetch(after_id) -> tuned rows "
                            "(autospec.store.queries.tuned_fetcher(store, pair) makes one)")
        self._fetch = fetch
        self.reload()
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="autospec-tuned",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _poll(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.reload()

    def reload(self) -> int:
        """Apply tuned rows newer than the last seen; returns how many. Never raises."""
        if self._fetch is None:
            return 0
        try:
            rows = list(self._fetch(self._last_id))
        except Exception as e:
            self.reload_failures += 1
            log.warning("autospec: could not read tuned parameters (keeping those in force): "
                        "%s; %d such failures", e, self.reload_failures)
            return 0
        applied = 0
        for row in reversed(rows):  # oldest first, so the newest wins
            # a damaged row (the fetcher says why) is passed over, logged once: the poll
            # reads on from past its id, and the row in force stays
            problem = getattr(row, "problem", None)
            try:
                if problem is not None:
                    raise ValueError(problem)
                policy = build_policy(row.family, row.params)
            except (TypeError, ValueError) as e:
                log.warning("autospec: ignoring tuned parameters #%d for %r: %s", row.id,
                            row.category, e)
                continue
            with self._lock:
                self._policies[row.category] = policy
                self.params[row.category] = row
            applied += 1
            log.info("autospec: category %r now uses %s %s (tuning #%d)", row.category,
                     row.family, row.params, row.id)
        if rows:
            self._last_id = max(self._last_id, max(r.id for r in rows))
        return applied

    def policies(self) -> list[Policy]:
        """The tuned policies in force (one per tuned category)."""
        with self._lock:
            return list(self._policies.values())

    # -- the policy contract --------------------------------------------------------------
    def _for(self, category: str) -> Policy:
        return self._policies.get(category, self.fallback)

    def _serving(self, context: Context) -> Policy:
        cats = getattr(context, "categories", ()) or ()
        if not cats:
            return self._for(context.category)
        return self._for(max(dict.fromkeys(cats), key=cats.count))  # most common, first wins

    def choose(self, context: Context) -> int:
        return self._serving(context).choose(context)

    def early_stop_for(self, category: str) -> float | None:
        return early_stop_of(self._for(category), category)

    def update(self, context: Context, k: int, outcome: Outcome) -> None:
        self._serving(context).update(context, k, outcome)
