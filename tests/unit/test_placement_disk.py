"""The prompt cache's disk budget against each node's free disk (core.placement.disk)."""

from __future__ import annotations

from dataclasses import replace

from studiotui.core.placement import (
    Link,
    ModelFacts,
    NodeBudget,
    Plan,
    Refusal,
    TensorFacts,
    disk_by_node,
    fit_disk,
    plan,
    with_prompt_cache,
)

GB = 1024**3


def _plan(disk: int | None, tensor: int = 1) -> Plan:
    model = ModelFacts("m", "llama", 4, (GB,) * 4, 0, 0, 1024)
    if tensor > 1:
        model = replace(model, tensor=TensorFacts((("heads", 4),), (GB // 2,) * 4))
    names = ["a", "b", "c", "d"][: 2 * tensor]
    nodes = [NodeBudget(n, 20 * GB, 20 * GB) for n in names]
    links = [Link(x, y, 30.0, 40.0, "thunderbolt") for x in names for y in names if x < y]
    p = plan(model, nodes, links, context_tokens=4096, tensor=tensor)
    assert isinstance(p, Plan)
    cached = with_prompt_cache(p, GB, disk)
    assert isinstance(cached, Plan)
    return cached


def test_an_asked_budget_a_node_cannot_hold_is_refused_naming_it_and_what_fits() -> None:
    p = _plan(40 * GB)
    need = disk_by_node(p)
    assert 40 * GB - 2 <= sum(need.values()) <= 40 * GB
    refused = fit_disk(p, 40 * GB, {"a": 100 * GB, "b": 5 * GB})
    assert isinstance(refused, Refusal)
    assert "a prompt cache of 40.0 GB on disk does not fit" in refused.reason
    assert f"b would keep {need['b'] / GB:.1f} GB of it with 5.0 GB free" in refused.reason
    assert "a would keep" not in refused.reason
    most = float(refused.reason.split("--prompt-cache-disk ", 1)[1].split()[0])
    assert 0 < most <= 10.0
    fits = _plan(int(most * GB))
    assert fit_disk(fits, int(most * GB), {"a": 100 * GB, "b": 5 * GB}) is fits
    # Enough everywhere, or a node that does not say: the plan as it was.
    assert fit_disk(p, 40 * GB, {"a": 100 * GB, "b": 100 * GB}) is p
    assert fit_disk(p, 40 * GB, {"a": None, "b": None}) is p


def test_the_default_budget_takes_at_most_half_of_each_node_s_free_disk() -> None:
    p = _plan(None)  # the plan's default: 4x memory
    need = disk_by_node(p)
    assert all(v > 0 for v in need.values())
    roomy = {n: 10 * v for n, v in need.items()}
    assert fit_disk(p, None, roomy) is p
    tight = {"a": need["a"], "b": 10 * need["b"]}  # a has only its whole share free
    cut = fit_disk(p, None, tight)
    assert isinstance(cut, Plan)
    after = disk_by_node(cut)
    assert after["a"] <= need["a"] // 2 and after["a"] >= need["a"] // 2 - 1
    assert after["b"] == need["b"]
    # Nothing else of the plan changes (the disk is not memory).
    assert [s.prompt_cache_bytes for s in cut.shards] == [s.prompt_cache_bytes for s in p.shards]
    assert cut.total_bytes == p.total_bytes


def test_a_tensor_group_keeps_one_budget_its_members_smallest() -> None:
    p = _plan(None, tensor=2)
    assert all(len(s.nodes) == 2 for s in p.shards)
    first = p.shards[0].nodes
    per = p.shards[0].prompt_cache_disk_bytes
    free = {n: 100 * per for s in p.shards for n in s.nodes}
    free[first[1]] = per  # one member's disk is nearly full: half of it for the cache
    cut = fit_disk(p, None, free)
    assert isinstance(cut, Plan)
    assert cut.shards[0].prompt_cache_disk_bytes <= per // 2
    assert cut.shards[1].prompt_cache_disk_bytes == p.shards[1].prompt_cache_disk_bytes
