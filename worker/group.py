"""Launching a process as one rank of an `mx.distributed` group, the way MLX expects.

Tensor-parallel stages, fine-tuning jobs and the cluster benchmark all run a group of
processes (one per node) that talk over MLX's own distributed engine; the agents start
them. This module holds what every such launch shares: the ring backend's hostfile
(one list of "ip:port" per rank, as `mlx.launch --backend ring` writes it), JACCL's
device file and coordinator, and the environment a rank reads in
`mx.distributed.init()`. The operator decides the backend (JACCL only when every pair
of the group has RDMA enabled) and the addresses (the Thunderbolt bridge's, so
`mx.distributed` traffic, which MLX does not authenticate, stays on the cable).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import mlx.core as mx

from worker.shared.protocol.control import GROUP_JOIN_S, JOIN_S_VAR

Backend = Literal["ring", "jaccl"]
# The variables a rank's join reads (rank_env), named when the join cannot happen.
_SAID = ("MLX_RANK", "MLX_WORLD_SIZE", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES")
BACKENDS: tuple[Backend, ...] = ("ring", "jaccl")
# Ours, not MLX's: the group's node names in rank order, for the words when one does
# not come (JOIN_S_VAR, how long the ranks wait for one another, is the operator's too).
NODES_VAR = "STUDIOTUI_GROUP_NODES"
# After the ranks met, MLX connects them within milliseconds; past this, one of them
# died or its network path is shut, and MLX's accept would wait for ever.
MLX_CONNECT_S = 60.0
_HELLO = b"studiotui-join"
# How often a waiting rank says in its log whom it waits for.
_SAY_EVERY_S = 5.0
_AFTER_GO_S = 0.2


class GroupError(RuntimeError):
    """A group that cannot be formed as asked, with what to change."""


def ring_hostfile(addresses: Sequence[str], ports: Sequence[int]) -> list[list[str]]:
    """The ring backend's hostfile: rank i listens on addresses[i]:ports[i]."""
    if len(addresses) != len(ports):
        raise GroupError(f"{len(addresses)} addresses but {len(ports)} ports for the group")
    if len(addresses) < 2:
        raise GroupError("a distributed group needs at least 2 ranks")
    ends = [f"{a}:{p}" for a, p in zip(addresses, ports, strict=True)]
    if len(set(ends)) != len(ends):
        raise GroupError(f"two ranks of the group share an address and port: {ends}")
    return [[end] for end in ends]


