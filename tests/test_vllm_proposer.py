"""autospec's ``custom_class`` proposer for vLLM, without vLLM: token rows fed as vLLM's model
runner hands them (``sampled_token_ids`` per row, ``num_tokens_no_spec``, ``token_ids_cpu``),
the tokens "vLLM" samples coming from a deterministic target sequence per request, so a draft's
acceptance is what greedy verification would give. Checks the drafts, the acceptance counted
from what comes back, k = 0 where the step costs say nothing pays, the store's records, and
that bad state gives empty drafts instead of an exception. The real-vLLM test is
tests/test_vllm_custom_class.py."""

from __future__ import annotations

import types

import numpy as np
import pytest

from autospec.fleet.vllm_choice import Acceptance, allocate
from autospec.fleet.vllm_costs import StepCosts
from autospec.fleet.vllm_proposer import AutospecProposer
from autospec.fleet.vllm_sink import PATH, POLICY, StoreSink
from autospec.fleet.vllm_speculator import RequestInfo, Row, Settings, Speculator

MAX_LEN = 512


class FakeClock:
    """The seconds vLLM's step takes, as a function of the batch and the draft tokens sent."""

    def __init__(self, plain: float = 0.1, per_token: float = 0.001):
        self.t, self.plain, self.per_token = 0.0, plain, per_token

    def __call__(self) -> float:
        return self.t

    def run_step(self, batch: int, drafted: int) -> None:
        self.t += self.plain * batch ** 0.1 + self.per_token * drafted


class Engine:
    """vLLM's side of the contract: rows of requests whose output is a fixed sequence each
    (what a greedy target would emit), verification of drafts against it, the arrays the
    runner passes. ``step`` returns the drafts of the call and what was accepted."""

    def __init__(self, proposer, clock: FakeClock | None = None):
        self.proposer = proposer  # a Speculator (bookkeeping) or AutospecProposer (vLLM's API)
        self.clock = clock
        self.rows: list[dict] = []  # id, prompt, target (its whole output), out, drafts
        self.token_ids = np.zeros((16, MAX_LEN), dtype=np.int32)

    def add(self, req_id: str, prompt: list[int], target: list[int], label=None):
        self.rows.append({"id": req_id, "prompt": prompt, "target": target, "out": [],
                          "draft": [], "label": label, "new": True})

    def _sync(self) -> None:
        for i, r in enumerate(self.rows):
            toks = r["prompt"] + r["out"]
            self.token_ids[i, : len(toks)] = toks
            self.token_ids[i, len(toks):] = 0

    def step(self) -> list[list[int]]:
        """One engine step (prefill of new rows, verification of drafts) then propose."""
        sampled: list[list[int]] = []
        drafted = sum(len(r["draft"]) for r in self.rows)
        for r in self.rows:
            pos = len(r["out"])
            if r["new"]:
                got = [r["target"][0]]
                r["new"] = False
            else:
                ok = 0
                for j, t in enumerate(r["draft"]):
                    if pos + j < len(r["target"]) and r["target"][pos + j] == t:
                        ok += 1
                    else:
                        break
                got = r["target"][pos: pos + ok + 1]
            r["out"] += got
            sampled.append(got)
        if self.clock is not None:
            self.clock.run_step(len(self.rows), drafted)
        self._sync()
        n = np.array([len(r["prompt"]) + len(r["out"]) for r in self.rows], dtype=np.int32)
        if isinstance(self.proposer, Speculator):
            rows = [Row(r["id"], s, self.token_ids[i], int(n[i]),
                        _info(r)) for i, (r, s) in enumerate(zip(self.rows, sampled))]
            drafts = self.proposer.step(rows, lambda key: True)
        else:
            drafts = self.proposer.propose(sampled, n, self.token_ids[: len(self.rows)])
        for r, d in zip(self.rows, drafts):
            assert len(d) <= 8
            r["draft"] = list(d)
        self.rows = [r for r in self.rows if len(r["out"]) < len(r["target"])]
        return drafts


