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
