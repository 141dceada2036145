"""`kvtool rm`: remove one namespace, or the cached blocks of one prompt. Plan, show, confirm, execute.

MLX-free unless a prompt is given (its model is loaded for the tokenizer and identity).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import typer
from rich.markup import escape

from kvtool.cli import common
from kvtool.cli.cmd_inspect import PROMPT, PromptSource, prompt_options
from kvtool.cli.cmd_remote import rm_remote
from kvtool.cli.output import Output
from kvtool.cli.removal import REMOVAL, Removal, confirm_and_execute, print_freed, removal_options
from kvtool.cli.target import TARGET, Target, target_options
from kvtool.units import format_bytes

HELP = """Remove one namespace of the SSD cache, or the cached blocks of one prompt.

kvtool rm NAMESPACE removes the namespace whose key starts with NAMESPACE (a unique prefix of at least 8 hex digits, as kvtool inspect lists it), whole, whatever its state: every file kvtool writes there (segment, temp and index files), then the directories left empty. Anything else in it (a file kvtool never writes) is left where it is and listed, in the dry run too; a directory whose index.sqlite is not a kvtool index is refused. A prefix that several keys share removes nothing.

kvtool rm --prompt TEXT (or --prompt-file, --messages) [--model/-m M] removes that prompt's cached blocks (its full blocks and its tail entry) from the namespaces of that model (every block size in the cache, or only --block-size), every block below them (a prefix shared with other prompts takes their continuations with it) and the segment files left empty. The model (default: tiny, as serve-once) is loaded for its tokenizer and identity; encode the prompt as the server did (--ignore-chat-template, --system-prompt, --adapter-path, --kv-bits).

The plan is shown, then executed after confirmation (--yes skips it; without a terminal --yes is required). rm holds prune's lock: an rm and a prune never run at once. Safe while serve-once or warm use the cache (a removed block is a miss); a process that has a removed namespace open caches nothing more to it until restarted. Symlinks are never followed.

With --remote (or --remote-url URL), remove from the remote tier's server instead (as `kvtool remote rm`): NAMESPACE removes every key of that namespace; a prompt removes its blocks (and their parts) from the namespace of its model at --block-size (default: the config's block_size). A kvtool process reading a removed value gets a miss.

Examples:

  kvtool rm 3fa2c1d0 --dry-run

  kvtool rm 3fa2c1d0 --yes

  kvtool rm --model qwen0.5b --prompt-file secret.txt --yes --json

  kvtool rm 3fa2c1d0 --remote --yes      # the server of remote_url / $KVTOOL_REMOTE_URL

