"""Which shards an upgrade or a restart loads again (`restart.to_reload`), and the
chat screen's nodes card fitting its width (`chat.nodes_card`): pure decisions."""

from __future__ import annotations

from studiotui.app.screens.chat import nodes_card
from studiotui.cluster.controller import SavedShard
from studiotui.core.state import PlacementState, ShardState
from studiotui.provision.restart import to_reload
from worker.shared.protocol import control


def saved(node: str, placement: str, index: int, group: tuple[str, ...] = ()) -> SavedShard:
    report = control.ShardReport(placement=placement, index=index, count=2, group=list(group))
    return SavedShard(node, placement, report, "tcp://127.0.0.1:1", "key")


def test_only_what_is_gone_comes_back_with_its_whole_tensor_group() -> None:
    pipe = [saved("a", "pipe", 0), saved("b", "pipe", 1)]
    tp = [saved("a", "tp", 0, ("a", "c")), saved("c", "tp", 0, ("a", "c")), saved("b", "tp", 1)]
    # a was replaced (its shards are gone); b and c were left alone (theirs run on).
    held = {("b", "pipe"), ("c", "tp"), ("b", "tp")}
    again, lost = to_reload([*pipe, *tp], held, back={"a", "b", "c"})
    assert [(s.node, s.placement) for s in again] == [("a", "pipe"), ("a", "tp"), ("c", "tp")]
    assert lost == {}


def test_a_shard_gone_with_a_node_that_did_not_come_back_loses_its_placement() -> None:
    shards = [saved("a", "pipe", 0), saved("b", "pipe", 1), saved("a", "solo", 0)]
    again, lost = to_reload(shards, held={("b", "pipe")}, back={"b"})
    assert again == [] and lost == {"pipe": ["a"], "solo": ["a"]}
    # Nothing gone: nothing to do (an upgrade that found the agents up to date).
    held = {("a", "pipe"), ("b", "pipe"), ("a", "solo")}
    assert to_reload(shards, held, back=set()) == ([], {})


def test_the_nodes_card_drops_the_role_then_cuts_names_to_fit() -> None:
    shards = tuple(
        ShardState("p", node, i, 2, 40 * i, 40 * (i + 1), state, in_flight=12)
        for i, (node, state) in enumerate((("studio-long-name", "ready"), ("b", "loading")))
    )
    placement = PlacementState("p", "qwen3-32b", "/m", shards)
    wide = nodes_card(placement, False, 80).plain.splitlines()
    assert wide[1].split() == ["node", "role", "layers", "reqs"]
    assert wide[2].split() == ["●", "studio-long-name", "head", "0–40", "12"]
    assert wide[3].split() == ["●", "b", "tail", "40–80", "12", "loading"]
    for width in (29, 30, 34):  # the side panel at 80 columns, with or without a scrollbar
        lines = nodes_card(placement, False, width).plain.splitlines()
        assert max(len(line) for line in lines) <= width, (width, lines)
        assert lines[1].split() == ["node", "layers", "reqs"]
        assert lines[3].split() == ["●", "b", "40–80", "12", "loading"]
    cut = nodes_card(placement, False, 29).plain.splitlines()[2]
    assert cut.split()[1] == "studio…" and cut.split()[-2:] == ["0–40", "12"]
