"""One rule for what a category may be, applied wherever a category comes from, before any
work: generate's and wrap's ``category=``, a categoriser's classes, the store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import autospec
from autospec.categorize.categorizer import Categorizer
from autospec.store import check_category
from autospec.store.record import PairInfo, RequestRecord
from autospec.store.write import validate_record

from conftest import noisy_copy, prompt, tiny
from records import draft

BAD = ["a\x00b", "", "   ", "\ud800x", 3, None]


@pytest.mark.parametrize("bad", BAD)
def test_the_rule(bad):
    with pytest.raises(ValueError, match="category"):
        check_category(bad)


@pytest.mark.parametrize("good", ["chat", "código", "a'b\"c", "x" * 500, "tab\there"])
def test_free_text_is_a_category(good):
    assert check_category(good) == good


@pytest.fixture(scope="module")
def wrapped():
    target = tiny(sharpen=10.0)
    ctrl = autospec.wrap(target, noisy_copy(target, 0.3), store=False, policy=2)
    yield target, ctrl
    autospec.unwrap(target)


def test_generate_refuses_a_nul_category_before_any_work(wrapped):
    target, ctrl = wrapped
    ids = prompt(8)
    ctrl.generate(ids, max_new_tokens=3, category="ok")
    assert ctrl.last_stats is not None
    with pytest.raises(ValueError, match="NUL"):
        target.generate(ids, max_new_tokens=3, category="a\x00b")
    assert "a\x00b" not in ctrl.live
    with pytest.raises(ValueError, match="NUL"):  # and per row at batch > 1
        target.generate(torch.cat([ids, ids]), max_new_tokens=3, category=["ok", "b\x00"])


@pytest.mark.parametrize("bad", BAD[:4])
def test_generate_refuses_what_the_store_refuses(wrapped, bad):
    target, _ = wrapped
    pair = PairInfo(target="t", draft="d", dtype="float32", hardware="cpu")
    record = RequestRecord(pair=pair, category=bad, policy="fixed(1)", greedy=True,
                           prompt_tokens=8, new_tokens=1, iterations=1,
                           proposers=draft(trace=b"\xff"),
                           k_schedule=b"\x00", accepted_schedule=b"\x00", wall_s=0.1,
                           prefill_s=0.1, draft_s=0.0, draft_forwards=0,
                           target_s_by_n={}, trace_kind="greedy")
    with pytest.raises(ValueError, match="category"):
        validate_record(record)
    with pytest.raises(ValueError, match="category"):
        target.generate(prompt(8), max_new_tokens=3, category=bad)


def test_wrap_refuses_a_nul_category():
    target = tiny()
    with pytest.raises(ValueError, match="NUL"):
        autospec.wrap(target, noisy_copy(target, 0.3), store=False, category="x\x00")
    assert getattr(target, "_autospec_controller", None) is None


def test_a_categoriser_cannot_hold_a_bad_category():
    with pytest.raises(ValueError, match="NUL"):
        Categorizer(name="c", version=None, kind="classifier", classes=["ok", "n\x00"],
                    columns=np.zeros(0, dtype=np.uint32), coef=np.zeros((2, 0)),
                    intercept=np.zeros(2))
