"""The static-cache path (autospec.engine.runners) on the CPU: greedy output equals generate's in fp32,
sampled output equals the eager path's under the same generator, and the graph bookkeeping
(lazy capture per size, static buffers, warm-up that must not disturb the cache, reuse across
requests, growth) is exercised through its emulation. Real CUDA graphs: tests/test_gpu_path.py."""

from __future__ import annotations

import logging
import random

import pytest
import torch

import autospec
from autospec.engine.loop import speculative_generate
from autospec.engine.runners import StaticRunner, graph_report, open_runner
from autospec.engine.sampling import SamplingConfig
from autospec.policies import FixedK

from conftest import noisy_copy, prompt, tiny

GRAPHS = [False, "emulate"]


def reference(target, ids, **kw):
    return target.generate(ids, do_sample=False, **kw)


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_static_greedy_identical_to_generate(pair, graphs, k):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False, static_cache=True, cuda_graphs=graphs)
    for seed in range(3):
        ids = prompt(8 + seed, seed=seed)
        out = spec.generate(ids, max_new_tokens=30, do_sample=False, k=k)
        assert torch.equal(out, reference(target, ids, max_new_tokens=30)), (k, seed)
    assert spec.last_stats.path == ("static" if not graphs else "static+emulate")
    assert 0 < spec.last_stats.accepted < spec.last_stats.drafted  # rejections exercised


@pytest.mark.parametrize("graphs", GRAPHS)
def test_static_k_changing_every_iteration_with_eos_and_penalty(pair, graphs):
    target, draft = pair
    rng = random.Random(0)
    spec = autospec.Controller(target, draft, store=False, static_cache=True, cuda_graphs=graphs,
                               policy=lambda ctx: rng.randint(0, 8))
    for seed in range(3):
        ids = prompt(9, seed=seed)
        free = reference(target, ids, max_new_tokens=40, eos_token_id=None)[0, 9:].tolist()
        for kw in (dict(eos_token_id=None), dict(eos_token_id=free[20]),
                   dict(eos_token_id=None, repetition_penalty=1.4, min_new_tokens=5)):
            out = spec.generate(ids, max_new_tokens=40, do_sample=False, **kw)
            assert torch.equal(out, reference(target, ids, max_new_tokens=40, **kw)), (seed, kw)
    assert 0 in spec.last_stats.k_schedule


@pytest.mark.parametrize("graphs", GRAPHS)
def test_static_sampling_matches_the_eager_path_under_one_generator(graphs):
    # fp32 on the CPU: the two paths' logits agree to ~1e-7, so the same uniforms make the
    # same choices (exactness of sampling itself is tests/test_sampled_exact.py's business)
    target = tiny("llama", sharpen=3.0)
    draft = noisy_copy(target, 0.5)
    cfg = SamplingConfig(do_sample=True, temperature=0.9, top_p=0.95, repetition_penalty=1.2)
    for seed in range(6):
        ids = prompt(9, seed=seed)
        outs = [speculative_generate(target, draft, ids, sampling=cfg, policy=FixedK(3),
                                     max_new_tokens=30, generator=torch.Generator().manual_seed(seed),
                                     static_cache=static, cuda_graphs=graphs).sequences
                for static in (False, True)]
        assert torch.equal(*outs), seed


def test_graphs_are_captured_once_per_size_and_reused_across_requests(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False, static_cache=True,
                               cuda_graphs="emulate")
    spec.generate(prompt(10), max_new_tokens=30, do_sample=False, k=4)
    (report,) = graph_report(target)
    assert report["path"] == "static+emulate" and 5 in report["graphs"]
    # sizes are what decoding scores after the prefill: k + 1 (and catch-ups), never the prompt
    assert max(report["graphs"]) <= 5 + 1
    captures = report["captures"]
    for _ in range(2):  # the same sizes again: one runner, its graphs replayed
        spec.generate(prompt(10), max_new_tokens=30, do_sample=False, k=4)
    assert graph_report(target)[0]["captures"] == captures
    assert set(graph_report(target)[0]["graph_bytes"].values()) == {None}  # emulated: no pool


