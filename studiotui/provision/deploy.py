"""Bring every node from "a Mac with SSH and Python" to "an agent running this build".

`provision` works on all nodes at once (one asyncio task each; one failing node
never stops the others) and returns an `Outcome` per node. Per SSH node:
connect (host key checked) -> probe (one remote command) -> `plan_node` (pure,
in plan.py) -> carry out the planned steps -> wait until the agent
answers on its control socket. Progress goes to `on_event(node, step, status,
detail)` with status one of "start", "done", "fail", "info".

The worker travels as a wheel built from this checkout once per source state
(cached under STUDIOTUI_HOME/wheels by version + source hash), copied over SFTP
and unpacked into the node's work dir (`wheel.py`; see `plan.InstallWheel` for why
it is not pip-installed). Its dependencies are pip-installed from the package
index only when the probe finds them missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import asyncssh
import psutil

from studiotui.cluster import keys, local_cluster
from studiotui.cluster.controller import Controller
from studiotui.cluster.peers import AgentError, AgentUnreachable
from studiotui.core.errors import StudioError
from studiotui.core.inventory import Inventory, NodeSpec
from studiotui.core.text import last_lines
from studiotui.core.trust import home_mark
from studiotui.provision import remote
from studiotui.provision.plan import (
    MIN_FREE_BYTES,
    MLX_HINT,
    AgentHello,
    CheckMlx,
    InstallDeps,
    InstallFiles,
    InstallWheel,
    MakeVenv,
    NodePlan,
    NodeProbe,
    ProbeError,
    Prune,
    Refusal,
    StartAgent,
    Step,
    StopAgent,
    Wanted,
    parse_probe,
    plan_node,
    requirement_name,
)
from studiotui.provision.wheel import (
    BuildError,
    CheckoutWheel,
    WheelSource,
    files_digest,
)
from studiotui.provision.wheel import (
    project_root as project_root,  # re-exported: the engine bench builds from it
)
from studiotui.ssh import client as ssh
from studiotui.ssh import nodes
from worker.shared import ports
from worker.shared.protocol.control import AgentBrief

log = logging.getLogger("studiotui.provision.deploy")

EventCallback = Callable[[str, str, str, str], None]
OutcomeStatus = Literal["up", "unchanged", "kept", "failed"]

PROBE_TIMEOUT_S = 120.0
HELLO_TIMEOUT_S = 2.0
STOP_GRACE_S = 10
LOG_TAIL_LINES = 15
PIP_TIMEOUT_S = 1800.0
START_MARKER = "=== studiotui: starting agent"
LOG_WINDOW_BYTES = 256 * 1024
# $1 a node's keys/authorized dir, $2... the key files it keeps: removes the others.
REVOKE_SCRIPT = r"""
dir=$1; shift
cd "$dir" 2>/dev/null || exit 0
for f in *.key; do
  [ -e "$f" ] || continue
  keep=0
  for k in "$@"; do [ "$f" = "$k" ] && keep=1; done
  [ "$keep" = 1 ] || rm -f -- "$f"
