"""worker.group: the files and environment a rank of an mx.distributed group is launched with."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from worker.group import GroupError, join, rank_env, ring_hostfile, write_json

RANK = """
import os, sys
import mlx.core as mx
from worker.group import join
group = join("ring", os.environ)
total = mx.distributed.all_sum(mx.array([float(group.rank() + 1)]), group=group)
print(group.rank(), group.size(), total.item())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ring_hostfile_is_one_list_per_rank() -> None:
    assert ring_hostfile(["10.0.0.1", "10.0.0.2"], [5000, 5001]) == [
        ["10.0.0.1:5000"],
        ["10.0.0.2:5001"],
    ]


@pytest.mark.parametrize(
    ("addresses", "ports", "word"),
    [(["10.0.0.1"], [1], "at least 2"), (["a", "a"], [1, 1], "share"), (["a"], [1, 2], "ports")],
)
def test_ring_hostfile_refuses_bad_groups(
    addresses: list[str], ports: list[int], word: str
) -> None:
    with pytest.raises(GroupError, match=word):
        ring_hostfile(addresses, ports)


def test_rank_env_names_what_is_missing(tmp_path: Path) -> None:
    assert rank_env(1, 2, "ring", hostfile=tmp_path / "h.json")["MLX_RANK"] == "1"
    with pytest.raises(GroupError, match="outside"):
        rank_env(2, 2, "ring", hostfile=tmp_path / "h.json")
    with pytest.raises(GroupError, match="hostfile"):
        rank_env(0, 2, "ring")
    with pytest.raises(GroupError, match="coordinator"):
        rank_env(0, 2, "jaccl")


def test_two_ranks_join_a_ring_and_sum(tmp_path: Path) -> None:
    """Two real processes on loopback form a ring group from what the module writes."""
    hostfile = write_json(
        tmp_path / "hosts.json", ring_hostfile(["127.0.0.1"] * 2, [_free_port(), _free_port()])
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            env={**os.environ, **rank_env(rank, 2, "ring", hostfile=hostfile)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=60)[0].split() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sorted(outs) == [["0", "2", "3.0"], ["1", "2", "3.0"]]
    assert json.loads(hostfile.read_text())[0][0].startswith("127.0.0.1:")


def test_a_join_mlx_cannot_make_names_what_the_rank_was_given(tmp_path: Path) -> None:
    # No JACCL in MLX on Linux: the refusal names the coordinator and device file the
    # rank was launched with, so a launch can be checked where it cannot run.
    if mx.distributed.is_available("jaccl"):
        pytest.skip("this MLX has JACCL")
    env = rank_env(1, 4, "jaccl", coordinator="10.0.0.1:5000", devices=tmp_path / "d.json")
    with pytest.raises(GroupError) as refused:
        join("jaccl", {**env, "HOME": "/root"})
    said = str(refused.value)
    assert said.startswith("MLX here has no 'jaccl' distributed backend (")
    assert "MLX_JACCL_COORDINATOR=10.0.0.1:5000" in said and "MLX_RANK=1" in said
    assert f"MLX_IBV_DEVICES={tmp_path / 'd.json'}" in said and "HOME" not in said


JOINING = """
import os, sys
from worker.group import GroupError, join
try:
    group = join("ring", os.environ)
except GroupError as exc:
    print("refused:", exc)
else:
    print("joined", group.rank(), group.size())
"""


def _ranks(
    tmp_path: Path, ranks: list[int], size: int, join_s: float
) -> tuple[list[str], list[str]]:
    """Start only `ranks` of a ring group of `size` (nodes n0, n1, ... by name) with a
    join time of `join_s`; what each printed, and the group's addresses."""
    ends = ["127.0.0.1"] * size, [_free_port() for _ in range(size)]
    hostfile = write_json(tmp_path / "hosts.json", ring_hostfile(*ends))
    nodes = [f"n{r}" for r in range(size)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", JOINING],
            env={
                **os.environ,
                **rank_env(rank, size, "ring", hostfile=hostfile, nodes=nodes, join_s=join_s),
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in ranks
    ]
    try:
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs, [f"127.0.0.1:{p}" for p in ends[1]]


def test_a_rank_that_never_comes_is_named_by_every_rank_that_did(tmp_path: Path) -> None:
    """Ranks 0 and 1 of three start, rank 2 never does: within the join time (2 s here,
    set as the launcher sets it) both refuse with the same words, naming rank 2 and its
    node, where the ranks meet, and what to do, instead of MLX waiting in accept."""
    outs, ends = _ranks(tmp_path, [0, 1], 3, 2.0)
    assert outs[0] == outs[1], outs
    said = outs[0]
    assert said.startswith("refused: the group of n0, n1, n2 did not form: rank 2 (n2) was ")
    assert f"not there within 2 s (the ranks meet at {ends[0]})" in said
    assert "studiotui logs n2" in said and "give the join more time (STUDIOTUI_JOIN_S=600" in said


def test_a_missing_rank_0_is_named_by_the_others(tmp_path: Path) -> None:
    outs, ends = _ranks(tmp_path, [1], 2, 1.5)
    assert outs[0].startswith("refused: the group of n0, n1 did not form: rank 0 (n0) was ")
    assert ends[0] in outs[0]


def test_ranks_started_seconds_apart_still_join(tmp_path: Path) -> None:
    """Rank 1 (the one MLX has connect first) waits at the meeting for rank 0,
    started 3 s later, and the group forms."""
    ends = ["127.0.0.1"] * 2, [_free_port(), _free_port()]
    hostfile = write_json(tmp_path / "hosts.json", ring_hostfile(*ends))

    def start(rank: int) -> subprocess.Popen[str]:
        env = rank_env(rank, 2, "ring", hostfile=hostfile, nodes=["a", "b"], join_s=60)
        return subprocess.Popen(
            [sys.executable, "-c", JOINING],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            text=True,
        )

    late = start(1)
    time.sleep(3.0)
    procs = [start(0), late]
    try:
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert outs == ["joined 0 2", "joined 1 2"]
