"""What a person types is read as typed or refused with one line: no empty list items
skipped, no timeout that is not a duration, and one limit on the lookahead k wherever a k
is given (the command line, a policy spec, ``as_policy``, ``wrap``, ``tune``)."""

from __future__ import annotations

import pytest

import autospec
from autospec.cli import build_parser, main
from autospec.policies import FixedK, TablePolicy, as_policy
from autospec.policies.base import K_LIMIT

from conftest import tiny


def _refused(argv, capsys, tmp_path) -> str:
    """The one error line of a refused command line (status 2, no traceback). Commands that
    load models get an empty local directory as both models: were the input taken, they
    would fail there, and never fetch the default pair."""
    if argv[0] in ("bench", "generate", "probe"):
        argv = [*argv, "--target", str(tmp_path), "--draft", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("autospec: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, says", [
    (["bench", "--batch", "1,,4"], "an empty item in '1,,4'"),
    (["bench", "--batch", "1,4,"], "an empty item"),
    (["bench", "--k", "1,,2"], "--k: an empty item"),
])
def test_an_empty_item_in_a_list_is_refused_not_skipped(argv, says, capsys, tmp_path):
    assert says in _refused(argv, capsys, tmp_path)


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "-inf", "soon"])
def test_tune_timeout_must_be_a_positive_finite_number_of_seconds(value, tmp_path, capsys):
    err = _refused(["tune", "--db", str(tmp_path / "t.db"), f"--timeout={value}"], capsys,
                   tmp_path)
    assert "--timeout" in err and "seconds" in err
    assert not (tmp_path / "t.db").exists()  # refused before anything ran


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf"])
def test_probe_time_budget_must_be_a_positive_finite_number_of_seconds(value, tmp_path, capsys):
    err = _refused(["probe", f"--max-seconds={value}", "--no-store"], capsys, tmp_path)
    assert "--max-seconds" in err and "seconds" in err


def test_tune_accepts_a_timeout_and_k_max_inside_the_limits():
    args = build_parser().parse_args(["tune", "--timeout", "0.5", "--k-max", str(K_LIMIT)])
    assert args.timeout == 0.5 and args.k_max == K_LIMIT


@pytest.mark.parametrize("argv, says", [
    (["tune", "--k-max", str(K_LIMIT + 1)], f"--k-max: must be in 1..{K_LIMIT}"),
    (["tune", "--k-max", "1000"], f"--k-max: must be in 1..{K_LIMIT}"),
    (["tune", "--k-max", "0"], "--k-max"),
    (["bench", "--k", str(K_LIMIT + 1)], f"every k must be in 1..{K_LIMIT}"),
    (["bench", "--modes", f"autospec:{K_LIMIT + 1}"], f"k must be in 0..{K_LIMIT}, got 65"),
    (["bench", "--modes", f"ngram:{K_LIMIT + 1}"], f"k must be in 1..{K_LIMIT}, got 65"),
    (["bench", "--policies", "fixed:1..1000"], f"k must be in 0..{K_LIMIT}"),
    (["bench", "--policies", f"ngram:{K_LIMIT + 1}"], f"k must be in 1..{K_LIMIT}"),
    (["generate", "--prompt", "x", "--k", str(K_LIMIT + 1)], f"0..{K_LIMIT}"),
])
def test_the_command_line_holds_k_to_one_limit(argv, says, capsys, tmp_path):
    assert says in _refused(argv, capsys, tmp_path)


@pytest.mark.parametrize("spec", [K_LIMIT + 1, -1, 1000, f"fixed:{K_LIMIT + 1}",
                                  f"ngram:{K_LIMIT + 1}", f"hybrid:{K_LIMIT + 1}:2",
                                  f"table:1-4:{K_LIMIT + 1},5-:0", f"fixed:{K_LIMIT + 1}+stop=0.5"])
def test_a_policy_k_outside_the_limit_is_a_clear_error(spec):
    # 0 is plain decoding; a spec naming a proposer starts at 1
    with pytest.raises(ValueError, match=rf"[01]\.\.{K_LIMIT}"):
        as_policy(spec)


def test_every_k_inside_the_limit_is_a_policy():
    assert as_policy(K_LIMIT) == FixedK(K_LIMIT) and as_policy(0) == FixedK(0)
    assert as_policy(f"ngram:{K_LIMIT}").k == K_LIMIT
    assert TablePolicy.parse(f"table:1-:{K_LIMIT}").k_for(1) == K_LIMIT
    for bad in (K_LIMIT + 1, -1, 2.5, True):
        with pytest.raises(ValueError):
            FixedK(bad)


def test_wrap_refuses_a_policy_k_beyond_the_limit():
    model = tiny()
    with pytest.raises(ValueError, match=f"0..{K_LIMIT}.*got {K_LIMIT + 1}"):
        autospec.wrap(model, policy=K_LIMIT + 1, store=False)
    with pytest.raises(ValueError, match="got -1"):
        autospec.wrap(model, policy=-1, store=False)
    assert model.generate.__func__ is type(model).generate  # nothing was left wrapped


def test_the_tuner_refuses_a_k_max_or_timeout_outside_the_limits(tmp_path):
    from autospec.store import open_store
    from autospec.tune.study import TuneError, tune

    with open_store(tmp_path / "t.db") as store:
        with pytest.raises(TuneError, match=f"k_max ≤ {K_LIMIT}"):
            tune(store, k_max=K_LIMIT + 1)
        for timeout in (-5.0, 0.0, float("nan")):
            with pytest.raises(TuneError, match="timeout"):
                tune(store, timeout=timeout)