done
"""


# --------------------------------------------------------------------------- outcomes


@dataclass(frozen=True)
class Outcome:
    """How provisioning ended on one node."""

    node: str
    status: OutcomeStatus
    message: str
    hint: str = ""
    version: str = ""
    build: str = ""
    address: str = ""
    memory_total: int = 0
    pid: int | None = None
    steps: tuple[str, ...] = ()
    seconds: float = 0.0
    log_tail: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    def __str__(self) -> str:
        text = f"{self.node}: {self.message}"
        if self.log_tail:
            text += "\n    " + self.log_tail.replace("\n", "\n    ")
        return f"{text}\n  hint: {self.hint}" if self.hint else text


class StepFailed(StudioError):
    def __init__(self, message: str, hint: str = "", log_tail: str = "") -> None:
        super().__init__(message, hint)
        self.log_tail = log_tail


def keys_digest(bundle: keys.NodeKeyFiles) -> str:
    return files_digest(bundle.files)[:16]


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Options:
    upgrade: bool = False
    accept_new_host_keys: bool = False
    min_free_bytes: int = MIN_FREE_BYTES
    connect_timeout: float = 10.0
    start_timeout: float = 30.0
    pip_options: tuple[str, ...] = ()
    user_known_hosts: Path | None = nodes.USER_KNOWN_HOSTS


class _Run:
    def __init__(
        self,
        home: Path,
        inventory: Inventory,
        wheel: WheelSource,
        options: Options,
        on_event: EventCallback | None,
    ) -> None:
        self.home = home
        self.inventory = inventory
        self.wheel = wheel
        self.options = options
        self.on_event = on_event
        self.ctl = Controller(home, inventory)
        self.hellos: dict[str, AgentBrief] = {}
        # Made before any node is probed, so a probe of this very home sees it.
        self.home_mark = home_mark(home)

    def emit(self, node: str, step: str, status: str, detail: str = "") -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(node, step, status, detail)
        except Exception:  # a display bug must not fail a node
            log.exception("on_event callback failed")

    async def close(self) -> None:
        await self.ctl.close()

    # ---- per node -------------------------------------------------------------------------

    async def node(self, node: NodeSpec) -> Outcome:
        started = time.monotonic()
        done: list[str] = []
        try:
            if node.is_local:
                outcome = await self._local(node, done)
            else:
                outcome = await self._ssh(node, done)
        except ssh.SshError as exc:
            outcome = Outcome(node.name, "failed", exc.message, exc.hint)
        except StepFailed as exc:
            outcome = Outcome(node.name, "failed", exc.message, exc.hint, log_tail=exc.log_tail)
        except BuildError as exc:
            outcome = Outcome(
                node.name,
                "failed",
                str(exc),
                "Fix the build error above in the checkout (or check that PyPI is reachable "
                "for pip's build environment), then rerun provision.",
            )
        except Exception as exc:  # one node's bug must not take the others down
            log.exception("provisioning %s", node.name)
            outcome = Outcome(
                node.name,
                "failed",
                f"unexpected error: {type(exc).__name__}: {exc}",
                "This is a bug in studiotui; please report it with the output above.",
            )
        seconds = time.monotonic() - started
        final = replace(outcome, steps=tuple(done), seconds=seconds)
        self.emit(node.name, "result", "fail" if not final.ok else "done", final.message)
        return final

    async def _ssh(self, node: NodeSpec, done: list[str]) -> Outcome:
        name = node.name
        self.emit(name, "connect", "start", node.hostname or node.ssh_host)
        conn = await nodes.connect_node(
            node,
            self.home,
            accept_new_host_keys=self.options.accept_new_host_keys,
            timeout=self.options.connect_timeout,
            user_known_hosts=self.options.user_known_hosts,
        )
        done.append("connect")
        self.emit(name, "connect", "done")
        try:
            return await self._with_connection(conn, node, done)
        finally:
            conn.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await conn.wait_closed()

    async def _with_connection(
        self, conn: asyncssh.SSHClientConnection, node: NodeSpec, done: list[str]
    ) -> Outcome:
        name = node.name
        self.emit(name, "probe", "start")
        result = await ssh.run(
            conn,
            remote.probe_argv(node, self.wheel.requirements),
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
        try:
            probe = parse_probe(name, result.stdout)
        except ProbeError as exc:
            raise StepFailed(
                f"could not probe {name}: {exc}",
                f"Check that the login shell of {node.user or 'the user'} on {name} runs "
                "`sh -c` commands (try `ssh NODE sh -c true`).",
            ) from None
        done.append("probe")
        self.emit(name, "probe", "done", _probe_line(probe))

        hello = None
        busy = probe.python is not None and "in_use" in probe.python.binds.values()
        if (probe.agent is not None and probe.agent.alive) or busy:
            hello = await self._hello(name, HELLO_TIMEOUT_S)
        wanted = self._wanted(node)
        plan = plan_node(
            probe,
            node,
            wanted,
            upgrade=self.options.upgrade,
            hello=hello,
            min_free_bytes=self.options.min_free_bytes,
            operator_mark=self.home_mark,
        )
        if isinstance(plan, Refusal):
            self.emit(name, "plan", "fail", plan.message)
            return Outcome(name, "failed", plan.message, plan.hint, facts=probe.summary())
        self.emit(name, "plan", "done", plan.reason)
        if not plan.steps:
            status: OutcomeStatus = "unchanged" if plan.status == "unchanged" else "kept"
            running = (probe.deployed or {}).get("build", "")
            return Outcome(
                name,
                status,
                plan.reason,
                version=hello.version if hello else "",
                build=str(running),
                address=f"{node.address}:{node.control_port}",
                memory_total=self._memory_of(name),
                pid=probe.agent.pid if probe.agent else None,
                facts=probe.summary(),
            )

        # A re-key leaves the agent running: what it said on hello still holds.
        reply = self.hellos.get(name, AgentBrief()) if plan.status == "rekey" else AgentBrief()
        pid = 0
        for step in plan.steps:
            self.emit(name, step.kind, "start", step.detail)
            try:
                if isinstance(step, StartAgent):
                    pid = await self._start(conn, node, plan, step)
                else:
                    await self._do(conn, node, probe, step)
            except StepFailed as exc:
                self.emit(name, step.kind, "fail", exc.message)
                raise
            if isinstance(step, StartAgent):
                done.append(step.kind)
                self.emit(name, step.kind, "done", f"pid {pid}")
                self.emit(name, "wait", "start", f"{node.address}:{node.control_port}")
                reply = await self._wait_up(conn, node, probe.workdir, pid)
                done.append("wait")
                self.emit(name, "wait", "done", f"version {reply.version or '?'}")
                continue
            done.append(step.kind)
            self.emit(name, step.kind, "done")
        return Outcome(
            name,
            "up",
            f"{plan.reason}: agent {reply.version or '?'} up on {node.address}:{node.control_port}",
            version=reply.version,
            build=self.wheel.build,
            address=f"{node.address}:{node.control_port}",
            memory_total=reply.memory_total,
            pid=reply.pid or pid or None,
            facts=probe.summary(),
        )

    def _wanted(self, node: NodeSpec) -> Wanted:
        bundle = keys.node_key_files(self.home, node.name, list(self.inventory.names))
        return Wanted(
            build=self.wheel.build,
            version=self.wheel.version,
            requirements=self.wheel.requirements,
            keys_digest=keys_digest(bundle),
            cluster=self.inventory.name,
        )

    def _memory_of(self, name: str) -> int:
        return self.hellos.get(name, AgentBrief()).memory_total

    async def _hello(self, name: str, timeout: float) -> AgentHello | None:
        try:
            reply = await self.ctl.peer(name).ask("hello", AgentBrief, timeout=timeout)
        except (AgentUnreachable, AgentError):
            return None
        self.hellos[name] = reply
        return AgentHello(reply.version, reply.pid or None)

    # ---- steps ------------------------------------------------------------------------------

    async def _start(
        self, conn: asyncssh.SSHClientConnection, node: NodeSpec, plan: NodePlan, step: StartAgent
    ) -> int:
        launched = await remote.launch(
            conn,
            node.name,
            plan.python,
            step.workdir,
            step.pythonpath,
            (node.address, node.control_port),
            self.options.start_timeout,
            step.argv,
        )
        if launched.state == "exited":
            tail = await agent_output_tail(conn, step.workdir)
            raise _died(node, step.workdir, tail, launched.code)
        return launched.pid

    async def _do(
        self,
        conn: asyncssh.SSHClientConnection,
        node: NodeSpec,
        probe: NodeProbe,
        step: Step,
    ) -> None:
        name = node.name
        match step:
            case MakeVenv():
                argv = [step.python, "-m", "venv", *(["--clear"] if step.clear else []), step.venv]
                result = await ssh.run(conn, argv, timeout=600, check=False)
                if result.exit_status != 0:
                    out = last_lines(result.stderr or result.stdout)
                    hint = (
                        f"Install the venv module on {name} (Debian/Ubuntu: `sudo apt install "
                        "python3-venv`), or point `python` in cluster.toml at a venv's python."
                        if "ensurepip" in out or "No module named venv" in out
                        else f"Check that `{step.python} -m venv /tmp/x` works on {name}."
                    )
                    raise StepFailed(
                        f"could not create a venv at {step.venv} with {step.python} on "
                        f"{name}:\n    " + out.replace("\n", "\n    "),
                        hint,
                    )
            case InstallDeps():
                await self._install_deps(conn, node, step)
            case CheckMlx():
                result = await ssh.run(
                    conn, [step.python, "-c", remote.MLX_SNIPPET], timeout=300, check=False
                )
                if result.exit_status != 0:
                    out = last_lines(result.stderr or result.stdout, 6)
                    raise StepFailed(
                        f"MLX does not work with {step.python} on {name}:\n    "
                        + out.replace("\n", "\n    "),
                        MLX_HINT.format(node=name, python=step.python),
                    )
            case InstallWheel():
                cached = getattr(self.wheel, "cached", None)
                if cached is not None and cached() is None:
                    self.emit(name, "wheel", "info", f"building wheel {self.wheel.build}")
                local = await self.wheel.path()
                remote_wheel = nodes.remote_join(probe.workdir, "wheels", local.name)
                await ssh.put_file(conn, local, remote_wheel)
                result = await ssh.run(
                    conn,
                    remote.unpack_argv(step.python, remote_wheel, step.target),
                    timeout=300,
                    check=False,
                )
                if result.exit_status != 0:
                    raise StepFailed(
                        f"could not unpack the worker into {step.target} on {name}:\n    "
                        + last_lines(result.stderr or result.stdout, 6).replace("\n", "\n    "),
                        f"Check free space and permissions of {probe.workdir} on {name}.",
                    )
            case StopAgent():
                stopped = await remote.stop_agent(conn, probe.workdir, STOP_GRACE_S)
                if stopped.get("state") == "foreign":
                    raise StepFailed(
                        f"{probe.workdir}/agent.pid names pid {stopped.get('pid')}, which is not "
                        f"a studiotui agent ({stopped.get('command', '?')})",
                        f"Remove that pid file on {name} and rerun provision.",
                    )
            case InstallFiles():
                bundle = keys.node_key_files(self.home, name, list(self.inventory.names))
                key_files = {
                    nodes.remote_join(probe.workdir, rel): data
                    for rel, data in bundle.files.items()
                }
                await ssh.put_files(conn, key_files, mode=0o600, dir_mode=0o700)
                # Keys of nodes no longer in the inventory are revoked; the agent
                # reloads its keys when they change on disk.
                await ssh.run(
                    conn,
                    [
                        "sh",
                        "-c",
                        REVOKE_SCRIPT,
                        "sh",
                        nodes.remote_join(probe.workdir, keys.AUTHORIZED.rstrip("/")),
                        *keys.authorized_names(bundle),
                    ],
                    timeout=30,
                    check=False,
                )
                record = json.dumps(dict(step.record), indent=2).encode() + b"\n"
                await ssh.put_files(
                    conn, {nodes.remote_join(probe.workdir, "node.json"): record}, mode=0o600
                )
            case Prune():
                await ssh.run(conn, ["rm", "-rf", "--", *step.dirs], timeout=120, check=False)
            case StartAgent():
                raise AssertionError("StartAgent is carried out by _start")

    async def _install_deps(
        self, conn: asyncssh.SSHClientConnection, node: NodeSpec, step: InstallDeps
    ) -> None:
        argv = [
            step.python,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            *self.options.pip_options,
            *step.requirements,
        ]
        result = await ssh.run(conn, argv, timeout=PIP_TIMEOUT_S, check=False)
        if result.exit_status == 0:
            return
        names = [requirement_name(r) for r in step.requirements]
        out = last_lines(result.stderr or result.stdout, 8)
        if "No module named pip" in out:
            hint = (
                f"{step.python} has no pip: recreate that venv with pip "
                f"(`python3 -m venv DIR`), or install pip into it."
            )
        else:
            hint = (
                f"Check that {node.name} reaches the package index (pip's index-url and proxy "
                f"settings), or install them there yourself: `{step.python} -m pip install "
                + " ".join(f"'{r}'" for r in step.requirements)
                + "`."
            )
            if "mlx" in names:
                hint += " " + MLX_HINT.format(node=node.name, python=step.python)
        missing = ", ".join(names)
        lead = "MLX and other dependencies" if "mlx" in names else "dependencies"
        raise StepFailed(
            f"the worker's {lead} ({missing}) are missing for {step.python} on {node.name} "
            "and pip could not install them:\n    " + out.replace("\n", "\n    "),
            hint,
        )

    async def _wait_up(
        self, conn: asyncssh.SSHClientConnection, node: NodeSpec, workdir: str, pid: int
    ) -> AgentBrief:
        deadline = time.monotonic() + self.options.start_timeout
        peer = self.ctl.peer(node.name)
        while True:
            try:
                reply = await peer.ask("hello", AgentBrief, timeout=1.0)
            except (AgentUnreachable, AgentError):
                reply = None
            if reply is not None:
                self.hellos[node.name] = reply
                return reply
            if not await remote.is_alive(conn, pid):
                tail = await agent_output_tail(conn, workdir)
                raise _died(node, workdir, tail)
            if time.monotonic() > deadline:
                tail = await agent_output_tail(conn, workdir)
                raise StepFailed(
                    f"the agent on {node.name} (pid {pid}) runs but did not answer on "
                    f"{node.address}:{node.control_port} within {self.options.start_timeout:g} s",
                    f"Check that this machine can reach {node.address} (the node's `address`) "
                    f"and that no firewall blocks port {node.control_port}; "
                    f"`studiotui logs {node.name}` shows the agent's log.",
                    tail,
                )

    # ---- local nodes --------------------------------------------------------------------------

    async def _local(self, node: NodeSpec, done: list[str]) -> Outcome:
        name = node.name
        before = local_cluster.running_pid(node)
        self.emit(name, "start", "start", "local agent")
        pid = await asyncio.to_thread(local_cluster.start_agent, self.home, node, self.inventory)
        done.append("start")
        self.emit(name, "start", "done", f"pid {pid}")
        deadline = time.monotonic() + self.options.start_timeout
        while True:
            try:
                reply = await self.ctl.peer(name).ask("hello", AgentBrief, timeout=1.0)
                break
            except (AgentUnreachable, AgentError):
                pass
            if not psutil.pid_exists(pid) or time.monotonic() > deadline:
                tail = local_cluster.agent_output_tail(node, LOG_TAIL_LINES)
                raise StepFailed(
                    f"the local agent {name} did not come up", "See its output below.", tail
                )
        done.append("wait")
        return Outcome(
            name,
            "unchanged" if before == pid else "up",
            f"local agent {reply.version or '?'} up on {node.address}:{node.control_port}",
            version=reply.version,
            address=f"{node.address}:{node.control_port}",
            memory_total=reply.memory_total,
            pid=pid,
        )


def _probe_line(probe: NodeProbe) -> str:
    parts = [f"{probe.os} {probe.arch}"]
    if probe.python is not None:
        parts.append(f"Python {probe.python.version_text}")
    if probe.free_bytes is not None:
        parts.append(f"{probe.free_bytes / 1024**3:.1f} GB free")
    if probe.runtime is not None and probe.runtime.mlx_version:
        parts.append(f"mlx {probe.runtime.mlx_version}")
    return ", ".join(parts)


def last_start(text: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of agent.out written since the last start marker."""
    cut = text.rsplit(START_MARKER, 1)
    body = cut[1].split("\n", 1)[1] if len(cut) == 2 and "\n" in cut[1] else cut[-1]
    return last_lines(body, lines)


