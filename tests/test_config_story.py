"""One configuration story: flag > environment (`KVTOOL_<FIELD>`) > config file (`--config`, else
`$KVTOOL_CONFIG`, else `$XDG_CONFIG_HOME/kvtool/config.toml`) > default, and `kvtool config show`
reporting where every value came from.

Driven in-process with `CliRunner` (no model is loaded). Every test starts from an environment
without any kvtool setting and with `XDG_CONFIG_HOME` / `HOME` in its own temporary directory, so
neither the developer's shell nor their `~/.config/kvtool/config.toml` can change the outcome.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.cli import common
from kvtool.cli.cmd_config import shown_value
from kvtool.cli.output import SCHEMA_VERSION
from kvtool.config import FIELD_NAMES, KVToolConfig
from kvtool.config.settings import CONFIG_ENV, env_names, from_text
from kvtool.units import format_duration

if not app_module.app.registered_commands:
    app_module._register()
runner = CliRunner()
SECRET = "s3cret-Pa55"

# A valid, non-default text per field, as an environment variable would hold it, and the value
# `config show --json` then reports. A field missing here (a new one) is tested with its default's text.
SAMPLES: dict[str, tuple[str, object]] = {
    "ssd_enabled": ("false", False),
    "ssd_cache_dir": ("/tmp/kvtool-story-cache", "/tmp/kvtool-story-cache"),
    "ssd_ttl_days": ("3", 3.0),
    "ssd_ttl": ("1d12h", "36h"),
    "ssd_policy": ("evict_only", "evict_only"),
    "ssd_durability": ("durable", "durable"),
    "ssd_async_writes": ("FALSE", False),
    "ssd_writer_queue_size": ("64", 64),
    "ssd_flush_interval_s": ("2m", 120.0),
    "ssd_persistent_max_retries": ("7", 7),
    "block_size": ("128", 128),
    "ram_bytes": ("2MiB", 2 << 20),
    "ssd_dir_mode": ("2770", "0o2770"),
    "ssd_codec": ("zstd", "zstd"),
    "remote_url": (f"redis://user:{SECRET}@cache-host:6380/1", "redis://user:***@cache-host:6380/1"),
    "remote_policy": ("on_evict", "on_evict"),
    "remote_promote": ("false", False),
    "remote_ttl": ("7d", "7d"),
    "remote_timeout": ("1s", "1s"),
    "remote_cluster": ("true", True),
    "reply_cache": ("false", False),
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No kvtool setting in the environment; XDG_CONFIG_HOME and HOME in `tmp_path`."""
    for field in FIELD_NAMES:
        for name in env_names(field):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv("KVTOOL_REMOTE_PASSWORD", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")


def show(*args: str) -> dict:
    """`kvtool config show --json ARGS`, parsed (exit 0 required)."""
    res = runner.invoke(app_module.app, ["config", "show", "--json", *args])
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)


def one_error_line(res) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert res.stdout == "" and "Traceback" not in res.output
    return lines[0]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ------------------------------------------------------------------ the four sources
def test_config_show_reports_the_source_of_every_value(tmp_path, monkeypatch):
    conf = write(tmp_path / "kv.toml", 'block_size = 16\nssd_policy = "evict_only"\nram_bytes = "2MiB"\n')
    monkeypatch.setenv("KVTOOL_BLOCK_SIZE", "32")
    monkeypatch.setenv("KVTOOL_SSD_POLICY", "write_through")
    doc = show("--config", str(conf), "--block-size", "128")
    rows = doc["settings"]
    assert doc["schema_version"] == SCHEMA_VERSION and list(doc)[0] == "schema_version"
    assert list(rows) == list(FIELD_NAMES)  # every field, in the model's order
    assert rows["block_size"] == {"value": 128, "source": "flag", "from": "--block-size", "env": ["KVTOOL_BLOCK_SIZE"]}
    assert rows["ssd_policy"] | {"env": None} == {"value": "write_through", "source": "env", "from": "KVTOOL_SSD_POLICY", "env": None}
    assert rows["ram_bytes"] | {"env": None} == {"value": 2 << 20, "source": "file", "from": str(conf), "env": None}
    assert rows["ssd_codec"] | {"env": None} == {"value": "none", "source": "default", "from": None, "env": None}
    assert doc["config_file"] == {"path": str(conf), "found_by": "--config"}
    untouched = set(FIELD_NAMES) - {"block_size", "ssd_policy", "ram_bytes"}
    assert {rows[f]["source"] for f in untouched} == {"default"}