def test_a_longer_request_gets_a_larger_bucket_and_stays_exact(arch):
    target = tiny(arch, sharpen=30.0, max_pos=1024)
    draft = noisy_copy(target, 0.3)
    spec = autospec.Controller(target, draft, store=False, static_cache=True,
                               cuda_graphs="emulate")
    spec.generate(prompt(10), max_new_tokens=20, do_sample=False, k=3)
    assert [r["capacity"] for r in graph_report(target)] == [256]
    ids = prompt(250, seed=4)
    out = spec.generate(ids, max_new_tokens=40, do_sample=False, k=3)
    assert torch.equal(out, reference(target, ids, max_new_tokens=40))
    assert [r["capacity"] for r in graph_report(target)] == [256, 512]


def test_a_short_request_after_a_long_one_does_not_use_its_capacity(arch):
    """Attention spans the static cache's whole capacity: a short request must not inherit a
    long one's (before, capacities only grew)."""
    target = tiny(arch, sharpen=30.0, max_pos=2048)
    long_run = open_runner(target, 700, static=True)
    long_run.release()
    short = open_runner(target, 31, static=True)
    try:
        assert short.capacity == 256 and short is not long_run
    finally:
        short.release()
    assert long_run.capacity == 1024
    again = open_runner(target, 600, static=True)  # the long bucket's runner, reused
    assert again is long_run
    again.release()
    # bounded: a fifth bucket replaces the least recently used free runner
    for need in (1500, 300, 100):
        open_runner(target, need, static=True).release()
    caps = [r["capacity"] for r in graph_report(target)]
    assert len(caps) == 4 and sorted(caps) == [256, 512, 1024, 2048]
    ids = prompt(10)
    spec = autospec.Controller(target, noisy_copy(target, 0.3), store=False, static_cache=True,
                               cuda_graphs="emulate")
    out = spec.generate(ids, max_new_tokens=20, do_sample=False, k=3)
    assert torch.equal(out, reference(target, ids, max_new_tokens=20))


def test_capacity_buckets():
    from autospec.engine.runners import capacity_bucket

    assert [capacity_bucket(n) for n in (1, 256, 257, 600, 1024, 1025)] == \
        [256, 256, 512, 1024, 1024, 2048]
    assert capacity_bucket(600, context=700) == 700  # never past the model's context
    assert capacity_bucket(900, context=700) == 1024  # a request past it: its bucket


@pytest.mark.parametrize("close", ["unwrap", "close"])
def test_static_runners_are_released_on_unwrap_and_close(pair, close):
    import gc
    import weakref

    from autospec.engine.runners import _RUNNERS

    target, draft = pair
    spec = autospec.wrap(target, draft, store=False, static_cache=True, cuda_graphs="emulate")
    target.generate(prompt(10), max_new_tokens=20, do_sample=False, k=3)
    runners = [weakref.ref(r) for m in (target, draft) for r in _RUNNERS.get(m, [])]
    caches = [weakref.ref(r().cache) for r in runners]
    assert len(runners) == 2 and graph_report(target)
    if close == "unwrap":
        autospec.unwrap(target)
    else:
        spec.close()
        autospec.unwrap(target)
    gc.collect()
    assert graph_report(target) == [] and graph_report(draft) == []
    assert all(r() is None for r in runners) and all(c() is None for c in caches)


def test_draft_that_is_the_target_gets_its_own_runner(arch):
    target = tiny(arch, sharpen=30.0)
    spec = autospec.Controller(target, target, store=False, static_cache=True)
    ids = prompt(10)
    out = spec.generate(ids, max_new_tokens=25, do_sample=False, k=4)
    assert torch.equal(out, reference(target, ids, max_new_tokens=25))
    assert spec.last_stats.acceptance == 1.0 and spec.last_stats.path == "static"
    assert len(graph_report(target)) == 2


def test_busy_runners_fall_back_to_eager_for_the_request(pair, caplog):
    target, draft = pair
    held = [open_runner(target, 64, static=True) for _ in range(4)]  # every slot taken
    try:
        spec = autospec.Controller(target, draft, store=False, static_cache=True)
        ids = prompt(10)
        with caplog.at_level(logging.WARNING, logger="autospec.engine.runners"):
            out = spec.generate(ids, max_new_tokens=20, do_sample=False, k=3)
        assert torch.equal(out, reference(target, ids, max_new_tokens=20))
        assert spec.last_stats.path == "eager/static"
        assert "busy" in caplog.text
    finally:
        for r in held:
            r.release()
    spec.generate(prompt(10), max_new_tokens=5, do_sample=False, k=3)
    assert spec.last_stats.path == "static"


