"""`kvtool import` / `kvtool export`: mlx-lm prompt-cache files in and out of the tiers.

Logic in `kvtool.jobs.interop` (files, token ids: `kvtool.jobs.interop_files`); this module parses
options, loads the engine, prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from kvtool.cli import common
from kvtool.cli.output import Output
from kvtool.units import format_bytes, format_hits

if TYPE_CHECKING:
    from kvtool.engine import Engine  # (MLX: for annotations only)

IMPORT_HELP = """Import a prompt-cache file written by mlx_lm.cache_prompt (or save_prompt_cache) into the SSD tier as verified blocks.

mlx-lm's files hold no token ids, so give the prompt that made the file: --prompt/--prompt-file are tokenised exactly as mlx_lm.cache_prompt does (the chat template with the prompt as an unfinished user message; --ignore-chat-template: tokenizer.encode(text)); the text is taken literally ('-' reads stdin, '\\n' is not unescaped). Or --token-ids FILE.json (a JSON list of ids). Files written by kvtool export carry their ids and need none of these, and a checksum of their KV and ids that must match (a damaged or edited export is refused).

Checked before anything is written: the cache layers are plain KVCache (or QuantizedKVCache: imported into the namespace of its --kv-bits), one per model layer, holding exactly the prompt's token count, with the model's head counts, head dims and dtype; the file's model (metadata) is --model (same spec or directory, or the same weights digest; --skip-model-check: warn only); and the KV of the last --check-tokens tokens, and of --check-positions single tokens spread over the rest, is recomputed by the model from the file's KV before them and compared with the file's (a wrong model, or a wrong token at a checked position, fails it; other positions are checked by the token count only). After the writer has drained, every prompt token must be found on SSD (PrefixCache.probe).

Examples:

  mlx_lm.cache_prompt --model $(kvtool model path tiny) --prompt "$(cat doc.txt)" --prompt-cache-file doc.safetensors
  kvtool import doc.safetensors --model tiny --prompt-file doc.txt

  kvtool import prompt.safetensors --model ~/models/Qwen2.5-0.5B-Instruct-4bit --prompt - < doc.txt --json

  kvtool import kvtool-exported.safetensors --model tiny

Exit codes: 0 imported and verified; 1 written but not verified (a block failed, or the writer did not drain); 2 bad input (file, prompt, model, a check failed: nothing written); 130/143 interrupted.
"""

EXPORT_HELP = """Write the cached KV of a prompt as a file that mlx_lm.generate --prompt-cache-file loads.

The prompt is tokenised as mlx_lm.cache_prompt does (the chat template with the prompt as an unfinished user message, which is where mlx_lm.generate appends its own --prompt; --ignore-chat-template: tokenizer.encode(text); --system-prompt: a system message first), or given as --token-ids. Every token must be in kvtool's tiers (its blocks and its tail entry, as left by warm, serve-once, serve or import with the same model, block size and tokenisation); otherwise nothing is written and the error says how many are (--fill: compute the missing tokens instead). The file holds what mlx_lm.cache_prompt would write for the same tokens: the last token is forwarded as mlx-lm's last prefill step, sliding-window layers become mlx-lm's RotatingKVCache. Metadata: model (the model directory, or the Hub id: mlx_lm.generate requires the same --model string, or loads it when --model is omitted; --metadata-model overrides), tokenizer_config, chat_template, kvtool_token_ids, and kvtool_kv_digest (a checksum of the KV and token ids: kvtool import refuses the file if it was damaged or edited).

Examples:

  kvtool warm --model tiny --ignore-chat-template --whole doc.txt
  kvtool export --model tiny --ignore-chat-template --prompt-file doc.txt doc.safetensors
  mlx_lm.generate --model $(kvtool model path tiny) --ignore-chat-template --prompt-cache-file doc.safetensors --prompt " Summarise it."

  kvtool export --model tiny --prompt-file doc.txt --fill doc.safetensors --json