def _info(r):
    return lambda: RequestInfo(prompt_len=len(r["prompt"]), category=r["label"], greedy=True,
                               max_tokens=len(r["target"]))


def copy_request(seed: int, length: int = 60) -> tuple[list[int], list[int]]:
    """A prompt holding a passage and an output that copies it: prompt lookup's case."""
    rng = np.random.default_rng(seed)
    passage = [int(t) for t in rng.integers(100, 5000, size=length)]
    return [1, 2, 3] + passage + [7, 8], passage


def novel_request(seed: int, length: int = 40) -> tuple[list[int], list[int]]:
    """Output that shares nothing with the prompt or itself: nothing to look up."""
    rng = np.random.default_rng(seed)
    toks = [int(t) for t in rng.permutation(np.arange(10_000, 20_000))[: 20 + length]]
    return toks[:20], toks[20:]


def test_a_copy_gets_drafts_from_its_prompt_and_they_are_accepted():
    sp = Speculator(Settings(k_max=8), clock=FakeClock())
    eng = Engine(sp, sp.clock)
    prompt, target = copy_request(0)
    eng.add("r0", prompt, target, label="code")
    drafts = [eng.step() for _ in range(12)]
    sent = [d[0] for d in drafts if d and d[0]]
    assert sent, "prompt lookup proposed nothing on a copy"
    n = sp.counters
    assert n["drafts"] > 0 and n["accepted_tokens"] > 0
    assert n["lost"] == 0
    req = sp.requests.get("r0")
    if req is not None:
        assert req.counts["ngram"].accepted > 0
        assert req.category == "code" and req.category_source == "given"
    curve = sp.acceptance.curve("code", "ngram", 14)
    assert curve[0] > 0.8  # a copy's continuation is accepted


def test_acceptance_counts_what_vllm_accepted_of_the_draft_sent():
    """Two rows, one copying (all accepted), one where the lookup's draft is wrong after its
    first token: the counts say so per position."""
    sp = Speculator(Settings(k_max=4, proposers=("ngram",)), clock=FakeClock())
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    # after "7" the prompt continues 8 9 10; this output continues 8 then departs
    rows = [Row("a", [7], prompt + [7], 9, lambda: RequestInfo(prompt_len=8))]
    (d,) = sp.step(rows)
    assert d[:2] == [8, 9]  # the prompt's continuation of 7
    k = len(d)
    # vLLM verified it: accepted "8" only, then sampled 99 instead of 9
    rows = [Row("a", [8, 99], prompt + [7, 8, 99], 11)]
    sp.step(rows)
    req = sp.requests["a"]
    c = req.counts["ngram"]
    assert (c.blocks, c.proposed, c.accepted) == (1, k, 1)
    assert c.proposed_per_position == [1] * k and c.accepted_per_position == [1]
    assert req.k_schedule[-1] == k and req.accepted_schedule[-1] == 1
    acc, reached = sp.acceptance.counts[("default", "ngram", -1)]
    assert reached[:3] == [1, 1, 0] and acc[:2] == [1, 0]


def test_a_row_that_does_not_continue_its_request_resets_it_and_counts_nothing():
    sp = Speculator(Settings(k_max=4, proposers=("ngram",)), clock=FakeClock())
    prompt = [5, 6, 7, 8, 9, 10]
    sp.step([Row("a", [7], prompt + [7], 7, lambda: RequestInfo(prompt_len=6))])
    # the same key now holds other tokens (vLLM reused a row we misread): no count, no raise
    sp.step([Row("a", [1, 2], [9, 9, 9, 9, 1, 2], 6)])
    assert sp.counters["lost"] == 1
    assert sp.requests["a"].counts["ngram"].blocks == 0


def test_nothing_to_look_up_means_no_speculation():
    sp = Speculator(Settings(k_max=8), clock=FakeClock())
    eng = Engine(sp, sp.clock)
    prompt, target = novel_request(1)
    eng.add("r", prompt, target)
    drafts = [eng.step() for _ in range(20)]
    assert all(not d[0] for d in drafts if d)


