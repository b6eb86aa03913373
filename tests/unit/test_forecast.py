"""The speed forecast: the pure cost model, and how close it comes to real figures.

Published figures (the seeds' models, header-only, on the articles' machines) and
the bench's demo model measured on a 2-vCPU Linux machine: every row of the forecast
table in docs/placing.md is computed here, so the table cannot drift from the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from studiotui.core.forecast import (
    CHIPS,
    CPU_DEFAULT,
    DRAFT_TOKENS,
    SPEC_ACCEPTANCE,
    Chip,
    Forecast,
    chip_for,
    chips_from_state,
    describe,
    expected_tokens,
    forecast,
    links_from_state,
)
from studiotui.core.model_facts import ModelFacts, read_model
from studiotui.core.placement import Link, NodeBudget, Plan, TensorFacts, plan
from studiotui.core.state import ClusterState, LinkState, NodeState
from tests.support.seed_models import seed_model
from worker.shared.demo_model import DemoSpec, write_demo_model

GiB = 1024**3
PLACING = Path(__file__).resolve().parents[2] / "docs" / "placing.md"
ULTRAS = [NodeBudget(f"studio-{i}", 504 * GiB, 512 * GiB) for i in range(1, 5)]
NAMES = [n.name for n in ULTRAS]
M3_ULTRA = {n: chip_for("Apple M3 Ultra") for n in NAMES}


def mesh(names: list[str], rdma: bool, kind: str = "thunderbolt", latency: float = 150.0):
    return [
        Link(a, b, latency, 40.0, kind, rdma) for i, a in enumerate(names) for b in names[i + 1 :]
    ]


def dense(name: str, layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int,
          bits: float) -> ModelFacts:  # fmt: skip
    """A dense decoder's facts from its published config.json numbers (head_dim 128)."""
    per_layer = (2 * hidden * hidden + 2 * hidden * kv * 128 + 3 * hidden * inter) * bits / 8
    embed = int(vocab * hidden * bits / 8)
    # llama's shard() cuts every projection of a layer; only the two norms stay whole.
    tensor = TensorFacts(
        (("attention heads", heads), ("KV heads", kv)), (int(per_layer) - 4 * hidden,) * layers
    )
    return ModelFacts(
        name, "llama", layers, (int(per_layer),) * layers, embed, embed, 2 * kv * 128 * 2,
        dtype="bfloat16", hidden_size=hidden, attn_width=heads * 128, bits_per_weight=bits,
        tensor=tensor,
    )  # fmt: skip


def alone(model: ModelFacts, chip: str, memory_gb: int) -> Forecast:
    verdict = plan(model, [NodeBudget("m", memory_gb * GiB, memory_gb * GiB)])
    assert isinstance(verdict, Plan), verdict
    return forecast(model, verdict, {"m": chip_for(chip)})


# --------------------------------------------------------------------------- the model


def test_chips_come_from_the_table_by_the_longest_name_else_the_cpu_default() -> None:
    assert chip_for("Apple M3 Ultra").bandwidth_gbs == 819.0
    assert chip_for("Apple M3").bandwidth_gbs == 100.0  # not "M3 Ultra"'s
    assert chip_for("Apple M4 Max").bandwidth_gbs == 546.0
    assert chip_for("Apple M4 Pro").bandwidth_gbs == 273.0
    assert chip_for("Apple M2 Ultra").bandwidth_gbs == CHIPS["M2 Ultra"][0] == 800.0
    cpu = chip_for("AMD EPYC 7B13")
    assert (cpu.bandwidth_gbs, cpu.tflops) == CPU_DEFAULT and "CPU-only" in cpu.source
    measured = chip_for("Apple M3 Ultra", measured_gbs=700.0)
    assert measured.bandwidth_gbs == 700.0 and measured.source.startswith("measured")


