"""Structured output, exact: a JSON-schema constraint (``autospec.grammar.Grammar``, xgrammar
underneath) served by the speculative loop gives ``generate``'s own constrained output token
for token, at batch 1 and 3, with every proposer; every output that ends parses and validates;
the processor is a function of the prefix alone, however its calls are ordered."""

from __future__ import annotations

import json
import random

import pytest
import torch
import xgrammar as xgr

import autospec
from autospec.grammar import Grammar

from conftest import EOS, noisy_copy, prompt, tiny
from test_batch_exact import batch

# a character vocabulary with a few multi-character tokens (a token can cross a grammar
# boundary, as real ones do), the tiny models' specials first and filler after
TOKENS = (["<pad>", "<s>", "<unk>", "</s>"] + list('{}[]":, ')
          + list("abcdefghijklmnopqrstuvwxyz0123456789")
          + ['"name"', '"n"', "true", "false", '": ', '", "', "ab", "cd", '{"', '"}', "null", "12"])
TOKENS += [f"<x{i}>" for i in range(97 - len(TOKENS))]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"], "additionalProperties": False,
}
POLICIES = ["fixed:3", "fixed:6", "ngram:4", "suffix:4", "auto"]


def info():
    return xgr.TokenizerInfo(TOKENS, xgr.VocabType.RAW, vocab_size=97, stop_token_ids=[EOS])


def grammar():
    return Grammar.json_schema(SCHEMA, info(), separators=(",", ":"))


def valid(new: list[int]) -> bool:
    """The generated tokens end with EOS, and the text before it is a JSON object the schema
    accepts."""
    if not new or new[-1] != EOS:
        return False
    obj = json.loads("".join(TOKENS[t] for t in new[:-1]))
    return (set(obj) == {"name", "n", "ok"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 6 and type(obj["n"]) is int and 0 <= obj["n"] <= 99
            and isinstance(obj["ok"], bool))


@pytest.fixture(scope="module")
def models():
    target = tiny("llama", layers=2, seed=0, sharpen=30.0)
    return target, noisy_copy(target, 0.5)


@pytest.mark.parametrize("policy", POLICIES)
def test_json_schema_output_equals_constrained_generate(models, policy):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy=policy, suffix=True)
    ended = 0
    for seed in range(3):
        ids = prompt(10, seed=seed)
        kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=EOS)
        ref = target.generate(ids, logits_processor=[grammar()], **kw)
        for _ in range(2):  # suffix decoding drafts from the first call's output
            out = spec.generate(ids, logits_processor=[grammar()], **kw)
            assert torch.equal(out, ref), (policy, seed)
            assert spec.last_stats is not None  # served
        new = out[0, ids.shape[1]:].tolist()
        if EOS in new:
            ended += 1
            assert valid(new), "".join(TOKENS[t] for t in new)
    assert ended >= 2 and not spec.fallbacks
    if policy != "auto":  # it drafted, under the constraint
        assert sum(c.proposed for c in spec.last_stats.counts.values()) > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_json_schema_at_batch_3_equals_batched_generate(models, policy):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy=policy, suffix=True)
    ids, mask = batch([5, 11, 8], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=EOS)
    ref = target.generate(ids, logits_processor=[grammar()], **kw)
    for _ in range(2):  # suffix decoding drafts from the first call's outputs
        out = spec.generate(ids, logits_processor=[grammar()], **kw)
        assert torch.equal(out, ref) and not spec.fallbacks
    assert len(spec.last_row_stats) == 3
    for row in out[:, ids.shape[1]:].tolist():
        row = row[: row.index(EOS) + 1] if EOS in row else row
        assert EOS not in row or valid(row)


def test_xgrammars_own_processor_is_served_as_a_grammar(models):
    target, draft = models
    spec = autospec.Controller(target, draft, store=False, policy="fixed:4")
    compiled = xgr.GrammarCompiler(info()).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    ids = prompt(10, seed=1)
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=EOS)
    ref = target.generate(ids, logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)], **kw)
    out = spec.generate(ids, logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)], **kw)
    assert torch.equal(out, ref) and spec.last_stats is not None


def test_the_grammar_is_a_function_of_the_prefix_in_any_call_order():
    """Masks asked for in a random order over a tree of prefixes (blocks drafted, rejected,
    asked again, as the loop asks) equal a fresh processor's, called token by token."""
    rng = random.Random(0)
    prompt_ids = [1, 40, 41, 42]

    def walk(steps: int) -> list[int]:  # a valid generated sequence, by a fresh grammar
        g, seq = grammar(), list(prompt_ids)
        for _ in range(steps):
            allowed = (g(torch.tensor([seq]), torch.zeros(1, 97))[0] > -1e30).nonzero()
            if not len(allowed):
                break
            seq.append(int(rng.choice(allowed.flatten().tolist())))
        return seq[len(prompt_ids):]

    paths = [walk(rng.randint(3, 14)) for _ in range(12)]
    g = grammar()
    g(torch.tensor([prompt_ids]), torch.zeros(1, 97))  # the prompt is seen first, as in a call
    for _ in range(200):
        path = rng.choice(paths)
        cut = rng.randint(0, len(path))
        seq = prompt_ids + path[:cut]
        got = g(torch.tensor([seq]), torch.zeros(1, 97))
        fresh = grammar()
        for n in range(len(prompt_ids), len(seq) + 1):
            want = fresh(torch.tensor([seq[:n]]), torch.zeros(1, 97))
        assert torch.equal(got, want), (cut, path)
    # a prefix holding a forbidden token leaves the scores alone (no position after it is used)
    bad = prompt_ids + [TOKENS.index("}")]
    assert torch.equal(g(torch.tensor([bad]), torch.ones(1, 97)), torch.ones(1, 97))


def test_constrained_calls_are_logged_and_replayed_like_any_other(models, tmp_path):
    from autospec.policies.base import as_policy
    from autospec.store import open_store, queries
    from autospec.tune.replay import Costs, simulate

    target, draft = models
    url = f"sqlite:///{tmp_path / 'g.db'}"
    spec = autospec.Controller(target, draft, store=url, policy="fixed:4")
    served = []
    for seed in range(3):
        spec.generate(prompt(10, seed=seed), max_new_tokens=40, do_sample=False,
                      eos_token_id=EOS, category="tool-call", logits_processor=[grammar()])
        served.append(spec.last_stats)
    spec.close()
    with open_store(url) as store, store.session() as s:
        logged = list(queries.traces(s))
    assert [r.category for r in logged] == ["tool-call"] * 3
    assert [r.new_tokens for r in logged] == [st.new_tokens for st in served]
    assert any(st.stop_reason == "eos" for st in served)  # the grammar ended it
    grid = {n: 0.1 + 0.01 * n for n in range(1, 18)}
    costs = Costs(t_draft=0.05, t_target=grid, target_grid={1: grid}, draft_grid={1: 0.05})
    res = simulate(logged, as_policy("fixed:4"), costs)
    assert ([(st.k_schedule, st.accepted_schedule) for st in res.requests]
            == [(st.k_schedule, st.accepted_schedule) for st in served])
