"""mlx-lm prompt-cache files and their inputs: the file, its token ids, its model (the file-level
half of `kvtool.jobs.interop`). Errors are `InteropError` (one line, exit 2 unless set).

Token ids: mlx-lm's metadata holds no token ids (only `model` and `tokenizer_config`), so the
prompt is tokenised here exactly as `mlx_lm.cache_prompt` does (`cache_prompt_tokens`): with a
chat template, the prompt is one user message rendered with `add_generation_prompt=False,
continue_final_message=True` and tokenised by the template (the cache ends inside the user
message, where `mlx_lm.generate --prompt-cache-file` appends its own prompt); without one,
`tokenizer.encode(prompt)`. Files written by `kvtool export` also carry their token ids
(metadata `kvtool_token_ids`), so they import without a prompt.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.errors import KVToolError

SUFFIX = ".safetensors"  # mx.load picks the format by extension; mx.save_safetensors appends it
KV_DIGEST_KEY = "kvtool_kv_digest"  # metadata: `kv_digest` of an exported file

# ImportReport.token_source values -> how the tokens were obtained
TOKEN_SOURCES = {
    "prompt_chat_template": "the prompt in the chat template, as mlx_lm.cache_prompt tokenises it",
    "prompt_raw": "the prompt as raw text: tokenizer.encode(text)",
    "token_ids": "the --token-ids list",
    "metadata": "the file's kvtool_token_ids",
}


class InteropError(KVToolError):
    """An import or export that cannot be done; the message is one line (exit 2 unless set)."""


@dataclass
class ModelCheck:
    """Is the file's model (metadata `model`) the loaded one?

    Attributes:
        status: 'match' | 'mismatch' | 'unknown' (cannot be verified) | 'skipped'.
        detail: how it was decided, one line.
    """

    status: str
    detail: str


# --------------------------------------------------------------------------- tokens
def cache_prompt_tokens(tokenizer, text: str, *, chat_template: bool = True,
                        system_prompt: str | None = None) -> list[int]:
    """Token ids of `text` as `mlx_lm.cache_prompt` computes them (see the module docstring).

    Args:
        tokenizer: mlx-lm `TokenizerWrapper`.
        text: the prompt, taken literally (cache_prompt unescapes nothing).
        chat_template: use the tokenizer's chat template if it has one (cache_prompt always
            does); False: `tokenizer.encode(text)` (`mlx_lm.generate --ignore-chat-template`).
        system_prompt: a system message first (chat template only; what
            `mlx_lm.generate --system-prompt` keeps in front of a cached prefix).

    Raises:
        InteropError: `system_prompt` without a chat template.
    """
    has_template = bool(getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None))
    if chat_template and has_template:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    if system_prompt is not None:
        raise InteropError("--system-prompt needs the chat template (the tokenizer has none, or "
                           "--ignore-chat-template was given)")
    return [int(t) for t in tokenizer.encode(text)]


def parse_token_ids(text: str, where: str) -> list[int]:
    """A JSON list of token ids, or an object with a `token_ids` list.

    Raises:
        InteropError: not JSON, not a list of non-negative ints, or empty.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InteropError(f"{where}: invalid JSON: {exc.msg}") from None
    if isinstance(doc, dict):
        doc = doc.get("token_ids")
    if (not isinstance(doc, list) or not doc
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in doc)):
        raise InteropError(f"{where}: expected a non-empty JSON list of token ids (or {{\"token_ids\": [...]}})")
    return [int(t) for t in doc]


def read_token_ids(path: str | Path) -> list[int]:
    """`parse_token_ids` of a file (`-`: stdin).

    Raises:
        InteropError: unreadable file or bad content.
    """
    if str(path) == "-":
        return parse_token_ids(sys.stdin.read(), "stdin")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InteropError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return parse_token_ids(text, str(path))


# --------------------------------------------------------------------------- files
def resolve_cache_file(path: str | Path) -> Path:
    """The file to import: `path`, or `path.safetensors` (mlx-lm appends the suffix when saving).

    Raises:
        InteropError: missing, not a file, or not named `*.safetensors`.
    """
    p = Path(path).expanduser()
    if not p.exists() and p.suffix != SUFFIX and Path(str(p) + SUFFIX).is_file():
        p = Path(str(p) + SUFFIX)
    if not p.exists():
        raise InteropError(f"file not found: {path}")
    if not p.is_file():
        raise InteropError(f"not a file: {path}")
    if p.suffix != SUFFIX:
        raise InteropError(f"{path}: not a {SUFFIX} file (mlx-lm prompt caches are; mx.load picks the format by the suffix)")
    return p


def load_cache_file(path: str | Path) -> tuple[list, dict[str, str]]:
    """`mlx_lm.models.cache.load_prompt_cache(path, return_metadata=True)`, errors as one line; a
    file that carries a `kvtool_kv_digest` (written by `kvtool export`) must match it.

    Raises:
        InteropError: missing, unreadable or not an mlx-lm prompt cache; or its KV and token ids
            do not match its digest: damaged or edited since it was written (its KV would be
            imported unchecked where the KV check recomputes no position).
    """
    from mlx_lm.models.cache import load_prompt_cache

    p = resolve_cache_file(path)
    try:
        cache, metadata = load_prompt_cache(str(p), return_metadata=True)
    except KeyError as exc:
        raise InteropError(f"{path}: cache class {exc} is unknown to the installed mlx-lm") from None
    except Exception as exc:  # noqa: BLE001 - mx.load / unpacking errors: not a prompt cache
        text = " ".join(str(exc).split())[:300]
        raise InteropError(f"{path}: not an mlx-lm prompt cache file ({text})") from None
    if not isinstance(cache, list) or not cache:
        raise InteropError(f"{path}: the prompt cache has no layers")
    metadata = dict(metadata or {})
    if KV_DIGEST_KEY in metadata and kv_digest(cache, file_token_ids(metadata) or []) != metadata[KV_DIGEST_KEY]:
        raise InteropError(f"{path}: the KV and token ids do not match the file's {KV_DIGEST_KEY}: the file was "
                           "damaged or edited since kvtool export wrote it")
    return cache, metadata


