"""The pure placement planner: which node runs which contiguous range of a model's layers.

No I/O here. The controller gathers the facts (model sizes, free memory, measured
links) and this module turns them into a `Plan` or a `Refusal` a human can read, so
the preview the operator sees is exactly what will be deployed and every rule can be
tested without a cluster.

Sizes are shown in binary units labelled "GB"/"MB", as macOS reports unified memory
(a "512 GB" Mac Studio has 512 GiB).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from studiotui.core.kv_sizes import (
    DTYPE_BYTES,
    LayerKV,
    activation_bytes,
    layer_caches,
    standard_per_token,
    text_config,
)
from studiotui.core.state import shape_label

_GB = 1024**3
_MB = 1024**2
_KB = 1024

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

# Scores that differ by less than this (relative) are ties, so the tie-break rules decide
# rather than float rounding noise.
_TIE = 1e-9


@dataclass(frozen=True)
class TensorFacts:
    """What mlx-lm's `shard()` splits when a stage runs as a tensor group of N nodes.

    `dims` are the sizes N must divide (attention heads, KV heads, MLP and expert widths
    in quantization groups: `mx.split` refuses an uneven cut, and a head cannot be
    halved); `layer_split` is each layer's bytes that `shard()` cuts N ways (attention
    and MLP projections, every expert); the rest of a layer (norms, the router,
    DeepSeek's `q_a_proj`/`kv_a_proj`) and the embedding and head stay whole on every
    node. `kv_split`: the cache is per head and so split too; an MLA latent is not."""

    dims: tuple[tuple[str, int], ...]
    layer_split: tuple[int, ...]
    kv_split: bool = True

    def refusal(self, n: int) -> str | None:
        """Why `shard()` cannot cut this model `n` ways, or None."""
        bad = [f"{label} {size}" for label, size in self.dims if size % n]
        if not bad:
            return None
        return f"a tensor group of {n} must divide its {_joined(bad, 'and')}"


@dataclass(frozen=True)
class ModelFacts:
    name: str
    family: str
    n_layers: int
    layer_bytes: tuple[int, ...]  # weight bytes of each layer
    embed_bytes: int  # held by the first shard
    head_bytes: int  # final norm + lm_head (tied embeddings: the caller counts them here too)
    kv_bytes_per_token: int  # per layer, K+V, for one token (when layer_kv is empty)
    dtype: str = "float32"
    quantization: str | None = None
    # Each layer's cache as the family keeps it (MLA latent, sliding window, linear
    # state); empty: every layer keeps kv_bytes_per_token for every token.
    layer_kv: tuple[LayerKV, ...] = ()
    # None: the family has no `shard()` in mlx-lm, so only pipelines of one-node stages.
    tensor: TensorFacts | None = None
    # For the speed forecast (studiotui/core/forecast.py): the routed experts' bytes of
    # each layer (a token reads `experts_active` of them), the residual width an
    # all-reduce carries, the attention width a prefill multiplies by the context, and
    # the bits each weight takes (scales included) to turn bytes into FLOPs.
    layer_experts: tuple[int, ...] = ()
    experts_active: float = 1.0
    hidden_size: int = 0
    attn_width: int = 0
    bits_per_weight: float = 0.0
    # An adapter placed with the model (see `with_adapter`): its bytes on each layer,
    # held beside that layer's weights by the shard running it; () without one.
    layer_adapter: tuple[int, ...] = ()
    # The positions the model was trained for (config.json's max_position_embeddings,
    # stretched by a RoPE scaling factor); 0: not said.
    max_positions: int = 0

    def __post_init__(self) -> None:
        # Bad facts are a bug in the caller, not something to explain to the operator.
        if self.n_layers < 1:
            raise ValueError(f"{self.name}: a model needs at least one layer")
        if len(self.layer_bytes) != self.n_layers:
            raise ValueError(
                f"{self.name}: {len(self.layer_bytes)} layer sizes for {self.n_layers} layers"
            )
        if self.layer_kv and len(self.layer_kv) != self.n_layers:
            raise ValueError(
                f"{self.name}: {len(self.layer_kv)} layer caches for {self.n_layers} layers"
            )
        for name, per_layer in (
            ("split", self.tensor.layer_split if self.tensor else ()),
            ("expert", self.layer_experts),
            ("adapter", self.layer_adapter),
        ):
            if per_layer and len(per_layer) != self.n_layers:
                raise ValueError(f"{self.name}: {len(per_layer)} {name} sizes for {self.n_layers}")
        sizes = (
            *self.layer_bytes,
            *self.layer_adapter,
            self.embed_bytes,
            self.head_bytes,
            self.kv_bytes_per_token,
        )
        if min(sizes) < 0:
            raise ValueError(f"{self.name}: sizes cannot be negative")

    def kv_bytes(self, tokens: int, streams: int = 1) -> list[int]:
        """Each layer's cache bytes once `streams` requests hold `tokens` tokens each."""
        if not self.layer_kv:
            return [self.kv_bytes_per_token * tokens * streams] * self.n_layers
        return [kv.bytes_for(tokens) * streams for kv in self.layer_kv]

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes

    @property
    def adapter_bytes(self) -> int:
        return sum(self.layer_adapter)


def with_adapter(model: ModelFacts, adapter_layer_bytes: Sequence[int]) -> ModelFacts:
    """The model as placed with an adapter: `adapter_layer_bytes[i]` more on layer i (its
    LoRA/DoRA tensors, counted from the adapter's safetensors header by the caller)."""
    return replace(model, layer_adapter=tuple(int(b) for b in adapter_layer_bytes))


@dataclass(frozen=True)
class NodeBudget:
    name: str
    free_bytes: int
    total_bytes: int

    def __post_init__(self) -> None:
        if self.free_bytes < 0 or self.total_bytes < 0:
            raise ValueError(f"{self.name}: memory cannot be negative")


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    latency_us: float | None
    gbps: float | None
    kind: str  # "thunderbolt", "ethernet", "wifi", "loopback", "unknown"
    # Both ends report RDMA over Thunderbolt usable (the agents' `facts["rdma"]`):
    # MLX's JACCL backend can run a tensor group over it.
    rdma: bool = False
    # Why not, when both nodes have RDMA but no active cable joins them
    # ("studio-2 has no cable to studio-4"; core/members.rdma_pair); "" otherwise.
    rdma_why: str = ""


@dataclass(frozen=True)
class ShardPlan:
    node: str
    start: int  # layers [start, end)
    end: int
    weight_bytes: int
    kv_bytes: int
    free_before: int
    free_after: int
    # A stage run by a tensor-parallel group: every node in it (rank order, `node` first)
    # holds a 1/N slice of layers [start, end) and they talk over `mx.distributed` with
    # `backend` ("ring" or "jaccl"), chosen for `backend_reason`. () for a one-node stage;
    # the byte figures above are then per node of the group.
    group: tuple[str, ...] = ()
    backend: str | None = None
    backend_reason: str = ""
    # Free memory of each node of the group before loading (rank order), so every
    # member's "after" can be shown; () for a one-node stage (`free_before` says it).
    group_free: tuple[int, ...] = ()
    # An adapter's share of these layers, held beside `weight_bytes` (counted in
    # free_after); 0 without an adapter.
    adapter_bytes: int = 0
    # The prompt cache's budget on this shard (per node of a group), in memory (counted
    # in free_after) and on the node's disk.
    prompt_cache_bytes: int = 0
    prompt_cache_disk_bytes: int = 0
    # A speculative decoding draft model, loaded whole beside the head's layers (counted
    # in free_after; studiotui/cluster/draft.py); 0 elsewhere and without one.
    draft_bytes: int = 0

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node of the stage: the group, or the one node."""
        return self.group or (self.node,)


@dataclass(frozen=True)
class Plan:
    model: str
    shards: tuple[ShardPlan, ...]  # in ring order: the first holds the embedding
    context_tokens: int
    slowest_link: Link | None  # None only for a single node
    total_bytes: int
    # Requests served at once, each with the whole context: the KV cache is reserved for
    # all of them, and the head shard queues or refuses ("busy") any beyond.
    streams: int = 1
    # Quantized KV (`--kv-bits`; 0: full precision), in groups of kv_group_size values.
    kv_bits: int = 0
    kv_group_size: int = 64
    # Lines the preview says under the table (what stays at full precision, why
    # requests decode one by one).
    notes: tuple[str, ...] = ()

    @property
    def tensor(self) -> int:
        """Nodes per stage (every stage of a plan has the same)."""
        return len(self.shards[0].nodes) if self.shards else 1

    @property
    def shape(self) -> str:
        """ "4 stages", "2 stages × 2 (ring)", "1 stage × 4 (jaccl)", "1 node"."""
        backends = {s.backend for s in self.shards if s.backend}
        return shape_label(len(self.shards), self.tensor, "/".join(sorted(backends)) or None)


@dataclass(frozen=True)
class Refusal:
    reason: str
    # What kind of refusal (REFUSAL_KINDS): what the CLI's exit status says.
    kind: str = "memory"


# Every kind of refusal: the model and its KV cache do not fit the memory; the group
# cannot take that shape (layers, tensor size, adapter); the model cannot run on a
# shard; a node of the group is unknown or not up.
REFUSAL_KINDS = ("memory", "shape", "model", "node")


# --------------------------------------------------------------------------- sizes


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def format_bytes(n: int) -> str:
    """A size for people: "1.5 GB", "512 MB", "3 KB", "12 B"."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= _GB:
        return f"{sign}{n / _GB:.1f} GB"
    if n >= _MB:
        return f"{sign}{n / _MB:.0f} MB"
    if n >= _KB:
        return f"{sign}{n / _KB:.0f} KB"
    return f"{sign}{n} B"


def _gb(n: int) -> str:
    """Refusals always speak GB so the numbers in one sentence compare at a glance;
    below 1 GB with two significant digits, so small nodes' figures still differ."""
    x = n / _GB
    if x == 0 or abs(x) >= 1:
        return f"{x:.1f} GB"
    decimals = 1 - math.floor(math.log10(abs(x)))
    return f"{x:.{decimals}f}".rstrip("0").rstrip(".") + " GB"


def reserve_bytes(node: NodeBudget, reserve_fraction: float) -> int:
    """Memory kept free on a node for the OS and the runner itself."""
    return math.ceil(node.total_bytes * reserve_fraction)


def _usable(node: NodeBudget, reserve_fraction: float) -> int:
    return node.free_bytes - reserve_bytes(node, reserve_fraction)


def _fixed(index: int, count: int, model: ModelFacts) -> int:
    """Bytes a shard holds besides its layers, by its place in the ring."""
    first = model.embed_bytes if index == 0 else 0
    last = model.head_bytes if index == count - 1 else 0
    return first + last


# --------------------------------------------------------------------------- links

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


# --------------------------------------------------------------------------- split


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


# --------------------------------------------------------------------------- refusals


def _group_refusal(model: ModelFacts, nodes: Sequence[NodeBudget]) -> Refusal | None:
    if not nodes:
        return Refusal("the group is empty; pick at least one node", "shape")
    names = [n.name for n in nodes]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return Refusal(
            f"the group names {', '.join(repeated)} more than once; "
            "a node can hold only one shard of a model",
            "shape",
        )
    if len(nodes) > model.n_layers:
        return Refusal(
            f"{model.name} has {model.n_layers} layers but the group has {len(nodes)} nodes "
            f"and each node needs at least one layer; use at most {model.n_layers} nodes",
            "shape",
        )
    return None


def _bits(model: ModelFacts) -> int | None:
    if model.quantization:
        found = re.search(r"\d+", model.quantization)
        return int(found.group()) if found else None
    size = DTYPE_BYTES.get(model.dtype)
    return None if size is None else size * 8


def _joined(parts: Sequence[str], word: str) -> str:
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + f" {word} " + parts[-1]


def remedies(
    model: ModelFacts, weights: int, kv: int, available: int, context_fit: int | None
) -> list[str]:
    """What would let `weights` + `kv` bytes fit in `available`, each only if it helps:
    a node with the shortfall free always does; a 4-bit copy only when the model is
    wider than 4 bits and its weights at 4 bits beside the same KV cache would fit (a
    tiny model whose KV cache is what does not fit gains nothing from it); a shorter
    context when one fits (`context_fit`)."""
    parts = [f"add a node with at least {_gb(weights + kv - available)} free"]
    bits = _bits(model)
    if (bits is None or bits > 4) and weights * 4 // (bits or 16) + kv <= available:
        parts.append("use a 4-bit copy")
    if context_fit:
        parts.append(f"shorten the context to {context_fit} tokens")
    return parts


def _context_that_fits(
    model: ModelFacts, available: int, weights: int, context_tokens: int, streams: int
) -> int | None:
    """The longest context below `context_tokens` whose caches fit beside the weights.

    Caches grow with the context but not linearly (windows stop, linear states do not
    grow at all), so this searches the real per-layer function rather than dividing."""

    def fits(tokens: int) -> bool:
        return weights + sum(model.kv_bytes(tokens, streams)) <= available

    if available <= weights or not fits(1):
        return None
    low, high = 1, context_tokens  # fits(low); not fits(high), or this is no refusal for KV
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low if low < context_tokens and sum(model.kv_bytes(low, streams)) > 0 else None


def _total_refusal(
    model: ModelFacts,
    usable: Sequence[int],
    kv_total: int,
    context_tokens: int,
    streams: int,
    reserve_fraction: float,
) -> Refusal | None:
    weights = model.weight_bytes
    need = weights + kv_total
    available = sum(max(u, 0) for u in usable)
    if need <= available:
        return None
    fit = _context_that_fits(model, available, weights, context_tokens, streams)
    return Refusal(
        f"{model.name} needs {_gb(need)} ({_gb(weights)} weights + {_gb(kv_total)} KV cache "
        f"for {context_tokens} tokens × {streams} stream{'s' if streams > 1 else ''}), "
        f"the group has {_gb(available)} free after a {reserve_fraction:.0%} reserve per node; "
        f"{_joined(remedies(model, weights, kv_total, available, fit), 'or')}"
    )


def _small_node_refusal(usable: Mapping[str, int], costs: Sequence[int]) -> Refusal | None:
    # Any shard holds at least one layer and its KV cache, wherever it sits in the ring.
    smallest = min(costs)
    tiny = sorted(name for name, room in usable.items() if room < smallest)
    if not tiny:
        return None
    rooms = ", ".join(f"{name} {_gb(max(usable[name], 0))}" for name in tiny)
    return Refusal(
        f"one layer with its KV cache needs at least {_gb(smallest)} but "
        f"{_joined(tiny, 'and')} {'has' if len(tiny) == 1 else 'have'} less free "
        f"after the reserve ({rooms}); "
        f"drop {'it' if len(tiny) == 1 else 'them'} from the group or free memory there"
    )


def _cut_refusal(model: ModelFacts, usable: Sequence[int], costs: Sequence[int]) -> Refusal:
    need = sum(costs) + model.embed_bytes + model.head_bytes
    bits = _bits(model)
    # A 4-bit copy helps where weights, not the KV cache, make the layers too large.
    smaller = (bits is None or bits > 4) and model.weight_bytes * 2 > need
    return Refusal(
        f"{model.name} needs {_gb(need)} and the group has {_gb(sum(max(u, 0) for u in usable))} "
        f"free, but its {model.n_layers} layers (the largest {_gb(max(costs))} with KV cache) "
        "cannot be cut into contiguous ranges that fit every node; add a node"
        + (
            ", free memory on the smallest node or use a 4-bit copy"
            if smaller
            else " or free memory on the smallest node"
        )
    )


# --------------------------------------------------------------------------- plan


def _check_args(context_tokens: int, streams: int, reserve_fraction: float) -> None:
    if context_tokens < 1 or streams < 1:
        raise ValueError("context_tokens and streams must be at least 1")
    if not 0.0 <= reserve_fraction < 1.0:
        raise ValueError("reserve_fraction must be in [0, 1)")


def _shard(
    node: NodeBudget, index: int, cuts: Sequence[int], model: ModelFacts, kv_layers: Sequence[int]
) -> ShardPlan:
    start, end = cuts[index], cuts[index + 1]
    weights = sum(model.layer_bytes[start:end]) + _fixed(index, len(cuts) - 1, model)
    kv = sum(kv_layers[start:end])
    adapter = sum(model.layer_adapter[start:end])
    after = node.free_bytes - weights - adapter - kv
    return ShardPlan(
        node.name, start, end, weights, kv, node.free_bytes, after, adapter_bytes=adapter
    )


def _adapter_refusal(
    model: ModelFacts,
    nodes: Sequence[NodeBudget],
    links: Sequence[Link],
    usable: Mapping[str, int],
    context_tokens: int,
    streams: int,
    reserve_fraction: float,
) -> Refusal | None:
    """Why the model fits these nodes but not with its adapter (None: no adapter, or it
    does not fit without one either): the plan without the adapter, and the node(s) of
    it whose layers' adapter share does not fit there, by how much."""
    if not model.layer_adapter:
        return None
    without = plan(
        replace(model, layer_adapter=()),
        nodes,
        links,
        context_tokens=context_tokens,
        streams=streams,
        reserve_fraction=reserve_fraction,
    )
    if not isinstance(without, Plan):
        return None
    short = []
    for s in without.shards:
        share = sum(model.layer_adapter[s.start : s.end])
        room = usable[s.node] - s.weight_bytes - s.kv_bytes
        if share > room:
            span = f"{s.start}–{s.end - 1}" if s.end - s.start > 1 else f"{s.start}"
            short.append((s.node, span, share, share - room))
    if not short:
        return None
    parts = [
        f"{node} would hold layers {span} and {_gb(share)} of adapter tensors, "
        f"{_gb(lack)} more than it has free"
        for node, span, share, lack in short
    ]
    return Refusal(
        f"{model.name} fits these nodes without its adapter but not with it "
        f"({_gb(model.adapter_bytes)} of adapter tensors, each held by the shard of its "
        f"layer): "
        f"{_joined(parts, 'and')} after the reserve; free that much there, add a node, "
        "or shorten the context"
    )


def plan(
    model: ModelFacts,
    nodes: Sequence[NodeBudget],
    links: Sequence[Link] = (),
    *,
    context_tokens: int = 4096,
    streams: int = 1,
    reserve_fraction: float = 0.05,
    tensor: int = 1,
) -> Plan | Refusal:
    """Place `model` on `nodes` as a ring of contiguous layer ranges, or say why not.

    `tensor` > 1 makes every stage a tensor group of that many nodes (see
    `_plan_tensor`); 1, the default, is a pipeline of one-node stages.

    The ring follows the fastest links; layers go in proportion to each node's usable
    memory (free minus `reserve_fraction` of its total) after the head pays the
    embedding, the tail the head, and every node the KV cache of its layers for
    `context_tokens` × `streams`. Which node heads the ring (and so pays the embedding)
    and which way round it runs is chosen for the most even split, since that changes
    no link. The same input always gives the same plan, whatever order the nodes and
    links are listed in.
    """
    _check_args(context_tokens, streams, reserve_fraction)
    refusal = _group_refusal(model, nodes)
    if refusal:
        return refusal
    if tensor != 1:
        why = tensor_refusal(model, tensor, len(nodes))
        if why:
            return Refusal(why, "shape")
        if model.layer_adapter:
            # mlx-lm's LoRA layers wrap whole projections; a tensor rank holds slices.
            return Refusal(
                f"an adapter is applied by pipeline stages, not by tensor groups of {tensor}",
                "shape",
            )
        return _plan_tensor(model, nodes, links, tensor, context_tokens, streams, reserve_fraction)
    by_name = {node.name: node for node in nodes}
    usable = {name: _usable(node, reserve_fraction) for name, node in by_name.items()}
    # Each layer costs its own weights (experts included) plus its own cache, so the
    # split follows bytes: DeepSeek's 3 dense layers weigh a fraction of its MoE ones.
    kv_layers = model.kv_bytes(context_tokens, streams)
    costs = [size + kv for size, kv in zip(model.layer_bytes, kv_layers, strict=True)]
    if model.layer_adapter:
        # An adapter's tensors sit beside their layer's weights, on that layer's shard.
        costs = [c + a for c, a in zip(costs, model.layer_adapter, strict=True)]
    refusal = _total_refusal(
        model,
        list(usable.values()),
        sum(kv_layers),
        context_tokens,
        streams,
        reserve_fraction,
    ) or _small_node_refusal(usable, costs)
    if refusal:
        return (
            _adapter_refusal(model, nodes, links, usable, context_tokens, streams, reserve_fraction)
            or refusal
        )
    best_links = _best_links(links, frozenset(by_name))
    found = _best_fit(_ring_order(sorted(by_name), best_links), usable, costs, model)
    if found is None:
        return _adapter_refusal(
            model, nodes, links, usable, context_tokens, streams, reserve_fraction
        ) or _cut_refusal(model, list(usable.values()), costs)
    order, cuts = found
    shards = tuple(_shard(by_name[name], i, cuts, model, kv_layers) for i, name in enumerate(order))
    return Plan(
        model=model.name,
        shards=shards,
        context_tokens=context_tokens,
        slowest_link=_slowest_link(order, best_links),
        total_bytes=sum(s.weight_bytes + s.adapter_bytes + s.kv_bytes for s in shards),
        streams=streams,
    )


def longest_context(
    model: ModelFacts,
    nodes: Sequence[NodeBudget],
    links: Sequence[Link] = (),
    *,
    streams: int = 1,
    tensor: int = 1,
    reserve_fraction: float = 0.05,
    most: int = 1 << 24,
) -> int:
    """The longest context (at most `most`) `plan` places on these nodes for `streams`
    requests at once; 0 when not even one token fits. Caches grow with the context but
    not linearly (windows, linear states), so it searches the plan itself."""

    def fits(tokens: int) -> bool:
        verdict = plan(
            model,
            nodes,
            links,
            context_tokens=tokens,
            streams=streams,
            tensor=tensor,
            reserve_fraction=reserve_fraction,
        )
        return isinstance(verdict, Plan)

    if not fits(1):
        return 0
    if fits(most):
        return most
    low, high = 1, most
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


# --------------------------------------------------------------------------- prompt cache

# The default prompt-cache budget of a shard: at most this share of what the plan leaves
# free on its node (the rest stays for other placements and jobs), and at most this many
# whole contexts' KV of one stream (that many conversations' entries kept).
CACHE_SHARE_OF_FREE = 0.5
CACHE_KV_MULTIPLE = 4
CACHE_DISK_MULTIPLE = 4  # default disk budget: this many times the memory one


def with_prompt_cache(p: Plan, memory: int | None, disk: int | None) -> Plan | Refusal:
    """`p` with a prompt-cache budget on every shard, counted in its node's memory.

    `memory` is the whole placement's, split between the nodes as the KV is (an entry
    holds each layer's cache, on that layer's shard); None: each shard gets what its
    node can spare, at most CACHE_SHARE_OF_FREE of what the plan leaves free there and
    CACHE_KV_MULTIPLE whole contexts of one stream's KV. `disk` likewise (None:
    CACHE_DISK_MULTIPLE times memory). A `memory` some node cannot hold is refused with
    the most that fits."""
    nodes_kv = sum(s.kv_bytes * len(s.nodes) for s in p.shards)
    count = sum(len(s.nodes) for s in p.shards)

    def share(total: int, s: ShardPlan) -> int:
        return total * s.kv_bytes // nodes_kv if nodes_kv else total // count

    if memory is None:
        mem = [
            max(
                0,
                min(
                    int(s.free_after * CACHE_SHARE_OF_FREE),
                    CACHE_KV_MULTIPLE * s.kv_bytes // p.streams,
                ),
            )
            for s in p.shards
        ]
    else:
        mem = [share(memory, s) for s in p.shards]
        short = [(s, m) for s, m in zip(p.shards, mem, strict=True) if m > s.free_after]
        if short:
            most = min(
                max(s.free_after, 0) * nodes_kv // s.kv_bytes if nodes_kv and s.kv_bytes else 0
                for s in p.shards
            )
            where = ", ".join(
                f"{'+'.join(s.nodes)} would hold {_gb(m)} of it with {_gb(max(s.free_after, 0))} "
                "free after weights and KV"
                for s, m in short
            )
            return Refusal(
                f"a prompt cache of {_gb(memory)} does not fit: {where}; "
                f"--prompt-cache {math.floor(most / _GB * 10) / 10:.1f} or less fits these nodes"
            )
    if disk is None:
        on_disk = [CACHE_DISK_MULTIPLE * m for m in mem]
    else:
        on_disk = [share(disk, s) for s in p.shards]
    shards = tuple(
        replace(
            s,
            prompt_cache_bytes=m,
            prompt_cache_disk_bytes=d,
            free_after=s.free_after - m,
        )
        for s, m, d in zip(p.shards, mem, on_disk, strict=True)
    )
    added = sum(m * len(s.nodes) for s, m in zip(p.shards, mem, strict=True))
    return replace(p, shards=shards, total_bytes=p.total_bytes + added)


# --------------------------------------------------------------------------- tensor groups


def tensor_refusal(model: ModelFacts, n: int, node_count: int) -> str | None:
    """Why `node_count` nodes cannot run `model` as stages of `n`-node tensor groups."""
    if n < 1:
        return f"a tensor group needs at least 1 node, not {n}"
    if n == 1:
        return None
    if model.tensor is None:
        why = (
            f"{model.name} ({model.family}) has no tensor-parallel shard() in mlx-lm, "
            "so it runs only as a pipeline (tensor 1)"
        )
    elif node_count % n:
        why = f"a tensor group of {n} does not split {_count(node_count, 'node')} into equal stages"
    elif node_count // n > model.n_layers:
        why = f"{node_count // n} stages need at least {node_count // n} layers"
    else:
        cut = model.tensor.refusal(n)
        why = f"{model.name} cannot be cut {n} ways: {cut}" if cut else ""
    if not why:
        return None
    fits = [str(k) for k in tensor_sizes(model, node_count)]
    return f"{why}; tensor sizes that divide here: {', '.join(fits)}"


def tensor_sizes(model: ModelFacts, node_count: int) -> tuple[int, ...]:
    """Tensor-group sizes `shard()` can cut this model into on `node_count` nodes (the
    stages equal), 1 — a pipeline of one-node stages — first."""
    if model.tensor is None:
        return (1,)
    return tuple(
        n
        for n in range(1, node_count + 1)
        if node_count % n == 0
        and node_count // n <= model.n_layers
        and model.tensor.refusal(n) is None
    )


def _partitions(names: Sequence[str], n: int) -> list[tuple[tuple[str, ...], ...]]:
    """Every way to cut the sorted names into groups of n (each group sorted; the group
    holding the first name first), without repeating one in another order."""
    if not names:
        return [()]
    first, rest = names[0], names[1:]
    out = []
    for mates in itertools.combinations(rest, n - 1):
        left = [x for x in rest if x not in mates]
        out += [((first, *mates), *more) for more in _partitions(left, n)]
    return out


def _all_rdma(group: Sequence[str], links: Mapping[_Pair, Link]) -> bool:
    return all(
        (link := links.get(_pair(a, b))) is not None and link.rdma
        for a, b in itertools.combinations(group, 2)
    )


def _group_key(
    groups: Sequence[Sequence[str]], links: Mapping[_Pair, Link]
) -> tuple[int, float, float]:
    """Smaller is better: groups without RDMA everywhere, then the slowest link inside a
    group (every all-reduce waits for it), then the total."""
    pairs = [p for g in groups for p in itertools.combinations(g, 2)]
    times = [_hop_us(links.get(_pair(a, b))) for a, b in pairs]
    finite = [t for t in times if math.isfinite(t)]
    no_rdma = sum(not _all_rdma(g, links) for g in groups)
    return (no_rdma, max(times, default=0.0), math.fsum(finite))


def backend_for(
    group: Sequence[str], links: Sequence[Link] | Mapping[_Pair, Link]
) -> tuple[str, str]:
    """The `mx.distributed` backend a tensor group runs and why: JACCL when every pair
    of its nodes has RDMA over Thunderbolt enabled at both ends, else the ring backend
    over TCP on the Thunderbolt bridge addresses."""
    best = links if isinstance(links, Mapping) else _best_links(links, frozenset(group))
    missing, named = [], []
    for a, b in itertools.combinations(group, 2):
        link = best.get(_pair(a, b))
        if link is not None and link.rdma:
            continue
        if link is not None and link.rdma_why:
            named.append(link.rdma_why)
        else:
            missing.append(f"{a} ↔ {b}")
    if not missing and not named:
        return "jaccl", f"every pair of {', '.join(group)} has RDMA enabled: JACCL over RDMA"
    words = list(dict.fromkeys(named))
    if missing:
        verb = "has" if len(missing) == 1 else "have"
        words.append(f"{_joined(missing, 'and')} {verb} no RDMA at both ends")
    return "ring", f"{'; '.join(words)}: ring backend over TCP on the bridge addresses"


def _plan_tensor(
    model: ModelFacts,
    nodes: Sequence[NodeBudget],
    links: Sequence[Link],
    n: int,
    context_tokens: int,
    streams: int,
    reserve_fraction: float,
) -> Plan | Refusal:
    """Stages of `n`-node tensor groups: every node of a group holds 1/n of what
    `shard()` splits in the stage's layers (and of their cache, unless it is an MLA
    latent), and the rest whole; the first group's nodes each hold the embedding, the
    last group's the head. Groups are the partition whose links are best (RDMA
    everywhere first), then the stages are cut and ordered as a pipeline's nodes are,
    each group counted as its smallest node."""
    assert model.tensor is not None  # tensor_refusal said so
    by_name = {node.name: node for node in nodes}
    usable = {name: _usable(node, reserve_fraction) for name, node in by_name.items()}
    kv_layers = model.kv_bytes(context_tokens, streams)
    split = model.tensor.layer_split
    node_layer = [b - s + math.ceil(s / n) for b, s in zip(model.layer_bytes, split, strict=True)]
    node_kv = [math.ceil(kv / n) if model.tensor.kv_split else kv for kv in kv_layers]
    costs = [w + kv for w, kv in zip(node_layer, node_kv, strict=True)]
    stages = len(nodes) // n
    label = shape_label(stages, n)
    need = n * (sum(costs) + model.embed_bytes + model.head_bytes)
    # Held whole on each node of a group: what shard() does not cut, and an MLA cache.
    whole = sum(b - s for b, s in zip(model.layer_bytes, split, strict=True))
    whole += model.embed_bytes + model.head_bytes
    whole += 0 if model.tensor.kv_split else sum(kv_layers)
    available = sum(max(u, 0) for u in usable.values())
    if need > available:
        return Refusal(
            f"{model.name} as {label} needs {_gb(need)} ({_gb((n - 1) * whole)} more than a "
            f"pipeline: what shard() leaves whole — norms, routers, embedding, head, an MLA "
            f"cache — is held by each of the {n} nodes of a group), the group has "
            f"{_gb(available)} free after a {reserve_fraction:.0%} "
            f"reserve per node; use fewer nodes per tensor group or add a node"
        )
    refusal = _small_node_refusal(usable, costs)
    if refusal:
        return refusal
    best = _best_links(links, frozenset(by_name))
    partitions = sorted(_partitions(sorted(by_name), n), key=lambda g: (_group_key(g, best), g))
    for groups in partitions:
        leaders = {g[0]: g for g in groups}
        room = {lead: min(usable[m] for m in g) for lead, g in leaders.items()}
        found = _best_fit(_ring_order(sorted(leaders), best), room, costs, model)
        if found is None:
            continue
        order, cuts = found
        shards = []
        for i, lead in enumerate(order):
            group = leaders[lead]
            start, end = cuts[i], cuts[i + 1]
            weights = sum(node_layer[start:end]) + _fixed(i, len(order), model)
            kv = sum(node_kv[start:end])
            backend, why = backend_for(group, best)
            free = by_name[lead].free_bytes
            shards.append(
                ShardPlan(
                    lead,
                    start,
                    end,
                    weights,
                    kv,
                    free,
                    free - weights - kv,
                    group=group,
                    backend=backend,
                    backend_reason=why,
                    group_free=tuple(by_name[m].free_bytes for m in group),
                )
            )
        return Plan(
            model=model.name,
            shards=tuple(shards),
            context_tokens=context_tokens,
            slowest_link=_slowest_link(order, best),
            total_bytes=sum((s.weight_bytes + s.kv_bytes) * n for s in shards),
            streams=streams,
        )
    return _cut_refusal(model, list(usable.values()), costs)


# --------------------------------------------------------------------------- output


def plan_to_dict(p: Plan | Refusal) -> dict[str, Any]:
    """A JSON-able view for `studiotui place --json` and the controller's events."""
    if isinstance(p, Refusal):
        return {"ok": False, "reason": p.reason}
    return {
        "ok": True,
        "model": p.model,
        "context_tokens": p.context_tokens,
        "streams": p.streams,
        "kv_bits": p.kv_bits,
        "kv_group_size": p.kv_group_size,
        "notes": list(p.notes),
        "total_bytes": p.total_bytes,
        "ring": [s.node for s in p.shards],
        "slowest_link": asdict(p.slowest_link) if p.slowest_link else None,
        "shape": p.shape,
        "shards": [
            {**asdict(s), "group": list(s.group), "group_free": list(s.group_free)}
            for s in p.shards
        ],
    }


# --------------------------------------------------------------------------- config


def _quantization(config: Mapping[str, Any]) -> str | None:
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, Mapping):
        mode = q.get("mode", "affine")
        if mode != "affine":  # mxfp4, mxfp8, nvfp4: the name says the bits
            return str(mode)
        if "bits" in q:
            # Mixed conversions override bits per module ("model.layers.0.mlp": {...}).
            bits = {q["bits"]} | {
                v["bits"] for v in q.values() if isinstance(v, Mapping) and "bits" in v
            }
            if len(bits) > 1:
                return f"mixed {'/'.join(str(b) for b in sorted(bits))}-bit"
            return f"{q['bits']}-bit"
        method = q.get("quant_method")
        return str(method) if method else None
    return None


