"""worker.tensor, pure parts: which frames are a mirrored item, which failure a lost member."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.agent import tensor_member
from worker.tensor import CANCEL, GENERATE, INTERNAL, RING, MirrorError, check_event, lost_member


@pytest.mark.parametrize(
    "frames", [[INTERNAL], [RING, b"h", b"p"], [GENERATE, b"m"], [CANCEL, b"rid"]]
)
def test_every_kind_the_leader_sends_is_accepted(frames: list[bytes]) -> None:
    assert check_event(frames) == frames[0]


@pytest.mark.parametrize("frames", [[], [b"x"], [RING, b"h"], [INTERNAL, b"extra"], [CANCEL]])
def test_anything_else_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(MirrorError):
        check_event(frames)


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


def test_a_ring_member_gets_the_hostfile_and_environment_mlx_reads(tmp_path: Path) -> None:
    follower = ["tcp://10.0.0.2:5011", "KEY"]
    member, env = tensor_member(
        _load_msg(0, "ring", followers=[follower]), "10.0.0.1", tmp_path / "p"
    )
    assert member["rank"] == 0 and member["group_size"] == 2 and member["followers"] == [follower]
    assert env["MLX_RANK"] == "0" and env["MLX_WORLD_SIZE"] == "2"
    hosts = json.loads(Path(env["MLX_HOSTFILE"]).read_text())
    assert hosts == [["10.0.0.1:5010"], ["10.0.0.2:5020"]]


def test_a_jaccl_member_gets_devices_and_the_leaders_coordinator(tmp_path: Path) -> None:
    devices = [[None, "rdma_en3"], ["rdma_en5", None]]
    msg = _load_msg(1, "jaccl", devices=devices, leader_key="LEADER")
    member, env = tensor_member(msg, "10.0.0.2", tmp_path / "p")
    assert member["leader_key"] == "LEADER" and env["MLX_RANK"] == "1"
    assert env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:5010"
    assert json.loads(Path(env["MLX_IBV_DEVICES"]).read_text()) == devices


@pytest.mark.parametrize(
    ("msg", "address", "word"),
    [
        (_load_msg(0, "ring"), "10.0.0.9", "not this node's"),
        (_load_msg(0, "nccl"), "10.0.0.1", "unknown backend"),
    ],
)
def test_a_member_refuses_a_wrong_group(
    tmp_path: Path, msg: dict[str, object], address: str, word: str
) -> None:
    with pytest.raises(ValueError, match=word):
        tensor_member(msg, address, tmp_path / "p")
