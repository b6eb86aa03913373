"""Provisioning against a real OpenSSH sshd on loopback (tests/support/sshd.py).

Each sshd address stands for one Mac: the agent provisioned "there" binds the
same 127.0.0.2X address, and every node's work dir has a space and a quote in
its name. All of it runs on this machine, so a model directory is valid on every
"node". Every agent started is stopped by its pid file at teardown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import stat
import sys
import time
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from studiotui.cli import provision_cmd
from studiotui.cluster.controller import Controller
from studiotui.cluster.model_files import needed_files
from studiotui.core.inventory import Inventory, NodeSpec, dump_inventory
from studiotui.provision.deploy import CheckoutWheel, Outcome, provision
from studiotui.provision.remote import BUILD_MARKER
from studiotui.provision.wheel import PrebuiltWheel
from tests.support.sshd import SshdServer, SshNodes, free_port, make_node
from worker.shared.demo_model import DemoSpec, write_demo_model
from worker.shared.protocol import control

pytestmark = [
    pytest.mark.asyncio(loop_scope="function"),
    # In CI the SSH tests must run: there a missing sshd is a failure, not a skip.
    pytest.mark.skipif(
        shutil.which("ssh-keygen") is None and not os.environ.get("CI"),
        reason="run .ci/install-sshd.sh",
    ),
]

# Documentation range (RFC 5737 TEST-NET-2): never an address of this machine.
# Only ever bound to (which fails), never sent to: provisioning stops before
# anything connects to a node's address it could not bind.
FOREIGN_ADDRESS = "198.51.100.77"


# --------------------------------------------------------------------------- fixtures


# `wheel` and `node_python` (session fixtures) live in conftest.py: the model-file
# tests on SSH nodes use the same ones.


def trust(server: SshdServer, home: Path) -> None:
    home.mkdir(parents=True, exist_ok=True)
    server.write_known_hosts(home / "known_hosts")


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[float, str, str, str, str]] = []

    def __call__(self, node: str, step: str, status: str, detail: str) -> None:
        self.seen.append((time.monotonic(), node, step, status, detail))

    def steps(self, node: str, status: str = "done") -> list[str]:
        return [s for _, n, s, st, _ in self.seen if n == node and st == status]

    def first(self, node: str, step: str, status: str) -> float:
        return next(t for t, n, s, st, _ in self.seen if (n, s, st) == (node, step, status))


def agent_pid(node: NodeSpec) -> int:
    return int((Path(node.workdir) / "agent.pid").read_text())


def bumped_wheel(source: Path, dest: Path, version: str) -> PrebuiltWheel:
    """A copy of the wheel that reports another version: the agent says so on hello."""
    out = dest / source.name.replace("0.1.0", version)
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename in ("worker/__init__.py", "studiotui/__init__.py"):
                data = f'__version__ = "{version}"\n'.encode()
            elif info.filename.endswith(".dist-info/METADATA"):
                data = data.replace(b"Version: 0.1.0", f"Version: {version}".encode())
            dst.writestr(info, data)
    return PrebuiltWheel(out)


def wrapper_python(directory: Path, real: str, poison: dict[str, str]) -> str:
    """A `python` that is `real` but with modules that fail to import shadowing real ones."""
    poison_dir = directory / "poison"
    for module, error in poison.items():
        package = poison_dir / module
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"raise ImportError({error!r})\n")
    script = directory / "python"
    script.write_text(
        f"#!/bin/sh\nPYTHONPATH='{poison_dir}'${{PYTHONPATH:+:$PYTHONPATH}} exec '{real}' \"$@\"\n"
    )
    script.chmod(0o755)
    return str(script)


def old_python(directory: Path, real: str) -> str:
    """A Python older than 3.11: a real one if pyenv has one, else `real` claiming 3.9.6."""
    root = Path("~/.pyenv/versions").expanduser()
    real_old = sorted(root.glob("3.[0-9].*/bin/python3")) + sorted(root.glob("3.10.*/bin/python3"))
    if real_old:
        return str(real_old[-1])
    site = directory / "oldsite"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text("import sys\nsys.version_info = (3, 9, 6, 'final', 0)\n")
    script = directory / "python3.9"
    script.write_text(f"#!/bin/sh\nPYTHONPATH='{site}' exec '{real}' \"$@\"\n")
    script.chmod(0o755)
    return str(script)


# --------------------------------------------------------------------------- the happy path


async def test_three_nodes_in_parallel_then_a_prompt_then_nothing_to_do(
    sshd_server: SshdServer,
    tmp_path: Path,
    wheel: CheckoutWheel,
    ssh_nodes: Callable[..., Awaitable[SshNodes]],
) -> None:
    made = await ssh_nodes(3, provisioned=False)
    nodes, inv, home = made.nodes, made.inventory, made.home
    port = nodes[0].control_port
    common: dict[str, Any] = {"wheel": wheel, "user_known_hosts": None}
    # The operator's own files under a workdir's lib/ (as under ~/lib): never pruned.
    theirs = Path(nodes[0].workdir) / "lib" / "not-studiotuis"
    theirs.mkdir(parents=True)
    (theirs / "keep.txt").write_text("mine")

    # Unknown hosts are refused, with the fingerprint and the flag that accepts them.
    refused = await provision(home, inv, **common)
    for node in nodes:
        text = str(refused[node.name])
        assert refused[node.name].status == "failed"
        assert node.name in text and sshd_server.host_key_fingerprint in text
        assert "--accept-new-host-keys" in text
    assert not (home / "known_hosts").exists()

    events = Events()
    started = time.monotonic()
    outcomes = await provision(home, inv, accept_new_host_keys=True, on_event=events, **common)
    first_run = time.monotonic() - started
    for node in nodes:
        o = outcomes[node.name]
        assert o.status == "up", str(o)
        assert o.version == "0.1.0" and o.build == wheel.build
        assert o.address == f"{node.address}:{port}"
        assert o.memory_total == 2 * 1024**3
        assert o.facts["os"] == "Linux" and o.facts["python"]
        assert events.steps(node.name) == ["connect", "probe", "plan", "wheel", "keys", "start",
                                            "wait", "result"]  # fmt: skip
        workdir = Path(node.workdir)
        secret = workdir / "keys" / "self.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert stat.S_IMODE((workdir / "keys").stat().st_mode) == 0o700
        assert (workdir / "lib" / wheel.build / "worker" / "__main__.py").is_file()
    # Parallel: every node was probing before any node finished.
    last_probe = max(events.first(n.name, "probe", "start") for n in nodes)
    first_result = min(events.first(n.name, "result", "done") for n in nodes)
    assert last_probe < first_result
    assert len((home / "known_hosts").read_text().splitlines()) == 3

    # The agents outlived their SSH sessions; run a prompt through all three.
    model = tmp_path / "m"
    write_demo_model(model, DemoSpec(layers=6, files=3))
    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        assert all(n.state == "up" for n in ctl.state.nodes)
        placed = await ctl.place(model, [n.name for n in nodes], name="demo")
        assert sorted(placed.placement.nodes) == [n.name for n in nodes]
        text, done = "", None
        params = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop": []}
        async for msg in ctl.generate("demo", {"prompt": "hello"}, params):
            if isinstance(msg, control.Delta):
                text += msg.text
            elif isinstance(msg, control.Done):
                done = msg
        assert done is not None
        assert 1 <= done.usage["completion_tokens"] <= 8 and done.finish_reason
        # Each node got, over SFTP, only the weight files its own layers live in.
        for shard in placed.placement.shards:
            copy = Path(inv.node(shard.node).workdir) / "models" / "m"
            wanted = {f.name for f in needed_files(model, shard.start, shard.end, 6)}
            assert {p.name for p in copy.iterdir() if not p.name.startswith(".")} == wanted
            assert len([n for n in wanted if n.endswith(".safetensors")]) < 3
        await ctl.unload("demo")

        # A Hugging Face snapshot the nodes already hold (here: the same path, as
        # files linked to blobs the way the hub cache stores them) is not copied.
        repo = tmp_path / "hub" / "models--studiotui--demo"
        snapshot = repo / "snapshots" / "c0ffee0123456789"
        (repo / "blobs").mkdir(parents=True)
        snapshot.mkdir(parents=True)
        for f in model.iterdir():
            shutil.copy(f, repo / "blobs" / f.name)
            (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
        await ctl.place(snapshot, [n.name for n in nodes], name="hub")
        async for msg in ctl.generate("hub", {"prompt": "hello"}, {**params, "max_tokens": 4}):
            assert isinstance(msg, control.Accepted | control.Delta | control.Done), msg
        held = [e.text for e in ctl.state.log if "already holds" in e.text]
        assert sorted(t.split()[0] for t in held) == [n.name for n in nodes], held
        assert all(f"studiotui--demo@c0ffee012345 at {snapshot}" in t for t in held)
        for node in nodes:
            assert not (Path(node.workdir) / "models" / "studiotui--demo@c0ffee012345").exists()
        await ctl.unload("hub")
    finally:
        await ctl.close()

    # Nothing changed: nothing is done, quickly, and the same agents keep running.
    pids = {n.name: agent_pid(n) for n in nodes}
    started = time.monotonic()
    again = await provision(home, inv, **common)
    rerun = time.monotonic() - started
    for node in nodes:
        assert again[node.name].status == "unchanged", str(again[node.name])
        assert again[node.name].steps == ("connect", "probe")
        assert agent_pid(node) == pids[node.name]
    assert rerun < max(8.0, first_run), rerun

    # Another version is left alone without --upgrade, and replaces the agents with it.
    newer = bumped_wheel(await wheel.path(), tmp_path, "0.1.1")
    kept = await provision(home, inv, wheel=newer, user_known_hosts=None)
    for node in nodes:
        assert kept[node.name].status == "kept"
        assert "--upgrade" in kept[node.name].message
        assert agent_pid(node) == pids[node.name]
    upgraded = await provision(home, inv, wheel=newer, user_known_hosts=None, upgrade=True)
    for node in nodes:
        o = upgraded[node.name]
        assert o.status == "up" and o.version == "0.1.1", str(o)
        assert "stop" in o.steps and "prune" in o.steps
        assert agent_pid(node) != pids[node.name]
        assert not psutil.pid_exists(pids[node.name]) or (
            psutil.Process(pids[node.name]).status() == psutil.STATUS_ZOMBIE
        )
        builds = sorted(p.name for p in (Path(node.workdir) / "lib").iterdir())
        assert builds == sorted([newer.build, *(["not-studiotuis"] if node == nodes[0] else [])])
        assert (Path(node.workdir) / "lib" / newer.build / BUILD_MARKER).is_file()
    assert (theirs / "keep.txt").read_text() == "mine"

    # The third node leaves the inventory: the next provision revokes its key on the others.
    kept_nodes = nodes[:2]
    fewer = await provision(home, Inventory(name="desk", nodes=kept_nodes), wheel=newer,
                            user_known_hosts=None)  # fmt: skip
    for node in kept_nodes:
        assert fewer[node.name].status in ("up", "unchanged"), str(fewer[node.name])
        authorized = Path(node.workdir) / "keys" / "authorized"
        held = sorted(p.name for p in authorized.glob("*.key"))
        assert held == sorted(["controller.key", *(f"{n.name}.key" for n in kept_nodes)])


# --------------------------------------------------------------------------- failures


async def test_each_failure_names_its_node_and_the_others_still_come_up(
    sshd_server: SshdServer,
    tmp_path: Path,
    wheel: CheckoutWheel,
    node_python: str,
    agents: list[Path],
) -> None:
    server = sshd_server
    wrong_key = tmp_path / "id_wrong"
    os.system(f"ssh-keygen -q -t ed25519 -N '' -f '{wrong_key}' </dev/null >/dev/null")
    with socket.socket() as probe:
        probe.bind(("127.0.0.99", 0))
        closed_port = probe.getsockname()[1]
    busy_addr, dies_addr = "127.0.0.26", "127.0.0.27"
    port = free_port([busy_addr, dies_addr, *(f"127.0.0.{i}" for i in range(31, 40))])
    occupier = socket.socket()
    occupier.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    occupier.bind((busy_addr, port))
    occupier.listen(1)

    # Each node binds its own address, so one agent coming up never makes
    # another node's port check fail.
    own = iter(f"127.0.0.{i}" for i in range(31, 60))

    def node(name: str, **changes: Any) -> NodeSpec:
        changes.setdefault("address", next(own))
        return make_node(server, "127.0.0.21", name, tmp_path, port, node_python, **changes)

    nodes = (
        node("ok"),
        node("unreachable", host="127.0.0.99", port=closed_port),
        node("badkey", identity=str(wrong_key)),
        node("nopython", python="/nonexistent/python3"),
        node("oldpython", python=old_python(tmp_path / "old", node_python)),
        node(
            "brokenmlx",
            python=wrapper_python(
                tmp_path / "w1",
                node_python,
                {"mlx": "libmlx.so: cannot open shared object file: No such file or directory"},
            ),
        ),
        node(
            "dies",
            address=dies_addr,
            python=wrapper_python(
                tmp_path / "w2",
                node_python,
                {"zmq": "libzmq.so.5: cannot open shared object file: No such file or directory"},
            ),
        ),
        node("portbusy", address=busy_addr),
        node("elsewhere", address=FOREIGN_ADDRESS),
        # This very machine over SSH, with the operator's STUDIOTUI_HOME as its workdir.
        node("myself", workdir=str(tmp_path / "home")),
    )
    agents.extend(Path(n.workdir) for n in nodes)
    trust(server, tmp_path / "home")
    inv = Inventory(name="mixed", nodes=nodes)
    try:
        outcomes = await provision(
            tmp_path / "home",
            inv,
            wheel=wheel,
            user_known_hosts=None,
            connect_timeout=3.0,
            start_timeout=20.0,
        )
    finally:
        occupier.close()

    def failed(name: str, *needles: str) -> Outcome:
        o = outcomes[name]
        text = str(o)
        assert o.status == "failed", text
        assert name in text and o.hint, text
        for needle in needles:
            assert needle in text, f"{needle!r} not in:\n{text}"
        return o

    assert outcomes["ok"].status == "up", str(outcomes["ok"])
    unreachable = failed("unreachable", "127.0.0.99", "refused", "powered on")
    assert unreachable.seconds < 3.0 + 2
    failed("badkey", "authentication failed", str(wrong_key), "authorized_keys")
    failed("nopython", "no Python at '/nonexistent/python3'", "3.11 or later")
    failed("oldpython", "studiotui needs 3.11 or later", "3.11 or later on oldpython")
    failed("brokenmlx", "MLX is installed", "libmlx.so", "Apple silicon")
    dies = failed("dies", "exited right after starting", "libzmq.so.5", "ImportError")
    assert "logs dies" in dies.hint
    failed("portbusy", f"port {port} on {busy_addr} is already in use", "lsof")
    failed("elsewhere", f"address {FOREIGN_ADDRESS} is not an address of elsewhere", "`address`")
    failed("myself", "is this studiotui's own STUDIOTUI_HOME", "`workdir` for myself")
    assert (
        not (tmp_path / "home" / "lib").exists() and not (tmp_path / "home" / "node.json").exists()
    )


async def test_missing_mlx_that_pip_cannot_install(
    sshd_server: SshdServer,
    tmp_path: Path,
    wheel: CheckoutWheel,
) -> None:
    """A plain (non-venv) Python: provisioning makes a venv, then pip finds no MLX."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    home = tmp_path / "home"
    trust(sshd_server, home)
    node = make_node(sshd_server, "127.0.0.22", "bare", tmp_path, 54000, base)
    empty = tmp_path / "no-packages"
    empty.mkdir()
    events = Events()
    outcomes = await provision(
        home,
        Inventory(name="t", nodes=(node,)),
        wheel=wheel,
        user_known_hosts=None,
        on_event=events,
        pip_options=("--no-index", "--find-links", str(empty)),
    )
    o = outcomes["bare"]
    text = str(o)
    assert o.status == "failed", text
    assert events.steps("bare") == ["connect", "probe", "plan", "venv"]
    assert "MLX and other dependencies" in text and "mlx" in text
    assert "bare" in text and "package index" in o.hint and "Apple silicon" in o.hint
    assert (Path(node.workdir) / "venv" / "bin" / "python").exists()