async def agent_output_tail(conn: asyncssh.SSHClientConnection, workdir: str) -> str:
    try:
        text = await ssh.read_file_tail(
            conn, nodes.sftp_path(nodes.remote_join(workdir, "agent.out")), 200
        )
    except ssh.SshError as exc:
        return f"(cannot read agent.out: {exc.message})"
    return last_start(text)


def _died(node: NodeSpec, workdir: str, tail: str, code: int | None = None) -> StepFailed:
    """Why the agent on `node` exited, from its exit status (`code`; None: not known)."""
    match code:
        case ports.EXIT_PORT_IN_USE:
            return StepFailed(
                f"the agent on {node.name} could not bind {node.address}:{node.control_port}: "
                "the port is already in use",
                f"Stop the program holding port {node.control_port} on {node.name} (`lsof -nP "
                f"-iTCP:{node.control_port}`) or choose another control_port in cluster.toml.",
                tail,
            )
        case ports.EXIT_NOT_AN_ADDRESS:
            return StepFailed(
                f"the agent on {node.name} could not bind {node.address}: it is not an address "
                f"of {node.name}",
                f"Set `address` for {node.name} in cluster.toml to one of its own addresses.",
                tail,
            )
    return StepFailed(
        f"the agent on {node.name} exited right after starting; the last lines of "
        f"{workdir}/agent.out:",
        f"Fix the error above on {node.name}, then rerun provision; `studiotui logs "
        f"{node.name}` shows its whole log.",
        tail,
    )


