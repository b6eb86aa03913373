"""What a placement is serving now: requests in flight, tokens served, tokens a second.

The one computation behind the dashboard's Placements pane (in flight, tok/s, tokens)
and `studiotui status --json`. The agents report totals per shard; a rate is derived
here from how a total changed between samples, since a rate is what an operator
compares.
"""

from __future__ import annotations

from collections import deque

from studiotui.core.state import PlacementState

RATE_WINDOW_S = 5.0


def placement_tokens(placement: PlacementState) -> int:
    """Tokens the placement has served since its shards were loaded."""
    # Only the tail counts sampled tokens, so the busiest shard's count is the total.
    return max((s.tokens for s in placement.shards), default=0)


def placement_acceptance(placement: PlacementState) -> float | None:
    """The share of speculative decoding's guesses the placement kept (None: none made).
    Only the head guesses, so the sums are its counts."""
    drafted = sum(s.drafted for s in placement.shards)
    return sum(s.kept for s in placement.shards) / drafted if drafted else None


def placement_in_flight(placement: PlacementState) -> int:
    """Requests the placement is working on now."""
    # Every shard of the ring sees each request; the head's count is the placement's,
    # and a shard that lags (telemetry a second late) must not make it look idle.
    return max((s.in_flight for s in placement.shards), default=0)


class RateMeter:
    """Tokens per second from totals sampled at irregular times.

    The rate is taken over the last `window` seconds of samples, so one late
    telemetry message does not make it jump, and it falls to 0 once the count has
    stood still for a window.
    """

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def update(self, key: str, total: int, now: float) -> float:
        samples = self._samples.setdefault(key, deque())
        if samples and total < samples[-1][1]:
            samples.clear()  # the shard restarted and counts from zero again
        samples.append((now, total))
        # Keep one sample at least a window old as the baseline.
        while len(samples) > 2 and now - samples[1][0] >= self.window:
            samples.popleft()
        first_t, first_n = samples[0]
        return (total - first_n) / (now - first_t) if now > first_t else 0.0

    def forget(self, keep: set[str]) -> None:
        for key in [k for k in self._samples if k not in keep]:
            del self._samples[key]
