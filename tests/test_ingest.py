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
    said = capsys.readouterr().out
    f = fixture_sums()
    assert f"ingested Qwen/Qwen2.5-7B-Instruct (vllm): 19500 drafts, " \
        f"{f['vllm:spec_decode_num_draft_tokens_total']:.0f} draft tokens" in said
    sm = summary(url, "chat")
    # one proposer row, the model's (the engine's drafter), with counters and no trace: a
    # scrape is no request to replay
    with open_store(url, read_only=True) as st, st.session() as s:
        (row,) = queries.recent_requests(s)
        assert list(queries.traces(s)) == []
    assert set(row.proposers) == {"draft"} and row.proposers["draft"].trace is None
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
    from autospec.report import build_report
    with open_store(url, read_only=True) as st:  # engine traffic only: one source, no own row
        (w,) = build_report(st, category="chat").workloads
    assert [(src.source, src.drafts) for src in w.acceptance.by_source] == [
        ("vllm (ingested)", 19500)]
    assert main(["export", "--db", url, "--engine", "vllm", "--category", "chat"]) == 0
    assert "num_speculative_tokens" in capsys.readouterr().out


def test_a_baseline_scrape_adds_only_the_difference(tmp_path):
    url = f"sqlite:///{tmp_path / 'b.db'}"
    later = tmp_path / "later.txt"
    text = FIXTURE.read_text()
    # the same engines later: engine 0 ran 1000 more drafts of 3 tokens, 1500 of them accepted
    bump = {"drafts_total": 1000, "draft_tokens_total": 3000, "accepted_tokens_total": 1500,
            "0": 700, "1": 500, "2": 300}  # accepted per position

    def grown(m):
        pos = re.search(r'position="(\d)"', m.group(2))
        return (f"vllm:spec_decode_num_{m.group(1)}{m.group(2)} "
                f"{float(m.group(3)) + bump.get(pos.group(1) if pos else m.group(1), 0)}")
    later.write_text(re.sub(r'vllm:spec_decode_num_(\w+)(\{engine="0"[^}]*\}) (\S+)', grown,
                            text))
    assert main(["ingest", "--db", url, "--prometheus", str(later), "--baseline",
                 str(FIXTURE), "--category", "c"]) == 0
    sm = summary(url, "c")
    assert (sm.drafts, sm.drafted, sm.accepted) == (1000, 3000, 1500)
    assert list(sm.accepted_per_position) == [700, 500, 300]


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


def test_the_report_sets_the_engines_acceptance_beside_autospecs_own(tmp_path, capsys):
    """autospec's own requests and a vLLM scrape ingested into the same category and pair:
    the report's acceptance by source gives each one's counters, autospec's as its requests
    summed them, the engine's as the scrape has them."""
    import autospec
    from autospec.report import build_report

    from conftest import noisy_copy, prompt, tiny

    url = f"sqlite:///{tmp_path / 'both.db'}"
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.15), store=url,
                               names=("org/t", "org/d"))
    for seed in range(2):
        spec.generate(prompt(10, seed=seed), max_new_tokens=16, do_sample=False, k=3,
                      category="code", eos_token_id=None)
    spec.close()
    own = summary(url, "code")
    p = own.pair
    with open_store(url, read_only=True) as st:  # nothing ingested yet: no split by source
        (w,) = build_report(st, category="code").workloads
    assert w.acceptance.by_source == []
    assert main(["ingest", "--db", url, "--prometheus", str(FIXTURE), "--category", "code",
                 "--target", p.target, "--draft", p.draft, "--dtype", p.dtype,
                 "--hardware", p.hardware]) == 0
    with open_store(url, read_only=True) as st:
        (w,) = build_report(st, category="code").workloads
    mine, engine = w.acceptance.by_source
    assert (mine.source, mine.records, mine.drafts, mine.drafted, mine.accepted) == (
        "autospec", 2, own.drafts, own.drafted, own.accepted)
    assert mine.accepted_by_position == list(own.accepted_per_position)
    assert mine.drafted_by_position == list(own.drafted_per_position)
    f = fixture_sums()
    assert (engine.source, engine.records, engine.drafts, engine.drafted, engine.accepted) == (
        "vllm (ingested)", 1, f["vllm:spec_decode_num_drafts_total"],
        f["vllm:spec_decode_num_draft_tokens_total"],
        f["vllm:spec_decode_num_accepted_tokens_total"])
    assert engine.accepted_by_position == [
        f[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(3)]
    assert engine.by_position[0] == engine.accepted_by_position[0] / engine.drafts
    capsys.readouterr()
    assert main(["report", "--db", url, "--category", "code"]) == 0
    text = capsys.readouterr().out
    assert "by source (autospec's own requests" in text
    row = [ln for ln in text.splitlines() if ln.startswith("vllm (ingested)")]
    assert len(row) == 1 and f"{engine.alpha:.3f}" in row[0]
    from autospec.report.html import render_html
    with open_store(url, read_only=True) as st:
        html = render_html(build_report(st, category="code"))
    assert "Acceptance by source" in html and "<td>vllm (ingested)</td>" in html


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


# -- hostile scrapes: refused with one line, nothing written ------------------------------------
def _scrape(drafts="2", draft_tokens="10", accepted="3", per_pos=(("0", "2"), ("1", "1"))):
    """A one-engine scrape of model "m", its values as the exposition writes them."""
    lab = 'engine="0",model_name="m"'
    lines = [f"vllm:spec_decode_num_drafts_total{{{lab}}} {drafts}",
             f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {draft_tokens}",
             f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {accepted}"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{p}"}} {v}'
              for p, v in per_pos]
    return "\n".join(lines) + "\n"


