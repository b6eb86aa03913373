"""A tensor-parallel stage: one process per node, each holding a 1/N slice of the layers.

The ranks of a group compute one forward together: every sharded layer ends in an
`mx.distributed.all_sum` (mlx-lm's own `shard()` put it there), so every rank must
evaluate the same steps, on the same inputs, in the same order, or the all-reduces
pair up wrongly and the answer is garbage (or the group hangs).

How the followers learn what to compute: the leader (rank 0) is the stage as a
one-node stage is (its ZeroMQ ring and client sockets, its stage logic); every
follower runs the very same `Stage` code on the same events, as mlx-lm's own tensor
parallel runs the same generate loop on every rank. The leader's serving loop runs
one work item at a time; before each it tells its followers, over a CURVE PUSH on
the bridge address, which one it is:

* an item that came from outside (a ring frame, a client's generate or cancel, a
  client that went away): the item's bytes, which the follower turns into the same
  job with the same code;
* an item its own stage scheduled (the next prefill chunk, a one-stage ring's token
  looping back): one byte, `INTERNAL`. The follower's stage scheduled the same item
  at the same point (it ran the same items before), into its own queue; it runs the
  oldest.

So the followers run the leader's exact sequence of items and, the stage being a
deterministic function of that sequence, the same MLX evaluations in the same
order. Sampling is part of it: the all-reduced logits are bit-identical on every
rank (a ring all-reduce sums each chunk once and broadcasts it), so each rank's
sampler, seeded by the request, draws the same token (mlx-lm relies on the same).
Followers send nothing to the ring or to clients: their links go nowhere.

Why not send the arrays over `mx.distributed` itself: a `send`/`recv` pair is a
graph op that blocks both processes until evaluated, and the leader's next input is
known only when it arrives on a socket; a PUSH lets the leader go on at once and the
follower block in its own `recv`, which the all-reduces already pace.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import zmq

from worker.group import Backend, GroupError, join
from worker.shared.protocol import curve

INTERNAL = b"i"
RING = b"r"
GENERATE = b"g"
CANCEL = b"c"
KINDS = (INTERNAL, RING, GENERATE, CANCEL)
# Items the leader may be ahead of a follower by. Past it a send blocks the leader,
# which the all-reduces would make it wait for anyway.
MIRROR_HWM = 100_000


class MirrorError(RuntimeError):
    pass


@dataclass
class Outside:
    """A work item that came from outside the stage, with the frames a follower needs
    to make the same job."""

    job: Callable[[], None]
    event: list[bytes | memoryview]

    def __call__(self) -> None:
        self.job()


class Mirror:
    """The leader's side: one CURVE PUSH per follower, told every item before it runs."""

    def __init__(
        self, ctx: zmq.Context, keys: curve.CurveKeys, followers: Sequence[Sequence[str]]
    ) -> None:
        self.socks: list[zmq.Socket] = []
        for endpoint, key in followers:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, MIRROR_HWM)
            curve.make_client(sock, keys, key.encode())
            sock.connect(endpoint)
            self.socks.append(sock)
        self.sent = 0

    def before(self, item: Callable[[], None]) -> None:
        event = item.event if isinstance(item, Outside) else [INTERNAL]
        for sock in self.socks:
            sock.send_multipart(event, copy=False)
        self.sent += 1

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)


def lost_member(message: str) -> bool:
    """Whether a step failed because the group's `mx.distributed` link broke (a member
    died): MLX's backends raise "[ring] ..." / "[jaccl] ..." from the all-reduce."""
    return "[ring]" in message or "[jaccl]" in message


def check_event(frames: Sequence[bytes]) -> bytes:
    """The kind of a mirrored item, or MirrorError for frames no leader sends."""
    if not frames or frames[0] not in KINDS:
        raise MirrorError(f"not a mirrored work item: {[bytes(f[:8]) for f in frames[:3]]}")
    want = {INTERNAL: 1, RING: 3, GENERATE: 2, CANCEL: 2}[frames[0]]
    if len(frames) != want:
        raise MirrorError(f"a {frames[0]!r} item has {len(frames)} frames, not {want}")
    return frames[0]


def join_group(backend: str, rank: int, size: int, env: Mapping[str, str] | None = None) -> Any:
    """Join the stage's `mx.distributed` group (the agent set the environment MLX reads)."""
    env = os.environ if env is None else env
    if backend not in ("ring", "jaccl"):
        raise GroupError(f"unknown backend {backend!r} for a tensor group")
    chosen: Backend = "ring" if backend == "ring" else "jaccl"
    group = join(chosen, env)
    if group.rank() != rank or group.size() != size:
        raise GroupError(
            f"joined as rank {group.rank()} of {group.size()}, expected {rank} of {size}"
        )
    # The first all-reduce sets the ring's connections up: do it now, not on the first
    # token, so a member that cannot reach the others fails the load, with its reason.
    mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))
    return group