def test_human_output_names_each_source(tmp_path, monkeypatch):
    conf = write(tmp_path / "kv.toml", 'ram_bytes = "2MiB"\n')
    monkeypatch.setenv("KVTOOL_SSD_POLICY", "evict_only")
    res = runner.invoke(app_module.app, ["config", "show", "--config", str(conf), "--sync"])
    assert res.exit_code == 0, res.output
    lines = {w[0]: w[1:] for w in (line.strip().split(None, 2) for line in res.stdout.splitlines()) if w and w[0] in FIELD_NAMES}
    assert lines["ssd_async_writes"] == ["false", "flag --sync"]
    assert lines["ssd_policy"] == ["evict_only", "env KVTOOL_SSD_POLICY"]
    raw = {line.split()[0]: line.split() for line in res.stdout.splitlines() if line.strip()}
    assert raw["ram_bytes"][1:5] == ["2", "MiB", "config", "file"]  # human units; exact bytes in --json
    assert lines["block_size"] == ["64", "default"] and raw["ssd_ttl"][1:] == ["7d", "(default)", "default"]
    folded = "".join(res.stdout.split())  # a long path wraps at the console's width
    assert folded.startswith(f"configfile:{conf}(--config)") and f"configfile{conf}" in folded


LAYERS = ("flag", "env", "file")


@pytest.mark.parametrize("given", [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)],
                         ids=lambda g: "+".join(layer for layer, on in zip(LAYERS, g) if on) or "none")
def test_precedence_flag_over_env_over_file_over_default(tmp_path, monkeypatch, given):
    flag, env, file = given
    args = ["--block-size", "128"] if flag else []
    if env:
        monkeypatch.setenv("KVTOOL_BLOCK_SIZE", "32")
    if file:
        args += ["--config", str(write(tmp_path / "kv.toml", "block_size = 16\n"))]
    row = show(*args)["settings"]["block_size"]
    expected = ("flag", 128) if flag else ("env", 32) if env else ("file", 16) if file else ("default", 64)
    assert (row["source"], row["value"]) == expected
    assert common.build_config(tmp_path / "kv.toml" if file else None, block_size=128 if flag else None).block_size == expected[1]


@pytest.mark.parametrize("field", FIELD_NAMES)
def test_every_field_has_a_kvtool_variable(monkeypatch, field):
    var = f"KVTOOL_{field.upper()}"
    default = show()["settings"][field]["value"]
    if field not in SAMPLES and default is None:  # a new field without a sample: the variable is read and validated
        monkeypatch.setenv(var, "?")
        res = runner.invoke(app_module.app, ["config", "show", "--json"])
        assert f"${var}:" in one_error_line(res) if res.exit_code else json.loads(res.stdout)["settings"][field]["from"] == var
        return
    text, value = SAMPLES.get(field, (str(default).lower() if isinstance(default, bool) else str(default), default))
    monkeypatch.setenv(var, text)
    row = show()["settings"][field]
    assert row == {"value": value, "source": "env", "from": var, "env": list(env_names(field))}
    assert SECRET not in json.dumps(row)


# ------------------------------------------------------------------ the config file's places
def test_xdg_config_home_then_kvtool_config_then_flag(tmp_path, monkeypatch):
    xdg_file = write(tmp_path / "xdg" / "kvtool" / "config.toml", "block_size = 16\n")
    doc = show()
    assert doc["config_file"] == {"path": str(xdg_file), "found_by": "default location"}
    assert doc["settings"]["block_size"] | {"env": None} == {"value": 16, "source": "file", "from": str(xdg_file), "env": None}

    named = write(tmp_path / "named.toml", "block_size = 32\n")
    monkeypatch.setenv(CONFIG_ENV, str(named))
    doc = show()
    assert doc["config_file"] == {"path": str(named), "found_by": "$KVTOOL_CONFIG"}
    assert doc["settings"]["block_size"]["value"] == 32  # one file is read, never merged with the XDG one

    flag = write(tmp_path / "flag.toml", "ssd_codec = \"lz4\"\n")
    doc = show("--config", str(flag))
    assert doc["config_file"]["found_by"] == "--config" and doc["settings"]["block_size"]["source"] == "default"


