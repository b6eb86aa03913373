"""What a placement that cannot answer is said to need decides on the nodes' typed
state (`NodeState.stopped_at`: the operator's `studiotui down`), never on the words of
their messages: rewording a message changes no advice and no log level."""

from __future__ import annotations

from studiotui.cluster.hints import STOPPED_BY_DOWN, not_ready_hint, stopped_by_down
from studiotui.core.state import NodeState, PlacementState, PlannedShard, ShardState

PLANNED = (PlannedShard("n1", 0, 2), PlannedShard("n2", 2, 4))


def placement() -> PlacementState:
    """A two-stage placement whose second node reports no shard."""
    shard = ShardState("demo", "n1", 0, 2, 0, 2, "ready", model_dir="/m/demo")
    return PlacementState("demo", "demo", "/m/demo", (shard,), planned=PLANNED)


def nodes(message: str, stopped_at: float | None) -> tuple[NodeState, ...]:
    up = NodeState("n1", "127.0.0.1", 1, "local", state="up")
    down = NodeState(
        "n2", "127.0.0.2", 1, "local", state="down", message=message, stopped_at=stopped_at
    )
    return (up, down)


def test_a_node_stopped_by_down_is_said_so_whatever_its_message() -> None:
    for message in (f"{STOPPED_BY_DOWN} at 10:00:00", "the operator stopped it"):
        seen = nodes(message, stopped_at=1_700_000_000.0)
        assert stopped_by_down(placement(), seen)
        hint = not_ready_hint(placement(), seen)
        assert "`studiotui up`" in hint and "restart n2" in hint, hint


def test_words_that_read_like_a_stop_are_not_one() -> None:
    # A message that happens to begin with the words, on a node that fell silent.
    seen = nodes(f"{STOPPED_BY_DOWN}, said someone", stopped_at=None)
    assert not stopped_by_down(placement(), seen)
    hint = not_ready_hint(placement(), seen)
    assert "`studiotui up`" not in hint and "comes back with its shard" in hint, hint


def test_a_placement_with_no_missing_node_is_not_stopped_by_down() -> None:
    whole = PlacementState("demo", "demo", "/m/demo", placement().shards)
    assert not stopped_by_down(whole, nodes("", stopped_at=1.0))
