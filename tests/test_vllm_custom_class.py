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
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import USER_CACHE

ROOT = Path(__file__).resolve().parents[1]
K = 6
TOKENS = 48
START_S = int(os.environ.get("AUTOSPEC_VLLM_START_S", "420"))
CLASS = "autospec.fleet.vllm_proposer.AutospecProposer"
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


def store_packages(vllm_py: Path, into: Path) -> list[str]:
    """Links in ``into`` to the store's packages that vLLM's environment lacks (from this
    interpreter's environment); the names linked."""
    into.mkdir(parents=True, exist_ok=True)
    linked = []
    for name in ("sqlalchemy", "alembic", "mako"):
        there = subprocess.run([str(vllm_py), "-c", f"import {name}"], capture_output=True)
        if there.returncode == 0:
            continue
        module = __import__(name)
        (into / name).symlink_to(Path(module.__file__).parent)
        linked.append(name)
    return linked


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One vLLM server on 127.0.0.1, in its own process group, stopped on exit."""

    def __init__(self, py: Path, model: str, log: Path, spec: dict | None, env: dict):
        self.port = _port()
        args = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
                "--max-model-len", "2048", "--seed", "0"]
        if spec is not None:
            args += ["--speculative-config", json.dumps(spec)]
        cores = os.cpu_count() or 1
        env = dict(os.environ, **env, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_PLUGINS="", VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.log = log
        self.out = open(log, "w")
        self.proc = subprocess.Popen(args, stdout=self.out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM exited while starting:\n{self.tail()}")
            if time.monotonic() - t0 > START_S:
                self.stop()
                raise AssertionError(f"vLLM did not answer in {START_S} s:\n{self.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        self.started_s = time.monotonic() - t0

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def complete(self, model: str, prompt: str, label: str | None = None) -> list[int]:
        body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        if label:
            body["vllm_xargs"] = {"autospec_category": label}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            doc = json.load(r)
        return list(doc["choices"][0]["token_ids"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.out.close()


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
        server = Server(py, target, tmp_path / f"{label}.log", spec, env)
        timings[f"{label} start"] = round(server.started_s)
        try:
            t = time.monotonic()
            out = [server.complete(target, p, lab) for p, lab in prompts]
            with ThreadPoolExecutor(len(prompts)) as pool:  # together: steps at B > 1
                out += list(pool.map(lambda pl: server.complete(target, *pl), prompts))
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
