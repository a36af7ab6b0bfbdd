"""SaveBook: which refused objects go again, and when a finished request is released."""

from __future__ import annotations

import logging

import pytest

from kvpool.connector.drain import DRAIN_LIMIT_S, SaveBook
from kvpool.store.base import Status
from kvpool.transfer.records import ChunkRef, JobResult


def refs(*keys: str) -> list[ChunkRef]:
    return [ChunkRef(k, 0, i, (i,)) for i, k in enumerate(keys)]


def result(job: str, put: dict[str, Status], known: tuple[str, ...] = (),
           refused: str = "") -> JobResult:  # fmt: skip
    return JobResult(job, "save", put, known=known, refused=refused, refused_from=0)


def test_only_objects_neither_put_nor_known_go_again_and_only_after_local_pressure() -> None:
    book = SaveBook(retries=True)
    book.submitted("j1", "r", refs("a", "b", "c", "d"))
    ok = {"a": Status.OK, "b": Status.NO_SPACE}  # b failed in the pool: back-off, not retried
    assert book.ended("j1", result("j1", ok, known=("c",), refused="staging_busy")) == "r"
    assert [x.key for x in book.take_retries()["r"]] == ["d"]
    assert book.take_retries() == {}  # taken once
    book.submitted("j2", "r", refs("e"))
    book.ended("j2", result("j2", {}, refused="backpressure"))  # not local pressure
    book.submitted("j3", "q", refs("f"))
    book.ended("j3", result("j3", {}, refused="queue_full"))
    assert book.retrying == {"q"}
    off = SaveBook(retries=False)  # KV events on, or a group that frees blocks early
    off.submitted("j", "r", refs("a"))
    assert off.ended("j", result("j", {}, refused="staging_busy")) == "r"
    assert not off.pending_retries and off.outstanding == 0
    assert book.ended("unknown", result("unknown", {})) is None


def test_freed_blocks_drop_what_waited_to_be_retried() -> None:
    book = SaveBook(retries=True)
    for job, req in (("j1", "r"), ("j2", "q")):
        book.submitted(job, req, refs(f"{req}0"))
        book.ended(job, result(job, {}, refused="staging_busy"))
    book.freed(["r", "gone"])
    assert book.retrying == {"q"}


def test_a_finishing_request_is_released_once_nothing_of_it_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    book = SaveBook(retries=True)
    book.submitted("j1", "r", refs("a", "b"))
    book.submitted("j2", "idle-rank", [])  # a job of another request
    book.finishing(["r", "s"], now=0.0)
    assert book.release(now=1.0) == {"s"}  # no job of "s" on this worker
    assert book.release(now=1.0) == set()  # "r" has a job in flight
    book.ended("j1", result("j1", {"a": Status.OK}, refused="staging_busy"))
    assert book.release(now=2.0) == set()  # "b" waits to go again
    (again,) = book.take_retries()["r"]
    book.submitted("j3", "r", [again])
    book.ended("j3", result("j3", {"b": Status.OK}))
    assert book.release(now=3.0) == {"r"}
    assert book.release(now=4.0) == set()  # reported once
    # Past the limit, or with no pool to retry on, the rest is given up.
    book.submitted("j4", "t", refs("x"))
    book.ended("j4", result("j4", {}, refused="staging_busy"))
    book.finishing(["t"], now=10.0)
    assert book.release(now=10.0 + DRAIN_LIMIT_S / 2) == set()
    with caplog.at_level(logging.WARNING, logger="kvpool.connector.drain"):
        assert book.release(now=10.0 + DRAIN_LIMIT_S) == {"t"}
    assert "gave up saving 1 object(s) of t" in caplog.text
    book.submitted("j5", "u", refs("y"))
    book.ended("j5", result("j5", {}, refused="staging_busy"))
    book.finishing(["u"], now=100.0)
    assert book.release(now=100.0, pool=False) == {"u"}
    assert book.jobs == ["j2"] and book.outstanding == 1


def test_a_refusal_reported_after_the_blocks_were_freed_never_goes_again() -> None:
    """A staged job refused part-way reports after its earlier pieces' puts; by then
    vLLM may have preempted the request and given its blocks to another: a retry
    would save that request's KV under this one's keys."""
    book = SaveBook(retries=True)
    book.submitted("j", "r", refs("a", "b"))
    book.freed(["r"])
    assert book.ended("j", result("j", {"a": Status.OK}, refused="staging_busy")) == "r"
    assert book.take_retries() == {}


def test_past_the_limit_a_job_in_flight_that_read_its_blocks_no_longer_holds_them() -> None:
    """A put that never returns must not keep a finished request's blocks for ever
    once its save read them (staged). A job that may still read them (zero copy until
    it ends, a deferred save until staged) holds them, past the limit too."""
    for reading, released in (((), {"r"}), (("j",), set())):
        book = SaveBook(retries=True)
        book.submitted("j", "r", refs("a", "b"))
        book.finishing(["r"], now=0.0)
        assert book.release(now=DRAIN_LIMIT_S / 2) == set()
        assert book.release(now=DRAIN_LIMIT_S, reading=reading) == released
        book.ended("j", result("j", {"a": Status.OK}, refused="staging_busy"))
        assert book.take_retries() == ({} if released else {"r": refs("a", "b")[1:]})
