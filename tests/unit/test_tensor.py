"""worker.tensor, pure parts: which frames are a mirrored item, which failure a lost member."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.wire import LOAD_SHARD, arrived
from worker.agent import tensor_member
from worker.shared.protocol import control
from worker.shared.protocol.messages import MessageError
from worker.tensor import (
    CANCEL,
    GENERATE,
    GRANT,
    RING,
    WINDOW,
    FollowerQueue,
    LeaderQueue,
    MirrorError,
    Outside,
    check_event,
    lost_member,
)


@pytest.mark.parametrize(
    "frames",
    [[GRANT, b"3"], [RING, b"0", b"h", b"p"], [GENERATE, b"1", b"m"], [CANCEL, b"2", b"r"]],
)
def test_every_kind_the_leader_sends_is_accepted(frames: list[bytes]) -> None:
    assert check_event(frames) == frames[0]


@pytest.mark.parametrize("frames", [[], [b"x"], [RING, b"0", b"h"], [GRANT], [CANCEL, b"1"]])
def test_anything_else_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(MirrorError):
        check_event(frames)


class Wire:
    """Stands in for the PUSH socket: what the leader sent, in order."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send(self, frames: list[bytes]) -> None:
        self.sent.append([bytes(f) for f in frames])


class Rank:
    """A deterministic stand-in for a stage: an outside item "gX" schedules three inside
    steps of X, each inside step of X schedules the next until three are done. Every
    rank logs the order it ran things in."""

    def __init__(self, queue: LeaderQueue | FollowerQueue) -> None:
        self.queue, self.log = queue, []  # type: ignore[var-annotated]

    def job(self, name: str, left: int) -> None:
        self.log.append(f"{name}{left}")
        if left > 1:
            self.queue.append(lambda: self.job(name, left - 1))

    def outside(self, name: str) -> Outside:
        return Outside(lambda: self.job(name, 3), [GENERATE, name.encode()])


@pytest.mark.parametrize("seed", range(20))
def test_a_follower_runs_the_leaders_order_whenever_its_messages_arrive(seed: int) -> None:
    """The leader takes outside items at random moments; the follower hears the wire at
    random moments and runs as far as it may in between. Both logs must be equal."""
    import random

    rng = random.Random(seed)
    wire = Wire()
    leader = Rank(LeaderQueue(wire))  # type: ignore[arg-type]
    follower_queue = FollowerQueue()
    follower = Rank(follower_queue)
    heard = 0
    arriving = [f"r{i}-" for i in range(6)]
    for _ in range(400):
        if arriving and rng.random() < 0.15:
            leader.queue.append(leader.outside(arriving.pop(0)))
        if len(leader.queue) and rng.random() < 0.6:
            leader.queue.popleft()()  # type: ignore[union-attr]
        while heard < len(wire.sent) and rng.random() < 0.5:
            follower_queue.hear(wire.sent[heard])
            heard += 1
        for _ in range(rng.randrange(3)):
            step = follower_queue.next()
            if step is None:
                break
            if step[0] == "inside":
                step[1]()
            else:
                follower.outside(step[1][1].decode())()
    assert not arriving and not len(leader.queue)
    for frames in wire.sent[heard:]:
        follower_queue.hear(frames)
    while (step := follower_queue.next()) is not None:
        step[1]() if step[0] == "inside" else follower.outside(step[1][1].decode())()
    assert follower.log == leader.log and len(leader.log) == 18


def test_the_leader_keeps_the_grant_ahead_and_holds_outside_items_until_it_is_reached() -> None:
    wire = Wire()
    rank = Rank(LeaderQueue(wire))  # type: ignore[arg-type]
    queue = rank.queue
    assert isinstance(queue, LeaderQueue)
    queue.append(rank.outside("a"))
    queue.popleft()()
    queue.popleft()()  # a's first inside step: a grant goes out, WINDOW ahead
    assert wire.sent[-1] == [GRANT, str(1 + WINDOW).encode()]
    queue.append(rank.outside("b"))
    # b waits: a's inside steps run first, up to the grant or while any are left.
    queue.popleft()()
    queue.popleft()()
    assert rank.log == ["a3", "a2", "a1", "b3"]
    assert wire.sent[-1][:2] == [GENERATE, b"2"]  # b ran after 2 inside items


