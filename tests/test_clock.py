"""The clock's events are reused: a request makes as many as one iteration needs.

A stand-in event (it records perf_counter) replaces the CUDA one so the bookkeeping runs on the
CPU; the clock, the loops and their reading of the marks are the real ones."""

from __future__ import annotations

import time

import pytest
import torch

from autospec.engine.timing import Clock

from conftest import noisy_copy, prompt, tiny


class StandInEvent:
    made = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        StandInEvent.made += 1
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:  # milliseconds, as torch.cuda.Event
        return (end.t - self.t) * 1e3


def test_recycled_marks_are_recorded_again():
    clock = Clock(torch.device("cpu"), event=StandInEvent)
    first = [clock.mark() for _ in range(3)]
    assert clock.seconds(first[0], first[2]) >= 0
    clock.recycle(*first, first[0], None)  # a mark handed back twice is kept once
    again = [clock.mark() for _ in range(4)]
    assert {id(e) for e in again[:3]} == {id(e) for e in first}
    assert clock.created == 4


@pytest.mark.parametrize("batch", [1, 2])
def test_a_request_makes_the_events_of_one_iteration(monkeypatch, batch):
    import autospec.engine.batch

    made = []

    def clock(device):
        c = Clock(device, event=StandInEvent)
        made.append(c)
        return c

    monkeypatch.setattr(autospec.engine.batch, "Clock", clock)
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.4), store=False)
    ids = torch.cat([prompt(10, seed=s) for s in range(batch)])
    spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                  eos_token_id=None, k=3)
    st = spec.last_stats
    assert st.iterations >= 10
    (c,) = made
    assert c.created <= 6, (c.created, st.iterations)  # not a few per iteration
    # and the times still arrive where they are used
    assert st.draft_s > 0 and st.draft_forwards > 0
    if batch == 1:
        assert sum(len(v) for v in st.target_s_by_n.values()) == st.iterations - 1
        assert all(t > 0 for v in st.target_s_by_n.values() for t in v)
    else:
        assert all(t > 0 for v in st.target_s_by_bn.values() for t in v)


def test_clock_on_the_cpu_uses_no_events():
    clock = Clock(torch.device("cpu"))
    a, b = clock.mark(), clock.mark()
    assert isinstance(a, float) and clock.seconds(a, b) >= 0 and clock.created == 0