def rank_env(
    rank: int,
    size: int,
    backend: Backend,
    hostfile: Path | None = None,
    coordinator: str | None = None,
    devices: Path | None = None,
    nodes: Sequence[str] = (),
    join_s: float | None = None,
) -> dict[str, str]:
    """The environment one rank needs so `mx.distributed.init(backend=...)` joins the group;
    with the group's node names (rank order) and how long the ranks wait for one another
    (None: GROUP_JOIN_S), which `join` reads too."""
    if not 0 <= rank < size:
        raise GroupError(f"rank {rank} is outside a group of {size}")
    env = {"MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(size)}
    if nodes:
        if len(nodes) != size or any("," in n for n in nodes):
            raise GroupError(f"{len(nodes)} node names for a group of {size}: {list(nodes)}")
        env[NODES_VAR] = ",".join(nodes)
    if join_s is not None:
        if not join_s > 0:
            raise GroupError(f"the join time must be positive seconds, not {join_s}")
        env[JOIN_S_VAR] = str(join_s)
    if backend == "ring":
        if hostfile is None:
            raise GroupError("the ring backend needs a hostfile")
        env["MLX_HOSTFILE"] = str(hostfile)
    elif backend == "jaccl":
        if coordinator is None or devices is None:
            raise GroupError(
                "the JACCL backend needs a coordinator address and an RDMA device file"
            )
        env["MLX_JACCL_COORDINATOR"] = coordinator
        env["MLX_IBV_DEVICES"] = str(devices)
    else:
        raise GroupError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    return env


def write_json(path: Path, value: object) -> Path:
    """Write a hostfile or device file where a rank's environment will point."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))
    return path


def join(backend: Backend, env: Mapping[str, str] | None = None) -> mx.distributed.Group:
    """Join the group this process was launched into; refuse a lone or misconfigured rank.

    The ranks first meet (`meet`, at rank 0's address) within the join time the
    launcher set (GROUP_JOIN_S by default), so MLX's own connects, with their fixed
    retries (about 15 s to the last attempt), start only once every rank is there; a
    rank that does not come is named. `strict=True` makes MLX raise instead of
    silently returning a group of one, which would compute a wrong answer (a 1/N slice
    of every layer) without any error.
    """
    env = os.environ if env is None else env
    if not mx.distributed.is_available(backend):
        # Say what the rank was given, so a launch can be checked where it cannot run.
        given = ", ".join(f"{k}={v}" for k, v in sorted(env.items()) if k in _SAID)
        raise GroupError(
            f"MLX here has no {backend!r} distributed backend" + (f" ({given})" if given else "")
        )
    place = _meeting_place(backend, env)
    if place is not None:
        meet(place, join_s=_join_s(env), nodes=_nodes(env, place))
    # MLX's accept has no timeout: a rank that met the others and then died would
    # leave its neighbour here for ever. Past MLX_CONNECT_S, say so and leave.
    watchdog = threading.Timer(MLX_CONNECT_S, _stuck, (backend, env))
    watchdog.daemon = True
    watchdog.start()
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        if place is None:  # a launch that does not say where: MLX's own words
            raise GroupError(f"MLX's {backend} backend cannot form the group: {exc}") from None
        raise GroupError(
            f"the ranks met, but MLX's {backend} backend could not connect them: {exc}; "
            "check that the nodes reach each other on the group's ports (a firewall?)"
        ) from None
    finally:
        watchdog.cancel()
    want = env.get("MLX_WORLD_SIZE")
    if want is not None and group.size() != int(want):
        raise GroupError(f"joined a group of {group.size()}, expected {want}")
    return group


def _stuck(backend: str, env: Mapping[str, str]) -> None:
    rank = env.get("MLX_RANK", "?")
    sys.stderr.write(
        f"rank {rank}: the group's ranks met, but MLX's {backend} backend has not connected "
        f"them within {MLX_CONNECT_S:.0f} s (a rank died, or the path between two nodes is "
        "shut); giving up\n"
    )
    sys.stderr.flush()
    os._exit(3)


@dataclass(frozen=True)
class Meeting:
    """Where and as whom a rank meets the others: rank 0's address, a token the
    group's launch files decide (so a stray connection is not taken for a rank), and
    each rank's address where the launch says them (the ring's hostfile)."""

    rank: int
    size: int
    host: str
    port: int
    token: str
    addresses: tuple[str, ...] = ()


def _meeting_place(backend: Backend, env: Mapping[str, str]) -> Meeting | None:
    """Rank 0's address (the ring's first hostfile entry, JACCL's coordinator), or None
    when the launch does not say (MLX then refuses it with its own words)."""
    try:
        rank, size = int(env["MLX_RANK"]), int(env["MLX_WORLD_SIZE"])
        addresses: tuple[str, ...] = ()
        if backend == "ring":
            text = Path(env["MLX_HOSTFILE"]).read_text()
            addresses = tuple(str(h[0]) for h in json.loads(text))
            first = addresses[0]
        else:
            first = env["MLX_JACCL_COORDINATOR"]
            text = f"{first} {size}"
        host, port = first.rsplit(":", 1)
        token = hashlib.sha256(f"{backend}\n{text}".encode()).hexdigest()[:32]
        return Meeting(rank, size, host, int(port), token, addresses)
    except (KeyError, ValueError, IndexError, TypeError, OSError):
        return None


def _join_s(env: Mapping[str, str]) -> float:
    try:
        value = float(env.get(JOIN_S_VAR, GROUP_JOIN_S))
    except ValueError:
        return GROUP_JOIN_S
    return value if value > 0 else GROUP_JOIN_S


def _nodes(env: Mapping[str, str], place: Meeting) -> list[str]:
    """Each rank's node by name (as the launcher said), else by address."""
    names = [n for n in env.get(NODES_VAR, "").split(",") if n]
    if len(names) == place.size:
        return names
    if len(place.addresses) == place.size:
        return list(place.addresses)
    return [f"node {r}" for r in range(place.size)]


def _who(ranks: Sequence[int], nodes: Sequence[str]) -> str:
    return ", ".join(f"rank {r} ({nodes[r]})" for r in ranks)


def _absent(ranks: Sequence[int], nodes: Sequence[str], join_s: float, at: str) -> str:
    """The words for ranks that did not come, with what to do."""
    verb = "was" if len(ranks) == 1 else "were"
    names = ", ".join(nodes[r] for r in ranks)
    return (
        f"the group of {', '.join(nodes)} did not form: {_who(ranks, nodes)} {verb} "
        f"not there within {join_s:g} s (the ranks meet at {at}); check that {names}'s "
        f"agent is up and its shard loading (studiotui status; studiotui logs {nodes[ranks[0]]}),"
        " and that it reaches that address; on a loaded machine a rank can start slowly: "
        f"place again, or give the join more time ({JOIN_S_VAR}=600 for studiotui; it "
        f"was {join_s:g} s)"
    )


def meet(place: Meeting, join_s: float, nodes: Sequence[str]) -> None:
    """Wait until every rank of the group is running, at most `join_s` seconds.

    Rank 0 listens at its own group address; every other rank connects there, says
    hello and waits for a word. When all have come, rank 0 closes its listener, then
    says "go" to each (so no rank's MLX connect reaches this listener instead of
    MLX's); if some have not come in time, it tells those that did which ones, and
    each rank raises GroupError with the same words."""
    if place.rank == 0:
        _host(place, join_s, nodes)
    else:
        _guest(place, join_s, nodes)


def _host(place: Meeting, join_s: float, nodes: Sequence[str]) -> None:
    at = f"{place.host}:{place.port}"
    try:
        listener = socket.create_server((place.host, place.port))
    except OSError as exc:
        raise GroupError(
            f"rank 0 ({nodes[0]}) cannot listen at {at} to meet the group: {exc}"
        ) from None
    came: dict[int, socket.socket] = {}
    began = said = time.monotonic()
    try:
        listener.settimeout(0.5)
        while len(came) < place.size - 1 and time.monotonic() - began < join_s:
            now = time.monotonic()
            if now - said >= _SAY_EVERY_S:
                said = now
                missing = [r for r in range(1, place.size) if r not in came]
                _say(f"waiting for {_who(missing, nodes)}: {now - began:.0f} s of {join_s:g} s")
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            rank = _hello(conn, place)
            if rank is None:
                conn.close()
                continue
            if rank in came:
                came[rank].close()  # it came again (a retry): the newer connection counts
            came[rank] = conn
    finally:
        # Closed before any "go": a rank told to go connects with MLX at once, and must
        # find MLX's listener (or none yet, which MLX retries), never this one.
        listener.close()
    missing = [r for r in range(1, place.size) if r not in came]
    word = f"fail {_absent(missing, nodes, join_s, at)}" if missing else "go"
    for conn in came.values():
        # One that left already: MLX, or its own deadline, says so.
        with conn, contextlib.suppress(OSError):
            conn.sendall(word.encode() + b"\n")
    if missing:
        raise GroupError(word.removeprefix("fail "))


def _hello(conn: socket.socket, place: Meeting) -> int | None:
    """The rank a connection says it is, or None for anything but a hello of this group."""
    conn.settimeout(5.0)
    try:
        words = _line(conn).split()
    except OSError:
        return None
    if len(words) != 4 or words[0].encode() != _HELLO or words[1] != place.token:
        return None
    try:
        rank, size = int(words[2]), int(words[3])
    except ValueError:
        return None
    return rank if size == place.size and 0 < rank < size else None


def _guest(place: Meeting, join_s: float, nodes: Sequence[str]) -> None:
    at = f"{place.host}:{place.port}"
    began = said = time.monotonic()
    hello = b"%s %s %d %d\n" % (_HELLO, place.token.encode(), place.rank, place.size)
    while True:
        left = join_s - (time.monotonic() - began)
        if left <= 0:
            raise GroupError(_absent([0], nodes, join_s, at))
        now = time.monotonic()
        if now - said >= _SAY_EVERY_S:
            said = now
            _say(f"waiting for {_who([0], nodes)} at {at}: {now - began:.0f} s of {join_s:g} s")
        try:
            conn = socket.create_connection((place.host, place.port), timeout=2.0)
        except OSError:
            time.sleep(0.2)
            continue
        with conn:
            try:
                conn.sendall(hello)
                # Rank 0 answers when all came or its time is up; a little after ours.
                conn.settimeout(left + 10.0)
                word = _line(conn)
            except TimeoutError:
                raise GroupError(
                    f"rank 0 ({nodes[0]}) at {at} took this rank's hello but said nothing "
                    f"within {join_s:g} s (is it stopped?)"
                ) from None
            except OSError:
                word = ""
        if word == "go":
            # Rank 0 starts MLX's listener just after its last "go": connecting before
            # it does costs a full second of MLX's retry wait.
            time.sleep(_AFTER_GO_S)
            return
        if word.startswith("fail "):
            raise GroupError(word.removeprefix("fail "))
        time.sleep(0.2)  # closed without a word (rank 0 restarting): try again


def _line(conn: socket.socket, limit: int = 4096) -> str:
    """One line from `conn` ("" at its end), at most `limit` bytes."""
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = conn.recv(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _say(text: str) -> None:
    """A line in the rank's log (its stderr, which the agent keeps)."""
    sys.stderr.write(f"joining: {text}\n")
    sys.stderr.flush()
