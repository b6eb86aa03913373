"""What provisioning has to do on one node, decided from what the node reported.

Everything here is pure. The node runs one probe command (see `remote.probe_argv`)
that prints sections of facts; `parse_probe` reads them into a `NodeProbe`, and
`plan_node` turns a probe plus what we want running there into the ordered `Step`s
to carry out, or a `Refusal` that names the node and says what to do. The I/O that
carries the steps out lives in `provision.py`.

Decisions worth knowing (the why is next to each):
- The worker is not pip-installed into the node's environment: the wheel is
  unpacked into `WORKDIR/lib/<build>` and the agent runs with that directory on
  PYTHONPATH. Only missing *dependencies* are pip-installed (from the package
  index). See `InstallWheel`.
- A running agent is only ever replaced with `--upgrade`: replacing it stops every
  shard it serves (the CLI loads them again afterwards, `restart.keep_placements`).
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from studiotui.core.errors import StudioError
from studiotui.core.inventory import NodeSpec
from studiotui.core.placement import gb
from worker.shared import probes
from worker.shared.probes import Interface, ProbeParseError, RdmaSummary

MIN_PYTHON = (3, 11)
MIN_FREE_BYTES = 2 * 1024**3
SECTION_PREFIX = "@@studiotui:"
DEPLOYMENT_FORMAT = 1

# The extra of pyproject.toml that lists what a node needs (and all it gets: the
# operator's own dependencies stay off the Macs that only run shards).
NODE_EXTRA = "node"

PYTHON_HINT = (
    "Install Python 3.11 or later on {node} (on macOS e.g. `brew install python@3.12`) "
    'and set `python` for {node} in cluster.toml to it (e.g. python = "/opt/homebrew/bin/'
    'python3.12"), or to the python of a venv that has it.'
)
MLX_HINT = (
    "MLX needs an Apple silicon Mac with macOS 14 or later (or Linux, where mlx[cpu] is "
    "used) and a Python for which MLX publishes wheels. Check with `{python} -c 'import "
    "mlx.core'` on {node}; reinstall with `{python} -m pip install --force-reinstall mlx`."
)


# --------------------------------------------------------------------------- probe facts


@dataclass(frozen=True)
class PythonFacts:
    """One interpreter on the node, as the cheap (Python-2-safe) snippet saw it."""

    path: str
    version: tuple[int, int, int] | None = None
    is_venv: bool = False
    # What it printed when it could not run the snippet (or why it is unusable).
    error: str = ""
    # Results of trying to bind the agent's ports: port -> ok | in_use | not_local | error ...
    binds: Mapping[int, str] = field(default_factory=dict)

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version)) if self.version else "unknown"


@dataclass(frozen=True)
class RuntimeFacts:
    """The interpreter the agent will run with, checked deeply."""

    python: str
    unmet: tuple[str, ...] = ()
    has_pip: bool = True
    mlx_version: str | None = None
    mlx_device: str = ""
    mlx_error: str = ""
    # The deep check could not run at all (e.g. a broken interpreter).
    error: str = ""


@dataclass(frozen=True)
class AgentFacts:
    pid: int
    alive: bool
    command: str = ""


@dataclass(frozen=True)
class NodeProbe:
    node: str
    os: str
    arch: str
    home: str
    workdir: str
    os_version: str = ""
    chip: str = ""
    memory_total: int | None = None
    free_bytes: int | None = None
    free_path: str = ""
    interfaces: Mapping[str, Interface] = field(default_factory=dict)
    rdma: RdmaSummary | None = None
    python: PythonFacts | None = None
    venv_python: PythonFacts | None = None
    venv_broken: bool = False
    runtime: RuntimeFacts | None = None
    agent: AgentFacts | None = None
    deployed: Mapping[str, Any] | None = None
    builds: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # The token in the workdir's HOME_MARK file, if any: the operator's own home has one.
    home_mark: str = ""

    @property
    def is_macos(self) -> bool:
        return self.os == "Darwin"

    @property
    def addresses(self) -> tuple[str, ...]:
        found = [a for i in self.interfaces.values() for a in (*i.ipv4, *i.ipv6)]
        return tuple(dict.fromkeys(found))

    @property
    def bridge_address(self) -> str | None:
        """IPv4 of the Thunderbolt Bridge (bridge0 on macOS), if it has one."""
        bridge = self.interfaces.get("bridge0")
        return bridge.ipv4[0] if bridge and bridge.ipv4 else None

    @property
    def venv_dir(self) -> str:
        return posixpath.join(self.workdir, "venv")

    def summary(self) -> dict[str, Any]:
        """Plain facts for reports and JSON."""
        facts: dict[str, Any] = {
            "os": self.os,
            "os_version": self.os_version,
            "arch": self.arch,
            "chip": self.chip,
            "memory_total": self.memory_total,
            "free_bytes": self.free_bytes,
            "workdir": self.workdir,
            "addresses": list(self.addresses),
        }
        if self.python is not None:
            facts["python"] = self.python.version_text
        if self.runtime is not None and self.runtime.mlx_version:
            facts["mlx"] = self.runtime.mlx_version
        if self.is_macos:
            facts["thunderbolt_bridge"] = self.bridge_address
            if self.rdma is not None:
                facts["rdma"] = self.rdma.status
                facts["rdma_devices"] = list(self.rdma.devices)
        return facts


class ProbeError(StudioError, ValueError):
    """The probe printed nothing we can read (its script did not run)."""


# --------------------------------------------------------------------------- probe parsing


def split_sections(text: str) -> dict[str, str]:
    """`@@studiotui:NAME` lines split the probe output; text before the first is dropped."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(SECTION_PREFIX):
            current = sections.setdefault(line[len(SECTION_PREFIX) :].strip(), [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines).strip("\n") for name, lines in sections.items()}


