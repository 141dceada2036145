"""Where each setting comes from: flag > environment > config file > default (the user's view:
docs/configuration.md).

1. a command-line flag (the CLI passes them as `flags`);
2. an environment variable `KVTOOL_<FIELD>`, read by pydantic-settings (`EnvSource`), then the
   older names of `ENV_ALIASES`; an empty variable is unset;
3. the config file: `--config FILE`, else `$KVTOOL_CONFIG`, else `default_config_file()` when it
   exists;
4. the field's default.

Each layer is validated on its own by `KVToolConfig`, so a bad value is a `ConfigError` naming
where it came from (`$KVTOOL_BLOCK_SIZE: must be an integer ...`) even where a higher layer
overrides it. Environment text is read as the TOML value a config file would hold (`from_text`).
`ssd_ttl` and its deprecated twin `ssd_ttl_days` are one setting: a layer that sets either hides
both from the layers below. `resolve_settings` returns the config with the origin of every field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from kvtool.config import FIELD_NAMES, ConfigError, KVToolConfig, read_config_file
from kvtool.config.validators import xdg_dir

ENV_PREFIX = "KVTOOL_"
CONFIG_ENV = "KVTOOL_CONFIG"  # the config file when no --config is given
# Variables read before the KVTOOL_<FIELD> pattern, still honoured after it.
ENV_ALIASES: dict[str, tuple[str, ...]] = {"ssd_cache_dir": ("KVTOOL_CACHE_DIR",)}
# Fields whose text is not a decimal integer although their value is an int (octal modes).
_TEXT_FIELDS = frozenset({"ssd_dir_mode"})
# Two names of one setting: a layer that sets either shadows both in the layers below.
_TWINS = {"ssd_ttl": "ssd_ttl_days", "ssd_ttl_days": "ssd_ttl"}
_INTEGER = re.compile(r"\s*[+-]?\d+\s*")

FLAG, ENV, FILE, DEFAULT = "flag", "env", "file", "default"  # Origin.kind, highest precedence first


def env_names(field: str) -> tuple[str, ...]:
    """The environment variables of `field`, in the order they are read: `KVTOOL_<FIELD>`, then
    its aliases."""
    return (ENV_PREFIX + field.upper(), *ENV_ALIASES.get(field, ()))


def from_text(field: str, text: str) -> Any:
    """The value of `field` given as text (an environment variable), as a config file would hold
    it: `true` / `false` (any case) for a boolean field, an int for decimal digits in an integer
    field; otherwise `text` itself, for the field's validator to accept or refuse."""
    annotation = KVToolConfig.model_fields[field].annotation
    if annotation is bool:
        return {"true": True, "false": False}.get(text.strip().lower(), text)
    if annotation is int and field not in _TEXT_FIELDS and _INTEGER.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # more digits than Python converts: the validator reports the text
            return text
    return text


class KVToolSettings(KVToolConfig, BaseSettings):
    """`KVToolConfig`'s fields as pydantic-settings sees them: the settings class `EnvSource`
    reads variables for. kvtool builds its configs with `resolve_settings`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, case_sensitive=True, env_ignore_empty=True)


class EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source, reading `env_names(field)` for each field (the
    `KVTOOL_<FIELD>` pattern, then the aliases) and converting the text with `from_text`.

    Attributes:
        names: field -> the variable its value came from (after the source was called).
    """

    def __init__(self) -> None:
        """Read the process environment now (empty variables count as unset)."""
        self.names: dict[str, str] = {}
        super().__init__(KVToolSettings)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """The text of the first of `env_names(field_name)` that is set, else None."""
        for name in env_names(field_name):
            text = self.env_vars.get(name)
            if text is not None:
                self.names[field_name] = name
                return text, field_name, False
        return None, field_name, False

    def prepare_field_value(self, field_name: str, field: FieldInfo, value: Any, value_is_complex: bool) -> Any:
        """`from_text(field_name, value)`; None (not set) stays None."""
        return None if value is None else from_text(field_name, value)


@dataclass(frozen=True)
class Origin:
    """Where a setting's value came from.

    Attributes:
        kind: `flag`, `env`, `file` or `default` (highest precedence first).
        name: the flag (`--block-size`), the variable (`KVTOOL_BLOCK_SIZE`) or the config file's
            path; None for a default.
    """

    kind: str
    name: str | None = None

    def __str__(self) -> str:
        """`flag --block-size`, `env KVTOOL_BLOCK_SIZE`, `config file PATH` or `default`."""
        label = "config file" if self.kind == FILE else self.kind
        return label if self.name is None else f"{label} {self.name}"


