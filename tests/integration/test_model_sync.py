"""Model files between nodes, on a real local cluster: agent to agent, none via the operator.

Every byte the operator exchanges with the agents goes through a counting TCP relay
(the controller's inventory names the relay's ports, the agents bind their own), so
"the operator moved no model bytes" is measured, not assumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from studiotui.cluster import local_cluster, model_sync
from studiotui.cluster.controller import Controller
from studiotui.cluster.model_files import needed_files
from studiotui.core.inventory import Inventory
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.manifest import CACHE_NAME, manifest, part_name

RELAY_OFFSET = 100


@pytest.fixture()
def trio(tmp_path: Path) -> Iterator[LocalCluster]:
    """Three agents of their own (127.0.0.71-73:57700), stopped by pid afterwards."""
    yield from cluster_fixture(tmp_path / "home", 3, 71, 57700, memory_gb=2.0)


class Relay:
    """A TCP relay in front of each agent's control and telemetry ports, counting bytes."""

    def __init__(self) -> None:
        self.bytes = 0
        self.servers: list[asyncio.Server] = []

    async def start(self, inventory: Inventory) -> Inventory:
        for node in inventory.nodes:
            for port in (node.control_port, node.control_port + 1):
                server = await asyncio.start_server(
                    lambda r, w, a=node.address, p=port: self._pipe(r, w, a, p),
                    node.address,
                    port + RELAY_OFFSET,
                )
                self.servers.append(server)
        nodes = tuple(
            replace(n, control_port=n.control_port + RELAY_OFFSET) for n in inventory.nodes
        )
        return replace(inventory, nodes=nodes)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str, port: int
    ) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(address, port)
        except OSError:
            writer.close()
            return

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    self.bytes += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(copy(reader, up_w), copy(up_r, writer))

    def close(self) -> None:
        for server in self.servers:
            server.close()


def _model(tmp: Path, seed: int = 1) -> Path:
    return write_demo_model(tmp / "m", DemoSpec(layers=8, files=4, seed=seed, dtype="float32"))


