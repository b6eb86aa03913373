"""What a runner tells its agent: one JSON object a line on its stdout, typed.

Each line is one of the structs below, told apart by its `event` field. The runner
writes them with `encode`; the agent reads them with `decode`, which checks every
field and raises `EventError` for a line that is not one of them (the agent counts
it as a bad line and reads on).
"""

from __future__ import annotations

import msgspec

from worker.shared.protocol.control import ShardStats


class EventError(ValueError):
    """A runner's line that is not an event; the text says why."""


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="event"):
    """A runner's event (fields a line carries that an event does not name are ignored)."""


class Beat(Event, frozen=True, kw_only=True, tag="beat"):
    """The runner lives; how long the step it is in has run (0: between steps)."""

    step_s: float = 0.0


class Loading(Event, frozen=True, kw_only=True, tag="progress"):
    """Weight bytes read so far while the shard loads."""

    done: int
    total: int


class Ready(Event, frozen=True, kw_only=True, tag="ready"):
    param_bytes: int
    start: int
    end: int
    active_bytes: int = 0


class Stats(ShardStats, frozen=True, kw_only=True, tag_field="event", tag="stats"):
    """The runner's counters, once a second (what the agent reports as the shard's)."""


class Fatal(Event, frozen=True, kw_only=True, tag="fatal"):
    """The runner's last word before it exits: why (and whether memory ran out, which
    the agent answers a load with as code out_of_memory)."""

    message: str = ""
    out_of_memory: bool = False


RunnerEvent = Beat | Loading | Ready | Stats | Fatal

_decoder = msgspec.json.Decoder(RunnerEvent)
_encoder = msgspec.json.Encoder()


def encode(event: RunnerEvent) -> bytes:
    """One line of the runner's stdout, newline included."""
    return _encoder.encode(event) + b"\n"


def decode(line: bytes) -> RunnerEvent:
    try:
        return _decoder.decode(line)
    except msgspec.DecodeError as exc:  # ValidationError is one too
        raise EventError(f"not a runner event: {exc}") from None