def test_state_gives_chips_and_links_with_rdma() -> None:
    state = ClusterState(
        nodes=(
            NodeState("a", "10.0.0.1", 1, "ssh", chip="Apple M4 Max"),
            NodeState("b", "10.0.0.2", 1, "ssh", chip="Apple M4 Max",
                      facts={"memory_bandwidth_gbs": 500}),
        ),
        links=(LinkState("a", "b", 40.0, 60.0, "thunderbolt", rdma=True),),
    )  # fmt: skip
    chips = chips_from_state(state, ["a", "b", "gone"])
    assert chips["a"].bandwidth_gbs == 546.0 and chips["b"].bandwidth_gbs == 500.0
    assert "CPU-only" in chips["gone"].source
    assert links_from_state(state) == [Link("a", "b", 40.0, 60.0, "thunderbolt", True)]

    # Not measured yet: RDMA when what both agents report shows an active cable between
    # them (their Thunderbolt ports, core/members.rdma_link), and nothing else known.
    def port(own: str, peer: str) -> dict[str, object]:
        return {"receptacle": 1, "domain_uuid": own, "device": "rdma_en2",
                "state": "PORT_ACTIVE", "peer_uuid": peer}  # fmt: skip

    def rdma(own: str, peer: str) -> dict[str, object]:
        return {"rdma": {"status": "enabled", "usable": True, "ports": [port(own, peer)]}}

    fresh = ClusterState(
        nodes=(
            NodeState("x", "", 1, "ssh", facts=rdma("X1", "Y1")),
            NodeState("y", "", 1, "ssh", facts=rdma("Y1", "X1")),
            NodeState("z", "", 1, "ssh", facts=rdma("Z1", "")),
        )
    )
    assert links_from_state(fresh) == [Link("x", "y", None, None, "unknown", True)]


def test_decode_follows_bandwidth_and_more_nodes_on_one_machine_gain_nothing() -> None:
    model = dense("d", 32, 4096, 14336, 32, 8, 128256, 4.5)
    slow, fast = alone(model, "Apple M4 Pro", 64), alone(model, "Apple M4 Max", 64)
    # A bandwidth-bound step: twice the bandwidth, twice the tokens (within dispatch).
    assert fast.tps_1 / slow.tps_1 == pytest.approx(546 / 273, rel=0.02)
    nodes = [NodeBudget(n, 60 * GiB, 64 * GiB) for n in NAMES]
    chips = {n: chip_for("Apple M4 Max") for n in NAMES}
    local = mesh(NAMES, False, "loopback", 50.0)
    four = forecast(model, plan(model, nodes, local), chips, local)  # type: ignore[arg-type]
    group = forecast(model, plan(model, nodes, local, tensor=4), chips, local)  # type: ignore[arg-type]
    # A pipeline on one machine runs its stages one after the other: no faster; a
    # tensor group there shares one memory bus and adds its all-reduces: slower.
    assert four.tps_1 < fast.tps_1 and group.tps_1 < four.tps_1


def test_speculation_forecasts_its_gain_at_a_stated_acceptance() -> None:
    """A 70B on two Ultras: a step of 1 + 4 positions reads the weights once, as one of
    one position does, so prompt lookup at 50% kept nearly multiplies one stream's
    tok/s by its expected tokens a step; a draft model pays its own reads; a CPU node,
    compute bound, gains less."""
    model = dense("d", 80, 8192, 28672, 64, 8, 128256, 4.5)
    two = plan(model, ULTRAS[:2], mesh(NAMES[:2], False))
    assert isinstance(two, Plan)
    plain = forecast(model, two, M3_ULTRA, mesh(NAMES[:2], False))
    assert plain.spec_tps_1 == 0.0 and "guesses" not in describe(plain)
    lookup = forecast(model, two, M3_ULTRA, mesh(NAMES[:2], False), draft="lookup")
    most = expected_tokens(SPEC_ACCEPTANCE["lookup"], DRAFT_TOKENS)
    assert lookup.spec_acceptance == 0.5
    assert 0.8 * most < lookup.spec_tps_1 / lookup.tps_1 < most
    said = describe(lookup)
    assert f"with guesses {lookup.spec_tps_1:.1f} tok/s" in said
    assert "if 50% of them are kept" in said
    # A 1 GB draft model read 4 times a step, at 70% kept.
    drafted = replace(two, shards=(replace(two.shards[0], draft_bytes=GiB), *two.shards[1:]))
    model_draft = forecast(model, drafted, M3_ULTRA, mesh(NAMES[:2], False), draft="model")
    free = expected_tokens(0.7, DRAFT_TOKENS) / expected_tokens(0.5, DRAFT_TOKENS)
    assert 1.0 < model_draft.spec_tps_1 / lookup.spec_tps_1 < free
    # Past what half kept guesses add (1/32 of a token, then 1/64), more guesses a step
    # only make each step dearer.
    six = forecast(model, two, M3_ULTRA, mesh(NAMES[:2], False), draft="lookup", draft_tokens=6)
    assert six.spec_tps_1 < lookup.spec_tps_1
    cpu = {n: chip_for("") for n in NAMES[:2]}
    slow = forecast(model, two, cpu, mesh(NAMES[:2], False), draft="lookup")
    assert slow.spec_tps_1 / slow.tps_1 < lookup.spec_tps_1 / lookup.tps_1


