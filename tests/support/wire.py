"""Messages as a peer sends them, for tests of the wire."""

from __future__ import annotations

import msgspec

from worker.shared.protocol import PROTOCOL_VERSION, control

# The fields every load_shard must carry (control.LoadShard's required ones).
LOAD_SHARD: dict[str, object] = {
    "placement": "p",
    "model_dir": "/m",
    "start": 0,
    "end": 2,
    "index": 0,
    "count": 1,
    "data_port": 1,
    "client_port": 2,
    "next_endpoint": "tcp://a:1",
    "next_key": "k",
}


def arrived(kind: str, **fields: object) -> control.AnyMessage:
    """A message sent as a plain map (what any sender may send, right or wrong), read by
    the one decoder every receiver uses (MessageError if it is wrong)."""
    return control.decode(msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": kind, **fields}))
