"""``kvpool.transfer.priority``: save threads under SCHED_IDLE, raised while starving."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from tests.factories import wait_until

from kvpool.transfer import priority
from kvpool.transfer.priority import SaveThreads


def policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


@pytest.fixture
def save_thread() -> Iterator[Callable[[SaveThreads], int]]:
    """Start a thread that enters ``threads`` and sleeps until the test ends;
    returns its native id."""
    stop = threading.Event()
    started: list[threading.Thread] = []

    def start(threads: SaveThreads) -> int:
        ready = threading.Event()
        tid: list[int] = []

        def body() -> None:
            threads.enter()
            tid.append(threading.get_native_id())
            ready.set()
            stop.wait()

        thread = threading.Thread(target=body)
        thread.start()
        started.append(thread)
        assert ready.wait(10)
        return tid[0]

    yield start
    stop.set()
    for thread in started:
        thread.join(10)


def test_this_machine_can_leave_sched_idle() -> None:
    # The tests run as root (CAP_SYS_NICE): the idle mode is what they exercise.
    assert priority.can_leave_idle()


def test_idle_save_threads_are_raised_while_saves_starve_and_lowered_once_none_is_queued(
    save_thread: Callable[[SaveThreads], int],
) -> None:
    threads = SaveThreads("idle", starve_s=0.05)
    try:
        tid = save_thread(threads)
        assert policy(tid) == os.SCHED_IDLE
        threads.queued()  # and nothing finishes
        assert wait_until(lambda: policy(tid) == os.SCHED_OTHER, 10)
        assert threads.raised == 1
        threads.done()
        assert policy(tid) == os.SCHED_IDLE
        # A thread that enters while the others are raised starts raised.
        threads.queued()
        assert wait_until(lambda: policy(tid) == os.SCHED_OTHER, 10)
        late = save_thread(threads)
        assert policy(late) == os.SCHED_OTHER
        threads.done()
        assert policy(tid) == policy(late) == os.SCHED_IDLE
        assert threads.raised == 2
    finally:
        threads.close()


def test_saves_that_finish_in_time_are_never_raised(
    save_thread: Callable[[SaveThreads], int],
) -> None:
    threads = SaveThreads("idle", starve_s=30.0)
    try:
        tid = save_thread(threads)
        for _ in range(5):
            threads.queued()
            threads.done()
        assert policy(tid) == os.SCHED_IDLE and threads.raised == 0
    finally:
        threads.close()


def test_normal_priority_leaves_the_threads_alone(
    save_thread: Callable[[SaveThreads], int],
) -> None:
    threads = SaveThreads("normal")
    tid = save_thread(threads)
    assert not threads.idle and policy(tid) == os.SCHED_OTHER
    threads.close()


def test_a_process_that_could_not_leave_sched_idle_never_enters_it(
    save_thread: Callable[[SaveThreads], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(priority, "_probe", [False])
    threads = SaveThreads("idle")
    tid = save_thread(threads)
    assert not threads.idle and policy(tid) == os.SCHED_OTHER
    threads.close()


def test_saves_that_keep_moving_pieces_are_not_starving(
    save_thread: Callable[[SaveThreads], int],
) -> None:
    """A long save whose pieces move (staged, put) is slow, not starved: its threads
    stay under SCHED_IDLE however long the job takes."""
    threads = SaveThreads("idle", starve_s=0.3)
    try:
        tid = save_thread(threads)
        threads.queued()
        deadline = time.monotonic() + 1.0  # three times starve_s
        while time.monotonic() < deadline:
            threads.moved()
            time.sleep(0.02)  # the pace of the pieces, not a wait for an event
        assert policy(tid) == os.SCHED_IDLE and threads.raised == 0
        threads.done()
    finally:
        threads.close()