def test_batched_decode_gains_less_on_a_moe_whose_batch_touches_more_experts() -> None:
    model = dense("d", 32, 4096, 14336, 32, 8, 128256, 4.5)
    moe = replace(model, layer_experts=tuple(int(b * 0.95) for b in model.layer_bytes),
                  experts_active=8 / 128)  # fmt: skip
    d, m = alone(model, "Apple M4 Max", 64), alone(moe, "Apple M4 Max", 64)
    assert m.tps_1 > 3 * d.tps_1  # a token reads 1/16 of the experts (and all the rest)
    assert d.tps_streams / d.tps_1 > 4  # 8 streams read the dense weights once (each its own KV)
    assert 1 < m.tps_streams / m.tps_1 < d.tps_streams / d.tps_1
    assert "tok/s" in describe(m) and "first token of 2k" in describe(m)


def test_rdma_makes_a_tensor_group_pay_and_tcp_makes_it_lose() -> None:
    model = dense("d", 80, 8192, 28672, 64, 8, 128256, 8.5)
    nodes = [NodeBudget(n, 120 * GiB, 128 * GiB) for n in NAMES]
    chips = {n: chip_for("Apple M4 Max") for n in NAMES}

    def tps(links: list[Link], tensor: int) -> float:
        verdict = plan(model, nodes, links, tensor=tensor)
        assert isinstance(verdict, Plan)
        return forecast(model, verdict, chips, links).tps_1

    rdma, tcp = mesh(NAMES, True), mesh(NAMES, False)
    assert tps(rdma, 4) > 2.5 * tps(rdma, 1)
    assert tps(tcp, 4) < tps(tcp, 1)
    # A prompt: four nodes compute it together, the first token comes sooner (not 4×:
    # each all-reduce of a 512-token chunk carries 8 MB over the cable).
    one = forecast(model, plan(model, nodes, rdma), chips, rdma)  # type: ignore[arg-type]
    four = forecast(model, plan(model, nodes, rdma, tensor=4), chips, rdma)  # type: ignore[arg-type]
    assert four.ttft_ms < one.ttft_ms


# --------------------------------------------------------------------------- against figures


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelFacts]:
    root = tmp_path_factory.mktemp("seeds")
    return {
        name: read_model(seed_model(root, name, "8bit")).facts
        for name in ("qwen3-235b-a22b", "deepseek-v3.1")
    }


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> ModelFacts:
    """The bench's model: qwen2, 8 layers, hidden 256, float32 (its real files)."""
    spec = DemoSpec(arch="qwen2", layers=8, hidden=256, heads=8, kv_heads=4, dtype="float32")
    return read_model(write_demo_model(tmp_path_factory.mktemp("demo") / "bench", spec)).facts


def _four(model: ModelFacts, rdma: bool, tensor: int, streams: int = 8) -> Forecast:
    links = mesh(NAMES, rdma)
    verdict = plan(model, ULTRAS, links, tensor=tensor)
    assert isinstance(verdict, Plan), verdict
    return forecast(model, verdict, M3_ULTRA, links, streams=streams)