# --------------------------------------------------------------------------- entry points


async def provision(
    home: Path,
    inventory: Inventory,
    *,
    upgrade: bool = False,
    accept_new_host_keys: bool = False,
    on_event: EventCallback | None = None,
    nodes: Sequence[str] | None = None,
    min_free_bytes: int = MIN_FREE_BYTES,
    connect_timeout: float = 10.0,
    start_timeout: float = 30.0,
    pip_options: Sequence[str] = (),
    wheel: WheelSource | None = None,
    user_known_hosts: Path | None = nodes.USER_KNOWN_HOSTS,
) -> dict[str, Outcome]:
    """Provision `nodes` (default: all) of `inventory` in parallel; an Outcome per node.

    Never raises for a node's failure; raises BuildError only if this is not a
    checkout to build the worker from (and no `wheel` is given).
    """
    names = list(nodes) if nodes else list(inventory.names)
    source = wheel if wheel is not None else CheckoutWheel(home / "wheels")
    options = Options(
        upgrade=upgrade,
        accept_new_host_keys=accept_new_host_keys,
        min_free_bytes=min_free_bytes,
        connect_timeout=connect_timeout,
        start_timeout=start_timeout,
        pip_options=tuple(pip_options),
        user_known_hosts=user_known_hosts,
    )
    run = _Run(home, inventory, source, options, on_event)
    try:
        results = await asyncio.gather(*(run.node(inventory.node(n)) for n in names))
    finally:
        await run.close()
    return {o.node: o for o in results}