def parse_kv(text: str) -> dict[str, str]:
    """`key=value` lines; the first occurrence of a key wins, other lines are ignored."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and re.fullmatch(r"[A-Za-z_][\w.]*", key) and key not in found:
            found[key] = value
    return found


def parse_version(text: str) -> tuple[int, int, int] | None:
    m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.(\d+))?\S*\s*", text or "")
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def parse_df(text: str) -> tuple[int | None, str]:
    """Available bytes and mount point from POSIX `df -Pk` output."""
    for line in text.splitlines()[1:]:
        words = line.split()
        # The device name and the mount point may contain spaces; the capacity
        # column ("23%") anchors the numbers before it.
        for i, word in enumerate(words):
            if re.fullmatch(r"\d+%|-", word) and i >= 3 and words[i - 1].isdigit():
                return int(words[i - 1]) * 1024, " ".join(words[i + 1 :])
    return None, ""


def _python_facts(text: str) -> PythonFacts | None:
    kv = parse_kv(text)
    if "missing" in kv:
        return None
    path = kv.get("path", "")
    version = parse_version(kv.get("version", ""))
    binds = {
        int(k.split(".", 1)[1]): v
        for k, v in kv.items()
        if k.startswith("bind.") and k.split(".", 1)[1].isdigit()
    }
    error = ""
    if version is None:
        shown = [
            line for line in text.splitlines() if not line.startswith(("path=", "rc=")) and line
        ]
        error = "\n".join(shown[-6:]) or f"exit status {kv.get('rc', '?')}"
    return PythonFacts(
        path=path, version=version, is_venv=kv.get("venv") == "1", error=error, binds=binds
    )


def _runtime_facts(text: str) -> RuntimeFacts | None:
    """The runtime section: path, the facts JSON line, then MLX's lines (or its error)."""
    kv = parse_kv(text)
    if "path" not in kv:
        return None
    facts: dict[str, Any] = {}
    rest: list[str] = []
    for line in text.splitlines():
        if line.startswith("{") and not facts:
            try:
                loaded = json.loads(line)
            except ValueError:
                loaded = None
            if isinstance(loaded, dict) and "unmet" in loaded:
                facts = loaded
                continue
        if not line.startswith(("path=", "rc=", "mlx=", "device=")) and line.strip():
            rest.append(line)
    if not facts:
        return RuntimeFacts(
            python=kv["path"], error="\n".join(rest[-6:]) or f"exit status {kv.get('rc', '?')}"
        )
    mlx_ok = "mlx" in kv and kv.get("rc") == "0"
    return RuntimeFacts(
        python=kv["path"],
        unmet=tuple(str(u) for u in facts.get("unmet", ())),
        has_pip=bool(facts.get("pip", True)),
        mlx_version=kv["mlx"] if mlx_ok else None,
        mlx_device=kv.get("device", "") if mlx_ok else "",
        mlx_error="" if mlx_ok else "\n".join(rest[-4:]) or f"exit status {kv.get('rc', '?')}",
    )