def _local(model: ModelFacts, shards: int, streams: int = 8, prompt: int = 128) -> Forecast:
    """The bench's runs: 256 tokens decoded after a short prompt, so ~128 tokens of
    context on average (`prompt` sets it), on 4 local nodes of one 2-vCPU machine."""
    nodes = [NodeBudget(f"local-{i}", 2 * GiB, 8 * GiB) for i in range(1, shards + 1)]
    names = [n.name for n in nodes]
    links = mesh(names, False, "loopback", 50.0)
    verdict = plan(model, nodes, links)
    assert isinstance(verdict, Plan)
    chips = {n: chip_for("AMD EPYC") for n in names}
    return forecast(model, verdict, chips, links, streams=streams, prompt_tokens=prompt)


Row = tuple[str, float, Callable[[dict[str, ModelFacts], ModelFacts], float]]
# (what, the published or measured figure, the forecast of it)
ROWS: list[Row] = [
    ("mlx-lm, Llama 3.1 70B bf16, 1 × M2 Ultra (calibrates the 0.85)", 4.7,
     lambda s, d: alone(dense("l", 80, 8192, 28672, 64, 8, 128256, 16), "M2 Ultra", 192).tps_1),
    ("mlx-lm, Qwen2.5-72B 6-bit, 1 × M4 Max (calibrates the 0.85)", 7.9,
     lambda s, d: alone(dense("q", 80, 8192, 29568, 64, 8, 152064, 6.5), "M4 Max", 128).tps_1),
    ("exo 1.0, Qwen3-235B-A22B 8-bit, 1 stage × 4 over RDMA", 31.9,
     lambda s, d: _four(s["qwen3-235b-a22b"], True, 4).tps_1),
    ("exo 1.0, DeepSeek V3.1 8-bit, 1 stage × 4 over RDMA", 32.5,
     lambda s, d: _four(s["deepseek-v3.1"], True, 4).tps_1),
    ("llama.cpp, Qwen3-235B-A22B 8-bit, 4 stages over TCP", 15.2,
     lambda s, d: _four(s["qwen3-235b-a22b"], False, 1).tps_1),
    ("llama.cpp, DeepSeek V3.1 8-bit, 4 stages over TCP", 14.6,
     lambda s, d: _four(s["deepseek-v3.1"], False, 1).tps_1),
    ("exo, 4 stages, 1 stream (Qwen3-235B 8-bit assumed)", 25.4,
     lambda s, d: _four(s["qwen3-235b-a22b"], False, 1).tps_1),
    ("exo, 4 stages, 16 streams (Qwen3-235B 8-bit assumed)", 69.1,
     lambda s, d: _four(s["qwen3-235b-a22b"], False, 1, streams=16).tps_streams),
    ("here: demo model, 1 node (calibrates the CPU dispatch cost)", 189.8,
     lambda s, d: _local(d, 1).tps_1),
    ("here: demo model, 2 stages", 190.2, lambda s, d: _local(d, 2).tps_1),
    ("here: demo model, 4 stages", 134.7, lambda s, d: _local(d, 4).tps_1),
    ("here: demo model, 2 stages, 4 streams (interleaved, not batched)", 273.0,
     lambda s, d: _local(d, 2, streams=4).tps_streams),
    ("here: demo model, first token of 512 (ms; calibrates the CPU compute)", 1744.0,
     lambda s, d: _local(d, 1, prompt=512).ttft_ms),
]  # fmt: skip


def table_line(what: str, figure: float, guess: float) -> str:
    error = (guess - figure) / figure * 100
    return f"| {what} | {figure:g} | {guess:.1f} | {error:+.0f} % |"


def test_the_docs_table_is_what_the_model_forecasts(
    seeds: dict[str, ModelFacts], demo: ModelFacts
) -> None:
    page = PLACING.read_text(encoding="utf-8")
    lines = [table_line(what, figure, guess(seeds, demo)) for what, figure, guess in ROWS]
    missing = [line for line in lines if line not in page]
    assert not missing, "docs/placing.md's forecast table differs; its rows are:\n" + "\n".join(
        lines
    )


