"""The CLI's shared options: defined once (`kvtool.cli.common`), grouped into one parameter
(`option_group`), and the same names, order and values in every command that takes them."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import typer
from typer.testing import CliRunner

from kvtool.cli import common
from kvtool.config import Codec, SSDPolicy


@dataclass(frozen=True)
class _Pair:
    a: int = 1
    b: str = "x"


_TABLE = {"a": (int, 1), "b": (str, "x")}


def test_option_group_puts_the_options_in_place_of_its_parameter_and_passes_one_object():
    seen = []

    @common.option_group("pair", _TABLE, _Pair, ["b", "a"])  # table order wins over the order asked
    def command(first: int = 0, pair: _Pair = _Pair(), last: bool = False) -> None:
        seen.append((first, pair, last))

    assert list(inspect.signature(command).parameters) == ["first", "a", "b", "last"]
    command(first=3, a=7, b="y", last=True)
    assert seen == [(3, _Pair(7, "y"), True)]


def test_cache_options_reach_the_config_and_name_their_flag(tmp_path):
    app = typer.Typer(add_completion=False)
    got = {}

    @app.command()
    @common.cache_options("cache_dir", "policy", "block_size", "codec")
    def show(cache: common.CacheFlags = common.CACHE) -> None:
        settings = cache.settings()
        got.update(config=settings.config, origins=settings.origins)

    res = CliRunner().invoke(app, ["--cache-dir", str(tmp_path), "--policy", "evict_only", "--block-size", "16",
                                   "--codec", "zstd"])
    assert res.exit_code == 0, res.output
    cfg = got["config"]
    assert (cfg.ssd_policy, cfg.block_size, cfg.ssd_codec) == (SSDPolicy.EVICT_ONLY, 16, Codec.ZSTD)
    assert cfg.ssd_cache_dir == Path(tmp_path).resolve()
    assert str(got["origins"]["ssd_policy"]).endswith("--policy") and str(got["origins"]["block_size"]).endswith("--block-size")


def test_the_policy_choices_show_the_default_first_and_accept_the_config_values(tmp_path):
    res = CliRunner().invoke(_app(), ["config", "show", "--help"], env={"COLUMNS": "200"})
    assert "<write_through|evict_only>" in res.output
    bad = CliRunner().invoke(_app(), ["config", "show", "--policy", "sometimes", "--cache-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "sometimes" in bad.output


def _app():
    from kvtool.cli.app import _register, app

    _register()
    return app
