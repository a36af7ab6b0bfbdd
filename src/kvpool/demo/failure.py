"""One line for a process that failed: how it ended and the line of its log that says why.

    exit_reason(rc)        -> "exit 1", "killed by SIGILL", ...
    last_error(log_text)   -> the log line that says most about the failure
    failure_line(what, rc, log_path) -> "WHAT (killed by SIGILL): Fatal Python error:
                              Illegal instruction (log: PATH)"; rc None: a process
                              that still runs (no "(...)")

The benches and the demo end with such a line (``kvpool: error: ...``), never a
traceback or a screen of log: the log's path is in the line. The line picked is,
from the end of the log, the first of: a fatal Python error (a signal, with
``PYTHONFAULTHANDLER``, which the servers and engines kvpool starts set), an
exception line (``SomethingError: ...``) other than vLLM's wrappers that only say
an engine is gone, a vLLM line saying a process died, an ERROR line; else the
last line.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

__all__ = ["exit_reason", "failure_line", "last_error"]

# vLLM prefixes its lines with "(EngineCore pid=12) ERROR 12-05 21:03:49 [core.py:1510] ",
# torch.distributed with "[rank0]: ".
_VLLM_PREFIX = re.compile(
    r"^(?:\[rank\d+\]:\s*)?(?:\([\w ]+pid=\d+\)\s+)?"
    r"(?:[A-Z]+\s+\d\d-\d\d [\d:]+\s+\[[^\]]*\]\s*)?"
)
_RULES = (
    re.compile(r"Fatal Python error: .*"),
    re.compile(r"^(?:[a-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Failed|Interrupt)\b: .*"),
    re.compile(r".*\bdied\b.*"),
    re.compile(r".*\bERROR\b.*"),
)
# Exception lines that say only that an engine is gone: the cause is elsewhere.
_WRAPPERS = re.compile(
    r"EngineDeadError|EngineGenerateError|Engine core initialization failed|"
    r"See root cause above|ServerFailed|EngineFailed"
)


def exit_reason(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit {rc}"


def last_error(log_text: str, limit: int = 1000) -> str:
    lines = [_VLLM_PREFIX.sub("", line).strip() for line in log_text.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return "(empty log)"
    for rule in _RULES:
        for line in reversed(lines):
            found = rule.search(line)
            if found and not _WRAPPERS.search(line):
                return _clip(found.group(0), limit)
    return _clip(lines[-1], limit)


def failure_line(what: str, rc: int | None, log_path: Path) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        text = ""
    how = "" if rc is None else f" ({exit_reason(rc)})"
    return f"{what}{how}: {last_error(text)} (log: {log_path})"


def _clip(line: str, limit: int) -> str:
    return line if len(line) <= limit else line[: limit - 3] + "..."