def test_the_published_tensor_parallel_figures_are_within_ten_percent(
    seeds: dict[str, ModelFacts],
) -> None:
    # What the forecast is for: what a shape on Macs will do before buying cables.
    for name, published in (("qwen3-235b-a22b", 31.9), ("deepseek-v3.1", 32.5)):
        guess = _four(seeds[name], True, 4).tps_1
        assert abs(guess - published) / published < 0.10, (name, guess)
    # And exo's batched pipeline at 16 streams.
    many = _four(seeds["qwen3-235b-a22b"], False, 1, streams=16).tps_streams
    assert abs(many - 69.1) / 69.1 < 0.10, many


def test_the_chip_figures_are_positive_and_the_default_is_not_a_mac() -> None:
    assert all(gbs > 0 and tflops > 0 for gbs, tflops in CHIPS.values())
    assert not re.search(r"M\d", chip_for("").source)
    assert isinstance(chip_for(""), Chip)


def test_a_saved_benchmarks_measured_bandwidth_replaces_the_chip_table() -> None:
    from studiotui.core.benchmark import NodeFigures, Run, Sizes
    from studiotui.core.forecast import measured_bandwidths

    def run(cluster: str, *nodes: NodeFigures) -> Run:
        return Run("r", "2026-12-01T00:00:00Z", cluster, {}, "b", Sizes(), nodes=nodes)

    runs = [  # newest first, as benchmark.saved() lists them
        run("desk", NodeFigures("a", read_gbs=700.0), NodeFigures("b", error="crashed")),
        run("other", NodeFigures("b", read_gbs=1.0)),
        run("desk", NodeFigures("a", read_gbs=650.0), NodeFigures("b", read_gbs=520.0)),
    ]
    measured = measured_bandwidths(runs, "desk")
    assert measured == {"a": 700.0, "b": 520.0}
    state = ClusterState(
        nodes=(
            NodeState("a", "", 1, "ssh", chip="Apple M3 Ultra"),
            NodeState("b", "", 1, "ssh", chip="Apple M4 Max"),
            NodeState("c", "", 1, "ssh", chip="Apple M4 Max"),
        )
    )
    chips = chips_from_state(state, ["a", "b", "c"], measured)
    assert chips["a"].bandwidth_gbs == 700.0 and chips["a"].source == "measured 700 GB/s"
    assert chips["b"].bandwidth_gbs == 520.0
    assert chips["c"].bandwidth_gbs == 546.0 and chips["c"].source == "M4 Max (table)"


def test_the_batched_figure_is_for_the_streams_the_placement_admits() -> None:
    """The preview says "× 4 streams" for a placement's KV room: its forecast line
    gives the batched tok/s at those 4, and no batched figure for a one-stream one."""
    four = Forecast("2 stages", 30.0, 100.0, 2100.0, streams=4)
    assert "4 streams 100 tok/s" in describe(four)
    one = Forecast("2 stages", 30.0, 30.0, 2100.0, streams=1)
    assert "streams" not in describe(one) and "30.0 tok/s" in describe(one)


# --------------------------------------------------------------------------- after a benchmark


def test_a_rank_pays_the_part_of_a_layer_that_shrinks_with_its_slice() -> None:
    from studiotui.core.forecast import rank_share

    # Whole 1000 µs, a 2-way rank's slice 600: 200 of it does not shrink, 800 does.
    timed = {"dense": 1000.0, "dense_tp2": 600.0}
    assert rank_share(timed, 1) == 1.0
    assert rank_share(timed, 2) == pytest.approx(0.6)
    assert rank_share(timed, 4) == pytest.approx(0.2 + 0.8 / 4)
    # Not timed (an older run): the whole layer, as before.
    assert rank_share({"dense": 1000.0}, 2) == 1.0
    # Noise past either end: all of the layer fixed, or all of it shrinking.
    assert rank_share({"dense": 1000.0, "dense_tp2": 1200.0}, 2) == 1.0
    assert rank_share({"dense": 1000.0, "dense_tp2": 300.0}, 4) == pytest.approx(0.25)