@dataclass(frozen=True)
class Settings:
    """A resolved config and where each of its values came from.

    Attributes:
        config: the validated config.
        origins: field name -> `Origin`, for every field.
        config_file: the config file read, None when there is none.
        config_file_origin: how it was found: `--config`, `$KVTOOL_CONFIG` or `default location`.
    """

    config: KVToolConfig
    origins: dict[str, Origin]
    config_file: Path | None = None
    config_file_origin: str | None = None


def default_config_file() -> Path | None:
    """`$XDG_CONFIG_HOME/kvtool/config.toml` (if that variable is absolute; the XDG spec ignores
    a relative one), else `~/.config/kvtool/config.toml`; None without a home directory."""
    path = xdg_dir("XDG_CONFIG_HOME", ".config")
    return None if path is None else path / "config.toml"


def find_config_file(explicit: Path | None = None) -> tuple[Path | None, str | None]:
    """The config file to read and how it was found: `explicit` (`--config`), else
    `$KVTOOL_CONFIG`, else `default_config_file()` when it is a file; `(None, None)` for none.

    Raises:
        ConfigError: `--config` or `$KVTOOL_CONFIG` names no file (`config file not found: ...`, or
            `... is a directory, not a file: ...`).
    """
    if explicit is not None:
        if not explicit.is_file():
            raise ConfigError("<file>", f"{_not_a_file(explicit)}: {explicit}")
        return explicit, "--config"
    named = os.environ.get(CONFIG_ENV)
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ConfigError("<file>", f"{_not_a_file(path)}: {path} (${CONFIG_ENV})")
        return path, f"${CONFIG_ENV}"
    default = default_config_file()
    if default is not None and default.is_file():
        return default, "default location"
    return None, None


def _not_a_file(path: Path) -> str:
    return "is a directory, not a file" if path.is_dir() else "not found"


def _validated(values: dict[str, Any], where: Mapping[str, str] | None = None) -> KVToolConfig:
    """The config of `values` (one layer alone, or the layers merged). `where` (field -> flag,
    variable or file) prefixes the error's message (`$KVTOOL_BLOCK_SIZE: ...`); without it (a
    config file alone) the error keeps its own text.

    Raises:
        ConfigError: an invalid value, naming the field and, with `where`, its flag or variable.
    """
    try:
        return KVToolConfig(**values)
    except ConfigError as exc:
        if where is None or exc.field not in where:
            raise
        raise ConfigError(exc.field, f"{where[exc.field]}: {exc.reason}", hint=exc.hint) from None


def resolve_settings(
    flags: Mapping[str, Any] | None = None,
    config_path: Path | None = None,
    flag_names: Mapping[str, str] | None = None,
) -> Settings:
    """The config from flags > environment > config file > defaults, with each field's origin.

    Args:
        flags: field values given on the command line (None: not given).
        config_path: `--config`; None: `$KVTOOL_CONFIG`, else the default location if it exists.
        flag_names: field -> the flag that set it (`--block-size`), for origins and messages.

    Raises:
        ConfigError: a bad value in any layer (naming the field, and the variable or flag), a
            config file that cannot be read, or one named by `--config` / `$KVTOOL_CONFIG` that
            does not exist.
    """
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    names = {k: (flag_names or {}).get(k, f"--{k.replace('_', '-')}") for k in given}
    path, found_by = find_config_file(config_path)
    file_values = read_config_file(path) if path is not None else {}
    env = EnvSource()
    env_values = env()
    # The environment first: the defaults of the other layers read $KVTOOL_CACHE_DIR / $KVTOOL_REMOTE_URL too.
    _validated(env_values, {k: f"${v}" for k, v in env.names.items()})
    _validated(file_values)
    _validated(given, names)

    merged: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    layers = ((FLAG, given, names), (ENV, env_values, env.names), (FILE, file_values, dict.fromkeys(file_values, str(path))))
    for kind, values, named in layers:
        taken = set(origins) | {_TWINS[f] for f in origins if f in _TWINS}
        for field in values.keys() - taken:
            merged[field] = values[field]
            origins[field] = Origin(kind, named[field])
    # an error here comes from a combination of layers (each was valid alone)
    config = _validated(merged, {k: f"${o.name}" if o.kind == ENV else str(o.name) for k, o in origins.items()})
    return Settings(config, {f: origins.get(f, Origin(DEFAULT)) for f in FIELD_NAMES}, path, found_by)
