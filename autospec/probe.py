"""The hardware probe: is verification memory-bandwidth bound on this machine?

Measures the target's cost to score n tokens, T_t(n) for n = 1 … max_n, on a cache of
``context`` tokens, the draft's one-token cost T_d, and the achieved memory bandwidth of the
target's one-token step (weights + KV read ÷ time) against the device's peak. Where T_t(n)
stays near T_t(1), scoring k+1 tokens costs what scoring one does and speculation can pay;
where it grows linearly, verification is compute bound and it cannot.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass

import torch

from autospec.loop import Forward, crop_cache, new_cache
from autospec.telemetry import (
    Clock,
    hardware_name,
    kv_bytes_per_token,
    param_bytes,
    peak_bandwidth,
    raise_peak,
)

log = logging.getLogger(__name__)

__all__ = ["ProbeResult", "probe"]

MEMORY_BOUND_RATIO = 1.25  # T_t(n) / T_t(1) up to which we call scoring n tokens "free"


@dataclass
class ProbeResult:
    hardware: str
    dtype: str
    context: int
    target_s_by_n: dict[int, float]  # median seconds to score n tokens
    draft_s: float | None  # T_d: median seconds of the draft's one-token step
    target_param_bytes: int
    kv_bytes: int  # KV bytes read by a step at this context
    achieved_bytes_per_s: float  # (weights + KV) / T_t(1)
    peak_bytes_per_s: float | None
    threads: int

    @property
    def utilisation(self) -> float | None:
        return self.achieved_bytes_per_s / self.peak_bytes_per_s if self.peak_bytes_per_s else None

    @property
    def relative_cost(self) -> dict[int, float]:
        t1 = self.target_s_by_n[1]
        return {n: t / t1 for n, t in self.target_s_by_n.items()}

    @property
    def memory_bound_up_to(self) -> int:
        """The largest n whose cost stays within MEMORY_BOUND_RATIO of scoring one token."""
        ok = [n for n, r in self.relative_cost.items() if r <= MEMORY_BOUND_RATIO]
        return max(ok) if ok else 1

    @property
    def slope(self) -> float:
        """Least-squares growth of T_t(n)/T_t(1) per extra scored token (0: flat)."""
        pts = list(self.relative_cost.items())
        if len(pts) < 2:
            return 0.0
        mx = statistics.fmean(n for n, _ in pts)
        my = statistics.fmean(r for _, r in pts)
        return (sum((n - mx) * (r - my) for n, r in pts)
                / sum((n - mx) ** 2 for n, _ in pts))

    @property
    def draft_ratio(self) -> float | None:
        """c = T_d / T_t(1): acceptance must beat this for speculation to have a chance."""
        return self.draft_s / self.target_s_by_n[1] if self.draft_s else None

    def verdict(self) -> str:
        upto = self.memory_bound_up_to
        slope = self.slope
        if upto >= 4:
            head = f"verification is memory-bandwidth bound up to n = {upto} scored tokens"
        else:
            head = (f"verification is compute bound: each extra scored token adds "
                    f"{slope:.0%} of a one-token step")
        c = self.draft_ratio
        tail = f"; the draft costs c = {c:.2f} of a target step" if c is not None else ""
        return head + tail

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(utilisation=self.utilisation, memory_bound_up_to=self.memory_bound_up_to,
                 slope=self.slope,
                 draft_ratio=self.draft_ratio, verdict=self.verdict())
        return d


def _median_time(fn, clock: Clock, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        a = clock.mark()
        fn()
        b = clock.mark()
        if clock.cuda:
            torch.cuda.synchronize()
        times.append(clock.seconds(a, b))
    return statistics.median(times)


@torch.inference_mode()
def probe(target, draft=None, *, context: int = 200, max_n: int = 16, repeats: int = 5,
          cache_dir=None, progress=None) -> ProbeResult:
    """Measure the cost curve; ``progress(i, total)`` is called as points complete."""
    device = next(target.parameters()).device
    clock = Clock(device)
    vocab = min(target.config.get_text_config().vocab_size, 32000)
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
    extra = torch.randint(0, vocab, (1, max_n), generator=g).to(device)

    fwd, cache = Forward(target), new_cache(target)
    fwd(prompt, cache, 1)  # the context, cached once; every point scores on top of it
    total = max_n + (draft is not None)

    def score(n: int):
        fwd(extra[:, :n], cache, n)
        crop_cache(cache, context)

    score(1)  # warm-up
    # rounds over every n, so that a burst of machine noise spreads over the curve instead of
    # bending one stretch of it; then the median per n
    times: dict[int, list[float]] = {n: [] for n in range(1, max_n + 1)}
    for r in range(repeats):
        for n in times:
            times[n].append(_median_time(lambda n=n: score(n), clock, 1))
        if progress:
            progress(round((r + 1) * max_n / repeats), total)
    curve = {n: statistics.median(ts) for n, ts in times.items()}

    draft_s = None
    if draft is not None:
        dfwd, dcache = Forward(draft), new_cache(draft)
        dfwd(prompt, dcache, 1)

        def step():
            dfwd(extra[:, :1], dcache, 1)
            crop_cache(dcache, context)

        step()
        draft_s = _median_time(step, clock, repeats)
        if progress:
            progress(total, total)

    weights = param_bytes(target)
    kv = kv_bytes_per_token(target) * context
    achieved = (weights + kv) / curve[1]
    peak = raise_peak(device, cache_dir, peak_bandwidth(device, cache_dir), achieved,
                      weights + kv)
    return ProbeResult(
        hardware=hardware_name(device), dtype=str(next(target.parameters()).dtype).split(".")[-1],
        context=context, target_s_by_n=curve, draft_s=draft_s, target_param_bytes=weights,
        kv_bytes=kv, achieved_bytes_per_s=achieved, peak_bytes_per_s=peak,
        threads=torch.get_num_threads())