def _benchmarked(names: list[str], latency: float, kind: str = "loopback") -> list:
    """A saved run that timed each node's decode step (a layer whole and as a 2-way
    rank's slice) and every link at `latency` µs, newest first."""
    from studiotui.core.benchmark import LinkFigures, NodeFigures, Run, Sizes

    decode = {"dense": 1000.0, "dense_tp2": 600.0, "step": 300.0}
    # Bandwidth and compute to spare: the measured layers are what a step costs.
    nodes = tuple(NodeFigures(n, read_gbs=400.0, gflops={"float32": 400.0}, decode_us=decode)
                  for n in names)  # fmt: skip
    links = tuple(
        LinkFigures(a, b, kind, latency, None, 10.0, 10.0)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    )
    return [Run("r", "2026-12-01T00:00:00Z", "desk", {}, "b", Sizes(), nodes=nodes, links=links)]


def test_after_a_benchmark_a_tensor_rank_pays_its_slice_and_the_links_it_measured(
    demo: ModelFacts,
) -> None:
    """A 2-node tensor group priced from a run: each rank pays its share of every
    layer's measured cost, and each of the 2 × layers all-reduces two rounds over the
    link the run measured (no link measured by the dashboard: the run's is used, not
    a default)."""
    from studiotui.core.forecast import ALLREDUCE_SYNC_US, with_benchmark

    names = ["local-1", "local-2"]
    nodes = [NodeBudget(n, 2 * GiB, 8 * GiB) for n in names]
    base = {n: chip_for("AMD EPYC") for n in names}
    verdict = plan(demo, nodes, [], tensor=2)
    assert isinstance(verdict, Plan)

    def per_token_us(latency: float) -> float:
        chips = with_benchmark(base, _benchmarked(names, latency), "desk")
        return 1e6 / forecast(demo, verdict, chips, [], streams=1).tps_1

    layers = demo.n_layers
    # Each rank: the step's own 300 µs and 8 layers at 0.6 of 1000 µs.
    compute = 300.0 + layers * 600.0
    fast, slow = per_token_us(100.0), per_token_us(300.0)
    # Two more rounds of 200 µs for each of the 2 × 8 all-reduces.
    assert slow - fast == pytest.approx(2 * layers * 2 * 200.0, rel=0.01)
    allreduce = ALLREDUCE_SYNC_US + 2 * 100.0
    assert fast == pytest.approx(compute + 2 * layers * allreduce, rel=0.02)
    # A link the dashboard measured is the one taken.
    chips = with_benchmark(base, _benchmarked(names, 300.0), "desk")
    measured = [Link("local-1", "local-2", 100.0, 10.0, "loopback")]
    at_100 = 1e6 / forecast(demo, verdict, chips, measured, streams=1).tps_1
    assert at_100 == pytest.approx(fast, rel=0.001)


def test_the_slice_a_benchmark_times_is_a_2_way_ranks_share_of_a_layer() -> None:
    """`dense_tp2` is a dense layer with half its heads, KV heads and MLP width, the
    hidden size and head width kept: what a rank of a 2-way group holds of it."""
    import mlx.core as mx

    from worker.device_bench import DECODE_KINDS, _decode_model

    assert DECODE_KINDS["dense_tp2"][2] == 2
    whole, half = (
        _decode_model("llama", 1, None, mx.float32, cut).model.layers[0] for cut in (1, 2)
    )

    def shape(layer: Any, path: str) -> tuple[int, ...]:
        for part in path.split("."):
            layer = getattr(layer, part)
        # On a CPU the shard's fusions wrap each projection (its `plain` Linear inside).
        return tuple(getattr(layer, "plain", layer).weight.shape)

    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj"):
        (rows, cols), (half_rows, half_cols) = shape(whole, name), shape(half, name)
        assert (half_rows * 2, half_cols) == (rows, cols), name
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        (rows, cols), (half_rows, half_cols) = shape(whole, name), shape(half, name)
        assert (half_rows, half_cols * 2) == (rows, cols), name
