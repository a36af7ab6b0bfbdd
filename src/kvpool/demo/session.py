"""A vLLM engine process driven phase by phase, so faults can happen in between.

    EngineSession.start(spec, workdir, name, env, on_progress)  ``python -m
                                    kvpool.demo.engine`` with a ``phases`` spec (and
                                    ``hold``: wait before phase 0)
    session.ready(timeout)          wait until the engine is up (only with ``hold``)
    session.next_phase(timeout)     let the next phase run; its results and the
                                    connector's counters so far
    session.finish(timeout)         let it end (no more phases); the final result
    session.kill()                  SIGKILL (an engine that crashes or is restarted)
    session.log()                   its stderr so far
    EngineSession.run(spec, ...)    start, run every phase (or the prompts) straight
                                    through, finish: the result, with ``"log"`` (and
                                    ``"phases"``: what each phase printed)

Lines from the engine are read on a thread into a queue; every wait is on that
queue with a deadline, and an engine that dies raises ``EngineFailed`` at once,
with one line: how it ended and its log's telling line (``kvpool.demo.failure``).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from kvpool.demo.failure import failure_line
from kvpool.errors import KVPoolError

__all__ = ["EngineFailed", "EngineSession"]


class EngineFailed(KVPoolError, RuntimeError):
    """The engine process exited or did not answer in time; the message is one line
    (how it ended, its log's telling line and the log's path)."""


class EngineSession:
    def __init__(
        self,
        proc: subprocess.Popen[str],
        log_path: Path,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        self._proc = proc
        self._on_progress = on_progress
        self._log_path = log_path
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._phase = 0
        self._held = False
        assert proc.stdout is not None
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    @classmethod
    def start(
        cls,
        spec: dict[str, Any],
        workdir: Path,
        name: str,
        env: dict[str, str] | None = None,
        on_progress: Callable[[int], None] | None = None,
        wrap: Sequence[str] = (),
    ) -> EngineSession:
        """Start the engine; ``on_progress(prompts done)`` with ``spec["progress"]``;
        ``wrap`` prefixes the command (e.g. ``ip netns exec h2``: another host)."""
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / f"{name}.json"
        path.write_text(json.dumps(spec))
        log_path = workdir / f"{name}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [*wrap, sys.executable, "-m", "kvpool.demo.engine", str(path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                # A signal's Python stack (and "Fatal Python error: ...") in the log.
                env=dict(os.environ, PYTHONFAULTHANDLER="1", **(env or {})),
            )
        session = cls(proc, log_path, on_progress)
        session._held = bool(spec.get("hold"))
        return session

    @classmethod
    def run(
        cls,
        spec: dict[str, Any],
        workdir: Path,
        name: str,
        env: dict[str, str] | None = None,
        on_progress: Callable[[int], None] | None = None,
        wrap: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Run ``spec`` without interruption; its result, with the engine's stderr
        as ``"log"``. Waits as long as the engine lives."""
        with cls.start(spec, workdir, name, env, on_progress, wrap) as session:
            phases = [session.next_phase(timeout=None) for _ in spec.get("phases", ())]
            result = session.finish(timeout=None)
            result["log"] = session.log()
            if phases:  # each phase's results and the connector's counters after it
                result["phases"] = phases
            return result

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith("KVPOOL-PROGRESS ") and self._on_progress is not None:
                self._on_progress(int(line.split()[1]))
            elif line.startswith("KVPOOL-"):
                self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _expect(self, prefix: str, timeout: float | None) -> str:
        try:
            line = self._lines.get(timeout=timeout)
            while line is not None and not line.startswith(prefix):
                line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise EngineFailed(
                f"no {prefix!r} from the engine {self._log_path.stem} within {timeout} s "
                f"(log: {self._log_path})"
            ) from None
        if line is None:
            self._proc.wait()
            what = f"the engine {self._log_path.stem} exited"
            raise EngineFailed(failure_line(what, self._proc.returncode, self._log_path))
        return line.removeprefix(prefix)

    def _send(self) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write("go\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died; _expect reports how

    def ready(self, timeout: float = 300.0) -> None:
        self._expect("KVPOOL-READY", timeout)

    def next_phase(
        self, timeout: float | None = 300.0, during: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Run the next phase and return its output; ``during()`` is called once the
        phase is under way (sent), before its output is awaited."""
        if self._phase > 0 or self._held:
            self._send()
        if during is not None:
            during()
        out: dict[str, Any] = json.loads(self._expect(f"KVPOOL-PHASE {self._phase} ", timeout))
        self._phase += 1
        return out

    def finish(self, timeout: float | None = 300.0) -> dict[str, Any]:
        """Skip the phases left; the engine prints its result and exits."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        result: dict[str, Any] = json.loads(self._expect("KVPOOL-RESULT ", timeout))
        self._proc.wait(timeout)
        return result

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def log(self) -> str:
        try:
            return self._log_path.read_text()
        except OSError:
            return ""

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
