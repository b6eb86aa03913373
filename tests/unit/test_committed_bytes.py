"""Memory a node has promised to a placement still loading (controller.committed_bytes),
from the report its agent sends: the KV reserve, the weights not read yet and the
plan's share of the adapter, which is applied only once the weights are in. The report
is the agent's own (`ShardProc.describe`) sent over the wire codec and read back as the
controller reads it."""

from __future__ import annotations

from typing import Any

from studiotui.cluster.controller import committed_bytes
from studiotui.core.state import NodeState, shard_from_report
from worker.agent import ShardProc
from worker.shared.protocol import control, messages

MB = 1024**2


def _node(shard: ShardProc) -> NodeState:
    wire = messages.decode(messages.encode("shards", shards=[shard.describe()]))
    reports = control.parse(wire, control.Shards).shards
    return NodeState(
        "studio-1",
        "10.0.0.11",
        52500,
        "ssh",
        state="up",
        memory_total=64 * 1024 * MB,
        shards=tuple(shard_from_report("studio-1", r) for r in reports),
    )


def _shard(state: Any, progress: tuple[int, int], **spec: Any) -> ShardProc:
    # The fields of the agent's spec the report carries (worker/agent.py _on_load_shard).
    spec = {"model_dir": "/m", "start": 0, "end": 2, "index": 0, "count": 2, **spec}
    return ShardProc("tiny+style", 1, 2, spec=spec, state=state, progress=progress)


def test_a_loading_shard_commits_its_adapter_share_until_it_is_ready() -> None:
    loading = _shard("loading", (4 * MB, 10 * MB), kv_bytes=2 * MB, adapter_bytes=3 * MB)
    node = _node(loading)
    assert node.shards[0].adapter_bytes == 3 * MB
    # KV + the 6 MB of weights still to read + the whole adapter (not applied yet).
    assert committed_bytes(node) == 2 * MB + 6 * MB + 3 * MB
    # Prepared (ports taken, nothing read yet): the same promise.
    assert committed_bytes(_node(_shard("prepared", (0, 0), adapter_bytes=3 * MB))) == 3 * MB
    # Ready: weights and adapter are in the memory the node reports used; the KV may grow.
    ready = _shard("ready", (10 * MB, 10 * MB), kv_bytes=2 * MB, adapter_bytes=3 * MB)
    assert committed_bytes(_node(ready)) == 2 * MB


def test_a_report_without_adapter_bytes_reads_as_none() -> None:
    # An agent from before the field (or a shard without an adapter) reports none.
    older = _shard("loading", (4 * MB, 10 * MB), kv_bytes=2 * MB)
    described = older.describe()
    described.pop("adapter_bytes")
    report = control.parse(described, control.ShardReport)
    assert report.adapter_bytes == 0
    assert committed_bytes(_node(older)) == 2 * MB + 6 * MB
