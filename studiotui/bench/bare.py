"""The two ends of a bare CURVE ZeroMQ hop: each a PULL server and a PUSH client to the
other end, with the ring's options, and nothing else (no engine, no request logic).

`studiotui bench` measures its floors with them: `bare_hop_us` (a frame out and one back
between two otherwise idle processes, `studiotui/bench/batching.py`) and
`moe_pipe2_floor_ratio` (two processes running a model's two shards over one such hop
each way, `studiotui/bench/pipe_floor.py`). Both ends live on keys of their own, "a" and "b",
under a home directory that only they use.
"""

from __future__ import annotations

from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from worker.shared.protocol import curve

ENDS = ("a", "b")


def pair_keys(home: Path) -> None:
    """Keypairs for both ends under `home`, each end authorizing the other."""
    keys = curve.key_dir(home)
    for name in ENDS:
        pair = curve.ensure_keypair(keys, name)
        curve.write_public_key(curve.authorized_dir(home), name, pair.public)


class BareEnd:
    """One end: a CURVE PULL server bound at `bind` and a PUSH client connected to the
    other end at `peer`, with the ring's options (`curve.make_server` / `make_client`,
    LINGER 0) and an authenticator that knows the other end's key, as a runner does."""

    def __init__(self, home: Path, me: str, bind: str, peer: str, max_bytes: int = 1 << 20) -> None:
        keys = curve.load_keypair(curve.key_dir(home) / f"{me}.key_secret")
        other = ENDS[1] if me == ENDS[0] else ENDS[0]
        peer_key = curve.load_public_key(curve.key_dir(home) / f"{other}.key")
        self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(curve.authorized_dir(home)))
        self.pull = self.ctx.socket(zmq.PULL)
        curve.make_server(self.pull, keys, max_bytes=max_bytes)
        self.pull.bind(bind)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        curve.make_client(self.push, keys, peer_key)
        self.push.connect(peer)

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.auth.stop()
        self.ctx.term()
