"""Rows a reader cannot use, and how readers say what they left out.

A store may hold rows that this release never writes: counters from an older release or a
hostile writer that contradict each other (more tokens accepted than drafted: an acceptance
outside [0, 1]), tuned parameters no policy can be built from (null, a list, JSON that does
not parse, a fixed k outside 0 … ``K_LIMIT``). Readers leave such a row out — the row, never
the whole store — and say which:

- ``note(message)`` adds the message to every ``collecting()`` block open in this context
  (the command line prints each one as one line; the report keeps them), and where none is
  open logs it as a warning, once per message per process (a server that reads the store
  every few seconds does not repeat itself).
- ``rate_problem`` is the one rule for drafted / accepted counters (what makes them a rate);
  ``write.validate_record`` refuses a record that breaks it, and readers skip a row that does
  (``request_problem``: one proposer's row of a request; ``counters_problem``: one
  proposer's sums of a category, which ``less`` takes a damaged request's row out of).
- ``tuned_problem`` is why a stored tuning result cannot be applied.

No SQLAlchemy and no torch here: the values are plain Python.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import operator
import threading
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["collecting", "note", "rate_problem", "tuned_problem", "is_count", "request_note",
           "proposer_counters", "counters_problem", "request_problem", "less", "SUMS", "LISTS",
           "trace_problem"]

_COLLECTORS: contextvars.ContextVar[tuple[list[str], ...]] = contextvars.ContextVar(
    "autospec_store_skipped", default=())
_LOGGED: set[str] = set()  # messages logged without a collector (once each)
_LOGGED_MAX = 4096  # then every further one is logged (a bound on what is remembered)
_lock = threading.Lock()


@contextlib.contextmanager
def collecting() -> Iterator[list[str]]:
    """Collect the notes of what readers skip inside the block (in order, each once), instead
    of logging them. Blocks nest: a note reaches every open one."""
    notes: list[str] = []
    token = _COLLECTORS.set((*_COLLECTORS.get(), notes))
    try:
        yield notes
    finally:
        _COLLECTORS.reset(token)


def note(message: str) -> None:
    """Say that a reader left something out: into the open ``collecting()`` blocks, else a
    logged warning (once per message per process)."""
    collectors = _COLLECTORS.get()
    if collectors:
        for notes in collectors:
            if message not in notes:
                notes.append(message)
        return
    with _lock:
        if message in _LOGGED:
            return
        if len(_LOGGED) < _LOGGED_MAX:
            _LOGGED.add(message)
    log.warning("autospec: %s", message)


def is_count(value: object) -> bool:
    """A whole number ≥ 0 (not a bool, not a float)."""
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= 0
    except TypeError:
        return False


def rate_problem(drafted: object, accepted: object, accepted_per_position: object = (),
                 drafted_per_position: object = (), *, who: str = "") -> str | None:
    """Why these counters are not an acceptance rate in [0, 1], or None where they are: every
    counter a whole number ≥ 0, accepted ≤ drafted, and at every position the tokens accepted
    ≤ those drafted there (a position counted as accepted but never drafted included).
    ``who``: names the proposer in the message ("n-gram ")."""
    if not (is_count(drafted) and is_count(accepted)):
        return f"{who}drafted {drafted!r} and accepted {accepted!r} are not counts"
    if accepted > drafted:  # type: ignore[operator]
        return f"{accepted} {who}tokens accepted of {drafted} drafted"
    acc = _counts(accepted_per_position)
    drf = _counts(drafted_per_position)
    if acc is None or drf is None:
        return f"{who}per-position counters that are not lists of counts"
    for i, a in enumerate(acc):
        d = drf[i] if i < len(drf) else 0
        if a > d:
            return f"{a} {who}tokens accepted of {d} drafted at position {i}"
    return None


def trace_problem(size: int, positions: int) -> str | None:
    """Why a proposer's trace of ``size`` bytes cannot be a request's of ``positions``
    generated positions, or None where it can: a whole number of bytes per position, at
    least one (its replay rule reads each position's; an empty trace of a request that
    generated tokens would have it read past the end)."""
    if size % positions if positions else size:
        return (f"has {size} bytes for {positions} generated positions: a whole number per "
                "position")
    if positions and not size:
        return f"is empty for {positions} generated positions: at least one byte per position"
    return None


def _counts(values: object) -> list[int] | None:
    if values is None:
        return []
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        return None
    return [int(v) for v in values] if all(is_count(v) for v in values) else None


# a proposer's counters (a request's row, or a category's sums: ``request_proposers``,
# ``category_proposers``): what ``rate_problem`` checks, and what a damaged request's row is
# taken out of its category's sums by (per-position lists elementwise)
SUMS = ("blocks", "proposed", "accepted", "seconds")
LISTS = ("proposed_per_position", "accepted_per_position")


def proposer_counters(row) -> dict[str, Any]:
    """A proposer row's counters, as stored (nothing converted before the check)."""
    return {name: getattr(row, name) for name in (*SUMS, *LISTS)}


def counters_problem(c: dict[str, Any], who: str = "") -> str | None:
    """Why a proposer's counters (``proposer_counters``) are not an acceptance rate in
    [0, 1]; None where they are. ``who``: its name, for the message."""
    return rate_problem(c["proposed"], c["accepted"], c["accepted_per_position"],
                        c["proposed_per_position"], who=f"{who} " if who else "")


def request_problem(row) -> str | None:
    """Why a request's proposer row (``request_proposers``, with its ``proposer``) is not a
    rate in [0, 1] (``rate_problem``), or None where it is."""
    return counters_problem(proposer_counters(row), getattr(row, "proposer", ""))


def less(counters: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """``counters`` with ``part`` (a request's) taken out, per-position lists elementwise."""
    out = {name: (counters[name] or 0) - (part[name] or 0) for name in SUMS}
    for name in LISTS:
        have, minus = list(counters[name] or ()), list(part[name] or ())
        out[name] = [v - (minus[i] if i < len(minus) else 0) for i, v in enumerate(have)]
    return out


def request_note(request_id: int, category: str, pair_id: int, policy: str,
                 problem: str) -> str:
    """What every reader says of a damaged ``requests`` row it leaves out (one text, so that
    a command whose readers meet the row several times says it once)."""
    from autospec.textfmt import named

    return (f"request {request_id} (category {named(category)} on pair {pair_id}, policy "
            f"{named(policy, 40)}): {problem}; left out")


def tuned_problem(family: object, params: object, tokens_per_s: object = 0.0) -> str | None:
    """Why a stored tuning result cannot be applied, or None where it can: its parameters must
    be a JSON object that ``policies.tuned.build_policy`` builds a policy of ``family`` from
    (a known family, known parameter names, values in range), and its simulated throughput a
    finite number."""
    from autospec.policies.tuned import build_policy  # no torch

    if not isinstance(params, dict):
        what = "null" if params is None else f"a {_json_type(params)}"
        return f"its parameters are {what}, not a JSON object"
    if not isinstance(family, str):
        return f"its family is {family!r}, not a name"
    if (isinstance(tokens_per_s, bool) or not isinstance(tokens_per_s, (int, float))
            or not math.isfinite(tokens_per_s)):
        return f"its simulated tokens/s is {tokens_per_s!r}"
    try:
        build_policy(family, params)
    except Exception as e:  # whatever a hostile row makes the constructor raise
        from autospec.textfmt import clip

        return clip(str(e) or type(e).__name__, 200)
    return None


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number",
            bool: "boolean"}.get(type(value), type(value).__name__)
