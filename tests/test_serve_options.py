"""`kvtool serve` takes every `mlx_lm.server` option (read from mlx-lm's own parser) and passes it on.

- the option sets: `kvtool serve --help` lists every option `mlx_lm.server --help` lists;
- bad values are one `error:` line (mlx-lm's converter, the prompt-cache options' mapping);
- real servers: a custom `--chat-template` is what tokenizes the prompt (usage counts its tokens),
  `--prompt-cache-bytes` is the RAM tier's budget, `--trust-remote-code` reaches the tokenizer
  loading (a model directory whose tokenizer is remote code), `--kv-bits` serves quantized KV from
  the cache with `mlx_lm.server`'s output, `--draft-model` serves cached prefixes with the plain
  greedy output, and the quantized-weight presets (`tiny-4bit`, `tiny-8bit`) answer as
  `mlx_lm.server` does on the same directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module

REPO = Path(__file__).resolve().parent.parent
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
QUESTION = [{"role": "user", "content": "hello there, a long enough question about the cache and its blocks of "
                                        "tokens, more tokens here and there and everywhere"}]
if not app_module.app.registered_commands:
    app_module._register()
runner = CliRunner()


def _options(args: list[str]) -> set[str]:
    env = {**os.environ, "COLUMNS": "300", "TERM": "dumb", "NO_COLOR": "1"}
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    return set(OPTION.findall(res.stdout))


@pytest.mark.slow
def test_serve_help_lists_every_mlx_lm_server_option():
    ours = _options(["-m", "kvtool.cli.app", "serve", "--help"])
    theirs = _options(["-m", "mlx_lm.server", "--help"])
    assert {"--chat-template", "--kv-bits", "--draft-model", "--prompt-cache-bytes"} <= theirs
    assert theirs - ours == set()


@pytest.mark.parametrize(("args", "needle"), [
    (["--prompt-cache-size", "4"], "--prompt-cache-size: kvtool's RAM tier is bounded in bytes"),
    (["--prompt-cache-bytes", "1GiB"], "--prompt-cache-bytes: invalid value '1GiB' for mlx_lm.server"),
    (["--prompt-cache-bytes", "2GB", "--ram-bytes", "1GiB"], "disagree"),
    (["--chat-template-args", "{not json"], "--chat-template-args: invalid loads value"),
    (["--kv-bits", "7"], "KV quantization takes 2, 3, 4, 5, 6 or 8 bits"),
    (["--top-k", "many"], "--top-k"),
])  # fmt: skip
def test_bad_mlx_lm_options_are_one_error_line(tmp_path, args, needle):
    res = runner.invoke(app_module.app, ["serve", "--port", "0", "--cache-dir", str(tmp_path), *args])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr


# --------------------------------------------------------------------------- real servers
def _post(proc, path: str, body: dict) -> dict:
    req = urllib.request.Request(proc.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _chat(proc, messages=QUESTION, max_tokens: int = 8) -> tuple[str, int, int]:
    """(text, prompt tokens, cached prompt tokens) of a greedy chat request."""
    doc = _post(proc, "/v1/chat/completions", {"model": "default_model", "messages": messages,
                                                "max_tokens": max_tokens, "temperature": 0.0})
    usage = doc["usage"]
    return doc["choices"][0]["message"]["content"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_chat_template_and_prompt_cache_bytes(tmp_path):
    from transformers import AutoTokenizer

    from tests.test_serve_http import kvtool_cli, start_kvtool

    template = "{{ 'KVTOOL TEMPLATE MARKER: ' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model_path = kvtool_cli("model", "path", "tiny").stdout.strip()
    tok = AutoTokenizer.from_pretrained(model_path)
    default_n = len(tok.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True)["input_ids"])
    custom_n = len(tok.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True,
                                           chat_template=template)["input_ids"])
    assert custom_n != default_n
    proc = start_kvtool(tmp_path, "template", "--chat-template", template, "--prompt-cache-bytes", "64MB")
    try:
        text, n_prompt, cached = _chat(proc)
        again = _chat(proc)
    finally:
        assert proc.stop() == 143
    assert n_prompt == custom_n and cached == 0
    assert again == (text, custom_n, custom_n - 1)  # served from kvtool's RAM tier
    assert "RAM 61.0 MiB" in proc.text()  # --prompt-cache-bytes is the RAM tier's budget


def _remote_code_model(tmp_path: Path) -> Path:
    """The tiny model with a tokenizer that is remote code (`auto_map`): it prefixes a marker to
    every text it encodes."""
    from tests.test_serve_http import kvtool_cli

    model = tmp_path / "remote-code-model"
    shutil.copytree(kvtool_cli("model", "path", "tiny").stdout.strip(), model)
    (model / "marker_tok.py").write_text(
        "from transformers import Qwen2Tokenizer\n\n\n"
        "class MarkerTokenizer(Qwen2Tokenizer):\n"
        "    def _encode_plus(self, text, *args, **kwargs):\n"
        "        text = 'MARKER FROM REMOTE CODE ' + text if isinstance(text, str) else text\n"
        "        return super()._encode_plus(text, *args, **kwargs)\n"
    )
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MarkerTokenizer", auto_map={"AutoTokenizer": ["marker_tok.MarkerTokenizer", None]})
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


@pytest.mark.slow
def test_trust_remote_code_reaches_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from tests.test_serve_http import start_kvtool

    model = _remote_code_model(tmp_path)
    prompt = "a completion prompt for the remote-code tokenizer"
    expected = len(AutoTokenizer.from_pretrained(model, trust_remote_code=True).encode(prompt))
    counts = {}
    for name, extra in (("plain", ()), ("trusted", ("--trust-remote-code",))):
        (tmp_path / name).mkdir()
        proc = start_kvtool(tmp_path / name, name, "--model", str(model), *extra)
        try:
            doc = _post(proc, "/v1/completions", {"model": "default_model", "prompt": prompt, "max_tokens": 2})
        finally:
            assert proc.stop() == 143
        counts[name] = doc["usage"]["prompt_tokens"]
    assert counts["trusted"] == expected > counts["plain"]  # only the trusted server ran the remote tokenizer


@pytest.mark.slow
def test_kv_bits_matches_mlx_lm_server(tmp_path):
    from tests.server_procs import free_port
    from tests.test_serve_http import Proc, kvtool_cli, start_kvtool

    quant = ("--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0")
    proc = start_kvtool(tmp_path, "kvbits", *quant)
    try:
        first, second = _chat(proc), _chat(proc)
        with urllib.request.urlopen(proc.url + "/kvtool/stats", timeout=30) as r:
            doc = json.loads(r.read())
    finally:
        assert proc.stop() == 143
    assert second[0] == first[0] and first[2] == 0 and second[2] == second[1] - 1
    assert doc["uncached_reason"] is None and doc["adapter"]["inserts_uncacheable"] == 0
    port = free_port()
    oracle = Proc([sys.executable, "-m", "mlx_lm.server", "--model", kvtool_cli("model", "path", "tiny").stdout.strip(),
                   "--port", str(port), *quant], tmp_path / "oracle.log")
    oracle.url = f"http://127.0.0.1:{port}"
    try:
        oracle.wait_for(r"Starting httpd")
        expected = _chat(oracle)
    finally:
        oracle.kill()
    assert first[0] == expected[0]


@pytest.mark.slow
def test_draft_model_serves_cached_prefixes(tmp_path):
    from tests.test_serve_http import start_kvtool

    for name in ("plain", "draft"):
        (tmp_path / name).mkdir()
    plain = start_kvtool(tmp_path / "plain", "plain")
    try:
        expected = _chat(plain)
    finally:
        assert plain.stop() == 143
    proc = start_kvtool(tmp_path / "draft", "draft", "--draft-model", "tiny", "--num-draft-tokens", "2")
    try:
        first, second = _chat(proc), _chat(proc)
    finally:
        assert proc.stop() == 143
    assert first[0] == second[0] == expected[0]
    assert first[2] == 0 and second[2] == second[1] - 1  # the second one was served from the cache


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-4bit", "tiny-8bit"])
def test_quantized_weights_match_mlx_lm_server(tmp_path, preset):
    """A model as users download them (mlx_lm.convert -q: packed weights): the cold answer and the
    cached one are `mlx_lm.server`'s on the same model directory."""
    from tests.server_procs import free_port
    from tests.test_serve_http import Proc, kvtool_cli

    path = kvtool_cli("model", "path", preset).stdout.strip()
    assert "quantization" in json.loads((Path(path) / "config.json").read_text())
    proc = Proc([sys.executable, "-m", "kvtool.cli.app", "serve", "--model", preset, "--port", "0",
                 "--cache-dir", str(tmp_path / "cache")], tmp_path / "kvtool.log")
    proc.url = proc.wait_for(r"listening on (http://127\.0\.0\.1:\d+)").group(1)
    try:
        first, second = _chat(proc), _chat(proc)
    finally:
        assert proc.stop() == 143
    assert first[2] == 0 and second[2] == second[1] - 1  # the second one was served from the cache
    port = free_port()
    oracle = Proc([sys.executable, "-m", "mlx_lm.server", "--model", path, "--port", str(port)],
                  tmp_path / "oracle.log")
    oracle.url = f"http://127.0.0.1:{port}"
    try:
        oracle.wait_for(r"Starting httpd")
        expected = _chat(oracle)
    finally:
        oracle.kill()
    assert first[0] == second[0] == expected[0]
