"""What a person sees when the command line is given bad input or hostile stored strings: one
``autospec: error:`` line and status 2, never a traceback; control characters shown, never
acted on; a greedy divergence from plain decoding explained, not just flagged."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from autospec.cli import main
from autospec.textfmt import table, visible

from conftest import prompt, tiny
from test_store import make_record


def _run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr()


BAD = [
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["generate", "--prompt", "x", "--device", "nonsense"], "--device"),
    (["probe", "--repeats", "0"], "--repeats: must be at least 1"),
    (["probe", "--context", "0"], "--context"),
    (["bench", "--k", "x"], "--k"),
    (["tune", "--trials", "0"], "--trials"),
    (["report", "--db", "nosuchdialect://x/y"], "unknown database kind"),
    (["categorize"], "ACTION"),
    (["nosuchcommand"], "invalid choice"),
    ([], "COMMAND"),
    # a store's ids are 64-bit signed integers: one past them is refused, not an overflow
    (["explain", "--request", "9223372036854775808"], "fit a 64-bit signed integer"),
    (["export", "--engine", "vllm", "--pair-id", "9" * 30], "fit a 64-bit signed integer"),
    (["report", "--pair-id", "9223372036854775808"], "fit a 64-bit signed integer"),
    (["tune", "--pair-id", "-1"], "--pair-id: must be in 1..9223372036854775807"),
    (["categorize", "fit", "--pair-id", "99999999999999999999"], "64-bit"),
]


@pytest.mark.parametrize("argv, says", BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_input_is_one_error_line_with_status_2(argv, says, capsys):
    code, out = _run(argv, capsys)
    assert code == 2
    assert out.err.startswith("autospec: error: ") and out.err.count("\n") == 1, out.err
    assert says in out.err and "Traceback" not in out.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_error_line(capsys):
    code, out = _run(["generate", "--prompt", "x", "--device", "cuda"], capsys)
    assert code == 2 and out.err.count("\n") == 1
    assert "no CUDA device" in out.err and "--device cpu" in out.err


def test_read_only_commands_create_nothing_at_a_mistyped_path(tmp_path, capsys):
    for command in (["stats"], ["report"], ["categorize", "show"]):
        code, out = _run([*command, "--db", str(tmp_path / "typo" / "autospec.db")], capsys)
        assert code == 2 and "no store at" in out.err
    assert not (tmp_path / "typo").exists()


# -- control characters --------------------------------------------------------------------------

EVIL = "evil\x1b]0;pwned\x07\x1b[2J\x9b31m\u202eboom\nnext"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # \t, \n allowed


def test_visible_shows_every_control_character():
    assert visible(EVIL) == "evil\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\u202eboom\\nnext"
    assert visible("code · Qwen2.5 ✓") == "code · Qwen2.5 ✓"  # printable text untouched
    assert not RAW.search(table(["c"], [[EVIL]]))


def _strings(x) -> list[str]:
    if isinstance(x, dict):
        return [s for v in x.values() for s in _strings(v)]
    if isinstance(x, list):
        return [s for v in x for s in _strings(v)]
    return [x] if isinstance(x, str) else []


def test_stored_control_characters_never_reach_the_terminal(tmp_path, capsys):
    from autospec.store import open_store

    db = tmp_path / "evil.db"
    with open_store(db) as st:
        st.write([make_record(random.Random(i), category=EVIL) for i in range(3)])
    for argv in (["stats"], ["stats", "--json"], ["report"], ["report", "--format", "json"]):
        code, out = _run([*argv, "--db", str(db)], capsys)
        assert code == 0, out.err
        assert not RAW.search(out.out), (argv, RAW.search(out.out))
        if "--json" in argv or "json" in argv:
            assert EVIL in _strings(json.loads(out.out))  # the same string for a program


# -- a greedy divergence, explained ---------------------------------------------------------------

def test_a_divergence_is_explained_with_the_targets_margin():
    from autospec.bench.run import NEAR_TIE, explain_divergence, top2_margin

    model = tiny("llama", seed=3).to(torch.bfloat16)
    ids = prompt(8, seed=5)
    with torch.inference_mode():
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                               do_sample=False)[0, ids.shape[1]:].tolist()
    assert explain_divergence(model, ids, plain, list(plain), torch.bfloat16) is None
    other = plain[:3] + [(plain[3] + 1) % model.config.vocab_size] + plain[4:]
    margin = top2_margin(model, ids, plain[:3])
    for dtype in (torch.bfloat16, torch.float32):
        why = explain_divergence(model, ids, plain, other, dtype)
        assert f"they part at new token 3 (plain token {plain[3]}, autospec {other[3]})" in why
        assert f"{margin:.3f} apart" in why
        tie = dtype == torch.bfloat16 and margin < NEAR_TIE
        assert ("bf16 near-tie" in why and "fp32" in why) if tie else "please report it" in why
    short = explain_divergence(model, ids, plain, plain[:4], torch.bfloat16)
    assert "stops earlier, at new token 4" in short
