"""Sweep definitions: TOML -> `SweepSpec`, grid expansion into `Cell`s, validation.

A sweep file (see `bench_configs/quick.toml` for a commented example)::

    model = "tiny"            # preset, local mlx-lm directory or Hugging Face id
    seed = 0                  # workloads are deterministic from it
    repeats = 3               # runs of every (workload, cell), each in a fresh cache directory;
                              # the report states medians and min-max ranges over them
    max_tokens = 8            # decoded tokens per request
    baselines = ["no-cache", "mlx-lm-prompt-cache"]

    [cache]                   # KVToolConfig fields shared by every kvtool cell
    block_size = 64
    ram_bytes = "4MiB"        # sizes: integer bytes or strings like "4MiB", "1GB"

    [grid]                    # cartesian product; an omitted axis takes the [cache] value
    ssd_policy = ["evict_only", "write_through"]
    writer = ["sync", "async"]
    ssd_durability = ["best_effort", "persistent", "durable"]
    remote_policy = ["off", "write_through", "on_evict"]   # optional: the remote tier (default off)

    [workloads.shared-prefix] # one table per workload; keys override WORKLOAD_DEFAULTS
    requests = 6

The remote dimension (`remote_policy`, from the grid or `[cache]`; `off` unless the sweep names
it) runs against `[cache] remote_url` when given, else against a redis-server the bench starts on
loopback (`kvtool.bench.redis_local`); `$KVTOOL_REMOTE_URL` is never used. Before and after each
cell run the cell's namespace is removed from the server, as each cell run starts from an empty
cache directory. `restart_host = "new"` makes a workload's restart another host: the tier reopens
on an empty cache directory sharing the remote server (without a remote tier it starts cold);
`"same"` (the default) reopens the cell's own directory.

Errors are `ConfigError`s naming the field (`grid.writer`, `workloads.restart.prompts`, ...).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtool.bench.workloads import config_error, size_field, validate_params
from kvtool.config import FIELD_NAMES, ConfigError, KVToolConfig, parse_toml

KIND_KVTOOL = "kvtool"
BASELINE_NO_CACHE = "no-cache"
BASELINE_MLXLM = "mlx-lm-prompt-cache"
BASELINES = (BASELINE_NO_CACHE, BASELINE_MLXLM)
WRITERS = ("sync", "async")
GRID_AXES = ("ssd_policy", "writer", "ssd_durability", "block_size", "ram_bytes", "remote_policy")
REMOTE_OFF = "off"
RESTART_HOSTS = ("same", "new")
DEFAULT_BENCH_MAX_TOKENS = 8  # short decodes: the bench measures TTFT and the write path
DEFAULT_REPEATS = 3  # the report's winner rule needs a spread: fewer repeats give none worth the name


@dataclass(frozen=True)
class Cell:
    """One point of the sweep: a kvtool configuration or a baseline.

    Attributes:
        name: display name, e.g. `write_through/async/durable` or `no-cache`.
        kind: `kvtool`, `no-cache` or `mlx-lm-prompt-cache`.
        ssd_policy, writer, ssd_durability: the tier settings (None for baselines).
        block_size: tokens per block.
        ram_bytes: RAM tier budget (bytes; 0 for the baselines).
        remote_policy: `off`, `write_through` or `on_evict` (None for baselines).
    """

    name: str
    kind: str
    ssd_policy: str | None = None
    writer: str | None = None
    ssd_durability: str | None = None
    block_size: int = 0
    ram_bytes: int = 0
    remote_policy: str | None = None

    @property
    def remote(self) -> bool:
        """The cell uses the remote tier."""
        return self.kind == KIND_KVTOOL and self.remote_policy not in (None, REMOTE_OFF)

    @property
    def slug(self) -> str:
        """File-system-safe name (used for the cell's cache sub-directory)."""
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)

    def config(self, base: KVToolConfig, cache_dir: Path) -> KVToolConfig:
        """The engine configuration of this cell with its SSD tier rooted at `cache_dir`.

        For `mlx-lm-prompt-cache` this is the engine's parked configuration (no tier), since
        the baseline does not use kvtool's tier. The remote tier uses `base.remote_url` (the
        runner sets it) in a cell whose `remote_policy` is not `off`.
        """
        if self.kind != KIND_KVTOOL:
            return base.replace(ssd_enabled=False, ram_bytes=0, ssd_cache_dir=cache_dir, remote_url=None)
        return base.replace(
            remote_url=base.remote_url if self.remote else None,
            remote_policy=self.remote_policy or REMOTE_OFF,
            ssd_enabled=True,
            ssd_policy=self.ssd_policy,
            ssd_async_writes=self.writer == "async",
            ssd_durability=self.ssd_durability,
            block_size=self.block_size,
            ram_bytes=self.ram_bytes,
            ssd_cache_dir=cache_dir,
        )

    def columns(self) -> dict[str, Any]:
        """The cell's identifying columns for the CSV files: its fields, `name` as `cell`."""
        fields = asdict(self)
        return {"cell": fields.pop("name"), **fields}


