"""`kvtool serve`: mlx-lm's OpenAI-compatible HTTP server on kvtool's RAM/SSD prefix cache.

The HTTP server, the request handling and the generation (batching included) are mlx-lm's own
(`mlx_lm.server`); kvtool only supplies the prompt cache (`kvtool.server.KVToolPromptCache`),
owns the socket and the shutdown (drain the SSD writer, close the index), logs one line per
request and adds `GET /kvtool/stats`. Wiring: `kvtool.server.serve.KVToolServer`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import signal
import sys
import threading
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from kvtool.cli import common
from kvtool.cli.cmd_serve import tier_summary
from kvtool.units import format_size

HELP = """Serve mlx-lm's OpenAI-compatible HTTP API, Anthropic's Messages API and OpenAI's Responses API with kvtool's RAM/SSD prefix cache.

Routes: POST /v1/chat/completions, /v1/completions (mlx-lm's), /v1/messages, /v1/messages/count_tokens (Anthropic's, for coding agents), /v1/responses (OpenAI's); GET /v1/models, /health, /kvtool/stats, /metrics. All three chat APIs take the same path: the same cache, request checks and per-request log line.

It is mlx_lm.server itself (same request fields, batching, chat templates, streaming), with kvtool's tiers instead of mlx-lm's in-memory prompt cache: a prompt prefix seen before, in this process or an earlier one, is not prefilled again, and the output is the one mlx_lm.server gives. Clients name the model "default_model", the --model value or its path. One log line per request on stderr: prompt, cached (RAM, SSD, remote) and prefilled tokens. GET /kvtool/stats returns the cache counters and the last requests as JSON.

Examples:

  kvtool serve --model tiny --port 8080

  kvtool serve --model ~/models/Qwen2.5-0.5B-Instruct --cache-dir /fast/ssd/kvtool --ram-bytes 2GiB

  curl -s localhost:8080/v1/chat/completions -d '{"model": "default_model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}'

  kill -HUP <pid>    (re-read --config and the cache flags; reattach the tiers live)

  kvtool serve --model ~/models/Qwen3-0.6B --chat-template-args '{"enable_thinking": false}' --kv-bits 8 --top-k 20

  curl -s localhost:8080/metrics    (Prometheus text format: hit tokens, bytes, restore latency per tier)

Every mlx_lm.server option is accepted (read from the installed mlx-lm's own parser; panel "mlx_lm.server options") and passed to it unchanged, except where it touches the prompt cache: --prompt-cache-bytes N sets the RAM tier's budget (as --ram-bytes N; mlx-lm also trims it to N minus the active batch's KV after each batched insert); --prompt-cache-size is refused (kvtool's RAM tier is bounded in bytes, not entries); --kv-bits (with --kv-group-size, --quantized-kv-start) makes the cached blocks hold mlx-lm's quantized KV, in a namespace of their own; with --draft-model a hit is completed with the draft model's KV of the cached tokens (the model's own KV comes from the tiers).

Requests are checked before they reach the generation thread: a body over --max-body-bytes or a prompt over --max-prompt-tokens is answered 413, malformed JSON or fields 400, a model other than the served one 404; a generation thread that fails is restarted (its requests get 500).

--port 0 listens on any free port (printed in the 'listening on' line). SIGINT/SIGTERM stop the server: requests in flight are cut off, the SSD writer is drained and the index closed. SIGHUP reconfigures the cache live: it re-reads --config (the flags still win), waits for the cache call in progress, drains the writer, flushes, detaches, drops RAM blocks and reattaches under the new settings; requests in flight finish but are not stored.

Exit codes: 130/143 stopped by SIGINT/SIGTERM after a clean drain; 1 the writer did not drain (run kvtool validate); 2 bad input (model, options, address in use).
"""

log = logging.getLogger("kvtool.server")
MAX_CONNECTIONS = 256  # kvtool.server.handler.MAX_CONNECTIONS (not imported here: it loads mlx-lm)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def setup_server_logging(level: str) -> None:
    """mlx-lm's log format (as `mlx_lm.server`) for its lines and kvtool's request lines on stderr."""
    fmt = "%(asctime)s - %(levelname)s - %(message)s"
    logging.basicConfig(level=getattr(logging, level), format=fmt)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(_prefix)
        handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(kvtool_prefix)s%(message)s"))
        log.addHandler(handler)
    log.setLevel(min(getattr(logging, level), logging.INFO))  # the per-request line is always shown
    log.propagate = False


def _prefix(record: logging.LogRecord) -> bool:
    """`kvtool ` before a line, unless its message names kvtool already (`kvtool: reply KV reuse on`)."""
    record.kvtool_prefix = "" if str(record.msg).startswith("kvtool") else "kvtool "
    return True


MLX_PANEL = "mlx_lm.server options"
MLX_OPTIONS_META = "kvtool.mlx_lm_options"  # ctx.meta key: dest -> value of the mlx-lm options given


def _mlx_lm_parameters(taken: set[str]) -> list[Any]:
    """Typer options for every `mlx_lm.server` option kvtool does not declare itself (by option
    string), built from mlx-lm's parser: flags stay flags, int/float values keep their type,
    other values are strings that mlx-lm's own converter turns into the namespace value (JSON,
    comma lists, sizes). Defaults are None here (not given): mlx-lm's apply."""
    from rich.markup import escape

    from kvtool.server import mlx_options

    params, annotations = [], {}
    for action in mlx_options.server_actions():
        if taken & set(action.option_strings):
            continue
        help_ = mlx_options.help_text(action)
        if not mlx_options.is_flag(action) and action.default not in (None, "") and "default" not in help_.lower():
            help_ += f" \\[mlx-lm default: {escape(str(action.default))}]"
        if mlx_options.is_flag(action):
            annotation: Any = Annotated[bool, typer.Option(*action.option_strings, help=help_, rich_help_panel=MLX_PANEL)]
            default: Any = False
        else:
            kind = action.type if action.type in (int, float) else str
            metavar = "[" + "|".join(map(str, action.choices)) + "]" if action.choices else None
            annotation = Annotated[kind | None, typer.Option(*action.option_strings, help=help_, metavar=metavar,
                                                              show_default=False, rich_help_panel=MLX_PANEL)]
            default = None
        params.append(inspect.Parameter(action.dest, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotation))
        annotations[action.dest] = annotation

    def options(**kwargs: Any) -> None:  # only its signature is used
        return None

    options.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    options.__annotations__ = annotations
    holder = typer.Typer(add_completion=False)
    holder.command()(options)
    return list(typer.main.get_command(holder).params)


class ServeCommand(TyperCommand):
    """`kvtool serve`'s command: its own options, plus mlx_lm.server's, added the first time the
    command's parameters are needed (parsing, --help, completion) so that other kvtool
    commands never import mlx-lm. Their values go to `ctx.meta[MLX_OPTIONS_META]`."""

    _mlx_names: tuple[str, ...] | None = None

    def get_params(self, ctx):
        if self._mlx_names is None:
            taken = {opt for p in self.params for opt in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}
            try:
                extra = _mlx_lm_parameters(taken)
            except Exception as exc:  # noqa: BLE001 - kvtool serve still runs with its own options
                if common.describe_error(exc) is not None:  # mlx-lm cannot load at all (open-files limit)
                    raise
                extra = []
                common.err_console.print(f"warning: mlx_lm.server's options are not available: {exc}",
                                         markup=False, highlight=False)
            self._mlx_names = tuple(p.name for p in extra if p.name)
            self.params.extend(extra)
        return super().get_params(ctx)

    def parse_args(self, ctx, args):
        refuse_early(args)  # before get_params imports mlx-lm (seconds; more on a loaded machine)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        names = self._mlx_names or ()
        ctx.meta[MLX_OPTIONS_META] = {n: ctx.params.pop(n) for n in names if n in ctx.params}
        return super().invoke(ctx)


PROMPT_CACHE_SIZE_REFUSAL = ("--prompt-cache-size: kvtool's RAM tier is bounded in bytes, not in cached sequences; "
                             "use --prompt-cache-bytes or --ram-bytes")


def refuse_early(args: list[str]) -> None:
    """Refuse the options `kvtool serve` never runs with (`--max-kv-size`, mlx-lm's
    `--prompt-cache-size`) from the raw arguments, before mlx-lm is imported to parse the rest;
    nothing is refused when `--help` is asked for.

    Raises:
        CLIError: one of them is given (`--flag VALUE` or `--flag=VALUE`).
    """
    if "--help" in args or "-h" in args:
        return
    for i, arg in enumerate(args):
        if arg == "--":
            return
        name, _, value = arg.partition("=")
        value = value or (args[i + 1] if i + 1 < len(args) else "")
        if name == "--max-kv-size":
            common.refuse_max_kv_size(value)
        if name == "--prompt-cache-size":
            raise common.CLIError(PROMPT_CACHE_SIZE_REFUSAL)


def mlx_lm_options(given: dict[str, Any], ram_bytes: str | None) -> tuple[dict[str, Any], str | None]:
    """The mlx_lm.server options given on the command line as its namespace values, and the RAM
    tier's budget after `--prompt-cache-bytes`.

    Raises:
        CLIError: a value mlx-lm's parser refuses, `--prompt-cache-size`, or `--prompt-cache-bytes`
            contradicting `--ram-bytes`.
    """
    from kvtool.server import mlx_options

    out: dict[str, Any] = {}
    for dest, value in given.items():
        if value is None or value is False:
            continue
        try:
            out[dest] = mlx_options.convert(dest, value)
        except mlx_options.OptionValueError as exc:
            raise common.CLIError(str(exc)) from None
    if "prompt_cache_size" in out:
        raise common.CLIError(PROMPT_CACHE_SIZE_REFUSAL)
    budget = out.get("prompt_cache_bytes")
    if budget is not None:
        from kvtool.units import parse_size

        if ram_bytes is not None and parse_size(ram_bytes) != budget:
            raise common.CLIError(f"--prompt-cache-bytes {budget} and --ram-bytes {ram_bytes} disagree: "
                                  "both set the RAM tier's budget; give one")
        ram_bytes = str(budget)
    return out, ram_bytes


@dataclasses.dataclass(frozen=True)
class Listener:
    """The HTTP listener's limits, access key and log level: the options `--max-body-bytes`,
    `--head-timeout`, `--max-connections-per-peer`, `--api-key` and `--log-level` of `kvtool
    serve`, as given on the command line."""

    max_body_bytes: Annotated[
        str, typer.Option("--max-body-bytes", help="Largest request body, e.g. 8MiB (larger: HTTP 413).")
    ] = "8MiB"
    head_timeout: Annotated[
        str, typer.Option("--head-timeout", help="Time a client has to send a request's whole head (request line "
                          "and headers), e.g. 20s; past it the connection is closed (also an idle keep-alive one).")
    ] = "20s"
    max_connections_per_peer: Annotated[
        int, typer.Option("--max-connections-per-peer", min=1, max=MAX_CONNECTIONS,
                          help=f"Connections served at once from one client address (more: HTTP 503 and closed; "
                               f"all clients together: {MAX_CONNECTIONS}).")
    ] = 64
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="KVTOOL_API_KEY", show_envvar=True, show_default=False,
                                 help="Require this key on every request (x-api-key or Authorization: Bearer; "
                                      "else HTTP 401). Never logged.")
    ] = None
    log_level: Annotated[
        str, typer.Option("--log-level", help="mlx-lm's log level: DEBUG, INFO, WARNING, ERROR, CRITICAL.")
    ] = "INFO"

    def parsed(self) -> tuple[str, int, float]:
        """`(log level, body limit in bytes, head timeout in seconds)`.

        Raises:
            CLIError: an unknown level, a body limit under 1KiB, a head timeout outside 0.1s..1h.
        """
        from kvtool.units import parse_duration, parse_size

        level = self.log_level.upper()
        if level not in LOG_LEVELS:
            raise common.CLIError(f"--log-level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        body_limit = common.parse_flag(self.max_body_bytes, parse_size, "--max-body-bytes")
        if body_limit < 1024:
            raise common.CLIError(f"--max-body-bytes {self.max_body_bytes}: at least 1KiB")
        head_timeout_s = common.parse_flag(self.head_timeout, parse_duration, "--head-timeout")
        if not 0.1 <= head_timeout_s <= 3600:
            raise common.CLIError(f"--head-timeout {self.head_timeout}: from 0.1s to 1h")
        return level, body_limit, head_timeout_s


@common.cache_options(*(name for name in common.CACHE_OPTIONS if name != "codec"))
@common.model_options("adapter_path", "max_kv_size", "prefill_step_size")
@common.flag_options("listener", Listener)
@common.cli_command
def serve_http(
    ctx: typer.Context,
    model: common.ModelOpt = "tiny",
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (0: any free port).")] = 8080,
    max_tokens: common.MaxTokensOpt = 512,
    temp: Annotated[float, typer.Option("--temp", min=0.0, callback=common.finite_number, help="Default sampling temperature (0: greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, callback=common.finite_number, help="Default nucleus sampling mass.")] = 1.0,
    model_flags: common.ModelFlags = common.MODEL,
    decode_concurrency: Annotated[
        int, typer.Option("--decode-concurrency", min=1, help="Requests decoded in one batch (as mlx_lm.server).")
    ] = 32,
    prompt_concurrency: Annotated[
        int, typer.Option("--prompt-concurrency", min=1, help="Prompts prefilled in one batch (as mlx_lm.server).")
    ] = 8,
    prefill_token_budget: Annotated[
        int | None, typer.Option("--prefill-token-budget", min=0, show_default="256 on the CPU backend, else 0",
                                 help="Take no more requests into the batch while the prompts being prefilled have this "
                                 "many uncached tokens (0: none, as mlx_lm.server): long prompts are prefilled "
                                 "one at a time, short ones together: docs/server.md#the-prefill-token-budget.")
    ] = None,
    max_prompt_tokens: common.MaxPromptTokensOpt = None,
    listener: Listener = Listener(),
    no_reply_cache: Annotated[bool, typer.Option(
        "--no-reply-cache", rich_help_panel=common.CACHE_PANEL, help="Store prompt KV only, never a finished request's "
        "reply (sets reply_cache = false; by default a reply is stored where a probe measured decode KV bit-identical "
        "to prefill KV: docs/server.md#reply-kv-reuse).")] = False,
    cache: common.CacheFlags = common.CACHE,
    verbose: common.VerboseOpt = False,
) -> int:
    common.setup_logging(verbose)
    with common.signals_raise():  # an Interrupted before serving started: nothing was written
        level, body_limit, head_timeout_s = listener.parsed()  # (--max-kv-size: refused as it is parsed)
        extra, ram_bytes = mlx_lm_options(ctx.meta.get(MLX_OPTIONS_META, {}), cache.ram_bytes)
        setup_server_logging(level)
        build = dataclasses.replace(cache, ram_bytes=ram_bytes).build
        make_config = (lambda: build().replace(reply_cache=False)) if no_reply_cache else build
        cfg = make_config()
        server = _start(model, cfg, host, port, model_flags.adapter_path, max_tokens=max_tokens, temp=temp,
                        top_p=top_p, prefill_step_size=model_flags.prefill_step_size,
                        decode_concurrency=decode_concurrency, prompt_concurrency=prompt_concurrency,
                        prefill_token_budget=prefill_token_budget, log_level=level, max_prompt_tokens=max_prompt_tokens,
                        max_body_bytes=body_limit, head_timeout_s=head_timeout_s,
                        max_connections_per_peer=listener.max_connections_per_peer, api_key=listener.api_key, **extra)
        return _run(server, make_config)


def _start(model, cfg, host, port, adapter_path, **options):
    from kvtool.server.serve import KVToolServer, ServerStartError

    try:
        return KVToolServer(model, cfg, host=host, port=port,
                            adapter_path=str(adapter_path) if adapter_path else None, **options)
    except ServerStartError as exc:
        raise common.CLIError(str(exc)) from None


def _describe(server) -> str:
    pc = server.prefix_cache
    if pc.tiered is None:
        cache = f"uncached: {pc.uncached_reason or 'no tier enabled'}"
    else:
        cfg = pc.config
        ssd = f"SSD {pc.namespace_dir}" if pc.namespace_dir is not None else f"no SSD ({pc.ssd_disabled_reason})"
        cache = (f"{ssd} | layout {pc.layout_key} | block {cfg.block_size} | policy {cfg.ssd_policy} | "
                 f"RAM {format_size(cfg.ram_bytes)}")
    limits = server.limits
    return (f"serve: listening on {server.url} | model {server.model_name} ({server.model_path}) | {cache} | "
            f"max prompt {limits.max_prompt_tokens} tok, max_tokens <= {limits.max_tokens_cap}, "
            f"body <= {format_size(limits.max_body_bytes)} | prefill width {server.prefill_width}, "
            f"token budget {server.prefill_token_budget or 'none'}"
            f"{' | API key required' if server.api_key_required else ''}")


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _run(server, make_config) -> int:
    """Serve until SIGINT/SIGTERM; then stop, drain and close. Returns the exit code."""
    interrupted = None

    def reload() -> None:
        try:
            cfg = make_config()
            old = server.prefix_cache.layout_key
            status = server.reconfigure(cfg)
            log.info("reconfigured (SIGHUP): layout %s -> %s | block %d | old tiers shut down clean=%s",
                     old, server.prefix_cache.layout_key, cfg.block_size, status.shutdown_clean)
        except Exception as exc:  # noqa: BLE001 - a bad config file keeps the running settings
            described = common.describe_error(exc)
            log.error("reconfiguration (SIGHUP) refused, settings unchanged: %s",
                      described[0] if described else f"{type(exc).__name__}: {exc}")

    def on_hup(_signum, _frame) -> None:  # the drain may take seconds: never in the signal handler
        threading.Thread(target=reload, name="kvtool-reconfigure", daemon=True).start()

    old_hup = signal.signal(signal.SIGHUP, on_hup) if hasattr(signal, "SIGHUP") else None
    log.info("%s", _describe(server))
    if not _is_loopback(server.host):
        log.warning("listening on %s, not only on this machine: mlx_lm.server is not recommended for production "
                    "(basic security checks only), and anyone who can reach it can fill this cache", server.host)
    try:
        server.serve_forever()
    except common.Interrupted as exc:
        interrupted = exc
    finally:
        common.ignore_signals()  # the clean path also on a second signal: drain, flush, then exit
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        status = server.close(from_serving_thread=True)
        stats = server.stats()["cache"]
        log.info("stopped%s: %s, shutdown_clean=%s", f" by {interrupted.args[0]}" if interrupted else "",
                 tier_summary(stats), status.shutdown_clean)
        if old_hup is not None:
            signal.signal(signal.SIGHUP, old_hup)
    if not status.shutdown_clean:
        return common.EXIT_PROBLEMS
    return 128 + interrupted.signum if interrupted is not None else common.EXIT_OK


def register(app: typer.Typer) -> None:
    app.command("serve", cls=ServeCommand, help=HELP, no_args_is_help=False)(serve_http)