Exit codes: 0 written; 1 the prompt is not fully cached (nothing written); 2 bad input (prompt, model, output path); 130/143 interrupted.
"""

PromptOpt = Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text, taken literally as mlx_lm.cache_prompt does ('-' reads stdin).", show_default=False)]
PromptFileOpt = Annotated[Path | None, typer.Option("--prompt-file", "-f", help="File holding the prompt ('-' reads stdin).", show_default=False)]
TokenIdsOpt = Annotated[Path | None, typer.Option("--token-ids", help="JSON file with the prompt's token ids: [1, 2, ...] or {\"token_ids\": [...]} ('-' reads stdin).", show_default=False)]
IgnoreTemplateOpt = Annotated[bool, typer.Option("--ignore-chat-template", help="Tokenise the prompt as raw text: tokenizer.encode(text) (default: the chat template, as mlx_lm.cache_prompt).")]
QuantStartOpt = Annotated[int, typer.Option("--quantized-kv-start", min=0, help="As mlx-lm: the cache offset from which KV is quantized (with --kv-bits / a quantized file).")]


@dataclass(frozen=True)
class PromptTokens:
    """The prompt of an import or export and the model that tokenises it: `--model`, then
    `--prompt` / `--prompt-file` (tokenised as mlx_lm.cache_prompt does) or `--token-ids`."""

    model: common.ModelOpt = "tiny"
    prompt: PromptOpt = None
    prompt_file: PromptFileOpt = None
    token_ids: TokenIdsOpt = None
    ignore_chat_template: IgnoreTemplateOpt = False
    system_prompt: common.SystemPromptOpt = None

    def tokens(self, engine: Engine, required: bool) -> tuple[list[int] | None, str]:
        """`(token ids, where they came from)`; `(None, "metadata")` when none is given and not `required`.

        Raises:
            CLIError: more than one source, none when `required`, --system-prompt with --token-ids,
                an unreadable source, a prompt without tokens.
        """
        from kvtool.jobs.interop_files import cache_prompt_tokens, read_token_ids

        given = sum(x is not None for x in (self.prompt, self.prompt_file, self.token_ids))
        if given > 1:
            raise common.CLIError("give only one of --prompt, --prompt-file, --token-ids")
        if given == 0:
            if required:
                raise common.CLIError("give the prompt: --prompt, --prompt-file or --token-ids")
            return None, "metadata"
        if self.token_ids is not None:
            if self.system_prompt is not None:
                raise common.CLIError("--system-prompt does not apply to --token-ids")
            return read_token_ids(self.token_ids), "token_ids"
        text = common.read_prompt_arg(self.prompt, self.prompt_file, unescape=False)  # literally, as cache_prompt
        assert text is not None  # --prompt or --prompt-file was given
        chat = not self.ignore_chat_template
        ids = cache_prompt_tokens(engine.tokenizer, text, chat_template=chat, system_prompt=self.system_prompt)
        if not ids:
            raise common.CLIError("the prompt has no tokens")
        templated = chat and bool(getattr(engine.tokenizer, "has_chat_template", False))
        return ids, "prompt_chat_template" if templated else "prompt_raw"


PROMPT = PromptTokens()  # the default of a command's `source` parameter (`prompt_options` always passes one)
prompt_options = common.flag_options("source", PromptTokens)  # every field of `PromptTokens`, in field order


def _run_job(model: str, cfg: Any, flags: common.ModelFlags, quantized_kv_start: int,
             work: Callable[[Engine], Any]) -> tuple[Any, common.Interrupted | None, Any]:
    """Load the engine (`flags.load` plus mlx-lm's --quantized-kv-start), run `work(engine)` with
    SIGINT/SIGTERM raising `Interrupted`, then close the engine (its writer drained) with the
    signals ignored: `(work's result or None, the interruption or None, the shutdown status)`.

    Raises:
        CLIError: the cache cannot be built for the model (e.g. a KV quantisation its head dims
            do not allow); and what `flags.load` and `work` raise.
    """
    result = interrupted = status = None
    with common.nothing_left_empty(Path(cfg.ssd_cache_dir)) as opened:
        try:
            engine = flags.load(model, cfg, quantized_kv_start=quantized_kv_start)
        except ValueError as exc:
            raise common.CLIError(f"cannot build the cache for {model}: {exc}") from None
        if engine.namespace_dir is not None:
            opened.append(engine.namespace_dir)
        try:
            with common.signals_raise():
                try:
                    result = work(engine)
                except common.Interrupted as exc:
                    interrupted = exc
                finally:
                    common.ignore_signals()
                    status = engine.close()
        except common.Interrupted as exc:  # a signal during the drain's set-up
            interrupted, status = exc, engine.close()
    return result, interrupted, status


def _exit_code(interrupted: common.Interrupted | None, ok: bool) -> int:
    if interrupted is not None:
        return 128 + interrupted.signum
    return common.EXIT_OK if ok else common.EXIT_PROBLEMS


# ------------------------------------------------------------------------------ import
@common.cache_options("config", "cache_dir", "durability", "async_writes", "block_size")
@common.model_options("adapter_path", "prefill_step_size")
@prompt_options
@common.cli_command
def import_cmd(
    file: Annotated[Path, typer.Argument(help="The .safetensors file written by mlx_lm.cache_prompt / save_prompt_cache.", show_default=False)],
    source: PromptTokens = PROMPT,
    skip_model_check: Annotated[bool, typer.Option("--skip-model-check", help="Import even if the file's model (metadata) is not --model or cannot be verified (warns; the KV check still runs).")] = False,
    check_tokens: Annotated[int, typer.Option("--check-tokens", min=0, help="KV check: recompute the KV of this many last tokens (one model call) and compare with the file's; the prompt length or more: every token (as slow as a prefill).")] = 32,
    check_positions: Annotated[int, typer.Option("--check-positions", min=0, help="KV check: also recompute this many single tokens spread over the rest of the prompt (one decode step each).")] = 64,
    kv_bits: Annotated[int | None, typer.Option("--kv-bits", show_default=False, help="The namespace's KV quantisation (default: the file's; give it for a plain file made with mlx_lm.cache_prompt --kv-bits whose prompt was below --quantized-kv-start).")] = None,
    quantized_kv_start: QuantStartOpt = 5000,
    model_flags: common.ModelFlags = common.MODEL,
    cache: common.CacheFlags = common.CACHE,
    json_out: common.JsonOpt = False,
    verbose: common.VerboseOpt = False,
) -> int:
    from kvtool.jobs.interop import import_cache_file
    from kvtool.jobs.interop_files import file_quantization, load_cache_file

    common.setup_logging(verbose)
    loaded = load_cache_file(file)  # fail fast (before the model loads: a damaged export makes no namespace)
    quant = file_quantization(loaded[0])
    if quant is not None and kv_bits is not None and kv_bits != quant[0]:
        raise common.CLIError(f"--kv-bits {kv_bits}: the file's KV is quantized to {quant[0]} bits")
    bits = quant[0] if quant else kv_bits
    flags = dataclasses.replace(model_flags, kv_bits=bits, kv_group_size=quant[1] if quant else 64)

    def work(engine: Engine):
        ids, origin = source.tokens(engine, required=False)
        return import_cache_file(engine, file, ids, model_spec=source.model,
                                 adapter_path=str(flags.adapter_path) if flags.adapter_path else None,
                                 require_model_match=not skip_model_check, check_tokens=check_tokens,
                                 check_positions=check_positions, token_source=origin, preloaded=loaded)

    report, interrupted, status = _run_job(source.model, cache.build(), flags, quantized_kv_start, work)
    ok = report is not None and report.verified and report.blocks_failed == 0 and status.shutdown_clean
    if report is not None:
        _print_import(report, status, json_out, explain=not ok and interrupted is None)
    return _exit_code(interrupted, ok)


def _print_import(report, status, json_out: bool, explain: bool) -> None:
    """The import's result: its JSON document, or two lines; then with `explain`, the `error:`
    line saying why it was not verified."""
    out = Output.from_flags(json_out)

    def human() -> None:
        for w in report.warnings:
            out.note(f"[yellow]warning:[/] {escape(w)}")
        mark = "[green]verified[/]" if report.verified else "[red]NOT verified[/]"
        out.print(f"imported {escape(str(report.file))}: {report.prompt_tokens} tokens ({report.cache_type}"
                  f"{f', {report.kv_bits}-bit' if report.kv_bits else ''}) | {report.entries_stored} entries stored, "
                  f"{report.blocks_written} block(s) written ({format_bytes(report.bytes_written)}), "
                  f"{report.blocks_dedup} already on SSD, {report.blocks_failed} failed | "
                  f"SSD holds {report.cached_tokens}/{report.prompt_tokens} tokens: {mark}")
        out.print(f"[dim]model check: {report.model_check} ({escape(str(report.model_check_detail))}) | KV check: "
                  f"{report.kv_check_tokens} tokens recomputed, max rel diff {report.kv_check_max_rel_diff:.2g} | "
                  f"namespace {report.layout_key} | {report.elapsed_s:.1f} s | shutdown_clean={status.shutdown_clean}[/]")

    out.emit(lambda: {**report.to_dict(), "shutdown_clean": status.shutdown_clean}, human)
    if explain:
        over = f" ({report.blocks_over_budget} block(s) over the SSD byte budget)" if report.blocks_over_budget else ""
        why = (f"not every token is on SSD after the flush{over}" if not report.verified
               else f"{report.blocks_failed} block(s) failed" if report.blocks_failed
               else "the writer did not drain")
        common.print_error(f"import not verified: {why}", "run kvtool validate")


# ------------------------------------------------------------------------------ export
@common.cache_options("config", "cache_dir", "block_size")
@common.model_options("adapter_path", "prefill_step_size", "kv_bits", "kv_group_size")
@prompt_options
@common.cli_command
def export_cmd(
    out: Annotated[Path, typer.Argument(help="The .safetensors file to write (replaced atomically).", show_default=False)],
    source: PromptTokens = PROMPT,
    fill: Annotated[bool, typer.Option("--fill", help="Compute the tokens that are not cached instead of refusing (nothing is stored).")] = False,
    metadata_model: Annotated[str | None, typer.Option("--metadata-model", help="The file's metadata 'model' (default: the model directory, or the Hub id); mlx_lm.generate --model must equal it.", show_default=False)] = None,
    model_flags: common.ModelFlags = common.MODEL,
    quantized_kv_start: QuantStartOpt = 5000,
    cache: common.CacheFlags = common.CACHE,
    json_out: common.JsonOpt = False,
    verbose: common.VerboseOpt = False,
) -> int:
    from kvtool.jobs.interop_export import export_cache_file
    from kvtool.jobs.interop_files import SUFFIX, metadata_model_for

    common.setup_logging(verbose)
    if out.suffix != SUFFIX:
        raise common.CLIError(f"{out}: the output must be named *{SUFFIX} (mlx-lm's loader picks the format by the suffix)")

    def work(engine: Engine):
        ids, _ = source.tokens(engine, required=True)
        assert ids is not None  # required: given, or CLIError
        return export_cache_file(engine, ids, out, fill=fill,
                                 metadata_model=metadata_model or metadata_model_for(source.model, engine.loaded))

    report, interrupted, _ = _run_job(source.model, cache.build(), model_flags, quantized_kv_start, work)
    if report is not None:
        output = Output.from_flags(json_out)
        output.emit(report.to_dict, lambda: output.print(
            f"wrote {escape(str(report.out))}: {report.prompt_tokens} tokens ({', '.join(report.cache_types)}, "
            f"{format_bytes(report.bytes)}) | from the tiers {report.cached_tokens} ("
            f"{format_hits(report.ram_hit_tokens, report.ssd_hit_tokens, report.remote_hit_tokens)}), computed {report.computed_tokens} | metadata model {escape(str(report.metadata_model))}"))
    return _exit_code(interrupted, report is not None)


def register(app: typer.Typer) -> None:
    """Add `kvtool import` and `kvtool export` to the app."""
    app.command("import", help=IMPORT_HELP)(import_cmd)
    app.command("export", help=EXPORT_HELP)(export_cmd)