@dataclass(frozen=True)
class SweepSpec:
    """A parsed, validated sweep definition.

    Attributes:
        name: sweep name (default: the file stem).
        model: model spec for `kvtool.models.loader.load_model`.
        seed: workload seed.
        repeats: runs per (workload, cell) (default `DEFAULT_REPEATS`).
        max_tokens: decoded tokens per request.
        baselines: baseline cells to run, in order.
        cache: KVToolConfig overrides shared by all cells.
        grid: axis -> values.
        workloads: workload name -> complete parameters, in file order.
        cache_root: where cell caches go (None: `<run_dir>/cache`).
        keep_cache: keep each cell's cache directory after it ran (default: delete it).
        restart_host: `same` (a restart reopens the cell's directory) or `new` (an empty one:
            another host sharing the remote server).
        raw: the TOML document as read (recorded in run.json).
    """

    name: str
    model: str
    seed: int
    repeats: int
    max_tokens: int
    baselines: tuple[str, ...]
    cache: dict[str, Any]
    grid: dict[str, tuple[Any, ...]]
    workloads: dict[str, dict[str, Any]]
    cache_root: Path | None = None
    keep_cache: bool = False
    restart_host: str = "same"
    raw: dict[str, Any] = field(default_factory=dict)

    def base_config(self, cache_dir: Path) -> KVToolConfig:
        """The `[cache]` settings over the KVToolConfig defaults, rooted at `cache_dir`; the remote
        URL only from `[cache]` (never `$KVTOOL_REMOTE_URL`), the remote policy `off` unless set."""
        return KVToolConfig(**{"remote_policy": REMOTE_OFF, **self.cache, "remote_url": self.cache.get("remote_url"),
                               "ssd_cache_dir": cache_dir})  # fmt: skip

    @property
    def needs_remote(self) -> bool:
        """Some cell uses the remote tier."""
        return any(c.remote for c in self.cells())

    def cells(self) -> list[Cell]:
        """Baselines first, then the grid's cartesian product (axes in `GRID_AXES` order)."""
        base = self.base_config(Path("."))
        defaults = {
            "ssd_policy": base.ssd_policy, "writer": "async" if base.ssd_async_writes else "sync",
            "ssd_durability": base.ssd_durability, "block_size": base.block_size, "ram_bytes": base.ram_bytes,
            "remote_policy": str(base.remote_policy),
        }
        cells = [Cell(name=b, kind=b, block_size=base.block_size) for b in self.baselines]
        axes = [self.grid.get(axis, (defaults[axis],)) for axis in GRID_AXES]
        for point in itertools.product(*axes):
            values = dict(zip(GRID_AXES, point))
            parts = [values["ssd_policy"], values["writer"], values["ssd_durability"]]
            if len(self.grid.get("block_size", ())) > 1:
                parts.append(f"bs{values['block_size']}")
            if len(self.grid.get("ram_bytes", ())) > 1:
                parts.append(f"ram{_human_bytes(values['ram_bytes'])}")
            if "remote_policy" in self.grid or values["remote_policy"] != REMOTE_OFF:
                parts.append(f"remote-{values['remote_policy']}")
            cells.append(Cell(name="/".join(parts), kind=KIND_KVTOOL, **values))
        return cells