def kv_bytes_per_token(config: Mapping[str, Any], act_dtype: str | None = None) -> int:
    """K and V of one token in one standard-attention layer, from a config.json.

    The cache is kept in the activation dtype (`act_dtype`, else the config's), not the
    weights' quantized one; an unknown dtype counts as float32 because overestimating
    KV is the safe side."""
    cfg = text_config(config)
    act = DTYPE_BYTES.get(act_dtype, 4) if act_dtype else activation_bytes(config)
    return standard_per_token(cfg, act)


def facts_from_config(
    config: Mapping[str, Any],
    weight_bytes_by_layer: Sequence[int],
    embed_bytes: int,
    head_bytes: int,
    name: str,
    act_dtype: str | None = None,
    kv_bits: int = 0,
    kv_group_size: int = 64,
) -> ModelFacts:
    """ModelFacts from a config.json dict and the tensor sizes read from safetensors.

    `act_dtype` is the dtype activations (and so caches) will have, when the caller
    knows it from the weights better than config.json says; `kv_bits`: the caches
    quantized (`place --kv-bits`)."""
    cfg = text_config(config)
    dtype = act_dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    try:
        n_layers = int(cfg["num_hidden_layers"])
        caches = layer_caches(
            {**config, "torch_dtype": dtype, "dtype": dtype}, kv_bits, kv_group_size
        )
    except KeyError as missing:
        raise ValueError(f"{name}: config.json lacks {missing}") from None
    return ModelFacts(
        name=name,
        family=str(config.get("model_type") or cfg.get("model_type") or "unknown"),
        n_layers=n_layers,
        layer_bytes=tuple(int(b) for b in weight_bytes_by_layer),
        embed_bytes=int(embed_bytes),
        head_bytes=int(head_bytes),
        kv_bytes_per_token=max(kv.per_token for kv in caches),
        dtype=dtype,
        quantization=_quantization(config),
        layer_kv=caches,
        max_positions=trained_positions(cfg),
    )


def trained_positions(cfg: Mapping[str, Any]) -> int:
    """How many positions a (text) config says its model was trained for, its RoPE
    scaling's stretch included (YaRN: original × factor); 0 when it does not say."""
    most = cfg.get("max_position_embeddings")
    positions = most if isinstance(most, int) and not isinstance(most, bool) else 0
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, Mapping):
        original, factor = scaling.get("original_max_position_embeddings"), scaling.get("factor")
        if isinstance(original, int) and isinstance(factor, int | float) and factor > 1:
            positions = max(positions, int(original * factor))
    return max(0, positions)


def context_beyond(facts: ModelFacts, context_tokens: int) -> str:
    """A word for a context longer than the model was trained for ("" when it is not):
    the KV cache is reserved all the same, but what comes past those positions is
    unreliable, and the memory could serve more streams instead."""
    if not facts.max_positions or context_tokens <= facts.max_positions:
        return ""
    return (
        f"{context_tokens} tokens of context is beyond the {facts.max_positions} positions "
        f"{facts.name} was trained for (max_position_embeddings): answers past them are "
        f"unreliable; --context {facts.max_positions} or less keeps to them"
    )
