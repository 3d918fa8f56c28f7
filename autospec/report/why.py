"""Reading decision records (``autospec.policies.explain``): the candidate table of one record,
and per workload the choice its kept records made most often ("why auto ran k = 3 on code").

Torch-free; shared by ``autospec explain`` and the report (text, HTML and JSON).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from autospec.policies.explain import RULES

__all__ = ["CANDIDATE_HEADER", "Why", "chosen", "choice_name", "candidate_rows", "why_view",
           "why_headline", "why_detail", "ms", "acceptance_cell", "RULES"]

# proposer, k, E[N] (tokens expected), block seconds, extra seconds per token, expected
# seconds per token (spt), S, seconds saved, acceptance a_1 … a_k used, where the acceptance
# and the costs came from (``policies.explain.candidate``); times in ms
CANDIDATE_HEADER = ["proposer", "k", "E[N]", "block", "+/tok", "ms/tok", "S", "saved",
                    "a_1..a_k", "a from", "costs"]
ACCEPTANCE_SHOWN = 4  # a_1 … a_4 shown, then how many more


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds, three significant figures or so; "-" for unknown."""
    if seconds is None or seconds != seconds:
        return "-"
    if seconds == float("inf"):
        return "inf"
    v = seconds * 1e3
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def acceptance_cell(acceptance: Sequence[float]) -> str:
    """a_1 … a_k, the first few, then "+N" for the rest; "-" for none."""
    if not acceptance:
        return "-"
    shown = " ".join(f"{a:.2f}".removeprefix("0") if a < 1 else f"{a:.2f}"
                     for a in acceptance[:ACCEPTANCE_SHOWN])
    more = len(acceptance) - ACCEPTANCE_SHOWN
    return shown + (f" +{more}" if more > 0 else "")


def choice_name(proposer: str, k: int) -> str:
    """"draft k=3", "plain" (k = 0)."""
    return "plain" if not k or proposer == "plain" else f"{proposer} k={k}"


def chosen(record: dict[str, Any]) -> int | None:
    """The index of the record's chosen candidate (its proposer and k); None: not among them."""
    k, proposer = record.get("k", 0), record.get("proposer", "plain")
    stop = record.get("stop")
    if stop:  # a block to where one more token stops paying: the block priced
        k = stop.get("priced_k", k)
    for i, c in enumerate(record.get("candidates") or ()):
        if c.get("k") == k and (c.get("proposer") == proposer
                                or (not k and c.get("proposer") == "plain")):
            return i
    return None


def candidate_rows(record: dict[str, Any]) -> list[list[str]]:
    """The record's candidates as table cells (``CANDIDATE_HEADER``; block, +/tok and saved
    in ms), the chosen one marked with "*"."""
    mark = chosen(record)
    rows = []
    for i, c in enumerate(record.get("candidates") or ()):
        saved = c.get("saved_s")
        rows.append([("* " if i == mark else "  ") + str(c.get("proposer")), str(c.get("k")),
                     f"{c.get('tokens', 0):.2f}", ms(c.get("block_s")), ms(c.get("extra_s")),
                     ms(c.get("spt")), f"{c.get('speedup', 0):.2f}", ms(saved),
                     acceptance_cell(c.get("acceptance") or ()),
                     str(c.get("acceptance_from", "-")), str(c.get("costs_from", "-"))])
    return rows


@dataclass
class Why:
    """What a workload's kept decision records chose most often, and why (one record)."""

    requests: int  # requests whose records were read
    decisions: int  # records read
    proposer: str  # the most frequent choice
    k: int
    count: int  # records that chose it
    rules: dict[str, int]  # rule → records, among those that chose it
    policies: dict[str, int]  # policy → records, among all read
    example: dict[str, Any] | None  # a record that chose it (with candidates where one has)
    example_request: int | None  # the request it is from
    others: dict[str, int] = field(default_factory=dict)  # the other choices: name → records

    @property
    def share(self) -> float:
        return self.count / self.decisions if self.decisions else 0.0

    @property
    def name(self) -> str:
        return choice_name(self.proposer, self.k)


def why_view(rows: Sequence[Any]) -> Why | None:
    """From ``store.queries.category_decisions`` rows (newest first): the most frequent
    (proposer, k) chosen and the newest record that chose it with candidates (else the newest
    that chose it). None: no record."""
    counts: Counter = Counter()
    policies: Counter = Counter()
    n = 0
    for row in rows:
        for rec in row.decisions or ():
            counts[_key(rec)] += 1
            policies[str(rec.get("policy", row.policy))] += 1
            n += 1
    if not n:
        return None
    (proposer, k), count = max(counts.items(), key=lambda kv: (kv[1], -kv[0][1]))
    example = example_request = None
    rules: Counter = Counter()
    for row in rows:
        for rec in row.decisions or ():
            if _key(rec) != (proposer, k):
                continue
            rules[str(rec.get("rule"))] += 1
            if example is None or (not example.get("candidates") and rec.get("candidates")):
                example, example_request = rec, row.id
    others = {choice_name(p, kk): c for (p, kk), c in counts.most_common()
              if (p, kk) != (proposer, k)}
    return Why(requests=sum(1 for r in rows if r.decisions), decisions=n, proposer=proposer,
               k=k, count=count, rules=dict(rules.most_common()),
               policies=dict(policies.most_common()), example=example,
               example_request=example_request, others=others)


def _key(rec: dict[str, Any]) -> tuple[str, int]:
    k = int(rec.get("k", 0))
    return ("plain", 0) if not k else (str(rec.get("proposer", "draft")), k)


def why_headline(w: Why, category: str) -> str:
    """"why auto ran draft k=3 on code: 41 of 60 kept decisions (68 %) …" in one line."""
    policy = next(iter(w.policies), "the policy")
    rules = ", ".join(f"rule {r}: {n}" for r, n in w.rules.items())
    return (f"why {policy} ran {w.name} on {category}: {w.count} of {w.decisions} kept "
            f"decisions ({w.share:.0%}; {rules}) in {w.requests} request"
            f"{'s' if w.requests != 1 else ''}")


def why_detail(w: Why) -> list[str]:
    """The other choices, and where the example record comes from, as sentences."""
    out = []
    if w.others:
        out.append("other choices: " + ", ".join(f"{n} ({c})" for n, c in w.others.items()))
    if len(w.policies) > 1:
        out.append("policies: " + ", ".join(f"{p} ({c})" for p, c in w.policies.items()))
    ex = w.example
    if ex is not None:
        rule = ex.get("rule")
        line = (f"request {w.example_request}, iteration {ex.get('iteration')} (rule {rule}: "
                f"{RULES.get(rule, '?')})")
        if ex.get("t_plain") is not None:
            line += f"; T_t(1) {ms(ex['t_plain'])} ms"
        out.append(line + (":" if ex.get("candidates") else "; no candidates recorded"))
    return out
