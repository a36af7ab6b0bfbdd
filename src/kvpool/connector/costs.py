"""Load or recompute: a pool hit is loaded only when loading it is measured faster.

    LoadCosts(policy="measured", small_step=32, min_samples=3, explore_s=30.0,
              clock=time.monotonic)
    costs.stepped(tokens, seconds)  one forward of this engine: the tokens it
                                    computed and its time
    costs.loaded(tokens, seconds)   one load: the tokens it loaded and the time
                                    the request waited for it (submit to report)
    costs.decide(tokens) -> Decision   load a hit of ``tokens`` tokens, or compute them
    Decision(load, load_s, compute_s, reason)   the estimates behind it (None: unknown)

The two models, each over its latest ``WINDOW`` samples:

- compute: a forward of n tokens takes a + b·n. ``a`` is the median time of
  steps under ``small_step`` tokens (decodes), ``b`` the median of (t − a)/n
  over the larger ones (prefills). Recomputing h tokens of a hit costs b·h: the
  step that computes the rest of the prompt runs either way.
- load: a load of h tokens takes c + d·h, a least-squares line over loads of
  several sizes (c, d ≥ 0; through the origin while all loads had one size). The
  request waits for all of it.

Policy ``measured``: a hit loads unless c + d·h > b·h. Until there are
``min_samples`` prefill steps and loads it loads (the engine's behaviour without
the decision, and how load samples come at all). After a decision to recompute,
one hit per ``explore_s`` loads anyway, so the load model follows a path that
got faster again (a busy holder that recovered). Policies ``load`` and
``recompute`` force the answer. The lookup's own time is not weighed: it is
spent before the decision is made, whichever way it goes.

Pure: no I/O, no vLLM, the clock is given.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["POLICIES", "WINDOW", "Decision", "LoadCosts"]

POLICIES = ("measured", "load", "recompute")
WINDOW = 64  # samples kept per kind


@dataclass(frozen=True, slots=True)
class Decision:
    load: bool
    load_s: float | None  # estimated time to load the hit
    compute_s: float | None  # estimated time to compute its tokens instead
    reason: str  # "faster", "slower", "exploring", "learning", "forced"

    def describe(self) -> str:
        """One line for the log: the verdict and the figures behind it."""
        verdict = "load" if self.load else "recompute"
        if self.load_s is None or self.compute_s is None:
            return f"{verdict} ({self.reason})"
        return (
            f"{verdict} ({self.reason}: load {self.load_s * 1e3:.1f} ms, "
            f"compute {self.compute_s * 1e3:.1f} ms)"
        )


def _line(samples: deque[tuple[int, float]]) -> tuple[float, float]:
    """(c, d) of t = c + d·n over ``samples``, both >= 0."""
    ns = [n for n, _ in samples]
    ts = [t for _, t in samples]
    through_origin = sum(ts) / max(sum(ns), 1)
    if len(set(ns)) < 2:
        return 0.0, through_origin
    mean_n, mean_t = statistics.fmean(ns), statistics.fmean(ts)
    sxx = sum((n - mean_n) ** 2 for n in ns)
    d = sum((n - mean_n) * (t - mean_t) for n, t in samples) / sxx
    if d < 0:  # no growth with size seen: a flat cost
        return mean_t, 0.0
    c = mean_t - d * mean_n
    if c < 0:
        return 0.0, through_origin
    return c, d


class LoadCosts:
    """See the module docstring."""

    def __init__(
        self,
        policy: str = "measured",
        *,
        small_step: int = 32,
        min_samples: int = 3,
        explore_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"load_decision must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.small_step = small_step
        self.min_samples = min_samples
        self.explore_s = explore_s
        self._clock = clock
        self._small: deque[float] = deque(maxlen=WINDOW)  # times of small steps
        self._large: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # prefill steps
        self._loads: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._last_load = -float("inf")  # clock time of the last load sample or exploration

    def stepped(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if tokens < self.small_step:
            self._small.append(seconds)
        else:
            self._large.append((tokens, seconds))

    def loaded(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._loads.append((tokens, seconds))
        self._last_load = self._clock()

    def compute_s(self, tokens: int) -> float | None:
        """Estimated extra forward time to compute ``tokens`` more tokens."""
        if len(self._large) < self.min_samples:
            return None
        a = statistics.median(self._small) if self._small else 0.0
        b = statistics.median(max(t - a, 0.0) / n for n, t in self._large)
        return b * tokens

    def load_s(self, tokens: int) -> float | None:
        """Estimated time a request waits to load ``tokens`` tokens."""
        if len(self._loads) < self.min_samples:
            return None
        c, d = _line(self._loads)
        return c + d * tokens

    def decide(self, tokens: int) -> Decision:
        if self.policy != "measured":
            return Decision(self.policy == "load", None, None, "forced")
        load_s, compute_s = self.load_s(tokens), self.compute_s(tokens)
        if load_s is None or compute_s is None:
            return Decision(True, load_s, compute_s, "learning")
        if load_s <= compute_s:
            return Decision(True, load_s, compute_s, "faster")
        now = self._clock()
        if now - self._last_load >= self.explore_s:
            self._last_load = now
            return Decision(True, load_s, compute_s, "exploring")
        return Decision(False, load_s, compute_s, "slower")
