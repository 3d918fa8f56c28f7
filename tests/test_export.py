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
