"""Trust boundaries on the operator's machine: private data is private whatever the
umask, and a stale pid file never gets another process killed."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from studiotui.chat.history import History
from studiotui.cli.main import home_dir
from studiotui.cluster import keys, local_cluster
from studiotui.core.inventory import Inventory, NodeSpec, dump_inventory
from studiotui.core.trust import HOME_MARK, home_mark, inventory_doubts
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control
from worker.shared.protocol.curve import CurveKeys, make_client


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The usual desktop umask, under which files are world-readable by default."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_studiotui_home_is_the_operators_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, open_umask: None
) -> None:
    home = tmp_path / "fresh"
    monkeypatch.setenv("STUDIOTUI_HOME", str(home))
    assert home_dir() == home and mode(home) == 0o700
    home.chmod(0o755)  # made by an older version
    home_dir()
    assert mode(home) == 0o700


def test_conversations_and_exports_are_0600(tmp_path: Path, open_umask: None) -> None:
    db = tmp_path / "chat.sqlite3"
    history = History(db)
    try:
        conv = history.create("a private question", "demo")
        history.add_message(conv.id, "user", "what is my salary?")
        wal, shm = Path(f"{db}-wal"), Path(f"{db}-shm")
        assert wal.exists() and shm.exists()
        assert {mode(p) for p in (db, wal, shm)} == {0o600}
        exported = history.export_file(conv.id, tmp_path / "exports")
        assert mode(exported) == 0o600 and "salary" in exported.read_text()
        exported.chmod(0o644)
        assert mode(history.export_file(conv.id, tmp_path / "exports")) == 0o600
    finally:
        history.close()
    db.chmod(0o644)  # a database an older version left readable to all
    History(db).close()
    assert mode(db) == 0o600


# ---- a real agent ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("trust-home"), 1, 126, 58300)


def test_the_agents_files_are_private(agent: LocalCluster) -> None:
    workdir = Path(agent.inventory.nodes[0].workdir)
    deadline = time.monotonic() + 10
    while not (workdir / "agent.log").exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert mode(workdir) == 0o700
    for name in ("agent.log", "agent.out", "agent.pid", "keys/self.key_secret"):
        assert mode(workdir / name) & 0o077 == 0, name


def test_a_stale_pid_file_never_gets_another_process_killed(agent: LocalCluster) -> None:
    node = agent.inventory.nodes[0]
    real = local_cluster.running_pid(node)
    assert real == agent.pids[node.name]

    # Another process, started later, that even looks like this node's agent.
    workdir = Path(node.workdir).resolve()
    lookalike = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "-m",
            "worker",
            "--home",
            str(workdir),
        ]
    )
    pid_file = local_cluster.pid_file(node)
    saved = pid_file.read_text()
    try:
        # The agent died hard long ago; its pid went to the lookalike.
        pid_file.write_text(str(lookalike.pid))
        an_hour_ago = time.time() - 3600
        os.utime(pid_file, (an_hour_ago, an_hour_ago))
        assert local_cluster.running_pid(node) is None
        assert local_cluster.stop_agent(node, timeout=1.0) is False
        assert lookalike.poll() is None and psutil.pid_exists(lookalike.pid)
        # The same file written after the process started does name it: the start
        # time, not the command line, is what told them apart.
        pid_file.write_text(str(lookalike.pid))
        assert local_cluster.running_pid(node) == lookalike.pid
        # A process that is not an agent at all is never named, fresh file or not.
        pid_file.write_text(str(os.getpid()))
        assert local_cluster.running_pid(node) is None
    finally:
        lookalike.kill()
        lookalike.wait()
        pid_file.write_text(saved)
    assert local_cluster.running_pid(node) == real


# ---- least privilege between nodes ------------------------------------------------------


def ask(
    endpoint: str, client: CurveKeys, server_key: bytes, kind: str, **fields: Any
) -> control.Message | None:
    """One request on a fresh CURVE connection; None if nothing comes back."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        make_client(sock, client, server_key)
        sock.connect(endpoint)
        sock.send(control.encode(control.build(kind, id=1, **fields)))
        if not sock.poll(3000):
            return None
        return control.decode(sock.recv())
    finally:
        ctx.destroy(linger=0)