async def connect(
    home: Path, node: NodeSpec, *, timeout: float = 10.0
) -> asyncssh.SSHClientConnection:
    """A connection to an already provisioned node (no new host keys are accepted)."""
    return await nodes.connect_node(node, home, timeout=timeout)


async def stop_agent(home: Path, node: NodeSpec) -> str:
    """Stop an SSH node's agent by the pid in its pid file; a line saying what happened."""
    conn = await connect(home, node)
    try:
        state = await remote.stop_agent(conn, node.workdir, STOP_GRACE_S)
    finally:
        conn.close()
    match state.get("state"):
        case "stopped":
            forced = " (killed: it ignored SIGTERM)" if state.get("forced") else ""
            return f"stopped (pid {state.get('pid')}){forced}"
        case "foreign":
            return (
                f"not stopped: {node.workdir}/agent.pid names pid {state.get('pid')}, "
                f"which is not an agent ({state.get('command', '?')})"
            )
        case _:
            return "was not running"


async def restart_agent(
    home: Path, inventory: Inventory, node: NodeSpec, *, start_timeout: float = 30.0
) -> Outcome:
    """Stop and start an SSH node's agent with what node.json recorded (same build)."""
    started = time.monotonic()
    conn = await connect(home, node)
    run = _Run(home, inventory, _NoWheel(), Options(start_timeout=start_timeout), None)
    try:
        workdir = await _remote_workdir(conn, node.workdir)
        record = await remote.read_json(conn, nodes.remote_join(workdir, "node.json"))
        if record is None or not isinstance(record.get("argv"), list):
            raise StepFailed(
                f"{node.name} has no {workdir}/node.json: it was never provisioned",
                "Run `studiotui provision` first.",
            )
        await remote.stop_agent(conn, workdir, STOP_GRACE_S)
        argv = [str(a) for a in record["argv"]]
        launched = await remote.launch(
            conn,
            node.name,
            argv[0],
            workdir,
            str(record.get("pythonpath", "")),
            (node.address, node.control_port),
            start_timeout,
            argv,
        )
        if launched.state == "exited":
            raise _died(node, workdir, await agent_output_tail(conn, workdir), launched.code)
        pid = launched.pid
        reply = await run._wait_up(conn, node, workdir, pid)
        return Outcome(
            node.name,
            "up",
            f"restarted: agent {reply.version or '?'} up (pid {reply.pid or pid})",
            version=reply.version,
            build=str(record.get("build", "")),
            address=f"{node.address}:{node.control_port}",
            memory_total=reply.memory_total,
            pid=reply.pid or pid,
            seconds=time.monotonic() - started,
        )
    except StepFailed as exc:
        return Outcome(node.name, "failed", exc.message, exc.hint, log_tail=exc.log_tail)
    finally:
        conn.close()
        await run.close()


