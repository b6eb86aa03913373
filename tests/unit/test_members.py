"""core.members: the processes a plan runs, and JACCL's device matrix from agents' facts."""

from __future__ import annotations

import pytest

from studiotui.core.members import jaccl_devices, members
from studiotui.core.placement import Plan, ShardPlan


def _shard(node: str, start: int, end: int, group: tuple[str, ...] = ()) -> ShardPlan:
    return ShardPlan(
        node, start, end, 10, 1, 100, 89, group=group, backend="ring" if group else None
    )


def _plan(*shards: ShardPlan) -> Plan:
    return Plan("m", shards, 4096, None, 20)


def test_members_run_stage_by_stage_each_leader_first() -> None:
    plan = _plan(_shard("a", 0, 4, ("a", "b")), _shard("c", 4, 8, ("c", "d")), _shard("e", 8, 9))
    got = [(m.stage, m.rank, m.node, m.start, m.end) for m in members(plan)]
    assert got == [
        (0, 0, "a", 0, 4),
        (0, 1, "b", 0, 4),
        (1, 0, "c", 4, 8),
        (1, 1, "d", 4, 8),
        (2, 0, "e", 8, 9),
    ]
    assert members(plan)[-1].group == () and members(plan)[1].group == ("a", "b")


@pytest.mark.parametrize(
    ("shards", "word"),
    [
        ((_shard("a", 0, 4, ("b", "a")),), "does not start with"),
        ((_shard("a", 0, 2, ("a", "b")), _shard("b", 2, 4)), "twice"),
    ],
)
def test_members_refuse_inconsistent_groups(shards: tuple[ShardPlan, ...], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        members(_plan(*shards))


def test_jaccl_devices_refuse_rather_than_guess() -> None:
    # Devices alone do not say which cable leads where (the matching from recorded
    # Thunderbolt ports is tested in test_rdma_ports.py): no device is guessed.
    rdma = {
        "a": {"usable": True, "devices": ["rdma_en3"], "active_devices": ["rdma_en3"]},
        "b": {"usable": True, "devices": ["rdma_en5"], "active_devices": ["rdma_en5"]},
    }
    assert jaccl_devices(["a", "b"], rdma) == (
        "a does not report its Thunderbolt ports (system_profiler, networksetup); "
        "b does not report its Thunderbolt ports (system_profiler, networksetup)"
    )
    rdma["a"] = {"usable": False}
    assert jaccl_devices(["a", "b"], rdma).startswith("a has no usable RDMA device")
