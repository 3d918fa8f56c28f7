"""Suffix decoding in the report and the export: section 5 prices it on the requests' suffix
traces, and where it pays ``autospec export --engine vllm`` writes vLLM's ``method: "suffix"``
— accepted by vLLM's own config class (with Arctic Inference in its environment, as
``--build-checker`` builds it); the other engines refuse it with one line naming their nearest
option. Real tiny models, a real SQLite store."""

from __future__ import annotations

import json
import os
import shlex

import pytest
from test_tune_suffix import _logged_store

from autospec.cli import main
from autospec.fleet.export import ExportError, plan_for, render
from autospec.report import build_report
from autospec.report.text import render_text

from conftest import USER_CACHE

REQUIRE = os.environ.get("AUTOSPEC_REQUIRE_ENGINES") == "1"


@pytest.fixture(scope="module")
def suffix_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("suffix") / "t.db"
    store, url = _logged_store(path)
    yield store, url
    store.close()


def _spec(text: str) -> dict:
    line = [ln for ln in text.splitlines() if ln and not ln.startswith("#")][0]
    argv = shlex.split(line)
    return json.loads(argv[argv.index("--speculative-config") + 1])


def test_the_report_prices_suffix_decoding_on_its_traces(suffix_store):
    store, _ = suffix_store
    (w,) = build_report(store).workloads
    pr = w.proposers
    suffix = pr.lookups["suffix"]
    assert suffix.trace_requests == 12 and 0 < suffix.match_rate <= 1
    k, s = suffix.best
    assert pr.pays == "suffix" and s > 1.5 and s > (pr.draft[1] if pr.draft else 1)
    text = render_text(build_report(store))
    assert "suffix decoding pays" in text and "suffix decoding had a draft at" in text


def test_export_writes_vllms_suffix_method_where_it_pays_and_other_engines_refuse(
        suffix_store, tmp_path, capsys):
    store, url = suffix_store
    plan = plan_for(store, category="agent")
    assert plan.proposer == "suffix"
    cfg = _spec(render(plan, "vllm"))
    assert cfg == {"method": "suffix", "num_speculative_tokens": plan.k_at(1),
                   "suffix_decoding_max_tree_depth": 24,
                   "suffix_decoding_max_cached_requests": 1000,
                   "suffix_decoding_max_spec_factor": 1.0,
                   "suffix_decoding_min_token_prob": 0.1}
    assert "which proposer pays (report section 5): suffix decoding" in render(plan, "vllm")
    for engine, name in (("sglang", "SGLang"), ("trtllm", "TensorRT-LLM"),
                         ("llamacpp", "llama.cpp")):
        with pytest.raises(ExportError, match=f"not supported by {name}.*--proposer ngram"):
            render(plan, engine)
    with pytest.raises(SystemExit) as e:
        main(["export", "--db", url, "--engine", "sglang", "--proposer", "suffix"])
    assert e.value.code == 2
    assert "not supported by SGLang" in capsys.readouterr().err
    # asked for the draft model, it is the draft model's
    assert plan_for(store, category="agent", proposer="draft").proposer == "draft"


def test_suffix_needs_its_traces(tmp_path):
    import torch

    import autospec
    from autospec.store import open_store

    from conftest import tiny

    url = f"sqlite:///{tmp_path / 'n.db'}"
    target = tiny("llama", layers=2, seed=5)
    spec = autospec.Controller(target, None, store=url, policy="ngram:2")
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    spec.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, category="c")
    spec.close()
    with open_store(url) as store:
        with pytest.raises(ExportError, match="nothing on suffix decoding .*no trace of it"
                           ) as e:
            plan_for(store, category="c", proposer="suffix")
        # what to export instead: what the pair served with, never a draft model it lacks
        assert str(e.value).endswith("or export --proposer ngram")
        with pytest.raises(ExportError, match="has no draft model.*--proposer ngram"):
            plan_for(store, category="c", proposer="draft")


def test_vllm_accepts_the_suffix_export_and_refuses_a_broken_one(suffix_store, monkeypatch):
    from autospec.fleet.check import check_export
    from autospec.fleet.engines import vllm_has_suffix, vllm_python

    py = vllm_python(USER_CACHE)
    if py is None or not vllm_has_suffix(USER_CACHE):
        msg = (f"no vLLM environment with Arctic Inference (build it: AUTOSPEC_CACHE="
               f"{USER_CACHE} autospec export --engine vllm --build-checker)")
        if REQUIRE:
            pytest.fail("AUTOSPEC_REQUIRE_ENGINES=1 but " + msg)
        pytest.skip(msg)
    store, _ = suffix_store
    text = render(plan_for(store, category="agent"), "vllm")
    if not os.environ.get("AUTOSPEC_VLLM_PYTHON"):  # the environment the cache holds
        monkeypatch.setenv("AUTOSPEC_CACHE", str(USER_CACHE))
    res = check_export(text, "vllm")
    assert res.ok, res
    broken = text.replace('"suffix_decoding_max_spec_factor": 1.0',
                          '"suffix_decoding_max_spec_factor": -1.0')
    assert broken != text
    res = check_export(broken, "vllm")
    assert not res.ok and "suffix_decoding_max_spec_factor" in str(res)
