"""Save threads that yield the CPU: Linux's ``SCHED_IDLE``, raised while saves starve.

    SaveThreads(priority, starve_s=STARVE_S)   "idle" or "normal"
    threads.enter()         a save thread starts: under SCHED_IDLE ("idle")
    threads.queued()        a save job was queued for one of them
    threads.done()          one of them finished a job
    threads.moved()         one of them staged or put a piece of a job
    threads.raised          how many times starving saves were raised
    threads.close()         stop the watchdog

A thread under ``SCHED_IDLE`` runs only on CPU time no other thread of the machine
wants, so copying and putting a save never delays a forward or the engine's own
scheduling. On a host that is never idle it would hardly run: a watchdog thread
(normal priority, asleep while no save is queued) raises every save thread to
normal priority once saves have been queued for ``starve_s`` with no piece of them
staged or put, and lowers them again once nothing is queued. Leaving ``SCHED_IDLE`` needs
``CAP_SYS_NICE`` (or an ``RLIMIT_NICE`` of 20): a process that cannot is tried once,
on a thread of its own, and its save threads then run at normal priority (said once),
never in a state they could not leave.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Literal

__all__ = ["STARVE_S", "SaveThreads", "can_leave_idle"]

logger = logging.getLogger(__name__)

STARVE_S = 0.5  # queued saves with no piece moved this long: raise the threads

_probe: list[bool] = []  # this process's answer, once
_probe_lock = threading.Lock()


def _set(tid: int, idle: bool) -> None:
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    os.sched_setscheduler(tid, policy, os.sched_param(0))


def can_leave_idle() -> bool:
    """Whether a thread of this process can enter ``SCHED_IDLE`` and leave it again
    (tried once per process, on a thread started for it)."""
    with _probe_lock:
        if not _probe:
            answer: list[bool] = []

            def attempt() -> None:
                try:
                    _set(0, idle=True)
                    _set(0, idle=False)
                    answer.append(True)
                except (AttributeError, OSError) as exc:
                    logger.info("save threads run at normal priority (SCHED_IDLE: %s)", exc)
                    answer.append(False)

            probe = threading.Thread(target=attempt, name="kvpool-priority-probe")
            probe.start()
            probe.join()
            _probe.append(bool(answer and answer[0]))
        return _probe[0]


class SaveThreads:
    """See the module docstring."""

    def __init__(self, priority: Literal["idle", "normal"], starve_s: float = STARVE_S) -> None:
        self.idle = priority == "idle" and can_leave_idle()
        self.starve_s = starve_s
        self.raised = 0
        self._tids: list[int] = []
        self._queued = 0
        self._since = time.monotonic()  # of the last piece moved (or the first queued)
        self._up = False  # the threads are raised now
        self._closed = False
        self._cond = threading.Condition()
        self._watch: threading.Thread | None = None
        if self.idle:
            self._watch = threading.Thread(target=self._watchdog, name="kvpool-save-watch")
            self._watch.daemon = True
            self._watch.start()

    def enter(self) -> None:
        if not self.idle:
            return
        tid = threading.get_native_id()
        with self._cond:
            self._tids.append(tid)
            _set(tid, idle=not self._up)

    def queued(self) -> None:
        if not self.idle:  # nothing to watch: no lock on the save path
            return
        with self._cond:
            if self._queued == 0:
                self._since = time.monotonic()
            self._queued += 1
            self._cond.notify_all()

    def done(self) -> None:
        if not self.idle:  # nothing to watch: no lock on the save path
            return
        with self._cond:
            self._queued = max(0, self._queued - 1)
            self._since = time.monotonic()
            if self._queued == 0 and self._up:
                self._move(up=False)

    def moved(self) -> None:
        if not self.idle:  # nothing to watch: no lock on the save path
            return
        with self._cond:
            self._since = time.monotonic()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._watch is not None:
            self._watch.join(5)

    def _move(self, up: bool) -> None:
        """Every save thread to normal priority (``up``) or back to SCHED_IDLE;
        called with the lock held."""
        for tid in self._tids:
            try:
                _set(tid, idle=not up)
            except OSError:  # a thread that has ended
                continue
        self._up = up
        if up:
            self.raised += 1
            logger.debug("saves queued %.1f s with no piece moved: save threads raised",
                         time.monotonic() - self._since)  # fmt: skip

    def _watchdog(self) -> None:
        with self._cond:
            while not self._closed:
                if self._queued == 0 or self._up:
                    self._cond.wait()
                    continue
                left = self._since + self.starve_s - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._move(up=True)
