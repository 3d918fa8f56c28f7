"""The README and docs/ keep their promises: every command and file they name exists, every
relative link (and its #anchor) resolves, every command is listed at a glance, the README stays
short with the two commands, an example and the CLI overview on its first screen, and figures
and commit ids live in the dated benchmark log, not in the pages that state behaviour."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from autospec.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# pages written elsewhere, linked before they land (docs/engine.md: the engine rewrite's);
# a pending page that exists is checked like any other
PENDING: set[str] = set()

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
PATH = re.compile(r"(?<![\w./$~-])((?:autospec|tests|scripts|docs|dashboards)"
                  r"/[\w./-]*)")
DOTTED = re.compile(r"(?<![\w./-])(autospec(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = {"db", "json", "jsonl", "md", "py", "txt", "html"}
# `autospec NAME` where autospec is what runs: a code span's or a line's start, or .venv/bin/
COMMAND = re.compile(r"(?:^|`|/bin/)autospec ([a-z]+)\b", re.M)


def _code(page: Path) -> str:
    """The page's code: fenced blocks and inline code spans, where names and paths are."""
    return "\n".join(CODE.findall(page.read_text(encoding="utf-8")))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for line in text.splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_command_the_readme_names_is_a_command():
    named = set(COMMAND.findall(_code(README)))
    assert len(named) >= 8, named  # the scan finds the commands it checks
    assert named <= set(COMMANDS), f"not commands: {sorted(named - set(COMMANDS))}"


def test_every_command_is_listed_at_a_glance():
    text = README.read_text(encoding="utf-8")
    glance = text[text.index("## The command line at a glance"):]
    glance = glance[:glance.index("\n## ", 1)]
    listed = re.findall(r"^\| `autospec ([a-z]+)` \|", glance, re.M)
    assert listed == list(COMMANDS)  # one line per command, in `autospec --help`'s order


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_a_page_names_exists(page):
    paths = {p.rstrip(".,:;") for p in PATH.findall(_code(page))}
    missing = sorted(p for p in paths if not (ROOT / p).exists()
                     and p not in PENDING)
    assert missing == [], f"{page.name} names paths that do not exist: {missing}"


def test_the_pages_name_paths_and_python_names_that_the_scan_finds():
    assert len({p for page in PAGES for p in PATH.findall(_code(page))}) >= 20
    assert len({d for page in PAGES for d in DOTTED.findall(_code(page))}) >= 10


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_name_a_page_gives_exists(page):
    names = {d for d in DOTTED.findall(_code(page))
             if d.rsplit(".", 1)[-1] not in FILE_SUFFIXES}
    missing = sorted(d for d in names if not _resolves(d))
    assert missing == [], f"{page.name} names what autospec does not have: {missing}"


def test_every_relative_link_resolves():
    checked = 0
    broken = []
    for page in PAGES:
        text = CODE.sub("", page.read_text(encoding="utf-8"))  # links are outside code
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            checked += 1
            if not dest.exists():
                if rel not in PENDING:
                    broken.append(f"{page.name}: {target}")
                continue
            if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert checked >= 30  # the scan does find the links it checks
    assert broken == []


def test_the_readme_is_short_and_its_first_screen_shows_how_to_start():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200
    first_screen = "\n".join(lines[:60])
    for must in ("scripts/demo.sh", "scripts/test.sh", "```python",
                 "## The command line at a glance"):
        assert must in first_screen, must


FIGURE = re.compile(r"\d(?:\.\d+)?\s?×|\d\s?tok/s|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "benchmarks.md"],
                         ids=lambda p: p.name)
def test_measurements_live_in_the_benchmark_log(page):
    found = FIGURE.findall(page.read_text(encoding="utf-8"))
    assert found == [], f"{page.name} quotes figures or commits; move them to benchmarks.md"
    assert FIGURE.search("auto ran 1.34× at 6fc3253")  # the pattern finds what it must


def test_the_benchmark_log_is_dated_newest_first():
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    dates = re.findall(r"^## (\d{4}-\d{2}-\d{2}) ", text, re.M)
    assert len(dates) >= 5 and dates == sorted(dates, reverse=True)