async def test_no_disk_space_says_how_much_is_free_where(
    sshd_server: SshdServer,
    tmp_path: Path,
    wheel: CheckoutWheel,
    node_python: str,
) -> None:
    home = tmp_path / "home"
    trust(sshd_server, home)
    node = make_node(sshd_server, "127.0.0.23", "full", tmp_path, 54000, node_python)
    outcomes = await provision(
        home,
        Inventory(name="t", nodes=(node,)),
        wheel=wheel,
        user_known_hosts=None,
        min_free_bytes=10**16,
    )
    o = outcomes["full"]
    assert o.status == "failed"
    assert "GB free on /" in o.message and "needs 9313225.7 GB" in o.message
    assert "full" in str(o) and "workdir" in o.hint


async def test_host_keys_changed_or_known_only_to_the_user(
    sshd_factory: Callable[..., SshdServer],
    tmp_path: Path,
    wheel: CheckoutWheel,
    node_python: str,
) -> None:
    server = sshd_factory(["127.0.0.24"])
    home = tmp_path / "home"
    home.mkdir()
    users = tmp_path / "user_known_hosts"
    server.write_known_hosts(users)
    # Provisioning stops at the plan (the address is not local), after the host
    # key check passed: trusted through the user's file alone.
    node = make_node(
        server, "127.0.0.24", "mac-24", tmp_path, 54000, node_python, address=FOREIGN_ADDRESS
    )
    inv = Inventory(name="t", nodes=(node,))
    o = (await provision(home, inv, wheel=wheel, user_known_hosts=users))["mac-24"]
    assert "is not an address of mac-24" in o.message, str(o)
    assert not (home / "known_hosts").exists()
    before = users.read_text()

    new_fp = server.regenerate_host_key()
    for accept in (False, True):
        o = (
            await provision(
                home, inv, wheel=wheel, user_known_hosts=users, accept_new_host_keys=accept
            )
        )["mac-24"]
        text = str(o)
        assert o.status == "failed"
        assert "HOST KEY CHANGED" in text and new_fp in text and "mac-24" in text
        assert f"{users} line 1" in o.hint and "ssh-keygen -R" in o.hint
    assert users.read_text() == before
    assert not (home / "known_hosts").exists()

    # The same stale key recorded in our own file is reported there.
    server_old = before.splitlines()[0]
    (home / "known_hosts").write_text(server_old + "\n")
    o = (await provision(home, inv, wheel=wheel, user_known_hosts=None))["mac-24"]
    assert "HOST KEY CHANGED" in str(o) and f"{home / 'known_hosts'} line 1" in o.hint

    # Accepting a new key with a user file that does not know the host: the key
    # goes to our file only.
    (home / "known_hosts").unlink()
    unrelated = tmp_path / "unrelated_known_hosts"
    unrelated.write_text(before.replace("[127.0.0.24]", "[127.0.0.77]"))
    o = (
        await provision(
            home, inv, wheel=wheel, user_known_hosts=unrelated, accept_new_host_keys=True
        )
    )["mac-24"]
    assert "is not an address of mac-24" in o.message, str(o)
    ours = (home / "known_hosts").read_text().splitlines()
    assert len(ours) == 1 and ours[0].startswith(f"[127.0.0.24]:{server.port} ssh-ed25519 ")
    assert unrelated.read_text() == before.replace("[127.0.0.24]", "[127.0.0.77]")


