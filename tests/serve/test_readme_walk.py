"""The README's "Using it with vLLM" commands, run as a newcomer runs them.

The code block under that heading is read from README.md and run in order, with a
fresh ``KVPOOL_HOME``: ``kvpool up``, ``vllm serve MODEL`` with the README's own
``--kv-transfer-config`` (no pool file named: the engine finds the one ``kvpool up``
wrote), ``kvpool status``, ``kvpool purge --dry-run`` and ``kvpool down``. MODEL is a
tiny random Llama built here (no model hub), and ``vllm serve`` gets a port and the
small-engine flags of this tier beside the README's own arguments. Between the
commands, the README's promises are checked: the server saves into the pool, a
restarted server answers from it exactly like its predecessor's local hit, the
request-level ``kv_transfer_params`` of its ``curl`` example are accepted, the status
and the purge see the saved objects, and ``kvpool down`` leaves no pool file.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.demo.server import VllmServer
from kvpool.pool import free_ports, wait_until

README = Path(__file__).resolve().parents[2] / "README.md"
ENGINE_ARGS = ["--block-size", "32", "--max-model-len", "2048", "--enforce-eager",
               "--max-num-seqs", "4"]  # fmt: skip
BIN = Path(sys.executable).parent
KV_HEADS = 2  # of the tier's tiny model
OBJECTS = 3 * 8 * KV_HEADS  # three prompts of 8 whole blocks of 32 tokens, one chunk each


def readme_block(heading: str) -> list[str]:
    """The commands of the first indented code block under ``heading``: one string per
    command (a line starting with ``.venv/bin/``; the lines after it that do not are
    its continuation), each with its trailing ``# comment`` cut off."""
    text = README.read_text()
    start = text.index(f"\n{heading}\n")
    lines = text[start:].splitlines()
    block: list[str] = []
    for line in lines[1:]:
        if line.startswith("    "):
            block.append(line[4:])
        elif block:
            break
    commands: list[str] = []
    for line in block:
        if line.startswith(".venv/bin/"):
            commands.append(line)
        else:
            commands[-1] += "\n" + line
    return [re.sub(r"\s+#[^'\n]*$", "", c) for c in commands]


def test_the_readme_block_is_read_as_the_commands_it_shows() -> None:
    commands = readme_block("## Using it with vLLM")
    assert [shlex.split(c)[:2] for c in commands] == [
        [".venv/bin/kvpool", "up"],
        [".venv/bin/vllm", "serve"],
        [".venv/bin/kvpool", "status"],
        [".venv/bin/kvpool", "purge"],
        [".venv/bin/kvpool", "down"],
    ]


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "kvpool-home"
    yield folder
    # A failed test must not leave the pool running.
    subprocess.run([str(BIN / "kvpool"), "down"], env=_env(folder), capture_output=True,
                   check=False, timeout=60)  # fmt: skip


def _env(home: Path) -> dict[str, str]:
    return dict(os.environ, KVPOOL_HOME=str(home), MC_TCP_BIND_ADDRESS="127.0.0.1")


def _argv(command: str, model: Path) -> list[str]:
    argv = shlex.split(command.replace("MODEL", str(model)))
    return [str(BIN / Path(argv[0]).name), *argv[1:]]


def _run(command: str, model: Path, home: Path) -> str:
    out = subprocess.run(_argv(command, model), env=_env(home), capture_output=True,
                         text=True, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, (command, out.stdout[-2000:], out.stderr[-2000:])
    return out.stdout


def _status(home: Path) -> dict[str, object]:
    return json.loads(_run(".venv/bin/kvpool status --json", Path("."), home))  # type: ignore[no-any-return]


def _server(serve_cmd: str, model: Path, home: Path, name: str) -> VllmServer:
    argv = _argv(serve_cmd, model)
    assert argv[1:3] == ["serve", str(model)]
    (port,) = free_ports(1)
    server = VllmServer(model, home.parent, port, [*argv[3:], *ENGINE_ARGS], name=name,
                        env={**_env(home), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})  # fmt: skip
    server.start()
    return server


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(8 * 32 + 5)]


def test_the_readme_commands_run_in_order_and_do_what_the_readme_says(
    tiny_model: Path, home: Path
) -> None:
    up, serve_cmd, status, purge, down = readme_block("## Using it with vLLM")

    printed = _run(up, tiny_model, home)
    # "kvpool up prints the exact --kv-transfer-config (with the pool file)"
    pool_file = home / "pool.json"
    assert pool_file.exists()
    assert f'"pool_file":"{pool_file}"' in printed, printed

    prompts = [_prompt(seed) for seed in range(3)]
    cold = _server(serve_cmd, tiny_model, home, "readme-cold")
    try:
        local = []
        for ids in prompts:
            assert cold.complete(ids).cached_tokens == 0
            local.append(cold.complete(ids))  # a local prefix-cache hit
        # Every prompt's 8 whole blocks are saved: one object per chunk and KV head.
        assert wait_until(lambda: _status(home)["keys"] == OBJECTS, 60), _status(home)
    finally:
        cold.stop()

    shown = _run(status, tiny_model, home)
    assert re.search(rf"keys\W+{OBJECTS}\b", shown), shown
    dry = _run(purge, tiny_model, home)
    assert f"would remove {OBJECTS} objects" in dry, dry

    fresh = _server(serve_cmd, tiny_model, home, "readme-fresh")
    try:
        # A fresh server has nothing cached but the pool. The README's command keeps
        # the default 50 ms lookup deadline, which a loaded CI machine can miss once:
        # one pool hit of three distinct prompts is required, and every answer must
        # equal the cold server's local hit.
        answers = [fresh.complete(ids) for ids in prompts]
        assert max(a.cached_tokens for a in answers) == 8 * 32, answers
        for answer, reference in zip(answers, local, strict=True):
            assert (answer.text, answer.logprobs) == (reference.text, reference.logprobs)
        # The README's curl example: a request that saves nothing and loads at most 4096.
        params = {"max_offload_tokens": 0, "max_load_tokens": 4096}
        body = {"model": str(tiny_model), "prompt": "private data", "max_tokens": 16,
                "kv_transfer_params": params}  # fmt: skip
        headers = {"Content-Type": "application/json"}
        url = fresh.url + "/v1/completions"
        request = urllib.request.Request(url, json.dumps(body).encode(), headers)
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert json.loads(reply.read())["choices"][0]["text"] is not None
        assert fresh.failure() is None
    finally:
        fresh.stop()

    stopped = _run(down, tiny_model, home)
    assert "stopped" in stopped, stopped
    assert not pool_file.exists()
