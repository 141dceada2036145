"""A test-time model zoo: tiny random-weight mlx-lm models of every model type mlx-lm ships.

Each family is written as an ordinary local mlx-lm model directory (config.json +
model.safetensors + the tokenizer files of kvtool's embedded `tiny` preset), so
`mlx_lm.load(path)` and `kvtool.models.loader.load_model(path)` load it unchanged. Configs:
`tests/zoo_configs.py` (explicit small configs, else a generic superset of field names).

Weights: every tensor of two or more dimensions is drawn uniformly, deterministically per
tensor name, with std `gain * scale / sqrt(fan_in)` (q/k/o projections gain 2, embeddings std
1); one-dimensional parameters keep the model's own initialisation (norm scales, biases, SSM
decay and step parameters), except gemma-style `1 + weight` norms (zeros) and mamba's S4D
`A_log`; lm_head rows of the special tokens are zeroed (greedy decoding never stops early).

A family is kept only if its output depends on the context: greedy tokens after the zoo prompt
must change when the prompt's first token changes, with finite logits. Otherwise the weights
are rescaled (`SCALES`) and checked again; a family that never qualifies, whose config does not
build, or whose model does not run is *not buildable* (`NotBuildable`, with the reason).

Built directories are cached under `<repo>/.cache/test-zoo/<family>-<digest>` (digest of the
config, this module's source, the seed and the mlx-lm version); a not-buildable verdict is
cached there too.
"""

from __future__ import annotations

import hashlib
import json
import math
import pkgutil
import shutil
from pathlib import Path

from tests.zoo_configs import FAMILIES, GENERIC

SEED = 0x7A6F  # "zo"
INIT_VERSION = "v2"
SCALES = (1.0, 2.0, 0.5, 4.0, 0.25)  # weight scales tried until the output depends on the first token
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_PARAMS = 4_000_000  # a config over this is not "small" (defaults the zoo's fields did not reach)
SENSITIVITY_TOKENS = 6
PROMPT_TOKENS = 150  # the zoo prompt (and the matrix's) is this long
# mlx_lm.models modules that are no model type
HELPERS = {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline", "gated_delta", "ssm", "mla",
           "bitlinear_layers"}
CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache" / "test-zoo"


class NotBuildable(Exception):
    """The family cannot be built small (its config, its model code, or its weights)."""


def model_types() -> list[str]:
    """Every model type (module) of the installed mlx-lm."""
    import mlx_lm.models as M

    return sorted(n for _, n, _ in pkgutil.iter_modules(M.__path__) if n not in HELPERS)


def _module_of(cfg: dict) -> str:
    from mlx_lm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(cfg["model_type"], cfg["model_type"])


def all_families() -> list[str]:
    """Zoo families: the explicit ones, then every other model type (built from `GENERIC`)."""
    covered = {_module_of(c) for c in FAMILIES.values()}
    return list(FAMILIES) + [m for m in model_types() if m not in covered and m not in FAMILIES]


def family_config(family: str) -> dict:
    return dict(FAMILIES[family]) if family in FAMILIES else dict(GENERIC, model_type=family)


def _config(family: str, vocab: dict[str, int], scale: float) -> dict:
    from kvtool.models import embedded

    cfg = family_config(family)
    cfg.update({
        "vocab_size": len(vocab),
        "torch_dtype": "float32",
        "eos_token_id": [vocab[t] for t in embedded.EOS_TOKENS],
        "pad_token_id": vocab["<|endoftext|>"],
        "bos_token_id": vocab["<|endoftext|>"],
        "kvtool_zoo_family": family,
        "kvtool_zoo_scale": scale,
    })  # fmt: skip
    return cfg


def _gain(name: str) -> float:
    for part in ("q_proj", "k_proj", "qkv_proj", "q_b_proj", "q_a_proj", "kv_a_proj", "kv_b_proj", "o_proj",
                 "out_proj"):
        if f"{part}." in name:
            return 2.0
    return 1.0


