"""The split of layers: contiguous ranges, one per node, each within its node's
room and as close to proportional as the sizes allow (exact dynamic programming).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from studiotui.core.placement.accounting import _fixed
from studiotui.core.placement.facts import ModelFacts
from studiotui.core.placement.ring import _orientations

# Scores that differ by less than this (relative) are ties, so the tie-break rules decide
# rather than float rounding noise.
_TIE = 1e-9


def _better(candidate: float, incumbent: float) -> bool:
    return candidate < incumbent - _TIE * max(abs(candidate), abs(incumbent), 1.0)


def _targets(caps: Sequence[int], total: int) -> list[float]:
    """Each node's proportional share of the layer bytes, by its room after fixed costs."""
    room = [max(c, 0) for c in caps]
    whole = sum(room)
    if whole == 0:
        return [total / len(caps)] * len(caps)
    return [total * r / whole for r in room]


def _split(caps: Sequence[int], costs: Sequence[int]) -> tuple[float, tuple[int, ...]] | None:
    """Cut layers into one contiguous, non-empty range per node, each within its cap.

    Among the cuts that fit, picks the one closest to the proportional targets
    (chi-square: squared miss over the node's room), so a node that cannot take its
    proportional share pushes the rest to nodes with room. Returns (score, cut points)
    or None when nothing fits. Dynamic programming over (node, end layer): O(n · L²),
    exact rather than a heuristic, because a refusal must mean nothing fits.
    """
    n, total_layers = len(caps), len(costs)
    prefix = list(itertools.accumulate(costs, initial=0))
    targets = _targets(caps, prefix[-1])
    scores = [0.0] + [math.inf] * total_layers  # best score with layers [0, end) placed
    parents: list[list[int]] = []
    for i in range(n):
        scores, parent = _extend(i, n, scores, caps[i], targets[i], prefix)
        parents.append(parent)
    if scores[total_layers] == math.inf:
        return None
    return scores[total_layers], _cuts(parents, total_layers)


def _extend(
    i: int, n: int, scores: Sequence[float], cap: int, target: float, prefix: Sequence[int]
) -> tuple[list[float], list[int]]:
    """One DP step: give node i the layers [start, end) after every reachable start."""
    total_layers = len(prefix) - 1
    # Later nodes need at least one layer each; the last node must take all that is left.
    last_end = total_layers - (n - 1 - i)
    weight = max(cap, 1)
    nxt = [math.inf] * (total_layers + 1)
    # What a score must beat to replace nxt[end]: kept beside it because this loop is
    # the planner's hot spot. Starts are visited in order and near-ties keep the first,
    # so the extra layers of an uneven split go to later nodes, whatever the rounding.
    bar = [math.inf] * (total_layers + 1)
    parent = [-1] * (total_layers + 1)
    for start, base in enumerate(scores):
        if base == math.inf:
            continue
        first_end = total_layers if i == n - 1 else start + 1
        for end in range(first_end, last_end + 1):
            load = prefix[end] - prefix[start]
            if load > cap:
                break  # costs are non-negative: longer ranges only get heavier
            score = base + (load - target) ** 2 / weight
            if score < bar[end]:
                nxt[end], parent[end] = score, start
                bar[end] = score - _TIE * max(score, 1.0)
    return nxt, parent


def _cuts(parents: Sequence[Sequence[int]], end: int) -> tuple[int, ...]:
    cuts = [end]
    for parent in reversed(parents):
        cuts.append(parent[cuts[-1]])
    return tuple(reversed(cuts))


def _fit_orientation(
    order: tuple[str, ...], usable: Mapping[str, int], costs: Sequence[int], model: ModelFacts
) -> tuple[float, tuple[int, ...]] | None:
    caps = [usable[name] - _fixed(i, len(order), model) for i, name in enumerate(order)]
    return _split(caps, costs)


def _best_fit(
    ring: tuple[str, ...], usable: Mapping[str, int], costs: Sequence[int], model: ModelFacts
) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """The head/tail/direction of the ring whose split is most even; names break ties."""
    best: tuple[float, tuple[str, ...], tuple[int, ...]] | None = None
    for order in _orientations(ring):
        fit = _fit_orientation(order, usable, costs, model)
        if fit is None:
            continue
        score, cuts = fit
        if (
            best is None
            or _better(score, best[0])
            or (not _better(best[0], score) and order < best[1])
        ):
            best = (score, order, cuts)
    return None if best is None else (best[1], best[2])