def _refused(tmp_path, capsys, text=None, source=None) -> str:
    """Ingest ``text`` (or read ``source``): status 2, one error line, no store written."""
    if source is None:
        source = tmp_path / "scrape.txt"
        source.write_text(text)
    db = tmp_path / "refused.db"
    with pytest.raises(SystemExit) as e:
        main(["ingest", "--db", str(db), "--prometheus", str(source), "--category", "c"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("autospec: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert not db.exists()  # refused before the store was opened
    return err


@pytest.mark.parametrize("position", ["100000000", "2000000", "64", "-1"])
def test_a_position_past_the_stated_maximum_is_refused(tmp_path, capsys, position):
    text = _scrape(draft_tokens="10000000000", per_pos=(("0", "2"), (position, "1")))
    err = _refused(tmp_path, capsys, text)
    assert f"position {position} is outside 0..63" in err and 'position="' in err


def test_a_position_the_scrapes_draft_counters_cannot_reach_is_refused(tmp_path, capsys):
    # 2 drafts, 10 draft tokens: the longest draft had at most 9 tokens (positions 0..8)
    err = _refused(tmp_path, capsys, _scrape(per_pos=(("0", "2"), ("9", "0"))))
    assert "position 9" in err and "10 draft tokens in 2 drafts" in err and "0..8" in err


def test_the_widest_scrape_the_counters_allow_is_ingested(tmp_path):
    per_pos = [(str(p), "1") for p in range(64)]  # 64 positions, each drafted 10 times
    path = tmp_path / "wide.txt"
    path.write_text(_scrape(drafts="10", draft_tokens="640", accepted="64", per_pos=per_pos))
    url = f"sqlite:///{tmp_path / 'w.db'}"
    assert main(["ingest", "--db", url, "--prometheus", str(path), "--category", "c"]) == 0
    assert list(summary(url, "c").accepted_per_position) == [1] * 64


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-3", "1e300"])
@pytest.mark.parametrize("counter", ["drafts", "draft_tokens", "accepted", "per_pos"])
def test_a_counter_that_is_not_a_count_is_refused_by_name(tmp_path, capsys, counter, value):
    kwargs = {"per_pos": (("0", value), ("1", "1"))} if counter == "per_pos" else {counter: value}
    err = _refused(tmp_path, capsys, _scrape(**kwargs))
    name = {"drafts": "num_drafts_total", "draft_tokens": "num_draft_tokens_total",
            "accepted": "num_accepted_tokens_total",
            "per_pos": 'per_pos_total{engine="0",model_name="m",position="0"}'}[counter]
    assert name in err and "a counter is a finite number" in err


def test_an_endless_file_is_refused_past_the_size_limit(tmp_path, capsys):
    from autospec.fleet.ingest import MAX_SCRAPE_BYTES

    err = _refused(tmp_path, capsys, source="/dev/zero")
    assert f"larger than {MAX_SCRAPE_BYTES / 2**20:g} MiB" in err


def test_an_endless_http_body_is_read_no_further_than_the_limit():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from autospec.fleet.ingest import IngestError, read_scrape

    sent = []

    class Endless(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            chunk = b"# more\n" * 4096
            try:
                while len(sent) < 10_000:  # ~280 MB if nobody stopped reading
                    self.wfile.write(chunk)
                    sent.append(len(chunk))
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(IngestError, match="larger than 1 MiB"):
            read_scrape(f"http://127.0.0.1:{server.server_port}/metrics", limit=2**20)
    finally:
        server.shutdown()
        server.server_close()
    assert sum(sent) < 100 * 2**20  # the reader stopped; the server did not send it all


# -- SGLang: counters of verification calls and tokens, no per-position counts -----------------
SGL_FIXTURE = Path(__file__).parent / "fixtures" / "sglang_spec_scrape.txt"


def sglang_sums() -> dict[str, float]:
    """The SGLang fixture's samples summed by name, read with a regex (not the parser)."""
    out: dict[str, float] = {}
    for line in SGL_FIXTURE.read_text().splitlines():
        m = re.match(r"^(sglang:\w+)\{[^}]*\} (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))
    return out


def test_an_sglang_scrape_round_trips_with_per_position_unknown(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 's.db'}"
    assert main(["ingest", "--db", url, "--prometheus", str(SGL_FIXTURE), "--category", "chat",
                 "--hardware", "cuda: NVIDIA H200"]) == 0
    out = capsys.readouterr().out
    assert "(sglang)" in out and "per position unknown" in out
    f = sglang_sums()
    verify, gen = f["sglang:spec_verify_calls_total"], f["sglang:generation_tokens_total"]
    reqs, k = f["sglang:num_requests_total"], f["sglang:spec_num_draft_tokens"] - 1
    sm = summary(url, "chat")
    assert sm.drafts == verify and sm.drafted == verify * k == 180000
    assert sm.accepted == gen - verify - reqs == 84000
    assert sm.new_tokens == gen and sm.prompt_tokens == f["sglang:prompt_tokens_total"]
    # unknown per position, not spread over positions by assumption
    assert sm.accepted_per_position == () and sm.drafted_per_position == ()
    assert sm.acceptance_by_position == ()
    # SGLang's own accept length (tokens per verification) less the prefill's first tokens
    assert sm.mean_accepted_length == pytest.approx((gen - reqs) / verify)
    with open_store(url) as st, st.begin() as s:  # costs for the pair: the report says why no k
        add_probe(s, PairInfo(MODEL, "unknown", "unknown", "cuda: NVIDIA H200"), grid_payload())
    assert main(["report", "--db", url, "--category", "chat"]) == 0
    report = capsys.readouterr().out
    assert "alpha = 0.467" in report and "acceptance by position unknown" in report
    with pytest.raises(SystemExit):  # no k without acceptance by position: said, not guessed
        main(["export", "--db", url, "--engine", "vllm", "--category", "chat"])
    # a category with both engines: per position is vLLM's alone, the totals are both
    assert main(["ingest", "--db", url, "--prometheus", str(FIXTURE), "--category", "both"]) == 0
    assert main(["ingest", "--db", url, "--prometheus", str(SGL_FIXTURE), "--category",
                 "both"]) == 0
    both, v = summary(url, "both"), fixture_sums()
    assert both.drafts == v["vllm:spec_decode_num_drafts_total"] + verify
    assert list(both.drafted_per_position) == [v["vllm:spec_decode_num_drafts_total"]] * 3
    assert list(both.accepted_per_position) == [
        v[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(3)]


def test_an_sglang_baseline_adds_only_the_difference(tmp_path):
    url = f"sqlite:///{tmp_path / 'b.db'}"
    later = tmp_path / "later.txt"
    bump = {"spec_verify_calls_total": 1000, "generation_tokens_total": 1250,  # per sample
            "num_requests_total": 50}
    later.write_text(re.sub(
        r"^(sglang:(\w+)\{[^}]*\}) (\S+)$",
        lambda m: f"{m.group(1)} {float(m.group(3)) + bump.get(m.group(2), 0)}",
        SGL_FIXTURE.read_text(), flags=re.M))
    assert main(["ingest", "--db", url, "--prometheus", str(later), "--baseline",
                 str(SGL_FIXTURE), "--category", "c"]) == 0
    sm = summary(url, "c")
    # 1000 verifications; 2 × 1250 tokens (two is_streaming samples) − 1000 − 2 × 50 requests
    assert (sm.drafts, sm.drafted, sm.accepted) == (1000, 3000, 1400)


def _sglang(gauge="4.0", verify="600.0", gen="1452.0", requests="12.0", extra=""):
    lab = 'model_name="m",engine_type="unified"'
    lines = [f"sglang:spec_verify_calls_total{{{lab}}} {verify}",
             f'sglang:generation_tokens_total{{{lab},is_streaming="false"}} {gen}',
             f'sglang:num_requests_total{{{lab},is_streaming="false"}} {requests}']
    if gauge is not None:
        lines.append(f'sglang:spec_num_draft_tokens{{{lab},tp_rank="0"}} {gauge}')
    return "\n".join(lines) + "\n" + extra


@pytest.mark.parametrize("text, message", [
    (_sglang(gauge=None), "no sglang:spec_num_draft_tokens gauge"),
    (_sglang(gauge="0.0"), "--k"),
    (_sglang(extra='sglang:spec_num_draft_tokens{model_name="m",tp_rank="1"} 6.0\n'),
     "differs between the scrape's samples"),
    (_sglang(gen="5000.0"), "the counters disagree"),  # more accepted than drafted
    (_sglang(gen="100.0"), "the counters disagree"),  # fewer tokens than verifications
    (_sglang(verify="NaN"), "a counter is a finite number"),
    (_sglang(requests="-1"), "a counter is a finite number"),
    ('sglang:spec_verify_calls_total{model_name="m"} 600.0\n'
     'sglang:spec_num_draft_tokens{model_name="m"} 4.0\n', "no sglang:generation_tokens_total"),
    ('sglang:generation_tokens_total{model_name="m"} 600.0\n', "no vllm:spec_decode_num_drafts"),
    ("sglang:spec_verify_calls_total{model_name=m} 1\n", "not a Prometheus text exposition"),
])
def test_a_malformed_sglang_scrape_is_refused(tmp_path, capsys, text, message):
    err = _refused(tmp_path, capsys, text)
    assert message in err, err


def test_sglang_k_from_the_command_line_where_the_scrape_lacks_it(tmp_path, capsys):
    path = tmp_path / "old.txt"
    path.write_text(_sglang(gauge=None))
    url = f"sqlite:///{tmp_path / 'k.db'}"
    assert main(["ingest", "--db", url, "--prometheus", str(path), "--category", "c",
                 "--k", "3"]) == 0
    assert (summary(url, "c").drafted, summary(url, "c").accepted) == (1800, 840)
    path.write_text(_sglang())  # the gauge says k = 3: a --k that disagrees is refused
    with pytest.raises(SystemExit):
        main(["ingest", "--db", url, "--prometheus", str(path), "--category", "c", "--k", "5"])
    assert "--k 5 disagrees" in capsys.readouterr().err


# -- counters that contradict each other, duplicates, fractions, absurd labels ----------------
@pytest.mark.parametrize("kwargs, says", [
    # 500 accepted of 400 draft tokens: 125 %
    (dict(drafts="100", draft_tokens="400", accepted="500",
          per_pos=(("0", "100"), ("1", "100"), ("2", "100"), ("3", "100"), ("4", "100"))),
     "500 accepted tokens of 400 draft tokens"),
    # a position accepted more often than there were drafts
    (dict(accepted="5", per_pos=(("0", "3"), ("1", "2"))),
     "position 0 counts 3 accepted tokens in 2 drafts"),
    # a later position accepted more often than the one before it
    (dict(accepted="3", per_pos=(("0", "1"), ("1", "2"))),
     "more than position 0's 1"),
    # positions that do not sum to the accepted tokens
    (dict(accepted="4", per_pos=(("0", "2"), ("1", "1"))),
     "per position sum to 3, the accepted tokens counter says 4"),
    # fewer draft tokens than drafts
    (dict(drafts="20", draft_tokens="10", accepted="3", per_pos=()), "20 drafts proposed 10"),
], ids=["accepted>drafted", "position>drafts", "increasing", "sum", "drafts>tokens"])
def test_counters_that_contradict_each_other_are_refused(tmp_path, capsys, kwargs, says):
    err = _refused(tmp_path, capsys, _scrape(**kwargs))
    assert "the counters disagree" in err and says in err, err


def test_counters_that_contradict_each_other_after_the_baseline_are_refused(tmp_path, capsys):
    # each scrape agrees with itself; position 1 counts less in the later one
    earlier, later = tmp_path / "earlier.txt", tmp_path / "later.txt"
    earlier.write_text(_scrape(drafts="2", draft_tokens="10", accepted="2",
                               per_pos=(("0", "1"), ("1", "1"))))
    later.write_text(_scrape(drafts="4", draft_tokens="20", accepted="4",
                             per_pos=(("0", "4"), ("1", "0"))))
    with pytest.raises(SystemExit) as e:
        main(["ingest", "--db", str(tmp_path / "x.db"), "--prometheus", str(later),
              "--baseline", str(earlier), "--category", "c"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "position 1 is -1" in err and not (tmp_path / "x.db").exists()


def test_a_series_listed_twice_is_refused_not_summed(tmp_path, capsys):
    text = _scrape() + 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 2\n'
    err = _refused(tmp_path, capsys, text)
    assert 'num_drafts_total{engine="0",model_name="m"} appears twice' in err


def test_a_fractional_count_is_refused_not_rounded(tmp_path, capsys):
    err = _refused(tmp_path, capsys, _scrape(accepted="2.6", per_pos=(("0", "2"), ("1", "1"))))
    assert "has the value 2.6: a count is a whole number" in err


@pytest.mark.parametrize("k", ["999", "0", "65"])
def test_a_k_outside_the_controllers_range_is_refused(tmp_path, capsys, k):
    path = tmp_path / "old.txt"
    path.write_text(_sglang(gauge=None))
    with pytest.raises(SystemExit) as e:
        main(["ingest", "--db", str(tmp_path / "k.db"), "--prometheus", str(path),
              "--category", "c", "--k", k])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--k: must be in 1..64" in err
    assert not (tmp_path / "k.db").exists()


def test_the_largest_k_is_accepted(tmp_path):
    path = tmp_path / "old.txt"
    path.write_text(_sglang(gauge=None))
    url = f"sqlite:///{tmp_path / 'k.db'}"
    assert main(["ingest", "--db", url, "--prometheus", str(path), "--category", "c",
                 "--k", "64"]) == 0
    assert summary(url, "c").drafted == 600 * 64


def test_an_absurd_model_name_is_refused_and_long_names_are_cut_in_what_is_printed(
        tmp_path, capsys):
    from autospec.fleet.ingest import MAX_NAME

    huge = "m" * 100_000
    err = _refused(tmp_path, capsys, _scrape().replace('model_name="m"', f'model_name="{huge}"'))
    assert f"100000 characters long, more than the {MAX_NAME}" in err and len(err) < 400
    # two models, both long: the choice is offered with the names cut short
    two = _scrape() + _scrape().replace('model_name="m"', f'model_name="{huge}"')
    err = _refused(tmp_path, capsys, two)
    assert "choose one with --model" in err and len(err) < 400
    path = tmp_path / "ok.txt"
    path.write_text(_scrape())
    long_category = "c" * 100_000
    assert main(["ingest", "--db", f"sqlite:///{tmp_path / 'ok.db'}", "--prometheus",
                 str(path), "--category", long_category]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ingested m (vllm)") and len(out) < 400


# -- vLLM's own clock: seconds per step with its draft model ----------------------------------
def clocked_scrape(model="m", *, drafts=0, k=5, per_pos=(), decode_s=0.0, decoded=0, steps=0,
                   tokens=0, engines=("0",)) -> str:
    """A vLLM 0.32 scrape as its loggers write it — the generated tokens, the spec-decode
    counters, the request decode-time histogram and the tokens-per-step histogram — with each
    value split evenly over ``engines``."""
    out = []
    accepted = sum(per_pos)
    for e in engines:
        lab, n = f'engine="{e}",model_name="{model}"', len(engines)
        out += [f"vllm:generation_tokens_total{{{lab}}} {tokens / n}",
                f"vllm:spec_decode_num_drafts_total{{{lab}}} {drafts / n}",
                f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {drafts * k / n}",
                f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {accepted / n}"]
        out += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{p}"}} '
                f"{v / n}" for p, v in enumerate(per_pos)]
        out += ["# TYPE vllm:request_decode_time_seconds histogram",
                f'vllm:request_decode_time_seconds_bucket{{{lab},le="+Inf"}} {decoded / n}',
                f"vllm:request_decode_time_seconds_count{{{lab}}} {decoded / n}",
                f"vllm:request_decode_time_seconds_sum{{{lab}}} {decode_s / n}",
                "# TYPE vllm:iteration_tokens_total histogram",
                f'vllm:iteration_tokens_total_bucket{{{lab},le="+Inf"}} {steps / n}',
                f"vllm:iteration_tokens_total_count{{{lab}}} {steps / n}",
                f"vllm:iteration_tokens_total_sum{{{lab}}} {steps * 3 / n}"]
    return "\n".join(out) + "\n"


def ingest_window(tmp_path, url, before: dict, after: dict, *extra) -> None:
    b, a = tmp_path / "before.txt", tmp_path / "after.txt"
    b.write_text(clocked_scrape(**before))
    a.write_text(clocked_scrape(**after))
    assert main(["ingest", "--db", url, "--prometheus", str(a), "--baseline", str(b),
                 "--category", "c", *extra]) == 0


def test_a_window_of_one_request_at_a_time_records_vllms_own_step(tmp_path, capsys):
    """18 requests one at a time at k = 5: 170 drafts in 162 decode steps (180 engine steps
    less 18 prefills) over 40 s of decode time: 0.247 s a step, drafting included, kept as
    the pair's step at n = 6 on path vllm+draft; a second window adds to it."""
    from autospec.fleet.engine_costs import ENGINE_STEP_PATHS, engine_steps

    url = f"sqlite:///{tmp_path / 'w.db'}"
    before = dict(drafts=90, per_pos=(60, 50, 40, 30, 20), decode_s=10.0, decoded=4, steps=100,
                  engines=("0", "1"))
    after = dict(drafts=260, per_pos=(230, 200, 170, 140, 110), decode_s=50.0, decoded=22,
                 steps=280, engines=("0", "1"))
    ingest_window(tmp_path, url, before, after)
    said = capsys.readouterr().out
    assert "vllm's own steps with the draft model at k = 5: 246.9 ms per step over 162 decode " \
           "steps (1.05 drafts per step), for pair #1" in said, said
    with open_store(url, read_only=True) as st, st.session() as s:
        assert engine_steps(s, "vllm", 1) == {6: (pytest.approx(40.0 / 162), 162)}
        assert engine_steps(s, "vllm", 1, min_forwards=163) == {}
        row = queries.path_costs(s, 1)[(1, ENGINE_STEP_PATHS["vllm"])]
        assert row.requests == 1
        assert queries.paths(s, 1) == {}  # the engine's steps serve no category
        (sm,) = queries.category_summaries(s, category="c")
        assert sm.path is None and sm.drafts == 170  # acceptance as before, no costs
    # a window of another server, at k = 3, beside it: its own point
    ingest_window(tmp_path, url, dict(drafts=0, k=3),
                  dict(drafts=200, k=3, per_pos=(150, 100, 50), decode_s=40.0, decoded=20,
                       steps=220))
    with open_store(url, read_only=True) as st, st.session() as s:
        assert engine_steps(s, "vllm", 1) == {4: (pytest.approx(40.0 / 200), 200),
                                              6: (pytest.approx(40.0 / 162), 162)}


@pytest.mark.parametrize("after, why", [
    (dict(drafts=90 + 340, per_pos=(400, 300, 200, 100, 50), decode_s=90.0, decoded=22,
          steps=280),
     "2.10 drafts per decode step: requests ran together"),
    (dict(drafts=90 + 80, per_pos=(60, 50, 40, 30, 20), decode_s=30.0, decoded=22,
          steps=280),
     "0.49 drafts per decode step: steps without a draft"),
    (dict(drafts=90 + 170, per_pos=(60, 50, 40, 30, 20), decode_s=10.0, decoded=4, steps=100),
     "no finished request decoded in the window"),
])
def test_a_window_that_is_not_batch_one_records_no_step(tmp_path, capsys, after, why):
    from autospec.fleet.engine_costs import engine_steps

    url = f"sqlite:///{tmp_path / 'n.db'}"
    before = dict(drafts=90, per_pos=(60, 50, 40, 30, 20), decode_s=10.0, decoded=4, steps=100)
    ingest_window(tmp_path, url, before, after)
    said = capsys.readouterr().out
    assert f"no step time recorded: {why}" in said, said
    with open_store(url, read_only=True) as st, st.session() as s:
        assert engine_steps(s, "vllm", 1, min_forwards=1) == {}


def test_a_scrape_without_a_window_or_a_clock_records_no_step(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    one = tmp_path / "one.txt"
    one.write_text(clocked_scrape(drafts=170, per_pos=(150, 120), decode_s=40.0, decoded=18,
                                  steps=180))
    assert main(["ingest", "--db", url, "--prometheus", str(one), "--category", "c"]) == 0
    assert "no step time recorded: a step time needs a window: pass --baseline" in \
        capsys.readouterr().out
    before, after = tmp_path / "p0.txt", tmp_path / "p1.txt"  # the counters alone: no clock
    before.write_text(_scrape())
    after.write_text(_scrape(drafts="4", draft_tokens="20", accepted="6",
                             per_pos=(("0", "4"), ("1", "2"))))
    assert main(["ingest", "--db", url, "--prometheus", str(after), "--baseline", str(before),
                 "--category", "d"]) == 0
    assert "no step time recorded: the scrape has no vllm:request_decode_time_seconds / " \
           "vllm:iteration_tokens_total (vLLM's own clock)" in capsys.readouterr().out
    from autospec.fleet.engine_costs import engine_steps
    with open_store(url, read_only=True) as st, st.session() as s:
        assert engine_steps(s, "vllm", 1, min_forwards=1) == {}


def test_a_real_vllm_window_records_its_step_by_its_own_clock(tmp_path, capsys):
    """Two scrapes of vLLM 0.32's CPU build around 21 requests served one at a time with a
    draft model at k = 1 (tests/fixtures/vllm_clock_*.txt): the step is the window's decode
    seconds over its decode steps, read by the engine loop test's own patterns."""
    from test_engine_loop import _clock, _counters

    from autospec.fleet.engine_costs import engine_steps

    fixtures = Path(__file__).parent / "fixtures"
    (b_s, b_n, b_steps), (a_s, a_n, a_steps) = (
        _clock((fixtures / f"vllm_clock_{w}.txt").read_text()) for w in ("before", "after"))
    drafts = (_counters((fixtures / "vllm_clock_after.txt").read_text())[0]
              - _counters((fixtures / "vllm_clock_before.txt").read_text())[0])
    steps, seconds = (a_steps - b_steps) - (a_n - b_n), a_s - b_s
    assert steps == drafts == 457  # one draft a decode step
    url = f"sqlite:///{tmp_path / 'r.db'}"
    assert main(["ingest", "--db", url, "--prometheus", str(fixtures / "vllm_clock_after.txt"),
                 "--baseline", str(fixtures / "vllm_clock_before.txt"), "--category", "c",
                 "--draft", "local/Qwen2.5-Coder-0.5B-Instruct-bfloat16"]) == 0
    said = capsys.readouterr().out
    assert f"at k = 1: {seconds / steps * 1e3:.1f} ms per step over {steps} decode steps " \
           "(1.00 drafts per step)" in said, said
    with open_store(url, read_only=True) as st, st.session() as s:
        assert engine_steps(s, "vllm", 1) == {2: (pytest.approx(seconds / steps), steps)}


def test_a_plain_window_records_vllms_plain_step_alone(tmp_path, capsys):
    """A window of a vLLM server without speculation (no spec-decode counters at all): its
    plain step by the same clock (n = 1) on the pair named, no acceptance record; requests
    that shared its steps (more tokens than steps) record none."""
    from autospec.fleet.engine_costs import engine_steps

    def plain(decode_s, decoded, steps, tokens):
        lab = 'engine="0",model_name="m"'
        return "\n".join([
            f"vllm:generation_tokens_total{{{lab}}} {tokens}",
            "# TYPE vllm:request_decode_time_seconds histogram",
            f'vllm:request_decode_time_seconds_bucket{{{lab},le="+Inf"}} {decoded}',
            f"vllm:request_decode_time_seconds_count{{{lab}}} {decoded}",
            f"vllm:request_decode_time_seconds_sum{{{lab}}} {decode_s}",
            "# TYPE vllm:iteration_tokens_total histogram",
            f'vllm:iteration_tokens_total_bucket{{{lab},le="+Inf"}} {steps}',
            f"vllm:iteration_tokens_total_count{{{lab}}} {steps}",
            f"vllm:iteration_tokens_total_sum{{{lab}}} {tokens}"]) + "\n"

    url = f"sqlite:///{tmp_path / 'p.db'}"
    b, a = tmp_path / "b.txt", tmp_path / "a.txt"
    b.write_text(plain(1.0, 1, 30, 30))
    a.write_text(plain(1.0 + 14.0, 1 + 4, 30 + 4 + 196, 30 + 200))  # 196 decode steps
    pair = ["--draft", "d", "--dtype", "bfloat16", "--hardware", "cpu: test"]
    assert main(["ingest", "--db", url, "--prometheus", str(a), "--baseline", str(b),
                 "--category", "c", *pair]) == 0
    said = capsys.readouterr().out
    assert "vllm's own steps plain (no drafts in the window): 71.4 ms per step over 196 " \
           "decode steps (1.00 tokens per step), for pair #1" in said, said
    assert "ingested" not in said
    with open_store(url, read_only=True) as st, st.session() as s:
        assert engine_steps(s, "vllm", 1) == {1: (pytest.approx(14.0 / 196), 196)}
        assert queries.recent_requests(s) == [] and queries.category_summaries(s) == []
        (p,) = queries.pairs(s)
        assert (p.target, p.draft, p.dtype, p.hardware) == ("m", "d", "bfloat16", "cpu: test")
    # two requests at a time: 200 tokens in 100 decode steps
    a.write_text(plain(1.0 + 14.0, 1 + 4, 30 + 4 + 100, 30 + 200))
    with pytest.raises(SystemExit):
        main(["ingest", "--db", url, "--prometheus", str(a), "--baseline", str(b),
              "--category", "c", *pair])
    assert "the window counts no drafts and gives no step time: 1.96 tokens per decode step: " \
           "requests ran together" in capsys.readouterr().err
    with open_store(url, read_only=True) as st, st.session() as s:
        assert engine_steps(s, "vllm", 1) == {1: (pytest.approx(14.0 / 196), 196)}
    # without a window there is nothing to ingest
    with pytest.raises(SystemExit):
        main(["ingest", "--db", url, "--prometheus", str(a), "--category", "c", *pair])
    assert "a plain vLLM server's window, with --baseline, records its step time alone" in \
        capsys.readouterr().err
