"""The `[serve_load]` config: keys, defaults and their validation (`kvtool bench CONFIG`).

A bench config whose TOML has a `[serve_load]` table (and nothing else at the top level) is run
by `kvtool bench CONFIG` through `kvtool.bench.loadcell` instead of the policy sweep. Keys (all
optional but `workloads`; see `bench_configs/serve_load.toml`):

    [serve_load]
    name = "serve_load"         # run id suffix (default: the file stem)
    model = "tiny"              # kvtool preset, model directory or HF id (mlx_lm.server gets its path)
    seed = 0                    # workloads and Poisson arrivals are deterministic from it
    repeats = 3                 # batches per cell; the servers' order rotates from repeat to repeat
    clients = [1, 4, 16]        # concurrency levels (closed loop) or in-flight caps (poisson, trace)
    servers = ["kvtool", "mlx-lm"]  # mlx-lm is the baseline; outputs are compared when both run;
                                # "mlx-lm-1000": mlx_lm.server --prompt-cache-size 1000, a second baseline
    arrival = "closed"          # closed | poisson (then rate = requests/s); trace workloads use their times
    max_tokens = 8              # generated tokens per request (greedy, temperature 0)
    max_requests = 0            # per phase: send at most this many requests (0: all)
    max_wall_s = 600            # per phase: nothing runs past this (s); cut requests are failures
    request_timeout_s = 600     # HTTP timeout per request (s)
    warmup = true               # one short unrecorded request after every server start
    start_timeout_s = 180       # readiness wait (GET /v1/models) (s)
    stop_timeout_s = 60         # SIGTERM -> SIGKILL (s)
    cache_root = "/mnt/nvme/x"  # where kvtool's cache directories go (default: <run dir>/cache)
    keep_cache = false          # keep them after the run

    [serve_load.kvtool]         # `kvtool serve` cache flags (default: kvtool's)
    block_size = 64             # --block-size
    ram_bytes = "256MiB"        # --ram-bytes (a multi-turn workload's own ram_bytes wins)
    policy = "write_through"    # --policy;  durability = "best_effort" (--durability); async = true (--async/--sync)
    args = []                   # more `kvtool serve` flags, verbatim

    [serve_load.workloads.shared-prefix]   # one table per workload (kvtool.bench.loadworkloads)
    groups = 1
    prompts_per_group = 48
    system_tokens = 2000
    question_tokens = 32

    [serve_load.workloads."multi-turn@16"]  # `<workload>@<label>`: another instance of a workload
    conversations = 16                      # (its own parameters; reported under the whole name)
    clients = [1, 4]                        # in any workload table: its own client counts
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from kvtool.bench.loadserver import DEFAULT_SERVERS, SERVER_KINDS
from kvtool.bench.loadworkloads import validate_load_params
from kvtool.bench.workloads import config_error
from kvtool.config import ConfigError
from kvtool.units import parse_size

SECTION = "serve_load"
KVTOOL_FLAGS = {"block_size": "--block-size", "ram_bytes": "--ram-bytes", "policy": "--policy",
                "durability": "--durability", "codec": "--codec"}


@dataclass(frozen=True)
class ServeLoadSpec:
    """A parsed `[serve_load]` config (see the module docstring for every key)."""

    name: str
    model: str
    seed: int
    repeats: int
    clients: tuple[int, ...]
    servers: tuple[str, ...]
    arrival: str
    rate: float | None
    max_tokens: int
    max_requests: int
    max_wall_s: float
    request_timeout_s: float
    warmup: bool
    start_timeout_s: float
    stop_timeout_s: float
    kvtool: dict[str, Any]
    workloads: dict[str, dict[str, Any]]
    cache_root: Path | None = None
    keep_cache: bool = False
    workload_clients: dict[str, tuple[int, ...]] = field(default_factory=dict)
    base_dir: Path = Path(".")
    raw: dict[str, Any] = field(default_factory=dict)

    def kvtool_args(self, ram_bytes: int | None = None) -> tuple[str, ...]:
        """`kvtool serve` flags from `[serve_load.kvtool]` (`ram_bytes` overrides the table's)."""
        args: list[str] = []
        table = dict(self.kvtool)
        if ram_bytes is not None:
            table["ram_bytes"] = ram_bytes
        for key, flag in KVTOOL_FLAGS.items():
            if key in table:
                args += [flag, str(table[key])]
        if "async" in table:
            args.append("--async" if table["async"] else "--sync")
        return (*args, *table.get("args", []))

    def clients_of(self, workload: str) -> tuple[int, ...]:
        """The client counts a workload runs at: its table's `clients`, else the config's."""
        return self.workload_clients.get(workload, self.clients)


def is_serve_load_config(path: Path | str) -> bool:
    """True if `path` is a TOML file with a `[serve_load]` table (False for anything unreadable:
    the sweep loader then reports the error)."""
    try:
        with open(path, "rb") as fh:
            return SECTION in tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError):
        return False