def test_nodes_feed_each_other_and_the_operator_moves_no_model_bytes(
    trio: LocalCluster, tmp_path: Path
) -> None:
    model = _model(tmp_path)
    a, b, c = (n for n in trio.inventory.nodes)
    # Node a holds the whole model (downloaded there earlier, say) in its copy folder.
    held = Path(a.workdir) / "models" / "m"
    shutil.copytree(model, held)
    shards = {b.name: needed_files(model, 0, 4, 8), c.name: needed_files(model, 4, 8, 8)}
    model_bytes = sum(f.size for fs in shards.values() for f in fs)
    # Node c already has a part of one of its files from an interrupted copy.
    big = max(shards[c.name], key=lambda f: f.size)
    big_id = manifest(model, [big.name])[big.name]
    (Path(c.workdir) / "models" / "m").mkdir(parents=True)
    part = Path(c.workdir) / "models" / "m" / part_name(big_id)
    part.write_bytes((model / big.name).read_bytes()[: big.size // 2])

    async def run() -> tuple[dict[str, str], int, list[str], dict[str, list[tuple[int, int]]]]:
        relay = Relay()
        ctl = Controller(trio.home, await relay.start(trio.inventory))
        seen: dict[str, list[tuple[int, int]]] = {}
        try:
            await ctl.refresh()
            before = relay.bytes
            where = await model_sync.provide(
                ctl, model, shards, lambda n, d, t: seen.setdefault(n, []).append((d, t))
            )
            return where, relay.bytes - before, [e.text for e in ctl.state.log], seen
        finally:
            await ctl.close()
            relay.close()

    where, operator_bytes, log, seen = asyncio.run(run())
    print(operator_bytes, "operator bytes for", model_bytes, "model bytes")
    for node, files in shards.items():
        folder = Path(where[node])
        assert folder == (Path(trio.inventory.node(node).workdir) / "models" / "m").resolve()
        assert {p.name for p in folder.iterdir()} == {f.name for f in files} | {CACHE_NAME}
        for f in files:
            assert (folder / f.name).read_bytes() == (model / f.name).read_bytes(), f.name
        assert any(f"to {node} from {a.name} over {a.address}:" in t for t in log), log
        assert seen[node][-1][0] == seen[node][-1][1] > 0
    assert any(f"{c.name}: resuming" in t for t in log), log
    assert any(t.startswith("hashed ") and " GB of m in " in t for t in log), log
    # Control messages only: far below the model bytes the two nodes received.
    assert operator_bytes < model_bytes / 20, (operator_bytes, model_bytes)
    # Node a lost its copy; b and c each hold half of what a needs: a gets each file
    # from whichever node holds it, both at once, and still nothing via the operator.
    shutil.rmtree(held)
    every = needed_files(model, 0, 8, 8)

    async def again() -> tuple[int, list[str]]:
        relay = Relay()
        ctl = Controller(trio.home, await relay.start(trio.inventory))
        try:
            await ctl.refresh()
            before = relay.bytes
            await model_sync.provide(ctl, model, {a.name: every})
            return relay.bytes - before, [e.text for e in ctl.state.log]
        finally:
            await ctl.close()
            relay.close()

    operator_bytes, log = asyncio.run(again())
    for source in (b, c):
        assert any(f"to {a.name} from {source.name} over" in t for t in log), log
    assert operator_bytes < sum(f.size for f in every) / 20
    for f in every:
        assert (held / f.name).read_bytes() == (model / f.name).read_bytes(), f.name

    # The hashes landed in each folder's cache: a second look hashes nothing.
    hashed: list[int] = []
    got = manifest(Path(where[c.name]), [big.name], on_bytes=hashed.append)
    assert got[big.name] == big_id and hashed == []


def test_a_node_to_node_copy_killed_halfway_resumes_from_its_part(
    trio: LocalCluster, tmp_path: Path
) -> None:
    """The target's agent is killed mid-copy (the source frozen first, so "mid" is
    certain); started again, the next copy sends only what had not landed."""
    model = write_demo_model(
        tmp_path / "big", DemoSpec(layers=2, hidden=1024, heads=8, kv_heads=4, dtype="float32")
    )
    a, b, _c = trio.inventory.nodes
    shutil.copytree(model, Path(a.workdir) / "models" / "big")
    files = needed_files(model, 0, 2, 2)
    weights = max(files, key=lambda f: f.size)
    assert weights.size > 40 * 1024 * 1024  # more than the chunks a fetch keeps in flight
    folder = Path(b.workdir) / "models" / "big"
    part = folder / part_name(manifest(model, [weights.name])[weights.name])
    source_pid = trio.pids[a.name]

    async def run() -> list[str]:
        ctl = trio.controller()
        try:
            await ctl.refresh()
            copy = asyncio.create_task(model_sync.provide(ctl, model, {b.name: files}))
            while not (part.is_file() and part.stat().st_size):
                assert not copy.done(), copy
                await asyncio.sleep(0.002)
            os.kill(source_pid, signal.SIGSTOP)
            try:
                os.kill(trio.pids[b.name], signal.SIGKILL)
                assert local_cluster.wait_gone(trio.pids[b.name], 5.0)
            finally:
                os.kill(source_pid, signal.SIGCONT)
            copy.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await copy
            assert 0 < part.stat().st_size < weights.size
            trio.pids[b.name] = local_cluster.start_agent(trio.home, b, trio.inventory)
            for _ in range(100):
                await ctl.refresh(timeout=1.0)
                if ctl.state.node(b.name).state == "up":  # type: ignore[union-attr]
                    break
            mark = len(ctl.state.log)
            await model_sync.provide(ctl, model, {b.name: files})
            # Only the copy's entry tells of files received (what `fetch` prints).
            return [
                e.text for e in ctl.state.log[mark:] if e.topic == "files" or "resuming" in e.text
            ]
        finally:
            await ctl.close()

    log = asyncio.run(run())
    assert any(t.startswith(f"{b.name}: resuming ") for t in log), log
    copied = next(t for t in log if t.startswith("copied ") and f"to {b.name} from {a.name}" in t)
    assert [t for t in log if "resuming" not in t] == [copied], log
    assert float(copied.split()[1]) * 1e6 < sum(f.size for f in files), copied
    assert (folder / weights.name).read_bytes() == (model / weights.name).read_bytes()
    assert not list(folder.glob("*.studiotui-part"))


def test_a_file_server_answers_only_cluster_keys_and_only_granted_files(
    trio: LocalCluster, tmp_path: Path
) -> None:
    import zmq
    import zmq.asyncio

    from studiotui.cluster import keys
    from worker.shared.protocol import control, curve

    model = _model(tmp_path)
    a = trio.inventory.nodes[0]
    shutil.copytree(model, Path(a.workdir) / "models" / "m")
    server_key = keys.node_public_key(trio.home, a.name)
    member = curve.load_keypair(Path(trio.inventory.nodes[1].workdir) / "keys" / "self.key_secret")
    stranger = curve.CurveKeys(*zmq.curve_keypair())

    async def ask(ctx: zmq.asyncio.Context, who: curve.CurveKeys, port: int, **read: object):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        curve.make_client(sock, who, server_key)
        sock.connect(f"tcp://{a.address}:{port}")
        try:
            await sock.send(control.encode(control.build("read", offset=0, length=16, **read)))
            if not await sock.poll(2000):
                return None
            header, chunk = await sock.recv_multipart()
            return control.decode(header), chunk
        finally:
            sock.close(linger=0)

    async def run() -> list[object]:
        ctl = trio.controller()
        ctx = zmq.asyncio.Context()
        try:
            grant = await ctl.peer(a.name).ask(
                "serve_files",
                control.Granted,
                dir="models/m",
                files=[{"name": "config.json", "size": (model / "config.json").stat().st_size}],
            )
            port, token = grant.port, grant.token
            return [
                await ask(ctx, member, port, token=token, name="config.json"),
                await ask(ctx, stranger, port, token=token, name="config.json"),
                await ask(ctx, member, port, token=token, name="model.safetensors"),
                await ask(ctx, member, port, token="0" * 32, name="config.json"),
                await ask(ctx, member, port, token=token, name="../../keys/self.key_secret"),
            ]
        finally:
            ctx.term()
            await ctl.close()

    granted, stranger_asked, other_file, bad_token, escape = asyncio.run(run())
    assert granted is not None and granted[1] == (model / "config.json").read_bytes()[:16]
    assert stranger_asked is None  # CURVE: a key not authorized gets no answer at all
    for refused in (other_file, bad_token, escape):
        assert refused is not None and isinstance(refused[0], control.Error), refused
        assert refused[0].code == "not_found" and "not being served" in refused[0].message
        assert refused[1] == b""