def test_home_config_when_xdg_config_home_is_unset_or_relative(tmp_path, monkeypatch):
    home_file = write(tmp_path / "home" / ".config" / "kvtool" / "config.toml", "block_size = 8\n")
    for xdg in (None, "relative/dir"):  # a relative XDG_CONFIG_HOME is invalid per the spec: ignored
        if xdg is None:
            monkeypatch.delenv("XDG_CONFIG_HOME")
        else:
            monkeypatch.setenv("XDG_CONFIG_HOME", xdg)
        doc = show()
        assert doc["config_file"]["path"] == str(home_file) and doc["settings"]["block_size"]["value"] == 8


def test_no_config_file_anywhere_is_fine_and_a_missing_named_one_is_an_error(tmp_path, monkeypatch):
    assert show()["config_file"] is None
    line = one_error_line(runner.invoke(app_module.app, ["config", "show", "--config", str(tmp_path / "nope.toml")]))
    assert line == f"error: config file not found: {tmp_path / 'nope.toml'}"
    line = one_error_line(runner.invoke(app_module.app, ["config", "show", "--config", str(tmp_path)]))
    assert line == f"error: config file is a directory, not a file: {tmp_path}"
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "gone.toml"))
    line = one_error_line(runner.invoke(app_module.app, ["config", "show"]))
    assert "gone.toml" in line and "$KVTOOL_CONFIG" in line
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path))
    assert "is a directory" in one_error_line(runner.invoke(app_module.app, ["config", "show"]))


def test_a_bad_default_config_file_is_one_error_line(tmp_path):
    write(tmp_path / "xdg" / "kvtool" / "config.toml", "blok_size = 3\n")
    line = one_error_line(runner.invoke(app_module.app, ["config", "show"]))
    assert "blok_size" in line and "did you mean 'block_size'?" in line


# ------------------------------------------------------------------ environment values
@pytest.mark.parametrize(
    "var,text,needle",
    [
        ("KVTOOL_BLOCK_SIZE", "abc", "must be an integer"),
        ("KVTOOL_BLOCK_SIZE", "0", "from 1 to"),
        ("KVTOOL_BLOCK_SIZE", "1" * 400, "from 1 to"),
        ("KVTOOL_BLOCK_SIZE", "64.0", "must be an integer"),
        ("KVTOOL_SSD_POLICY", "sometimes", "must be one of"),
        ("KVTOOL_RAM_BYTES", "lots", "not a size"),
        ("KVTOOL_SSD_ASYNC_WRITES", "1", "true or false"),
        ("KVTOOL_SSD_ENABLED", "yes", "true or false"),
        ("KVTOOL_SSD_DIR_MODE", "777", "other users"),
        ("KVTOOL_SSD_TTL", "7", "has no unit"),
        ("KVTOOL_SSD_FLUSH_INTERVAL_S", "nan", "duration"),
        ("KVTOOL_CACHE_DIR", "~nosuchuser-kvtool/kv", "cannot expand"),
        ("KVTOOL_REMOTE_URL", f"redis://:{SECRET}@h:99999", "out of range"),
        ("KVTOOL_REMOTE_TIMEOUT", "2m", "from 1ms to 60s"),
    ],
)
def test_a_bad_environment_value_is_one_error_line_naming_the_variable(monkeypatch, var, text, needle):
    monkeypatch.setenv(var, text)
    line = one_error_line(runner.invoke(app_module.app, ["config", "show"]))
    assert f"${var}:" in line and needle in line and len(line) < 250 and SECRET not in line


