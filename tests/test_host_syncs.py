"""One host sync per iteration, counted on the CPU.

On a GPU every read of a device value to the host (``tolist``, ``item``, ``bool``, ``numpy``,
``cpu``; ``nonzero`` and other ops whose output shape depends on data) waits for the device,
and every tensor built from Python data (``torch.tensor``) is a blocking host→device copy.
The CPU shows neither as a stall, so they are counted here: Python-level reads and builds by
wrapping the methods (calls pass through unchanged), aten-level ones through torch's
dispatcher (``TorchDispatchMode``: ``_local_scalar_dense`` is what ``item``/``bool`` reach,
plus the data-dependent ops). The marginal count per iteration — the difference between a
56- and a 24-token run of the same request, over the difference in iterations — must be one
read and no build, at batch 1 and 8, for the draft model, prompt lookup and both together,
greedy and sampled.

And CUDA events: a stand-in event that counts as complete only after a read to the host
(as a CUDA event after the stream's sync) refuses ``elapsed_time`` before; the engine's
timings, prompt lookup's included, never ask it early.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autospec

from conftest import noisy_copy, tiny

# aten ops that make the host wait for the device (a read, or an output shape from data)
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2",
               "unique_consecutive", "unique_dim", "repeat_interleave", "bincount",
               "histc", "nonzero_static", "equal"}
READS = ("tolist", "item", "numpy", "cpu", "__bool__")
BUILDS = ("tensor", "as_tensor", "from_numpy", "frombuffer")


class HostCounter(TorchDispatchMode):
    """Counts host reads and tensors built from Python data while active."""

    def __init__(self):
        super().__init__()
        self.reads = self.builds = self.ops = 0
        self.paused = False  # while rows leave the batch (an index copy, once per row)
        self._saved = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNCING_OPS:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in READS:
            self._wrap(torch.Tensor, name, "reads")
        for name in BUILDS:
            self._wrap(torch, name, "builds")
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, orig in self._saved:
            setattr(owner, name, orig)
        return super().__exit__(*exc)

    def _wrap(self, owner, name: str, counter: str):
        orig = getattr(owner, name)

        def counted(*a, **kw):
            if not self.paused:
                setattr(self, counter, getattr(self, counter) + 1)
            return orig(*a, **kw)

        self._saved.append((owner, name, orig))
        setattr(owner, name, counted)


def _repetitive(rows: int, length: int = 24) -> torch.Tensor:
    """Prompts that repeat a phrase (prompt lookup finds matches in them)."""
    out = []
    for r in range(rows):
        phrase = [5 + (7 * r + 3 * j) % 80 for j in range(6)]
        out.append((phrase * (length // 6 + 1))[:length])
    return torch.tensor(out)


def _count(spec, ids, new: int, sampled: bool, monkeypatch):
    """Reads and builds of one request. Rows leaving the batch are not counted: each costs
    one copy of the surviving rows' indices (at most B per request, never per iteration)."""
    from autospec.engine.batch import Batch

    kwargs = dict(do_sample=True, top_k=20) if sampled else dict(do_sample=False)
    gen = torch.Generator().manual_seed(0)
    leave = Batch.leave
    with HostCounter() as c:
        def uncounted(self):
            c.paused = True
            try:
                return leave(self)
            finally:
                c.paused = False

        monkeypatch.setattr(Batch, "leave", uncounted)
        spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                      eos_token_id=None, generator=gen, **kwargs)
    monkeypatch.setattr(Batch, "leave", leave)
    return c, spec.last_stats.iterations


@pytest.fixture(scope="module")
def models():
    target = tiny("llama", sharpen=30.0)
    return target, noisy_copy(target, 0.3)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("policy", ["fixed:3", "ngram:3", "hybrid:3:1"])
@pytest.mark.parametrize("rows", [1, 8])
def test_one_read_and_no_build_per_iteration(models, monkeypatch, rows, policy, sampled):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy=policy)
    ids = _repetitive(rows)
    short, it_short = _count(spec, ids, 24, sampled, monkeypatch)
    long, it_long = _count(spec, ids, 56, sampled, monkeypatch)
    assert not spec.fallbacks
    assert it_long > it_short
    st = spec.last_stats
    drafted = st.drafted + st.proposer("ngram").proposed
    assert drafted > 0  # the proposers under test proposed
    if policy != "fixed:3":
        assert st.proposer("ngram").proposed > 0
    per = it_long - it_short
    assert (long.reads - short.reads) / per == 1.0, (long.reads, short.reads, per)
    assert long.builds - short.builds == 0
    assert long.ops - short.ops == 0


class CompletesOnSync:
    """A CUDA-event stand-in: recorded, it is incomplete until the next read to the host
    (``tolist``), as a CUDA event is until the stream reaches it; ``elapsed_time`` on an
    incomplete one raises, as CUDA's does."""

    pending: list = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.t, self.done = None, True

    def record(self):
        self.t, self.done = time.perf_counter(), False
        CompletesOnSync.pending.append(self)

    def elapsed_time(self, end) -> float:
        if not (self.done and end.done):
            raise RuntimeError("elapsed_time on an event that has not completed")
        return (end.t - self.t) * 1e3


@pytest.mark.parametrize("policy", ["fixed:3", "ngram:3", "hybrid:3:1", "off"])
@pytest.mark.parametrize("rows", [1, 3])
def test_events_are_read_only_after_the_iterations_sync(models, monkeypatch, rows, policy):
    import autospec.engine.batch
    from autospec.engine.timing import Clock

    monkeypatch.setattr(autospec.engine.batch, "Clock",
                        lambda device: Clock(device, event=CompletesOnSync))
    original = torch.Tensor.tolist

    def syncing(self, *a, **kw):  # the sync completes every event recorded before it
        for e in CompletesOnSync.pending:
            e.done = True
        CompletesOnSync.pending.clear()
        return original(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "tolist", syncing)
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy=policy)
    ids = _repetitive(rows)
    spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                  eos_token_id=None, do_sample=False)
    st = spec.last_stats
    assert st.iterations > 3 and not spec.fallbacks
    timings = st.target_s_by_n if rows == 1 else st.target_s_by_bn
    assert timings and all(t > 0 for v in timings.values() for t in v)
