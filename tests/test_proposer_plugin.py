"""A proposer is one file. The phrase book (``tests/phrasebook.py``: drafts the rest of a fixed
snippet the context ends in) is written outside autospec and registered through the public
registration, and with no edit anywhere else it is served live at batch 1 and 3 (greedy
identical to ``generate``, sampled rows each against the target's exact joint law), weighed by
``auto``, logged, replayed as it ran, searched by ``tune``, shown by ``explain`` and ``report``
and refused by ``export`` in one line naming it. Removing suffix decoding from the registry
leaves everything else running. A proposer that drafts from the target's last hidden state (a
linear head fitted here) through the opt-in hook is exact too."""

from __future__ import annotations

import json

import pytest
import torch

import autospec
from autospec.cli import main
from autospec.engine.proposers import HostLookup, get, register, registered, unregister
from autospec.policies import Choice
from autospec.store import add_probe, open_store, queries
from autospec.traces import SUFFIX_TRACE_WIDTH
from autospec.tune.replay import Costs, simulate
from autospec.tune.study import tune

from conftest import noisy_copy, tiny
from phrasebook import registered_phrasebook
from test_batch_exact import batch
from test_replay_equals_live import _same_counts
from test_sampled_exact import exact_joint
from test_verify import ALPHA, _chi2_pvalue

GRID = {b: {n: 0.1 + 0.01 * n for n in range(1, 18)} for b in (1, 2, 3)}
COSTS = Costs(t_draft=0.05, t_target=GRID[1], target_grid=GRID,
              draft_grid={b: 0.05 for b in GRID})
NEW = 40


@pytest.fixture(scope="module")
def setting():
    """The target, a draft that often disagrees, three prompts, and snippets cut from the
    target's own greedy continuations (so the phrase book drafts what the target says)."""
    target = tiny("llama", layers=2, seed=5)
    ids, mask = batch([7, 10, 5], seed=3)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                          pad_token_id=0, eos_token_id=None)
    L = ids.shape[1]
    snippets = []
    for row in ref[:, L:].tolist():
        snippets += [row[i:i + 8] for i in range(0, NEW // 2, 3)]  # the first half only
    return target, noisy_copy(target, 0.6), ids, mask, ref, snippets


def _generate(spec, ids, mask, category="book", **kw):
    return spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                         pad_token_id=0, eos_token_id=None, category=category, **kw)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("policy", ["phrasebook:4", "auto"])
def test_served_live_greedy_identical_and_weighed_by_auto(setting, tmp_path, rows, policy):
    target, draft, ids, mask, ref, snippets = setting
    with registered_phrasebook(snippets):
        spec = autospec.Controller(target, draft, store=f"sqlite:///{tmp_path / 's.db'}",
                                   policy=policy)
        served = []
        for _ in range(2):  # auto learns the phrase book's rate on the first call
            out = _generate(spec, ids[:rows], mask[:rows])
            assert torch.equal(out, ref[:rows])
            served += spec.last_row_stats
        assert not spec.fallbacks
        book = [st.proposer("phrasebook") for st in served]
        assert sum(c.proposed for c in book) >= sum(c.accepted for c in book) > 0
        # every iteration it drafted is marked with its name
        assert all(("phrasebook" in st.proposer_schedule) == (st.proposer("phrasebook").blocks
                                                              > 0) for st in served)
        if policy == "auto":  # weighed beside the draft model (on measured timings): both
            drafted = {n: sum(st.proposer(n).proposed for st in served)
                       for n in ("draft", "phrasebook")}
            assert drafted["phrasebook"] > 0 and drafted["draft"] > 0, drafted
        spec.close()


@pytest.mark.parametrize("rows", [1, 3])
def test_sampled_rows_follow_the_targets_joint_law(rows):
    """Each row's snippet is its prompt's last two tokens then [the target's least likely
    first token, its most likely one]: every call proposes them, so acceptance and the
    residual law both carry mass. Per row, chi-square against the exact joint law."""
    V = 8
    target = tiny("llama", vocab=V, sharpen=4.0, seed=3)
    ids, mask = batch([6, 4, 5][:rows], seed=11, vocab=V)
    L = ids.shape[1]
    laws, snippets = [], []
    for b, n in enumerate([6, 4, 5][:rows]):
        law = exact_joint(target, ids[b:b + 1, L - n:], top_k=0)
        first = law.sum(1)
        laws.append(law)
        snippets.append([*ids[b, -2:].tolist(), int(first.argmin()), int(first.argmax())])
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(rows, V * V, dtype=torch.long)
    proposed = accepted = 0
    with registered_phrasebook(snippets):
        spec = autospec.Controller(target, None, store=False, policy="phrasebook:2")
        for _ in range(2000):
            out = spec.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True,
                                top_k=0, eos_token_id=None, generator=g)
            for b in range(rows):
                counts[b, out[b, L] * V + out[b, L + 1]] += 1
            for st in spec.last_row_stats:
                proposed += st.proposer("phrasebook").proposed
                accepted += st.proposer("phrasebook").accepted
    assert proposed >= 2000 * rows and 0 < accepted < 0.5 * proposed  # rejections exercised
    for b in range(rows):
        assert _chi2_pvalue(counts[b], laws[b].flatten()) > ALPHA, b
        wrong = torch.zeros(V, V)  # power: emitting the proposal whenever proposed
        wrong[snippets[b][2], snippets[b][3]] = 1.0
        assert _chi2_pvalue(counts[b], (0.5 * laws[b] + 0.5 * wrong).flatten()) < ALPHA, b