def file_token_ids(metadata: dict[str, str]) -> list[int] | None:
    """Token ids a kvtool-exported file carries (metadata `kvtool_token_ids`), else None."""
    raw = metadata.get("kvtool_token_ids")
    if raw is None:
        return None
    return parse_token_ids(raw, "metadata kvtool_token_ids")


def file_quantization(cache: list) -> tuple[int, int] | None:
    """(bits, group_size) of a file of `QuantizedKVCache` layers, else None (classes unchecked)."""
    from mlx_lm.models.cache import QuantizedKVCache

    q = [c for c in cache if isinstance(c, QuantizedKVCache)]
    return (int(q[0].bits), int(q[0].group_size)) if q else None


# --------------------------------------------------------------------------- digest
def kv_digest(cache: list, token_ids: Sequence[int]) -> str:
    """The checksum (xxh3-128, 32 hex digits) of a prompt cache as its file holds it: the token ids
    (int32) and each layer's class and state arrays (name, dtype, shape, bytes), in file order.
    `kvtool export` writes it as metadata `kvtool_kv_digest`; `load_cache_file` compares. It
    detects a damaged or edited file, not a forged one (whoever edits can recompute it)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from kvtool.disk.verify import record_checksum

    pieces = [np.asarray(token_ids, dtype="<i4").tobytes()]
    for c in cache:
        pieces.append(type(c).__name__.encode())
        flat: list[tuple[str, Any]] = tree_flatten(c.state)  # type: ignore[assignment]
        for name, a in flat:
            if not isinstance(a, mx.array):
                pieces.append(f"{name}={a!r}".encode())
                continue
            pieces.append(f"{name}:{a.dtype}:{tuple(a.shape)}".encode())
            host = np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)  # (numpy has no bfloat16)
            pieces.append(np.ascontiguousarray(host).tobytes())
    return record_checksum(pieces)


def digest_warning(metadata: dict[str, str], path: str | Path) -> str | None:
    """A warning for a file that carries kvtool's token ids but no `kvtool_kv_digest` (an export of
    an older kvtool, or the digest removed: `load_cache_file` could not check its KV), else None
    (no digest in an mlx-lm file is normal)."""
    if KV_DIGEST_KEY not in metadata and "kvtool_token_ids" in metadata:
        return (f"{path} carries no {KV_DIGEST_KEY} (exported by an older kvtool?): its KV is checked "
                "at the KV check's positions only")
    return None


# --------------------------------------------------------------------------- model identity
def check_model(file_model: str | None, model_spec: str, loaded, adapter_path: str | None = None) -> ModelCheck:
    """Decide whether the file's metadata `model` names the loaded model.

    Match: the same spec string, the same directory, or a local directory (or a Hub id whose
    snapshot is in the local Hugging Face cache) whose config + weights digest equals the loaded
    model's `model_id`. Nothing is downloaded.
    """
    from kvtool.models.loader import compute_model_id, is_hub_id

    if not file_model:
        return ModelCheck("unknown", "the file's metadata names no model")
    if file_model == model_spec:
        return ModelCheck("match", f"same model spec {file_model!r}")
    here = Path(loaded.path).resolve() if loaded.path is not None else None
    local = Path(file_model).expanduser()
    if local.is_dir():
        candidate = local.resolve()
    elif is_hub_id(file_model):
        try:
            from huggingface_hub import snapshot_download

            candidate = Path(snapshot_download(file_model, local_files_only=True)).resolve()
        except Exception:  # noqa: BLE001 - not in the local cache: cannot verify
            return ModelCheck("unknown", f"the file's model {file_model!r} is a Hub id not in the local cache")
    else:
        return ModelCheck("unknown", f"the file's model {file_model!r} is not a directory here")
    if here is not None and candidate == here:
        return ModelCheck("match", f"same model directory {here}")
    try:
        other = compute_model_id(candidate, adapter_path)
    except OSError as exc:
        return ModelCheck("unknown", f"cannot digest {candidate}: {getattr(exc, 'strerror', None) or exc}")
    if other == loaded.model_id:
        return ModelCheck("match", f"{file_model} has the same weights digest ({other[:12]})")
    return ModelCheck("mismatch", f"the file was made with {file_model} (weights {other[:12]}), not the loaded "
                                  f"model {model_spec} (weights {loaded.model_id[:12]})")


def metadata_model_for(model_spec: str, loaded) -> str:
    """What to write as metadata `model`: the Hub id for a Hub model, else the model directory
    (mlx_lm.generate loads it when --model is omitted, and refuses a different --model string)."""
    from kvtool.models.loader import is_hub_id

    if is_hub_id(model_spec) and not Path(model_spec).expanduser().exists():
        return model_spec
    return str(loaded.path) if loaded.path is not None else model_spec


__all__ = [
    "SUFFIX", "KV_DIGEST_KEY", "TOKEN_SOURCES", "InteropError", "kv_digest", "digest_warning", "ModelCheck", "cache_prompt_tokens", "parse_token_ids", "read_token_ids",
    "resolve_cache_file", "load_cache_file", "file_token_ids", "file_quantization", "check_model",
    "metadata_model_for",
]