def test_k_is_zero_where_the_engines_steps_say_drafts_do_not_pay():
    """A draft token that costs a whole plain step never pays at this acceptance: after the
    costs are measured (the first steps speculate on the optimistic prior), k = 0."""
    clock = FakeClock(plain=0.1, per_token=0.1)
    sp = Speculator(Settings(k_max=8), clock=clock)
    eng = Engine(sp, clock)
    for i in range(3):  # low acceptance: the prompt's passage and the output differ often
        prompt, target = copy_request(10 + i, length=200)
        noisy = [t if j % 3 else t + 1 for j, t in enumerate(target)]
        eng.add(f"r{i}", prompt, noisy)
    sent = [sum(len(d) for d in eng.step()) for _ in range(60)]
    assert sum(sent[:10]) > 0  # tried on the prior
    slope, source = sp.costs.slope(3)
    assert source == "measured" and slope > 0.5
    assert sum(sent[-20:]) == 0 and sp.counters["plain_steps"] >= 20


def test_the_engines_step_costs_are_learned_per_batch_and_draft_tokens():
    costs = StepCosts(settle=3)
    for _ in range(3):
        costs.observe(4, 0, 0.10)
        costs.observe(4, 8, 0.14)
        costs.observe(4, 16, 0.18)
    slope, source = costs.slope(4)
    assert source == "measured" and slope == pytest.approx(0.05, rel=1e-6)
    assert costs.slope(8) == (pytest.approx(0.05, rel=1e-6), "B=4")  # borrowed
    assert StepCosts(prior_slope=0.07).slope(1) == (0.07, "prior")
    assert costs.seconds(4, 4) == pytest.approx(0.12)


def test_allocation_gives_the_tokens_to_the_rows_that_accept_them():
    good, bad = [0.95] * 4, [0.05] * 4
    k, rate, plain = allocate([good, bad], [4, 4], 0.05, min_gain=0.02)
    assert k[0] == 4 and k[1] == 0 and rate > plain
    k, rate, plain = allocate([good, bad], [4, 4], 2.0, min_gain=0.02)
    assert k == [0, 0] and rate == plain
    assert allocate([good], [0], 0.0, min_gain=0.0)[0] == [0]  # no draft, nothing sent


def test_shadows_learn_acceptance_while_speculation_is_off():
    """With every step plain (drafts cost a step each), the lookup's drafts are still compared
    with the output: the category's acceptance grows from them."""
    clock = FakeClock(plain=0.1, per_token=1.0)
    sp = Speculator(Settings(k_max=4, proposers=("ngram",), prior_slope=10.0), clock=clock)
    eng = Engine(sp, clock)
    prompt, target = copy_request(3)
    eng.add("r", prompt, target)
    for _ in range(30):
        assert not any(eng.step())
    acc, reached = sp.acceptance.counts[("default", "ngram", -1)]
    assert reached[0] >= 5 and acc[0] / reached[0] > 0.8


def test_suffix_decoding_proposes_from_the_categorys_earlier_outputs():
    sp = Speculator(Settings(k_max=8, proposers=("suffix",)), clock=FakeClock())
    eng = Engine(sp, sp.clock)
    _, target = novel_request(5)
    eng.add("first", [1, 2, 3], target, label="chat")
    while eng.rows:
        eng.step()
    sp.step([])  # the first left the batch: its output joins the category's memory
    eng.add("second", [4, 5, 6], target, label="chat")
    drafts = [eng.step() for _ in range(6)]
    assert any(d and d[0] for d in drafts)
    assert sp.counters["accepted_tokens"] > 0


def test_the_proposer_never_raises_into_vllm():
    cfg = _config(k=4)
    p = AutospecProposer(cfg)
    # rows and counts that disagree: logged, empty drafts
    out = p.propose([[1], [2]], np.array([3], dtype=np.int32), np.zeros((1, 8), np.int32))
    assert out == [[], []] and p.speculator.counters["errors"] == 1
    assert p.propose([], np.zeros(0, np.int32), np.zeros((0, 8), np.int32)) == []