def _agent_facts(text: str) -> AgentFacts | None:
    kv = parse_kv(text)
    pid = kv.get("pid", "")
    if not pid.isdigit():
        return None
    return AgentFacts(pid=int(pid), alive=kv.get("alive") == "1", command=kv.get("command", ""))


def _deployed(text: str) -> Mapping[str, Any] | None:
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _interfaces(sections: Mapping[str, str], notes: list[str]) -> dict[str, Interface]:
    try:
        if "ifconfig" in sections:
            return probes.parse_ifconfig(sections["ifconfig"])
        if sections.get("ip", "").lstrip().startswith("["):
            return probes.parse_ip_addr_json(sections["ip"])
    except ProbeParseError as exc:
        notes.append(str(exc))
    return {}


def _rdma(
    sections: Mapping[str, str], interfaces: Mapping[str, Interface], notes: list[str]
) -> RdmaSummary | None:
    try:
        status = probes.parse_rdma_ctl_status(sections.get("rdma_ctl", ""))
    except ProbeParseError as exc:
        notes.append(str(exc))
        status = "unknown"
    devices: tuple[probes.IbvDevice, ...] = ()
    ibv = sections.get("ibv_devices", "")
    if "node GUID" in ibv:
        try:
            devices = probes.parse_ibv_devices(ibv)
        except ProbeParseError as exc:
            notes.append(str(exc))
    report = None
    if sections.get("thunderbolt", "").strip():
        try:
            report = probes.parse_thunderbolt_json(sections["thunderbolt"])
        except ProbeParseError as exc:
            notes.append(str(exc))
    return probes.rdma_summary(status, devices, report, interfaces)


def _memory(sections: Mapping[str, str], notes: list[str]) -> int | None:
    try:
        if "memsize" in sections:
            return probes.parse_sysctl_memsize(sections["memsize"])
        if "meminfo" in sections:
            return probes.parse_proc_meminfo(sections["meminfo"]).total_bytes
    except ProbeParseError as exc:
        notes.append(str(exc))
    return None


def _os_version(sections: Mapping[str, str], notes: list[str]) -> str:
    if "sw_vers" in sections:
        return sections["sw_vers"].strip()
    if sections.get("os_release", "").strip():
        try:
            release = probes.parse_os_release(sections["os_release"])
        except ProbeParseError as exc:
            notes.append(str(exc))
            return ""
        return release.pretty_name or release.version_id or release.id
    return ""


def parse_probe(node: str, text: str) -> NodeProbe:
    """Read the probe command's output; odd sections become notes, never errors.

    Raises ProbeError only when the script's own first section is missing,
    i.e. the remote shell did not run it at all.
    """
    sections = split_sections(text)
    env = parse_kv(sections.get("env", ""))
    if "os" not in env or "workdir" not in env:
        shown = "\n".join(text.strip().splitlines()[:6]) or "(nothing)"
        raise ProbeError(f"the probe printed no facts; it printed:\n{shown}")
    notes: list[str] = []
    interfaces = _interfaces(sections, notes)
    free, mount = parse_df(sections.get("df", ""))
    chip = sections.get("chip", "").strip()
    if ":" in chip and chip.startswith("model name"):
        chip = chip.split(":", 1)[1].strip()
    venv_text = sections.get("venv", "")
    return NodeProbe(
        node=node,
        os=env["os"],
        arch=env.get("arch", ""),
        home=env.get("home", ""),
        workdir=env["workdir"],
        os_version=_os_version(sections, notes),
        chip=chip,
        memory_total=_memory(sections, notes),
        free_bytes=free,
        free_path=sections.get("df_path", "").strip() or mount,
        interfaces=interfaces,
        rdma=_rdma(sections, interfaces, notes) if env["os"] == "Darwin" else None,
        python=_python_facts(sections.get("python", "missing=1")),
        venv_python=_python_facts(venv_text or "missing=1"),
        venv_broken=parse_kv(venv_text).get("broken") == "1",
        runtime=_runtime_facts(sections.get("runtime", "")),
        agent=_agent_facts(sections.get("agent", "")),
        deployed=_deployed(sections.get("deployed", "")),
        builds=tuple(b for b in sections.get("builds", "").split() if not b.startswith(".")),
        notes=tuple(notes),
        home_mark=sections.get("home_mark", "").strip(),
    )


