"""A real ``vllm serve`` process with kvpool: start it, ask it, stop it.

    VllmServer(model, folder, port, extra_args, name=..., env=...)
    server.start(timeout_s)    launch ``vllm serve`` (the OpenAI server with the
                               multiprocess engine core) and return once ``/health``
                               answers; ``ServerFailed`` (one line: how it ended,
                               its log's telling line) if the process exits or the
                               deadline passes
    server.failure()           None while the server and its engines are healthy;
                               else that one line (a dead engine leaves the API
                               server up, answering 500s)
    server.complete(ids, dp_rank=None, max_tokens=8, kv_transfer_params=None)
                               one greedy completion of a token-id prompt; with
                               ``dp_rank``, vLLM routes it to that DP engine
                               (``X-data-parallel-rank``); ``kv_transfer_params``
                               go to the connector (per-request control)
    server.metrics()           the server's Prometheus text (``/metrics``)
    server.stop(timeout_s)     SIGTERM the process group, SIGKILL what is left
    kv_transfer_config(pool_file, **extra)   the JSON ``kvpool up`` prints
    vllm_command()             the ``vllm`` console script beside this Python

A headless DP follower (``--headless``) serves no HTTP: ``start(wait_health=False)``
returns once the process runs, and the head's ``/health`` says when every engine
is up. Used by the serve test tier; loopback only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.demo.failure import failure_line
from kvpool.errors import KVPoolError

__all__ = ["Completion", "ServerFailed", "VllmServer", "kv_transfer_config", "vllm_command"]

_HOST = "127.0.0.1"


class ServerFailed(KVPoolError):
    """A ``vllm serve`` process exited or did not come up in time."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One answer: generated text, per-token logprobs, and the prompt tokens the
    server reports as cached (``usage.prompt_tokens_details.cached_tokens``)."""

    text: str
    logprobs: tuple[float, ...]
    prompt_tokens: int
    cached_tokens: int


def vllm_command() -> str:
    """The ``vllm`` console script of this environment."""
    return str(Path(sys.executable).parent / "vllm")


def kv_transfer_config(pool_file: str, **extra: Any) -> str:
    """``--kv-transfer-config`` for kvpool, as ``kvpool up`` prints it."""
    return json.dumps(
        {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool_file": pool_file, **extra},
        }
    )


class VllmServer:
    """One ``vllm serve`` process (and its engine processes). See the module docstring."""

    def __init__(
        self,
        model: str | Path,
        folder: str | Path,
        port: int,
        extra_args: Sequence[str] = (),
        *,
        name: str = "server",
        env: dict[str, str] | None = None,
    ) -> None:
        self.model = str(model)
        self.port = port
        self.args = [
            vllm_command(),
            "serve",
            self.model,
            "--host",
            _HOST,
            "--port",
            str(port),
            "--enable-prompt-tokens-details",
            *extra_args,
        ]
        self.name = name
        self.log_path = Path(folder) / f"{name}.log"
        # PYTHONFAULTHANDLER: a process killed by a signal leaves "Fatal Python error"
        # and its stack in the log.
        self.env = {
            **os.environ,
            "MC_TCP_BIND_ADDRESS": _HOST,
            "PYTHONFAULTHANDLER": "1",
            **(env or {}),
        }
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{_HOST}:{self.port}"

    def start(self, timeout_s: float = 300.0, wait_health: bool = True) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group: stop() reaches the engines
            )
        if wait_health:
            self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Return once ``/health`` answers 200; ``ServerFailed`` if the process
        exits first or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is None or self._proc.poll() is not None:
                rc = None if self._proc is None else self._proc.returncode
                what = f"vllm serve {self.name} exited before it was healthy"
                raise ServerFailed(failure_line(what, rc, self.log_path))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                what = f"vllm serve {self.name} not healthy in {timeout_s:g} s"
                raise ServerFailed(failure_line(what, None, self.log_path))
            # The server process offers no readiness event to wait on: poll its endpoint.
            time.sleep(1.0)

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def failure(self) -> str | None:
        """None while the process runs and ``/health`` answers 200 (every engine
        alive); else one line: what ended, and the telling line of its log."""
        if self._proc is None:
            return f"vllm serve {self.name} is not running (log: {self.log_path})"
        if self._proc.poll() is not None:
            what = f"vllm serve {self.name} exited"
            return failure_line(what, self._proc.returncode, self.log_path)
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        return failure_line(f"vllm serve {self.name}: an engine died", None, self.log_path)

    def complete(
        self,
        ids: Sequence[int],
        dp_rank: int | None = None,
        max_tokens: int = 8,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Completion:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 1,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        headers = {"Content-Type": "application/json"}
        if dp_rank is not None:
            headers["X-data-parallel-rank"] = str(dp_rank)
        req = urllib.request.Request(
            self.url + "/v1/completions", json.dumps(body).encode(), headers
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        choice = answer["choices"][0]
        usage = answer["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            text=choice["text"],
            logprobs=tuple(choice["logprobs"]["token_logprobs"]),
            prompt_tokens=int(usage["prompt_tokens"]),
            cached_tokens=int(details.get("cached_tokens") or 0),
        )

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return str(r.read().decode())

    def stop(self, timeout_s: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # Engine processes of the group may outlive the API server by a moment.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
