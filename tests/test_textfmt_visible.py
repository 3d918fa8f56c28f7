"""``textfmt.visible``: stored strings (categories, model names, hardware, policies) reach a
terminal with their control characters shown, never acted on."""

from __future__ import annotations

import pytest

from autospec.textfmt import visible


@pytest.mark.parametrize("raw, shown", [
    ("a\x1b[2Jb", "a\\x1b[2Jb"),  # ESC: clear screen
    ("\x1b]0;title\x07", "\\x1b]0;title\\x07"),  # OSC set-title, BEL
    ("x\ny\tz\r", "x\\ny\\tz\\r"),
    ("\x00\x7f", "\\x00\\x7f"),  # NUL, DEL
    ("\x85\x9b31m", "\\x85\\x9b31m"),  # C1: NEL, CSI
    ("abc\u202edcba", "abc\\u202edcba"),  # right-to-left override
    ("\u202a\u202b\u202c\u202d", "\\u202a\\u202b\\u202c\\u202d"),
    ("\u2066\u2067\u2068\u2069", "\\u2066\\u2067\\u2068\\u2069"),  # isolates
])
def test_control_characters_are_shown_escaped(raw, shown):
    assert visible(raw) == shown
    assert visible(shown) == shown  # idempotent: escaping twice changes nothing


def test_printable_text_is_left_alone():
    for s in ("code", "Qwen/Qwen2.5-7B", "é中文 ½ — ×", "C:\\path\\x1b", ""):
        assert visible(s) == s
    assert visible(3) == "3" and visible(None) == "None"
