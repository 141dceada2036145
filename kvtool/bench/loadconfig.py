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
from typing import Any

from kvtool.bench.loadserver import DEFAULT_SERVERS, SERVER_KINDS
from kvtool.bench.loadworkloads import validate_load_params
from kvtool.bench.workloads import int_key, size_field
from kvtool.config import ConfigError

SECTION = "serve_load"
WHERE = f"{SECTION}."  # the prefix of every field name in an error
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


def parse_serve_load(data: dict[str, Any], default_name: str = SECTION, base_dir: Path = Path(".")) -> ServeLoadSpec:
    """Validate a parsed config document (see `load_serve_load`)."""
    extra = sorted(set(data) - {SECTION})
    if extra:
        raise ConfigError(extra[0], f"a [{SECTION}] config has no other top-level keys")
    t = data[SECTION]
    if not isinstance(t, dict):
        raise ConfigError(SECTION, "must be a table")
    known = {"name", "model", "seed", "repeats", "clients", "servers", "arrival", "rate", "max_tokens", "max_requests",
             "max_wall_s", "request_timeout_s", "warmup", "start_timeout_s", "stop_timeout_s", "cache_root",
             "keep_cache", "kvtool", "workloads"}
    for key in t:
        if key not in known:
            raise ConfigError(f"{SECTION}.{key}", f"unknown key; known: {', '.join(sorted(known))}")
    clients = _clients(t.get("clients", [1]), f"{SECTION}.clients")
    servers = t.get("servers", list(DEFAULT_SERVERS))
    if not isinstance(servers, list) or not servers or any(s not in SERVER_KINDS for s in servers) \
            or len(set(servers)) != len(servers):
        raise ConfigError(f"{SECTION}.servers", f"must be a list drawn from {', '.join(SERVER_KINDS)}, got {servers!r}")
    arrival = t.get("arrival", "closed")
    if arrival not in ("closed", "poisson"):
        raise ConfigError(f"{SECTION}.arrival", f"must be closed or poisson (trace workloads use their times), "
                                                f"got {arrival!r}")
    rate = t.get("rate")
    if arrival == "poisson" and not (isinstance(rate, (int, float)) and not _bad_num(rate) and rate > 0):
        raise ConfigError(f"{SECTION}.rate", f"arrival = 'poisson' needs rate = requests/s > 0, got {rate!r}")
    name = t.get("name", default_name)
    if not isinstance(name, str) or not name or any(not (ch.isalnum() or ch in "_.-") for ch in name):
        raise ConfigError(f"{SECTION}.name", "must be a non-empty string of letters, digits, '_', '.', '-'")
    model = t.get("model", "tiny")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{SECTION}.model", "must be a preset name, model directory or Hugging Face id")
    for key in ("warmup", "keep_cache"):
        if not isinstance(t.get(key, True), bool):
            raise ConfigError(f"{SECTION}.{key}", "must be true or false")
    cache_root = t.get("cache_root")
    if cache_root is not None and (not isinstance(cache_root, str) or not cache_root):
        raise ConfigError(f"{SECTION}.cache_root", "must be a directory path")
    workloads = t.get("workloads")
    if not isinstance(workloads, dict) or not workloads:
        raise ConfigError(f"{SECTION}.workloads", f"at least one [{SECTION}.workloads.<name>] table is required")
    workload_clients = {}
    for wname, params in workloads.items():
        if not isinstance(params, dict):
            raise ConfigError(f"{SECTION}.workloads.{wname}", "must be a table")
        if "clients" in params:
            workload_clients[wname] = _clients(params["clients"], f"{SECTION}.workloads.{wname}.clients")
        validate_load_params(wname, {k: v for k, v in params.items() if k != "clients"})
    return ServeLoadSpec(
        name=name, model=model, seed=int_key(t, "seed", 0, 0, WHERE), repeats=int_key(t, "repeats", 3, 1, WHERE),
        clients=clients, servers=tuple(servers), arrival=arrival, rate=float(rate) if rate else None,
        max_tokens=int_key(t, "max_tokens", 8, 1, WHERE), max_requests=int_key(t, "max_requests", 0, 0, WHERE),
        max_wall_s=_num(t, "max_wall_s", 600.0), request_timeout_s=_num(t, "request_timeout_s", 600.0),
        warmup=t.get("warmup", True), start_timeout_s=_num(t, "start_timeout_s", 180.0),
        stop_timeout_s=_num(t, "stop_timeout_s", 60.0), kvtool=_parse_kvtool(t.get("kvtool", {})),
        workloads={k: {p: v for p, v in table.items() if p != "clients"} for k, table in workloads.items()},
        workload_clients=workload_clients,
        cache_root=Path(cache_root).expanduser() if cache_root else None, keep_cache=t.get("keep_cache", False),
        base_dir=base_dir, raw=data,
    )  # fmt: skip


def _clients(value: Any, field_name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or any(_bad_int(c, 1) for c in value) or len(set(value)) != len(value):
        raise ConfigError(field_name, f"must be a non-empty list of distinct integers >= 1, got {value!r}")
    return tuple(value)


def _bad_int(value: Any, minimum: int) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < minimum


def _bad_num(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float)) or value != value


def _num(t: dict[str, Any], key: str, default: float) -> float:
    value = t.get(key, default)
    if _bad_num(value) or value <= 0:
        raise ConfigError(f"{SECTION}.{key}", f"must be a number of seconds > 0, got {value!r}")
    return float(value)


def _parse_kvtool(table: Any) -> dict[str, Any]:
    where = f"{SECTION}.kvtool"
    if not isinstance(table, dict):
        raise ConfigError(where, "must be a table of kvtool serve cache flags")
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key == "ram_bytes":
            value = size_field(f"{where}.ram_bytes", value)
            if _bad_int(value, 0):
                raise ConfigError(f"{where}.ram_bytes", f"must be a size (bytes or e.g. '64MiB'), got {value!r}")
        elif key == "block_size":
            if _bad_int(value, 1):
                raise ConfigError(f"{where}.block_size", f"must be an integer >= 1, got {value!r}")
        elif key in ("policy", "durability", "codec"):
            if not isinstance(value, str):
                raise ConfigError(f"{where}.{key}", f"must be a string, got {value!r}")
        elif key == "async":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.async", "must be true or false")
        elif key == "args":
            if not isinstance(value, list) or any(not isinstance(a, str) for a in value):
                raise ConfigError(f"{where}.args", "must be a list of strings")
        else:
            raise ConfigError(f"{where}.{key}", "unknown key; known: block_size, ram_bytes, policy, durability, "
                                                "codec, async, args")
        out[key] = value
    return out


__all__ = ["SECTION", "ServeLoadSpec", "is_serve_load_config", "load_serve_load", "parse_serve_load"]
