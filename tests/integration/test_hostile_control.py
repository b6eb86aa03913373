"""The agent's control socket, from the one key allowed to drive it, with the requests
the socket fuzz leaves out because a right one would change the node (load_shard,
prepare_shard, unload, jobs, files, benches): each with fields of the wrong type, out of
range, missing or nested junk. Property: every request gets a reply (an error naming
what is wrong), the agent stays up, starts nothing that outlives the request, and
answers as before.

The agent listens on 127.0.0.152:58950.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import psutil
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from studiotui.cluster import keys
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.protocol import PROTOCOL_VERSION, control, curve

# Everything that drives the node but shutdown (which stops it on purpose) and what
# reaches out to endpoints the message names (measure_links, fetch_files, hub_download).
TYPES = [
    "load_shard", "prepare_shard", "renew_shards", "unload", "read_log", "open_sink",
    "close_sink", "device_bench", "stop_bench", "files_status", "files_commit",
    "serve_files", "unserve_files", "job_ports", "start_job", "follow_job", "job_status",
    "stop_job", "forget_job",
]  # fmt: skip
FIELDS = [
    "placement", "model_dir", "start", "end", "index", "shards", "peers", "name", "path",
    "files", "lines", "job", "job_id", "kind", "params", "args", "seconds", "matmul_n",
    "copy_mib", "port", "ports", "hops", "dtype", "context_tokens", "prefill_chunk",
    "streams", "token", "manifest", "root", "spec", "data_port", "client_port",
]  # fmt: skip
EXAMPLES = 12  # per type: ~230 requests

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=16)
    | st.sampled_from(["../../etc/passwd", "/", "", "0", "-1", "\x00"])
    | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
requests = st.tuples(
    st.sampled_from(TYPES),
    st.dictionaries(st.sampled_from(FIELDS), junk, min_size=1, max_size=5),
)


@pytest.fixture(scope="module")
def one_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("hostile-control"), 1, 152, 58950)


def draw() -> list[tuple[str, dict[str, Any]]]:
    batch: list[tuple[str, dict[str, Any]]] = []

    @settings(
        max_examples=EXAMPLES * len(TYPES),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests)
    def collect(request: tuple[str, dict[str, Any]]) -> None:
        batch.append(request)

    collect()
    return batch


def test_wrong_typed_requests_from_the_controller_are_answered_and_change_nothing(
    one_agent: LocalCluster,
) -> None:
    node = one_agent.inventory.nodes[0]
    agent = psutil.Process(one_agent.pids[node.name])
    batch = draw()
    replies: dict[int, control.Message] = {}

    async def go() -> control.Message:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            curve.make_client(
                sock,
                keys.controller_keys(one_agent.home),
                keys.node_public_key(one_agent.home, node.name),
            )
            sock.connect(node.control_endpoint)
            for rid, (kind, fields) in enumerate(batch, 1):
                envelope = {"v": PROTOCOL_VERSION, "type": kind, "id": rid}
                raw = msgspec.msgpack.encode({**envelope, **fields})
                await sock.send(raw)
                # One at a time: each must be answered, not merely survived.
                deadline = time.monotonic() + 30
                while rid not in replies:
                    left = deadline - time.monotonic()
                    assert left > 0, f"no reply to {kind} {fields!r}"
                    try:
                        # Every reply is a message the controller's decoder takes.
                        msg = control.decode(await asyncio.wait_for(sock.recv(), left))
                    except TimeoutError:
                        before = [
                            (batch[i - 1], replies[i].kind, str(replies[i])[:150])
                            for i in range(max(1, rid - 4), rid)
                        ]
                        raise AssertionError(
                            f"no reply to {kind} {fields!r} after {before}"
                        ) from None
                    if isinstance(msg.re, int):
                        replies.setdefault(msg.re, msg)
                assert agent.is_running(), (kind, fields)
            await sock.send(control.encode(control.ListShards(id=0)))
            while True:
                msg = control.decode(await asyncio.wait_for(sock.recv(), 10))
                if msg.re == 0:
                    return msg
        finally:
            sock.close(linger=0)
            ctx.term()

    listed = asyncio.run(go())
    # A prepare_shard whose fields happen to be right is a real request: it reserves
    # ports (until its lease lapses) and starts nothing. Nothing else is left.
    assert isinstance(listed, control.Shards), listed
    assert all(s.state == "prepared" and s.pid is None for s in listed.shards), listed
    kinds = {replies[rid].kind for rid in replies}
    assert "error" in kinds, kinds
    for rid, msg in replies.items():
        if isinstance(msg, control.Error):
            kind, fields = batch[rid - 1]
            assert msg.message and "Traceback" not in msg.message, (kind, fields, msg)
            # A junk request is the asker's mistake or a refusal, never a handler's bug.
            assert msg.code != "internal", (kind, fields, msg)
    # Nothing started by a junk request is left running (a runner, a job, a bench).
    for _ in range(50):
        children = [c for c in agent.children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
        if not children:
            break
        time.sleep(0.2)
    assert not children, [c.cmdline() for c in children]
    assert agent.is_running()