def _human_bytes(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def load_sweep(path: Path | str) -> SweepSpec:
    """Read and validate a sweep TOML file.

    Raises:
        FileNotFoundError: `path` does not exist.
        ConfigError: invalid TOML or an invalid field (the error names it).
    """
    path = Path(path)
    data = parse_toml(path.read_bytes(), path)  # not UTF-8 (a binary file) or not TOML: one ConfigError
    return parse_sweep(data, default_name=path.stem)


class _SweepTable(BaseModel):
    """The top level of a sweep file (see the module docstring); `cache`, `grid` and `workloads`
    are checked against kvtool's config and the workloads' parameters below."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")] | None = None
    seed: Annotated[int, Field(ge=0)] = 0
    repeats: Annotated[int, Field(ge=1)] = DEFAULT_REPEATS
    max_tokens: Annotated[int, Field(ge=1)] = DEFAULT_BENCH_MAX_TOKENS
    baselines: list[Literal[BASELINES]] = list(BASELINES)  # type: ignore[valid-type]
    cache_root: Annotated[str, Field(min_length=1)] | None = None
    keep_cache: bool = False
    restart_host: Literal[RESTART_HOSTS] = "same"  # type: ignore[valid-type]
    cache: dict[str, Any] = {}
    grid: dict[str, Any] = {}
    workloads: Annotated[dict[str, Any], Field(min_length=1)]


def parse_sweep(data: dict[str, Any], default_name: str = "sweep") -> SweepSpec:
    """Validate a sweep document (the parsed TOML) and build the `SweepSpec`.

    Raises:
        ConfigError: the first invalid field, named (e.g. `grid.ssd_durability`).
    """
    try:
        t = _SweepTable.model_validate(data)
    except ValidationError as exc:
        raise config_error(exc, "", {"": _SweepTable}) from None
    cache = _parse_cache(t.cache)
    return SweepSpec(
        name=t.name or default_name, model=t.model, seed=t.seed, repeats=t.repeats, max_tokens=t.max_tokens,
        baselines=tuple(dict.fromkeys(t.baselines)), cache=cache, grid=_parse_grid(t.grid, cache),
        workloads=_parse_workloads(t.workloads), cache_root=Path(t.cache_root).expanduser() if t.cache_root else None,
        keep_cache=t.keep_cache, restart_host=t.restart_host, raw=data,
    )  # fmt: skip


def _parse_cache(table: dict[str, Any]) -> dict[str, Any]:
    for key in table:
        if key not in FIELD_NAMES or key == "ssd_cache_dir":
            why = "is set per cell by the runner" if key == "ssd_cache_dir" else "unknown kvtool config field"
            raise ConfigError(f"cache.{key}", why)
    table = dict(table)
    if "ram_bytes" in table:
        table["ram_bytes"] = size_field("cache.ram_bytes", table["ram_bytes"])
    try:
        KVToolConfig(**{**table, "ssd_cache_dir": Path(".")})
    except ConfigError as exc:
        raise ConfigError(f"cache.{exc.field}", str(exc).split(": ", 1)[-1]) from None
    return dict(table)


def _parse_grid(table: dict[str, Any], cache: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    grid: dict[str, tuple[Any, ...]] = {}
    for axis, values in table.items():
        field_name = f"grid.{axis}"
        if axis not in GRID_AXES:
            raise ConfigError(field_name, f"unknown axis; known: {', '.join(GRID_AXES)}")
        if not isinstance(values, list) or not values:
            raise ConfigError(field_name, "must be a non-empty list")
        if axis == "ram_bytes":
            values = [size_field(field_name, v) for v in values]
        if len(set(values)) != len(values):
            raise ConfigError(field_name, f"duplicate values in {values!r}")
        for value in values:
            _check_axis_value(axis, value, cache)
        grid[axis] = tuple(values)
    return grid


def _check_axis_value(axis: str, value: Any, cache: dict[str, Any]) -> None:
    field_name = f"grid.{axis}"
    if axis == "writer":
        if value not in WRITERS:
            raise ConfigError(field_name, f"must be one of {', '.join(WRITERS)}, got {value!r}")
        return
    try:
        KVToolConfig(**{**cache, axis: value, "ssd_cache_dir": Path(".")})
    except ConfigError as exc:
        raise ConfigError(field_name, str(exc).split(": ", 1)[-1]) from None


def _parse_workloads(table: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, params in table.items():
        if not isinstance(params, dict):
            raise ConfigError(f"workloads.{name}", "must be a table")
        if "ram_bytes" in params:
            params = {**params, "ram_bytes": size_field(f"workloads.{name}.ram_bytes", params["ram_bytes"])}
        out[name] = validate_params(name, params)
    return out
