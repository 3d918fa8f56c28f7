"""autospec inside a real vLLM (its CPU build): one server with ``"method": "custom_class"``
pointing at ``autospec.fleet.vllm_proposer.AutospecProposer`` on the small random-weight pair,
a few greedy requests (one labelled, one copy-heavy), one at a time and then all at once, and
the same requests to a plain vLLM server: the outputs must be token-identical, and the proposer must have proposed and had
tokens accepted (its stats file, and the store rows it wrote from inside vLLM).

Opt-in like tests/test_engine_loop.py: it starts two vLLM servers, one after the other (a few
minutes, every core), so it runs only with AUTOSPEC_ENGINE_LOOP=1 and the vLLM environment in
the user's cache (``autospec export --engine vllm --build-checker``); AUTOSPEC_REQUIRE_ENGINES=1
turns a missing environment into a failure. vLLM's process imports autospec from this checkout
(PYTHONPATH) and the store's packages (SQLAlchemy, Alembic, Mako), which vLLM's environment
lacks, from autospec's own environment (a directory of links to them)."""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from autospec.testing.vllm import CUSTOM_CLASS as CLASS
from autospec.testing.vllm import Server, store_packages

from conftest import USER_CACHE

ROOT = Path(__file__).resolve().parents[1]
K = 6
TOKENS = 48
START_S = int(os.environ.get("AUTOSPEC_VLLM_START_S", "420"))
opt_in = pytest.mark.skipif(os.environ.get("AUTOSPEC_ENGINE_LOOP") != "1",
                            reason="starts vLLM servers: AUTOSPEC_ENGINE_LOOP=1 runs it")


def _vllm_python() -> Path:
    from autospec.fleet.engines import vllm_python

    py = vllm_python(USER_CACHE)
    if py is None or not Path(py).exists():
        msg = (f"no vLLM environment (build it: AUTOSPEC_CACHE={USER_CACHE} autospec export "
               f"--engine vllm --build-checker)")
        if os.environ.get("AUTOSPEC_REQUIRE_ENGINES") == "1":
            pytest.fail("AUTOSPEC_REQUIRE_ENGINES=1 but " + msg)
        pytest.skip(msg)
    return Path(py)


def _prompts() -> list[tuple[str, str | None]]:
    """(prompt, label): the small pair's prompts (each repeats a stretch), one of them
    labelled, and a copy-heavy one (a passage three times: prompt lookup's case)."""
    from autospec.testing.small_pair import small_prompts

    plain = small_prompts(3, seed=3)
    passage = " ".join(f"w{40 + (7 * i) % 400}" for i in range(40))
    return [(plain[0], "chat"), (plain[1], None), (plain[2], None),
            (" ".join([passage] * 3), "code")]


def _finished(stats: Path) -> int:
    try:
        return json.loads(stats.read_text())["counters"]["finished"]
    except (OSError, ValueError, KeyError):
        return 0


def _rows(db: Path) -> int:
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            return c.execute("select count(*) from requests").fetchone()[0]
    except sqlite3.Error:
        return 0


def _wait_for(done, limit: float = 60.0) -> None:
    t0 = time.monotonic()
    while not done() and time.monotonic() - t0 < limit:
        time.sleep(0.5)


@opt_in
def test_autospec_proposes_inside_vllm_and_the_output_is_vllms_own(tmp_path):
    py = _vllm_python()
    from autospec.testing.small_pair import save_small_pair

    t0 = time.monotonic()
    target, _ = save_small_pair(tmp_path / "pair")
    extra = tmp_path / "site"
    store_packages(py, extra)
    db = tmp_path / "vllm.db"
    stats = tmp_path / "proposer.json"
    prompts = _prompts()
    timings = {}

    def serve(spec, env, label) -> list[list[int]]:
        server = Server(py, target, tmp_path / f"{label}.log", spec, env, start_s=START_S)
        timings[f"{label} start"] = round(server.started_s)
        try:
            t = time.monotonic()
            out = [server.complete(p, TOKENS, lab) for p, lab in prompts]
            with ThreadPoolExecutor(len(prompts)) as pool:  # together: steps at B > 1
                out += list(pool.map(lambda pl: server.complete(pl[0], TOKENS, pl[1]), prompts))
            timings[f"{label} requests"] = round(time.monotonic() - t, 1)
            if spec is not None:  # the proposer's records and stats, written off the hot path
                _wait_for(lambda: _finished(stats) >= len(out) and _rows(db) >= len(out))
            return out
        except Exception:
            sys.stdout.write(server.tail())
            raise
        finally:
            server.stop()

    spec = {"method": "custom_class", "model": CLASS, "num_speculative_tokens": K}
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(extra)]),
           "AUTOSPEC_VLLM_STORE": f"sqlite:///{db}", "AUTOSPEC_VLLM_STATS": str(stats),
           "AUTOSPEC_VLLM_CATEGORY": "vllm-test"}
    mine = serve(spec, env, "autospec")
    log_text = (tmp_path / "autospec.log").read_text(errors="replace")
    assert "Loaded custom proposer class" in log_text
    assert "requests known by vLLM's request ids" in log_text
    assert "propose failed" not in log_text
    plain = serve(None, {}, "plain")
    timings["total"] = round(time.monotonic() - t0)
    sys.stdout.write(f"timings (s): {timings}\n")
    assert all(len(o) == TOKENS for o in plain)
    assert mine == plain  # vLLM's verification keeps the target's greedy output

    doc = json.loads(stats.read_text())
    n = doc["counters"]
    sys.stdout.write(f"proposer: {json.dumps(doc)}\n")
    assert n["drafts"] > 0 and n["draft_tokens"] > 0 and n["accepted_tokens"] > 0
    assert n["errors"] == 0 and n["lost"] == 0

    from autospec.store import open_store, queries

    with open_store(f"sqlite:///{db}", read_only=True) as st, st.session() as s:
        rows = queries.recent_requests(s, limit=100)
    assert len(rows) == 2 * len(prompts), [r.category for r in rows]  # each at its max_tokens
    assert max(r.batch_size for r in rows) > 1
    # steps are timed (only those without a prefill: whether a B > 1 step comes without one
    # depends on how the concurrent requests arrive, so B > 1 timings are not required here)
    assert doc["step_costs"] and all(t > 0 for t in doc["step_costs"].values())
    assert all(r.path == "vllm" and r.policy == "autospec (vllm)" for r in rows)
    cats = {r.category for r in rows}
    assert "chat" in cats and "vllm-test" in cats
    assert sum(p.accepted for r in rows for p in r.proposers.values()) > 0
