"""scripts/engine_loop.sh end to end on the small pair, with a real vLLM (its CPU build): a
labelled mix of the default prompt set's categories served by autospec, exported (``--k 3``:
the small pair's own costs say speculation does not pay), served by one vLLM server with
exactly the exported setting, each category's scrape difference ingested into that category,
the report with both sources.

The loop itself is opt-in: it starts a vLLM server (minutes, every core), so it runs only with
AUTOSPEC_ENGINE_LOOP=1 and the vLLM environment in the user's cache directory (``autospec export
--engine vllm --build-checker``); AUTOSPEC_REQUIRE_ENGINES=1 then turns a missing environment
into a failure. What it checks is read from the store and the scrapes the script kept, not from
its log: per category one ingested record equal to the scrapes' difference (read here by a
pattern of its own), and the report's acceptance by source with autospec's own requests and
vLLM's counters. The script's own check (``engine_loop.py verify``) and the small pair's
prompts are tested here without vLLM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from itertools import zip_longest
from pathlib import Path

import pytest

from conftest import USER_CACHE

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = int(os.environ.get("AUTOSPEC_ENGINE_LOOP_LIMIT_S", "900"))  # the whole script
CATEGORIES = ("code", "chat", "translation")  # the default prompt set's

FIXTURE = ROOT / "tests" / "fixtures" / "vllm_spec_scrape.txt"
opt_in = pytest.mark.skipif(os.environ.get("AUTOSPEC_ENGINE_LOOP") != "1",
                            reason="starts a vLLM server: AUTOSPEC_ENGINE_LOOP=1 runs it")


def _counters(text: str) -> tuple[int, int, int, list[int]]:
    """(drafts, draft tokens, accepted, accepted per position) summed over the label sets."""
    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(
            rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)$", text, re.M))
    per: dict[int, float] = {}
    for labels, v in re.findall(
            r"^vllm:spec_decode_num_accepted_tokens_per_pos_total{([^}]*)} (\S+)$", text, re.M):
        i = int(re.search(r'position="(\d+)"', labels).group(1))
        per[i] = per.get(i, 0.0) + float(v)
    return (int(total("num_drafts")), int(total("num_draft_tokens")),
            int(total("num_accepted_tokens")),
            [int(per.get(i, 0)) for i in range(max(per, default=-1) + 1)])


def _clock(text: str) -> tuple[float, int, int]:
    """vLLM's clock in a scrape, summed over the label sets: (seconds its finished requests
    spent decoding, those requests, the engine's steps)."""
    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}{{[^}}]*}} (\S+)$", text, re.M))
    return (total("request_decode_time_seconds_sum"),
            int(total("request_decode_time_seconds_count")),
            int(total("iteration_tokens_total_count")))


def _trim(xs) -> list[int]:
    xs = [int(x) for x in xs]
    while xs and xs[-1] == 0:
        xs.pop()
    return xs


def test_the_small_pairs_prompts_keep_the_packaged_prompts_repeats(tmp_path):
    from autospec.bench.run import default_prompts_path, load_prompts
    from autospec.testing.small_pair import VOCAB, small_prompt_of

    text = load_prompts(default_prompts_path())[1].prompt  # code: repeats its words
    words, mapped = text.split(), small_prompt_of(text).split()
    assert len(mapped) == len(words) and small_prompt_of(text) == " ".join(mapped)
    assert all(4 <= int(w[1:]) < VOCAB for w in mapped)
    assert len(set(words)) < len(words)  # the prompt repeats words …
    assert len(set(zip(words, mapped))) == len(set(words))  # … and each maps to one id
    assert len(small_prompt_of("x " * 1000).split()) == 256


def _more(series: str) -> int:
    """What the later scrape adds to one of engine 0's counters."""
    return 7 if "per_pos" in series else 21 if "accepted_tokens" in series else 100


def test_the_scripts_check_compares_the_ingested_record_with_the_scrapes(tmp_path):
    """engine_loop.py verify: equal where `autospec ingest --baseline` recorded the scrapes'
    difference, status 1 and MISMATCH where the record differs from them."""
    from autospec.cli import main

    before = tmp_path / "before.txt"
    before.write_text(FIXTURE.read_text())
    after = tmp_path / "after.txt"
    # engine 0 drafted 100 more, accepted 7 more at each of its 3 positions (21 in all: the
    # counters must agree, or ingest refuses them)
    after.write_text(re.sub(
        r'(vllm:spec_decode_num_\w+\{engine="0"[^}]*\}) (\S+)',
        lambda m: f"{m.group(1)} {float(m.group(2)) + _more(m.group(1))}",
        FIXTURE.read_text()))
    url = f"sqlite:///{tmp_path / 'v.db'}"
    assert main(["ingest", "--db", url, "--prometheus", str(after), "--baseline", str(before),
                 "--category", "code"]) == 0

    def verify(b: Path, a: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "engine_loop.py"),
                               "verify", url, "code", str(b), str(a)],
                              capture_output=True, text=True, timeout=120)
    ok = verify(before, after)
    assert ok.returncode == 0 and "category 'code': equal" in ok.stdout, ok.stderr
    assert "accepted per position [7, 7, 7]" in ok.stdout
    bad = verify(before, before)  # a difference of nothing against the record of 100 drafts
    assert bad.returncode == 1 and "MISMATCH in category 'code'" in bad.stderr


