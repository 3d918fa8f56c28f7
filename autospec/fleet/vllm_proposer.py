"""autospec inside a real vLLM: a proposer class for vLLM's ``custom_class`` speculative method.

    python -m vllm.entrypoints.openai.api_server --model M --speculative-config \\
        '{"method": "custom_class", "model": "autospec.fleet.vllm_proposer.AutospecProposer",
          "num_speculative_tokens": 8}'

vLLM (0.32) builds the class with its ``VllmConfig`` and calls ``propose(sampled_token_ids,
num_tokens_no_spec, token_ids_cpu, slot_mappings=None)`` after every step, from the model
runner's one thread: per running request (in the runner's row order, ``input_batch.req_ids``)
the tokens sampled in the step (accepted draft tokens + one), its token count and its token
row. It returns one draft per request, of any length up to ``num_speculative_tokens`` (empty:
no speculation for it this step); vLLM's rejection sampler verifies them, so the output stays
the target's. The CPU runner also calls ``load_model(model)`` (nothing to load here).

What runs here is ``autospec.fleet.vllm_speculator``: prompt lookup and suffix decoding per
request, acceptance learned per category, the engine's own step costs, each request's k every
step. Requests are known by vLLM's request ids, read from the runner that calls ``propose``
(the caller's frame: the call passes none); without it, by their first tokens. A request's
category: its label (``"vllm_xargs": {"autospec_category": "code"}`` in the OpenAI request),
else the store's categoriser on its prompt's tokens, else ``AUTOSPEC_VLLM_CATEGORY``.

Settings (environment of the vLLM process):
    AUTOSPEC_VLLM_STORE       a store URL: each finished request's record, written off the
                              hot path (path "vllm", policy "autospec (vllm)"); unset: none
    AUTOSPEC_VLLM_CATEGORY    the category of unlabelled requests (default "default")
    AUTOSPEC_VLLM_PROPOSERS   "ngram,suffix" (default), "ngram" or "suffix"
    AUTOSPEC_VLLM_MIN_GAIN    the share a step must gain to speculate (default 0.02)
    AUTOSPEC_VLLM_PRIOR_COST  a draft token's share of a step before any is measured (0.05)
    AUTOSPEC_VLLM_STATS       a file: the proposer's counters, acceptance and step costs as
                              JSON, rewritten at most once a second (for tests and people)

Nothing here raises into vLLM: a failure is logged (the first few in full), counted, and the
step gets no drafts.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import time
from typing import Any

from autospec.fleet.vllm_sink import StoreSink
from autospec.fleet.vllm_speculator import PROPOSERS, RequestInfo, Row, Settings, Speculator

log = logging.getLogger(__name__)

__all__ = ["AutospecProposer", "LABEL"]

LABEL = "autospec_category"  # the key of a request's ``vllm_xargs`` that names its category
FULL_TRACEBACKS = 3  # failures logged with their traceback; later ones in one line


class AutospecProposer:
    """vLLM's ``custom_class`` proposer: autospec's lookups, k per request per step."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        env = os.environ
        names = tuple(p.strip() for p in env.get("AUTOSPEC_VLLM_PROPOSERS",
                                                  ",".join(PROPOSERS)).split(",") if p.strip())
        self.settings = Settings(
            k_max=int(spec.num_speculative_tokens), proposers=names,
            min_gain=float(env.get("AUTOSPEC_VLLM_MIN_GAIN", "0.02")),
            prior_slope=float(env.get("AUTOSPEC_VLLM_PRIOR_COST", "0.05")),
            category=env.get("AUTOSPEC_VLLM_CATEGORY") or "default")
        model = vllm_config.model_config
        self.max_model_len = int(model.max_model_len)
        url = env.get("AUTOSPEC_VLLM_STORE") or None
        self.sink = StoreSink(url, target=str(model.model),
                              dtype=str(model.dtype).replace("torch.", ""),
                              at_exit=self._at_exit) if url else None
        self.speculator = Speculator(
            self.settings, on_finish=self.sink.submit if self.sink else None,
            categorize=self.sink.categorize if self.sink else None)
        self.stats_path = env.get("AUTOSPEC_VLLM_STATS") or None
        self._stats_written = 0.0
        self._runner = None
        self.failures = 0
        self._finished_seen = 0
        _log_with_vllm()
        if self.stats_path:
            atexit.register(self._write_stats, force=True)
        log.info("autospec: custom_class proposer (%s, k ≤ %d%s)", ",".join(names),
                 self.settings.k_max, f", store {url}" if url else ", no store")

    def _at_exit(self) -> None:
        """The process exits: the requests still held are recorded."""
        self.speculator.finish_all()

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner hands every drafter the target; lookups need none."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """One draft per running request (``[]``: none), never an exception."""
        try:
            rows = self._rows(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
            out = self.speculator.step(rows, self._finished)
        except Exception as e:  # bad state must not stop generation: no drafts this step
            self.failures += 1
            self.speculator.counters["errors"] += 1
            if self.failures <= FULL_TRACEBACKS:
                log.exception("autospec: propose failed (no drafts this step)")
            else:
                log.warning("autospec: propose failed again (%d in all): %s: %s",
                            self.failures, type(e).__name__, e)
            out = [[] for _ in sampled_token_ids]
        if self.stats_path:
            self._write_stats()
        return out

    # -- what vLLM passes, as rows ------------------------------------------------------------
    def _rows(self, sampled, num_tokens, token_ids) -> list[Row]:
        runner = self._find_runner(len(sampled))
        req_ids = list(runner.input_batch.req_ids) if runner is not None else None
        rows = []
        for i, got in enumerate(sampled):
            n = int(num_tokens[i])
            row = token_ids[i]
            if req_ids is not None:
                key, info = req_ids[i], _info_of(runner, req_ids[i])
            else:  # no request ids: the first tokens name the request
                key, info = ("tokens", tuple(int(t) for t in row[: min(n, 64)])), None
            if n + self.settings.k_max > self.max_model_len:
                got = []  # no room for a draft: as vLLM's own lookup, none
            rows.append(Row(key, list(got), row, n, info))
        return rows

    def _find_runner(self, batch: int):
        """The model runner calling ``propose`` (its frame's ``self``), checked against the
        call: its drafter is this object and its batch holds ``batch`` requests."""
        runner = self._runner
        if runner is None:
            frame = sys._getframe(3)  # propose ← _rows ← _find_runner; 3 = propose's caller
            candidate = frame.f_locals.get("self")
            if getattr(candidate, "drafter", None) is self and hasattr(candidate,
                                                                       "input_batch"):
                runner = self._runner = candidate
                log.info("autospec: requests known by vLLM's request ids")
            else:
                self._runner = False
                log.warning("autospec: vLLM's runner not found: requests known by their "
                            "first tokens")
        if not runner or len(runner.input_batch.req_ids) != batch:
            return None
        return runner

    def _finished(self, key) -> bool:
        """A request gone from the batch is finished unless vLLM still holds it (preempted)."""
        runner = self._runner
        if not runner or not isinstance(key, str):
            return True
        return key not in runner.requests

    def _write_stats(self, force: bool = False) -> None:
        """At most once a second, and whenever a request has finished."""
        now = time.time()
        done = self.speculator.counters["finished"]
        if not force and done == self._finished_seen and now - self._stats_written < 1.0:
            return
        self._finished_seen = done
        self._stats_written = now
        try:
            doc = self.snapshot()
            tmp = f"{self.stats_path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f)
            os.replace(tmp, self.stats_path)
        except Exception as e:  # the stats file is for people; generation goes on
            log.debug("autospec: stats file not written: %s", e)

    def snapshot(self) -> dict[str, Any]:
        """Counters, acceptance per category/proposer/bucket, step costs, the sink's counts."""
        sp = self.speculator
        return {"counters": dict(sp.counters), "acceptance": sp.acceptance.snapshot(),
                "step_costs": sp.costs.table(), "running": len(sp.requests),
                "sink": self.sink.counts() if self.sink else None}


def _log_with_vllm() -> None:
    """autospec's messages go where vLLM's go (vLLM configures its own logger only)."""
    mine, theirs = logging.getLogger("autospec"), logging.getLogger("vllm")
    if not mine.handlers and theirs.handlers:
        for handler in theirs.handlers:
            mine.addHandler(handler)
        mine.setLevel(logging.INFO)
        mine.propagate = False


def _info_of(runner, req_id: str):
    """What the runner knows of a request (called once, when the speculator first sees it)."""
    def info() -> RequestInfo:
        state = runner.requests.get(req_id)
        if state is None:
            return RequestInfo()
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        label = extra.get(LABEL) if isinstance(extra, dict) else None
        temperature = getattr(params, "temperature", None)
        return RequestInfo(prompt_len=getattr(state, "num_prompt_tokens", None),
                           category=str(label) if label else None,
                           greedy=None if temperature is None else temperature == 0,
                           max_tokens=getattr(params, "max_tokens", None))
    return info
