"""What `kvtool inspect|validate|prune|rm` act on (`Target`): the SSD cache, whose directory must
exist when it was named (`existing_cache_dir`; `--create` makes it), or with `--remote` /
`--remote-url` the remote tier's server (`kvtool.cli.cmd_remote.Server`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.cli import common
from kvtool.cli.cmd_remote import Server

CreateOpt = Annotated[bool, typer.Option(
    "--create", help="Create the cache directory if it does not exist (without it, a --cache-dir, $KVTOOL_CACHE_DIR "
    "or config file ssd_cache_dir that does not exist is an error, exit 2; the default directory never is).")]


def existing_cache_dir(settings: Any, create: bool = False) -> Path:
    """The cache directory of `settings` (`kvtool.config.settings.Settings`), which an operator
    command reads: one named by a flag, a variable or a config file must exist (a typo would
    otherwise look like an empty cache and exit 0), unless `create` (then it is made, with the
    config's `ssd_dir_mode`). The default directory may be missing: nothing was cached yet.

    Raises:
        CLIError: a named directory does not exist and not `create`, or cannot be created; or it
            is a namespace directory of a cache (a 32-hex name holding an index), not a cache.
    """
    import os

    from kvtool.config.settings import DEFAULT
    from kvtool.disk.fsops import FileOps, short_path
    from kvtool.disk.names import INDEX_FILENAME, NAMESPACE_RE

    cfg = settings.config
    root = cfg.ssd_cache_dir
    origin = settings.origins["ssd_cache_dir"]
    if NAMESPACE_RE.match(Path(root).name) and os.path.lexists(Path(root) / INDEX_FILENAME):
        raise common.CLIError(f"{short_path(root)} is a namespace directory, not a cache directory (from {origin})",
                              hint=f"give the directory that holds it: --cache-dir {short_path(Path(root).parent)}")
    if os.path.lexists(root) or origin.kind == DEFAULT:
        return root
    if not create:
        raise common.CLIError(f"cache directory {short_path(root)} does not exist (from {origin})",
                              hint="check the path, or add --create to start an empty cache there")
    try:
        FileOps().makedirs(root, cfg.ssd_dir_mode)
    except OSError as exc:
        raise common.CLIError(f"cannot create cache directory {short_path(root)}: {exc.strerror or exc}") from None
    return root


@dataclass(frozen=True)
class Target:
    """What `kvtool inspect|validate|prune|rm` act on: the SSD cache, or with `--remote` /
    `--remote-url` the remote tier's server (`server`); `config` is `--config`; `create` is
    `--create` (make a cache directory that does not exist)."""

    config: common.ConfigOpt = None
    remote: common.RemoteOpt = False
    remote_url: common.RemoteServerOpt = None
    create: CreateOpt = False

    @property
    def server(self) -> Server | None:
        """The remote server to act on, None for the SSD cache.

        Raises:
            CLIError: `--create` with `--remote` / `--remote-url`.
        """
        if not self.remote and self.remote_url is None:
            return None
        common.refuse_options({"--create": self.create}, "with --remote")
        return Server(self.remote_url, config=self.config, flag="--remote-url")

    def cache_config(self, cache_dir: Path | None = None, **flags: Any) -> Any:
        """The `KVToolConfig` of the SSD cache to act on (`common.CacheFlags` fields as `flags`),
        its cache directory checked by `existing_cache_dir` (created with `--create`).

        Raises:
            CLIError: the cache directory was named (flag, variable, config file) and does not
                exist, without `--create`; or as `common.CacheFlags.settings`.
        """
        settings = common.CacheFlags(self.config, cache_dir, **flags).settings()
        existing_cache_dir(settings, self.create)
        return settings.config


TARGET = Target()  # the default of a command's `target` parameter (`target_options` always passes one)


def target_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an operator command whose parameter `target: Target` stands for `--config`,
    `--remote`, `--remote-url` and `--create` (shown last)."""
    return common.flag_options("target", Target)(fn)
