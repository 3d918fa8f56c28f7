"""`autospec export --check`: every shape the export writes for vLLM is accepted by vLLM's own
validation (``EngineArgs(…).create_engine_config()`` and the scheduler's
``build_dynamic_sd_schedule_lookup``), run in the vLLM environment autospec builds
(``autospec export --engine vllm --build-checker``); deliberately broken ones are refused with
vLLM's own message. SGLang's exports go through SGLang's own argument parser the same way.

Opt-in: skipped unless the environment exists in the user's cache directory (or
$AUTOSPEC_VLLM_PYTHON names an interpreter with vLLM); AUTOSPEC_REQUIRE_ENGINES=1 (CI) turns the
skip into a failure. No mock: the validator is the engine's code."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
from test_export import export, proposer_store, synthetic  # noqa: F401 (fixtures)

from autospec.cli import main

from conftest import USER_CACHE, tiny_tokenizer

REQUIRE = os.environ.get("AUTOSPEC_REQUIRE_ENGINES") == "1"


def _need(what: str, found) -> None:
    if found:
        return
    msg = (f"no {what} (build it: AUTOSPEC_CACHE={USER_CACHE} autospec export --engine "
           f"{what.split()[0].lower()} --build-checker)")
    if REQUIRE:
        pytest.fail("AUTOSPEC_REQUIRE_ENGINES=1 but " + msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def vllm_py():
    from autospec.fleet.engines import vllm_python

    py = vllm_python(USER_CACHE)
    _need("vLLM environment", py is not None and py.exists())
    return py


@pytest.fixture
def checker_cache(vllm_py, monkeypatch):
    """The CLI's --check finds the environment through the cache directory, as a user's
    would (the tests otherwise run with a throwaway cache)."""
    if not os.environ.get("AUTOSPEC_VLLM_PYTHON"):
        monkeypatch.setenv("AUTOSPEC_CACHE", str(USER_CACHE))


def spec_of(text: str) -> dict:
    line = [ln for ln in text.splitlines() if ln and not ln.startswith("#")][0]
    argv = shlex.split(line)
    return json.loads(argv[argv.index("--speculative-config") + 1])


def save_tiny(root: Path, name: str, vocab: int = 97, layers: int = 2) -> str:
    """A model directory with a tiny Qwen2's config and the tests' tokenizer, no weights."""
    from autospec.testing.controlled import qwen2_config

    path = root / name
    cfg = qwen2_config("tiny", vocab_size=vocab, num_hidden_layers=layers,
                       max_position_embeddings=4096)
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(path)
    tiny_tokenizer(vocab).save_pretrained(path)
    return str(path)


def test_vllm_accepts_every_export_shape_and_refuses_broken_ones(vllm_py, synthetic,  # noqa: F811
                                                                proposer_store, tmp_path):  # noqa: F811
    from autospec.fleet.check import check_vllm, vllm_job

    url, _ = synthetic
    texts = {  # every kind of workload test_export.py builds, as the export writes it
        "draft, cost model's batch-size table": export(url, "vllm", tmp_path, "--source",
                                                        "costmodel"),
        "draft, tuned table to B=64": export(url, "vllm", tmp_path, "--max-batch", "64"),
        "draft, one k (section 5)": export(proposer_store, "vllm", tmp_path, "--category",
                                           "free"),
        "ngram (it pays)": export(proposer_store, "vllm", tmp_path, "--category", "copy",
                                  "--proposer", "ngram"),
        "ngram (asked for)": export(proposer_store, "vllm", tmp_path, "--category", "mixed",
                                    "--proposer", "ngram"),
    }
    specs = {name: spec_of(t) for name, t in texts.items()}
    assert "num_speculative_tokens_per_batch_size" in specs["draft, tuned table to B=64"]
    assert specs["ngram (it pays)"]["method"] == "ngram"
    assert "num_speculative_tokens_per_batch_size" not in specs["draft, one k (section 5)"]
    good = [vllm_job(t) for t in texts.values()]
    # the models for real: local directories with the tiny pair's configs and tokenizer
    target, draft = save_tiny(tmp_path, "target"), save_tiny(tmp_path, "draft", layers=1)
    table = specs["draft, tuned table to B=64"]
    real = vllm_job(texts["draft, tuned table to B=64"],
                    targets={"org/target-7b": target}, drafts={"org/draft-0.5b": draft})
    assert real["target"] == target and real["speculative_config"]["model"] == draft
    # broken, one thing each: vLLM must refuse every one
    ngram = specs["ngram (it pays)"]
    schedule = table["num_speculative_tokens_per_batch_size"]
    broken = {
        "first range not at 1": {**table, "num_speculative_tokens_per_batch_size":
                                 [[2, *schedule[0][1:]], *schedule[1:]]},
        "overlapping ranges": {**table, "num_speculative_tokens_per_batch_size":
                               [[1, 8, 3], [4, 16, 1]]},
        "2-item entry": {**table, "num_speculative_tokens_per_batch_size": [[1, 8], [9, 16, 1]]},
        "k = 0": {**ngram, "num_speculative_tokens": 0},
        "lookup min > max": {**ngram, "prompt_lookup_min": ngram["prompt_lookup_max"] + 1},
        "unknown field": {**ngram, "prompt_lookup_avg": 3},
        "unknown method": {**ngram, "method": "prompt_lookup"},
    }
    jobs = good + [real] + [{"target": None, "speculative_config": c, "max_model_len": 2048}
                            for c in broken.values()]
    # a draft whose vocabulary differs from the target's: the models themselves are checked
    other = save_tiny(tmp_path, "other-vocab", vocab=120)
    jobs.append({"target": target, "speculative_config": {**real["speculative_config"],
                                                          "model": other},
                 "max_model_len": 2048})
    results = check_vllm(jobs, python=vllm_py)
    names = [*texts, "draft, tuned table, real tiny pair", *broken, "draft vocab differs"]
    for name, res in zip(names, results):
        should = name in texts or name == "draft, tuned table, real tiny pair"
        assert res.ok is should, (name, res.message)
        assert "\n" not in res.message
    by = dict(zip(names, results))
    # the expanded schedule is the export's table, read back by vLLM's scheduler code
    dense = by["draft, tuned table, real tiny pair"].details["schedule"]
    for lo, hi, k in schedule:
        assert all(dense[b - 1] == min(k, table["num_speculative_tokens"])
                   for b in range(lo, min(hi, len(dense)) + 1))
    assert "against a stand-in pair" in by["ngram (it pays)"].message
    assert "stand-in" not in by["draft, tuned table, real tiny pair"].message
    # vLLM's own words for each refusal
    assert "must start at 1" in by["first range not at 1"].message
    assert "non-overlapping" in by["overlapping ranges"].message
    assert "num_speculative_tokens_per_batch_size" in by["2-item entry"].message
    assert "num_speculative_tokens" in by["k = 0"].message
    assert "prompt_lookup_min" in by["lookup min > max"].message
    assert "prompt_lookup_avg" in by["unknown field"].message
    assert "method" in by["unknown method"].message
    assert "vocab" in by["draft vocab differs"].message.lower()


def test_the_check_option_runs_vllm_and_refuses_with_its_message(checker_cache, synthetic,  # noqa: F811
                                                                 tmp_path, capsys):
    url, _ = synthetic
    target, draft = save_tiny(tmp_path, "target"), save_tiny(tmp_path, "draft", layers=1)
    out = tmp_path / "vllm.sh"
    assert main(["export", "--db", url, "--engine", "vllm", "--out", str(out), "--check",
                 "--check-target", target, "--check-draft", draft]) == 0
    err = capsys.readouterr().err
    assert "autospec: check: vLLM 0.32.0 accepts the speculative config (draft_model" in err
    assert "stand-in" not in err
    # a draft the target cannot run with: exit 2, one line, vLLM's message
    other = save_tiny(tmp_path, "other", vocab=120)
    with pytest.raises(SystemExit) as e:
        main(["export", "--db", url, "--engine", "vllm", "--out", str(out), "--check",
              "--check-target", target, "--check-draft", other])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("autospec: error: vLLM 0.32.0 refuses")
    assert "vocab" in err[-1].lower()


def test_a_missing_environment_is_one_line_naming_the_build_command(synthetic, tmp_path,  # noqa: F811
                                                                    capsys, monkeypatch):
    url, _ = synthetic
    monkeypatch.delenv("AUTOSPEC_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("AUTOSPEC_CACHE", str(tmp_path / "empty-cache"))
    for engine, message in [("vllm", "autospec export --engine vllm --build-checker"),
                            ("sglang", "autospec export --engine sglang --build-checker"),
                            ("trtllm", "cannot check trtllm here: TensorRT-LLM"),
                            ("llamacpp", "cannot check llamacpp here")]:
        with pytest.raises(SystemExit) as e:
            main(["export", "--db", url, "--engine", engine, "--out",
                  str(tmp_path / "x"), "--check"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and err[-1].startswith("autospec: error:"), err
        assert message in err[-1]


def test_sglang_parser_accepts_the_draft_export_and_judges_the_ngram_one(synthetic,  # noqa: F811
                                                                         proposer_store,  # noqa: F811
                                                                         vllm_py, tmp_path):
    from autospec.fleet.check import _command
    from autospec.fleet.sglang_check import check_sglang, sglang_checker_dir

    _need("SGLang checker", (sglang_checker_dir(USER_CACHE) / ".autospec-ready").is_file())
    url, _ = synthetic
    draft = _command(export(url, "sglang", tmp_path, "--source", "costmodel"))
    ngram = _command(export(proposer_store, "sglang", tmp_path, "--category", "copy"))
    bad = [*draft, "--speculative-num-stepz", "3"]
    results = check_sglang([draft, ngram, bad], cache=USER_CACHE)
    assert [r.ok for r in results] == [True, True, False], [r.message for r in results]
    assert "STANDALONE" in results[0].message and "NGRAM" in results[1].message
    assert "unrecognized arguments: --speculative-num-stepz" in results[2].message


def test_the_loops_small_pair_loads_back_with_its_word_tokenizer(tmp_path):
    """scripts/engine_loop.sh's small pair: saved, loaded as autospec loads any directory, its
    prompts tokenized word by word (a Qwen2 checkpoint would come back with a byte-level
    tokenizer that reads none of them), the draft close to the target but not equal."""
    import torch

    import autospec
    from autospec.testing.small_pair import save_small_pair, small_prompts

    t_dir, d_dir = save_small_pair(tmp_path)
    assert save_small_pair(tmp_path) == (t_dir, d_dir)  # written once
    target, tok = autospec.load_model(t_dir, dtype=torch.float32, progress=False)
    draft, _ = autospec.load_model(d_dir, dtype=torch.float32, progress=False)
    agree = []
    for p in small_prompts(4):
        ids = tok(p, add_special_tokens=False, return_tensors="pt").input_ids
        assert ids.shape[1] == len(p.split()) and tok.decode(ids[0]) == p
        with torch.no_grad():
            agree.append((target(ids).logits.argmax(-1) == draft(ids).logits.argmax(-1))
                         .float().mean().item())
    assert 0.1 < sum(agree) / len(agree) < 0.9  # neither a copy nor unrelated
