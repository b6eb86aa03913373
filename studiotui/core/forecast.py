"""How fast a placement will decode, before anything loads: a small, pure cost model.

Decode is memory-bandwidth bound: a step of a stage costs the bytes its node reads
(its share of the weights a token touches, plus the KV cache it attends over) divided
by the node's memory bandwidth, capped below by the compute the step needs. Links add
what they cost: a pipeline hop per stage boundary per step, and for a tensor group two
all-reduces per layer (after attention and after the MLP, where mlx-lm's `shard()`
puts its `sharded-to-all` cuts). Every constant is stated here, with where it comes
from; `docs/architecture.md` ("Placement" → "Forecast") and the forecast table in docs/placing.md
say how close the model comes to published and measured figures.

What it does not model: the KV cache's growth within an answer (decode is priced at a
fixed context), prefix caching, sliding windows in prefill, thermal limits, how
several stages sharing one CPU-only host compete for its cores (only its bandwidth),
and other programs keeping a host's cores busy, which slows a tensor group on the ring
backend most: its ranks busy-poll at every all-reduce (docs/forecast.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from studiotui.core.benchmark import Run
from studiotui.core.members import rdma_link
from studiotui.core.placement import (
    Link,
    ModelFacts,
    NodeBudget,
    Plan,
    Refusal,
    link_figures,
    plan,
    tensor_refusal,
    tensor_sizes,
)
from studiotui.core.state import ClusterState

_GB = 1e9  # memory bandwidth is quoted in decimal GB/s

# (GB/s, FP16 TFLOPS) of each chip's unified memory and GPU, from Apple's published
# specifications (the largest GPU of each chip; a binned part is a little slower).
CHIPS: dict[str, tuple[float, float]] = {
    "M1": (68.0, 2.6),
    "M1 Pro": (200.0, 5.2),
    "M1 Max": (400.0, 10.4),
    "M1 Ultra": (800.0, 21.0),
    "M2": (100.0, 3.6),
    "M2 Pro": (200.0, 6.8),
    "M2 Max": (400.0, 13.6),
    "M2 Ultra": (800.0, 27.2),
    "M3": (100.0, 4.1),
    "M3 Pro": (150.0, 7.4),
    "M3 Max": (400.0, 16.4),
    "M3 Ultra": (819.0, 28.2),
    "M4": (120.0, 4.3),
    "M4 Pro": (273.0, 9.2),
    "M4 Max": (546.0, 18.4),
    "M5": (153.0, 5.7),
}
# A node that is not Apple Silicon runs MLX on its CPU: a stated default, calibrated on
# a 2-vCPU Linux machine (docs/placing.md's forecast table, the demo model): its
# 512-token prompt in 1.74 s gives the compute (MLX's float32 matmuls here reach ~4
# GFLOPS), its 190 tok/s in one process the fixed dispatch cost per layer per step.
CPU_DEFAULT = (20.0, 0.008)
CPU_LAYER_US = 280.0

# Share of peak bandwidth a decode step reaches with MLX on Apple GPUs: mlx-lm's
# published single-machine figures give 0.83 (Llama 3.1 70B bf16, M2 Ultra, 4.7 tok/s,
# ml-explore/mlx-examples#1069) and 0.86 (Qwen2.5-72B 6-bit, M4 Max, 7.9 tok/s,
# ml-explore/mlx-examples#1281).
BANDWIDTH_EFFICIENCY = 0.85
# Share of peak compute a prefill chunk reaches (large matmuls; assumed, not measured here).
COMPUTE_EFFICIENCY = 0.5
# One all-reduce of MLX's distributed ops waits for the GPU stream to drain and the CPU
# to run the collective before the next kernel starts (assumed).
ALLREDUCE_SYNC_US = 50.0
# RDMA over Thunderbolt: ~30 µs against ~300 µs for TCP (measured by others, see
# shared/DESIGN.md; Jeff Geerling's article says "< 50 µs").
RDMA_LATENCY_US = 30.0
# What this engine adds to a link's own latency for each pipeline hop (Python,
# ZeroMQ wake-ups at both ends): `studiotui bench` measured 244-404 µs on loopback,
# whose link latency is ~50 µs, when hop_us_p50 still held the receiver's Python up to
# its compute. The bench now splits that into hop_us_p50 (send call to recv, ~225-460
# µs loaded) and frame_overhead_us_p50 (a stage's Python per frame, mostly the next
# step's graph build, which the per-layer dispatch cost of CPU-only nodes prices).
ENGINE_HOP_US = 200.0
# A prefill is cut into chunks (the runners' default prefill_chunk) that pipeline
# across stages; decode is priced at the context a 2k-token prompt leaves.
PREFILL_CHUNK = 512
PROMPT_TOKENS = 2048
STREAMS = 8


@dataclass(frozen=True)
class Chip:
    """A node's speed as the forecast sees it, and where the figures came from."""

    bandwidth_gbs: float
    tflops: float
    source: str
    layer_us: float = 0.0  # fixed dispatch cost per layer per step (CPU-only nodes)
    # What `studiotui benchmark` measured on the node's device, when it did: µs of a
    # decode step per layer by kind (dense, dense_q4, moe, moe_q4; dense_tp2: a dense
    # layer as a 2-way tensor rank's slice, see rank_share) and outside its
    # layers (step), MLX GFLOP/s per dtype, and µs per round of a small all-reduce by
    # backend and group size ("ring/2": the group's product step measured it there).
    decode_us: Mapping[str, float] = field(default_factory=dict)
    gflops: Mapping[str, float] = field(default_factory=dict)
    allreduce_round_us: Mapping[str, float] = field(default_factory=dict)
    run: str = ""  # the benchmark run the measured figures come from
    # The links that run measured from this node (latency and Gb/s to each other node),
    # used for a pair the caller's links have no measured figure for.
    links: tuple[Link, ...] = ()

    @property
    def measured(self) -> bool:
        """Whether a benchmark measured this node's decode step (not the table's guess)."""
        return bool(self.decode_us)