# --------------------------------------------------------------------------- the verbs


async def test_provision_logs_restart_down_verbs(
    sshd_server: SshdServer,
    tmp_path: Path,
    node_python: str,
    wheel: CheckoutWheel,
    agents: list[Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = tmp_path / "home"
    trust(sshd_server, home)
    port = free_port(["127.0.0.21"])
    node = make_node(sshd_server, "127.0.0.21", "verbs", tmp_path, port, node_python)
    agents.append(Path(node.workdir))
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(Inventory(name="verbs", nodes=(node,))))
    # The verb builds its own wheel source: hand it the session's (already built).
    monkeypatch.setattr("studiotui.provision.deploy.CheckoutWheel", lambda cache: wheel)
    args = argparse.Namespace(
        inventory=inventory, nodes=[], upgrade=False, accept_new_host_keys=False
    )

    assert await provision_cmd.cmd_provision(args, home) == 0
    out = capsys.readouterr().out
    assert "verbs: connect ..." in out and "verbs: result ok" in out  # plain lines: no TTY
    assert "provisioning" in out and "up" in out  # the summary table
    first_pid = agent_pid(node)

    logs = argparse.Namespace(inventory=inventory, node="verbs", lines=5, follow=False)
    assert await provision_cmd.cmd_logs(logs, home) == 0
    assert "listening on 127.0.0.21" in capsys.readouterr().out

    restart = argparse.Namespace(inventory=inventory, nodes=["verbs"])
    assert await provision_cmd.cmd_restart(restart, home) == 0
    assert "restarted" in capsys.readouterr().out
    second_pid = agent_pid(node)
    assert second_pid != first_pid and psutil.pid_exists(second_pid)

    down = argparse.Namespace(inventory=inventory, nodes=[])
    assert await provision_cmd.cmd_down(down, home) == 0
    assert f"verbs: stopped (pid {second_pid})" in capsys.readouterr().out
    assert not (Path(node.workdir) / "agent.pid").exists()
    gone = not psutil.pid_exists(second_pid)
    assert gone or psutil.Process(second_pid).status() == psutil.STATUS_ZOMBIE
    assert await provision_cmd.cmd_down(down, home) == 0
    assert "verbs: was not running" in capsys.readouterr().out


async def test_follow_log_reads_only_what_was_appended(
    sshd_server: SshdServer,
    tmp_path: Path,
) -> None:
    from studiotui.provision import deploy as prov

    home = tmp_path / "home"
    trust(sshd_server, home)
    node = make_node(sshd_server, "127.0.0.22", "tail", tmp_path, 54000, sys.executable)
    log = Path(node.workdir) / "agent.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"".join(f"line {i}\n".encode() for i in range(1000)))
    conn = await prov.connect(home, node)
    try:
        lines = prov.follow_log(conn, node, 3, follow=True, poll_s=0.05)
        assert [await anext(lines) for _ in range(3)] == ["line 997", "line 998", "line 999"]
        with log.open("ab") as f:
            f.write("caf\u00e9 ".encode()[:-2])  # half of a UTF-8 character
            f.flush()
            await asyncio.sleep(0.2)
            f.write("\u00e9 ".encode()[1:] + b"done\n")
        assert await asyncio.wait_for(anext(lines), 5) == "caf\u00e9 done"
        await lines.aclose()
    finally:
        conn.close()


async def test_local_nodes_are_started_and_restarted_without_ssh(
    tmp_path: Path,
    wheel: CheckoutWheel,
    agents: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = free_port(["127.0.0.41"])
    node = NodeSpec(
        name="here",
        transport="local",
        address="127.0.0.41",
        control_port=port,
        workdir=str(tmp_path / "local node"),
        python=sys.executable,
    )
    agents.append(Path(node.workdir))
    inv = Inventory(name="t", nodes=(node,))
    home = tmp_path / "home"
    first = (await provision(home, inv, wheel=wheel))["here"]
    assert first.status == "up" and first.version == "0.1.0", str(first)
    again = (await provision(home, inv, wheel=wheel))["here"]
    assert again.status == "unchanged" and again.pid == first.pid

    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(inv))
    restart = argparse.Namespace(inventory=inventory, nodes=["here"])
    assert await provision_cmd.cmd_restart(restart, home) == 0
    assert "restarted" in capsys.readouterr().out
    assert agent_pid(node) != first.pid