def node_keypair(home: Path, name: str) -> CurveKeys:
    return keys.node_keys(home, name)


def test_only_the_controllers_key_drives_an_agent(agent: LocalCluster) -> None:
    node = agent.inventory.nodes[0]
    server = keys.node_public_key(agent.home, node.name)
    # A peer node's key: a key every node of the cluster holds the secret of one of.
    peer = node_keypair(agent.home, node.name)
    for kind, fields in (
        ("hello", {}),
        ("read_log", {}),
        ("list_shards", {}),
        ("shutdown", {}),
        ("measure_links", {"peers": []}),
        ("unload", {"placement": "x"}),
    ):
        reply = ask(node.control_endpoint, peer, server, kind, **fields)
        assert isinstance(reply, control.Error), (kind, reply)
        assert reply.code == "not_authorized" and "controller's key only" in reply.message
    # What peers do need of each other: the pings of measure_links.
    assert isinstance(ask(node.control_endpoint, peer, server, "ping_peer"), control.Pong)
    boss = keys.controller_keys(agent.home)
    assert isinstance(ask(node.control_endpoint, boss, server, "hello"), control.HelloReply)
    assert local_cluster.running_pid(node) == agent.pids[node.name]  # no shutdown happened


def test_only_the_controllers_key_asks_a_head_shard(agent: LocalCluster, tmp_path: Path) -> None:
    model = write_demo_model(
        tmp_path / "tiny", DemoSpec(layers=2, hidden=32, heads=2, kv_heads=1, dtype="float32")
    )
    node = agent.inventory.nodes[0]

    async def go() -> None:
        ctl = agent.controller()
        try:
            await ctl.place(model, [node.name], "trusted", context_tokens=256)
            head = ctl.state.placement("trusted").shards[0]
            endpoint = f"tcp://{node.address}:{head.client_port}"
            server = keys.node_public_key(agent.home, node.name)
            peer = node_keypair(agent.home, node.name)
            params = {"max_tokens": 3, "temperature": 0.0}
            reply = await asyncio.to_thread(
                ask, endpoint, peer, server, "generate", rid="r", params=params, prompt="hi"
            )
            assert isinstance(reply, control.Error)
            assert reply.code == "not_authorized" and "only the controller" in reply.message
            # The controller's own requests are served as ever.
            got = [m async for m in ctl.generate("trusted", {"prompt": "hi"}, params)]
            last = got[-1]
            assert isinstance(last, control.Done) and last.usage["completion_tokens"] == 3
            head = ctl.head_peer(ctl.pick_placement("trusted"))
            assert (await head.ask("stats", control.StatsReply)).stats.refused == 1
            await ctl.unload("trusted")
        finally:
            await ctl.close()

    asyncio.run(go())