def test_a_follower_past_an_outside_items_place_is_out_of_step() -> None:
    queue = FollowerQueue()
    queue.hear([GRANT, b"5"])
    queue.append(lambda: None)
    assert queue.next() is not None
    queue.hear([CANCEL, b"0", b"rid"])
    with pytest.raises(MirrorError, match="has run 1"):
        queue.next()


def test_a_lost_member_is_told_by_mlx_backends_words() -> None:
    assert lost_member("RuntimeError: [ring] connection to a peer was lost")
    assert lost_member("RuntimeError: [jaccl] recv failed")
    assert not lost_member("the prompt is empty")


def _load_msg(rank: int, backend: str, **extra: object) -> dict[str, object]:
    return {
        "group": ["a", "b"],
        "group_addresses": ["10.0.0.1", "10.0.0.2"],
        "group_ports": [5010, 5020],
        "rank": rank,
        "backend": backend,
        **extra,
    }


def _member(msg: dict[str, object]) -> control.TensorMember:
    """A load_shard carrying these group fields, as the agent decodes it off the wire."""
    decoded = arrived("load_shard", **LOAD_SHARD, **msg)
    assert isinstance(decoded, control.LoadShard)
    return decoded


def test_a_wrong_typed_group_field_is_a_message_error_naming_it() -> None:
    with pytest.raises(MessageError, match=r"load_shard: .* at `\$.group_ports\[1\]`"):
        _member(_load_msg(0, "ring", group_ports=[5010, "5020"]))
    with pytest.raises(MessageError, match=r"`\$.followers\[0\]`"):
        _member(_load_msg(0, "ring", followers=[["tcp://10.0.0.2:5011"]]))


def test_a_ring_member_gets_the_hostfile_and_environment_mlx_reads(tmp_path: Path) -> None:
    follower = ["tcp://10.0.0.2:5011", "KEY"]
    member, env = tensor_member(
        _member(_load_msg(0, "ring", followers=[follower])), "10.0.0.1", tmp_path / "p"
    )
    assert member["rank"] == 0 and member["group_size"] == 2 and member["followers"] == [follower]
    assert env["MLX_RANK"] == "0" and env["MLX_WORLD_SIZE"] == "2"
    hosts = json.loads(Path(env["MLX_HOSTFILE"]).read_text())
    assert hosts == [["10.0.0.1:5010"], ["10.0.0.2:5020"]]


def test_a_jaccl_member_gets_devices_and_the_leaders_coordinator(tmp_path: Path) -> None:
    devices = [[None, "rdma_en3"], ["rdma_en5", None]]
    msg = _load_msg(1, "jaccl", devices=devices, leader_key="LEADER")
    member, env = tensor_member(_member(msg), "10.0.0.2", tmp_path / "p")
    assert member["leader_key"] == "LEADER" and env["MLX_RANK"] == "1"
    assert env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:5010"
    assert json.loads(Path(env["MLX_IBV_DEVICES"]).read_text()) == devices


@pytest.mark.parametrize(
    ("msg", "address", "word"),
    [
        (_load_msg(0, "ring"), "10.0.0.9", "not this node's"),
        (_load_msg(0, "nccl"), "10.0.0.1", "unknown backend"),
        (_load_msg(2, "ring"), "10.0.0.1", "rank 2 of a group of 2"),
    ],
)
def test_a_member_refuses_a_wrong_group(
    tmp_path: Path, msg: dict[str, object], address: str, word: str
) -> None:
    with pytest.raises(ValueError, match=word):
        tensor_member(_member(msg), address, tmp_path / "p")
