"""Plain-text tables and numbers for people reading a terminal (the CLI's output only)."""

from __future__ import annotations

import re

__all__ = ["table", "fmt", "human_bytes", "visible", "VisibleStream"]

# C0 controls (newline and tab included: a name is one line), DEL, C1 controls (U+009B is a
# one-character CSI in some terminals), and the bidirectional overrides/isolates that reorder
# what follows them
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


_CONTROL_IN_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _esc(m: re.Match) -> str:
    o = ord(m.group())
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def visible(text: object, *, lines: bool = False) -> str:
    """``text`` with every control character shown as an escape (ESC → ``\\x1b``,
    U+202E → ``\\u202e``): stored strings (category and model names) reach a terminal
    without moving the cursor, clearing the screen, setting the title or reordering text.
    ``lines``: keep newlines and tabs (a whole output, not one name)."""
    return (_CONTROL_IN_LINES if lines else _CONTROL).sub(_esc, str(text))


class VisibleStream:
    """A text stream that writes through ``visible(..., lines=True)``: what the command
    line prints to standard output cannot act on the terminal, whatever a stored string
    or a model's output holds."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, s: str) -> int:
        self.stream.write(visible(s, lines=True))
        return len(s)

    def __getattr__(self, name: str):  # flush, isatty, encoding, fileno, ...
        return getattr(self.stream, name)


def fmt(x, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)  # x != x: NaN


def human_bytes(n: float | None, per_s: bool = False) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}{'/s' if per_s else ''}"
        n /= 1000
    return "-"


def table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Fixed-width columns: the first ``left`` left-aligned, the rest right-aligned, with a
    rule under the header."""
    cells = [[visible(c) for c in row] for row in (header, *rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                       for i, (c, w) in enumerate(zip(cell, widths, strict=True))).rstrip()
             for cell in cells]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)