# --------------------------------------------------------------------------- what we want


@dataclass(frozen=True)
class Wanted:
    """What should run on a node after provisioning."""

    build: str  # e.g. "0.1.0+3f2a9c01d4e5": version plus a hash of the source
    version: str
    requirements: tuple[str, ...]
    keys_digest: str
    cluster: str = ""


@dataclass(frozen=True)
class AgentHello:
    """What the running agent said on its control socket."""

    version: str
    pid: int | None


def requirement_name(requirement: str) -> str:
    """A requirement's project name, normalised (`huggingface_hub>=1` -> huggingface-hub)."""
    return canonicalize_name(Requirement(requirement).name)


def node_requirements(project: Mapping[str, Any]) -> tuple[str, ...]:
    """What a node needs, from pyproject.toml's `[project]` table: the node extra."""
    extras = project.get("optional-dependencies", {})
    return tuple(str(r).strip() for r in extras.get(NODE_EXTRA, ()))


def extra_requirements(requires_dist: Sequence[str], extra: str = NODE_EXTRA) -> tuple[str, ...]:
    """The requirements of one extra among a wheel's `Requires-Dist` lines: those whose
    marker holds with that extra and not without it. They keep their markers (a node
    evaluates them with the extra, as the probe's snippet does)."""
    kept = []
    for line in requires_dist:
        marker = Requirement(line).marker
        if marker is None:
            continue
        if marker.evaluate({"extra": extra}) and not marker.evaluate({"extra": ""}):
            kept.append(line.strip())
    return tuple(kept)


def expand_home(path: str, home: str) -> str:
    """`~` and `~/x` against the node's home, as the remote shell would."""
    if path == "~":
        return home
    if path.startswith("~/"):
        return posixpath.join(home, path[2:])
    return path


def lib_dir(workdir: str, build: str) -> str:
    return posixpath.join(workdir, "lib", build)


def agent_argv(python: str, node: NodeSpec, workdir: str) -> list[str]:
    argv = [
        python,
        "-m",
        "worker",
        "--bind",
        f"{node.address}:{node.control_port}",
        "--home",
        workdir,
        "--name",
        node.name,
    ]
    if node.memory_gb:
        argv += ["--memory-gb", repr(float(node.memory_gb))]
    return argv


def deployment_record(node: NodeSpec, wanted: Wanted, python: str, workdir: str) -> dict[str, Any]:
    """The node's `node.json`: what runs there and how to start it again (restart)."""
    return {
        "format": DEPLOYMENT_FORMAT,
        "cluster": wanted.cluster,
        "name": node.name,
        "address": node.address,
        "control_port": node.control_port,
        "memory_gb": node.memory_gb,
        "build": wanted.build,
        "version": wanted.version,
        "python": python,
        "keys": wanted.keys_digest,
        "pythonpath": lib_dir(workdir, wanted.build),
        "argv": agent_argv(python, node, workdir),
    }


KEYS_CHANGED = "CURVE keys changed"


