"""The hardware probe: is verification memory-bandwidth bound on this machine, and up to
which batch size?

Measures the target's cost to score n tokens per row, T_t(B, n), on a cache of ``context``
tokens per row, for each batch size B in ``batches`` and n = 1 … max_n; the draft's
one-token step T_d(B); and the achieved memory bandwidth of the target's one-token step at
batch 1 (weights + KV read ÷ time) against the device's peak. Where T_t(B, n) stays near
T_t(B, 1), scoring k+1 tokens per row costs what scoring one does and speculation can pay at
that batch size; where it grows linearly, verification is compute bound and it cannot.

The context is prefilled once, for one row; batch B runs on that cache repeated B times
along the batch dimension (the rows are identical, which changes nothing in the arithmetic),
so probing B = 32 costs no 32-row prefill. Every timed forward is cropped back to the context.
Batch sizes grow until one runs out of device memory (logged; the grid keeps those measured)
or the ``max_seconds`` budget would be overrun. Above ``dense_up_to`` rows only the n in
``SPARSE_N`` are measured: n = 1 … 9 (what the loop scores with k ≤ 8) and 12, 16.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from autospec.runners import Forward, crop_cache, new_cache
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
# n measured per row at batch sizes above ``dense_up_to``: the loop's k + 1 for k ≤ 8, and two
# points to extend the curve
SPARSE_N = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)


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
    # the batch dimension: B → n → median seconds of a forward scoring n tokens in each of B
    # rows (batch 1 is target_s_by_n), and B → the draft's one-token step at batch B
    grid: dict[int, dict[int, float]] = field(default_factory=dict)
    draft_grid: dict[int, float] = field(default_factory=dict)
    grid_note: str = ""  # why the grid stops short of the batch sizes asked for, if it does

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

    def batch_ratios(self, batch: int) -> dict[int, float]:
        """T_t(B, n) / T_t(B, 1) at batch size ``batch``, for the n measured there."""
        row = self.grid.get(batch, {})
        t1 = row.get(1)
        return {n: t / t1 for n, t in row.items()} if t1 else {}

    def memory_bound_batch(self, n: int = 4, ratio: float = MEMORY_BOUND_RATIO) -> int | None:
        """The largest batch size up to which scoring ``n`` tokens per row still costs at
        most ``ratio`` × scoring one (verification ~free): the last B before the first
        measured B where it does not. None if it is not even at the smallest B measured."""
        best = None
        for b in sorted(self.grid):
            r = self.batch_ratios(b).get(n)
            if r is None:
                continue
            if r > ratio:
                break
            best = b
        return best

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(utilisation=self.utilisation, memory_bound_up_to=self.memory_bound_up_to,
                 slope=self.slope, memory_bound_batch=self.memory_bound_batch(),
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


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg
                                              or "can't allocate memory" in msg
                                              or "failed to allocate" in msg)


def _replicate(cache, batch: int):
    """A copy of a one-row cache with that row repeated ``batch`` times."""
    out = copy.deepcopy(cache)
    if batch > 1:
        out.batch_repeat_interleave(batch)
    return out


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _curve(fwd, cache, extra: torch.Tensor, context: int, ns, clock: Clock, repeats: int,
           tick) -> dict[int, float]:
    """Median seconds of scoring n tokens (``extra[:, :n]``, every row) on ``cache``, per n.
    Rounds over every n, so that a burst of machine noise spreads over the curve instead of
    bending one stretch of it."""
    def score(n: int):
        fwd(extra[:, :n], cache, n)
        crop_cache(cache, context)

    score(1)  # warm-up
    times: dict[int, list[float]] = {n: [] for n in ns}
    for _ in range(repeats):
        for n in times:
            times[n].append(_median_time(lambda n=n: score(n), clock, 1))
            tick()
    return {n: statistics.median(ts) for n, ts in times.items()}


def _draft_step(dfwd, dcache, extra: torch.Tensor, context: int, clock: Clock,
                repeats: int) -> float:
    def step():
        dfwd(extra[:, :1], dcache, 1)
        crop_cache(dcache, context)

    step()  # warm-up
    return _median_time(step, clock, repeats)


@torch.inference_mode()
def probe(target, draft=None, *, context: int = 200, max_n: int = 16, repeats: int = 5,
          cache_dir=None, progress=None, batches=(1,), max_seconds: float | None = None,
          dense_up_to: int = 8) -> ProbeResult:
    """Measure the cost grid; ``progress(i, total)`` is called as points complete.

    ``batches``: the batch sizes B to measure (1 is always measured: the bandwidth figures
    and ``target_s_by_n`` are batch 1's). Above ``dense_up_to`` rows only ``SPARSE_N`` (≤
    max_n) is measured. ``max_seconds``: stop adding batch sizes once the next one (estimated
    from the last, scaled by B) would overrun this budget."""
    device = next(target.parameters()).device
    clock = Clock(device)
    vocab = min(target.config.get_text_config().vocab_size, 32000)
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
    extra = torch.randint(0, vocab, (1, max_n), generator=g).to(device)
    sizes = sorted({1, *(int(b) for b in batches)})
    if sizes[0] < 1:
        raise ValueError(f"batch sizes must be positive, got {list(batches)}")

    def ns_at(b: int) -> list[int]:
        if b == 1 or b <= dense_up_to:
            return list(range(1, max_n + 1))
        return [n for n in SPARSE_N if n <= max_n]

    total = sum(len(ns_at(b)) * repeats + (draft is not None) for b in sizes)
    done = 0

    def tick(step: int = 1) -> None:
        nonlocal done
        done += step
        if progress:
            progress(done, total)

    fwd, base = Forward(target), new_cache(target)
    fwd(prompt, base, 1)  # the context, cached once for one row; batches repeat that row
    dfwd = dbase = None
    if draft is not None:
        dfwd, dbase = Forward(draft), new_cache(draft)
        dfwd(prompt, dbase, 1)

    grid: dict[int, dict[int, float]] = {}
    draft_grid: dict[int, float] = {}
    note = ""
    started = time.perf_counter()
    last: tuple[int, float] | None = None  # (B, seconds it took)
    for b in sizes:
        if b > 1 and max_seconds is not None and last is not None:
            spent = time.perf_counter() - started
            estimate = last[1] * b / last[0]
            if spent + estimate > max_seconds:
                note = (f"stopped before B = {b}: ~{estimate:.0f} s more would overrun the "
                        f"{max_seconds:g} s budget")
                log.info("probe: %s", note)
                break
        t0 = time.perf_counter()
        cache = dcache = None
        try:
            cache = base if b == 1 else _replicate(base, b)
            grid[b] = _curve(fwd, cache, extra.expand(b, -1), context, ns_at(b), clock,
                             repeats, tick)
            if draft is not None:
                dcache = dbase if b == 1 else _replicate(dbase, b)
                draft_grid[b] = _draft_step(dfwd, dcache, extra.expand(b, -1), context,
                                            clock, repeats)
                tick()
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            if b == 1 or not _is_oom(exc):
                raise
            grid.pop(b, None)
            note = f"out of memory at B = {b}; the grid stops at B = {max(grid)}"
            log.warning("probe: %s (%s)", note, str(exc).splitlines()[0])
            break
        finally:
            if b > 1:
                del cache, dcache
                _release(device)
        last = (b, time.perf_counter() - t0)

    curve = grid[1]
    draft_s = draft_grid.get(1)
    weights = param_bytes(target)
    kv = kv_bytes_per_token(target) * context
    achieved = (weights + kv) / curve[1]
    peak = raise_peak(device, cache_dir, peak_bandwidth(device, cache_dir), achieved,
                      weights + kv)
    return ProbeResult(
        hardware=hardware_name(device), dtype=str(next(target.parameters()).dtype).split(".")[-1],
        context=context, target_s_by_n=curve, draft_s=draft_s, target_param_bytes=weights,
        kv_bytes=kv, achieved_bytes_per_s=achieved, peak_bytes_per_s=peak,
        threads=torch.get_num_threads(), grid=grid, draft_grid=draft_grid, grid_note=note)
