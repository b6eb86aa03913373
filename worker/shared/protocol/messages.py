"""Control-plane messages: msgpack maps carrying a protocol version and a type.

Every message from the network goes through `decode`, which checks the version,
the type and the type of every required field, so handlers never see a
malformed message: they get a `MessageError` to answer or count instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from worker.shared.protocol.limits import MAX_CONTROL_BYTES
from worker.shared.protocol.packing import pack

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = MAX_CONTROL_BYTES

_NUM = (int, float)
_STR_LIST = (list, tuple)

# type -> {field: accepted python types}. Optional fields are not listed; handlers
# read them with .get() and a default.
SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    # controller -> agent
    "hello": {},
    "prepare_shard": {"placement": (str,)},
    "renew_shards": {"placements": _STR_LIST},
    "load_shard": {
        "placement": (str,),
        "model_dir": (str,),
        "start": (int,),
        "end": (int,),
        "index": (int,),
        "count": (int,),
        "data_port": (int,),
        "client_port": (int,),
        "next_endpoint": (str,),
        "next_key": (str,),
    },
    "unload": {"placement": (str,)},
    "list_shards": {},
    "measure_links": {"peers": (list,)},
    "ping_peer": {},
    # agent -> agent, measuring a link over the kind of socket the ring uses
    "open_sink": {"token": (str,)},
    "sink_open": {"port": (int,)},
    "close_sink": {"token": (str,)},
    "sink_result": {"bytes": (int,), "seconds": _NUM, "messages": (int,)},
    "shutdown": {},
    "read_log": {},
    # model files (worker/files.py): controller -> agent, agent -> agent
    "files_status": {"dirs": (list,), "files": (list,)},
    "files_commit": {"dir": (str,), "files": (list,)},
    "serve_files": {"dir": (str,), "files": (list,)},
    "unserve_files": {"token": (str,)},
    "fetch_files": {
        "dir": (str,),
        "files": (list,),
        "endpoint": (str,),
        "key": (str,),
        "token": (str,),
    },
    "hub_download": {"repo": (str,), "revision": (str,), "files": (list,)},
    "read": {"token": (str,), "name": (str,), "offset": (int,), "length": (int,)},
    "chunk": {"offset": (int,)},
    "file_progress": {"stage": (str,), "done": _NUM, "total": _NUM},
    # a node's device benchmark (worker/device_bench.py): controller -> agent, then its steps
    "device_bench": {"sizes": (dict,)},
    "bench_step": {"step": (str,)},
    "stop_bench": {},  # the measurement asked for was given up: end its process now
    # cluster jobs (worker/jobs.py): controller -> agent, then agent -> controller
    "job_ports": {},
    "start_job": {"job": (str,), "job_kind": (str,), "rank": (int,), "size": (int,)},
    "follow_job": {"job": (str,)},
    "job_status": {},
    "stop_job": {"job": (str,)},
    "forget_job": {"job": (str,)},
    "job_started": {"job": (str,), "rank": (int,)},
    "job_event": {"event": (str,), "seq": (int,)},
    "job_beat": {"job": (str,), "state": (str,)},
    "job_end": {"job": (str,), "state": (str,)},
    "jobs": {"jobs": (list,)},
    "job_stopped": {"job": (str,), "state": (str,)},
    # agent -> controller
    "hello_reply": {"name": (str,), "version": (str,), "pid": (int,)},
    "prepared": {"placement": (str,), "data_port": (int,), "client_port": (int,)},
    "renewed": {"placements": _STR_LIST},
    "progress": {"placement": (str,), "done": _NUM, "total": _NUM},
    "shard_ready": {"placement": (str,), "start": (int,), "end": (int,)},
    "unloaded": {"placement": (str,)},
    "shards": {"shards": (list,)},
    "links": {"links": (list,)},
    "log": {"lines": (list,)},
    "ok": {},
    "error": {"message": (str,)},
    "telemetry": {"name": (str,), "time": _NUM},
    # client -> head shard
    "generate": {"rid": (str,), "params": (dict,)},
    "cancel": {"rid": (str,)},
    "stats": {},
    "cache_clear": {},  # empty the placement's prefix cache (every stage)
    # head shard -> client
    "accepted": {"rid": (str,), "prompt_tokens": (int,)},
    "delta": {"rid": (str,), "text": (str,), "tokens": (list,)},
    "done": {"rid": (str,), "finish_reason": (str,), "usage": (dict,)},
    "failed": {"rid": (str,), "message": (str,)},
    "stats_reply": {"placement": (str,)},
}


class MessageError(ValueError):
    """A message from the network that cannot be accepted; the text says why. `re`:
    the request's id when the message was a map with one, so the error reply reaches
    the request that waits for it (without it the sender waits out its timeout)."""

    re: int | str | None = None


def make(kind: str, **fields: Any) -> dict[str, Any]:
    """Build a message map, checked against the schema like one received."""
    msg = {"v": PROTOCOL_VERSION, "type": kind, **fields}
    validate(msg)
    return msg


def encode(kind: str, **fields: Any) -> bytes:
    return pack(make(kind, **fields))


def decode(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES} limit")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError(f"not a msgpack message: {exc}") from None
    try:
        validate(msg)
    except MessageError as exc:
        rid = msg.get("id") if isinstance(msg, Mapping) else None
        if isinstance(rid, int | str) and not isinstance(rid, bool):
            exc.re = rid
        raise
    return msg


def validate(msg: Any) -> None:
    if not isinstance(msg, Mapping):
        raise MessageError(f"expected a map, got {type(msg).__name__}")
    version = msg.get("v")
    if version != PROTOCOL_VERSION:
        raise MessageError(
            f"protocol version {version!r} is not {PROTOCOL_VERSION}; "
            "run the same studiotui version on both sides (provision --upgrade)"
        )
    kind = msg.get("type")
    if kind not in SCHEMA:
        raise MessageError(f"unknown message type {kind!r}")
    for field, types in SCHEMA[kind].items():
        if field not in msg:
            raise MessageError(f"{kind}: missing field {field!r}")
        value = msg[field]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            names = "/".join(t.__name__ for t in types)
            raise MessageError(
                f"{kind}: field {field!r} should be {names}, got {type(value).__name__}"
            )
