"""Inside vLLM: acceptance learned live per category, and each request's k for one step.

Acceptance. Per (category, proposer) and per match-length bucket of the lookup
(``autospec.traces.MATCH_BUCKETS``: a long copy is accepted far more often than a 1-token
chance hit), per draft position i the tokens that reached i (every earlier one accepted) and
those accepted there; the conditional rate a_i = (accepted_i + h) / (reached_i + h + m) with
a Beta(h, m) prior, a bucket's counts shrunk towards the proposer's pooled rate. Counts are
halved when a position's total passes ``cap`` (old traffic fades).

The choice (one step of B running requests, each with its best draft): a draft token at
position j of row r adds g_rj = E_r(j) − E_r(j − 1) expected tokens (``expected_tokens``, the
cost model's one definition of E[N]); the step emits B + Σ g over the tokens sent and costs
T_B(D) ∝ 1 + s_B · D for D draft tokens in all (``StepCosts``). The D tokens of largest gain
(each row's gains fall with j, so they are prefixes of the rows' drafts) maximise the tokens
per second at each D; the step speculates at the best D if its rate beats plain decoding's by
``min_gain``, else every request gets k = 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from autospec.costs.price import expected_tokens
from autospec.policies.live import match_bucket

__all__ = ["Acceptance", "allocate"]


class Acceptance:
    """Discounted counts per (category, proposer, bucket) and draft position."""

    def __init__(self, k_max: int, *, prior: tuple[float, float] = (1.0, 1.0),
                 shrink: float = 4.0, cap: float = 4096.0):
        self.k_max, self.prior, self.shrink, self.cap = k_max, prior, shrink, cap
        # (category, proposer, bucket) → ([accepted per position], [reached per position]);
        # bucket -1: the proposer's pooled counts over every bucket
        self.counts: dict[tuple[str, str, int], tuple[list[float], list[float]]] = {}

    def _cell(self, key) -> tuple[list[float], list[float]]:
        got = self.counts.get(key)
        if got is None:
            got = self.counts[key] = ([0.0] * self.k_max, [0.0] * self.k_max)
        return got

    def add(self, category: str, proposer: str, match: int, proposed: int,
            accepted: int) -> None:
        """A draft of ``proposed`` tokens of which the first ``accepted`` were accepted (as a
        block, or compared with the output as a shadow)."""
        proposed = min(proposed, self.k_max)
        accepted = min(accepted, proposed)
        for key in ((category, proposer, -1), (category, proposer, match_bucket(match))):
            acc, reached = self._cell(key)
            for i in range(min(accepted + 1, proposed)):
                reached[i] += 1
                if i < accepted:
                    acc[i] += 1
            if reached[0] > self.cap:
                for i in range(self.k_max):
                    acc[i] /= 2
                    reached[i] /= 2

    def curve(self, category: str, proposer: str, match: int) -> list[float]:
        """a_1 … a_kmax: the conditional acceptance at each position."""
        h, m = self.prior
        pooled = self.counts.get((category, proposer, -1))
        own = self.counts.get((category, proposer, match_bucket(match)))
        out = []
        for i in range(self.k_max):
            base = h / (h + m)
            if pooled is not None:
                base = (pooled[0][i] + h) / (pooled[1][i] + h + m)
            if own is None:
                out.append(base)
            else:
                w = self.shrink
                out.append((own[0][i] + w * base) / (own[1][i] + w))
        return out

    def snapshot(self) -> dict[str, list[float]]:
        """"category/proposer/bucket" → the rate per position (positions reached only)."""
        return {f"{c}/{p}/{'all' if b < 0 else b}": [round(a / r, 4) for a, r in zip(*v) if r]
                for (c, p, b), v in sorted(self.counts.items())}


def allocate(curves: Sequence[Sequence[float]], lengths: Sequence[int], slope: float, *,
             min_gain: float) -> tuple[list[int], float, float]:
    """Each row's k for one step: (k per row, the chosen rate, plain decoding's rate), rates in
    tokens per plain step. ``curves``: each row's conditional acceptance; ``lengths``: the
    draft each row has (0: none); ``slope``: a draft token's share of a plain step."""
    rows = len(curves)
    gains: list[tuple[float, int, int]] = []  # (−gain, position, row): best first, prefixes
    for r, (curve, n) in enumerate(zip(curves, lengths)):
        before = 1.0
        for j in range(1, n + 1):
            e = expected_tokens(curve, j)
            gains.append((-(e - before), j, r))
            before = e
    gains.sort()
    plain = float(rows)  # B tokens per plain step
    best_rate, best_d, tokens = plain, 0, plain
    for d, (g, _, _) in enumerate(gains, start=1):
        tokens -= g
        rate = tokens / (1 + slope * d)
        if rate > best_rate:
            best_rate, best_d = rate, d
    if best_rate < plain * (1 + min_gain):
        return [0] * rows, plain, plain
    k = [0] * rows
    for _, _, r in gains[:best_d]:
        k[r] += 1
    return k, best_rate, plain