def test_a_bad_environment_value_fails_every_command_even_under_a_flag(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_BLOCK_SIZE", "lots")
    for args in (["config", "show", "--block-size", "64"], ["inspect", "--cache-dir", str(tmp_path), "--json"],
                 ["prune", "--cache-dir", str(tmp_path), "--dry-run"]):
        assert "$KVTOOL_BLOCK_SIZE: must be an integer" in one_error_line(runner.invoke(app_module.app, args))


def test_empty_variables_are_unset_and_the_pattern_name_wins_over_the_alias(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_BLOCK_SIZE", "")
    assert show()["settings"]["block_size"]["source"] == "default"
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path / "old"))
    row = show()["settings"]["ssd_cache_dir"]
    assert (row["value"], row["from"]) == (str(tmp_path / "old"), "KVTOOL_CACHE_DIR")
    monkeypatch.setenv("KVTOOL_SSD_CACHE_DIR", str(tmp_path / "new"))
    row = show()["settings"]["ssd_cache_dir"]
    assert (row["value"], row["from"]) == (str(tmp_path / "new"), "KVTOOL_SSD_CACHE_DIR")
    conf = write(tmp_path / "kv.toml", f'ssd_cache_dir = "{tmp_path / "file"}"\n')
    assert show("--config", str(conf))["settings"]["ssd_cache_dir"]["source"] == "env"  # env > file, aliases too
    assert common.build_config(conf).ssd_cache_dir == tmp_path / "new"


def test_ssd_ttl_and_its_deprecated_twin_are_one_setting(tmp_path, monkeypatch):
    conf = write(tmp_path / "kv.toml", "ssd_ttl_days = 3\n")
    monkeypatch.setenv("KVTOOL_SSD_TTL", "12h")
    rows = show("--config", str(conf))["settings"]
    assert (rows["ssd_ttl"]["value"], rows["ssd_ttl"]["source"]) == ("12h", "env")
    assert (rows["ssd_ttl_days"]["value"], rows["ssd_ttl_days"]["source"]) == (None, "default")
    assert common.build_config(conf).ttl_s == 12 * 3600


def test_remote_url_password_is_masked_from_every_source(tmp_path, monkeypatch):
    conf = write(tmp_path / "kv.toml", f'remote_url = "rediss://:{SECRET}@file-host:6380/0?password={SECRET}"\n')
    for args in (["--json", "--config", str(conf)], ["--config", str(conf)]):
        res = runner.invoke(app_module.app, ["config", "show", *args])
        assert res.exit_code == 0 and "file-host" in res.stdout and "***" in res.stdout and SECRET not in res.output
    monkeypatch.setenv("KVTOOL_REMOTE_URL", f"redis://u:{SECRET}@env-host")
    assert show("--config", str(conf))["settings"]["remote_url"]["value"] == "redis://u:***@env-host"


# ------------------------------------------------------------------ helpers
@pytest.mark.parametrize("seconds,text", [(0.25, "250ms"), (1, "1s"), (90, "90s"), (3600, "1h"), (129600, "36h"),
                                          (604800, "7d"), (86400 * 3, "3d"), (1.5, "1.5s")])
def test_duration_text(seconds, text):
    assert format_duration(seconds) == text


def test_shown_values_read_back_as_the_same_config(tmp_path):
    """What `config show` prints is accepted back by a config file (and equals what it holds)."""
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, ssd_ttl="1d12h", remote_ttl="2w", remote_timeout="250ms",
                       ssd_dir_mode="2770", ram_bytes="3GiB")
    shown = {f: shown_value(f, getattr(cfg, f)) for f in FIELD_NAMES if f != "remote_url"}
    again = KVToolConfig(**{f: v for f, v in shown.items() if v is not None})
    assert all(getattr(again, f) == getattr(cfg, f) for f in shown)


@pytest.mark.parametrize("field,text,value", [("block_size", " 12 ", 12), ("ssd_enabled", "True", True),
                                              ("ssd_dir_mode", "2770", "2770"), ("ram_bytes", "4096", 4096),
                                              ("ssd_policy", "evict_only", "evict_only"), ("block_size", "1e3", "1e3")])
def test_from_text(field, text, value):
    assert from_text(field, text) == value
