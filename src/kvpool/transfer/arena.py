"""A ring allocator over one staging buffer, for pieces that are freed roughly FIFO.

    StagingArena(nbytes)             manage offsets ``[0, nbytes)``
    alloc(size, wait=False, timeout) offset of ``size`` free bytes, or None when
                                     they are not free now (``wait``: once they are,
                                     or None after ``timeout`` seconds); None at once
                                     if ``size`` exceeds the whole arena
    free(offset)                     give a reservation back (any order; space is
                                     reused once every older reservation is free)
    used                             bytes reserved now
    frees                            how many reservations were given back so far

Sizes round up to ``align`` bytes, so every reservation starts aligned. Thread
safe; a waiting ``alloc`` wakes on every ``free``. Knows nothing of what the
bytes hold.
"""

from __future__ import annotations

import threading
import time
from collections import deque

__all__ = ["StagingArena"]


class StagingArena:
    """See the module docstring."""

    def __init__(self, nbytes: int, align: int = 64) -> None:
        self.nbytes = nbytes
        self._align = align
        self._live: deque[list[int]] = deque()  # [start, size, freed]
        self._by_start: dict[int, list[int]] = {}
        self._lock = threading.Condition()
        self.frees = 0  # reservations given back: a change means space may be free

    def alloc(self, size: int, wait: bool = False, timeout: float | None = None) -> int | None:
        """Offset of ``size`` free bytes, or None. With ``wait``, block until they are
        free or ``timeout`` seconds passed (None at once if ``size`` exceeds the arena)."""
        size = max(self._align, -(-size // self._align) * self._align)
        if size > self.nbytes:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while (start := self._try_alloc(size)) is None and wait:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._lock.wait(left)
            return start

    def _try_alloc(self, size: int) -> int | None:
        """Place ``size`` bytes after the newest live block, wrapping to 0 if needed."""
        if not self._live:
            start: int | None = 0
        else:
            tail = self._live[0][0]
            head = self._live[-1][0] + self._live[-1][1]
            if self._live[-1][0] < tail:  # wrapped: free space is [head, tail)
                start = head if head + size <= tail else None
            elif head + size <= self.nbytes:
                start = head
            else:
                start = 0 if size <= tail else None
        if start is not None:
            entry = [start, size, 0]
            self._live.append(entry)
            self._by_start[start] = entry
        return start

    def free(self, start: int) -> None:
        with self._lock:
            self._by_start.pop(start)[2] = 1
            self.frees += 1
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._lock.notify_all()

    @property
    def used(self) -> int:
        with self._lock:
            return sum(e[1] for e in self._live if not e[2])
