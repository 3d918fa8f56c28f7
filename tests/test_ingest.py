"""`autospec ingest`: a captured-style vLLM scrape (tests/fixtures/vllm_spec_scrape.txt) and
autospec's own live scrape round-trip into the store's category statistics."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_report_batch import grid_payload

from autospec.cli import main
from autospec.fleet.metrics import Metrics, start_http_server
from autospec.store import add_probe, open_store, queries
from autospec.store.record import PairInfo

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_spec_scrape.txt"
MODEL = "Qwen/Qwen2.5-7B-Instruct"


def fixture_sums(engines=("0", "1")):
    """What the fixture holds, read with a regex (independently of the parser under test)."""
    out: dict[str, float] = {}
    pat = re.compile(r'^(vllm:\w+)\{engine="(\d)",model_name="[^"]+"(?:,position="(\d)")?\} '
                     r'(\S+)$')
    for line in FIXTURE.read_text().splitlines():
        m = pat.match(line)
        if m and m.group(2) in engines:
            key = m.group(1) + (f"[{m.group(3)}]" if m.group(3) else "")
            out[key] = out.get(key, 0) + float(m.group(4))
    return out


def summary(url, category):
    with open_store(url, read_only=True) as st, st.session() as s:
        (sm,) = queries.category_summaries(s, category=category)
    return sm


def test_a_vllm_scrape_round_trips_into_the_category(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'i.db'}"
    assert main(["ingest", "--db", url, "--prometheus", str(FIXTURE), "--category", "chat",
                 "--hardware", "cuda: NVIDIA H200", "--draft", "Qwen/Qwen2.5-0.5B-Instruct"]) == 0
    assert "ingested Qwen/Qwen2.5-7B-Instruct" in capsys.readouterr().out
    f = fixture_sums()
    sm = summary(url, "chat")
    assert sm.drafts == f["vllm:spec_decode_num_drafts_total"] == 19500
    assert sm.drafted == f["vllm:spec_decode_num_draft_tokens_total"]
    assert sm.accepted == f["vllm:spec_decode_num_accepted_tokens_total"]
    assert list(sm.accepted_per_position) == [
        f[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(3)]
    assert list(sm.drafted_per_position) == [19500] * 3  # vLLM drafts k = 3 every time
    assert sm.new_tokens == f["vllm:generation_tokens_total"]
    assert sm.prompt_tokens == f["vllm:prompt_tokens_total"]
    assert sm.pair.target == MODEL and sm.pair.hardware == "cuda: NVIDIA H200"
    # one engine only, into another category; then a report and an export work on it
    assert main(["ingest", "--db", url, "--prometheus", str(FIXTURE), "--category", "code",
                 "--label", "engine=1", "--hardware", "cuda: NVIDIA H200",
                 "--draft", "Qwen/Qwen2.5-0.5B-Instruct"]) == 0
    assert summary(url, "code").drafts == fixture_sums(("1",))[
        "vllm:spec_decode_num_drafts_total"]
    with open_store(url) as st, st.begin() as s:  # costs measured for the pair: a probe grid
        add_probe(s, PairInfo(MODEL, "Qwen/Qwen2.5-0.5B-Instruct", "unknown",
                              "cuda: NVIDIA H200"), grid_payload())
    capsys.readouterr()
    assert main(["report", "--db", url, "--category", "chat"]) == 0
    assert "chat" in capsys.readouterr().out
    assert main(["export", "--db", url, "--engine", "vllm", "--category", "chat"]) == 0
    assert "num_speculative_tokens" in capsys.readouterr().out


def test_a_baseline_scrape_adds_only_the_difference(tmp_path):
    url = f"sqlite:///{tmp_path / 'b.db'}"
    later = tmp_path / "later.txt"
    text = FIXTURE.read_text()
    # the same engines later: every spec-decode counter of engine 0 grew by 1000 / per pos 10
    later.write_text(re.sub(
        r'(vllm:spec_decode_num_\w+\{engine="0"[^}]*\}) (\S+)',
        lambda m: f"{m.group(1)} {float(m.group(2)) + (10 if 'per_pos' in m.group(1) else 1000)}",
        text))
    assert main(["ingest", "--db", url, "--prometheus", str(later), "--baseline",
                 str(FIXTURE), "--category", "c"]) == 0
    sm = summary(url, "c")
    assert (sm.drafts, sm.drafted, sm.accepted) == (1000, 1000, 1000)
    assert list(sm.accepted_per_position) == [10, 10, 10]


def test_autospecs_own_live_scrape_ingests_to_the_same_counts(tmp_path):
    import autospec

    from conftest import noisy_copy, prompt, tiny

    url = f"sqlite:///{tmp_path / 'own.db'}"
    target = tiny("llama", sharpen=30.0)
    metrics = Metrics()
    spec = autospec.Controller(target, noisy_copy(target, 0.15), store=url, metrics=metrics,
                               names=("org/t", "org/d"))
    for seed in range(3):
        spec.generate(prompt(10, seed=seed), max_new_tokens=16, do_sample=False, k=3,
                      category="code", eos_token_id=None)
    spec.close()
    exp = start_http_server(0, metrics=metrics)
    again = f"sqlite:///{tmp_path / 'again.db'}"
    try:  # straight from the live endpoint's URL
        assert main(["ingest", "--db", again, "--prometheus", exp.url, "--category",
                     "code"]) == 0
    finally:
        exp.close()
    a, b = summary(url, "code"), summary(again, "code")
    assert (a.drafts, a.drafted, a.accepted) == (b.drafts, b.drafted, b.accepted)
    assert list(a.accepted_per_position) == list(b.accepted_per_position)
    assert b.pair.target == "t"  # the exporter's model_name: the short name


@pytest.mark.parametrize("argv, message", [
    (["--prometheus", "/nonexistent.txt", "--category", "c"], "cannot read"),
    (["--prometheus", str(FIXTURE), "--category", "c", "--model", "x"], "no spec-decode"),
    (["--prometheus", str(FIXTURE), "--category", "c", "--label", "engine"], "NAME=VALUE"),
    (["--prometheus", str(FIXTURE), "--category", "c", "--label", "engine=7"], "no vllm:"),
    (["--prometheus", str(FIXTURE)], "--category"),
])
def test_bad_input_is_one_error_line(tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["ingest", "--db", f"sqlite:///{tmp_path / 'x.db'}", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("autospec: error:")
    assert message in err[0]


def test_a_file_that_is_not_a_scrape_is_refused(tmp_path, capsys):
    junk = tmp_path / "junk.txt"
    junk.write_text("<html>not metrics</html>\n")
    with pytest.raises(SystemExit) as e:
        main(["ingest", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--prometheus", str(junk),
              "--category", "c"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("autospec: error:")
