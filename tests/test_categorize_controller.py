"""The categoriser in the serving path: requests logged with categories train it, and a
controller then categorises requests that name none (and records how each category was set)."""

from __future__ import annotations

import random

import pytest
import torch

from autospec.categorize.categorizer import fit_from_store
from autospec.controller import Controller
from autospec.store import open_store, queries

from conftest import noisy_copy, tiny


def prompt_of(kind: str, rng: random.Random) -> torch.Tensor:
    """'low' prompts use token ids 10..49, 'high' ones 50..89: learnable from ids alone."""
    lo = 10 if kind == "low" else 50
    return torch.tensor([[1] + [rng.randrange(lo, lo + 40) for _ in range(12)]])


@pytest.fixture
def models():
    target = tiny(sharpen=4.0)
    return target, noisy_copy(target, 0.3)


def serve(ctrl: Controller, ids: torch.Tensor, **kw) -> torch.Tensor:
    return ctrl.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                         do_sample=False, **kw)


def test_logged_categories_train_a_categoriser_the_controller_then_uses(tmp_path, models):
    target, draft = models
    url = f"sqlite:///{tmp_path / 'c.db'}"
    rng = random.Random(0)
    ctrl = Controller(target, draft, policy=2, store=url)
    for i in range(40):
        kind = "low" if i % 2 else "high"
        serve(ctrl, prompt_of(kind, rng), category=kind)
    ctrl.close()
    with open_store(url) as store:
        with store.session() as s:
            rows = queries.recent_requests(s, limit=100)
        assert len(rows) == 40
        assert all(r.category_source == "given" and r.features for r in rows)
        assert all(r.prompt_text is None for r in rows)  # features, never text
        cat, report = fit_from_store(store, min_rows=20)
    assert cat.kind == "classifier" and sorted(cat.classes) == ["high", "low"]

    ctrl = Controller(target, draft, policy="auto", store=url)
    assert ctrl.categorizer is not None and ctrl.categorizer.version == cat.version
    kinds = [("low" if i % 3 else "high") for i in range(12)]
    outs = []
    for kind in kinds:
        ids = prompt_of(kind, rng)
        outs.append((ids, serve(ctrl, ids)))  # no category: the categoriser picks one
    serve(ctrl, prompt_of("low", rng), category="named")  # a named category wins
    ctrl.close()
    # categorising changes only the bookkeeping: output is still the target's greedy output
    for ids, out in outs:
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                              do_sample=False)
        assert torch.equal(out, ref)
    with open_store(url) as store, store.session() as s:
        new = list(reversed(queries.recent_requests(s, limit=13)))
    auto = new[:12]
    assert [r.category_source for r in auto] == ["auto"] * 12
    accuracy = sum(r.category == k for r, k in zip(auto, kinds)) / len(kinds)
    assert accuracy >= 0.9, [(r.category, k) for r, k in zip(auto, kinds)]
    # fitted on this very pair, so each request carries an acceptance forecast in [0, 1]
    assert all(r.predicted_alpha is not None and 0 <= r.predicted_alpha <= 1 for r in auto)
    assert (new[12].category, new[12].category_source, new[12].predicted_alpha) == \
        ("named", "given", None)


def test_without_a_categoriser_or_features(tmp_path, models):
    target, draft = models
    url = f"sqlite:///{tmp_path / 'd.db'}"
    rng = random.Random(1)
    ctrl = Controller(target, draft, policy=2, store=url, categorize=False,
                      log_features=False)
    serve(ctrl, prompt_of("low", rng))
    ctrl.close()
    with open_store(url) as store, store.session() as s:
        (row,) = queries.recent_requests(s)
    assert (row.category, row.category_source, row.features) == ("default", "default", None)
    with pytest.raises(ValueError, match="no categoriser named 'missing'"):
        Controller(target, draft, store=url, categorize="missing")
    with pytest.raises(ValueError, match="store is off"):
        Controller(target, draft, store=False, categorize="default")


def _fixed_categorizer(winner: str, other: str = "other", *, name: str = "fixed",
                       key_id: int | None = None):
    """A real Categorizer with no feature columns: its intercept alone picks ``winner``."""
    import numpy as np

    from autospec.categorize.categorizer import Categorizer

    return Categorizer(name=name, version=None, kind="classifier", classes=[winner, other],
                       columns=np.zeros(0, dtype=np.uint32), coef=np.zeros((2, 0)),
                       intercept=np.array([1.0, 0.0]), key_id=key_id)


def test_a_categorizer_object_categorises(models, caplog):
    """wrap(..., categorize=<Categorizer>) used to leave ``_forecast`` unset: every request
    then failed inside the categoriser, was served as "default" and logged a warning."""
    import autospec

    target, draft = models
    cat = _fixed_categorizer("chat")
    ids = prompt_of("low", random.Random(3))
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                          do_sample=False)
    ctrl = autospec.wrap(target, draft, categorize=cat, store=False, policy=2)
    try:
        with caplog.at_level("WARNING", logger="autospec.controller"):
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                  do_sample=False)
        assert torch.equal(out, ref)
        assert ctrl.categorizer is cat
        assert list(ctrl.live) == ["chat"]  # the request's statistics went to its category
        assert getattr(ctrl, "categorize_failures", 0) == 0
        assert not [r for r in caplog.records if "categoriser failed" in r.getMessage()]
    finally:
        autospec.unwrap(target)


def test_a_categorizer_object_with_a_store_records_auto(tmp_path, models):
    target, draft = models
    url = f"sqlite:///{tmp_path / 'obj.db'}"
    ctrl = Controller(target, draft, policy=2, store=url, categorize=_fixed_categorizer("code"))
    serve(ctrl, prompt_of("high", random.Random(4)))
    ctrl.close()
    with open_store(url) as store, store.session() as s:
        (row,) = queries.recent_requests(s, limit=5)
    assert (row.category, row.category_source) == ("code", "auto")


def test_categorize_takes_only_what_it_documents(models):
    target, draft = models
    with pytest.raises(TypeError, match="Categorizer"):
        Controller(target, draft, store=False, categorize=True)


def test_a_categoriser_fitted_under_a_rotated_key_is_refused(tmp_path, models, caplog):
    from autospec.categorize.features import FeatureKey

    target, draft = models
    db = tmp_path / "rot.db"
    with open_store(db) as store:
        old = FeatureKey(store.feature_key())
        _fixed_categorizer("chat", name="default", key_id=old.id).save(store)
    ids = prompt_of("low", random.Random(5))
    ctrl = Controller(target, draft, policy=2, store=db)  # under its own key: used
    assert ctrl.categorizer is not None
    serve(ctrl, ids)
    ctrl.close()
    (tmp_path / "rot.db.feature-key").unlink()  # rotated: the next writer makes a new key
    with caplog.at_level("WARNING", logger="autospec.controller"):
        ctrl = Controller(target, draft, policy=2, store=db)
    assert ctrl.categorizer is None and ctrl.feature_key.id != old.id
    assert [r for r in caplog.records if "not categorising" in r.getMessage()
            and "refit it" in r.getMessage()]
    serve(ctrl, ids)
    ctrl.close()
    with open_store(db) as store, store.session() as s:
        after, before = queries.recent_requests(s, limit=2)
    assert (before.category, before.category_source) == ("chat", "auto")
    assert (after.category, after.category_source) == ("default", "default")
    assert after.features[1:5] == ctrl.feature_key.id.to_bytes(4, "little")  # the new key
    with pytest.raises(ValueError, match="fitted on features under feature key"):
        Controller(target, draft, store=db, categorize="default")  # named: refused