def test_a_failing_capture_leaves_the_runner_exact_without_graphs(pair, monkeypatch, caplog):
    # the capture fails after its warm-up forward moved the write position: the runner must
    # restore it, log, and carry on without graphs, still exact
    target, draft = pair

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("autospec.engine.runners._Graph", refuse)
    spec = autospec.Controller(target, draft, store=False, static_cache=True,
                               cuda_graphs="emulate")
    ids = prompt(10)
    with caplog.at_level(logging.WARNING, logger="autospec.engine.runners"):
        out = spec.generate(ids, max_new_tokens=30, do_sample=False, k=4)
    assert "failed" in caplog.text
    assert torch.equal(out, reference(target, ids, max_new_tokens=30))
    assert graph_report(target)[0]["graphs"] == [] and graph_report(target)[0]["path"] == "static"


def test_capture_warmup_restores_the_write_position(pair):
    target, _ = pair
    runner = StaticRunner(target, 64, graphs="emulate")
    ids = prompt(12)
    with torch.inference_mode():
        runner.run(ids[:, :10], 1)
        a = runner.run(ids[:, 10:12], 2).clone()  # captures the 2-token graph, then replays it
        runner.crop(10)
        b = runner.run(ids[:, 10:12], 2).clone()  # replay only
        ref = target(ids).logits[:, 10:12]
    assert runner.length == 12 and int(runner.lens[0]) == 12
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)


def test_crop_only_moves_the_write_position(pair):
    target, _ = pair
    runner = StaticRunner(target, 64)
    ids = prompt(20)
    with torch.inference_mode():
        runner.run(ids, 1)
        runner.crop(12)  # positions 12…19 are now stale: masked, then overwritten
        other = torch.tensor([[5, 6, 7]])
        got = runner.run(other, 3)
        ref = target(torch.cat([ids[:, :12], other], dim=1)).logits[:, -3:]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_cuda_graphs_required_on_a_cpu_is_an_error(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="CUDA"):
        autospec.Controller(target, draft, store=False, static_cache=True, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        autospec.Controller(target, draft, store=False, cuda_graphs="sometimes")
    with pytest.raises(ValueError, match="static_cache=True"):
        autospec.Controller(target, draft, store=False, cuda_graphs=True)


def test_unsupported_attention_falls_back_to_eager(pair, monkeypatch, caplog):
    target, draft = pair
    monkeypatch.setattr(type(target.config), "_attn_implementation",
                        property(lambda self: "flex_attention"))
    with caplog.at_level(logging.WARNING, logger="autospec.engine.runners"):
        runner = open_runner(target, 64, static=True)
    assert runner.path == "eager" and "flex_attention" in caplog.text


def test_static_forwards_never_read_device_values(pair, monkeypatch):
    # on a GPU a host read (.item(), bool(), .tolist() …) is a sync and breaks graph capture:
    # the static path's forwards and crops must do none, prefill included
    target, _ = pair
    runner = StaticRunner(target, 64, graphs="emulate")
    ids = prompt(16)

    def host_read(*args, **kwargs):
        raise AssertionError("a forward read a tensor's value on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    with torch.inference_mode():
        runner.run(ids[:, :10], 1)
        for n in (1, 2, 3):  # captures (emulated), then replays
            runner.run(ids[:, 10 : 10 + n], n)
            runner.crop(10)
            runner.run(ids[:, 10 : 10 + n], n)
            runner.crop(10)
    monkeypatch.undo()
    assert runner.length == 10 and sorted(runner.graphs) == [1, 2, 3]


@pytest.mark.parametrize("static,sampled", [(True, False), (True, True), (False, False)])
def test_one_host_read_per_iteration(pair, monkeypatch, static, sampled):
    # the CPU stand-in for tests/test_gpu_path.py's sync count: Python-level reads of tensor
    # values (each one a sync on a GPU) number at most one per iteration
    target, draft = pair
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            reads.append(1)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    gen = torch.Generator().manual_seed(0) if sampled else None
    res = speculative_generate(target, draft, prompt(10), policy=FixedK(4), max_new_tokens=30,
                               sampling=SamplingConfig(do_sample=sampled), generator=gen,
                               static_cache=static, cuda_graphs="emulate")
    monkeypatch.undo()
    assert 0 < len(reads) <= res.stats.iterations
