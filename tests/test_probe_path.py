"""The probe times the loop's step through the loop's runner: the path it ran on is in the
result and the store, the static path goes through ``open_runner``'s pooled static runner
(and hands it back), and every timed target step includes logits processing, the token
choice and verification, every draft step processing and the proposal. Tiny models."""

from __future__ import annotations

import pytest
import torch

from autospec import probe as probe_mod
from autospec.costs.stored import stored_costs
from autospec.engine.runners import graph_report
from autospec.engine.sampling import SamplingConfig
from autospec.probe import probe
from autospec.store import add_probe, open_store, queries
from autospec.telemetry import RequestTelemetry

from conftest import noisy_copy, tiny


@pytest.fixture
def models():
    target = tiny("llama", layers=2)
    return target, noisy_copy(target, 0.1)


@pytest.mark.parametrize("options, path", [
    ({}, "eager"),
    ({"static_cache": True, "cuda_graphs": False}, "static"),
    ({"static_cache": True, "cuda_graphs": "emulate"}, "static+emulate"),
])
def test_the_probe_runs_on_the_runner_the_loop_opens_and_names_its_path(models, tmp_path,
                                                                          options, path):
    res = probe(*models, context=12, max_n=3, repeats=1, **options)
    assert res.path == path and res.to_dict()["path"] == path
    assert sorted(res.target_s_by_n) == [1, 2, 3] and res.draft_s > 0
    pooled = graph_report(models[0]) + graph_report(models[1])
    if options:  # the static runners open_runner pools, returned for the next request
        assert [r["path"] for r in pooled] == [path, path]
        from autospec.engine.runners import _RUNNERS

        assert not any(r.busy for m in models for r in _RUNNERS.get(m, []))
    else:
        assert pooled == []
    with open_store(f"sqlite:///{tmp_path / 'p.db'}") as store:
        pair = RequestTelemetry(*models, measure_peak=False).pair
        with store.begin() as s:
            add_probe(s, pair, res.to_dict())
        with store.session() as s:
            pid = queries.pair_id(s, pair)
            assert queries.latest_probe(s, pid).path == path
            c = stored_costs(s, pid, path=path)
            curve, source = c.t_target, c.source
            other = "eager" if path != "eager" else "static"
            assert stored_costs(s, pid, path=other).t_target == {}
    assert source.startswith("probe #") and curve == res.target_s_by_n


def test_a_static_probe_refuses_batch_sizes_the_batched_loop_runs_eagerly(models):
    with pytest.raises(ValueError, match="eager"):
        probe(*models, context=8, max_n=2, repeats=1, batches=(1, 2), static_cache=True)


@pytest.mark.parametrize("sampling", [None, SamplingConfig(do_sample=True, top_k=20,
                                                           top_p=0.9, temperature=0.7)])
def test_every_timed_step_processes_logits_and_verifies_as_the_loop_does(models, monkeypatch,
                                                                         sampling):
    """Each target step: processing, then greedy_verify (greedy) or rejection_sample
    (sampling) on the n − 1 drafts; each draft step: processing and the proposal. Counted on
    the real functions the loop uses (wrapped, not replaced)."""
    calls = {"process": 0, "verify": [], "sample": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            if name == "verify":
                calls["verify"].append(args[-1].shape[1])  # the drafts
            else:
                calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(probe_mod, "process_logits",
                        counting("process", probe_mod.process_logits))
    greedy = sampling is None
    verify = "greedy_verify" if greedy else "rejection_sample"
    monkeypatch.setattr(probe_mod, verify, counting("verify", getattr(probe_mod, verify)))
    monkeypatch.setattr(probe_mod, "sample", counting("sample", probe_mod.sample))
    repeats, max_n = 2, 3
    res = probe(*models, context=8, max_n=max_n, repeats=repeats, sampling=sampling)
    assert res.greedy is greedy
    target_steps = max_n * (repeats + 1)  # one untimed round, then the timed ones
    # one proposal, then one catch-up per size (each proposing from its last token)
    draft_steps = (repeats + 1) * (1 + len(probe_mod.CATCH_UP_SIZES))
    assert calls["process"] == target_steps + draft_steps
    # drafts verified: n − 1 per step scoring n (the loop's k + 1 = n)
    assert sorted(calls["verify"]) == sorted(list(range(max_n)) * (repeats + 1))
    assert calls["sample"] == (0 if greedy else draft_steps)


def test_the_timed_step_is_the_loops_step_on_the_same_logits(models):
    """The probe's verification on a forward's logits gives what the loop's verification
    would: the greedy step accepts the target's own argmax continuation in full."""
    step = probe_mod._Step(SamplingConfig(), models[0].config.vocab_size,
                           torch.tensor([[5, 6, 7]]))
    raw = torch.randn(1, 4, models[0].config.vocab_size)
    own = raw.argmax(-1)[:, :3]
    num, nxt, trace = step.verify(raw, own)
    assert int(num) == 3 and int(nxt) == int(raw[0, 3].argmax()) and bool(trace.all())
