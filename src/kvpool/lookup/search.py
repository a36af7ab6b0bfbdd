"""How many leading chunks of a prompt are in the pool, in a few store round trips.

    plan_rounds(n, per_chunk)           -> (rounds, fan_out): the search's shape for
                                           n chunks of per_chunk keys each
    find_prefix(n, per_chunk, probe)    -> the hit: leading chunks taken as present
    ROUND_COST_KEYS, MAX_ROUNDS         the cost model's constants

Probing every key of a long prompt costs a store call of thousands of keys
(Mooncake answers ~1.2 us per key after ~0.1 ms per call: 2.4 ms for 32k tokens
in 16-token chunks at TP1, 33 ms at TP8 with 8 KV heads). ``find_prefix``
instead searches the boundary in rounds: each round asks ``probe`` about at
most ``fan_out + 1`` chunks of the window still in doubt (its first chunk,
then every ``stride``-th, ending with its last), and the window shrinks to
the gap between the last present probe and the first absent one. The number
of rounds minimises ``rounds * (ROUND_COST_KEYS + probes_per_round *
per_chunk)``, so a short prompt is one round over every chunk (exact, as a
full probe), a 32k-token prompt two rounds of ~46 chunks, and a full hit or a
miss at chunk 0 ends after the first round.

The answer ``h`` is exact when the present chunks form a prefix (saves write a
prompt's chunks in order). Otherwise, for any presence: every probed chunk
below ``h`` is present, chunk ``h`` was probed and is absent (or ``h == n``),
and ``h`` is at least the true prefix. A hole between probes (an evicted
object, a lost holder) is then found by the load, which fails for those
blocks: vLLM recomputes them (with ``kv_load_failure_policy: recompute``) and
the scheduler keeps the chunk out of lookups for a while, so it costs a miss,
never a wrong byte. Where a failed load fails the request instead (policy
``fail``), ``exact=True`` probes every chunk in one round.

Pure: no I/O; ``probe`` is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["MAX_ROUNDS", "ROUND_COST_KEYS", "find_prefix", "plan_rounds"]

ROUND_COST_KEYS = 100  # one store round trip costs about as much as probing 100 keys
MAX_ROUNDS = 4

Probe = Callable[[Sequence[int]], Sequence[bool]]


def _root_ceil(n: int, r: int) -> int:
    """The least f >= 1 with f**r >= n (integer arithmetic, no float rounding)."""
    f: int = max(1, round(n ** (1.0 / r)))
    while f**r < n:
        f += 1
    while f > 1 and (f - 1) ** r >= n:
        f -= 1
    return f


def plan_rounds(
    n: int,
    per_chunk: int,
    round_cost_keys: int = ROUND_COST_KEYS,
    max_rounds: int = MAX_ROUNDS,
) -> tuple[int, int]:
    """(rounds, fan_out) for ``n`` chunks: ``fan_out ** rounds >= n``, and the
    cheapest such pair by the cost model (ties go to fewer rounds)."""
    if n < 0 or per_chunk < 1 or max_rounds < 1 or round_cost_keys < 0:
        raise ValueError(f"bad search shape: n={n}, per_chunk={per_chunk}")
    if n <= 1:
        return 1, max(n, 1)
    best: tuple[int, int, int] | None = None  # (cost, rounds, fan_out)
    for rounds in range(1, max_rounds + 1):
        fan = _root_ceil(n, rounds)
        probes = min(n, fan + 1)  # +1: each round also probes its window's first chunk
        cost = rounds * (round_cost_keys + probes * per_chunk)
        if best is None or cost < best[0]:
            best = (cost, rounds, fan)
    assert best is not None
    return best[1], best[2]


def _round_probes(lo: int, hi: int, fan: int) -> list[int]:
    """The chunks one round probes in the window ``[lo, hi)``: ascending, the
    first ``lo``, then every ``stride``-th, the last ``hi - 1``."""
    width = hi - lo
    stride = -(-width // fan)
    probes = {lo}
    probes.update(min(lo + k * stride - 1, hi - 1) for k in range(1, -(-width // stride) + 1))
    return sorted(probes)


def find_prefix(
    n: int,
    per_chunk: int,
    probe: Probe,
    round_cost_keys: int = ROUND_COST_KEYS,
    exact: bool = False,
) -> int:
    """The number of leading chunks of ``0..n-1`` taken as present.

    ``probe(chunks)`` answers, per chunk index (ascending), whether every key of
    that chunk is present; it is called at most ``plan_rounds(n, ...)[0]`` times
    (once with ``exact``: every chunk in one round) and never with an empty
    list. See the module docstring for what the answer promises when the
    present chunks are not a prefix; with ``exact`` it is the true prefix.
    """
    if n <= 0:
        return 0
    fan = n if exact else plan_rounds(n, per_chunk, round_cost_keys)[1]
    lo, hi = 0, n  # chunks below lo are taken as present; hi is absent (or n)
    while lo < hi:
        chunks = _round_probes(lo, hi, fan)
        present = probe(chunks)
        if len(present) != len(chunks):
            raise ValueError(f"probe answered {len(present)} chunks, asked {len(chunks)}")
        first_absent = next((j for j, ok in enumerate(present) if not ok), len(chunks))
        if first_absent == len(chunks):
            lo = hi  # the window's last chunk is present
        else:
            if first_absent:
                lo = chunks[first_absent - 1] + 1
            hi = chunks[first_absent]
    return lo