def chip_for(chip: str, os_name: str = "", measured_gbs: float | None = None) -> Chip:
    """The node's figures: measured bandwidth if it reports one, else the chip table
    (the longest name the chip string contains), else the CPU-only default."""
    label = chip.replace("Apple ", "").strip()
    found = max((name for name in CHIPS if name.lower() in label.lower()), key=len, default=None)
    # "M3" is in "M3 Ultra": the longest match wins, and a bare "M3" must be a whole word.
    if found is not None and not _whole_word(found, label):
        found = None
    if found is not None:
        gbs, tflops = CHIPS[found]
        source = f"{found} (table)"
        layer_us = 0.0
    else:
        gbs, tflops = CPU_DEFAULT
        source = f"CPU-only node{f' ({label})' if label else ''}: default"
        layer_us = CPU_LAYER_US
    if measured_gbs and measured_gbs > 0:
        return Chip(measured_gbs, tflops, f"measured {measured_gbs:.0f} GB/s", layer_us)
    return Chip(gbs, tflops, source, layer_us)


def _whole_word(name: str, label: str) -> bool:
    at = label.lower().find(name.lower())
    end = at + len(name)
    return end == len(label) or not label[end].isalnum()


@dataclass(frozen=True)
class Forecast:
    shape: str
    tps_1: float  # decode tok/s, one stream
    tps_streams: float  # decode tok/s summed over `streams` streams (batched decode)
    ttft_ms: float  # time to first token of a PROMPT_TOKENS prompt
    streams: int = STREAMS  # what tps_streams is for: the placement's streams, when known
    measured: bool = False  # every node's figures come from a `studiotui benchmark` run
    # With speculative decoding (`place --draft`): one stream's tok/s when the share
    # `spec_acceptance` of the guesses is kept (0: the placement does not speculate).
    spec_tps_1: float = 0.0
    spec_acceptance: float = 0.0