def load_serve_load(path: Path | str) -> ServeLoadSpec:
    """Read and validate a `[serve_load]` config.

    Raises:
        ConfigError: invalid TOML or field (the error names it, e.g. `serve_load.clients`).
    """
    path = Path(path)
    with open(path, "rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("<file>", f"{path}: invalid TOML: {exc}") from None
    return parse_serve_load(data, default_name=path.stem, base_dir=path.resolve().parent)


def _distinct(value: list) -> list:
    if len(set(value)) != len(value):
        raise ValueError("must not repeat a value")
    return value


def _size(value: Any) -> Any:
    return parse_size(value) if isinstance(value, str) else value  # "64MiB" -> bytes (ValueError: not a size)


Clients = Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1), AfterValidator(_distinct)]
Seconds = Annotated[float, Field(gt=0)]  # inf: no limit; nan fails gt
SERVER_KIND = Literal[SERVER_KINDS]  # type: ignore[valid-type]  # the kinds `kvtool.bench.loadserver` starts


class _Table(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class _KvtoolFlags(_Table):
    """`[serve_load.kvtool]`: `kvtool serve` cache flags (`KVTOOL_FLAGS`)."""

    block_size: Annotated[int, Field(ge=1)] | None = None
    ram_bytes: Annotated[int, BeforeValidator(_size), Field(ge=0)] | None = None
    policy: str | None = None
    durability: str | None = None
    codec: str | None = None
    async_: bool | None = Field(None, alias="async")
    args: list[str] | None = None


class _ServeLoadTable(_Table):
    """`[serve_load]` (see the module docstring); the workloads' own keys are checked by
    `kvtool.bench.loadworkloads.validate_load_params`."""

    name: Annotated[str, Field(pattern=r"^[\w.-]+$")] | None = None
    model: Annotated[str, Field(min_length=1)] = "tiny"
    seed: Annotated[int, Field(ge=0)] = 0
    repeats: Annotated[int, Field(ge=1)] = 3
    clients: Clients = [1]
    servers: Annotated[list[SERVER_KIND], Field(min_length=1), AfterValidator(_distinct)] = list(DEFAULT_SERVERS)
    arrival: Literal["closed", "poisson"] = "closed"
    rate: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(None, validate_default=True)
    max_tokens: Annotated[int, Field(ge=1)] = 8
    max_requests: Annotated[int, Field(ge=0)] = 0
    max_wall_s: Seconds = 600.0
    request_timeout_s: Seconds = 600.0
    warmup: bool = True
    start_timeout_s: Seconds = 180.0
    stop_timeout_s: Seconds = 60.0
    cache_root: Annotated[str, Field(min_length=1)] | None = None
    keep_cache: bool = False
    kvtool: _KvtoolFlags = Field(default_factory=lambda: _KvtoolFlags.model_validate({}))
    workloads: Annotated[dict[str, dict[str, Any]], Field(min_length=1)]

    @field_validator("rate")
    @classmethod
    def _poisson_rate(cls, rate: float | None, info: ValidationInfo) -> float | None:
        if rate is None and info.data.get("arrival") == "poisson":
            raise ValueError("arrival = 'poisson' needs rate = requests/s > 0")
        return rate


def parse_serve_load(data: dict[str, Any], default_name: str = SECTION, base_dir: Path = Path(".")) -> ServeLoadSpec:
    """Validate a parsed config document (see `load_serve_load`).

    Raises:
        ConfigError: naming the offending key (`serve_load.clients`, `serve_load.workloads.<name>.<key>`).
    """
    extra = sorted(set(data) - {SECTION})
    if extra:
        raise ConfigError(extra[0], f"a [{SECTION}] config has no other top-level keys")
    try:
        t = _ServeLoadTable.model_validate(data[SECTION])
    except ValidationError as exc:
        raise config_error(exc, SECTION, {"": _ServeLoadTable, "kvtool": _KvtoolFlags}) from None
    workload_clients = {}
    for wname, params in t.workloads.items():
        if "clients" in params:
            try:
                workload_clients[wname] = tuple(TypeAdapter(Clients).validate_python(params["clients"], strict=True))
            except ValidationError as exc:
                raise config_error(exc, f"{SECTION}.workloads.{wname}.clients", {"": _ServeLoadTable}) from None
        validate_load_params(wname, {k: v for k, v in params.items() if k != "clients"})
    return ServeLoadSpec(
        **t.model_dump(exclude={"name", "clients", "servers", "kvtool", "workloads", "cache_root"}),
        name=t.name or default_name, clients=tuple(t.clients), servers=tuple(t.servers),
        kvtool=t.kvtool.model_dump(exclude_none=True, by_alias=True),
        workloads={k: {p: v for p, v in table.items() if p != "clients"} for k, table in t.workloads.items()},
        workload_clients=workload_clients, cache_root=Path(t.cache_root).expanduser() if t.cache_root else None,
        base_dir=base_dir, raw=data,
    )  # fmt: skip


__all__ = ["SECTION", "ServeLoadSpec", "is_serve_load_config", "load_serve_load", "parse_serve_load"]
