"""The placement planner: properties over random clusters, and worked examples."""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table
from rich.text import Text

from studiotui.core.placement import (
    Link,
    ModelFacts,
    NodeBudget,
    Plan,
    Refusal,
    TensorFacts,
    context_beyond,
    facts_from_config,
    format_bytes,
    kv_bytes_per_token,
    longest_context,
    plan,
    plan_to_dict,
    reserve_bytes,
    trained_positions,
    with_adapter,
    with_prompt_cache,
)
from studiotui.views.plan import render_plan

GB = 1024**3
MB = 1024**2
KINDS = ("thunderbolt", "ethernet", "wifi", "loopback", "unknown")


# --------------------------------------------------------------------------- helpers


def model_of(
    layers: list[int], embed: int = 0, head: int = 0, kv: int = 0, name: str = "m"
) -> ModelFacts:
    return ModelFacts(name, "llama", len(layers), tuple(layers), embed, head, kv)


def node(name: str, free: int, total: int | None = None) -> NodeBudget:
    return NodeBudget(name, free, free if total is None else total)


def tb(a: str, b: str, us: float = 30.0) -> Link:
    return Link(a, b, us, 40.0, "thunderbolt")


def eth(a: str, b: str, us: float = 250.0) -> Link:
    return Link(a, b, us, 10.0, "ethernet")


def ring_pairs(p: Plan) -> set[frozenset[str]]:
    names = [s.node for s in p.shards]
    return {frozenset(pair) for pair in zip(names, names[1:] + names[:1], strict=True)}


def fits_somehow(
    model: ModelFacts, nodes: list[NodeBudget], context: int, streams: int, reserve: float
) -> bool:
    """Brute force: does any node order and any contiguous cut fit every budget?"""
    kv_layer = model.kv_bytes_per_token * context * streams
    n, layers = len(nodes), model.n_layers
    for order in itertools.permutations(nodes):
        for inner in itertools.combinations(range(1, layers), n - 1):
            cuts = (0, *inner, layers)
            if all(
                shard_need(model, cuts, i, kv_layer) <= room(order[i], reserve) for i in range(n)
            ):
                return True
    return False


def shard_need(model: ModelFacts, cuts: tuple[int, ...], i: int, kv_layer: int) -> int:
    n = len(cuts) - 1
    fixed = (model.embed_bytes if i == 0 else 0) + (model.head_bytes if i == n - 1 else 0)
    return (
        sum(model.layer_bytes[cuts[i] : cuts[i + 1]]) + kv_layer * (cuts[i + 1] - cuts[i]) + fixed
    )


def room(n: NodeBudget, reserve: float) -> int:
    return n.free_bytes - reserve_bytes(n, reserve)


def check_plan(
    p: Plan, model: ModelFacts, nodes: list[NodeBudget], context: int, streams: int, reserve: float
) -> None:
    by_name = {n.name: n for n in nodes}
    assert sorted(s.node for s in p.shards) == sorted(by_name)
    # Contiguous, in ring order, every layer exactly once, none empty.
    assert p.shards[0].start == 0
    assert p.shards[-1].end == model.n_layers
    for before, after in itertools.pairwise(p.shards):
        assert before.end == after.start
    assert all(s.end > s.start for s in p.shards)
    kv_layer = model.kv_bytes_per_token * context * streams
    cuts = (*(s.start for s in p.shards), model.n_layers)
    for i, s in enumerate(p.shards):
        budget = by_name[s.node]
        assert s.weight_bytes + s.kv_bytes == shard_need(model, cuts, i, kv_layer)
        assert s.kv_bytes == kv_layer * (s.end - s.start)
        assert s.free_before == budget.free_bytes
        assert s.free_after == budget.free_bytes - s.weight_bytes - s.kv_bytes
        assert s.free_after >= 0
        assert s.free_after >= reserve_bytes(budget, reserve)
    assert p.total_bytes == sum(s.weight_bytes + s.kv_bytes for s in p.shards)
    assert p.context_tokens == context


# --------------------------------------------------------------------------- strategies

LINK_FACTS = st.tuples(
    st.none() | st.floats(1.0, 5000.0),
    st.none() | st.floats(0.1, 100.0),
    st.sampled_from(KINDS),
)


