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

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import mlx.core as mx

Backend = Literal["ring", "jaccl"]
# The variables a rank's join reads (rank_env), named when the join cannot happen.
_SAID = ("MLX_RANK", "MLX_WORLD_SIZE", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES")
BACKENDS: tuple[Backend, ...] = ("ring", "jaccl")


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
) -> dict[str, str]:
    """The environment one rank needs so `mx.distributed.init(backend=...)` joins the group."""
    if not 0 <= rank < size:
        raise GroupError(f"rank {rank} is outside a group of {size}")
    env = {"MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(size)}
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

    `strict=True` makes MLX raise instead of silently returning a group of one, which would
    compute a wrong answer (a 1/N slice of every layer) without any error.
    """
    if not mx.distributed.is_available(backend):
        # Say what the rank was given, so a launch can be checked where it cannot run.
        given = ", ".join(f"{k}={v}" for k, v in sorted((env or {}).items()) if k in _SAID)
        raise GroupError(
            f"MLX here has no {backend!r} distributed backend" + (f" ({given})" if given else "")
        )
    group = mx.distributed.init(strict=True, backend=backend)
    want = (env or {}).get("MLX_WORLD_SIZE")
    if want is not None and group.size() != int(want):
        raise GroupError(f"joined a group of {group.size()}, expected {want}")
    return group