async def _remote_workdir(conn: asyncssh.SSHClientConnection, workdir: str) -> str:
    if workdir == "~" or workdir.startswith("~/"):
        home = (await ssh.run(conn, ["sh", "-c", 'printf %s "$HOME"'], timeout=30)).stdout
        return home + workdir[1:]
    return workdir


class _NoWheel:
    build = ""
    version = ""
    requirements: tuple[str, ...] = ()

    async def path(self) -> Path:
        raise BuildError("restart does not install anything")


async def follow_log(
    conn: asyncssh.SSHClientConnection,
    node: NodeSpec,
    lines: int,
    *,
    follow: bool = False,
    poll_s: float = 1.0,
) -> AsyncGenerator[str, None]:
    """The last `lines` lines of the node's agent.log, then (with `follow`) new ones as
    they are written. Reads only what was appended, over one SSH connection."""
    path = nodes.sftp_path(nodes.remote_join(node.workdir, "agent.log"))
    data, offset = await ssh.read_file_since(conn, path, -LOG_WINDOW_BYTES)
    if offset - len(data) > 0:
        data = data.partition(b"\n")[2]  # the window began mid-line
    # Split bytes, not text: a read may end inside a multi-byte character.
    *complete, pending = data.split(b"\n")
    for line in complete[-lines:] if lines > 0 else []:
        yield line.decode("utf-8", errors="replace")
    while follow:
        await asyncio.sleep(poll_s)
        data, offset = await ssh.read_file_since(conn, path, offset)
        if data:
            *complete, pending = (pending + data).split(b"\n")
            for line in complete:
                yield line.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- from the dashboard


