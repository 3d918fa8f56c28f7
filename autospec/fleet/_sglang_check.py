"""Run by the vLLM environment's interpreter with the unpacked SGLang wheel on ``PYTHONPATH``
(``autospec.fleet.sglang_check``), never imported by autospec: standard library and SGLang.

    python _sglang_check.py JOBS.json RESULTS.json

Each job: the exported command's arguments after ``python -m sglang.launch_server``. SGLang's
own ``prepare_server_args`` parses them (its argparse parser refuses an unknown flag or a bad
value; ``ServerArgs`` is built from them), then ``SpeculativeAlgorithm.from_string`` names the
algorithm. The launch-time hooks that need a GPU (memory, CUDA graphs) are not run.

Each result: ``{"ok": bool, "error": one line or null, "algorithm": name}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def check(argv: list[str]) -> dict:
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    err = io.StringIO()
    out = {"ok": False, "error": None, "algorithm": None}
    try:
        with contextlib.redirect_stderr(err):
            args = prepare_server_args(list(argv))
        algo = SpeculativeAlgorithm.from_string(args.speculative_algorithm)
        out["algorithm"] = getattr(algo, "name", str(algo))
        out["ok"] = True
    except SystemExit:  # argparse: its message is the last line it wrote
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        out["error"] = lines[-1] if lines else "the argument parser refused the flags"
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
    return out


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as f:
        jobs = json.load(f)
    results = [check(job) for job in jobs]
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
