"""Shapes: a pipeline of stages where a stage may be a tensor group of N nodes.

The seeds' models (header-only safetensors of the published Qwen3-235B-A22B,
DeepSeek-V3.1, gpt-oss-120b, written by mlx-lm's own classes: tests/support/seed_models.py)
on the four 512 GB Mac Studios of the articles, and what mlx-lm's own `shard()`
methods decide: which families can be cut, which sizes divide, what is cut.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)
from mlx.utils import tree_flatten
from mlx_lm.utils import MODEL_REMAPPING

from studiotui.core import model_facts
from studiotui.core.forecast import chip_for, choose
from studiotui.core.model_facts import ModelInfo, read_model
from studiotui.core.placement import (
    Link,
    NodeBudget,
    Plan,
    Refusal,
    backend_for,
    plan,
    plan_to_dict,
    tensor_refusal,
    tensor_sizes,
)
from studiotui.core.state import (
    PlacementState,
    PlannedPlacement,
    PlannedShard,
    shape_label,
)
from studiotui.views.plan import render_plan
from tests.support.seed_models import seed_model
from worker.shared.demo_model import DemoSpec, build_model, make_config, write_demo_model
from worker.shared.model_support import FAMILIES

GiB = 1024**3
FOUR = [NodeBudget(f"studio-{i}", 504 * GiB, 512 * GiB) for i in range(1, 5)]
NAMES = [n.name for n in FOUR]


def mesh(rdma: bool, kind: str = "thunderbolt", latency: float = 150.0) -> list[Link]:
    return [
        Link(a, b, latency, 40.0, kind, rdma) for i, a in enumerate(NAMES) for b in NAMES[i + 1 :]
    ]


M3_ULTRA = {n: chip_for("Apple M3 Ultra") for n in NAMES}


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelInfo]:
    root = tmp_path_factory.mktemp("seeds")
    pairs = [("qwen3-235b-a22b", "8bit"), ("deepseek-v3.1", "8bit"), ("gpt-oss-120b", "mxfp4")]
    return {name: read_model(seed_model(root, name, quant)) for name, quant in pairs}


# --------------------------------------------------------------------------- what mlx-lm cuts


def test_the_tensor_families_are_the_supported_ones_whose_mlx_lm_class_has_shard() -> None:
    with_shard = {
        family
        for family in FAMILIES
        if hasattr(
            importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(family, family)}").Model,
            "shard",
        )
    }
    assert with_shard == model_facts.TENSOR_FAMILIES


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_split_names_are_the_layers_shard_linear_cuts(arch: str) -> None:
    """mlx-lm's own shard() on a group of one: every layer it turns into a sharded
    linear is one the planner counts as cut (and the other way round, apart from
    what shard_inplace cuts without changing the class: experts, shared experts)."""
    spec = DemoSpec(arch=arch, layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32")
    model = build_model(make_config(spec))
    model.shard(mx.distributed.init())
    sharded = (
        AllToShardedLinear,
        ShardedToAllLinear,
        QuantizedAllToShardedLinear,
        QuantizedShardedToAllLinear,
    )
    cut = {name for name, m in model.named_modules() if isinstance(m, sharded)}
    weights = [k for k, _ in tree_flatten(model.parameters()) if ".layers." in f".{k}"]
    assert cut, "shard() cut nothing"
    for key in weights:
        module = key.rsplit(".", 1)[0]
        by_class = module in cut
        by_name = model_facts.cut_by_shard(key)
        in_place = any(p in key for p in ("switch_mlp", "experts", "embed_q", "unembed_out"))
        if by_class:
            assert by_name, f"{arch}: shard() cuts {key} but the planner keeps it whole"
        elif by_name:
            assert in_place or key.endswith("sinks"), f"{arch}: {key} is not cut by shard()"
    assert isinstance(model, nn.Module)


def test_sizes_that_divide_follow_heads_and_quantization_groups(
    seeds: dict[str, ModelInfo],
) -> None:
    qwen, ds, oss = (seeds[k].facts for k in ("qwen3-235b-a22b", "deepseek-v3.1", "gpt-oss-120b"))
    assert tensor_sizes(qwen, 4) == (1, 2, 4)
    assert tensor_sizes(ds, 4) == (1, 2, 4)
    # gpt-oss's expert width 2880 is 90 mxfp4 groups of 32: two ways, not four.
    assert tensor_sizes(oss, 4) == (1, 2)
    why = tensor_refusal(oss, 4, 4)
    assert why and "MLP width (32-wide quantization groups) 90" in why
    assert why.endswith("tensor sizes that divide here: 1, 2")
    # Qwen3's 4 KV heads and 64 heads cannot be cut 3 ways; 3 nodes are a pipeline.
    assert tensor_sizes(qwen, 3) == (1,)
    assert "KV heads 4" in (tensor_refusal(qwen, 3, 3) or "")
    # 3 does not split 4 nodes into equal stages.
    assert "does not split 4 nodes" in (tensor_refusal(qwen, 3, 4) or "")
    assert "does not split 1 node into" in (tensor_refusal(qwen, 2, 1) or "")
    # MLA keeps one latent per token: DeepSeek's cache is whole on every node.
    assert ds.tensor is not None and not ds.tensor.kv_split
    assert qwen.tensor is not None and qwen.tensor.kv_split


def test_a_family_without_shard_runs_only_as_a_pipeline(tmp_path: Path) -> None:
    spec = DemoSpec(arch="mixtral", layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32")
    from worker.shared.demo_model import write_demo_model

    facts = read_model(write_demo_model(tmp_path / "mixtral", spec)).facts
    assert facts.tensor is None and tensor_sizes(facts, 4) == (1,)
    refusal = plan(facts, FOUR[:2], tensor=2)
    assert isinstance(refusal, Refusal)
    assert "has no tensor-parallel shard() in mlx-lm" in refusal.reason


# --------------------------------------------------------------------------- bytes per node


def test_a_tensor_stage_holds_a_slice_of_its_layers_and_the_uncut_parts_whole(
    seeds: dict[str, ModelInfo],
) -> None:
    qwen = seeds["qwen3-235b-a22b"].facts
    assert qwen.tensor is not None
    whole = sum(b - s for b, s in zip(qwen.layer_bytes, qwen.tensor.layer_split, strict=True))
    # Norms and routers: a few MB of a 233 GB model.
    assert 0 < whole < 0.001 * qwen.weight_bytes
    one = plan(qwen, FOUR, mesh(True), context_tokens=8192, tensor=4)
    assert isinstance(one, Plan) and one.shape == "1 stage × 4 (jaccl)"
    (stage,) = one.shards
    assert stage.group == tuple(NAMES) and (stage.start, stage.end) == (0, qwen.n_layers)
    layers = sum(qwen.layer_bytes)
    # Each node: a quarter of the layers, all of the (uncut) embedding and head.
    expected = layers / 4 + whole * 3 / 4 + qwen.embed_bytes + qwen.head_bytes
    assert stage.weight_bytes == pytest.approx(expected, rel=1e-6)
    assert stage.kv_bytes == pytest.approx(sum(qwen.kv_bytes(8192)) / 4, rel=1e-6)
    assert stage.group_free == (504 * GiB,) * 4

    two = plan(qwen, FOUR, mesh(False), context_tokens=8192, tensor=2)
    assert isinstance(two, Plan) and two.shape == "2 stages × 2 (ring)"
    assert [len(s.group) for s in two.shards] == [2, 2]
    assert two.shards[0].start == 0 and two.shards[-1].end == qwen.n_layers
    assert {n for s in two.shards for n in s.group} == set(NAMES)
    data = json.loads(json.dumps(plan_to_dict(two)))
    assert data["shape"] == "2 stages × 2 (ring)" and len(data["shards"][0]["group"]) == 2
    text = str(render_plan(two).title) + str(render_plan(two).caption)  # type: ignore[union-attr]
    assert "2 stages × 2 (ring)" in text and "ring backend over TCP" in text


def test_deepseek_keeps_its_mla_cache_whole_on_every_node(seeds: dict[str, ModelInfo]) -> None:
    ds = seeds["deepseek-v3.1"].facts
    four = plan(ds, FOUR, mesh(True), context_tokens=32768, tensor=4)
    assert isinstance(four, Plan)
    assert four.shards[0].kv_bytes == sum(ds.kv_bytes(32768))


def test_a_tensor_shape_that_does_not_fit_says_what_the_copies_cost(
    seeds: dict[str, ModelInfo],
) -> None:
    qwen = seeds["qwen3-235b-a22b"].facts
    small = [NodeBudget(n, 60 * GiB, 64 * GiB) for n in NAMES]
    refusal = plan(qwen, small, tensor=2)
    assert isinstance(refusal, Refusal)
    assert "as 2 stages × 2 needs" in refusal.reason and "more than a pipeline" in refusal.reason


# --------------------------------------------------------------------------- backend


def test_jaccl_only_when_every_pair_has_rdma() -> None:
    links = mesh(True)
    assert backend_for(NAMES, links)[0] == "jaccl"
    broken = [x if {x.a, x.b} != {"studio-1", "studio-3"} else Link(x.a, x.b, 150, 40, x.kind)
              for x in links]  # fmt: skip
    backend, why = backend_for(NAMES, broken)
    assert backend == "ring"
    assert why.startswith("studio-1 ↔ studio-3 has no RDMA at both ends")
    # A pair with no link measured at all has no RDMA either.
    assert backend_for(["studio-1", "studio-2"], [])[0] == "ring"


def test_groups_pair_the_nodes_that_have_rdma_between_them(seeds: dict[str, ModelInfo]) -> None:
    qwen = seeds["qwen3-235b-a22b"].facts
    links = [
        Link(a, b, 150.0, 40.0, "thunderbolt", {a, b} in ({"studio-1", "studio-3"},
                                                          {"studio-2", "studio-4"}))
        for i, a in enumerate(NAMES)
        for b in NAMES[i + 1 :]
    ]  # fmt: skip
    two = plan(qwen, FOUR, links, tensor=2)
    assert isinstance(two, Plan)
    assert sorted(s.group for s in two.shards) == [
        ("studio-1", "studio-3"),
        ("studio-2", "studio-4"),
    ]
    assert {s.backend for s in two.shards} == {"jaccl"}


# --------------------------------------------------------------------------- choosing


def test_the_fastest_shape_is_chosen_and_a_pipeline_where_it_is_as_fast(
    seeds: dict[str, ModelInfo],
) -> None:
    qwen = seeds["qwen3-235b-a22b"].facts
    # RDMA everywhere: one stage of four (each node reads a quarter per token).
    fast = choose(qwen, FOUR, mesh(True), M3_ULTRA, context_tokens=8192)
    assert isinstance(fast.verdict, Plan) and fast.verdict.shape == "1 stage × 4 (jaccl)"
    assert [o.tensor for o in fast.options] == [1, 2, 4]
    # TCP only: every all-reduce costs a TCP round trip; the pipeline wins.
    slow = choose(qwen, FOUR, mesh(False), M3_ULTRA, context_tokens=8192)
    assert isinstance(slow.verdict, Plan) and slow.verdict.shape == "4 stages"
    # Nodes on one machine (loopback) share its memory: a group is no faster there,
    # so the planner's old answer stands, exactly.
    local = choose(qwen, FOUR, mesh(False, "loopback", 50.0), {}, context_tokens=8192)
    assert local.verdict == plan(qwen, FOUR, mesh(False, "loopback", 50.0), context_tokens=8192)
    # Asked for: that shape, or the reason it cannot be.
    asked = choose(qwen, FOUR, mesh(False), M3_ULTRA, tensor=2, context_tokens=8192)
    assert isinstance(asked.verdict, Plan) and asked.verdict.tensor == 2
    refused = choose(qwen, FOUR, mesh(False), M3_ULTRA, tensor=3)
    assert isinstance(refused.verdict, Refusal)
    assert "tensor sizes that divide here: 1, 2, 4" in refused.verdict.reason


# --------------------------------------------------------------------------- shown


def test_shape_labels_and_a_placements_shape_from_its_planned_ring() -> None:
    assert shape_label(4, 1) == "4 stages"
    assert shape_label(1, 1) == "1 node"
    assert shape_label(2, 2, "ring") == "2 stages × 2 (ring)"
    assert shape_label(1, 4, "jaccl") == "1 stage × 4 (jaccl)"
    ring = (
        PlannedShard("a", 0, 40, "ring"),
        PlannedShard("b", 0, 40, "ring"),
        PlannedShard("c", 40, 94, "ring"),
        PlannedShard("d", 40, 94, "ring"),
    )
    placed = PlannedPlacement("/m/qwen", ring)
    again = PlannedPlacement.from_json(json.loads(json.dumps(placed.to_json())))
    assert again == placed
    assert PlacementState("q", "qwen", "/m/qwen", (), planned=again.shards).shape == (
        "2 stages × 2 (ring)"
    )
    # …and its stages, a group's nodes together (status and the chat draw `a+b → c+d`).
    assert PlacementState("q", "qwen", "/m/qwen", (), planned=ring).stages == (
        (("a", "b"), 0, 40),
        (("c", "d"), 40, 94),
    )
    # A ring written before shapes existed reads as the pipeline it was.
    old = PlannedPlacement.from_json({"model_dir": "/m", "shards": [["a", 0, 4], ["b", 4, 8]]})
    assert PlacementState("p", "m", "/m", (), planned=old.shards).shape == "2 stages"
    with pytest.raises(ValueError):
        PlannedPlacement.from_json({"model_dir": "/m", "shards": [["a", 0]]})


def test_a_tensor_group_must_beat_the_pipeline_by_the_margin(
    seeds: dict[str, ModelInfo], monkeypatch: pytest.MonkeyPatch
) -> None:
    from studiotui.core import forecast as forecast_module

    qwen = seeds["qwen3-235b-a22b"].facts
    fast = choose(qwen, FOUR, mesh(True), M3_ULTRA, context_tokens=8192)
    speeds = {o.tensor: o.forecast.tps_1 for o in fast.options if o.forecast}
    gain = speeds[4] / speeds[1]
    assert gain > forecast_module.MARGIN  # so the group of four was taken above
    # Asked for more than that gain, the pipeline stays.
    monkeypatch.setattr(forecast_module, "MARGIN", gain * 1.01)
    kept = choose(qwen, FOUR, mesh(True), M3_ULTRA, context_tokens=8192)
    assert isinstance(kept.verdict, Plan) and kept.verdict.tensor == 1


def test_a_moe_whose_every_layer_is_sparse_is_not_held_to_its_unused_dense_width(
    tmp_path: Path,
) -> None:
    """qwen3_moe's `intermediate_size` is the width of a dense MLP only layers in
    `mlp_only_layers` (or off `decoder_sparse_step`) have; shard() never cuts it when
    every layer has experts. The README's demo (`--arch qwen3_moe --quantize 4`,
    hidden 256: a dense width of 704, 11 groups of 64) offered no tensor shape."""
    spec = DemoSpec(arch="qwen3_moe", quantize="4")
    info = read_model(write_demo_model(tmp_path / "moe", spec))
    assert info.facts.tensor is not None
    assert tensor_sizes(info.facts, 4) == (1, 2, 4)
    # A layer that does run the dense MLP brings its width back into the rule.
    config = make_config(DemoSpec(arch="qwen3_moe", quantize="4"))
    config = {**config, "quantization": {"bits": 4, "group_size": 64}}
    widths = dict(model_facts.tensor_dims(config))
    assert "MLP width (64-wide quantization groups)" not in widths
    dense = dict(model_facts.tensor_dims({**config, "mlp_only_layers": [0]}))
    assert dense["MLP width (64-wide quantization groups)"] == 11