@opt_in
def test_the_loop_closes_on_the_small_pair_with_a_labelled_mix(tmp_path):
    from autospec.fleet.engines import vllm_python

    py = vllm_python(USER_CACHE)
    if py is None or not py.exists():
        msg = (f"no vLLM environment (build it: AUTOSPEC_CACHE={USER_CACHE} autospec export "
               f"--engine vllm --build-checker)")
        if os.environ.get("AUTOSPEC_REQUIRE_ENGINES") == "1":
            pytest.fail("AUTOSPEC_REQUIRE_ENGINES=1 but " + msg)
        pytest.skip(msg)
    work = tmp_path / "loop"
    env = dict(os.environ, AUTOSPEC_CACHE=str(USER_CACHE), AUTOSPEC_LOOP_PAIR="small",
               AUTOSPEC_LOOP_SET="default", AUTOSPEC_LOOP_CATEGORIES=",".join(CATEGORIES),
               AUTOSPEC_LOOP_PER_CATEGORY="2", AUTOSPEC_LOOP_TOKENS="32",
               AUTOSPEC_LOOP_K="3", AUTOSPEC_LOOP_SERVE_S=str(LIMIT_S))
    log = tmp_path / "loop.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "engine_loop.sh"), str(work)],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:  # TERM: the script's trap stops its server
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            rc = None
    text = log.read_text()
    sys.stdout.write(text[-4000:])  # shown where the test fails
    assert rc == 0, f"engine_loop.sh ended with {rc} (None: past {LIMIT_S} s)"
    # the log: the exported setting, the server, every category served and checked
    assert '"method": "draft_model", "num_speculative_tokens": 3' in text
    assert "vLLM up after" in text and "1 distinct setting(s)" in text
    for c in CATEGORIES:
        assert f"vLLM served category '{c}': 2 requests" in text
        assert f"category '{c}': equal" in text
    assert text.count("vllm's own steps with the draft model at k = 3: ") == len(CATEGORIES)

    from autospec.report import build_report
    from autospec.store import open_store, queries

    url = f"sqlite:///{work / 'loop.db'}"
    with open_store(url, read_only=True) as st:
        with st.session() as s:  # the ingested records: counters on the draft model's row
            rows = [r for r in queries.recent_requests(s, limit=10_000)
                    if r.stop_reason == "ingested"]
        assert all(r.model is not None and r.model.name == "draft" for r in rows)
        assert sorted(r.category for r in rows) == sorted(CATEGORIES)  # one each
        for r in rows:
            before, after = (_counters((work / f"{w}-{r.category}.txt").read_text())
                             for w in ("before", "after"))
            pos = [a - b for a, b in zip_longest(after[3], before[3], fillvalue=0)]
            assert (r.drafts, r.drafted, r.accepted) == tuple(
                a - b for a, b in zip(after[:3], before[:3])) and r.drafts > 0, r.category
            assert _trim(r.accepted_per_position) == _trim(pos), r.category
            assert r.policy == "vllm (ingested)" and r.drafted <= 3 * r.drafts  # k = 3
        # vLLM's own steps with the draft model at k = 3, by its clock over each category's
        # window (requests one at a time): the pair's step at n = 4, every window pooled
        seconds = steps = 0
        for c in CATEGORIES:
            (b_s, b_n, b_steps), (a_s, a_n, a_steps) = (
                _clock((work / f"{w}-{c}.txt").read_text()) for w in ("before", "after"))
            assert a_n - b_n == 2 and a_s > b_s, (c, a_n - b_n)  # both requests finished
            seconds += a_s - b_s
            steps += (a_steps - b_steps) - (a_n - b_n)  # less one prefill step a request
        from autospec.fleet.engine_costs import engine_steps
        with st.session() as s:
            (pid,) = {r.pair_id for r in rows}
            got = engine_steps(s, "vllm", pid, min_forwards=1)
        assert got == {4: (pytest.approx(seconds / steps), steps)}, (got, seconds, steps)
        for c in CATEGORIES:  # both sources, side by side
            (w,) = build_report(st, category=c).workloads
            mine, engine = w.acceptance.by_source
            assert mine.source == "autospec" and mine.records == 2 and mine.drafted > 0
            assert engine.source == "vllm (ingested)" and engine.records == 1
            assert 1 <= len(engine.by_position) <= 3 and engine.drafted > 0
    report = (work / "report" / "report.txt").read_text()
    assert report.count("vllm (ingested)") >= len(CATEGORIES)
