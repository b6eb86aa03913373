"""Memory a node has promised to a placement still loading (controller.node_promised_bytes),
from the report its agent sends: the KV reserve, the weights not read yet and the
plan's share of the adapter, which is applied only once the weights are in. The report
is the agent's own (`ShardProc.describe`) sent over the wire codec and read back as the
controller reads it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from studiotui.core.memory import (
    disk_room,
    node_promised_bytes,
    promises_note,
    unreported_promised_bytes,
)
from studiotui.core.state import NodeState, shard_from_report
from worker.agent import ShardProc
from worker.shared.protocol import control

MB = 1024**2


def _node(*shard: ShardProc, name: str = "studio-1") -> NodeState:
    wire = control.decode(control.encode(control.Shards(shards=[s.describe() for s in shard])))
    assert isinstance(wire, control.Shards)
    reports = wire.shards
    return NodeState(
        name,
        "10.0.0.11",
        52500,
        "ssh",
        state="up",
        memory_total=64 * 1024 * MB,
        shards=tuple(shard_from_report(name, r) for r in reports),
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
    assert node_promised_bytes(node) == 2 * MB + 6 * MB + 3 * MB
    # Prepared (ports taken, nothing read yet): the same promise.
    assert node_promised_bytes(_node(_shard("prepared", (0, 0), adapter_bytes=3 * MB))) == 3 * MB
    # Ready: weights and adapter are in the memory the node reports used; the KV may grow.
    ready = _shard("ready", (10 * MB, 10 * MB), kv_bytes=2 * MB, adapter_bytes=3 * MB)
    assert node_promised_bytes(_node(ready)) == 2 * MB


def test_a_report_without_adapter_bytes_reads_as_none() -> None:
    # An agent from before the field (or a shard without an adapter) reports none.
    older = _shard("loading", (4 * MB, 10 * MB), kv_bytes=2 * MB)
    described = control.to_wire(older.describe())
    described.pop("adapter_bytes")
    report = control.parse(described, control.ShardReport)
    assert report.adapter_bytes == 0
    assert node_promised_bytes(_node(older)) == 2 * MB + 6 * MB


def _prepared(placement: str, weights: int, kv: int, adapter: int = 0) -> ShardProc:
    # As the agent makes it on prepare_shard: ports, and the plan's promise only.
    promise = {"weight_bytes": weights, "kv_bytes": kv, "adapter_bytes": adapter}
    return ShardProc(placement, 1, 2, spec=promise)


def test_a_prepared_shard_promises_its_whole_budget_through_the_copy() -> None:
    # Its files are still being copied: nothing read, nothing in the node's report.
    copying = _prepared("big", 700 * MB, 200 * MB, 30 * MB)
    assert copying.state == "prepared"
    node = _node(copying)
    assert node.shards[0].weight_bytes == 700 * MB
    assert node_promised_bytes(node) == 700 * MB + 200 * MB + 30 * MB
    # Loading, before the runner's first progress: still the plan's weights.
    copying.state = "loading"
    assert node_promised_bytes(_node(copying)) == 700 * MB + 200 * MB + 30 * MB
    # Its first progress: the file's own size stands, less what is read.
    copying.progress = (500 * MB, 720 * MB)
    assert node_promised_bytes(_node(copying)) == 220 * MB + 200 * MB + 30 * MB
    # Loaded: the node's memory report has weights and adapter; only the KV may grow.
    copying.state, copying.progress = "ready", (720 * MB, 720 * MB)
    assert node_promised_bytes(_node(copying)) == 200 * MB


def test_the_note_names_each_placement_not_loaded_yet_and_its_promise_per_node() -> None:
    one = _node(_prepared("big", 700 * MB, 200 * MB), name="studio-1")
    loading = ShardProc("small", 3, 4, spec={"kv_bytes": 10 * MB}, state="loading")
    loading.progress = (0, 90 * MB)
    ready = ShardProc("old", 5, 6, spec={"kv_bytes": 50 * MB}, state="ready")
    two = _node(_prepared("big", 300 * MB, 0), loading, ready, name="studio-2")
    note = promises_note([one, two])
    assert "placement 'big' (copying its files) is promised 900 MB on studio-1, 300 MB on " in note
    assert "placement 'small' (loading) is promised 100 MB on studio-2" in note
    assert "'old'" not in note  # loaded: its memory shows in the node's own report
    assert "given back if it fails or is unloaded" in note
    assert "(studiotui unload NAME if its placing was given up)" in note
    # Else the agents give it back once its lease lapses (worker PREPARED_LEASE_S).
    assert note.endswith("a copy whose operator went away is given back after 5 minutes")
    assert promises_note([_node(ready)]) == ""
    # One placement: the command to free it, should its operator have gone.
    assert "(studiotui unload big if its placing was given up)" in promises_note([one])


def test_a_prepare_from_an_older_controller_promises_nothing_it_did_not_say() -> None:
    req = control.parse({"placement": "p"}, control.PrepareShard)
    assert (req.weight_bytes, req.kv_bytes, req.adapter_bytes) == (0, 0, 0)
    assert node_promised_bytes(_node(_prepared("p", 0, 0))) == 0


def test_an_unreported_promise_counts_until_its_node_reports_it_and_never_twice() -> None:
    promises = {"new": {"studio-1": 40 * MB, "studio-2": 60 * MB}}
    empty = _node(name="studio-1")
    assert unreported_promised_bytes(promises, empty) == 40 * MB
    assert unreported_promised_bytes(promises, _node(name="studio-3")) == 0
    # Once the node reports the prepared shard, its report holds the promise.
    reported = _node(_prepared("new", 30 * MB, 10 * MB), name="studio-1")
    assert unreported_promised_bytes(promises, reported) == 0
    assert node_promised_bytes(reported) == 40 * MB
    note = promises_note([empty, _node(name="studio-2")], promises)
    assert "placement 'new' (being prepared) is promised 40 MB on studio-1, 60 MB on studio-2" in (
        note
    )
    assert promises_note([reported], promises).count("'new'") == 1


def test_the_prompt_cache_budget_is_promised() -> None:
    # Prepared (the agent's promise from prepare_shard), and loaded: the prompt cache's
    # budget is promised like the KV it may grow to, and says so in the note.
    prepared = ShardProc("big", 1, 2, spec={"weight_bytes": 7 * MB, "prompt_cache_bytes": 5 * MB})
    node = _node(prepared)
    assert node.shards[0].prompt_cache_bytes == 5 * MB
    assert node_promised_bytes(node) == 7 * MB + 5 * MB
    assert "placement 'big' (copying its files) is promised 12 MB" in promises_note([node])
    ready = _shard("ready", (10 * MB, 10 * MB), kv_bytes=2 * MB, prompt_cache_bytes=4 * MB)
    assert node_promised_bytes(_node(ready)) == 2 * MB + 4 * MB


def test_disk_room_counts_what_placed_prompt_caches_may_still_write() -> None:
    """Two placements' default disk budgets must not both count on the same free disk:
    what a placed cache may still write (its budget less what it holds) is spoken for."""
    spec = {"prompt_cache_disk_bytes": 10 * MB}
    node = _node(_shard("ready", (1, 1), **spec), _shard("ready", (1, 1), **spec))
    assert [s.prompt_cache_disk_bytes for s in node.shards] == [10 * MB, 10 * MB]
    assert disk_room(node) is None  # the node did not say its free disk
    held = replace(node.shards[0], cache_disk_bytes=4 * MB)
    over = replace(node.shards[1], cache_disk_bytes=12 * MB)  # past its budget: no credit
    node = replace(node, disk_free=100 * MB, shards=(held, over))
    assert disk_room(node) == 100 * MB - 6 * MB