Exit codes: 0 removed, nothing to remove, or --dry-run; 1 declined at the prompt, or something could not be removed (or a namespace of the prompt is unreadable); 2 bad input (namespace prefix, prompt, model, cache dir; with --remote: bad URL, unreachable server, wrong password, TLS failure, unknown namespace), or no terminal and no --yes; 3 a prune, a validate or another rm is running on this cache; 130/143 interrupted (deferred until the removal finished).
"""

NamespaceArg = Annotated[
    str | None,
    typer.Argument(metavar="NAMESPACE", help="Key prefix of the namespace to remove (unique, at least 8 hex digits; see kvtool inspect).",
                   show_default=False),
]  # fmt: skip
BlockSizeOpt = Annotated[
    int | None,
    typer.Option("--block-size", min=1, help="Only the namespace of this block size (default: every block size in the cache).",
                 show_default=False),
]  # fmt: skip


@target_options
@prompt_options("prompt", "prompt_file", "messages", "model", "ignore_chat_template", "system_prompt", "adapter_path",
                "kv_bits", "kv_group_size")
@removal_options()
@common.cli_command
def rm_cmd(
    namespace: NamespaceArg = None,
    source: PromptSource = PROMPT,
    block_size: BlockSizeOpt = None,
    removal: Removal = REMOVAL,
    cache_dir: common.CacheDirOpt = None,
    target: Target = TARGET,
) -> int:
    from kvtool.ops.remove import check_prefix, execute_removal, plan_namespace_removal, scan_for_removal

    by_prompt = source.given
    if by_prompt == (namespace is not None):
        raise common.CLIError("give a NAMESPACE key prefix or a prompt (--prompt, --prompt-file, --messages)"
                              + (", not both" if by_prompt else ""))  # fmt: skip
    if not by_prompt and (block_size is not None or source.model_given):
        raise common.CLIError("--model, --block-size and the model options only apply with a prompt")
    if namespace is not None:
        check_prefix(namespace)
    server = target.server
    if server is not None:
        common.refuse_options({"--cache-dir": cache_dir}, "with --remote")
        if not by_prompt:
            return rm_remote(server, removal, namespace or "")
        removal.refuse_without_terminal("remove")  # before the model loads
        cfg = common.build_config(target.config, block_size=block_size).replace(remote_url=None)  # hashing only
        keys = _prompt_keys(cfg, source)[0](cfg.block_size)
        return rm_remote(server, removal, keys.namespace, list(keys.hashes))
    cfg = target.cache_config(cache_dir)
    root = cfg.ssd_cache_dir
    removal.preflight(root, "remove")
    make_plan = _prompt_planner(cfg, source, block_size) if by_prompt else None  # loads the model: before the lock
    with removal.maintenance_lock(root):  # a dry run only reads
        plan = make_plan() if make_plan else plan_namespace_removal(scan_for_removal(root, namespace or ""))
        return confirm_and_execute(plan, removal, question=lambda: _question(plan),
                                   execute=execute_removal, print_plan=_print_plan, print_result=_print_result,
                                   nothing="nothing to remove", print_problems=_print_problems)  # fmt: skip


def _prompt_keys(cfg, source) -> tuple[Callable, int]:
    """Encode the prompt with its model (closed again at once): `(keys_for, prompt tokens)`, where
    `keys_for(block_size)` is the prompt's namespace at that block size and the chain hashes of
    its full blocks and tail entry there (`kvtool.ops.remove.PromptKeys`)."""
    import numpy as np

    from kvtool.cli.cmd_inspect import prompt_engine
    from kvtool.hashing import chain_hashes, tail_hash
    from kvtool.ops.remove import PromptKeys

    with prompt_engine(cfg, source) as (engine, tokens):
        prefix = engine.cache
    ids = np.asarray(tokens, dtype=np.int32)

    def keys_for(bs: int) -> PromptKeys:
        layout = prefix.layout_key_for(bs)
        full = chain_hashes(ids, bs, layout, prefix.hash_fn)
        tail = tail_hash(ids, bs, layout, full, prefix.hash_fn)
        return PromptKeys(layout, bs, tuple(full) + ((tail,) if tail else ()))

    return keys_for, int(ids.size)


def _prompt_planner(cfg, source, block_size: int | None) -> Callable:
    """A planner that hashes the prompt for each block size: the given one, else every block
    size in the cache (and the config's). The model is loaded here, once."""
    from kvtool.ops.remove import block_sizes_of, plan_prompt_removal
    from kvtool.ops.scan import scan_cache

    keys_for, prompt_tokens = _prompt_keys(cfg, source)

    def plan():
        scan = scan_cache(cfg.ssd_cache_dir, full=False)
        sizes = [block_size] if block_size is not None else sorted(block_sizes_of(scan) | {cfg.block_size})
        return plan_prompt_removal(scan, keys_for, sizes, model=source.spec, prompt_tokens=prompt_tokens)

    return plan


def _question(plan) -> str:
    if plan.target == "namespace":
        (ns,) = plan.namespaces
        return f"Remove namespace {ns.namespace} ({_model(ns)}), {format_bytes(ns.prune_bytes)}?"
    return (f"Remove {plan.total('prune_blocks')} block(s) in {plan.total('prune_segments')} segment file(s), "
            f"{format_bytes(plan.total('prune_bytes'))}?")  # fmt: skip


def _print_problems(plan, out: Output) -> None:
    """--quiet: each namespace's problem (stderr), before the result line."""
    for ns in plan.namespaces:
        if ns.problems and ns.message:
            out.problem(f"{ns.namespace}: {escape(ns.message)}")


def _model(ns) -> str:
    return escape(ns.model_name or "model unknown") + ("" if ns.status in ("ok", "empty") else f", {ns.status}")


def _print_plan(plan, console) -> None:
    def say(text: str) -> None:
        console.print(text, highlight=False, soft_wrap=True)

    dry = " (dry run)" if plan.dry_run else ""
    if plan.target == "prompt" and not plan.namespaces:
        say(f"nothing of this prompt ({plan.prompt_tokens} tokens) can be cached in {escape(plan.cache_dir)}{dry}: "
            f"no namespace of model {escape(str(plan.model))} there")  # fmt: skip
    for ns in plan.namespaces:
        head = f"namespace {ns.namespace} ({_model(ns)})"
        if ns.remove_namespace:
            say(f"{head}: remove it whole{dry}: {ns.blocks} block(s) in {ns.segments} segment file(s), "
                f"{format_bytes(ns.prune_bytes)} with its index")  # fmt: skip
        elif ns.skipped:
            say(f"[red]{head}[/]: {escape(ns.message)}")
            continue
        else:
            say(f"{head}: {ns.prompt_blocks} of the prompt's {ns.prompt_entries} block(s) stored{dry}, "
                f"{ns.descendant_blocks} block(s) below them: remove {ns.prune_blocks} block(s), "
                f"{ns.prune_segments} segment file(s), {format_bytes(ns.prune_bytes)}; "
                f"{ns.blocks_after} block(s), {format_bytes(ns.bytes_after)} left")  # fmt: skip
        if ns.message:
            say(f"  [yellow]{escape(ns.message)}[/]")
        _print_left(ns, say, "would be left" if plan.dry_run else "left")


def _print_left(ns, say, verb: str) -> None:
    """The entries of a namespace removed whole that are not kvtool's (kept, with their directory)."""
    if ns.remove_namespace and ns.left:
        shown = ", ".join(escape(p) for p in ns.left[:10]) + (f", ... ({len(ns.left)} in all)" if len(ns.left) > 10 else "")
        say(f"  [yellow]not kvtool's, {verb} in {escape(str(ns.namespace))}/: {shown}[/]")


def _print_result(plan, console) -> None:
    gone = [ns.namespace[:12] for ns in plan.namespaces if getattr(ns, "namespace_removed", False)]
    kept = [ns for ns in plan.namespaces if ns.remove_namespace and ns.left and not ns.unlink_failed]
    what = (f"removed namespace {', '.join(gone)}: " if gone else
            f"removed the kvtool files of namespace {', '.join(ns.namespace[:12] for ns in kept)}: " if kept else "removed ")  # fmt: skip
    print_freed(console, plan, what, "segment file(s)")
    for ns in kept:
        _print_left(ns, lambda text: console.print(text, highlight=False, soft_wrap=True), "left")


def register(app: typer.Typer) -> None:
    """Add `kvtool rm` to the app."""
    app.command("rm", help=HELP)(rm_cmd)
