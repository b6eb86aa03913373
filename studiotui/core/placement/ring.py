"""Ring order: links ranked by the time to move one activation, and the order of
the nodes round the ring whose slowest hop is fastest.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from studiotui.core.placement.facts import Link

# 8 nodes give 7! = 5040 rings to score, still instant; 9 would be 40320.
_EXHAUSTIVE_LIMIT = 8


# Links are compared by the time to move one prefill-chunk-sized activation, so both
# latency (dominant while decoding) and bandwidth (dominant while prefilling) count.
_PROBE_BITS = 64 * 1024 * 8


# Only for ranking links that were not measured yet: rough figures for TCP over each
# medium. "unknown" has none on purpose, so such a link ranks slowest.
_KIND_DEFAULTS: dict[str, tuple[float, float]] = {
    "loopback": (30.0, 100.0),
    "thunderbolt": (100.0, 40.0),
    "ethernet": (300.0, 10.0),
    "wifi": (3000.0, 0.5),
}


_Pair = tuple[str, str]


def _pair(a: str, b: str) -> _Pair:
    return (a, b) if a <= b else (b, a)


def _known(x: float | None, default: float | None) -> float | None:
    if x is None or math.isnan(x):
        return default
    return x


def _hop_us(link: Link | None) -> float:
    """Estimated microseconds to move one activation over the link; inf if unknown."""
    if link is None:
        return math.inf
    lat_default, gbps_default = _KIND_DEFAULTS.get(link.kind, (None, None))
    latency = _known(link.latency_us, lat_default)
    gbps = _known(link.gbps, gbps_default)
    if latency is None or gbps is None or gbps <= 0 or latency < 0:
        return math.inf
    return latency + _PROBE_BITS / (gbps * 1e3)  # 1 Gb/s moves 1e3 bits per µs


def link_figures(link: Link) -> tuple[float, float]:
    """A link's one-way latency (µs) and Gb/s: measured, else the medium's rough TCP
    figures, else (an unknown medium) a slow guess — 1 ms and 1 Gb/s."""
    lat_default, gbps_default = _KIND_DEFAULTS.get(link.kind, (1000.0, 1.0))
    latency = _known(link.latency_us, lat_default)
    gbps = _known(link.gbps, gbps_default)
    return (
        latency if latency is not None and latency >= 0 else lat_default,
        gbps if gbps is not None and gbps > 0 else gbps_default,
    )


def _link_rank(link: Link) -> tuple[float, str, str, str, float, float]:
    # Every field takes part, so which of two links for one pair wins never depends
    # on the order the caller listed them in.
    return (
        _hop_us(link),
        link.kind,
        link.a,
        link.b,
        _sortable(link.latency_us),
        _sortable(link.gbps),
    )


def _sortable(x: float | None) -> float:
    # NaN and None would make the sort order depend on the input order.
    return -1.0 if x is None or math.isnan(x) else x


def _best_links(links: Sequence[Link], names: frozenset[str]) -> dict[_Pair, Link]:
    best: dict[_Pair, Link] = {}
    for link in sorted(links, key=_link_rank):
        if link.a != link.b and link.a in names and link.b in names:
            best.setdefault(_pair(link.a, link.b), link)
    return best


def _hops(order: Sequence[str]) -> list[_Pair]:
    """The hops of the ring, including the tail's token going back to the head."""
    if len(order) < 2:
        return []
    return list(zip(order, [*order[1:], order[0]], strict=True))


def _ring_key(order: Sequence[str], links: Mapping[_Pair, Link]) -> tuple[float, int, float]:
    """Smaller is better: slowest hop, then how many hops are unknown, then total time."""
    times = [_hop_us(links.get(_pair(a, b))) for a, b in _hops(order)]
    if not times:
        return (0.0, 0, 0.0)
    finite = [t for t in times if math.isfinite(t)]
    # fsum is exact, so a ring and its reverse score the same and names break the tie.
    return (max(times), len(times) - len(finite), math.fsum(finite))


def _exhaustive_ring(names: Sequence[str], links: Mapping[_Pair, Link]) -> tuple[str, ...]:
    # Rotations of a ring are the same ring, so the first node is fixed; permutations of
    # sorted names come in lexicographic order, so a strict "<" keeps the smallest on ties.
    first, *rest = names
    best_order = tuple(names)
    best_key = _ring_key(best_order, links)
    for perm in itertools.permutations(rest):
        order = (first, *perm)
        key = _ring_key(order, links)
        if key < best_key:
            best_key, best_order = key, order
    return best_order


def _nearest(here: str, left: set[str], links: Mapping[_Pair, Link]) -> str:
    return min(left, key=lambda name: (_hop_us(links.get(_pair(here, name))), name))


def _greedy_ring(names: Sequence[str], links: Mapping[_Pair, Link]) -> tuple[str, ...]:
    order = [names[0]]
    left = set(names[1:])
    while left:
        step = _nearest(order[-1], left, links)
        order.append(step)
        left.remove(step)
    return tuple(order)


def _ring_order(names: Sequence[str], links: Mapping[_Pair, Link]) -> tuple[str, ...]:
    if len(names) <= _EXHAUSTIVE_LIMIT:
        return _exhaustive_ring(names, links)
    return _greedy_ring(names, links)


def _orientations(ring: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every rotation of the ring in both directions: same links, different head and tail."""
    out: list[tuple[str, ...]] = []
    for seq in (ring, ring[::-1]):
        for i in range(len(seq)):
            turned = seq[i:] + seq[:i]
            if turned not in out:
                out.append(turned)
    return out


def _slowest_link(order: Sequence[str], links: Mapping[_Pair, Link]) -> Link | None:
    slowest: Link | None = None
    worst = -1.0
    for a, b in _hops(order):
        link = links.get(_pair(a, b)) or Link(a, b, None, None, "unknown")
        if _hop_us(link) > worst:
            slowest, worst = link, _hop_us(link)
    return slowest
