"""`studiotui provision --upgrade` brings back the placements it stopped (real sshd).

Two "Macs" are provisioned over a real sshd on loopback and hold a two-stage
pipeline. Upgrading their agents (a wheel that reports another version) stops every
shard; the verb then loads them again on the same layers and ports, showing it, and
the placement answers with mlx-lm's own greedy tokens, as before; a second upgrade
finds nothing to replace and leaves the shards running. An upgrade whose
new build cannot start on a node names the placement that could not come back and
why. A plain `provision` of a node that `down` stopped loads the shards kept for it
again the same way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from studiotui.cli import provision_cmd
from studiotui.cluster.controller import Controller
from studiotui.core.inventory import Inventory, dump_inventory
from studiotui.provision.deploy import CheckoutWheel
from studiotui.provision.wheel import PrebuiltWheel
from tests.integration.test_engine import collect, prompt_tokens, reference_tokens
from tests.integration.test_provision import agent_pid, bumped_wheel
from tests.support.sshd import SshNodes
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = [
    pytest.mark.asyncio(loop_scope="function"),
    pytest.mark.skipif(
        shutil.which("ssh-keygen") is None and not os.environ.get("CI"),
        reason="run .ci/install-sshd.sh",
    ),
]

NAME = "kept"
N_TOKENS = 8


def broken_wheel(source: Path, dest: Path, version: str) -> PrebuiltWheel:
    """A build of another version whose agent dies on start (a bad release)."""
    good = bumped_wheel(source, dest, version)
    out = dest / "broken" / good.wheel.name
    out.parent.mkdir()
    with zipfile.ZipFile(good.wheel) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "worker/__main__.py":
                data = b'raise SystemExit("this build is broken")\n'
            dst.writestr(info, data)
    return PrebuiltWheel(out)


async def _answer(home: Path, inv: Inventory, tokens: list[int]) -> tuple[str, list[int]]:
    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        p = ctl.state.placement(NAME)
        if p is None or p.state != "ready":
            return (p.state if p else "gone"), []
        return p.state, (await collect(ctl, NAME, tokens, N_TOKENS))[0]
    finally:
        await ctl.close()


async def test_upgrade_loads_the_placements_again_and_they_answer_the_same(
    tmp_path: Path,
    wheel: CheckoutWheel,
    ssh_nodes: Callable[..., Awaitable[SshNodes]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = await ssh_nodes(2)
    nodes, inv, home = made.nodes, made.inventory, made.home
    names = [n.name for n in nodes]
    model = write_demo_model(
        tmp_path / "model", DemoSpec(layers=4, hidden=128, heads=4, kv_heads=2, seed=3)
    )
    tokens = prompt_tokens(model)
    reference = reference_tokens(model, tokens, N_TOKENS)

    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        await ctl.place(model, names, NAME, prefill_chunk=64, tensor=1)
        placed = ctl.state.placement(NAME)
        assert placed is not None and sorted(placed.nodes) == sorted(names)
        layers = sorted((s.node, s.start, s.end, s.data_port) for s in placed.shards)
    finally:
        await ctl.close()
    assert await _answer(home, inv, tokens) == ("ready", reference)

    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(inv))
    args = argparse.Namespace(
        inventory=inventory, nodes=[], upgrade=True, accept_new_host_keys=False
    )
    newer = bumped_wheel(await wheel.path(), tmp_path, "0.1.1")
    monkeypatch.setattr("studiotui.provision.deploy.CheckoutWheel", lambda cache: newer)
    pids = {n.name: agent_pid(n) for n in nodes}
    capsys.readouterr()
    assert await provision_cmd.cmd_provision(args, home) == 0
    out = capsys.readouterr()
    print(out.out, out.err, sep="\n")
    assert all(agent_pid(n) != pids[n.name] for n in nodes)  # both agents were replaced
    assert f"placement {NAME!r}: loading its shards again on" in out.out  # progress
    assert f"placement {NAME!r}: reloaded its shards on" in out.out

    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        again = ctl.state.placement(NAME)
        assert again is not None
        assert {ctl.state.node(n).version for n in names} == {"0.1.1"}  # type: ignore[union-attr]
        assert sorted((s.node, s.start, s.end, s.data_port) for s in again.shards) == layers
    finally:
        await ctl.close()
    assert await _answer(home, inv, tokens) == ("ready", reference)

    # Upgraded already: nothing is replaced, and nothing reloaded (the shards ran on).
    pids = {n.name: agent_pid(n) for n in nodes}
    capsys.readouterr()
    assert await provision_cmd.cmd_provision(args, home) == 0
    out = capsys.readouterr()
    assert all(agent_pid(n) == pids[n.name] for n in nodes)
    assert "unchanged" in out.out and "loading its shards again" not in out.out, out.out
    assert await _answer(home, inv, tokens) == ("ready", reference)

    # A build that cannot start on the second node: the placement is named, with why.
    bad = broken_wheel(await wheel.path(), tmp_path, "0.1.2")
    monkeypatch.setattr("studiotui.provision.deploy.CheckoutWheel", lambda cache: bad)
    args.nodes = [names[1]]
    assert await provision_cmd.cmd_provision(args, home) == 1
    out = capsys.readouterr()
    print(out.out, out.err, sep="\n")
    said = " ".join(out.err.split())
    assert (
        f"placement {NAME!r} is broken: {names[1]}, which held a shard of it, did not come back"
        in said
    )
    assert "exited right after starting" in said and "unload it and place it again" in said


async def test_provision_after_down_loads_the_kept_shards_again(
    tmp_path: Path,
    wheel: CheckoutWheel,
    ssh_nodes: Callable[..., Awaitable[SshNodes]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = await ssh_nodes(2)
    nodes, inv, home = made.nodes, made.inventory, made.home
    names = [n.name for n in nodes]
    model = write_demo_model(
        tmp_path / "model", DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, seed=3)
    )
    tokens = prompt_tokens(model)
    reference = reference_tokens(model, tokens, N_TOKENS)
    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        await ctl.place(model, names, NAME, prefill_chunk=64, tensor=1)
        placed = ctl.state.placement(NAME)
        assert placed is not None and sorted(placed.nodes) == sorted(names)
        layers = sorted((s.node, s.start, s.end, s.data_port) for s in placed.shards)
    finally:
        await ctl.close()

    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(inv))
    last = names[1]
    capsys.readouterr()
    down = argparse.Namespace(inventory=inventory, nodes=[last], yes=False)
    assert await provision_cmd.cmd_down(down, home) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"{last} held a shard of {NAME!r}" in said and f"studiotui provision {last}" in said
    assert (await _answer(home, inv, tokens))[0] != "ready"

    # The same build (no rebuild): provisioning starts the agent and reloads the shard.
    monkeypatch.setattr("studiotui.provision.deploy.CheckoutWheel", lambda cache: wheel)
    args = argparse.Namespace(
        inventory=inventory, nodes=[last], upgrade=False, accept_new_host_keys=False
    )
    assert await provision_cmd.cmd_provision(args, home) == 0
    out = capsys.readouterr()
    print(out.out, out.err, sep="\n")
    assert f"placement {NAME!r}: loading its shards again on {last}" in out.out  # progress
    assert f"placement {NAME!r}: reloaded its shards on {last}" in out.out
    assert await _answer(home, inv, tokens) == ("ready", reference)
    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        again = ctl.state.placement(NAME)
        assert again is not None
        assert sorted((s.node, s.start, s.end, s.data_port) for s in again.shards) == layers
    finally:
        await ctl.close()

    # Down again, then a build that cannot start: the same words as the upgrade's.
    assert await provision_cmd.cmd_down(down, home) == 0
    bad = broken_wheel(await wheel.path(), tmp_path, "0.1.2")
    monkeypatch.setattr("studiotui.provision.deploy.CheckoutWheel", lambda cache: bad)
    capsys.readouterr()
    assert await provision_cmd.cmd_provision(args, home) == 1
    out = capsys.readouterr()
    said = " ".join(out.err.split())
    assert (
        f"placement {NAME!r} is broken: {last}, which held a shard of it, did not come back" in said
    ), said