def deployment_changes(deployed: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between what is deployed and what we want."""
    if deployed is None:
        return ["nothing recorded as deployed"]
    changes = []
    for key in ("build", "name", "address", "control_port", "memory_gb", "python", "keys"):
        if deployed.get(key) != wanted.get(key):
            if key == "keys":
                changes.append(KEYS_CHANGED)
            else:
                changes.append(f"{key} {deployed.get(key)!r} -> {wanted.get(key)!r}")
    return changes


# --------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class MakeVenv:
    python: str
    venv: str
    clear: bool = False
    kind: ClassVar[str] = "venv"

    @property
    def detail(self) -> str:
        return f"{'re' if self.clear else ''}create {self.venv} with {self.python}"


@dataclass(frozen=True)
class InstallDeps:
    python: str
    requirements: tuple[str, ...]
    kind: ClassVar[str] = "deps"

    @property
    def detail(self) -> str:
        names = ", ".join(requirement_name(r) for r in self.requirements)
        return f"pip install {names}"


@dataclass(frozen=True)
class CheckMlx:
    python: str
    kind: ClassVar[str] = "mlx"

    @property
    def detail(self) -> str:
        return f"import mlx with {self.python}"


@dataclass(frozen=True)
class InstallWheel:
    """Copy the wheel and unpack it into `target`.

    Unpacking a pure wheel onto a directory that goes on PYTHONPATH is what
    pip does for `--target`, minus pip's second of start-up per node. It keeps
    the worker out of the node's environment: pointing `python` at a venv that
    has an editable checkout of studiotui in it must not replace that checkout,
    and a new build lands beside the running one, which keeps running until it
    is replaced.
    """

    python: str
    build: str
    target: str
    kind: ClassVar[str] = "wheel"

    @property
    def detail(self) -> str:
        return f"unpack build {self.build} into {self.target}"


@dataclass(frozen=True)
class StopAgent:
    pid: int
    reason: str
    kind: ClassVar[str] = "stop"

    @property
    def detail(self) -> str:
        return f"stop agent pid {self.pid} ({self.reason})"


@dataclass(frozen=True)
class InstallFiles:
    """CURVE keys (mode 0600) and node.json."""

    record: Mapping[str, Any]
    kind: ClassVar[str] = "keys"

    @property
    def detail(self) -> str:
        return "install CURVE keys and node.json"


@dataclass(frozen=True)
class StartAgent:
    argv: tuple[str, ...]
    pythonpath: str
    workdir: str
    kind: ClassVar[str] = "start"

    @property
    def detail(self) -> str:
        return f"start agent on {self.argv[4]}"


@dataclass(frozen=True)
class Prune:
    dirs: tuple[str, ...]
    kind: ClassVar[str] = "prune"

    @property
    def detail(self) -> str:
        return f"remove {len(self.dirs)} old build(s)"


Step = (
    MakeVenv | InstallDeps | CheckMlx | InstallWheel | StopAgent | InstallFiles | StartAgent | Prune
)

PlanStatus = Literal["install", "start", "replace", "unchanged", "kept", "rekey"]


@dataclass(frozen=True)
class NodePlan:
    node: str
    status: PlanStatus
    reason: str
    python: str
    steps: tuple[Step, ...] = ()
    record: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    node: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        text = f"{self.node}: {self.message}"
        return f"{text}\n  hint: {self.hint}" if self.hint else text


# --------------------------------------------------------------------------- planning


def _check_python(node: NodeSpec, probe: NodeProbe) -> Refusal | PythonFacts:
    hint = PYTHON_HINT.format(node=node.name)
    py = probe.python
    if py is None:
        return Refusal(node.name, f"no Python at {node.python!r} on {node.name}", hint)
    if py.version is None:
        return Refusal(
            node.name,
            f"{py.path or node.python} on {node.name} does not run as Python:\n    "
            + py.error.replace("\n", "\n    "),
            hint,
        )
    if py.version[:2] < MIN_PYTHON:
        want = ".".join(map(str, MIN_PYTHON))
        return Refusal(
            node.name,
            f"{py.path} on {node.name} is Python {py.version_text}; studiotui needs {want} "
            "or later",
            hint,
        )
    return py


def _check_binds(
    node: NodeSpec,
    probe: NodeProbe,
    py: PythonFacts,
    ours_running: bool,
    hello: AgentHello | None,
) -> Refusal | None:
    ports = (node.control_port, node.telemetry_port)
    results = {p: py.binds.get(p, "") for p in ports}
    if any(r == "not_local" for r in results.values()):
        has = ", ".join(a for a in probe.addresses if a not in ("127.0.0.1", "::1")) or "none"
        return Refusal(
            node.name,
            f"address {node.address} is not an address of {node.name} (its addresses: {has}); "
            "the agent could not bind to it",
            f"Set `address` for {node.name} in cluster.toml to one of its own addresses "
            "(e.g. its Thunderbolt Bridge IP).",
        )
    busy = [p for p, r in results.items() if r == "in_use"]
    if busy and not ours_running and hello is not None:
        return Refusal(
            node.name,
            f"an agent (version {hello.version}, pid {hello.pid}) answers on "
            f"{node.address}:{node.control_port} but {probe.workdir}/agent.pid does not name it",
            f"It was started by hand or from another work dir; stop it on {node.name} "
            f"(`kill {hello.pid}`), then rerun provision.",
        )
    if busy and not ours_running:
        which = " and ".join(str(p) for p in busy)
        return Refusal(
            node.name,
            f"port {which} on {node.address} is already in use by another program on {node.name}",
            f"Find it with `lsof -nP -iTCP:{busy[0]} -sTCP:LISTEN` on {node.name} and stop it, "
            f"or give {node.name} another control_port in cluster.toml (it uses control_port "
            "and control_port+1).",
        )
    return None


def _ours(agent: AgentFacts | None, workdir: str) -> bool:
    """Is the pid file's process our agent (and not a pid reused after a reboot)?"""
    if agent is None or not agent.alive:
        return False
    # Without `ps` on the node there is nothing to compare; trust the pid file.
    return not agent.command or ("worker" in agent.command and workdir in agent.command)


def _runtime_python(
    node: NodeSpec, probe: NodeProbe, py: PythonFacts
) -> tuple[str, MakeVenv | None]:
    """The python the agent runs with, and the venv step that makes it if needed."""
    if py.is_venv:
        # A venv's own python is used as is: the operator chose that environment.
        return py.path, None
    venv_python = posixpath.join(probe.venv_dir, "bin", "python")
    have = probe.venv_python
    if have is None and not probe.venv_broken:
        return venv_python, MakeVenv(py.path, probe.venv_dir)
    if probe.venv_broken or have is None or have.version is None:
        return venv_python, MakeVenv(py.path, probe.venv_dir, clear=True)
    if py.version is not None and have.version[:2] != py.version[:2]:
        # `python` was pointed at another interpreter: its venv must follow.
        return venv_python, MakeVenv(py.path, probe.venv_dir, clear=True)
    return venv_python, None


def _mlx_platform(node: NodeSpec, probe: NodeProbe) -> Refusal | None:
    if probe.is_macos and probe.arch not in ("arm64", "arm64e"):
        return Refusal(
            node.name,
            f"{node.name} is an Intel Mac ({probe.arch}); MLX runs only on Apple silicon",
            f"Remove {node.name} from cluster.toml, or use an Apple silicon Mac.",
        )
    return None


def plan_node(
    probe: NodeProbe,
    node: NodeSpec,
    wanted: Wanted,
    *,
    upgrade: bool = False,
    hello: AgentHello | None = None,
    min_free_bytes: int = MIN_FREE_BYTES,
    operator_mark: str = "",
) -> NodePlan | Refusal:
    """Decide what to do on `node` given its probe and what its agent said (if it did).

    `operator_mark` is the token in the operator's STUDIOTUI_HOME: a workdir holding
    the same one is that home (this machine over SSH, or a shared home directory)."""
    if operator_mark and probe.home_mark == operator_mark:
        return Refusal(
            node.name,
            f"{node.name}'s workdir {probe.workdir} is this studiotui's own STUDIOTUI_HOME: "
            "a node there would share (and prune) the operator's keys, history and builds",
            f"Set `workdir` for {node.name} in cluster.toml to another directory "
            "(for example ~/studiotui-node).",
        )
    checked = _check_python(node, probe)
    if isinstance(checked, Refusal):
        return checked
    py = checked
    if refusal := _mlx_platform(node, probe):
        return refusal
    ours_running = _ours(probe.agent, probe.workdir)
    if refusal := _check_binds(node, probe, py, ours_running, hello):
        return refusal

    python, venv_step = _runtime_python(node, probe, py)
    record = deployment_record(node, wanted, python, probe.workdir)
    changes = deployment_changes(probe.deployed, record)
    running_pid = probe.agent.pid if ours_running and probe.agent else None
    answering = hello is not None and (hello.pid is None or hello.pid == running_pid)

    if ours_running and answering and not changes:
        assert hello is not None
        if hello.version == wanted.version:
            return NodePlan(
                node.name, "unchanged", f"agent {wanted.build} is up", python, (), record
            )
        changes = [f"agent reports version {hello.version}, want {wanted.version}"]
    if (
        ours_running
        and answering
        and changes == [KEYS_CHANGED]
        and hello is not None
        and hello.version == wanted.version
    ):
        # Only the cluster's keys changed (a node joined or left): the running agent and
        # its shards reload them from disk, so nothing is restarted and nothing unloaded.
        reason = "installing the cluster's new keys"
        return NodePlan(node.name, "rekey", reason, python, (InstallFiles(record),), record)
    if ours_running and not upgrade:
        why = "; ".join(changes) if changes else "it does not answer on its control socket"
        running = (probe.deployed or {}).get("build", "of unknown build")
        return NodePlan(
            node.name,
            "kept",
            f"agent {running} (pid {running_pid}) left running: {why}. "
            "Rerun with --upgrade to replace it (its shards stop, then are loaded again).",
            python,
            (),
            record,
        )

    steps: list[Step] = []
    install: list[Step] = []
    if venv_step is not None:
        install.append(venv_step)
        install.append(InstallDeps(python, wanted.requirements))
        install.append(CheckMlx(python))
    else:
        runtime = probe.runtime
        if runtime is None or runtime.python != python or runtime.error:
            detail = runtime.error if runtime else "it was not probed"
            return Refusal(
                node.name,
                f"cannot check the environment of {python} on {node.name}: {detail}",
                f"Run `{python} -c 'import sys; print(sys.version)'` on {node.name}; fix or "
                f"point `python` for {node.name} in cluster.toml at a working interpreter.",
            )
        if runtime.unmet:
            install.append(InstallDeps(python, runtime.unmet))
            install.append(CheckMlx(python))
        elif runtime.mlx_error:
            return Refusal(
                node.name,
                f"MLX is installed for {python} on {node.name} but does not work:\n    "
                + runtime.mlx_error.replace("\n", "\n    "),
                MLX_HINT.format(node=node.name, python=python),
            )
    if wanted.build not in probe.builds:
        install.append(InstallWheel(python, wanted.build, lib_dir(probe.workdir, wanted.build)))

    if install and probe.free_bytes is not None and probe.free_bytes < min_free_bytes:
        where = probe.free_path or probe.workdir
        return Refusal(
            node.name,
            f"only {gb(probe.free_bytes)} free on {where} on {node.name}; installing the "
            f"worker needs {gb(min_free_bytes)}",
            f"Free some space on {node.name}, or set `workdir` for {node.name} in cluster.toml "
            "to a disk with room.",
        )
    if ours_running and running_pid is not None:
        stop = StopAgent(running_pid, "; ".join(changes) if changes else "not answering")
        # Install while the old agent still serves, to keep the gap short; but
        # a venv is not rebuilt under a process that runs from it.
        if venv_step is not None and venv_step.clear:
            steps.extend([stop, *install])
        else:
            steps.extend([*install, stop])
    else:
        steps.extend(install)
    steps.append(InstallFiles(record))
    steps.append(StartAgent(tuple(record["argv"]), str(record["pythonpath"]), probe.workdir))
    stale = tuple(lib_dir(probe.workdir, b) for b in probe.builds if b != wanted.build)
    if stale:
        steps.append(Prune(stale))

    if ours_running:
        status: PlanStatus = "replace"
        reason = "replacing agent: " + ("; ".join(changes) if changes else "not answering")
    elif any(isinstance(s, InstallWheel | InstallDeps | MakeVenv) for s in steps):
        status, reason = "install", f"installing {wanted.build}"
    else:
        status, reason = "start", f"starting {wanted.build} (already installed)"
    return NodePlan(node.name, status, reason, python, tuple(steps), record)