# Speculative decoding's forecast states the share of guesses kept it assumes: a draft
# model of the model's own family keeps most on ordinary text, prompt lookup fewer (it
# pays where the answer copies its input). Guesses per step as worker/speculation's.
SPEC_ACCEPTANCE = {"model": 0.7, "lookup": 0.5}
DRAFT_TOKENS = 4


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step of `k` guesses yields when each is kept with probability
    `acceptance`: 1 + a + ... + a^k (worker.speculation's rule of K)."""
    return float(sum(acceptance**i for i in range(k + 1)))


# --------------------------------------------------------------------------- parts


def measured_links(links: Sequence[Link], chips: Mapping[str, Chip]) -> list[Link]:
    """`links`, and for each pair that none of them measured, the link a benchmark
    measured (`Chip.links`), with its kind and the RDMA the caller's link judged."""
    known = {frozenset((x.a, x.b)) for x in links if x.latency_us is not None}
    judged = {frozenset((x.a, x.b)): x for x in links}
    out = list(links)
    for chip in chips.values():
        for link in chip.links:
            key = frozenset((link.a, link.b))
            if key in known or link.latency_us is None:
                continue
            known.add(key)
            old = judged.get(key)
            out.append(replace(link, rdma=old.rdma, rdma_why=old.rdma_why) if old else link)
    # An unmeasured link of a pair measured now is left out: its defaults would win.
    measured = {frozenset((x.a, x.b)) for x in out if x.latency_us is not None}
    return [x for x in out if x.latency_us is not None or frozenset((x.a, x.b)) not in measured]


def _pair_links(links: Sequence[Link]) -> dict[frozenset[str], Link]:
    out: dict[frozenset[str], Link] = {}
    for link in links:
        key = frozenset((link.a, link.b))
        known = out.get(key)
        if known is None or link_figures(link)[0] < link_figures(known)[0]:
            out[key] = link
    return out


def _hosts(names: Sequence[str], links: Mapping[frozenset[str], Link]) -> dict[str, int]:
    """Nodes joined by a loopback link share one machine (and its memory bandwidth)."""
    host = {name: i for i, name in enumerate(names)}
    for key, link in links.items():
        if link.kind == "loopback" and key <= set(host):
            a, b = sorted(key)
            old, new = host[b], host[a]
            host = {n: (new if h == old else h) for n, h in host.items()}
    return host


def _params(model: ModelFacts, nbytes: float) -> float:
    bits = model.bits_per_weight or 16.0
    return nbytes * 8 / bits


@dataclass(frozen=True)
class _Stage:
    nodes: tuple[str, ...]
    start: int
    end: int
    first: bool
    last: bool


def _stage_bytes(model: ModelFacts, st: _Stage, batch: int, context: int) -> tuple[float, float]:
    """(bytes a node of the stage reads in one decode step of `batch` tokens, weight
    bytes one token multiplies by), each its share of a tensor group's split."""
    n = len(st.nodes)
    split = model.tensor.layer_split if model.tensor and n > 1 else (0,) * model.n_layers
    experts = model.layer_experts or (0,) * model.n_layers
    # Distinct experts b tokens touch, each routed independently: 1 - (1 - k/E)^b.
    touched = 1 - (1 - model.experts_active) ** batch if model.layer_experts else 1.0
    read = used = 0.0
    for i in range(st.start, st.end):
        whole, cut = model.layer_bytes[i] - split[i], split[i] / n
        # Routed experts are in the cut part when the family shards them (all that do).
        routed = experts[i] / n if n > 1 and split[i] >= experts[i] else experts[i]
        other = whole + cut - routed
        read += other + routed * touched
        used += other + routed * model.experts_active  # what one token multiplies by
    head = model.head_bytes if st.last else 0
    read += head
    used += head
    kv = float(sum(model.kv_bytes(context)[st.start : st.end]) * batch)
    if model.tensor and model.tensor.kv_split:
        kv /= n
    return read + kv, used


def _allreduce_us(
    nodes: Sequence[str],
    links: Mapping[frozenset[str], Link],
    nbytes: float,
    rdma: bool,
    chips: Mapping[str, Chip] | None = None,
) -> float:
    """One all-reduce over the group: JACCL over RDMA in two rounds (reduce, broadcast);
    the ring backend in 2(N-1) rounds over the slowest TCP link of the group. Where a
    benchmark timed a small all-reduce over the backend that will run, a round costs
    what it measured (the slowest of the group's nodes) instead of the link's latency."""
    n = len(nodes)
    if n < 2:
        return 0.0
    rounds = 2 if rdma else 2 * (n - 1)
    backend = f"{'jaccl' if rdma else 'ring'}/{n}"
    timed = [chips[x].allreduce_round_us.get(backend) for x in nodes if chips and x in chips]
    if timed and all(t is not None for t in timed):
        return rounds * max(t for t in timed if t is not None)
    worst_lat, worst_gbps = 0.0, math.inf
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            link = links.get(frozenset((a, b)))
            lat, gbps = link_figures(link) if link else (300.0, 10.0)
            worst_lat, worst_gbps = max(worst_lat, lat), min(worst_gbps, gbps)
    latency = RDMA_LATENCY_US if rdma else worst_lat
    transfer = nbytes / n * 8 / (worst_gbps * 1e3)  # 1 Gb/s moves 1e3 bits per µs
    return ALLREDUCE_SYNC_US + rounds * (latency + transfer)


def _step_us(
    model: ModelFacts,
    st: _Stage,
    chips: Mapping[str, Chip],
    links: Mapping[frozenset[str], Link],
    hosts: Mapping[str, int],
    batch: int,
    context: int,
    rdma: bool,
) -> float:
    """One decode step of `batch` tokens through the stage: its slowest node's read (or
    compute), plus the group's all-reduces."""
    read, used = _stage_bytes(model, st, batch, context)
    slowest = 0.0
    for node in st.nodes:
        chip = chips[node]
        # Group members on one machine share its bandwidth and compute.
        share = sum(hosts[m] == hosts[node] for m in st.nodes)
        memory = read * share / (chip.bandwidth_gbs * _GB * BANDWIDTH_EFFICIENCY) * 1e6
        flops = 2 * _params(model, used) * batch * share
        compute = flops / _flops(chip, model) * 1e6
        if chip.measured:
            # The measured cost of each layer's step already holds a small layer's reads
            # and products: a larger layer costs more only where its bytes or FLOPs do.
            # A rank of a tensor group holds a slice of each layer (rank_share).
            cut = rank_share(chip.decode_us, len(st.nodes))
            layers = cut * sum(_layer_us(model, chip, i) for i in range(st.start, st.end))
            slowest = max(slowest, chip.decode_us.get("step", 0.0) + max(layers, memory, compute))
            continue
        dispatch = chip.layer_us * (st.end - st.start)
        slowest = max(slowest, dispatch + max(memory, compute))
    act = _act_bytes(model)
    per = _allreduce_us(st.nodes, links, model.hidden_size * act * batch, rdma, chips)
    return slowest + 2 * (st.end - st.start) * per


def _flops(chip: Chip, model: ModelFacts) -> float:
    """FLOP/s a step's products reach on the node in the model's dtype: what a benchmark
    measured (a sustained figure: no efficiency applies), else the chip's peak times
    COMPUTE_EFFICIENCY."""
    measured = chip.gflops.get(model.dtype) or chip.gflops.get("float32")
    return measured * 1e9 if measured else chip.tflops * 1e12 * COMPUTE_EFFICIENCY


def rank_share(decode_us: Mapping[str, float], n: int) -> float:
    """The share of a layer's measured decode cost one rank of an `n`-way tensor group
    pays for its slice: a benchmark timed a dense layer whole (`dense`) and as a rank of
    a 2-way group holds it (`dense_tp2`), so a layer's cost is a part that does not
    shrink with the slice (op dispatch, the step's Python) and a part that does:
    whole = fixed + cut, half = fixed + cut / 2, and a rank of n pays fixed + cut / n.
    1 for one node, or where the run did not time the slice (an older benchmark)."""
    whole, half = decode_us.get("dense", 0.0), decode_us.get("dense_tp2", 0.0)
    if n < 2 or whole <= 0 or half <= 0:
        return 1.0
    # Timings under load can put the half above the whole, or below a half of it:
    # the fixed part is kept between none and all of the layer.
    fixed = min(max(2 * half / whole - 1, 0.0), 1.0)
    return fixed + (1 - fixed) / n


def _layer_us(model: ModelFacts, chip: Chip, layer: int) -> float:
    """The measured cost of one decode step of layer `layer`: a MoE layer's or a dense
    one's, of quantized weights or not (a kind not measured falls back to dense)."""
    moe = bool(model.layer_experts and model.layer_experts[layer])
    kind = "moe" if moe else "dense"
    if 0 < model.bits_per_weight < 16:
        kind += "_q4"
    return chip.decode_us.get(kind) or chip.decode_us.get("dense", 0.0)


def _act_bytes(model: ModelFacts) -> int:
    return {"float32": 4, "float64": 8}.get(model.dtype, 2)


def _hop_us(
    a: _Stage, b: _Stage, links: Mapping[frozenset[str], Link], nbytes: float, rdma: bool
) -> float:
    link = links.get(frozenset((a.nodes[0], b.nodes[0])))
    lat, gbps = link_figures(link) if link else (300.0, 10.0)
    if link is not None and link.rdma and rdma:
        lat = RDMA_LATENCY_US
    return ENGINE_HOP_US + lat + nbytes * 8 / (gbps * 1e3)


def _prefill_us(
    model: ModelFacts,
    st: _Stage,
    chips: Mapping[str, Chip],
    links: Mapping[frozenset[str], Link],
    hosts: Mapping[str, int],
    chunk: int,
    offset: int,
    rdma: bool,
) -> float:
    """One prefill chunk through the stage: its FLOPs (weights × tokens, attention over
    the context so far) or one read of its weights, whichever is slower."""
    n = len(st.nodes)
    # A chunk of hundreds of tokens touches every expert: the stage's whole share is read.
    weights = sum(model.layer_bytes[st.start : st.end]) / n + (model.head_bytes if st.last else 0)
    _, active = _stage_bytes(model, _Stage(st.nodes, st.start, st.end, False, False), 1, 0)
    flops = 2 * _params(model, active) * chunk
    flops += 4 * model.attn_width * chunk * (offset + chunk / 2) * (st.end - st.start) / n
    if st.last:  # only the last token's logits are needed
        flops += 2 * _params(model, model.head_bytes)
    slowest = 0.0
    for node in st.nodes:
        chip = chips[node]
        share = sum(hosts[m] == hosts[node] for m in st.nodes)
        compute = flops * share / _flops(chip, model) * 1e6
        memory = weights * share / (chip.bandwidth_gbs * _GB * BANDWIDTH_EFFICIENCY)
        dispatch = chip.layer_us * (st.end - st.start)
        slowest = max(slowest, dispatch + max(compute, memory * 1e6))
    act = _act_bytes(model)
    per = _allreduce_us(st.nodes, links, model.hidden_size * act * chunk, rdma, chips)
    return slowest + 2 * (st.end - st.start) * per


# --------------------------------------------------------------------------- forecast


def forecast(
    model: ModelFacts,
    plan: Plan,
    chips: Mapping[str, Chip],
    links: Sequence[Link] = (),
    *,
    streams: int = STREAMS,
    prompt_tokens: int = PROMPT_TOKENS,
    draft: str = "",
    draft_tokens: int = 0,
) -> Forecast:
    """Decode tok/s at one and at `streams` streams, and the time to first token of a
    `prompt_tokens` prompt, for `plan` on nodes with these `chips` and `links`.

    One stream: a token crosses every stage and every hop (the tail's token goes back
    to the head). Several: batched decode — each step reads the weights once for all
    the requests in it (more of a MoE's experts as the batch grows, each request's own
    KV) — as one batch going round the ring.

    With `draft` ("lookup", "model"): one stream's tok/s with `draft_tokens` guesses a
    step kept at SPEC_ACCEPTANCE — a step of 1 + K positions round the ring (priced as
    a batch of that many) plus, with a draft model, its K steps on the head's node
    (its weights, `draft_bytes`, read once a guess)."""
    pair = _pair_links(measured_links(links, chips))
    names = [n for s in plan.shards for n in s.nodes]
    hosts = _hosts(names, pair)
    count = len(plan.shards)
    stages = [
        _Stage(s.nodes, s.start, s.end, i == 0, i == count - 1) for i, s in enumerate(plan.shards)
    ]
    rdma = {i: s.backend == "jaccl" for i, s in enumerate(plan.shards)}
    context = prompt_tokens
    act = _act_bytes(model) * model.hidden_size

    def cycle(batch: int) -> float:
        steps = [
            _step_us(model, st, chips, pair, hosts, batch, context, rdma[i])
            for i, st in enumerate(stages)
        ]
        hops = [
            _hop_us(st, stages[(i + 1) % count], pair, act * batch, rdma[i])
            for i, st in enumerate(stages)
            if count > 1
        ]
        return sum(steps) + sum(hops)

    # Several streams decode as one batch that goes round the ring, one step per stage
    # (as exo's pipeline and mlx-lm's batched generation do): the weights are read once
    # per step for all of them, and a MoE's batch touches more of its experts.
    one = cycle(1)
    many = streams / cycle(streams)

    # Prefill: chunks flow through the stages one behind the other.
    chunks = [
        (min(PREFILL_CHUNK, prompt_tokens - o), o) for o in range(0, prompt_tokens, PREFILL_CHUNK)
    ]
    per_stage = [
        [_prefill_us(model, st, chips, pair, hosts, c, o, rdma[i]) for c, o in chunks]
        for i, st in enumerate(stages)
    ]
    hops = sum(
        _hop_us(st, stages[i + 1], pair, act * PREFILL_CHUNK, rdma[i])
        for i, st in enumerate(stages[:-1])
    )
    slowest = max(per_stage, key=sum)
    ttft = sum(t[0] for t in per_stage) + sum(slowest[1:]) + hops
    measured = all(chips[n].measured for n in names if n in chips)
    spec_tps, acceptance = 0.0, 0.0
    if draft in SPEC_ACCEPTANCE:
        k = draft_tokens or DRAFT_TOKENS
        acceptance = SPEC_ACCEPTANCE[draft]
        guessing = 0.0
        head = chips.get(plan.shards[0].nodes[0])
        draft_bytes = plan.shards[0].draft_bytes
        if draft == "model" and head is not None and draft_bytes:
            guessing = k * draft_bytes / (head.bandwidth_gbs * _GB * BANDWIDTH_EFFICIENCY) * 1e6
        spec_tps = expected_tokens(acceptance, k) / (cycle(k + 1) + guessing) * 1e6
    return Forecast(
        plan.shape, 1e6 / one, many * 1e6, ttft / 1e3, streams, measured, spec_tps, acceptance
    )


# --------------------------------------------------------------------------- choosing

# A tensor shape is chosen over a smaller one only when forecast this much faster:
# the forecast's own error on published figures is a few percent, and a pipeline is
# the simpler thing to run.
MARGIN = 1.05


@dataclass(frozen=True)
class ShapeOption:
    """One tensor size that divides the model and the nodes: its plan or refusal,
    and the forecast when it fits."""

    tensor: int
    verdict: Plan | Refusal
    forecast: Forecast | None


@dataclass(frozen=True)
class Choice:
    verdict: Plan | Refusal  # the shape chosen (or asked for), or why nothing fits
    options: tuple[ShapeOption, ...]  # every tensor size that divides, smallest first


def choose(
    model: ModelFacts,
    nodes: Sequence[NodeBudget],
    links: Sequence[Link],
    chips: Mapping[str, Chip],
    *,
    tensor: int | None = None,
    context_tokens: int = 4096,
    streams: int = 1,
    reserve_fraction: float = 0.05,
) -> Choice:
    """Plan every shape that divides (stages of 1, 2, 4… nodes), forecast those that
    fit, and pick `tensor` if asked, else the fastest at one stream — a bigger tensor
    group only when it beats the best smaller one by MARGIN, so a pipeline stays the
    choice wherever it is as fast. A `tensor` that does not divide is refused in words."""
    every = {name.name: chip_for("") for name in nodes}
    every.update(chips)
    options = []
    for size in tensor_sizes(model, len(nodes)):
        verdict = plan(
            model,
            nodes,
            links,
            context_tokens=context_tokens,
            streams=streams,
            reserve_fraction=reserve_fraction,
            tensor=size,
        )
        guess = forecast(model, verdict, every, links) if isinstance(verdict, Plan) else None
        options.append(ShapeOption(size, verdict, guess))
    if tensor is not None:
        why = tensor_refusal(model, tensor, len(nodes))
        asked = next((o for o in options if o.tensor == tensor), None)
        if why or asked is None:
            return Choice(
                Refusal(why or f"tensor size {tensor} does not fit", "shape" if why else "memory"),
                tuple(options),
            )
        return Choice(asked.verdict, tuple(options))
    best: ShapeOption | None = None
    for option in options:
        if option.forecast is None:
            continue
        if best is None or (
            best.forecast is not None and option.forecast.tps_1 > best.forecast.tps_1 * MARGIN
        ):
            best = option
    return Choice(best.verdict if best else options[0].verdict, tuple(options))


def chips_from_state(
    state: ClusterState, names: Sequence[str], measured: Mapping[str, float] | None = None
) -> dict[str, Chip]:
    """Each node's figures: a memory bandwidth its agent reports
    (`facts["memory_bandwidth_gbs"]`) or `studiotui benchmark` measured (`measured`,
    see `measured_bandwidths`), else its chip's row."""
    out = {}
    for name in names:
        node = state.node(name)
        if node is None:
            out[name] = chip_for("", measured_gbs=(measured or {}).get(name))
            continue
        reported = node.facts.get("memory_bandwidth_gbs")
        gbs = float(reported) if isinstance(reported, int | float) else None
        out[name] = chip_for(node.chip, node.os, gbs or (measured or {}).get(name))
    return out


def measured_bandwidths(runs: Sequence[Run], cluster: str) -> dict[str, float]:
    """Each node's memory read GB/s from the newest saved `studiotui benchmark` run of
    this cluster that measured it (`runs` newest first, as `benchmark.saved` gives them)."""
    out: dict[str, float] = {}
    for run in runs:
        if run.cluster != cluster:
            continue
        for node in run.nodes:
            if node.read_gbs and node.read_gbs > 0 and not node.error:
                out.setdefault(node.name, node.read_gbs)
    return out


def with_benchmark(chips: Mapping[str, Chip], runs: Sequence[Run], cluster: str) -> dict[str, Chip]:
    """`chips` with what the newest saved `studiotui benchmark` run of this cluster
    measured on each node (`runs` newest first): its decode step per layer, its MLX
    GFLOP/s, its memory read bandwidth, its links to the other nodes, and a round of a
    small all-reduce of a group it was in (the run's all-reduce over N ranks took
    2(N-1) rounds of the ring, 2 of JACCL)."""
    out = dict(chips)
    for name, chip in chips.items():
        for run in runs:
            if run.cluster != cluster:
                continue
            node = next((n for n in run.nodes if n.name == name and not n.error), None)
            if node is None or not node.decode_us:
                continue
            rounds: dict[str, float] = {}
            g = run.group
            if g is not None and g.allreduce_us and name in g.nodes and len(g.nodes) > 1:
                count = 2 if g.backend == "jaccl" else 2 * (len(g.nodes) - 1)
                # Keyed by the group's size too: on hosts whose cores the ranks share, a
                # round over 4 ranks is no guide to one over 2.
                rounds[f"{g.backend}/{len(g.nodes)}"] = g.allreduce_us / count
            measured_from = tuple(
                Link(x.a, x.b, x.latency_us, x.best_gbps, x.kind)
                for x in run.links
                if name in (x.a, x.b) and x.latency_us is not None and not x.error
            )
            out[name] = replace(
                chip,
                bandwidth_gbs=node.read_gbs or chip.bandwidth_gbs,
                source=f"measured by benchmark {run.id}",
                decode_us=dict(node.decode_us),
                gflops=dict(node.gflops),
                allreduce_round_us=rounds,
                run=run.id,
                links=measured_from,
            )
            break
    return out


@dataclass(frozen=True)
class LastMeasured:
    """The newest decode figure `studiotui benchmark` saved for a model on a shape."""

    tps_1: float  # one stream's decode tok/s, after its first token
    run: str  # the run's id
    placement: str


def last_measured(runs: Sequence[Run], cluster: str, model: str, shape: str) -> LastMeasured | None:
    """One stream's tok/s the newest run of this cluster measured for a placement of
    `model` on `shape` (`runs` newest first), or None if none did."""
    for run in runs:
        if run.cluster != cluster:
            continue
        for p in run.placements:
            if p.model != model or p.shape != shape or p.error:
                continue
            one = next((q for q in p.points if q.streams == 1), None)
            if one is not None and one.tps > 0:
                return LastMeasured(one.decode_tps, run.id, p.name)
    return None


def links_from_state(state: ClusterState) -> list[Link]:
    """The measured links as the planner takes them, RDMA included. Where both agents
    report their Thunderbolt ports, a link's RDMA is judged from them now (an active
    cable between the two, `members.rdma_link`, with the reason when there is none);
    else it is what the controller judged when it measured the link. A pair not
    measured yet that such a cable joins is listed with no figures but its RDMA."""
    rdma = {n.name: n.facts.get("rdma") for n in state.nodes}
    links = []
    for x in state.links:
        judged = rdma_link(x.a, x.b, rdma)
        ok, why = judged if judged is not None else (x.rdma, x.rdma_why)
        links.append(Link(x.a, x.b, x.latency_us, x.gbps, x.kind, ok, why))
    seen = {frozenset((x.a, x.b)) for x in links}
    names = [n.name for n in state.nodes]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if frozenset((a, b)) not in seen and rdma_link(a, b, rdma) == (True, ""):
                links.append(Link(a, b, None, None, "unknown", True))
    return links


# What a forecast with no benchmark behind it says of itself.
UNMEASURED = "not measured (run `studiotui benchmark`)"


def describe(f: Forecast, last: LastMeasured | None = None, *, unmeasured: bool = True) -> str:
    """ "31.9 tok/s · 8 streams 118 tok/s · first token 2.1 s": the streams a placement
    admits (the preview's "× N streams"), left out for one; then the tok/s a benchmark
    last measured for this model on this shape, and (`unmeasured`: unless the caller
    says it once for several) that the nodes were never measured."""
    ttft = f"{f.ttft_ms / 1000:.1f} s" if f.ttft_ms >= 1000 else f"{f.ttft_ms:.0f} ms"
    many = f"{f.streams} streams {f.tps_streams:.0f} tok/s · " if f.streams > 1 else ""
    said = f"{f.tps_1:.1f} tok/s · {many}first token of {PROMPT_TOKENS // 1024}k {ttft}"
    if f.spec_tps_1:
        said += (
            f" · with guesses {f.spec_tps_1:.1f} tok/s ({f.spec_tps_1 / f.tps_1:.2f}×) if "
            f"{f.spec_acceptance:.0%} of them are kept"
        )
    if last is not None:
        said += f" · last measured {last.tps_1:.1f} tok/s"
    if not f.measured and unmeasured:
        said += f" · {UNMEASURED}"
    return said
