"""Typed control messages (worker/shared/protocol/control.py): what the agent really
sends decodes, once, into the structs the controller reads; anything malformed is a
MessageError that names the message and the field, never another exception."""

from __future__ import annotations

import pytest

from studiotui.core.state import shard_from_report
from tests.support.wire import LOAD_SHARD, arrived
from worker.agent import ShardProc
from worker.shared.protocol import control, events
from worker.shared.protocol.messages import MessageError

_wire = arrived


def _shard() -> ShardProc:
    shard = ShardProc(placement="p", data_port=5001, client_port=5002)
    shard.spec = {
        "model_dir": "/m/tiny",
        "start": 2,
        "end": 4,
        "index": 1,
        "count": 2,
        "context_tokens": 1024,
        "streams": 3,
        "kv_bytes": 77,
        "prefill_chunk": 64,
    }
    shard.state, shard.progress, shard.param_bytes = "ready", (10, 20), 999
    shard.stats = control.ShardStats(tokens=5, in_flight=2, busy=0.5)
    return shard


def test_an_agents_shard_report_reads_back_as_the_shard_state() -> None:
    report = control.to_wire(_shard().describe())
    reply = _wire("shards", shards=[report])
    assert isinstance(reply, control.Shards)
    state = shard_from_report("n1", reply.shards[0])
    assert (state.placement, state.node, state.state) == ("p", "n1", "ready")
    assert (state.start, state.end, state.index, state.count) == (2, 4, 1, 2)
    assert (state.context_tokens, state.streams, state.kv_bytes) == (1024, 3, 77)
    assert (state.progress, state.param_bytes) == ((10, 20), 999)
    assert (state.data_port, state.client_port) == (5001, 5002)
    assert (state.tokens, state.in_flight) == (5, 2)


def test_telemetry_with_shards_and_unknown_fields_parses() -> None:
    msg = _wire(
        "telemetry",
        name="n1",
        time=1.5,
        version="0.1.0",
        facts={"chip": "M3 Ultra"},
        shards=[control.to_wire(_shard().describe())],
        memory_used=3,
        memory_total=8,
        cpu_pct=12,  # an int where a float is expected is a float
        gpu_pct=None,
        power={"total_w": 40.0},
        something_newer={"a": 1},
    )
    assert isinstance(msg, control.Telemetry)
    t = msg
    assert (t.name, t.memory_used, t.memory_total, t.cpu_pct) == ("n1", 3, 8, 12.0)
    assert t.shards[0].state == "ready" and t.power == {"total_w": 40.0}


@pytest.mark.parametrize(
    ("kind", "fields", "struct", "words"),
    [
        (
            "telemetry",
            {"name": "n1", "time": 1.0, "shards": [{"placement": "p", "state": "dancing"}]},
            control.Telemetry,
            "$.shards[0].state",
        ),
        ("telemetry", {"name": "n1", "time": 1.0, "shards": [7]}, control.Telemetry, "$.shards"),
        ("telemetry", {"name": "n1", "time": 1.0, "power": "hot"}, control.Telemetry, "power"),
        ("read_log", {"lines": "all"}, control.ReadLog, "$.lines"),
        ("prepare_shard", {"placement": "p", "data_port": True}, control.PrepareShard, "data_port"),
        (
            "measure_links",
            {"peers": [{"name": "b", "endpoint": "tcp://x:1"}]},
            control.MeasureLinks,
            "key",
        ),
        (
            "start_job",
            {"job": "j", "job_kind": "finetune", "rank": 0, "size": 2, "hosts": [["a", "x"]]},
            control.StartJob,
            "$.hosts[0][1]",
        ),
        (
            "start_job",
            {"job": "j", "job_kind": "k", "rank": 0, "size": 1, "spec": 3},
            control.StartJob,
            "$.spec",
        ),
        ("follow_job", {"job": "j", "since": "0"}, control.FollowJob, "$.since"),
        (
            "bench_done",
            {"figures": {"matmul": {"float32": {"n": 512, "gflops": "fast"}}}},
            control.DeviceBenchDone,
            "$.figures.matmul[...].gflops",
        ),
        (
            "jobs",
            {"node": "n", "jobs": [{"job": "j", "seq": "1"}]},
            control.JobsFound,
            "$.jobs[0].seq",
        ),
    ],
)
def test_a_malformed_message_is_a_message_error_naming_it(
    kind: str, fields: dict[str, object], struct: type[control.Wire], words: str
) -> None:
    assert control.BY_KIND[kind] is struct
    with pytest.raises(MessageError, match=kind) as caught:
        _wire(kind, **fields)
    assert words in str(caught.value)


def test_load_shard_defaults_and_types() -> None:
    fields = LOAD_SHARD
    req = _wire("load_shard", **fields)
    assert isinstance(req, control.LoadShard)
    assert (req.prefill_chunk, req.context_tokens, req.kv_bytes) == (512, 4096, 0)
    with pytest.raises(
        MessageError, match=r"load_shard: Expected `int`, got `str` - at `\$.streams`"
    ):
        _wire("load_shard", **fields, streams="4")


def test_runner_events_round_trip_and_anything_else_is_an_event_error() -> None:
    sent = [
        events.Beat(step_s=0.25),
        events.Loading(done=3, total=9),
        events.Ready(param_bytes=10, start=0, end=2, active_bytes=7),
        events.Stats(busy=0.5, tokens=4, in_flight=1, hop_us_p50=None),
        events.Fatal(message="out of memory while loading: bad_alloc", out_of_memory=True),
    ]
    lines = [events.encode(e) for e in sent]
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 for line in lines)
    assert [events.decode(line) for line in lines] == sent
    # What a runner's stats become: the shard's report, without the event's tag.
    stats = events.decode(lines[3])
    assert isinstance(stats, control.ShardStats) and stats.tokens == 4
    for line, words in [
        (b'{"event": "dance"}', "Invalid value 'dance' - at `$.event`"),
        (b'{"done": 1, "total": 2}', "missing required field `event`"),
        (b'{"event": "progress", "done": "half", "total": 2}', "at `$.done`"),
        (b"[1, 2]", "Expected `object`"),
        (b"not json {", "malformed"),
    ]:
        with pytest.raises(events.EventError, match="not a runner event") as caught:
            events.decode(line)
        assert words in str(caught.value)


def test_a_runners_stats_fields_are_all_shard_stats_fields() -> None:
    """The runner builds its stats event from `Runner._stats()`; a field added there
    and not to control.ShardStats would make the event raise, every second."""
    import ast
    import inspect

    from worker import runner

    source = inspect.getsource(runner.Runner._stats)
    returned = next(n for n in ast.walk(ast.parse(source.strip())) if isinstance(n, ast.Dict))
    keys = {k.value for k in returned.keys if isinstance(k, ast.Constant)}
    assert keys and keys <= set(control.ShardStats.__struct_fields__)
