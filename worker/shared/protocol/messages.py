"""The control plane's envelope: its version, the codes of an error reply, the errors.

A message on the wire is a msgpack map: `type` (its struct's tag), `v` (the protocol
version), `id` on a request and `re` on each reply to it, and the message's own fields.
`control.py` holds every message as a msgspec struct tagged by its type and reads one
off the wire once, straight into its struct (`control.decode`).

An error reply carries a stable `code` (`ErrorCode`) beside its words: a reader decides
on the code (the API's HTTP status, a retry), never on the wording, which may change.
"""

from __future__ import annotations

from typing import Literal

from worker.shared.protocol.limits import MAX_CONTROL_BYTES

# 2: messages became tagged structs; answers that were all "ok" are told apart by type,
# and errors carry a code.
PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = MAX_CONTROL_BYTES

# Why a request failed, as its sender raised it (the agent, a head shard, a runner):
#   bad_request      the message or one of its fields is wrong (the asker's mistake)
#   unknown_request  a type this peer does not serve
#   not_authorized   the sender's key may not ask this
#   busy             too much at once here (control tasks, a running benchmark, every
#                    stream of a placement taken): the same request may succeed later
#   conflict         the thing asked for is in a state that forbids it (a placement
#                    already loaded here, a job still running, a request id in flight)
#   not_prepared     load_shard for a placement not prepared here
#   not_found        no such thing here (a link sink, a file, a job)
#   no_space         the node's disk cannot hold what was asked
#   out_of_memory    the node ran out of memory doing it (a shard killed while loading)
#   load_failed      a shard's process ended before it was ready, for another reason
#   bench_failed     a measurement gave no figures
#   failed           the work failed on the node after it was accepted
#   internal         a bug in the peer (an exception no handler expected)
ErrorCode = Literal[
    "bad_request",
    "unknown_request",
    "not_authorized",
    "busy",
    "conflict",
    "not_prepared",
    "not_found",
    "no_space",
    "out_of_memory",
    "load_failed",
    "bench_failed",
    "failed",
    "internal",
]
ERROR_CODES: tuple[ErrorCode, ...] = ErrorCode.__args__  # type: ignore[attr-defined]


class MessageError(ValueError):
    """A message from the network that cannot be accepted; the text says why. `re`:
    the request's id when the message was a map with one, so the error reply reaches
    the request that waits for it (without it the sender waits out its timeout)."""

    re: int | str | None = None


class CodedError(RuntimeError):
    """A request refused or failed with an `ErrorCode` (raised by a handler, answered
    as an `Error` reply with this code and words)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