def test_a_removed_nodes_key_is_revoked_without_a_restart(agent: LocalCluster) -> None:
    node = agent.inventory.nodes[0]
    workdir = Path(node.workdir)
    server = keys.node_public_key(agent.home, node.name)
    names = list(agent.inventory.names)
    gone = node_keypair(agent.home, "gone-node")

    def pings() -> bool:
        reply = ask(node.control_endpoint, gone, server, "ping_peer")
        return isinstance(reply, control.Pong)

    def eventually(check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 15
        while not check():
            assert time.monotonic() < deadline
            time.sleep(0.3)

    # Provision with "gone-node" in the inventory: its key is installed and taken up.
    keys.install_locally(workdir, keys.node_key_files(agent.home, node.name, [*names, "gone-node"]))
    eventually(pings)
    # Provision again without it: the key file is removed, the agent stops answering it.
    keys.install_locally(workdir, keys.node_key_files(agent.home, node.name, names))
    assert not (workdir / "keys/authorized/gone-node.key").exists()
    assert (workdir / "keys/authorized/controller.key").exists()
    eventually(lambda: not pings())
    boss = keys.controller_keys(agent.home)
    assert isinstance(ask(node.control_endpoint, boss, server, "hello"), control.HelloReply)
    assert local_cluster.running_pid(node) == agent.pids[node.name]  # the same agent


# ---- a cluster.toml in the current directory -------------------------------------------


def run_cli(cwd: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STUDIOTUI_HOME": str(home), "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "studiotui", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_a_cluster_toml_in_the_current_directory_is_not_trusted_silently(tmp_path: Path) -> None:
    home, here = tmp_path / "home", tmp_path / "cloned-repo"
    here.mkdir()
    elsewhere = tmp_path / "elsewhere"
    node = NodeSpec(
        name="mine", transport="local", address="127.0.0.140", control_port=58700,
        python="/bin/sh", workdir=str(elsewhere),
    )  # fmt: skip
    inv = Inventory(name="downloaded", nodes=(node,))
    (here / "cluster.toml").write_text(dump_inventory(inv))
    doubts = inventory_doubts(inv, home, sys.executable)
    assert len(doubts) == 2 and "/bin/sh" in doubts[0] and str(elsewhere) in doubts[1]

    refused = run_cli(here, home, "up")
    assert refused.returncode == 2
    assert f"inventory {here / 'cluster.toml'}" in refused.stderr
    assert "/bin/sh" in refused.stderr and "--trust-inventory" in refused.stderr
    assert not elsewhere.exists()  # refused before anything was started or written

    # Trusted, the command goes on to the cluster itself (whose node is not up).
    trusted = run_cli(here, home, "--trust-inventory", "status", "--json")
    assert f"inventory {here / 'cluster.toml'}" in trusted.stderr
    assert "not studiotui's own" not in trusted.stderr
    assert "no node of cluster downloaded is up" in trusted.stderr, trusted.stderr
    # Named with -i, it is the operator's choice; and studiotui's own nodes need nothing.
    named = run_cli(tmp_path, home, "-i", str(here / "cluster.toml"), "status")
    assert "no node of cluster downloaded is up" in named.stderr, named.stderr
    own = NodeSpec(
        name="own", transport="local", address="127.0.0.140", control_port=58700,
        python=sys.executable, workdir=str(home / "local" / "own"),
    )  # fmt: skip
    assert inventory_doubts(Inventory(name="x", nodes=(own,)), home, sys.executable) == []


def test_the_home_mark_is_made_once_and_kept_private(tmp_path: Path, open_umask: None) -> None:
    home = tmp_path / "home"
    token = home_mark(home)
    assert len(token) == 32 and home_mark(home) == token
    assert mode(home / HOME_MARK) == 0o600


def test_the_ssh_stop_script_stops_only_the_agent_of_its_workdir(tmp_path: Path) -> None:
    """The script `down`/`restart` run over SSH, run here with sh as a node runs it."""
    from studiotui.provision.remote import stop_argv

    workdir = tmp_path / "node dir 'q'"
    workdir.mkdir()
    sleeper = "import time; time.sleep(60)"
    py = [sys.executable, "-c", sleeper]
    procs = {
        # What the old check took for an agent: "worker" somewhere in its command line.
        "lookalike": [*py, "some-worker-thing"],
        "other home": [*py, "-m", "worker", "--home", "/elsewhere"],
        "agent": [*py, "-m", "worker", "--home", str(workdir), "--name", "n"],
    }
    started = {k: subprocess.Popen(argv) for k, argv in procs.items()}
    try:
        for name, proc in started.items():
            (workdir / "agent.pid").write_text(str(proc.pid))
            out = subprocess.run(stop_argv(str(workdir), 2), capture_output=True, text=True)
            if name == "agent":
                assert "state=stopped" in out.stdout, out
                assert proc.wait(10) is not None
            else:
                assert "state=foreign" in out.stdout, (name, out)
                assert proc.poll() is None, name
    finally:
        for proc in started.values():
            proc.kill()
            proc.wait()