class Reader:
    """Decides from the statistics the accounting feeds (never from timings): the phrase book
    where its match is long and it has paid, else the draft model at a k that follows its
    acceptance, a plain step now and then."""

    name = "reader"

    def choose(self, ctx):
        live, request = ctx.live, ctx.request
        if request.iterations % 5 == 4:
            return 0
        book = live.first_acceptance("phrasebook")
        if ctx.matches["phrasebook"][0] >= 2 and (book is None or book > 0.3):
            return Choice(4, "phrasebook")
        accepted, reached = (c[0] for c in live.counts("draft"))
        return 1 + round(3 * (accepted / reached if reached else 0.5))

    def update(self, ctx, k, outcome):
        pass


def _schedules(st):
    return (st.k_schedule, st.accepted_schedule, st.proposer_schedule,
            {n: (c.blocks, c.proposed, c.accepted, c.proposed_per_position,
                 c.accepted_per_position) for n, c in st.counts.items() if c.blocks})


@pytest.mark.parametrize("rows", [1, 3])
def test_logged_and_replayed_as_it_ran(setting, tmp_path, rows):
    target, draft, ids, mask, ref, snippets = setting
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with registered_phrasebook(snippets):
        spec = autospec.Controller(target, draft, store=url, policy=Reader())
        served = []
        for _ in range(2):
            out = _generate(spec, ids[:rows], mask[:rows])
            assert torch.equal(out, ref[:rows])
            served += spec.last_row_stats
        live = spec.live["book"]
        spec.close()
        with open_store(url) as store, store.session() as s:
            logged = list(queries.traces(s))
            (sm,) = queries.category_summaries(s)
        # logged: its own row per request (counters, trace) and its category's sums
        assert all(len(r.traces["phrasebook"]) == SUFFIX_TRACE_WIDTH * r.new_tokens
                   for r in logged)
        assert sm.proposers["phrasebook"].accepted == sum(st.proposer("phrasebook").accepted
                                                          for st in served) > 0
        lives = {}
        res = simulate(logged, Reader(), COSTS, live=lives, category="book")
    assert [_schedules(st) for st in res.requests] == [_schedules(st) for st in served]
    kinds = {p for st in served for p in st.proposer_schedule}
    assert kinds == {"draft", "phrasebook", None}
    _same_counts(live, lives["book"])


def _logged_store(setting, url, calls=6):
    target, draft, ids, mask, ref, snippets = setting
    spec = autospec.Controller(target, draft, store=url, policy="auto")
    for i in range(calls):
        _generate(spec, ids[i % 3:i % 3 + 1], mask[i % 3:i % 3 + 1], explain=True)
    _probed(spec, url)


def _probed(spec, url):
    """Close ``spec`` and store the costs a probe of its pair would have measured."""
    pair = spec.telemetry.pair
    spec.close()
    with open_store(url) as store, store.begin() as s:
        add_probe(s, pair, {"path": "eager", "draft_s": 0.05,
                            "target_s_by_n": {str(n): t for n, t in GRID[1].items()}})


