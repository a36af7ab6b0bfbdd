"""One line for a process that died (``kvpool.demo.failure``), and the servers,
engines and benches that end with it instead of a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvpool.bench.serve import _phase
from kvpool.demo.failure import exit_reason, failure_line, last_error
from kvpool.demo.server import ServerFailed, VllmServer

SIGILL_LOG = """\
(APIServer pid=2768) WARNING 12-05 20:48:53 [system_utils.py:255] Found ulimit of 20000 and \
failed to automatically increase with error current limit exceeds maximum limit. This can \
cause fd limit errors like `OSError: [Errno 24] Too many open files`.
Fatal Python error: Illegal instruction

Thread 0x00007f (most recent call first):
  File "vllm/v1/attention/backends/cpu_attn.py", line 410 in forward
(EngineCore pid=3) ERROR 12-05 21:03:53 [multiproc_executor.py:315] Worker proc VllmWorker-0 \
died unexpectedly (exit code: -4), shutting down executor.
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace \
(above) for the root cause.
"""

START_LOG = """\
(EngineCore pid=7093) ERROR 12-05 21:03:49 [core.py:1510] EngineCore failed to start.
(EngineCore pid=7093) ERROR 12-05 21:03:49 [core.py:1510] ValueError: To serve at least one \
request with the model's max seq len (2048), (0.25 GiB KV cache is needed
(EngineCore pid=7093) ERROR 12-05 21:03:53 [multiproc_executor.py:315] Worker proc \
VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
  warnings.warn('resource_tracker: There appear to be %d '
"""


def test_the_telling_line_is_the_fatal_error_then_the_cause_then_who_died() -> None:
    assert last_error(SIGILL_LOG) == "Fatal Python error: Illegal instruction"
    assert last_error(START_LOG).startswith("ValueError: To serve at least one request")
    no_cause = SIGILL_LOG.replace("Fatal Python error: Illegal instruction", "")
    assert last_error(no_cause).startswith("Worker proc VllmWorker-0 died unexpectedly")
    assert last_error("a\n\nlast words\n\n") == "last words"
    torch_dist = "[rank0]: AttributeError: 'X' object has no attribute 'y'\nI1205 finish\n"
    assert last_error(torch_dist) == "AttributeError: 'X' object has no attribute 'y'"
    assert last_error("") == "(empty log)"
    assert len(last_error("KeyError: " + "x" * 5000)) == 1000


def test_exit_reasons_name_signals() -> None:
    assert exit_reason(-4) == "killed by SIGILL"
    assert exit_reason(1) == "exit 1"
    assert exit_reason(-200) == "killed by signal 200"


def test_failure_line_is_one_line_with_the_log_path(tmp_path: Path) -> None:
    log = tmp_path / "warm.log"
    log.write_text(SIGILL_LOG)
    line = failure_line("the warm engine exited", -4, log)
    assert line == (
        f"the warm engine exited (killed by SIGILL): Fatal Python error: Illegal instruction "
        f"(log: {log})"
    )
    assert "\n" not in failure_line("x", None, tmp_path / "absent.log")


def _dying_server(tmp_path: Path) -> VllmServer:
    """A 'server' whose process writes SIGILL_LOG and dies of SIGILL."""
    server = VllmServer("model", tmp_path, 9, name="kvpool-warm")
    code = f"import os,signal,sys; sys.stdout.write({SIGILL_LOG!r}); sys.stdout.flush(); " + (
        "os.kill(os.getpid(), signal.SIGILL)"
    )
    server.args = [sys.executable, "-c", code]
    return server


def test_a_server_that_dies_ends_the_start_and_the_bench_phase_with_one_line(
    tmp_path: Path,
) -> None:
    server = _dying_server(tmp_path)
    with pytest.raises(ServerFailed) as failed:
        server.start(timeout_s=60)
    message = str(failed.value)
    assert message.startswith("vllm serve kvpool-warm exited before it was healthy (killed by")
    assert "Fatal Python error: Illegal instruction" in message and "\n" not in message

    def never() -> dict[str, float]:
        raise AssertionError("the phase must not run against a dead server")

    with pytest.raises(ServerFailed, match=r"^vllm serve kvpool-warm exited \(killed by SIGILL\)"):
        _phase(server, never)
