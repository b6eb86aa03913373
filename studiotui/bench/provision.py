"""Provisioning, measured: 1 then 4 fresh SSH nodes on a real loopback sshd."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from studiotui.bench.copy_rates import copy_rates
from studiotui.bench.sshd import start_sshd
from studiotui.core.inventory import Inventory, NodeSpec
from studiotui.provision.deploy import BuildError, CheckoutWheel, project_root, provision


def python_with_deps(spare: Path) -> str:
    """A venv's python that has this interpreter's packages, for simulated nodes.

    A venv's own python is used as is by provisioning, so nodes on this machine
    need no dependency install. Outside a venv, make one in `spare` that sees
    this interpreter's site-packages.
    """
    if sys.prefix != sys.base_prefix:
        return sys.executable
    import venv

    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(spare)
    return str(spare / "bin" / "python")


def _free_control_port(addresses: Sequence[str], start: int) -> int:
    import socket

    port = start
    while port < 65000:
        try:
            for addr in addresses:
                for p in (port, port + 1):
                    with socket.socket() as s:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                        s.bind((addr, p))
        except OSError:
            port += 20
            continue
        return port
    raise RuntimeError("no free port pair for the benchmark's agents")


async def bench_provision(home: Path) -> dict[str, Any]:
    """Provision 1 and then 4 fresh SSH nodes (a real sshd on 127.0.0.21-24).

    `provision4_ratio` is wall time for 4 nodes over wall time for 1 (the work is
    parallel, so the goal is <= 1.5); `reprovision_s` is a rerun with nothing
    changed. The wheel is built before timing. Every agent started is stopped.
    """
    try:
        root = project_root()
    except BuildError as exc:
        return {"provision_error": str(exc)}
    base = Path(tempfile.mkdtemp(prefix="studiotui-bench-provision-"))
    try:
        server = start_sshd(workdir=base / "sshd")
    except Exception as exc:  # no sshd here: report it, do not sink the whole bench
        shutil.rmtree(base, ignore_errors=True)
        return {"provision_error": f"cannot start sshd for the benchmark: {exc}"}
    bench_home = base / "home"
    bench_home.mkdir()
    wheel = CheckoutWheel(home / "wheels", root)
    await wheel.path()
    addresses = list(server.addresses)
    port = _free_control_port(addresses, 55100)
    python = python_with_deps(base / "venv")

    def inv(tag: str, count: int, control_port: int) -> Inventory:
        nodes = tuple(
            NodeSpec(
                name=f"bench-{tag}-{i + 1}",
                host=addresses[i],
                port=server.port,
                user=server.user,
                identity=str(server.client_key),
                address=addresses[i],
                control_port=control_port,
                workdir=str(base / "nodes" / f"{tag}-{i + 1}"),
                python=python,
                memory_gb=1.0,
            )
            for i in range(count)
        )
        return Inventory(name=f"bench-{tag}", nodes=nodes)

    one = inv("one", 1, port)
    four = inv("four", 4, _free_control_port(addresses, port + 20))
    try:
        common: dict[str, Any] = {
            "accept_new_host_keys": True,
            "wheel": wheel,
            "user_known_hosts": None,
        }
        t0 = time.monotonic()
        r1 = await provision(bench_home, one, **common)
        t1 = time.monotonic() - t0
        t0 = time.monotonic()
        r4 = await provision(bench_home, four, **common)
        t4 = time.monotonic() - t0
        t0 = time.monotonic()
        again = await provision(bench_home, four, **common)
        t_again = time.monotonic() - t0
        failed = [str(o) for o in (*r1.values(), *r4.values(), *again.values()) if not o.ok]
        copies = await _copy_rates(bench_home, four, base / "copy")
        return {
            **copies,
            "provision1_s": round(t1, 2),
            "provision4_s": round(t4, 2),
            "provision4_ratio": round(t4 / t1, 2) if t1 else None,
            "reprovision_s": round(t_again, 2),
            "reprovision_unchanged": all(o.status == "unchanged" for o in again.values()),
            "provision_failures": failed,
        }
    finally:
        kill_local_agents([Path(n.workdir) for inv_ in (one, four) for n in inv_.nodes])
        server.cleanup()
        shutil.rmtree(base, ignore_errors=True)


async def _copy_rates(home: Path, inventory: Inventory, work: Path) -> dict[str, Any]:
    """Model files to these nodes three ways (`bench.copy_rates`); a failure is a figure."""
    try:
        return await copy_rates(home, inventory, work)
    except Exception as exc:  # the provisioning figures stand on their own
        return {"copy_error": f"{type(exc).__name__}: {exc}"}


def kill_local_agents(workdirs: Sequence[Path], timeout: float = 5.0) -> None:
    """Stop agents started on this machine (by the benchmark or tests), by their pid files.

    All are signalled first and waited for together: an agent takes a moment to
    stop its shards, and one at a time that adds up.
    """
    procs: list[psutil.Process] = []
    for workdir in workdirs:
        try:
            pid = int((workdir / "agent.pid").read_text().strip())
            proc = psutil.Process(pid)
            if str(workdir) in " ".join(proc.cmdline()):
                procs.append(proc)
        except (OSError, ValueError, psutil.Error):
            continue
    children = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            children += proc.children(recursive=True)
            proc.terminate()
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in (*alive, *children):
        with contextlib.suppress(psutil.Error):
            proc.kill()
