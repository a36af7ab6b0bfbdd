"""``Scatter``: a batch's scatter lists in columns, equal in meaning to plain lists."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.header import HEADER_SIZE
from kvpool.store.base import Status
from kvpool.store.framed import FramedStore
from kvpool.store.memory import MemoryStore
from kvpool.store.scatter import Scatter

pytestmark = pytest.mark.unit

FP = "0123456789abcdef"


def data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def cuts(a: np.ndarray, objects: int, segs: int) -> tuple[np.ndarray, np.ndarray]:
    """``objects`` objects of ``segs`` equal segments over ``a``, objects interleaved
    (segment j of object i is piece j * objects + i), as (addrs, sizes) arrays."""
    n = a.nbytes // (objects * segs)
    piece = np.arange(segs)[None, :] * objects + np.arange(objects)[:, None]
    return a.ctypes.data + piece * n, np.full((objects, segs), n)


def plain(addrs: np.ndarray, sizes: np.ndarray) -> list[list[tuple[int, int]]]:
    return [
        list(zip(a, n, strict=True)) for a, n in zip(addrs.tolist(), sizes.tolist(), strict=True)
    ]


def test_a_scatter_is_the_sequence_of_its_scatter_lists() -> None:
    a = data(4096, 0)
    addrs, sizes = cuts(a, 4, 2)
    s = Scatter.from_arrays(addrs, sizes)
    lists = plain(addrs, sizes)
    assert len(s) == 4 and list(s) == lists and s[1] == lists[1]
    assert list(s[1:3]) == lists[1:3] and isinstance(s[1:3], Scatter)
    assert list(s.take([3, 0])) == [lists[3], lists[0]]
    assert s.totals() == [1024] * 4 and s.counts() == [2] * 4
    assert Scatter.from_lists(addrs.tolist(), sizes.tolist()).addrs == s.addrs


@pytest.mark.parametrize(
    ("addrs", "sizes", "match"),
    [
        (np.ones((2, 3)), np.ones((3, 2)), "one shape"),
        (np.ones((2, 0)), np.ones((2, 0)), "segments >= 1"),
        (np.array([[0, 8]]), np.array([[8, 8]]), "addresses > 0"),
        (np.array([[8, 16]]), np.array([[8, 0]]), "sizes > 0"),
    ],
)
def test_from_arrays_refuses_what_no_store_can_move(
    addrs: np.ndarray, sizes: np.ndarray, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        Scatter.from_arrays(addrs, sizes)


@pytest.mark.parametrize(
    ("addrs", "sizes", "match"),
    [
        ([[8, 16]], [[8]], "object 0: addresses and sizes differ in count"),
        ([[8]], [[8], [8]], "1 address lists but 2 size lists"),
        ([[8], [np.int64(8)]], [[8], [8]], "object 1: .*Python ints"),
        ([[8, 16]], [[8, 0]], "object 0: a Scatter has no empty segments"),
        ([[-8]], [[8]], "object 0: .*address > 0"),
    ],
)
def test_from_lists_names_the_bad_object(addrs: list, sizes: list, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=match):
        Scatter.from_lists(addrs, sizes)


def test_stores_take_a_scatter_as_they_take_plain_lists() -> None:
    store = MemoryStore(capacity=1 << 24, require_registration=False)
    store.max_batch = 3  # sub-batches are slices of the Scatter
    a = data(8 * 3 * 512, 1)
    addrs, sizes = cuts(a, 8, 3)
    keys = [f"k{i}" for i in range(8)]
    assert store.batch_put(keys, Scatter.from_arrays(addrs, sizes)) == [Status.OK] * 8
    out = np.zeros_like(a)
    got = store.batch_get(keys, plain(*cuts(out, 8, 3)))
    assert got == [Status.OK] * 8 and np.array_equal(out, a)
    out[:] = 0
    bad_keys = [*keys[:4], "", *keys[5:]]  # one malformed key: INVALID, the rest read
    got = store.batch_get(bad_keys, Scatter.from_arrays(*cuts(out, 8, 3)))
    assert got == [Status.OK] * 4 + [Status.INVALID] + [Status.OK] * 3
    mine = plain(*cuts(out, 8, 3))
    theirs = plain(*cuts(a, 8, 3))
    for i in (0, 3, 5, 7):
        for (x, n), (y, _) in zip(mine[i], theirs[i], strict=True):
            assert np.array_equal(out[x - out.ctypes.data :][:n], a[y - a.ctypes.data :][:n])


@pytest.mark.parametrize("inline", [0, 600])
def test_framed_objects_are_the_same_whichever_form_wrote_or_reads_them(inline: int) -> None:
    inner = MemoryStore(capacity=1 << 24, require_registration=False)
    framed = FramedStore(inner, FP, checksum=True, inline_bytes=inline)
    a = data(6 * 1024, 2)

    def layout(base: int) -> tuple[np.ndarray, np.ndarray]:
        """Object i: the 1 KiB at i KiB, its two parts in reverse order; objects 0, 2, 4
        have a first segment small enough to inline."""
        first = np.array([256 if i % 2 == 0 else 768 for i in range(6)])
        at = base + 1024 * np.arange(6)
        return np.stack([at + 1024 - first, at], axis=1), np.stack([first, 1024 - first], axis=1)

    addrs, sizes = layout(a.ctypes.data)
    keys = [f"s{i}" for i in range(6)]
    assert framed.batch_put(keys, Scatter.from_arrays(addrs, sizes)) == [Status.OK] * 6
    assert framed.batch_put([k + "-plain" for k in keys], plain(addrs, sizes)) == [Status.OK] * 6
    for k in keys:  # byte-identical objects
        x, y = np.zeros(HEADER_SIZE + 1024, np.uint8), np.zeros(HEADER_SIZE + 1024, np.uint8)
        inner.batch_get([k], [[(x.ctypes.data, x.nbytes)]])
        inner.batch_get([k + "-plain"], [[(y.ctypes.data, y.nbytes)]])
        assert np.array_equal(x[HEADER_SIZE:], y[HEADER_SIZE:])
    inner.batch_remove(["s3"], force=True)
    out = np.zeros_like(a)
    got = framed.batch_get(keys, Scatter.from_arrays(*layout(out.ctypes.data)))
    assert got == [Status.OK] * 3 + [Status.MISSING] + [Status.OK] * 2
    for i in (0, 1, 2, 4, 5):
        assert np.array_equal(out[i * 1024 : (i + 1) * 1024], a[i * 1024 : (i + 1) * 1024]), i
    assert not out[3 * 1024 : 4 * 1024].any()
