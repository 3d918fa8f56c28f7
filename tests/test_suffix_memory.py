"""The suffix proposer's memory across requests (``autospec.suffix_memory``): it drafts what one
index of the same outputs drafts, stays within its bound in bytes (as it counts them and as
they are allocated), forgets the least recently used category first and a category's oldest
outputs first, never makes a lookup wait on an insertion, and keeps tenants apart."""

from __future__ import annotations

import random
import threading
import tracemalloc

import pytest
import torch

import autospec
from autospec.suffix import SuffixIndex, SuffixMemory, SuffixSettings

from conftest import tiny

V = 151936  # a real vocabulary: two-token seeds almost never repeat, the most places per token


def _outputs(rng: random.Random, n: int, length: int, vocab: int = V) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


# -- what it drafts ---------------------------------------------------------------------------
@pytest.mark.parametrize("max_requests", [1000, 7])
def test_the_memory_drafts_what_one_index_of_the_same_outputs_drafts(max_requests):
    """Its archive (sorted levels, merged as outputs come) against ``SuffixIndex`` holding the
    same outputs (the oldest dropped past ``max_requests``), on a small vocabulary where seeds
    repeat past the 64 places a lookup reads."""
    rng = random.Random(0)
    s = SuffixSettings(max_depth=8, max_requests=max_requests)
    mem, ref = SuffixMemory(s), SuffixIndex(s)
    for _ in range(150):
        prompt = [rng.randrange(30) for _ in range(10)]
        out = [rng.randrange(30) for _ in range(rng.randint(1, 60))]
        mem.remember("sql", prompt, out)
        ref.add(prompt[-8:] + out, finished=True)
        while len(ref) > max_requests:
            ref.drop_oldest()
        for _ in range(10):
            ctx = [rng.randrange(30) for _ in range(rng.randint(1, 12))]
            k = rng.randint(1, 8)
            assert mem.draft("sql", ctx, k) == ref.draft(ctx, k)
    assert mem.categories()["sql"][0] == min(150, max_requests)


# -- the bound --------------------------------------------------------------------------------
def test_the_bound_holds_over_many_categories_as_counted_and_as_allocated():
    """Outputs of every length (up to past a category's share) over 150 categories: after
    every insertion the memory's own count is within max_bytes, and so is what it had
    allocated at the insertion's peak (tracemalloc sees Python objects and numpy buffers
    alike: the count leaves nothing out)."""
    bound = 2 << 20
    mem = SuffixMemory(SuffixSettings(max_bytes=bound))
    rng = random.Random(1)
    tracemalloc.start()
    try:
        for i in range(400):
            n = 40_000 if i % 60 == 59 else rng.choice([3, 40, 400, 400, 2_000])
            out = [rng.randrange(V) for _ in range(n)]
            held, before = mem.bytes, tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            mem.remember(f"c{rng.randrange(150)}", [1, 2, 3], out)
            peak = tracemalloc.get_traced_memory()[1]
            assert mem.bytes <= bound, i
            assert held + peak - before <= bound, (i, n, held + peak - before)
    finally:
        tracemalloc.stop()
    assert mem.evicted > 0 and mem.skipped == 0
    assert len(mem.categories()) < 150


def _fill(mem: SuffixMemory, name: str, rng: random.Random, n: int = 2000) -> list[int]:
    out = _outputs(rng, 1, n)[0]
    mem.remember(name, [1, 2], out)
    return out


def test_the_least_recently_used_category_is_forgotten_first():
    mem = SuffixMemory(SuffixSettings(max_bytes=1 << 20))
    rng = random.Random(2)
    first = [_fill(mem, f"c{i}", rng) for i in range(6)]
    assert set(mem.categories()) == {f"c{i}" for i in range(6)}
    assert mem.propose("c0", first[0][:5], 4)[0] == first[0][5:9]  # c0 is used: the latest
    forgotten: list[str] = []  # in the order they went
    i = 6
    while len(forgotten) < 3:
        _fill(mem, f"c{i}", rng)
        forgotten += [c for c in (f"c{j}" for j in range(i))
                      if c not in mem.categories() and c not in forgotten]
        i += 1
    assert forgotten[:3] == ["c1", "c2", "c3"] and "c0" in mem.categories()
    assert mem.propose("c1", first[1][:5], 4) == ([], 0)  # forgotten whole


def test_a_category_keeps_its_latest_outputs_within_its_share_of_the_bound():
    """At 1 MiB a category's share holds about three 1000-token outputs: the oldest go."""
    mem = SuffixMemory(SuffixSettings(max_bytes=1 << 20))
    rng = random.Random(3)
    outs = [_fill(mem, "long", rng, 1000) for _ in range(10)]
    outputs, tokens = mem.categories()["long"]
    assert 1 <= outputs < 10 and tokens <= 4 * 1000
    assert mem.evicted == 10 - outputs
    assert mem.propose("long", outs[-1][:5], 4)[0] == outs[-1][5:9]
    assert mem.propose("long", outs[0][:5], 4) == ([], 0)
    # a single output past the share keeps its end
    huge = _outputs(rng, 1, 50_000)[0]
    mem.remember("huge", [1, 2], huge)
    assert mem.categories()["huge"][1] < 50_000
    assert mem.propose("huge", huge[-10:-5], 4)[0] == huge[-5:-1]
    assert mem.bytes <= 1 << 20


