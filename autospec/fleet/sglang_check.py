"""SGLang's own argument parser, for ``autospec export --engine sglang --check``.

SGLang does not install on a CPU-only machine in any reasonable time (its dependencies are
CUDA builds), but its server-argument parser (``sglang.srt.server_args.prepare_server_args``)
is pure Python. The checker is therefore the SGLang wheel from PyPI unpacked without its
dependencies into the cache directory (``sglang-<version>-parser``), plus the three pure-Python
modules its import chain needs that the vLLM environment lacks (orjson, IPython, traitlets),
run by the vLLM environment's interpreter (``autospec.fleet.engines``: torch, transformers,
pydantic and msgspec come from there) with the unpacked wheel on ``PYTHONPATH``. Only the
parser runs: SGLang's launch-time checks that need a GPU do not.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["SGLANG_VERSION", "sglang_checker_dir", "build_sglang_checker", "check_sglang"]

SGLANG_VERSION = "0.5.23"
EXTRA = ("orjson", "ipython", "traitlets")
READY = ".autospec-ready"
BUILD_COMMAND = "autospec export --engine sglang --build-checker"


def sglang_checker_dir(cache: str | os.PathLike | None = None) -> Path:
    from autospec.pairs import cache_dir

    return cache_dir(cache) / f"sglang-{SGLANG_VERSION}-parser"


def build_sglang_checker(cache: str | os.PathLike | None = None) -> tuple[Path, float]:
    """Unpack SGLang's wheel and the modules its parser needs; (the directory, seconds)."""
    from autospec.fleet.engines import EngineEnvError, build_vllm_env

    root = sglang_checker_dir(cache)
    if (root / READY).is_file():
        return root, 0.0
    start = time.perf_counter()
    py, _ = build_vllm_env(cache)  # the interpreter it runs with (built first where missing)
    if root.exists():
        shutil.rmtree(root)
    dl = root / "download"
    for argv in ([str(py), "-m", "pip", "download", "--no-deps", "-d", str(dl),
                  f"sglang=={SGLANG_VERSION}"],
                 [str(py), "-m", "pip", "install", "--no-deps", "--target", str(root / "deps"),
                  *EXTRA]):
        log.info("SGLang checker: %s", " ".join(argv))
        r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            tail = (r.stderr or "").strip().splitlines()[-1:]
            raise EngineEnvError(f"building the SGLang checker failed at `{' '.join(argv)}`"
                                 + (f": {tail[0]}" if tail else ""))
    (wheel,) = dl.glob("sglang-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root / "src")
    wheel.unlink()
    (root / READY).write_text(f"sglang=={SGLANG_VERSION}\n", encoding="utf-8")
    took = time.perf_counter() - start
    log.info("SGLang checker built at %s in %.0f s", root, took)
    return root, took


def check_sglang(jobs: list[list[str]], *, cache: str | os.PathLike | None = None,
                 timeout: float = 600.0):
    """SGLang's parser on each exported command line (``python -m sglang.launch_server …``)."""
    from autospec.fleet.check import CheckError, CheckResult, run_checker
    from autospec.fleet.engines import vllm_python

    root = sglang_checker_dir(cache)
    py = vllm_python(cache)
    if py is None or not (root / READY).is_file():
        raise CheckError(f"cannot check sglang here: no SGLang checker (build it with "
                         f"`{BUILD_COMMAND}`: the vLLM environment, then SGLang's wheel "
                         f"without its CUDA dependencies)")
    args = []
    for argv in jobs:
        if argv[:3] != ["python", "-m", "sglang.launch_server"]:
            raise CheckError(f"not an SGLang export: {' '.join(argv[:3])}")
        args.append(argv[3:])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "deps")])}
    script = Path(__file__).with_name("_sglang_check.py")
    start = time.perf_counter()
    raw = run_checker(py, script, args, env=env, timeout=timeout, engine="SGLang",
                      build=BUILD_COMMAND)
    took = time.perf_counter() - start
    out = []
    for res in raw:
        if res["ok"]:
            out.append(CheckResult("sglang", True, f"SGLang {SGLANG_VERSION}'s parser accepts "
                                   f"the flags (algorithm {res['algorithm']})", took / len(raw),
                                   res))
        else:
            out.append(CheckResult("sglang", False, f"SGLang {SGLANG_VERSION}'s parser refuses "
                                   f"the export: {res['error']}", took / len(raw), res))
    return out