def test_searched_by_tune_shown_by_explain_and_report_refused_by_export(setting, tmp_path,
                                                                        capsys):
    url = f"sqlite:///{tmp_path / 't.db'}"
    _, _, _, _, _, snippets = setting
    with registered_phrasebook(snippets):
        _logged_store(setting, url)
        with open_store(url) as store:
            (res,) = tune(store, trials=12, families=("fixed", "costmodel"), seed=0,
                          write=False, min_traces=4, min_positions=50)
        assert res.status == "tuned", res.reason
        assert "phrasebook" in res.proposers_searched
        assert res.shares.get("phrasebook") is not None

        assert main(["explain", "--db", url, "--last", "--json"]) == 0
        records = json.loads(capsys.readouterr().out)["decisions"]
        named = {c["proposer"] for r in records for c in r.get("candidates", ())}
        assert "phrasebook" in named | {r["proposer"] for r in records}

        assert main(["report", "--db", url]) == 0
        out = capsys.readouterr().out
        assert "the phrase book" in out  # its title, with its acceptance

        with pytest.raises(SystemExit) as exit_:
            main(["export", "--db", url, "--engine", "vllm", "--proposer", "phrasebook"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'phrasebook'" in err[0] and "vLLM" in err[0], err


class unregistered:
    """``with unregistered(name):`` — the proposer out of the registry, put back after."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.cls = unregister(self.name)

    def __exit__(self, *exc):
        register(self.cls)


def test_without_suffix_decoding_everything_else_runs(setting, tmp_path, capsys):
    target, draft, ids, mask, ref, _ = setting
    url = f"sqlite:///{tmp_path / 'n.db'}"
    spec = autospec.Controller(target, draft, store=url, policy="auto", suffix=True)
    for rows in (1, 3):  # the store holds suffix decoding's rows from before
        _generate(spec, ids[:rows], mask[:rows])
    spec.close()
    with unregistered("suffix"):
        assert "suffix" not in registered()
        spec = autospec.Controller(target, draft, store=url, policy="auto")
        for rows in (1, 3):
            assert torch.equal(_generate(spec, ids[:rows], mask[:rows]), ref[:rows])
        assert not spec.fallbacks
        _probed(spec, url)
        with pytest.raises(ValueError, match="suffix"):  # asking for it is one clear error
            autospec.Controller(target, draft, store=False, policy="suffix:4")
        with open_store(url) as store:
            with store.session() as s:
                logged = list(queries.traces(s))
            assert simulate(logged, autospec.policies.as_policy("auto"), COSTS).tokens > 0
            (res,) = tune(store, trials=6, families=("fixed",), seed=0, write=False,
                          min_traces=3, min_positions=50)
            assert res.status == "tuned" and "suffix" not in res.proposers_searched
            with store.session() as s:  # its rows stay, read by name
                assert "suffix" in queries.category_summaries(s)[0].proposers
        for argv in (["report", "--db", url], ["stats", "--db", url],
                     ["explain", "--db", url, "--last"],
                     ["export", "--db", url, "--engine", "vllm", "--proposer", "draft"]):
            assert main(argv) == 0, argv
        capsys.readouterr()
    assert "suffix" in registered()


# -- the hidden-states hook ------------------------------------------------------------------
class HiddenHead(HostLookup):
    """Drafts one token from the target's last hidden state at the row's last verified
    position: a linear head (``HEAD``, [d, V]) predicting the token after the next."""

    name = "hiddenhead"
    code = 41
    needs = ("hidden_states",)
    HEAD: torch.Tensor | None = None

    def __init__(self, call):
        super().__init__(call)
        self._next: list[int | None] = [None] * len(call.rows)

    def matches(self):
        return [1 if t is not None else 0 for t in self._next]

    def sizes(self):
        return [1 if t is not None else 0 for t in self._next]

    def propose(self, it, rows, lengths):
        blocks = {b: [self._next[b]] for b in rows if self._next[b] is not None}
        return self.staging.block(len(self.call.rows), 1, blocks)

    def accept(self, it, steps):
        h = it.hidden[torch.arange(len(steps)), torch.as_tensor(it.taken)]  # [B, d]
        self._next = (h @ self.HEAD).argmax(-1).tolist()

    def select(self, keep, index):
        self._next = [self._next[b] for b in keep]


def test_a_proposer_drafting_from_the_targets_hidden_states_is_exact(setting):
    target, _, ids, mask, ref, _ = setting
    L = ids.shape[1]
    with torch.no_grad():  # fit the head on the target's own continuations
        full = torch.cat([mask, torch.ones_like(ref[:, L:])], 1)
        out = target(ref, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp_min(0),
                     output_hidden_states=True)
        h = out.hidden_states[-1][:, L - 1:-2].reshape(-1, out.hidden_states[-1].shape[-1])
        y = ref[:, L + 1:].reshape(-1)
        onehot = torch.nn.functional.one_hot(y, target.config.vocab_size).float()
        fitted = torch.linalg.lstsq(h, onehot).solution  # [d, V]
    # a fitted head (its drafts mostly accepted) and a random one (mostly rejected): exact both
    noise = torch.randn(fitted.shape, generator=torch.Generator().manual_seed(0))
    register(HiddenHead)
    try:
        assert get("hiddenhead").needs == ("hidden_states",)
        spec = autospec.Controller(target, None, store=False, policy="hiddenhead:1")
        for head, good in ((fitted, True), (noise, False)):
            HiddenHead.HEAD = head
            for rows in (1, 3):
                assert torch.equal(_generate(spec, ids[:rows], mask[:rows]), ref[:rows])
                got = [st.proposer("hiddenhead") for st in spec.last_row_stats]
                proposed, accepted = (sum(c.proposed for c in got),
                                      sum(c.accepted for c in got))
                assert proposed > 0 and (accepted > proposed / 2 if good
                                         else accepted < proposed / 2), (good, rows)
        assert not spec.fallbacks
    finally:
        unregister("hiddenhead")