def event_words(node: str, step: str, status: str, detail: str) -> str:
    """One provisioning event as a log line: "local-1: start… local agent", "local-1:
    start done (pid 4242)", "studio-2: venv failed: …" (the step and its status are
    different words even when both are "start")."""
    first = detail.splitlines()[0] if detail else ""
    if status == "start":
        return f"{node}: {step}…" + (f" {first}" if first else "")
    if status == "done":
        return f"{node}: {step} done" + (f" ({first})" if first else "")
    if status == "fail":
        return f"{node}: {step} failed" + (f": {detail}" if detail else "")
    return f"{node}: {step}" + (f": {first}" if first else "")


async def provision_logged(
    ctl: Controller, names: list[str], upgrade: bool = False
) -> dict[str, Outcome]:
    """Provision SSH nodes (local ones are started directly), each step in the cluster log."""

    def on_event(node: str, step: str, status: str, detail: str) -> None:
        ctl.record(event_words(node, step, status, detail), "error" if status == "fail" else "info")

    ctl.mark_provisioning(names)
    try:
        outcomes = await provision(
            ctl.home, ctl.inventory, nodes=names, upgrade=upgrade, on_event=on_event
        )
    except BuildError as exc:
        ctl.record(f"cannot build the worker to install: {exc}", "error")
        await ctl.refresh()
        return {}
    for outcome in outcomes.values():
        ctl.record(str(outcome), "info" if outcome.ok else "error")
    await ctl.refresh()
    return dict(outcomes)
