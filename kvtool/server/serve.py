"""mlx-lm's own OpenAI-compatible HTTP server with kvtool's tiered prefix cache injected.

`mlx_lm.server.ModelProvider` loads the model, `mlx_lm.server.ResponseGenerator` runs the
generation thread and `mlx_lm.server.APIHandler` answers the routes, as in `mlx_lm.server`. The
differences: the prompt cache is a `KVToolPromptCache` (`kvtool.server.adapter`); the model is
loaded before the generation thread starts (its KV layout and weight digest name the namespace);
`GET /kvtool/stats` and `GET /metrics` (`kvtool.prom`); the handler checks requests first
(`kvtool.server.handler`, `kvtool.server.validation`); the generation thread restarts when its
loop raises (`kvtool.server.watchdog`); the socket and the shutdown are owned here (`close`:
stop the HTTP server and the generation thread, drain the SSD writer, close the index).

    server = KVToolServer("tiny", KVToolConfig(), port=0)
    threading.Thread(target=server.serve_forever).start()
    ... requests to server.url ...
    status = server.close()        # stop accepting, stop generating, drain, close the index
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtool.config import KVToolConfig
from kvtool.models.limits import TokenLimitError, token_limits
from kvtool.prom import CacheMetrics
from kvtool.server import validation
from kvtool.server.adapter import KVToolPromptCache
from kvtool.server.admission import Admission, default_prefill_token_budget, window_from_env
from kvtool.server.handler import (
    HEAD_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_PEER,
    STATS_PATH,
    KVToolHTTPServer,
    make_handler_class,
)
from kvtool.server.validation import Limits
from kvtool.tiers.stack import ShutdownStatus

log = logging.getLogger("kvtool.server")

GENERATION_STOP_TIMEOUT_S = 60.0


def server_args(**overrides: Any) -> argparse.Namespace:
    """`mlx_lm.server`'s `cli_args`: the defaults of its command line (`mlx_options.defaults`)
    with `overrides` applied.

    Raises:
        ValueError: an override that is not one of mlx-lm's server options.
    """
    from kvtool.server.mlx_options import defaults

    args = defaults()
    unknown = sorted(set(overrides) - set(args))
    if unknown:
        raise ValueError(f"not mlx_lm.server options: {', '.join(unknown)}")
    args.update(overrides)
    return argparse.Namespace(**args)


class ServerStartError(Exception):
    """The model could not be loaded or the address could not be bound (one-line message)."""


class KVToolServer:
    """A loaded model, its `PrefixCache`, mlx-lm's generation thread and HTTP server.

    Args:
        model: embedded preset, local mlx-lm model directory or Hugging Face id.
        config: kvtool cache settings.
        host, port: address to listen on (port 0: any free port, see `port`).
        adapter_path: LoRA adapter directory (part of the model identity and the layout key).
        max_prompt_tokens: longest prompt served (tokens, after the chat template; longer: 413).
            None: the model's context length, at most `kvtool.models.limits.MAX_PROMPT_TOKENS_CAP`.
        max_body_bytes: largest request body (bytes; larger: 413).
        head_timeout_s: seconds the whole request head may take to arrive (also the idle time
            of a keep-alive connection); past it the connection is closed.
        max_connections_per_peer: connections served at once from one client address (more are
            answered 503 and closed; all addresses together: `MAX_CONNECTIONS`).
        prefill_token_budget: `PrefillSlots`' token budget (uncached prompt tokens); 0: none;
            None: `default_prefill_token_budget()`.
        api_key: when given, every request must carry it (401 otherwise; `apis.check_api_key`).
        **server_options: other `mlx_lm.server` options (every option of its parser,
            `kvtool.server.mlx_options`). `kv_bits` (with `kv_group_size`, `quantized_kv_start`)
            also makes the prefix cache hold mlx-lm's quantized KV (its own namespace);
            `draft_model` uses `SpeculativePromptCache`.

    Raises:
        ServerStartError: the model does not load, the address cannot be bound, the default
            `max_tokens` exceeds the model's context length, `kv_bits` / `kv_group_size` do
            not quantize the model's KV head dims, or `KVTOOL_ADMISSION_WINDOW_MS` is not a
            number of milliseconds >= 0 (`kvtool.server.admission`).
        ValueError: an unknown server option.
    """

    def __init__(self, model: str, config: KVToolConfig, *, host: str = "127.0.0.1", port: int = 8080,
                 adapter_path: str | None = None, max_prompt_tokens: int | None = None,
                 max_body_bytes: int = validation.DEFAULT_MAX_BODY_BYTES, head_timeout_s: float = HEAD_TIMEOUT_S,
                 max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER, api_key: str | None = None,
                 prefill_token_budget: int | None = None, **server_options: Any):
        from kvtool.cache.prefix import PrefixCache
        from kvtool.server.watchdog import KVToolResponseGenerator, RequestGuard

        self.spec = model
        cli_args = server_args(host=host, port=port, **server_options)  # ValueError before any loading
        self.prefill_width: int = cli_args.prompt_concurrency  # prompts prefilled at a time, at most
        self.prefill_token_budget: int = (default_prefill_token_budget() if prefill_token_budget is None
                                          else max(0, prefill_token_budget))
        admission = _admission()  # a bad KVTOOL_ADMISSION_WINDOW_MS fails before any loading
        path, name, adapter = _resolve_models(cli_args, model, adapter_path)
        quant = _quantization(cli_args)
        self.model_name = name
        self.model_path = path
        self.provider, model_id = _load_provider(cli_args, model, path, adapter)
        names = self._alias(model, Path(path), adapter)
        self.limits = self._limits(names, max_prompt_tokens, max_body_bytes, cli_args.max_tokens)
        guard = RequestGuard(self.limits, self.provider.tokenizer, admission)
        self.prefix_cache = PrefixCache.for_model(self.provider.model, config, model_id=model_id, model_name=name,
                                                  quant=quant)
        self.metrics = CacheMetrics(self._metrics_snapshot)
        # the model: windowed / state-layer models are prefilled by kvtool at fetch (kvtool.server.adapter)
        own = dict(model_key=self.provider.model_key, on_record=self.metrics.observe, model=self.provider.model,
                   prefill_step=cli_args.prefill_step_size)
        self.cache: KVToolPromptCache = (SpeculativePromptCache(self.prefix_cache, self.provider, **own)
                                         if self.provider.draft_model is not None
                                         else KVToolPromptCache(self.prefix_cache, **own))  # fmt: skip
        try:
            try:
                self.httpd = self._bind(host, port, make_handler_class(self.cache, guard, self.metrics))
            except OSError as exc:
                raise ServerStartError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
            self.httpd.kvtool_head_timeout_s = head_timeout_s
            self.httpd.kvtool_max_per_peer = max_connections_per_peer
            self.httpd.kvtool_api_key = api_key or None
            self.api_key_required = bool(api_key)  # for the start line; the key itself stays with the listener
            # starts the generation thread
            self.generator = KVToolResponseGenerator(self.provider, self.cache,
                                                     max_prompt_tokens=self.limits.max_prompt_tokens,
                                                     admission=guard.admission,
                                                     prefill_token_budget=self.prefill_token_budget)
            self.httpd.kvtool_holder["generator"] = self.generator
        except BaseException:  # a bind error or a signal: the index is still closed cleanly
            generator = getattr(self, "generator", None)
            if generator is not None:
                generator.request_stop()
            self.cache.close()
            raise
        self._closed: ShutdownStatus | None = None
        self._close_lock = threading.Lock()
        self._serving = threading.Event()

    def _alias(self, spec: str, path: Path, adapter: str | None) -> tuple[str, ...]:
        """Let clients name the model as given on the command line (`"model": "tiny"`) or by its
        path (as given or resolved), besides mlx-lm's `default_model`: each name maps to the
        loaded model and adapter (ModelProvider's name maps). Returns the names, the command
        line's first; requests naming anything else are refused (404)."""
        names = tuple(dict.fromkeys((spec, str(path), str(path.resolve()), "default_model")))
        # mlx-lm 0.32.2 has no public way to add a model name: its ModelProvider's private name maps
        for attr, value in (("_model_map", str(path)), ("_adapter_map", adapter)):
            mapping = getattr(self.provider, attr, None)
            if isinstance(mapping, dict):
                for alias in names:
                    mapping.setdefault(alias, value)
        return names

    def _limits(self, names: tuple[str, ...], max_prompt_tokens: int | None, max_body_bytes: int,
                max_tokens: int) -> Limits:
        """The request limits for this model (context length from its config.json: the rule of
        `kvtool.models.limits.token_limits`, shared with serve-once and warm)."""
        tokens = token_limits(self.model_path, max_prompt_tokens)
        try:
            tokens.check_max_tokens(max_tokens)
        except TokenLimitError as exc:
            raise ServerStartError(str(exc)) from None
        tokenizer: Any = self.provider.tokenizer
        vocab = getattr(getattr(self.provider.model, "args", None), "vocab_size", None) or len(tokenizer.get_vocab())
        return Limits(max_body_bytes=max_body_bytes, max_prompt_tokens=tokens.max_prompt_tokens,
                      max_tokens_cap=tokens.max_tokens_cap,
                      vocab_size=int(vocab), model_names=names, images=self.provider.processor is not None)

    @staticmethod
    def _bind(host: str, port: int, handler_class) -> KVToolHTTPServer:
        # As mlx_lm.server._run_http_server: the address family from getaddrinfo.
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = next(iter(infos))

        class Server(KVToolHTTPServer):
            address_family = family

        return _make_server(Server, address, handler_class)

    # ------------------------------------------------------------------ public
    @property
    def host(self) -> str:
        return str(self.httpd.server_address[0])

    @property
    def port(self) -> int:
        """The bound port (the real one when started with port 0)."""
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"

    def serve_forever(self) -> None:
        """Answer HTTP requests until `close()` (or an exception in this thread, e.g. a signal)."""
        self._serving.set()
        self.httpd.serve_forever(poll_interval=0.2)

    def reconfigure(self, config: KVToolConfig) -> ShutdownStatus:
        """Live reconfiguration of the tiers (see `KVToolPromptCache.reconfigure`)."""
        return self.cache.reconfigure(config)

    def stats(self) -> dict[str, Any]:
        return self.cache.stats()

    def _metrics_snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tier counters, cumulative request totals) for `kvtool.prom` at each scrape."""
        stats = self.cache.stats()
        return stats["cache"], stats["adapter"]

    def close(self, *, from_serving_thread: bool = False, timeout: float = GENERATION_STOP_TIMEOUT_S) -> ShutdownStatus:
        """Stop accepting requests, stop the generation thread, drain the SSD writer and close the
        index. Idempotent.

        Args:
            from_serving_thread: True when `serve_forever` already returned in this thread (a
                signal interrupted it); False when it runs in another thread (it is stopped).
            timeout: seconds to wait for the generation thread to finish its current step.
        """
        with self._close_lock:
            if self._closed is not None:
                return self._closed
            if not from_serving_thread and self._serving.is_set():
                self.httpd.shutdown()  # waits for serve_forever (in another thread) to return
            self.httpd.server_close()
            # mlx-lm's stop_and_join (the thread ends after its current step), bounded: a stuck
            # step cannot keep the index open forever
            stopper = threading.Thread(target=self.generator.stop_and_join, name="kvtool-stop", daemon=True)
            stopper.start()
            stopper.join(timeout)
            if stopper.is_alive():
                log.warning("the generation thread did not stop within %.0f s; closing the cache anyway", timeout)
            self._closed = self.cache.close()
            return self._closed


def _load_provider(cli_args: Any, model: str, path: Path, adapter: str | None) -> tuple[Any, str]:
    """mlx-lm's `ModelProvider` with the model loaded (the generation thread then finds it loaded:
    same model_key), and the model's id (`kvtool.models.loader.compute_model_id`).

    Raises:
        ServerStartError: the model does not load, or its KV cannot be quantized as `--kv-bits` asks
            (mlx-lm would fail mid-request once a prompt reaches `--quantized-kv-start`).
    """
    from mlx_lm.server import ModelProvider

    from kvtool.models.loader import compute_model_id, kv_quantization_problem

    provider = ModelProvider(cli_args)
    try:
        provider.load_default()
        model_id = compute_model_id(path, adapter)
    except Exception as exc:  # noqa: BLE001 - any loader failure is one line
        raise ServerStartError(f"cannot load model {model!r} from {path}: {' '.join(str(exc).split())}") from exc
    problem = kv_quantization_problem(provider.model, cli_args.kv_bits, cli_args.kv_group_size)
    if problem is not None:
        raise ServerStartError(problem)
    return provider, model_id


def _admission() -> Admission:
    """The handlers' admission, with the window of `KVTOOL_ADMISSION_WINDOW_MS`.

    Raises:
        ServerStartError: the variable is not a number of milliseconds >= 0.
    """
    try:
        return Admission(window_from_env())
    except ValueError as exc:
        raise ServerStartError(str(exc)) from None


def _resolve_models(cli_args: argparse.Namespace, model: str, adapter_path: str | None) -> tuple[Path, str, str | None]:
    """`(model path, model name, adapter directory or None)`, set on `cli_args` (`model`,
    `adapter_path`, `draft_model` as paths) as mlx-lm's `ModelProvider` reads them.

    Raises:
        ServerStartError: a model (or the draft model) that does not resolve, a missing adapter path.
    """
    from kvtool.models.loader import ModelLoadError, resolve_spec

    try:
        path, name = resolve_spec(model)
        draft = resolve_spec(cli_args.draft_model)[0] if cli_args.draft_model else None
    except ModelLoadError as exc:
        raise ServerStartError(str(exc)) from None
    if adapter_path is not None and not Path(adapter_path).expanduser().exists():
        raise ServerStartError(f"adapter path not found: {adapter_path}")
    adapter = str(Path(adapter_path).expanduser()) if adapter_path else None
    cli_args.model, cli_args.adapter_path = str(path), adapter
    cli_args.draft_model = str(draft) if draft is not None else None
    return path, name, adapter


def _quantization(cli_args: argparse.Namespace):
    """The `KVQuantization` mlx-lm's server will apply (`--kv-bits`), or None.

    Raises:
        ServerStartError: bits or group size mlx can not quantize with.
    """
    if cli_args.kv_bits is None:
        return None
    from kvtool.kv.model_kv import KVQuantization

    try:
        return KVQuantization(cli_args.kv_bits, cli_args.kv_group_size, cli_args.quantized_kv_start,
                              cli_args.prefill_step_size)
    except ValueError:
        raise ServerStartError(f"--kv-bits {cli_args.kv_bits} --kv-group-size {cli_args.kv_group_size} "
                               f"--quantized-kv-start {cli_args.quantized_kv_start}: KV quantization takes 2, 3, 4, 5, "
                               "6 or 8 bits, a positive group size and a start >= 0") from None


class SpeculativePromptCache(KVToolPromptCache):
    """The prompt cache of a server with `--draft-model`.

    mlx-lm's speculative decoding uses one cache list: the model's layers, then the draft
    model's. kvtool caches the model's KV only: a hit is completed with the draft model's KV
    of the same tokens, prefilled here in `prefill_step` chunks, and inserts store the model's
    layers.

    Args:
        prefix_cache, model_key, prefill_step, **kwargs: as `KVToolPromptCache`; `prefill_step`
            (`--prefill-step-size`) is also the tokens per draft prefill call.
        provider: the `ModelProvider` holding `model` and `draft_model` (loaded).
    """

    reply_off_reason = ("speculative decoding (--draft-model): the reply's KV is written by verify forwards of "
                        "several tokens, which the reply probe does not measure")

    def __init__(self, prefix_cache, provider, **kwargs: Any):
        from mlx_lm.models.cache import make_prompt_cache

        super().__init__(prefix_cache, **kwargs)
        self._provider = provider
        self._n_layers = len(make_prompt_cache(provider.model))
        self._step = self.prefill_step

    def fetch_nearest_cache(self, model: Any, tokens: Sequence[int]) -> tuple[list | None, Sequence[int]]:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        draft = self._provider.draft_model
        if cache is None or draft is None:
            return cache, rest
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        n = len(tokens) - len(rest)
        draft_cache = make_prompt_cache(draft)
        ids = mx.array(list(tokens[:n]), dtype=mx.int32)[None]
        for start in range(0, n, self._step):
            draft(ids[:, start : start + self._step], cache=draft_cache)
            mx.eval([c.state for c in draft_cache])
        return list(cache) + draft_cache, rest

    def insert_cache(self, model: Any, tokens: Sequence[int], prompt_cache: list, *,
                     cache_type: str = "assistant") -> None:
        super().insert_cache(model, tokens, list(prompt_cache[: self._n_layers]), cache_type=cache_type)


def _make_server(server_class: type[KVToolHTTPServer], address, handler_class) -> KVToolHTTPServer:
    """Build the HTTP server; the handler gets the response generator once it exists (it is
    created after the socket is bound, so that a busy port fails before the generation thread
    starts)."""
    from mlx_lm.server import get_system_fingerprint

    holder: dict[str, Any] = {}
    fingerprint = get_system_fingerprint()
    httpd = server_class(address, lambda *args, **kwargs: handler_class(
        holder["generator"], *args, system_fingerprint=fingerprint, **kwargs))
    httpd.kvtool_holder = holder
    return httpd


__all__ = ["KVToolServer", "ServerStartError", "SpeculativePromptCache", "server_args", "make_handler_class",
           "STATS_PATH", "MAX_CONNECTIONS"]