@st.composite
def budgets(draw: st.DrawFn, names: list[str], need: int) -> list[NodeBudget]:
    # Around a fair share each, so the group is about as often short as roomy.
    out = []
    for name in names:
        percent = draw(st.integers(0, 300))
        free = need * percent // (100 * len(names)) + draw(st.integers(0, 100))
        out.append(NodeBudget(name, free, free + draw(st.integers(0, free // 4))))
    return out


@st.composite
def links_between(draw: st.DrawFn, names: list[str]) -> list[Link]:
    pairs = list(itertools.combinations(names, 2))
    if not pairs:
        return []
    chosen = draw(st.lists(st.tuples(st.sampled_from(pairs), LINK_FACTS), max_size=12))
    return [Link(a, b, *facts) for (a, b), facts in chosen]


@st.composite
def clusters(draw: st.DrawFn, max_nodes: int = 5, max_layers: int = 16) -> tuple:
    layers = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=max_layers))
    model = model_of(
        layers,
        embed=draw(st.integers(0, 2000)),
        head=draw(st.integers(0, 2000)),
        kv=draw(st.integers(0, 8)),
    )
    names = draw(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=max_nodes, unique=True))
    context = draw(st.integers(1, 64))
    streams = draw(st.integers(1, 3))
    need = (
        sum(layers)
        + model.embed_bytes
        + model.head_bytes
        + model.kv_bytes_per_token * context * streams * len(layers)
    )
    nodes = draw(budgets(names, need))
    links = draw(links_between(names))
    reserve = draw(st.sampled_from([0.0, 0.05, 0.2]))
    return model, nodes, links, context, streams, reserve


def run(case: tuple) -> Plan | Refusal:
    model, nodes, links, context, streams, reserve = case
    return plan(
        model, nodes, links, context_tokens=context, streams=streams, reserve_fraction=reserve
    )


# --------------------------------------------------------------------------- properties


@settings(max_examples=120, deadline=None)
@given(clusters())
def test_every_plan_covers_each_layer_once_within_budget(case: tuple) -> None:
    result = run(case)
    if isinstance(result, Plan):
        model, nodes, _, context, streams, reserve = case
        check_plan(result, model, nodes, context, streams, reserve)
    else:
        assert result.reason


@settings(max_examples=80, deadline=None)
@given(clusters(), st.randoms(use_true_random=False))
def test_same_input_same_plan_whatever_the_listing_order(case: tuple, rnd: random.Random) -> None:
    model, nodes, links, context, streams, reserve = case
    shuffled_nodes, shuffled_links = list(nodes), list(links)
    rnd.shuffle(shuffled_nodes)
    rnd.shuffle(shuffled_links)
    flipped = [Link(lk.b, lk.a, lk.latency_us, lk.gbps, lk.kind) for lk in shuffled_links]
    first = run(case)
    assert run(case) == first
    again = plan(
        model,
        shuffled_nodes,
        shuffled_links,
        context_tokens=context,
        streams=streams,
        reserve_fraction=reserve,
    )
    assert again == first
    # Which way round a link was reported does not move the ring, only how it is named.
    reversed_links = plan(
        model, nodes, flipped, context_tokens=context, streams=streams, reserve_fraction=reserve
    )
    assert type(reversed_links) is type(first)
    if isinstance(first, Plan):
        assert [s.node for s in reversed_links.shards] == [s.node for s in first.shards]


@settings(max_examples=120, deadline=None)
@given(clusters(max_nodes=3, max_layers=7))
def test_refuses_only_when_nothing_fits(case: tuple) -> None:
    # With three nodes or fewer every order is a rotation or reflection of one ring,
    # so the planner sees every order there is and must agree with brute force.
    model, nodes, _, context, streams, reserve = case
    result = run(case)
    if len(nodes) > model.n_layers:
        assert isinstance(result, Refusal)
        return
    assert isinstance(result, Plan) == fits_somehow(model, nodes, context, streams, reserve)


@settings(max_examples=60, deadline=None)
@given(clusters())
def test_room_for_everything_everywhere_always_fits(case: tuple) -> None:
    model, nodes, links, context, streams, _ = case
    need = (
        sum(model.layer_bytes)
        + model.embed_bytes
        + model.head_bytes
        + model.kv_bytes_per_token * context * streams * model.n_layers
    )
    roomy = [NodeBudget(n.name, need + n.total_bytes, need + n.total_bytes) for n in nodes]
    result = plan(model, roomy, links, context_tokens=context, streams=streams, reserve_fraction=0)
    if len(nodes) <= model.n_layers:
        assert isinstance(result, Plan)


@settings(max_examples=40, deadline=None)
@given(clusters())
def test_output_forms(case: tuple) -> None:
    result = run(case)
    data = plan_to_dict(result)
    assert json.loads(json.dumps(data)) == data
    shown = render_plan(result)
    assert isinstance(shown, Table if isinstance(result, Plan) else Text)


# --------------------------------------------------------------------------- the seed cluster

# DeepSeek V3 at 8 bit: 3 dense layers, 58 MoE layers, ~700 GB in all.
DEEPSEEK = ModelFacts(
    name="DeepSeek-V3-8bit",
    family="deepseek_v3",
    n_layers=61,
    layer_bytes=(620_000_000,) * 3 + (12_000_000_000,) * 58,
    embed_bytes=980_000_000,
    head_bytes=980_000_000,
    kv_bytes_per_token=70_000,
    dtype="bfloat16",
    quantization="8-bit",
)
STUDIOS = [
    NodeBudget("studio-1", 500 * GB, 512 * GB),
    NodeBudget("studio-2", 500 * GB, 512 * GB),
    NodeBudget("studio-3", 245 * GB, 256 * GB),
    NodeBudget("studio-4", 245 * GB, 256 * GB),
]
MESH = [tb(a.name, b.name) for a, b in itertools.combinations(STUDIOS, 2)]


def test_seed_cluster_fits_deepseek_over_four_studios() -> None:
    result = plan(DEEPSEEK, STUDIOS, MESH)
    assert isinstance(result, Plan)
    check_plan(result, DEEPSEEK, STUDIOS, 4096, 1, 0.05)
    layers = {s.node: s.end - s.start for s in result.shards}
    assert min(layers["studio-1"], layers["studio-2"]) > max(layers["studio-3"], layers["studio-4"])
    assert result.slowest_link is not None
    assert result.slowest_link.kind == "thunderbolt"


def test_seed_cluster_refuses_deepseek_on_the_two_small_studios() -> None:
    small = STUDIOS[2:]
    result = plan(DEEPSEEK, small, MESH)
    assert isinstance(result, Refusal)
    need = (
        sum(DEEPSEEK.layer_bytes)
        + DEEPSEEK.embed_bytes
        + DEEPSEEK.head_bytes
        + DEEPSEEK.kv_bytes_per_token * 4096 * 61
    )
    have = sum(n.free_bytes - reserve_bytes(n, 0.05) for n in small)
    assert f"needs {need / GB:.1f} GB" in result.reason
    assert f"has {have / GB:.1f} GB free" in result.reason
    assert f"at least {(need - have) / GB:.1f} GB" in result.reason
    assert "4-bit" in result.reason


def test_seed_cluster_preview_shows_every_node_and_the_ring() -> None:
    result = plan(DEEPSEEK, STUDIOS, MESH)
    console = Console(record=True, width=140)
    console.print(render_plan(result))
    text = console.export_text()
    for studio in STUDIOS:
        assert studio.name in text
    assert "slowest link" in text
    assert "thunderbolt" in text
    assert "+embed" in text and "+head" in text


def test_the_preview_keeps_figures_and_names_whole_at_80_columns() -> None:
    """`place` at 80 columns broke "245.0 GB" over two lines and cut every node to
    "studio…" once the prompt cache's two columns were there."""
    result = plan(DEEPSEEK, STUDIOS, MESH)
    assert isinstance(result, Plan)
    shards = tuple(
        replace(s, prompt_cache_bytes=32 << 20, prompt_cache_disk_bytes=128 << 20)
        for s in result.shards
    )
    console = Console(record=True, width=80)
    console.print(render_plan(replace(result, shards=shards)))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "…" not in text, text
    for s in shards:
        for figure in (s.weight_bytes, s.free_before, s.free_after):
            assert format_bytes(figure) in text, (format_bytes(figure), text)


# --------------------------------------------------------------------------- worked examples


def test_seven_layers_over_three_equal_nodes() -> None:
    nodes = [node(n, 100) for n in "abc"]
    result = plan(model_of([10] * 7), nodes, reserve_fraction=0)
    assert isinstance(result, Plan)
    assert sorted(s.end - s.start for s in result.shards) == [2, 2, 3]
    check_plan(result, model_of([10] * 7), nodes, 4096, 1, 0)


def test_a_small_node_gets_fewer_layers() -> None:
    model = model_of([10] * 20)
    nodes = [node("big-a", 1000), node("big-b", 1000), node("small", 250)]
    result = plan(model, nodes, reserve_fraction=0)
    assert isinstance(result, Plan)
    layers = {s.node: s.end - s.start for s in result.shards}
    assert layers["small"] < layers["big-a"]
    assert layers["small"] < layers["big-b"]
    # In proportion to free memory: 1000:1000:250 of 20 layers is 8.9:8.9:2.2.
    assert layers["small"] == 2


def test_an_overflowing_share_moves_to_nodes_with_room() -> None:
    # The embedding eats most of whichever node heads the ring, so the planner must
    # both pick a roomy head and move layers off the node the embedding squeezes.
    model = model_of([10] * 10, embed=400)
    nodes = [node("a", 450), node("b", 200), node("c", 200)]
    result = plan(model, nodes, reserve_fraction=0)
    assert isinstance(result, Plan)
    check_plan(result, model, nodes, 4096, 1, 0)
    assert result.shards[0].node == "a"


def test_ring_follows_thunderbolt_over_ethernet() -> None:
    names = ["a", "b", "c", "d"]
    cabled = [("a", "c"), ("c", "b"), ("b", "d"), ("d", "a")]
    links = [eth(a, b) for a, b in itertools.combinations(names, 2)] + [tb(a, b) for a, b in cabled]
    result = plan(model_of([10] * 8), [node(n, 1000) for n in names], links)
    assert isinstance(result, Plan)
    assert ring_pairs(result) == {frozenset(p) for p in cabled}
    assert result.slowest_link is not None
    assert result.slowest_link.kind == "thunderbolt"


def test_ring_prefers_a_slow_known_link_to_an_unknown_one() -> None:
    names = ["a", "b", "c"]
    links = [tb("a", "b"), Link("b", "c", None, None, "unknown"), eth("a", "c"), eth("b", "c")]
    result = plan(model_of([1] * 3), [node(n, 100) for n in names], links)
    assert isinstance(result, Plan)
    assert result.slowest_link is not None
    assert result.slowest_link.kind == "ethernet"


def test_unmeasured_thunderbolt_beats_unmeasured_ethernet() -> None:
    names = ["a", "b", "c", "d"]
    cabled = [("a", "b"), ("b", "d"), ("d", "c"), ("c", "a")]
    links = [Link(a, b, None, None, "ethernet") for a, b in itertools.combinations(names, 2)]
    links += [Link(a, b, None, None, "thunderbolt") for a, b in cabled]
    result = plan(model_of([1] * 4), [node(n, 100) for n in names], links)
    assert isinstance(result, Plan)
    assert ring_pairs(result) == {frozenset(p) for p in cabled}


def test_beyond_eight_nodes_the_ring_walks_the_cables() -> None:
    names = [f"n{i}" for i in range(10)]
    cable_order = ["n0", "n7", "n3", "n9", "n1", "n5", "n8", "n2", "n6", "n4"]
    cabled = list(zip(cable_order, cable_order[1:] + cable_order[:1], strict=True))
    links = [eth(a, b) for a, b in itertools.combinations(names, 2)] + [tb(a, b) for a, b in cabled]
    result = plan(model_of([1] * 20), [node(n, 100) for n in names], links)
    assert isinstance(result, Plan)
    assert ring_pairs(result) == {frozenset(p) for p in cabled}


def test_one_node_holds_everything() -> None:
    model = model_of([5] * 4, embed=7, head=3, kv=1)
    result = plan(model, [node("solo", 1000)], context_tokens=2, reserve_fraction=0)
    assert isinstance(result, Plan)
    (shard,) = result.shards
    assert (shard.start, shard.end) == (0, 4)
    assert shard.weight_bytes == 20 + 7 + 3
    assert shard.kv_bytes == 4 * 2
    assert result.slowest_link is None


def test_kv_cache_scales_with_context_and_streams() -> None:
    model = model_of([100] * 4, kv=2)
    nodes = [node("a", 10_000), node("b", 10_000)]
    one = plan(model, nodes, context_tokens=10, streams=1, reserve_fraction=0)
    three = plan(model, nodes, context_tokens=10, streams=3, reserve_fraction=0)
    assert isinstance(one, Plan) and isinstance(three, Plan)
    assert sum(s.kv_bytes for s in one.shards) == 2 * 10 * 4
    assert sum(s.kv_bytes for s in three.shards) == 3 * 2 * 10 * 4


# --------------------------------------------------------------------------- refusals


def test_an_exact_fit_fits() -> None:
    model = model_of([5, 5, 5, 5], embed=1, head=2)
    result = plan(model, [node("a", 11), node("b", 12)], reserve_fraction=0)
    assert isinstance(result, Plan)
    assert [s.free_after for s in result.shards] == [0, 0]


def test_refuses_when_the_total_fits_but_no_cut_does() -> None:
    # 20 bytes of layers on 11 + 9 free: enough in sum, but a 5-byte layer cannot be split.
    model = model_of([5, 5, 5, 5])
    result = plan(model, [node("a", 11), node("b", 9)], reserve_fraction=0)
    assert isinstance(result, Refusal)
    assert "cannot be cut into contiguous ranges" in result.reason


def test_refuses_an_empty_group() -> None:
    result = plan(model_of([1]), [])
    assert isinstance(result, Refusal)
    assert "empty" in result.reason


def test_refuses_duplicate_names() -> None:
    result = plan(model_of([1, 1]), [node("a", 100), node("a", 100)])
    assert isinstance(result, Refusal)
    assert "a more than once" in result.reason


def test_refuses_more_nodes_than_layers() -> None:
    result = plan(model_of([1, 1]), [node(n, 100) for n in "abc"])
    assert isinstance(result, Refusal)
    assert "2 layers" in result.reason and "3 nodes" in result.reason


def test_refusal_names_a_node_too_small_for_one_layer() -> None:
    model = model_of([GB] * 4)
    nodes = [node("roomy", 10 * GB), node("tiny", GB // 2)]
    result = plan(model, nodes, reserve_fraction=0)
    assert isinstance(result, Refusal)
    assert "tiny 0.5 GB" in result.reason
    assert "1.0 GB" in result.reason
    assert "roomy" not in result.reason


def test_refusal_suggests_a_shorter_context_when_the_cache_is_the_problem() -> None:
    model = model_of([GB] * 4, kv=1024 * 1024)
    result = plan(model, [node("a", 6 * GB)], context_tokens=4096, reserve_fraction=0)
    assert isinstance(result, Refusal)
    assert "shorten the context to 512 tokens" in result.reason


def test_refusal_preview_is_red_text() -> None:
    shown = render_plan(Refusal("no room"))
    assert isinstance(shown, Text)
    assert "no room" in shown.plain


def test_plan_to_dict() -> None:
    result = plan(DEEPSEEK, STUDIOS, MESH)
    data = plan_to_dict(result)
    assert data["ok"] is True
    assert data["ring"] == [s.node for s in result.shards]
    assert data["shards"][0]["start"] == 0
    assert data["slowest_link"]["kind"] == "thunderbolt"
    assert plan_to_dict(Refusal("why")) == {"ok": False, "reason": "why"}


# --------------------------------------------------------------------------- helpers


def test_format_bytes() -> None:
    assert format_bytes(3 * GB // 2) == "1.5 GB"
    assert format_bytes(512 * 1024 * 1024) == "512 MB"
    assert format_bytes(2048) == "2 KB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(-GB) == "-1.0 GB"


def test_refusals_on_small_nodes_still_tell_their_numbers_apart() -> None:
    # Two simulated 0.3 GB nodes: "needs 0.2 GB, has 0.2 GB" would say nothing.
    model = model_of([GB // 5] * 4)
    result = plan(model, [node("a", GB // 4), node("b", GB // 4)], reserve_fraction=0.1)
    assert isinstance(result, Refusal)
    figures = re.findall(r"(\d+(?:\.\d+)?) GB", result.reason)
    assert "0.8" in figures and "0.45" in figures, result.reason


def test_facts_from_config_llama_like() -> None:
    config = {
        "model_type": "llama",
        "num_hidden_layers": 3,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "torch_dtype": "bfloat16",
        "quantization": {"group_size": 64, "bits": 4},
    }
    facts = facts_from_config(config, [100, 100, 100], 50, 60, "tiny-llama")
    assert facts.kv_bytes_per_token == 2 * 8 * 128 * 2
    assert facts.n_layers == 3
    assert facts.family == "llama"
    assert facts.quantization == "4-bit"
    assert facts.dtype == "bfloat16"
    assert (facts.embed_bytes, facts.head_bytes) == (50, 60)


def test_facts_from_config_defaults_and_explicit_head_dim() -> None:
    # No KV heads: every head has its own K and V; no dtype: float32.
    assert kv_bytes_per_token({"num_attention_heads": 4, "hidden_size": 64}) == 2 * 4 * 16 * 4
    qwen3 = {"num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 1024}
    assert (
        kv_bytes_per_token({**qwen3, "head_dim": 128, "torch_dtype": "float16"}) == 2 * 8 * 128 * 2
    )


def test_facts_from_config_reads_a_nested_text_config() -> None:
    config = {
        "model_type": "gemma3",
        "text_config": {
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_size": 2560,
            "torch_dtype": "bfloat16",
        },
    }
    facts = facts_from_config(config, [1, 1], 0, 0, "g")
    assert facts.n_layers == 2
    assert facts.kv_bytes_per_token == 2 * 4 * 256 * 2


def test_facts_from_config_rejects_a_wrong_layer_count() -> None:
    config = {"num_hidden_layers": 3, "num_attention_heads": 4, "hidden_size": 64}
    try:
        facts_from_config(config, [1, 1], 0, 0, "m")
    except ValueError as err:
        assert "2 layer sizes for 3 layers" in str(err)
    else:
        raise AssertionError("a wrong layer count must be rejected")


# --------------------------------------------------------------------------- caches per layer


def test_each_shard_pays_the_caches_of_its_own_layers() -> None:
    from studiotui.core.kv_sizes import LayerKV

    # gpt-oss-like: sliding layers stop at 128 tokens, full ones grow; a linear
    # layer's state is fixed. The KV a shard pays is the sum over its layers.
    kinds = (LayerKV(1000, window=128), LayerKV(1000), LayerKV(0, fixed=5 * 10**6)) * 4
    facts = ModelFacts("hybrid", "gpt_oss", 12, (10**9,) * 12, 0, 0, 1000, layer_kv=kinds)
    context, streams = 65_536, 2
    result = plan(facts, [node("a", 40 * GB), node("b", 40 * GB)], context_tokens=context,
                  streams=streams)  # fmt: skip
    assert isinstance(result, Plan)
    for s in result.shards:
        want = sum(kinds[i].bytes_for(context) * streams for i in range(s.start, s.end))
        assert s.kv_bytes == want
    assert sum(s.kv_bytes for s in result.shards) == streams * 4 * (
        1000 * 128 + 1000 * context + 5 * 10**6
    )


def test_a_shorter_context_is_suggested_from_the_real_cache_growth() -> None:
    from studiotui.core.kv_sizes import LayerKV

    # Half the layers stop at a 1024-token window: the context that fits is found on
    # the real curve, not by dividing by a per-token figure of every layer.
    kinds = (LayerKV(10**6, window=1024), LayerKV(10**6)) * 2
    facts = ModelFacts("w", "gemma3_text", 4, (GB,) * 4, 0, 0, 10**6, layer_kv=kinds)
    room = 4 * GB + 2 * 1024 * 10**6 + 2 * 50_000 * 10**6  # weights + windows + 50k tokens
    result = plan(facts, [node("a", room, room)], context_tokens=200_000, reserve_fraction=0.0)
    assert isinstance(result, Refusal)
    assert "shorten the context to 50000 tokens" in result.reason


def test_a_mixed_precision_conversion_is_named_so() -> None:
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "quantization": {
            "group_size": 64,
            "bits": 4,
            "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
            "model.layers.1.self_attn.v_proj": {"group_size": 32, "bits": 6},
        },
    }
    facts = facts_from_config(config, [1, 1], 0, 0, "mixed")
    assert facts.quantization == "mixed 4/6/8-bit"
    # Its smallest width is 4 bits: no "use a 4-bit copy" when it does not fit.
    refused = plan(facts, [node("a", 10)], context_tokens=10**6)
    assert isinstance(refused, Refusal) and "4-bit copy" not in refused.reason
    plain = facts_from_config({**config, "quantization": {"group_size": 64, "bits": 8}},
                              [1, 1], 0, 0, "p")  # fmt: skip
    assert plain.quantization == "8-bit"


# --------------------------------------------------------------------------- adapters


def test_an_adapter_counts_on_the_shard_holding_its_layers() -> None:
    model = with_adapter(model_of([10 * MB] * 4, embed=MB, head=MB), [0, 0, 3 * MB, 5 * MB])
    p = plan(model, [node("a", 100 * MB), node("b", 100 * MB)], [tb("a", "b")], reserve_fraction=0)
    assert isinstance(p, Plan)
    for s in p.shards:
        share = sum(model.layer_adapter[s.start : s.end])
        assert s.adapter_bytes == share
        assert s.free_after == s.free_before - s.weight_bytes - share - s.kv_bytes
    assert sum(s.adapter_bytes for s in p.shards) == 8 * MB
    assert p.total_bytes == model.weight_bytes + 8 * MB
    # The preview and `place --dry-run` show each shard's share; --json carries it.
    table = render_plan(p)
    assert isinstance(table, Table)
    assert [c.header for c in table.columns][2:4] == ["weights", "adapter"]
    shards = plan_to_dict(p)["shards"]
    assert sorted(s["adapter_bytes"] for s in shards) == [0, 8 * MB]


def test_an_adapter_moves_layers_off_the_node_it_would_overfill() -> None:
    # Without the adapter the split is 2 + 2; with 3 MB of adapter on every layer two
    # layers (26 MB) no longer fit a 25 MB node, so it gets one and the other node three.
    bare = model_of([10 * MB] * 4)
    model = with_adapter(bare, [3 * MB] * 4)
    nodes = [node("a", 25 * MB), node("b", 40 * MB)]
    before = plan(bare, nodes, [tb("a", "b")], reserve_fraction=0)
    after = plan(model, nodes, [tb("a", "b")], reserve_fraction=0)
    assert isinstance(before, Plan) and isinstance(after, Plan)
    assert all(s.end - s.start == 2 for s in before.shards)
    assert all(s.free_after >= 0 for s in after.shards)
    assert {s.node: s.end - s.start for s in after.shards} == {"a": 1, "b": 3}


def test_an_adapter_that_does_not_fit_is_refused_naming_the_node_and_shortfall() -> None:
    # One node: the model fits with 4 MB to spare; its adapter needs 7 MB on layer 3.
    model = with_adapter(model_of([10 * MB] * 4), [0, 0, 0, 7 * MB])
    p = plan(model, [node("studio-1", 44 * MB)], reserve_fraction=0)
    assert isinstance(p, Refusal)
    assert "fits these nodes without its adapter but not with it" in p.reason
    assert "studio-1 would hold layers 0–3 and 0.0068 GB of adapter tensors" in p.reason
    # 7 MB of adapter, 4 MB of room: 3 MB short.
    assert "0.0029 GB more than it has free after the reserve" in p.reason
    # Without the adapter it fits: the refusal is the adapter's.
    assert isinstance(plan(replace(model, layer_adapter=()), [node("studio-1", 44 * MB)]), Plan)
    # A model too big even without its adapter keeps the planner's own words.
    big = plan(model, [node("studio-1", 30 * MB)], reserve_fraction=0)
    assert isinstance(big, Refusal) and "without its adapter" not in big.reason


def test_an_adapter_is_planned_as_a_pipeline_only() -> None:
    model = with_adapter(model_of([10 * MB] * 4), [MB] * 4)
    tensor = replace(model, tensor=TensorFacts((("heads", 4),), (5 * MB,) * 4))
    nodes = [node("a", GB), node("b", GB)]
    refused = plan(tensor, nodes, [tb("a", "b")], tensor=2)
    assert isinstance(refused, Refusal) and "pipeline stages" in refused.reason
    assert isinstance(plan(tensor, nodes, [tb("a", "b")]), Plan)


def test_adapter_sizes_must_match_the_layers() -> None:
    with pytest.raises(ValueError, match="2 adapter sizes for 4"):
        with_adapter(model_of([MB] * 4), [MB, MB])


def test_trained_positions_and_a_context_beyond_them() -> None:
    assert trained_positions({"max_position_embeddings": 40960}) == 40960
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert trained_positions({"max_position_embeddings": 40960, "rope_scaling": yarn}) == 131072
    assert trained_positions({"rope_scaling": {"factor": 8.0}}) == 0  # nothing to stretch
    assert trained_positions({"max_position_embeddings": True}) == 0
    facts = ModelFacts("m", "llama", 1, (1,), 1, 1, 1, max_positions=4096)
    assert context_beyond(facts, 4096) == ""
    said = context_beyond(facts, 8192)
    assert "8192 tokens of context is beyond the 4096 positions m was trained for" in said
    assert "--context 4096 or less" in said
    assert context_beyond(ModelFacts("m", "llama", 1, (1,), 1, 1, 1), 10**6) == ""


def test_the_prompt_cache_budget_is_split_as_the_kv_and_bounded() -> None:
    """A placement-wide budget goes to each shard in proportion to its KV, comes off its
    node's free memory, and one a node cannot hold is refused with what fits; without
    one, each shard takes at most half of what its node has left and four contexts' KV."""
    model = model_of([GB] * 4, kv=1024)  # 1 KB a token a layer
    p = plan(model, [node("a", 20 * GB), node("b", 20 * GB)], [tb("a", "b")], context_tokens=4096)
    assert isinstance(p, Plan)
    kv = [s.kv_bytes for s in p.shards]
    given = with_prompt_cache(p, 2 * GB, 8 * GB)
    assert isinstance(given, Plan)
    assert [s.prompt_cache_bytes for s in given.shards] == [2 * GB * k // sum(kv) for k in kv]
    assert [s.prompt_cache_disk_bytes for s in given.shards] == [8 * GB * k // sum(kv) for k in kv]
    assert [s.free_after for s in given.shards] == [
        s.free_after - c.prompt_cache_bytes for s, c in zip(p.shards, given.shards, strict=True)
    ]
    assert given.total_bytes == p.total_bytes + sum(s.prompt_cache_bytes for s in given.shards)
    shown = plan_to_dict(given)["shards"][0]
    assert shown["prompt_cache_bytes"] == given.shards[0].prompt_cache_bytes
    refused = with_prompt_cache(p, 100 * GB, None)
    assert isinstance(refused, Refusal)
    assert "a prompt cache of 100.0 GB does not fit" in refused.reason
    most = float(refused.reason.rsplit("--prompt-cache ", 1)[1].split()[0])
    assert isinstance(with_prompt_cache(p, int(most * GB), None), Plan)
    default = with_prompt_cache(p, None, None)
    assert isinstance(default, Plan)
    for before, s in zip(p.shards, default.shards, strict=True):
        assert s.prompt_cache_bytes == min(before.free_after // 2, 4 * before.kv_bytes)
        assert s.prompt_cache_disk_bytes == 4 * s.prompt_cache_bytes
    # With streams, four whole contexts of one stream's KV.
    two = plan(model, [node("a", 20 * GB)], context_tokens=4096, streams=2)
    assert isinstance(two, Plan)
    cached = with_prompt_cache(two, None, None)
    assert isinstance(cached, Plan)
    assert cached.shards[0].prompt_cache_bytes == 2 * two.shards[0].kv_bytes
    assert all(s.prompt_cache_bytes == 0 for s in with_prompt_cache(p, 0, 0).shards)  # type: ignore[union-attr]


def test_the_longest_context_is_the_last_one_planned() -> None:
    model = model_of([GB] * 4, kv=1024)
    nodes = [node("a", 10 * GB)]
    most = longest_context(model, nodes, reserve_fraction=0.0)
    assert isinstance(plan(model, nodes, context_tokens=most, reserve_fraction=0.0), Plan)
    assert isinstance(plan(model, nodes, context_tokens=most + 1, reserve_fraction=0.0), Refusal)
    assert longest_context(model, [node("a", GB)]) == 0
