"""The GPU benchmark's dry run (scripts/gpu_bench.py --tiny) end to end on the CPU, and the GPU
path's imports on a machine that has only torch and transformers (the device check's case)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "scripts" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_benchmark_runs_every_section(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = _load_bench().main(["--tiny", "--alphas", "0.8", "--ks", "1,3", "--batches", "1,2",
                             "--repeats", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    curve = res["sections"]["curve"]
    assert set(curve["target_s_by_n"]) == {str(n) for n in range(1, 7)}
    e2e = res["sections"]["end_to_end"]
    assert set(e2e) == {"a=0.8", "random"}
    modes = {r["mode"] for r in e2e["a=0.8"]}
    assert {"plain", "hf-plain", "hf-assisted", "eager:4", "k=1", "k=3", "auto"} <= modes
    assert all(r["identical"] for rows in e2e.values() for r in rows)
    k3 = next(r for r in e2e["a=0.8"] if r["mode"] == "k=3")
    assert abs(k3["alpha"] - 0.8) < 0.15 and k3["predicted_speedup"] > 0
    assert [b["batch"] for b in res["sections"]["batch"]] == [1, 2]
    assert res["goals"] and not res["skipped"]
    text = capsys.readouterr().out
    assert "1. Cost curve" in text and "3. Verification cost against batch size" in text


def test_gpu_path_needs_no_store_dependencies(tmp_path):
    # the device machine has torch and transformers only: the loop, the static path, the
    # controlled pairs and the benchmark must import and run without SQLAlchemy & co.
    for name in ("sqlalchemy", "alembic", "optuna", "gguf", "pynvml"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    code = textwrap.dedent(f"""
        import importlib.util, torch
        import autospec
        from autospec.testing.controlled import controlled_pair, qwen2_config
        spec = importlib.util.spec_from_file_location("b", {str(ROOT / "scripts" / "gpu_bench.py")!r})
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        t, d, _ = controlled_pair(qwen2_config("tiny"), qwen2_config("tiny"), 0.8)
        ctrl = autospec.Controller(t, d, store=False, static_cache=True, cuda_graphs="emulate")
        ctrl.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, k=2)
        assert ctrl.last_stats.path == "static+emulate"
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "tests")]))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_device_check_script_parses():
    res = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
