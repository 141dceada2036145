"""What `kvtool inspect|validate|prune|rm` act on (`Target`): the SSD cache, whose directory must
exist when it was named (`existing_cache_dir`; `--create` makes it), or with `--remote` /
`--remote-url` the remote tier's server (`Server`, also what `kvtool remote ...` connects to)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.cli import common

DEFAULT_TIMEOUT = "5s"  # operator commands: a SCAN of a large server needs more than the serving deadline
DEFAULT_MAX_KEYS = 10_000_000

URL_HELP = ("Server: redis://\\[user:password@]host\\[:port]\\[/db], rediss:// (TLS: ?ssl_ca_certs=FILE...), "
            "unix:///path.sock, redis+cluster://host:port. Default: remote_url of --config, else $KVTOOL_REMOTE_URL.")  # fmt: skip
UrlOpt = Annotated[str | None, typer.Option("--remote-url", help=URL_HELP, show_default=False, rich_help_panel="Server")]
LegacyUrlOpt = Annotated[str | None, typer.Option("--url", hidden=True)]
ClusterOpt = Annotated[bool, typer.Option("--cluster", help="The server is a Redis Cluster (implied by redis+cluster://).",
                                          rich_help_panel="Server")]  # fmt: skip
TimeoutOpt = Annotated[str, typer.Option("--timeout", help="Deadline of each server command: 5s, 500ms.",
                                         rich_help_panel="Server")]  # fmt: skip
MaxKeysOpt = Annotated[int, typer.Option("--max-keys", min=1, help="Stop listing after this many keys (reported as truncated).",
                                         rich_help_panel="Server")]  # fmt: skip


def server_options(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a `kvtool remote` command whose parameter `server: Server` stands for the options
    `names` (fields of `Server` that are options; none named: all of them); its `--remote-url`
    (declared by the command itself: it comes first) fills `server.url` (`Server.at`)."""
    return common.flag_options("server", Server, names)


@dataclass(frozen=True)
class Server:
    """Where a remote command connects: its flags, resolved when it connects.

    Attributes:
        url: the URL flag (None: the config's `remote_url`, else `$KVTOOL_REMOTE_URL`); as an
            option, the hidden `--url` (the name these commands used before: `at` lets
            `--remote-url` win).
        cluster: `--cluster` (a `redis+cluster://` URL or `remote_cluster = true` imply it too).
        timeout: deadline of each server command, a duration with its unit (`5s`, `500ms`).
        max_keys: listings stop after this many keys (reported as truncated).
        config: `--config` (None: `$KVTOOL_CONFIG`, else the default location).
        flag: the URL flag's name, for messages (`--remote-url`).
    """

    url: LegacyUrlOpt = None
    cluster: ClusterOpt = False
    timeout: TimeoutOpt = DEFAULT_TIMEOUT
    max_keys: MaxKeysOpt = DEFAULT_MAX_KEYS
    config: common.ConfigOpt = None
    flag: str = "--remote-url"

    def at(self, url: str | None) -> Server:
        """This server with the URL flag `url` (`--remote-url`; None: the hidden `--url`, if given)."""
        return replace(self, url=url if url is not None else self.url)

    def resolve(self) -> tuple[str, bool | None, float]:
        """`(url, cluster, timeout_s)`: the URL from the flag, else the environment, else the
        config file (`kvtool.config.settings`); `cluster` True or None (the URL decides).

        Raises:
            CLIError: no URL anywhere, a bad timeout, a `--config` that does not exist.
            ConfigError: a bad `remote_url` in a layer (its password masked).
        """
        from kvtool.config import ConfigError
        from kvtool.config.settings import resolve_settings

        cfg = resolve_settings({"remote_url": self.url}, self.config, {"remote_url": self.flag}).config
        try:
            timeout_s = cfg.replace(remote_timeout=self.timeout).remote_timeout_s
        except ConfigError as exc:
            raise common.CLIError(f"--timeout: {exc.reason}") from None
        if cfg.remote_url is None:
            raise common.CLIError(f"no remote server: give {self.flag}, set remote_url in the config file, "
                                  "or set $KVTOOL_REMOTE_URL")  # fmt: skip
        return cfg.remote_url, True if (self.cluster or cfg.remote_cluster) else None, timeout_s

    @contextmanager
    def connect(self) -> Iterator[Any]:
        """A checked `kvtool.ops.remote_ops.Connection` (PING answered), closed on exit.

        Raises:
            CLIError, ConfigError: see `resolve`. RemoteURLError, RemoteConnectError: a malformed
                URL; unreachable, wrong password, TLS failure, not a cluster (one line each).
        """
        from kvtool.ops.remote_ops import connect

        url, cluster, timeout_s = self.resolve()
        conn = connect(url, cluster=cluster, timeout_s=timeout_s)
        try:
            yield conn
        finally:
            conn.close()


SERVER = Server()  # the default of a command's `server` parameter (`server_options` always passes one)

CreateOpt = Annotated[bool, typer.Option(
    "--create", help="Create the cache directory if it does not exist (without it, a --cache-dir, $KVTOOL_CACHE_DIR "
    "or config file ssd_cache_dir that does not exist is an error, exit 2; the default directory never is).")]


def existing_cache_dir(settings: Any, create: bool | None = False) -> Path:
    """The cache directory of `settings` (`kvtool.config.settings.Settings`), which an operator
    command reads: one named by a flag, a variable or a config file must exist (a typo would
    otherwise look like an empty cache and exit 0), unless `create` (then it is made, with the
    config's `ssd_dir_mode`; None: the command has no `--create`, which the error then does not
    suggest). The default directory may be missing: nothing was cached yet.

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
                              hint="check the path" + ("" if create is None else ", or add --create to start an empty cache there"))
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