def test_the_proposer_reads_vllms_arrays_and_drafts_a_copy():
    p = AutospecProposer(_config(k=8))
    eng = Engine(p)
    prompt, target = copy_request(7)
    eng.add("x", prompt, target)
    drafts = [eng.step() for _ in range(8)]
    assert any(d and d[0] for d in drafts)
    assert p.speculator.counters["accepted_tokens"] > 0


def _config(k: int, max_len: int = MAX_LEN):
    return types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=k),
        model_config=types.SimpleNamespace(model="tiny/target", dtype="torch.float32",
                                           max_model_len=max_len))


def test_finished_requests_become_store_records(tmp_path):
    from autospec.store import open_store, queries

    url = f"sqlite:///{tmp_path / 's.db'}"
    sink = StoreSink(url, target="tiny/target", dtype="float32", hardware="cpu: test")
    sp = Speculator(Settings(k_max=8), clock=FakeClock(), on_finish=sink.submit,
                    categorize=sink.categorize)
    assert sink.ready.wait(30)
    eng = Engine(sp, sp.clock)
    for i in range(2):
        prompt, target = copy_request(20 + i)
        eng.add(f"r{i}", prompt, target, label="code")
    while eng.rows:
        eng.step()
    sp.step([])
    sink.close()
    assert sink.counts()["failures"] == 0 and sink.written == 2, sink.counts()
    with open_store(url, read_only=True) as st, st.session() as s:
        rows = queries.recent_requests(s, limit=10)
        assert len(rows) == 2
        for r in rows:
            assert r.policy == POLICY and r.path == PATH and r.category == "code"
            assert r.new_tokens == 60 and r.prompt_tokens == 65
            assert r.proposers["ngram"].accepted > 0 and r.proposers["ngram"].trace
            assert r.features is not None  # the store's key: categorise can fit on them
        summaries = queries.category_summaries(s)
        assert any(c.category == "code" for c in summaries)
    import random

    from test_store import make_record

    with open_store(url) as st:  # autospec's own traffic in the same category, beside vLLM's
        st.write([make_record(random.Random(i), category="code") for i in range(3)])
    from autospec.cli import main

    assert main(["stats", "--db", url]) == 0
    assert main(["report", "--db", url, "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.txt").read_text()
    summary = text.split("\npairs:")[0]
    vllm_rows = [ln for ln in summary.splitlines() if " vLLM " in ln]
    own_rows = [ln for ln in summary.splitlines() if " autospec " in ln]
    assert len(vllm_rows) == 1 and len(own_rows) == 1, summary
    assert " code " in vllm_rows[0] and " code " in own_rows[0], summary
    assert "served by vLLM" in text and "served by autospec (eager)" in text
    # lookups only, two requests at batch 2: not judged as a draft model that never drafted
    assert "no drafts" not in vllm_rows[0] and "too little" in vllm_rows[0], summary
    assert "the pair has no draft model" in text


def test_a_store_that_cannot_open_costs_generation_nothing(tmp_path):
    bad = tmp_path / "not-a-dir" / "x"
    (tmp_path / "not-a-dir").write_text("a file where a directory should be")
    sink = StoreSink(f"sqlite:///{bad}", target="t", dtype="float32", hardware="cpu")
    sp = Speculator(Settings(k_max=4), clock=FakeClock(), on_finish=sink.submit)
    eng = Engine(sp, sp.clock)
    prompt, target = copy_request(30, length=20)
    eng.add("r", prompt, target)
    while eng.rows:
        eng.step()
    sp.step([])
    sink.ready.wait(10)
    sink.close()
    assert sink.failures >= 1 and sink.written == 0


def test_acceptance_by_match_bucket_shrinks_towards_the_pooled_rate():
    a = Acceptance(4)
    for _ in range(50):
        a.add("c", "ngram", 14, 4, 4)  # long matches: all accepted
        a.add("c", "ngram", 1, 4, 0)  # chance hits: none
    long, short, unseen = (a.curve("c", "ngram", m) for m in (14, 1, 4))
    assert long[0] > 0.9 and short[0] < 0.1
    assert short[0] < unseen[0] < long[0]  # a bucket never seen: the pooled rate
