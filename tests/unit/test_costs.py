"""The load-or-recompute decision (``kvpool.connector.costs``) from measured samples:
each model's estimate, the learning phase, the verdict both ways, exploration,
the forced policies. Pure: the clock is a variable."""

from __future__ import annotations

import pytest

from kvpool.connector.costs import LoadCosts


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine(load_ms_per_token: float, load_fixed_ms: float, compute_ms_per_token: float,
           clock: Clock | None = None) -> LoadCosts:  # fmt: skip
    """Costs fed an engine's samples: decode steps of 4 tokens (5 ms each, the
    fixed cost), prefill steps of 256-1024 tokens, loads of 64-512 tokens."""
    costs = LoadCosts(small_step=32, clock=clock or Clock())
    for _ in range(5):
        costs.stepped(4, 0.005)
    for n in (256, 512, 1024):
        costs.stepped(n, 0.005 + n * compute_ms_per_token / 1e3)
    for n in (64, 128, 512):
        costs.loaded(n, (load_fixed_ms + n * load_ms_per_token) / 1e3)
    return costs


def test_the_models_recover_the_rates_they_were_fed() -> None:
    costs = engine(load_ms_per_token=0.01, load_fixed_ms=8.0, compute_ms_per_token=0.2)
    # Computing h more tokens costs the per-token rate alone: the step runs anyway.
    assert costs.compute_s(1000) == pytest.approx(0.2, rel=1e-6)
    # A load costs its fixed part too: the request waits for all of it.
    assert costs.load_s(1000) == pytest.approx(0.008 + 0.01, rel=1e-6)


def test_a_hit_loads_where_loading_is_faster_and_is_computed_where_it_is_slower() -> None:
    # A model of realistic compute per KV byte: loading wins at every length.
    heavy = engine(load_ms_per_token=0.01, load_fixed_ms=8.0, compute_ms_per_token=0.2)
    for tokens in (64, 1000, 4000):
        d = heavy.decide(tokens)
        assert d.load and d.reason == "faster", d
    # A tiny model on a slow path: computing wins.
    tiny = engine(load_ms_per_token=0.05, load_fixed_ms=20.0, compute_ms_per_token=0.02)
    d = tiny.decide(1000)
    assert not d.load and d.reason == "slower"
    assert d.load_s == pytest.approx(0.07) and d.compute_s == pytest.approx(0.02)
    assert d.describe() == "recompute (slower: load 70.0 ms, compute 20.0 ms)"
    # A fixed load cost makes short hits not worth it, long ones worth it.
    mixed = engine(load_ms_per_token=0.005, load_fixed_ms=30.0, compute_ms_per_token=0.05)
    assert not mixed.decide(256).load  # 31.3 ms against 12.8
    assert mixed.decide(2048).load  # 40.2 ms against 102.4


def test_hits_load_until_both_models_have_their_samples() -> None:
    costs = LoadCosts(min_samples=3)
    assert costs.decide(512).reason == "learning" and costs.decide(512).load
    for _ in range(10):
        costs.stepped(4, 0.005)  # decodes say nothing of a prefill's rate
    costs.stepped(512, 0.01)
    costs.stepped(512, 0.01)
    for _ in range(3):
        costs.loaded(512, 1.0)  # very slow loads
    d = costs.decide(512)
    assert d.load and d.reason == "learning" and d.compute_s is None
    costs.stepped(512, 0.01)
    assert not costs.decide(512).load  # three prefills: now it knows


def test_a_path_that_got_fast_again_is_found_by_one_load_per_explore_period() -> None:
    clock = Clock()
    costs = engine(load_ms_per_token=0.05, load_fixed_ms=20.0, compute_ms_per_token=0.02,
                   clock=clock)  # fmt: skip
    assert not costs.decide(1000).load  # the last load sample is recent
    clock.now += 31
    d = costs.decide(1000)
    assert d.load and d.reason == "exploring"
    assert not costs.decide(1000).load  # one exploration per period
    # The explored loads come back fast (the holder recovered): hits load again.
    for _ in range(64):
        costs.loaded(1000, 0.004)
    assert costs.decide(1000).load


def test_forced_policies_and_a_bad_one() -> None:
    slow = engine(load_ms_per_token=1.0, load_fixed_ms=0.0, compute_ms_per_token=0.001)
    assert not slow.decide(100).load
    forced = LoadCosts("load")
    forced.loaded(100, 10.0)
    assert forced.decide(100).load and forced.decide(100).reason == "forced"
    assert not LoadCosts("recompute").decide(100).load
    with pytest.raises(ValueError, match="measured, load, recompute"):
        LoadCosts("sometimes")


def test_loads_of_one_size_fit_through_the_origin_and_flat_ones_stay_flat() -> None:
    costs = LoadCosts()
    for _ in range(3):
        costs.loaded(100, 0.01)
    assert costs.load_s(400) == pytest.approx(0.04)  # one size: proportional
    flat = LoadCosts()
    for n in (100, 200, 400):
        flat.loaded(n, 0.01)
    assert flat.load_s(4000) == pytest.approx(0.01)  # no growth with size: flat
    for bad in ((0, 1.0), (10, 0.0), (-1, 1.0)):
        flat.loaded(*bad)  # no sample
        flat.stepped(*bad)
    assert flat.load_s(4000) == pytest.approx(0.01)