def _init(name: str, shape: tuple[int, ...], own, seed: int, family: str, scale: float):
    """The zoo's value of one parameter (`own`: the model's own initial value)."""
    import mlx.core as mx

    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    key = mx.random.key(int.from_bytes(digest, "little") >> 1)
    # Recurrent layers get a long memory (slow decay), so the first of 150 prompt tokens still
    # reaches the output: SSM A = -(1..N)/16, step sizes ~0.02, rwkv7 / RG-LRU decay gates near 1.
    if name.endswith("A_log"):
        return mx.broadcast_to(mx.log(mx.arange(1, shape[-1] + 1, dtype=mx.float32) / 16.0), shape)
    if name.endswith("dt_bias") and len(shape) == 1:
        return mx.full(shape, -4.0, dtype=mx.float32)
    if name.endswith("dt_proj.bias"):  # mamba: softplus^-1 of dt in [1e-3, 1e-2]
        dt = mx.exp(mx.random.uniform(math.log(1e-3), math.log(1e-2), shape, key=key))
        return dt + mx.log(-mx.expm1(-dt))
    if name.endswith("w_lora.lora.2.bias") or name.endswith("rg_lru.recurrent_param"):
        return mx.full(shape, -6.0, dtype=mx.float32)
    if len(shape) <= 1:
        return own.astype(mx.float32)
    if "embed" in name or name.endswith("wte.weight") or name.endswith("wpe.weight"):
        # gemma scales embeddings by sqrt(hidden); lfm2 ties them to the lm_head: keep both at std 1
        std = 1.0 / math.sqrt(shape[-1]) if family.startswith("gemma") or family == "lfm2" else 1.0
    else:
        fan_in = shape[-1]
        if "conv" in name and len(shape) == 3:
            fan_in = shape[1] * shape[2]
        std = _gain(name) * scale / math.sqrt(max(fan_in, 1))
    return mx.random.uniform(-1.0, 1.0, shape, dtype=mx.float32, key=key) * (std * math.sqrt(3.0))


def zoo_prompt(n: int = PROMPT_TOKENS) -> list[int]:
    """The first `n` token ids of kvtool's demo prompt under the zoo tokenizer (the matrix's prompt)."""
    from tokenizers import Tokenizer

    from kvtool.models import embedded

    tok = Tokenizer.from_file(str(embedded.ASSETS_DIR / "tokenizer.json"))
    text = (embedded.ASSETS_DIR / "demo_prompt.txt").read_text(encoding="utf-8")
    ids = tok.encode(text).ids
    assert len(ids) >= n
    return [int(t) for t in ids[:n]]


def greedy(model, ids, max_tokens: int, **kwargs) -> list[int]:
    """mlx-lm's greedy tokens (`generate_step` on a fresh cache), EOS not excluded."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens, **kwargs)]


def _sensitive(model, vocab_size: int, silent: set[int]) -> str | None:
    """None if greedy output depends on the first prompt token and logits are finite, else why not."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ids = zoo_prompt()
    logits = model(mx.array([ids[:16]]), cache=make_prompt_cache(model))
    if not bool(mx.all(mx.isfinite(logits))):
        return "non-finite logits"
    a = greedy(model, ids, SENSITIVITY_TOKENS)
    for k in range(1, 80, 4):  # up to 20 other first tokens: one of them must change the output
        first = (ids[0] + k) % (vocab_size - 3) + 3
        while first in silent:
            first = (first + 1) % vocab_size
        if greedy(model, [first] + ids[1:], SENSITIVITY_TOKENS) != a:
            return None
    return "greedy output does not depend on the first prompt token"


def _digest(family: str) -> str:
    import mlx_lm

    doc = json.dumps([family_config(family), INIT_VERSION, SEED, SCALES, PROMPT_TOKENS, mlx_lm.__version__,  # type: ignore[attr-defined]
                      hashlib.blake2b(Path(__file__).read_bytes()).hexdigest()], sort_keys=True, default=str)
    return hashlib.blake2b(doc.encode(), digest_size=6).hexdigest()


