"""The GPU path (needs CUDA; skipped elsewhere): the static cache replayed from CUDA graphs is
exact (greedy fp32 equals generate; bf16 sampling follows the target's distribution), reports
its graph memory, synchronises with the host at most once per iteration, and the telemetry
(CUDA-event timings, NVML figures) works or is absent without error.

Run by scripts/gpu_check.sh. Where pytest is missing (a bare device machine), ``python
tests/test_gpu_path.py`` runs the same functions (they take no fixtures)."""

from __future__ import annotations

import random
import time
import warnings

import torch

import autospec
from autospec.engine.runners import graph_report
from autospec.engine.sampling import SamplingConfig, logits_to_probs, process_logits
from autospec.testing.controlled import controlled_pair, measure_acceptance, qwen2_config

from conftest import noisy_copy, prompt, tiny

try:
    import pytest
except ImportError:  # run as a script on a machine without pytest
    pytest = None
else:
    pytestmark = [pytest.mark.gpu,
                  pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")


def _pair(arch="llama", dtype=torch.float32, vocab=97, sharpen=30.0, noise=0.5):
    target = tiny(arch, vocab=vocab, sharpen=sharpen).to(CUDA, dtype)
    draft = noisy_copy(tiny(arch, vocab=vocab, sharpen=sharpen), noise).to(CUDA, dtype)
    return target, draft


def _ids(length=10, seed=0, vocab=97):
    return prompt(length, seed=seed, vocab=vocab).to(CUDA)


def _graphs(target, draft, **kw):
    return autospec.Controller(target, draft, store=False, static_cache=True, cuda_graphs=True,
                               **kw)


def test_graphs_greedy_fp32_identical_to_generate():
    for arch in ("llama", "qwen2"):
        target, draft = _pair(arch)
        spec = _graphs(target, draft)
        for k in (1, 2, 4, 7):
            for seed in range(3):
                ids = _ids(8 + seed, seed)
                ref = target.generate(ids, do_sample=False, max_new_tokens=40)
                out = spec.generate(ids, do_sample=False, max_new_tokens=40, k=k)
                assert torch.equal(out, ref), (arch, k, seed)
        assert spec.last_stats.path == "static+cuda-graphs"
        assert 0 < spec.last_stats.accepted < spec.last_stats.drafted


def test_graphs_exact_when_k_changes_every_iteration_and_with_early_stopping():
    target, draft = _pair("qwen2")
    rng = random.Random(0)
    for policy in (lambda ctx: rng.randint(0, 8), "costmodel+stop=0.6", "auto"):
        spec = _graphs(target, draft, policy=policy)
        for seed in range(3):
            ids = _ids(9, seed)
            ref = target.generate(ids, do_sample=False, max_new_tokens=50, eos_token_id=None)
            out = spec.generate(ids, do_sample=False, max_new_tokens=50, eos_token_id=None)
            assert torch.equal(out, ref), (policy, seed)


def test_static_cache_without_graphs_on_cuda_is_exact_too():
    target, draft = _pair("llama")
    spec = autospec.Controller(target, draft, store=False, static_cache=True, cuda_graphs=False)
    ids = _ids()
    assert torch.equal(spec.generate(ids, do_sample=False, max_new_tokens=40, k=3),
                       target.generate(ids, do_sample=False, max_new_tokens=40))
    assert spec.last_stats.path == "static"


def test_graph_memory_is_reported_per_size():
    target, draft = _pair("llama")
    spec = _graphs(target, draft)
    spec.generate(_ids(), do_sample=False, max_new_tokens=30, k=4)
    (report,) = graph_report(target)
    assert report["path"] == "static+cuda-graphs" and 5 in report["graphs"]
    sizes = report["graph_bytes"]
    assert all(isinstance(b, int) and b >= 0 for b in sizes.values())
    assert sum(sizes.values()) > 0 and report["kv_bytes"] > 0 and report["capture_s"] > 0


def _count_syncs(fn):
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def test_at_most_one_host_sync_per_iteration():
    target, draft = _pair("llama")
    ids = _ids()
    for static, graphs, sampled in ((True, True, False), (True, True, True),
                                    (True, False, False)):
        spec = autospec.Controller(target, draft, store=False, static_cache=static,
                                   cuda_graphs=graphs)
        kw = dict(max_new_tokens=40, eos_token_id=None, k=4, do_sample=sampled)
        if sampled:
            kw["generator"] = torch.Generator(device=CUDA).manual_seed(0)
        spec.generate(ids, **kw)  # warm-up: captures graphs (which synchronise), first calls
        if sampled:
            kw["generator"] = torch.Generator(device=CUDA).manual_seed(1)
        syncs = _count_syncs(lambda spec=spec, kw=kw: spec.generate(ids, **kw))
        assert syncs <= spec.last_stats.iterations, (static, graphs, sampled, syncs,
                                                     spec.last_stats.iterations)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square against probs (sparse cells pooled); no scipy needed."""
    n = counts.sum().item()
    expected = probs.double().cpu() * n
    keep = expected >= 5
    obs = torch.cat([counts.double()[keep], counts.double()[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(exp) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def test_bf16_sampling_follows_the_target_distribution():
    V, runs = 8, 3000
    target = tiny("llama", vocab=V, sharpen=25.0, seed=3).to(CUDA, torch.bfloat16)
    draft = noisy_copy(tiny("llama", vocab=V, sharpen=25.0, seed=3), 1.0, seed=4).to(
        CUDA, torch.bfloat16)
    ids = prompt(6, seed=1, vocab=V).to(CUDA)
    cfg = SamplingConfig(do_sample=True)
    with torch.no_grad():  # exact joint of the first two tokens, enumerated
        seqs = torch.cat([ids.repeat(V, 1), torch.arange(V, device=CUDA)[:, None]], dim=1)
        probs = logits_to_probs(process_logits(target(seqs).logits[:, -2:].float(), cfg), cfg)
    joint = (probs[0, 0][:, None] * probs[:, 1]).flatten()
    spec = _graphs(target, draft)
    gen = torch.Generator(device=CUDA).manual_seed(7)
    counts = torch.zeros(V * V, dtype=torch.long)
    L = ids.shape[1]
    for _ in range(runs):
        out = spec.generate(ids, max_new_tokens=2, do_sample=True, top_k=0, eos_token_id=None,
                            k=2, generator=gen)
        counts[int(out[0, L]) * V + int(out[0, L + 1])] += 1
    assert spec.last_stats.path == "static+cuda-graphs"
    assert _chi2_pvalue(counts, joint) > 1e-4


def test_controlled_pair_in_bf16_on_the_gpu():
    t_cfg, d_cfg = qwen2_config("tiny"), qwen2_config("tiny", num_hidden_layers=1)
    target, draft, info = controlled_pair(t_cfg, d_cfg, 0.8, dtype=torch.bfloat16, device=CUDA)
    acc = measure_acceptance(target, draft, prompts=4, max_new_tokens=64, k=4,
                             check_generate=True, static_cache=True, cuda_graphs=True)
    assert abs(acc.alpha - info["exact_alpha"]) <= 0.08 and acc.outputs_equal


def test_timings_come_from_cuda_events():
    target, draft = _pair("llama")
    spec = _graphs(target, draft)
    spec.generate(_ids(), do_sample=False, max_new_tokens=30, k=3)
    s = spec.last_stats
    assert s.draft_forwards > 0 and s.draft_s > 0 and s.prefill_s > 0
    assert all(t > 0 for ts in s.target_s_by_n.values() for t in ts)
    assert 4 in s.target_s_by_n


def test_nvml_figures_are_present_or_absent_without_error():
    from autospec.telemetry import NvmlSampler, RequestTelemetry, peak_bandwidth

    peak = peak_bandwidth(CUDA)
    assert peak is None or peak > 1e11  # any CUDA GPU streams > 100 GB/s
    sampler = NvmlSampler(CUDA, interval_s=0.01)
    t0 = time.time()
    x = torch.randn(4096, 4096, device=CUDA)
    for _ in range(50):
        x = x @ x / 64
    torch.cuda.synchronize()
    time.sleep(0.1)
    busy, sm = sampler.window(t0, time.time())
    sampler.close()
    assert (busy is None) == (sm is None) == (not sampler.active)
    target, draft = _pair("llama")
    tele = RequestTelemetry(target, draft)
    spec = _graphs(target, draft)
    spec.generate(_ids(), do_sample=False, max_new_tokens=20, k=3)
    rec = tele.record(spec.last_stats, category="c", policy="p", greedy=True)
    tele.close()
    assert rec.bandwidth_bytes_per_s > 0 and rec.pair.hardware.startswith("cuda: ")
    assert (rec.bandwidth_peak_bytes_per_s is None) == (peak is None)


if __name__ == "__main__":  # the device check's fallback when pytest is not installed
    import sys
    import traceback

    if not torch.cuda.is_available():
        print("no CUDA device: every test skipped")
        sys.exit(0)
    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            t0 = time.perf_counter()
            try:
                fn()
                print(f"PASSED {name} ({time.perf_counter() - t0:.1f} s)")
            except Exception:
                failed += 1
                print(f"FAILED {name}")
                traceback.print_exc()
    print(f"{failed} failed")
    sys.exit(1 if failed else 0)
