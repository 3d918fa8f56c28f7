"""Live Prometheus metrics: scraped over HTTP during and after generation on tiny models, the
vLLM-named counters equal what the store recorded for the same requests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import autospec
from autospec.fleet.metrics import Metrics, start_http_server
from autospec.store import open_store, queries

from conftest import noisy_copy, prompt, tiny


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a real HTTP scrape: (name, sorted labels) → value."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def pick(samples, name: str, **labels) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, lv), v in samples.items()
               if n == name and all(dict(lv).get(k) == str(x) for k, x in labels.items()))


@pytest.fixture
def models():
    target = tiny("qwen2", sharpen=30.0)
    return target, noisy_copy(target, 0.15)


def test_live_counters_equal_the_store_during_and_after_generation(models, tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    metrics = Metrics()
    spec = autospec.Controller(*models, store=url, metrics=metrics,
                               names=("org/target-x", "org/draft-y"))
    exporter = start_http_server(0, metrics=metrics)
    try:
        spec.generate(prompt(10, seed=0), max_new_tokens=20, do_sample=False, k=3,
                      category="code", eos_token_id=None)
        first = spec.last_stats
        mid = scrape(exporter.url)  # between requests: exactly the first one
        lab = dict(category="code", model_name="target-x", pair="target-x/draft-y",
                   proposer="draft")
        assert pick(mid, "vllm:spec_decode_num_drafts_total", **lab) == first.drafts > 0
        assert pick(mid, "vllm:spec_decode_num_accepted_tokens_total", **lab) == first.accepted
        assert pick(mid, "autospec:k_in_force", **lab) == first.k_schedule[-1]

        for seed, (cat, k) in enumerate([("code", 2), ("chat", 0), ("chat", 4)], start=1):
            spec.generate(prompt(10, seed=seed), max_new_tokens=16, do_sample=False, k=k,
                          category=cat, eos_token_id=None)
        # a batched call counts each row
        import torch
        spec.generate(torch.cat([prompt(8, seed=7), prompt(8, seed=8)]), max_new_tokens=12,
                      do_sample=False, k=2, category="chat", eos_token_id=None,
                      attention_mask=torch.ones(2, 8, dtype=torch.long))
        spec.generate(prompt(6), max_new_tokens=4, num_beams=2)  # a fallback
        spec.close()
        after = scrape(exporter.url)
    finally:
        exporter.close()
    assert pick(after, "autospec:fallbacks_total", model_name="target-x") == 1
    with open_store(url, read_only=True) as store, store.session() as s:
        sums = {sm.category: sm for sm in queries.category_summaries(s)}
    assert sums.keys() == {"code", "chat"}
    for cat, sm in sums.items():
        lab = dict(category=cat, pair="target-x/draft-y")
        assert pick(after, "autospec:requests_total", **lab) == sm.requests
        assert pick(after, "vllm:spec_decode_num_drafts_total", **lab) == sm.drafts
        assert pick(after, "vllm:spec_decode_num_draft_tokens_total", **lab) == sm.drafted
        assert pick(after, "vllm:spec_decode_num_accepted_tokens_total", **lab) == sm.accepted
        acc, dra = list(sm.accepted_per_position), list(sm.drafted_per_position)
        for pos in range(max(len(acc), len(dra))):
            a = acc[pos] if pos < len(acc) else 0
            d = dra[pos] if pos < len(dra) else 0
            assert pick(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                        position=pos, **lab) == a
            assert pick(after, "autospec:spec_decode_num_draft_tokens_per_pos_total",
                        position=pos, **lab) == d
        assert pick(after, "autospec:iterations_total", **lab) == sm.iterations
        assert pick(after, "autospec:iterations_speculation_off_total", **lab) == \
            sm.k_counts.get(0, 0)
        assert pick(after, "autospec:generation_tokens_total", **lab) == sm.new_tokens
        assert pick(after, "autospec:request_seconds_total", **lab) == pytest.approx(sm.wall_s)
        assert pick(after, "autospec:speculation_off_share", **lab) == pytest.approx(
            sm.k_counts.get(0, 0) / sm.iterations)
        assert pick(after, "autospec:target_bandwidth_bytes_per_second", **lab) > 0
        assert pick(after, "autospec:tokens_per_second", **lab) > 0


def test_metrics_need_no_store_and_registries_do_not_collide(models):
    a, b = Metrics(), Metrics()  # two exporters in one process: no duplicate-name error
    spec = autospec.Controller(*models, store=False, metrics=a)
    spec.generate(prompt(10), max_new_tokens=8, do_sample=False, k=2, category="x",
                  eos_token_id=None)
    ea, eb = start_http_server(0, metrics=a), start_http_server(0, metrics=b)
    try:
        sa, sb = scrape(ea.url), scrape(eb.url)
    finally:
        ea.close()
        eb.close()
    assert pick(sa, "vllm:spec_decode_num_draft_tokens_total", category="x") == \
        spec.last_stats.drafted > 0
    assert pick(sb, "vllm:spec_decode_num_draft_tokens_total") == 0
    with pytest.raises(ValueError, match="metrics must be"):
        autospec.Controller(*models, store=False, metrics="yes")


def test_multiprocess_mode_sums_every_process(tmp_path):
    """Two processes count under PROMETHEUS_MULTIPROC_DIR; a third serves the sum."""
    worker = textwrap.dedent("""
        import sys
        from autospec.engine.stats import LoopStats, ProposerCounts
        from autospec.fleet.metrics import Metrics
        n = int(sys.argv[1])
        draft = ProposerCounts(blocks=n, proposed=3 * n, accepted=2 * n,
                               accepted_per_position=[n, n], proposed_per_position=[n, n])
        st = LoopStats(model="draft", counts={"draft": draft}, k_schedule=[3] * n,
                       new_tokens=5, wall_s=1.0)
        Metrics().observe(st, category="c", target="t", draft="d")
    """)
    reader = textwrap.dedent("""
        import urllib.request
        from autospec.fleet.metrics import start_http_server
        e = start_http_server(0)
        print(urllib.request.urlopen(e.url, timeout=10).read().decode())
        e.close()
    """)
    env = {**__import__("os").environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for n in (2, 5):
        subprocess.run([sys.executable, "-c", worker, str(n)], env=env, check=True, timeout=120)
    out = subprocess.run([sys.executable, "-c", reader], env=env, check=True, timeout=120,
                         capture_output=True, text=True).stdout
    samples = {}
    for fam in text_string_to_metric_families(out):
        for s in fam.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    assert pick(samples, "vllm:spec_decode_num_drafts_total", category="c") == 7
    assert pick(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=1) == 7


def test_n_gram_blocks_are_counted_under_their_own_proposer_label(models):
    from test_ngram import _repetitive

    m = Metrics()
    spec = autospec.Controller(*models, store=False, metrics=m, policy="hybrid:3:1")
    spec.generate(_repetitive(4), max_new_tokens=24, do_sample=False, category="c",
                  eos_token_id=None)
    st = spec.last_stats
    assert st.proposer("ngram").proposed > 0 and st.drafted > 0
    ep = start_http_server(0, metrics=m)
    try:
        got = scrape(ep.url)
    finally:
        ep.close()
    for proposer, drafted, accepted in (("draft", st.drafted, st.accepted),
                                        ("ngram", st.proposer("ngram").proposed, st.proposer("ngram").accepted)):
        assert pick(got, "vllm:spec_decode_num_draft_tokens_total", category="c",
                    proposer=proposer) == drafted
        assert pick(got, "vllm:spec_decode_num_accepted_tokens_total", category="c",
                    proposer=proposer) == accepted
        assert pick(got, "vllm:spec_decode_num_accepted_tokens_per_pos_total", category="c",
                    proposer=proposer) == accepted
