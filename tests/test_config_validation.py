"""One validation layer for config files, flags and sweep files (issues 9 and 12).

Every bad input is a `ConfigError` naming its field (a `KVToolError`, exit 2), never a traceback
(`UnicodeDecodeError`, `AttributeError`, `OverflowError`, `RuntimeError`, `TypeError`), and the
same text means the same value in a TOML file, on the command line and in a sweep file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.cli.common import build_config
from kvtool.config import (
    DURABILITY_MODES,
    ConfigError,
    Durability,
    KVToolConfig,
    SSDPolicy,
    default_cache_dir,
    load_config,
)
from kvtool.errors import KVToolError
from kvtool.units import MAX_BYTES, parse_duration, parse_size

BIG = "1" * 400  # a 400-digit number


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtool.toml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------ same rules everywhere
@pytest.mark.parametrize("text,expected", [('"1GiB"', 1 << 30), ('"512MB"', 512 * 10**6), ('"512M"', 512 << 20), ('"4096"', 4096)])
def test_toml_sizes_are_accepted_as_the_flag_accepts_them(tmp_path, text, expected):
    from_file = load_config(_toml(tmp_path, f"ram_bytes = {text}\n"))
    from_flag = build_config(ram_bytes=text.strip('"'))
    assert from_file.ram_bytes == from_flag.ram_bytes == expected


@pytest.mark.parametrize("text,days", [('"12h"', 0.5), ('"2w"', 14.0), ('"3d"', 3.0), ('"2"', 2.0)])
def test_ttl_days_takes_days_or_a_duration_string(tmp_path, text, days):
    assert load_config(_toml(tmp_path, f"ssd_ttl_days = {text}\n")).ssd_ttl_days == days


@pytest.mark.parametrize("flag", [BIG, "lots"])
def test_bad_ram_bytes_flag_names_the_flag(flag):
    from kvtool.cli.common import CLIError

    with pytest.raises(CLIError, match="--ram-bytes") as info:
        build_config(ram_bytes=flag)
    assert info.value.exit_code == 2 and len(str(info.value)) < 200


def test_flush_interval_takes_a_duration_string():
    assert KVToolConfig(ssd_flush_interval_s="2m").ssd_flush_interval_s == 120.0


def test_sweep_cache_table_uses_the_same_rules():
    from kvtool.bench.sweep import parse_sweep

    doc = {"model": "tiny", "cache": {"ssd_ttl_days": True}, "workloads": {"restart": {}}}
    with pytest.raises(ConfigError) as info:
        parse_sweep(doc)
    assert info.value.field == "cache.ssd_ttl_days"


# ------------------------------------------------------------------ bad values in a TOML file
@pytest.mark.parametrize(
    "line,field",
    [
        ("ssd_ttl_days = true", "ssd_ttl_days"),
        ("ram_bytes = true", "ram_bytes"),
        ("ssd_flush_interval_s = true", "ssd_flush_interval_s"),
        ("ssd_persistent_max_retries = true", "ssd_persistent_max_retries"),
        ("ssd_ttl_days = nan", "ssd_ttl_days"),
        ("ssd_ttl_days = inf", "ssd_ttl_days"),
        ("ssd_flush_interval_s = nan", "ssd_flush_interval_s"),
        ("ssd_flush_interval_s = inf", "ssd_flush_interval_s"),
        (f"ram_bytes = {BIG}", "ram_bytes"),
        (f"block_size = {BIG}", "block_size"),
        (f"ssd_writer_queue_size = {BIG}", "ssd_writer_queue_size"),
        (f"ssd_ttl_days = {BIG}", "ssd_ttl_days"),
        ('ssd_cache_dir = ""', "ssd_cache_dir"),
        ('ssd_cache_dir = "   "', "ssd_cache_dir"),
        ("ssd_cache_dir = 5", "ssd_cache_dir"),
        ('ssd_cache_dir = ["a", "b"]', "ssd_cache_dir"),
        ("ssd_cache_dir = true", "ssd_cache_dir"),
        ('ssd_cache_dir = "~nosuchuser-kvtool/cache"', "ssd_cache_dir"),
        ('ssd_cache_dir = "a\\u0000b"', "ssd_cache_dir"),
        ("kvtool = 5", "kvtool"),
        ('kvtool = "x"', "kvtool"),
    ],
)
def test_bad_toml_value_is_a_config_error_naming_the_field(tmp_path, line, field):
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, line + "\n"))
    assert info.value.field == field
    assert info.value.exit_code == 2
    assert len(str(info.value)) < 200  # one short line, even for a 400-digit input


def test_binary_config_file_is_a_config_error(tmp_path):
    path = tmp_path / "kvtool.toml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00 block_size = 64")
    with pytest.raises(ConfigError, match="not a UTF-8 text file") as info:
        load_config(path)
    assert info.value.field == "<file>"


def test_deeply_nested_toml_is_a_config_error(tmp_path):
    path = _toml(tmp_path, "block_size = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(path)


def test_unknown_field_names_the_closest_field(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, "blok_size = 32\n"))
    assert info.value.field == "blok_size" and info.value.hint == "did you mean 'block_size'?"


def test_unknown_keyword_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        KVToolConfig(ram_byte=5)
    assert info.value.field == "ram_byte" and "ram_bytes" in info.value.hint


# ------------------------------------------------------------------ Python construction
@pytest.mark.parametrize(
    "changes,field",
    [
        ({"ram_bytes": True}, "ram_bytes"),
        ({"ram_bytes": MAX_BYTES + 1}, "ram_bytes"),
        ({"ssd_ttl_days": float("nan")}, "ssd_ttl_days"),
        ({"ssd_persistent_max_retries": True}, "ssd_persistent_max_retries"),
        ({"ssd_cache_dir": ""}, "ssd_cache_dir"),
        ({"ssd_cache_dir": 3.5}, "ssd_cache_dir"),
    ],
)
def test_bad_keyword_value_is_a_config_error(changes, field, tmp_path):
    with pytest.raises(ConfigError) as info:
        KVToolConfig(ssd_cache_dir=tmp_path).replace(**changes)
    assert info.value.field == field


def test_assignment_is_validated(tmp_path):
    cfg = KVToolConfig(ssd_cache_dir=tmp_path)
    with pytest.raises(ConfigError) as info:
        cfg.block_size = True
    assert info.value.field == "block_size" and cfg.block_size == 64


def test_replace_keeps_values_and_validates(tmp_path):
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, ram_bytes="2MiB", ssd_ttl_days="36h", ssd_policy="evict_only")
    copy = cfg.replace(block_size=16)
    assert (copy.ram_bytes, copy.ssd_ttl_days, copy.ssd_policy, copy.block_size) == (2 << 20, 1.5, "evict_only", 16)
    assert copy.ssd_cache_dir == tmp_path and cfg.block_size == 64
    with pytest.raises(ConfigError, match="block_size"):
        cfg.replace(block_size=0)


# ------------------------------------------------------------------ enums
def test_policy_durability_and_writer_are_str_enums(tmp_path):
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, ssd_policy="evict_only", ssd_durability="durable")
    assert isinstance(cfg.ssd_policy, SSDPolicy) and cfg.ssd_policy is SSDPolicy.EVICT_ONLY
    assert cfg.ssd_policy == "evict_only" and f"{cfg.ssd_policy}/{cfg.ssd_durability}" == "evict_only/durable"
    assert isinstance(cfg.ssd_durability, Durability) and json.dumps(cfg.ssd_durability) == '"durable"'
    assert KVToolConfig(ssd_cache_dir=tmp_path).ssd_policy == "write_through"
    assert tuple(SSDPolicy) == ("evict_only", "write_through")
    assert DURABILITY_MODES == ("best_effort", "persistent", "durable")


# ------------------------------------------------------------------ directories
def test_default_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path / "kv"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "kv"
    monkeypatch.delenv("KVTOOL_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "kvtool"
    assert KVToolConfig().ssd_cache_dir == tmp_path / "xdg" / "kvtool"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # invalid per the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "kvtool"


def test_unexpandable_cache_dir_env_is_a_config_error(monkeypatch):
    monkeypatch.setenv("KVTOOL_CACHE_DIR", "~nosuchuser-kvtool/kv")
    with pytest.raises(ConfigError, match="KVTOOL_CACHE_DIR") as info:
        KVToolConfig()
    assert info.value.field == "ssd_cache_dir"


@pytest.mark.parametrize("value,mode", [(None, 0o700), (0o2770, 0o2770), ('"2770"', 0o2770), ('"0o750"', 0o750)])
def test_dir_mode_field(tmp_path, value, mode):
    text = "" if value is None else f"ssd_dir_mode = {value if isinstance(value, str) else oct(value)}\n"
    assert load_config(_toml(tmp_path, text)).ssd_dir_mode == mode


@pytest.mark.parametrize("value,needle", [(0o600, "owner"), (0o17777, "0o7777"), (True, "octal"), ("rwx", "octal"), ("0o9", "octal")])
def test_dir_mode_rejects(tmp_path, value, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        KVToolConfig(ssd_cache_dir=tmp_path, ssd_dir_mode=value)
    assert info.value.field == "ssd_dir_mode"


# ------------------------------------------------------------------ errors and units
def test_config_error_is_a_kvtool_error_with_exit_code_and_hint():
    err = ConfigError("block_size", "must be >= 1", hint="try 64")
    assert isinstance(err, KVToolError) and isinstance(err, ValueError)
    assert (err.field, err.reason, err.exit_code, err.hint) == ("block_size", "must be >= 1", 2, "try 64")
    assert str(err) == "config field 'block_size': must be >= 1"
    assert KVToolError("x", exit_code=3).exit_code == 3 and KVToolError("x").hint is None


@pytest.mark.slow
def test_errors_module_imports_nothing_heavy():
    code = "import sys, kvtool.errors; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'pydantic', 'typer', 'numpy')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("bad", [BIG, BIG + "GiB", True, False, 1.5, -1, str(MAX_BYTES + 1)])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("bad", [BIG, BIG + "d", True, float("nan"), float("inf"), -5, "99999w"])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_parse_is_exact():
    assert parse_size("0.5KiB") == 512 and parse_size(str(MAX_BYTES)) == MAX_BYTES
    assert parse_duration("1.5h") == 5400.0 and parse_duration(2, default_unit="d") == 172800.0
