"""Big loads: the deadline logic and the words for a shard that died loading, pure."""

from __future__ import annotations

import signal

from studiotui.core.load_watch import LOAD_SILENCE_S, NODE_DOWN_S, LoadWatch, node_gone
from worker.agent import LOAD_HEARTBEAT_S, exit_reason
from worker.runner import fatal_message
from worker.shard import ShardLoadError

GB = 1024**3


def test_a_slow_disk_never_trips_the_deadline_while_the_node_heartbeats() -> None:
    # 110 GB at 20 MB/s: a 95-minute load whose bytes move only once per 11 GB layer
    # (every ~9 minutes), with a heartbeat every 2 s carrying the same figure.
    watch = LoadWatch("mac-1", heard=0.0)
    total, layer, rate = 110 * GB, 11 * GB, 20 * 1024**2
    now, done = 0.0, 0
    while done < total:
        now += LOAD_HEARTBEAT_S
        done = min(total, int(now * rate) // layer * layer)
        assert watch.overdue(now) is None, now
        watch = watch.hear(now, done, total)
        assert watch.deadline == now + LOAD_SILENCE_S
    assert now > 90 * 60 and watch.done == total


def test_silence_ends_a_load_and_says_how_far_it_got() -> None:
    watch = LoadWatch("mac-2", heard=100.0).hear(130.0, 53 * GB, 120 * GB)
    assert watch.overdue(130.0 + LOAD_SILENCE_S - 0.1) is None
    reason = watch.overdue(130.0 + LOAD_SILENCE_S)
    assert reason is not None
    assert "mac-2 said nothing for 30 s" in reason and "53.0 GB of 120.0 GB loaded" in reason
    # A late or out-of-order timestamp never moves the deadline back.
    assert watch.hear(120.0).deadline == watch.deadline
    # Silent from the start: before any weight was read.
    assert "before it started reading weights" in (LoadWatch("m", 0.0).overdue(31.0) or "")


def test_heartbeats_come_well_inside_the_silence_allowed() -> None:
    assert LOAD_SILENCE_S >= 10 * LOAD_HEARTBEAT_S


def test_a_shard_that_ran_out_of_memory_is_said_to_have() -> None:
    killed = exit_reason(-signal.SIGKILL, loading=True)
    assert killed.startswith("out of memory while loading") and "SIGKILL" in killed
    served = exit_reason(-signal.SIGKILL, loading=False)
    assert served.startswith("shard process exited with code -9") and "out of memory?" in served
    assert exit_reason(1, loading=True) == "shard process exited with code 1"
    # The runner's own last word wins: it knows more than the exit code.
    assert exit_reason(1, loading=True, fatal="bad config") == "bad config"

    try:
        try:
            raise MemoryError()
        except MemoryError:
            raise ShardLoadError("cannot read the weights of model.layers.3: ") from None
    except ShardLoadError as wrapped:
        said = fatal_message(wrapped, loading=True)
    assert said.startswith("out of memory while loading: cannot read the weights")
    metal = RuntimeError("[metal::malloc] Attempting to allocate 12 GB which is greater …")
    assert fatal_message(metal, loading=True).startswith("out of memory while loading")
    assert fatal_message(MemoryError(), loading=False) == "out of memory while serving: MemoryError"
    assert fatal_message(ShardLoadError("no config.json"), loading=True) == "no config.json"


def test_a_node_is_gone_when_its_connection_closed_or_it_stayed_silent_not_at_one_late_check() -> (
    None
):
    assert node_gone("studio-2", down_for=0.0, silent_for=4.0) is None  # one or two late checks
    assert "connection closed" in (
        node_gone("studio-2", down_for=NODE_DOWN_S, silent_for=2.0) or ""
    )
    silent = node_gone("studio-2", down_for=0.0, silent_for=LOAD_SILENCE_S)
    assert silent is not None and "studio-2 stopped answering" in silent