def test_bad_bounds_are_refused_with_the_field_named():
    for bad in (0, 1000, True, 2.0**30):
        with pytest.raises(ValueError, match="max_bytes"):
            SuffixSettings(max_bytes=bad)


# -- threads ----------------------------------------------------------------------------------
class _Gate(int):
    """A token id whose conversion waits for the test: an insertion reading it is held
    there, in progress, for as long as the test wants."""

    entered = threading.Event()
    release = threading.Event()

    def __int__(self):
        type(self).entered.set()
        assert type(self).release.wait(30), "the test never released the insertion"
        return int.__int__(self)


def test_lookups_in_its_category_and_another_complete_while_an_output_is_stored():
    mem = SuffixMemory()
    rng = random.Random(4)
    sql, chat = _outputs(rng, 2, 50)
    mem.remember("sql", [1], sql)
    mem.remember("chat", [1], chat)
    _Gate.entered.clear()
    _Gate.release.clear()
    long = _outputs(rng, 1, 5000)[0] + [_Gate(7)] + _outputs(rng, 1, 5000)[0]
    writer = threading.Thread(target=mem.remember, args=("sql", [1], long))
    writer.start()
    try:
        assert _Gate.entered.wait(30), "the insertion never read its tokens"
        seen: dict[str, tuple] = {}

        def look():
            seen["chat"] = mem.propose("chat", chat[:5], 4)
            seen["sql"] = mem.propose("sql", sql[:5], 4)

        reader = threading.Thread(target=look)
        reader.start()
        reader.join(20)  # a lookup waiting on the insertion waits until it is released
        assert not reader.is_alive(), "a lookup waited on an insertion in progress"
        assert writer.is_alive()  # the insertion was still in progress meanwhile
        assert seen == {"chat": (chat[5:9], 5), "sql": (sql[5:9], 5)}
    finally:
        _Gate.release.set()
        writer.join(30)
    assert mem.propose("sql", long[100:105], 4)[0] == long[105:109]  # and then it is there


# -- tenants ----------------------------------------------------------------------------------
def test_a_tenant_drafts_from_its_own_outputs_only():
    mem = SuffixMemory()
    out = _outputs(random.Random(5), 1, 40)[0]
    mem.remember("sql", [1, 2], out, tenant="acme")
    ctx = out[:6]
    assert mem.propose("sql", ctx, 4, tenant="acme")[0] == out[6:10]
    assert mem.propose("sql", ctx, 4, tenant="globex") == ([], 0)
    assert mem.propose("sql", ctx, 4) == ([], 0)  # nor requests without a tenant
    view = mem.tenant("globex")
    assert view.propose("sql", ctx, 4) == ([], 0) and view.categories() == {}
    view.remember("sql", [1, 2], out[:20])
    assert mem.categories("globex") == {"sql": (1, 22)}
    assert mem.categories("acme") == {"sql": (1, 42)} and mem.categories() == {}
    with pytest.raises(ValueError, match="tenant"):
        mem.tenant("  ")


@pytest.fixture(scope="module")
def target():
    return tiny("llama", layers=2, seed=5)


def test_another_tenants_request_cannot_draft_from_an_earlier_output(target):
    """Tenant A's request, then the same prompt again for A (drafted whole from A's output)
    and for B (served as if the memory were empty: its counters are A's first request's)."""
    spec = autospec.Controller(target, None, store=False, policy="suffix:8", tenant="acme")
    ids = torch.randint(4, 90, (1, 13), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, category="tools")
    first = spec.generate(ids, **kw)  # the controller's tenant
    cold = spec.last_stats
    again = spec.generate(ids, tenant="acme", **kw)
    warm = spec.last_stats
    other = spec.generate(ids, tenant="globex", **kw)
    b = spec.last_stats
    assert torch.equal(first, again) and torch.equal(first, other)
    assert warm.proposer("suffix").accepted == warm.proposer("suffix").proposed >= 30
    assert warm.iterations < cold.iterations
    assert (b.iterations, b.proposer("suffix").proposed, b.proposer("suffix").accepted, b.proposer("suffix").blocks) == (
        cold.iterations, cold.proposer("suffix").proposed, cold.proposer("suffix").accepted, cold.proposer("suffix").blocks)
    assert spec.suffix_memory.categories("acme")["tools"][0] == 2
    assert spec.suffix_memory.categories("globex")["tools"][0] == 1


def test_tenant_names_are_checked_like_categories(target):
    with pytest.raises(ValueError, match="tenant"):
        autospec.Controller(target, None, store=False, tenant="")
    spec = autospec.Controller(target, None, store=False, policy="suffix:4")
    ids = torch.randint(4, 90, (1, 5), generator=torch.Generator().manual_seed(0))
    for bad in ("", "a\x00b", 7):
        with pytest.raises(ValueError, match="tenant"):
            spec.generate(ids, max_new_tokens=3, tenant=bad)
