"""Resolve a model spec (local directory, embedded preset, Hugging Face id) and load it with mlx-lm.

Resolution order of `load_model(spec)`:
1. `Path(spec).expanduser()` exists: a local mlx-lm model directory.
2. `spec` is an embedded preset (`kvtool.models.embedded.PRESETS`): built if needed, then loaded.
3. `spec` looks like a Hub id (`org/name`): downloaded by mlx-lm (needs a network).
4. Otherwise: `ModelLoadError("model path not found: ...")`.

Every model gets a `model_id`: blake2b-128 hex of config.json and the weight files (plus adapter
files), cached in `<models_root>/model_ids.json` keyed by each file's (path, inode, size, mtime, ctime).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.models import embedded

HUB_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+\Z")
DIGEST_SIZE = 16  # bytes: blake2b-128
DEFAULT_CHUNK_BYTES = 8 << 20
DIGEST_CACHE_FILE = "model_ids.json"
DEFAULT_DIGEST_CACHE_ENTRIES = 64
MAX_ERROR_CHARS = 300


class ModelLoadError(Exception):
    """The model spec cannot be resolved or loaded; the message is one line."""


@dataclass
class LoadedModel:
    """A loaded mlx-lm model and what identifies it.

    Attributes:
        model: The mlx-lm `nn.Module`.
        tokenizer: mlx-lm `TokenizerWrapper`.
        name: Preset name, directory name or Hub id.
        path: Local model directory (None only if unknown).
        model_id: blake2b-128 hex digest of config.json + weights (+ adapters).
    """

    model: Any
    tokenizer: Any
    name: str
    path: Path | None
    model_id: str


def load_model(spec: str, adapter_path: str | None = None) -> LoadedModel:
    """Resolve `spec` and load it with `mlx_lm.load`.

    Args:
        spec: Local mlx-lm model directory, embedded preset name, or Hugging Face id `org/name`.
        adapter_path: Optional LoRA adapter directory passed to mlx-lm.

    Raises:
        ModelLoadError: If the spec matches nothing, or building, downloading or loading fails.
    """
    path, name = resolve_spec(spec)
    if adapter_path is not None and not Path(adapter_path).expanduser().exists():
        raise ModelLoadError(f"adapter path not found: {adapter_path}")
    adapter = str(Path(adapter_path).expanduser()) if adapter_path else None
    try:
        import mlx_lm

        model, tokenizer, *_ = mlx_lm.load(str(path), adapter_path=adapter)  # (a config third only with return_config)
        model_id = compute_model_id(path, adapter)
    except Exception as exc:  # noqa: BLE001 - any loader failure becomes one clean line
        raise ModelLoadError(f"cannot load model {spec!r} from {path}: {_one_line(exc)}") from exc
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=path, model_id=model_id)


def kv_quantization_problem(model: Any, bits: int | None, group_size: int) -> str | None:
    """Why mlx cannot quantize `model`'s KV cache with `bits` / `group_size`: one line naming the
    head dim and the group size; None if it can, or `bits` is None. Checked at load (the head dims
    of every `KVCache` layer after one token, each run through `mx.quantize` as mlx-lm's
    `QuantizedKVCache` does), so a command refuses the settings before any prefill instead of
    failing with a traceback once a prompt reaches `--quantized-kv-start`."""
    if bits is None:
        return None
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    stack: list[Any] = list(cache)
    dims: set[int] = set()
    while stack:
        c = stack.pop()
        stack.extend(getattr(c, "caches", ()) or ())
        if isinstance(c, KVCache) and c.keys is not None:
            dims.update((int(c.keys.shape[-1]), int(c.values.shape[-1])))
    for dim in sorted(dims):
        try:
            mx.eval(mx.quantize(mx.zeros((1, dim)), group_size=group_size, bits=bits))
        except ValueError:
            return (f"--kv-bits {bits} --kv-group-size {group_size}: the model's KV head dim is {dim}, which mlx "
                    f"cannot quantize in groups of {group_size} (a group size must divide it and be 32, 64 or 128)")
    return None


def resolve_spec(spec: str) -> tuple[Path, str]:
    """Return (local model directory, display name) for `spec`, building or downloading if needed.

    Raises:
        ModelLoadError: If the spec matches nothing or the build / download fails.
    """
    local = Path(spec).expanduser()
    if spec and local.exists():
        return local.resolve(), local.resolve().name
    if embedded.is_preset(spec):
        try:
            return embedded.model_dir(spec), spec
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"cannot build model preset {spec!r}: {_one_line(exc)}") from exc
    if is_hub_id(spec):
        return _download(spec), spec
    raise ModelLoadError(f"model path not found: {spec} (not a directory, preset or Hugging Face id)")


def is_hub_id(spec: str) -> bool:
    """True if `spec` looks like a Hugging Face repo id: `org/name`, one slash, no path prefix."""
    return bool(HUB_ID_RE.match(spec)) and not spec.startswith((".", "/", "~"))


def _download(repo_id: str) -> Path:
    """Fetch `repo_id` as mlx-lm's `load` does (Hugging Face cache): the downloader `mlx_lm.utils`
    binds (`huggingface_hub.snapshot_download`, ModelScope's with `MLXLM_USE_MODELSCOPE=true`) for
    the files mlx-lm fetches (`DEFAULT_ALLOW_PATTERNS`).

    Raises:
        ModelLoadError: On any failure (no network, unknown repo, ...).
    """
    try:
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS, snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot download model {repo_id!r}: {_one_line(exc)}") from exc


def model_files(path: Path, adapter_path: str | None = None) -> list[Path]:
    """Files that define a model: config.json, *.safetensors sorted, then adapter files sorted.

    Raises:
        FileNotFoundError: If `path/config.json` is missing.
    """
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(2, "No such file", str(config))
    files = [config, *sorted(path.glob("*.safetensors"))]
    if adapter_path:
        adapter = Path(adapter_path)
        files += sorted(p for p in adapter.glob("*") if p.suffix in (".json", ".safetensors") and p.is_file())
    return files


def compute_model_id(path: Path, adapter_path: str | None = None) -> str:
    """The blake2b-128 digest (32 hex characters) of `model_files(path, adapter_path)`, from the
    sidecar cache when its signature still matches.

    Raises:
        FileNotFoundError: If config.json is missing.
    """
    files = model_files(path, adapter_path)
    signature = _signature(files)
    cached = _read_digest_cache().get(signature)
    if cached:
        return cached
    model_id = digest_files(files)
    _write_digest_cache(signature, model_id)
    return model_id


def digest_files(files: list[Path]) -> str:
    """blake2b-128 hex of each file's name, size and bytes, in the given order."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(DEFAULT_CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()


def _signature(files: list[Path]) -> str:
    """Cache key: digest of (absolute path, device, inode, size, mtime_ns, ctime_ns) of every file.

    ctime cannot be set from user space (`os.utime` changes only atime/mtime, and itself moves
    ctime), so a weight file edited in place with its size and mtime restored gets a new key and
    is digested again (a stale model id would serve the old namespace's KV).
    """
    stats = [
        (str(f.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        for f in files
        for st in [f.stat()]
    ]
    return hashlib.blake2b(json.dumps(stats).encode(), digest_size=DIGEST_SIZE).hexdigest()


def _digest_cache_path() -> Path:
    return embedded.models_root() / DIGEST_CACHE_FILE


def _read_digest_cache() -> dict[str, str]:
    """Return the sidecar cache (signature -> model_id); empty if missing or unreadable."""
    try:
        doc = json.loads(_digest_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_digest_cache(signature: str, model_id: str) -> None:
    """Add one entry (keeping the newest `DEFAULT_DIGEST_CACHE_ENTRIES`); atomic, best effort."""
    cache = _read_digest_cache()
    cache.pop(signature, None)
    cache[signature] = model_id
    cache = dict(list(cache.items())[-DEFAULT_DIGEST_CACHE_ENTRIES:])
    target = _digest_cache_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{DIGEST_CACHE_FILE}.", suffix=".tmp", dir=target.parent)
    except OSError:
        return  # a cache: losing it only costs a re-hash
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(cache, fh)
        os.replace(tmp, target)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def _one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, shortened to `MAX_ERROR_CHARS`."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text[:MAX_ERROR_CHARS]