def build_family(family: str, dest: Path, seed: int = SEED) -> Path:
    """Write the model directory of `family` into `dest` (created; must not exist).

    Raises:
        NotBuildable: the config does not build, the model does not run, it is not small, or
            no weight scale makes its output depend on the context.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes as get_model_classes

    from kvtool.models import embedded
    from kvtool.models.loader import load_model as kv_load_model

    vocab = embedded.tokenizer_vocab()
    silent = {vocab[t] for t in embedded.SPECIAL_TOKENS}
    why = "no scale tried"
    for scale in SCALES:
        cfg = _config(family, vocab, scale)
        try:
            model_cls, args_cls = get_model_classes(cfg)
            mx.random.seed(seed)
            model = model_cls(args_cls.from_dict(cfg))
            params = sorted(tree_flatten(model.parameters()))
            n_params = sum(int(p.size) for _, p in params)
            if n_params > MAX_PARAMS:
                raise NotBuildable(f"{n_params:,} parameters with the zoo's config (not small)")
            weights = {}
            with mx.stream(mx.cpu):
                for name, p in params:
                    weights[name] = _init(name, tuple(p.shape), p, seed, family, scale).astype(p.dtype)
                for name in list(weights):
                    if name.endswith("lm_head.weight") and weights[name].shape[0] == len(vocab):
                        mask = mx.ones((weights[name].shape[0], 1), dtype=mx.float32)
                        mask[mx.array(sorted(silent))] = 0.0
                        weights[name] = weights[name] * mask
                mx.eval(weights)
            if dest.exists():
                shutil.rmtree(dest)
            _write(dest, cfg, weights)
            loaded = kv_load_model(str(dest)).model  # what every test loads (mlx_lm.load: sanitize, tokenizer)
            why = _sensitive(loaded, len(vocab), silent) or ""
        except NotBuildable:
            raise
        except BaseException as exc:  # noqa: BLE001 - mlx-lm model code may raise anything (even SystemExit)
            if isinstance(exc, KeyboardInterrupt):
                raise
            cause = exc.__cause__ or exc  # (kvtool's ModelLoadError names the temporary path: its cause does not)
            where = "mlx_lm.load: " if cause is not exc else ""
            why = f"{where}{type(cause).__name__}: {str(cause).splitlines()[0][:160] if str(cause) else ''}"
            break
        if not why:
            return dest
    if dest.exists():
        shutil.rmtree(dest)
    raise NotBuildable(why)


def _write(dest: Path, cfg: dict, weights: dict) -> None:
    import mlx.core as mx

    from kvtool.models import embedded

    dest.mkdir(parents=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    src = embedded.model_dir("tiny")
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copyfile(src / f, dest / f)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))


def family_dir(family: str, root: Path | None = None) -> Path:
    """The (cached) model directory of `family`, built on first use.

    Raises:
        NotBuildable: see `build_family` (the verdict is cached next to where the model would be).
    """
    root = root or CACHE_DIR
    d = root / f"{family}-{_digest(family)}"
    marker = root / f"{family}-{_digest(family)}.not-buildable"
    if (d / "config.json").exists():
        return d
    if marker.exists():
        raise NotBuildable(marker.read_text(encoding="utf-8"))
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{d.name}.{__import__('os').getpid()}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        build_family(family, tmp)
    except NotBuildable as exc:
        marker.write_text(str(exc), encoding="utf-8")
        raise
    try:
        tmp.rename(d)
    except OSError:  # built meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def build_zoo(root: Path | None = None, families=None) -> dict[str, Path]:
    """Build every family (or `families`); returns family -> model directory for those that
    build (see `not_buildable` for the others)."""
    out = {}
    for fam in families or all_families():
        try:
            out[fam] = family_dir(fam, root)
        except NotBuildable:
            continue
    return out


def not_buildable(root: Path | None = None, families=None) -> dict[str, str]:
    """family -> why it is not buildable (cached verdicts; builds what was never tried)."""
    out = {}
    for fam in families or all_families():
        try:
            family_dir(fam, root)
        except NotBuildable as exc:
            out[fam] = str(exc)
    return out
