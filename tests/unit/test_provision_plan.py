"""The pure half of provisioning: reading the probe, and deciding the steps."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from studiotui.core.inventory import NodeSpec
from studiotui.provision import remote
from studiotui.provision.deploy import last_start
from studiotui.provision.plan import (
    MIN_FREE_BYTES,
    SECTION_PREFIX,
    AgentHello,
    CheckMlx,
    InstallDeps,
    InstallFiles,
    InstallWheel,
    MakeVenv,
    NodePlan,
    ProbeError,
    Prune,
    Refusal,
    StartAgent,
    StopAgent,
    Wanted,
    agent_argv,
    deployment_record,
    expand_home,
    extra_requirements,
    node_requirements,
    parse_df,
    parse_probe,
    plan_node,
    requirement_name,
    split_sections,
)
from tests.support.fixture_paths import macos_fixtures

WORKDIR = "/Users/me/studio tui 'x'"
VENV_PY = "/Users/me/venvs/mlx/bin/python"
BUILD = "0.1.0+abcdef012345"
REQS = ("mlx>=0.25", "pyzmq>=26", "msgpack>=1.0")


FIXTURES = macos_fixtures()

NODE = NodeSpec(
    name="studio-1",
    host="studio-1.local",
    address="169.254.10.1",
    control_port=28500,
    workdir="~/studio tui 'x'",
    python="python3",
)


def wanted(build: str = BUILD, version: str = "0.1.0") -> Wanted:
    return Wanted(build=build, version=version, requirements=REQS, keys_digest="k1", cluster="d")


def section(name: str, body: str) -> str:
    return f"\n{SECTION_PREFIX}{name}\n{body}\n"


def probe_text(
    *,
    os_name: str = "Linux",
    python: str | None = "path=/usr/bin/python3\nversion=3.12.4\nvenv=0\n"
    "bind.28500=ok\nbind.28501=ok\nrc=0",
    venv: str = "missing=1",
    runtime: str = "",
    agent: str = "",
    deployed: str = "",
    builds: str = "",
    free_kb: int = 50_000_000,
    extra: str = "",
) -> str:
    text = section(
        "env",
        f"os={os_name}\nrelease=6.1\narch={'arm64' if os_name == 'Darwin' else 'x86_64'}\n"
        f"home=/Users/me\nworkdir={WORKDIR}",
    )
    text += section(
        "df",
        "Filesystem 1024-blocks Used Available Capacity Mounted on\n"
        f"/dev/disk3s5 100000000 2000 {free_kb} 5% /System/Volumes/Data",
    )
    text += section("df_path", "/Users/me")
    if os_name == "Linux":
        text += section("meminfo", "MemTotal:       16384000 kB\nMemAvailable: 8000000 kB")
        text += section("chip", "model name\t: AMD EPYC 7B13")
        text += section("os_release", 'ID=debian\nPRETTY_NAME="Debian GNU/Linux 12 (bookworm)"')
        text += section(
            "ip",
            json.dumps(
                [
                    {
                        "ifname": "eth0",
                        "flags": ["UP"],
                        "operstate": "UP",
                        "addr_info": [{"family": "inet", "local": "169.254.10.1", "prefixlen": 16}],
                    }
                ]
            ),
        )
    text += extra
    text += section("python", python if python is not None else "missing=python3")
    text += section("venv", venv)
    text += section("runtime", runtime)
    text += section("agent", agent)
    text += section("deployed", deployed)
    text += section("builds", builds)
    text += section("end", "")
    return text


def runtime_ok(path: str, unmet: tuple[str, ...] = ()) -> str:
    facts = json.dumps({"unmet": list(unmet), "pip": True})
    return f"path={path}\n{facts}\nmlx=0.32.4\ndevice=Device(cpu, 0)\nrc=0"


def venv_python_text(binds: bool = True) -> str:
    text = f"path={VENV_PY}\nversion=3.12.4\nvenv=1\n"
    if binds:
        text += "bind.28500=ok\nbind.28501=ok\n"
    return text + "rc=0"


def node_with_venv() -> NodeSpec:
    return replace(NODE, python=VENV_PY)


def deployed_json(node: NodeSpec, python: str, build: str = BUILD, keys: str = "k1") -> str:
    record = deployment_record(node, replace(wanted(build), keys_digest=keys), python, WORKDIR)
    return json.dumps(record)


# --------------------------------------------------------------------------- parsing


def test_split_sections_and_df() -> None:
    text = "motd noise\n@@studiotui:a\n1\n2\n@@studiotui:b\n\n@@studiotui:a\n3"
    assert split_sections(text) == {"a": "1\n2\n3", "b": ""}
    free, mount = parse_df(
        "Filesystem 1024-blocks Used Available Capacity Mounted on\n"
        "map auto_home 0 0 0 100% /System/Volumes/Data/home\n"
        "/dev/disk 100 40 60 40% /Volumes/My Disk"
    )
    assert (free, mount) == (0, "/System/Volumes/Data/home")
    assert parse_df("garbage") == (None, "")


def test_parse_linux_probe() -> None:
    agent = f"pid=4242\nalive=1\ncommand=/x/python -m worker --home {WORKDIR}"
    probe = parse_probe(
        "studio-1",
        probe_text(
            venv=f"path={WORKDIR}/venv/bin/python\nversion=3.12.4\nvenv=1\nrc=0",
            runtime=runtime_ok(f"{WORKDIR}/venv/bin/python", ("pyzmq>=26",)),
            agent=agent,
            deployed='{"build": "0.0.9+old"}',
            builds="0.0.9+old\n.0.1.0+x.tmp-12",
        ),
    )
    assert probe.os == "Linux" and probe.arch == "x86_64"
    assert probe.workdir == WORKDIR
    assert probe.memory_total == 16384000 * 1024
    assert probe.free_bytes == 50_000_000 * 1024
    assert probe.chip == "AMD EPYC 7B13"
    assert probe.os_version == "Debian GNU/Linux 12 (bookworm)"
    assert probe.addresses == ("169.254.10.1",)
    assert probe.python is not None and probe.python.version == (3, 12, 4)
    assert probe.python.binds == {28500: "ok", 28501: "ok"}
    assert probe.venv_python is not None and probe.venv_python.is_venv
    assert probe.runtime is not None and probe.runtime.unmet == ("pyzmq>=26",)
    assert probe.runtime.mlx_version == "0.32.4"
    assert probe.agent is not None and probe.agent.pid == 4242 and probe.agent.alive
    assert probe.deployed == {"build": "0.0.9+old"}
    assert probe.builds == ("0.0.9+old",)  # half-unpacked temp dirs are not builds
    assert probe.notes == ()


def test_parse_probe_of_nothing_says_what_it_saw() -> None:
    with pytest.raises(ProbeError, match="This account is disabled"):
        parse_probe("studio-1", "This account is disabled.\n")


def test_parse_macos_probe_thunderbolt_and_rdma() -> None:
    def fixture(prefix: str) -> str:
        name = next(p for p in sorted(FIXTURES.iterdir()) if p.name.startswith(prefix))
        return name.read_text(encoding="utf-8")

    extra = (
        section("memsize", "549755813888")
        + section("chip", "Apple M3 Ultra")
        + section("sw_vers", "26.2")
        + section("ifconfig", fixture("ifconfig.all-interfaces.bridge0"))
        + section("rdma_ctl", fixture("rdma_ctl_status.enabled"))
        + section("ibv_devices", fixture("ibv_devices.m3ultra-6-ports"))
        + section("thunderbolt", fixture("system_profiler_SPThunderboltDataType.json.tb5-peer."))
    )
    probe = parse_probe("studio-1", probe_text(os_name="Darwin", extra=extra))
    assert probe.is_macos and probe.os_version == "26.2"
    assert probe.memory_total == 512 * 1024**3
    assert probe.rdma is not None and probe.rdma.status == "enabled"
    assert probe.rdma.devices and all(d.startswith("rdma_en") for d in probe.rdma.devices)
    assert "bridge0" in probe.interfaces
    facts = probe.summary()
    assert facts["rdma"] == "enabled" and facts["chip"] == "Apple M3 Ultra"


def test_odd_probe_sections_become_notes() -> None:
    extra = section("rdma_ctl", "segmentation fault") + section("memsize", "lots")
    probe = parse_probe("studio-1", probe_text(os_name="Darwin", extra=extra))
    assert probe.memory_total is None
    assert any("sysctl hw.memsize" in n for n in probe.notes)
    assert any("rdma_ctl" in n for n in probe.notes)


def test_a_nodes_requirements_are_the_node_extra() -> None:
    """From pyproject's table, the node extra as written; from a wheel's METADATA, the
    lines whose marker holds with the extra and not without it, markers kept."""
    project = {
        "dependencies": ["studiotui[node]", "textual>=0.80"],
        "optional-dependencies": {
            "node": ["mlx[cpu]>=0.25; sys_platform == 'linux'", "pyzmq>=26"],
            "test": ["pytest>=8"],
        },
    }
    assert node_requirements(project) == ("mlx[cpu]>=0.25; sys_platform == 'linux'", "pyzmq>=26")
    assert node_requirements({"dependencies": ["textual"]}) == ()
    requires_dist = [
        "studiotui[node]",
        "textual>=0.80",
        'mlx[cpu]>=0.25; sys_platform == "linux" and extra == "node"',
        'pyzmq>=26; extra == "node"',
        'pytest>=8; extra == "test"',
    ]
    assert extra_requirements(requires_dist) == (
        'mlx[cpu]>=0.25; sys_platform == "linux" and extra == "node"',
        'pyzmq>=26; extra == "node"',
    )
    assert requirement_name("huggingface_hub>=0.24") == "huggingface-hub"
    assert requirement_name("mlx[cpu]>=0.25; sys_platform == 'linux'") == "mlx"


def test_expand_home_and_argv() -> None:
    assert expand_home("~", "/Users/me") == "/Users/me"
    assert expand_home("~/x y", "/Users/me") == "/Users/me/x y"
    assert expand_home("/abs", "/Users/me") == "/abs"
    argv = agent_argv("/p", replace(NODE, memory_gb=128), WORKDIR)
    assert argv[-2:] == ["--memory-gb", "128.0"]
    assert argv[argv.index("--home") + 1] == WORKDIR


# --------------------------------------------------------------------------- planning


def kinds(plan: NodePlan | Refusal) -> list[type]:
    assert isinstance(plan, NodePlan), str(plan)
    return [type(s) for s in plan.steps]


def test_fresh_node_with_plain_python_gets_a_venv_and_dependencies() -> None:
    probe = parse_probe("studio-1", probe_text())
    plan = plan_node(probe, NODE, wanted())
    assert kinds(plan) == [MakeVenv, InstallDeps, CheckMlx, InstallWheel, InstallFiles, StartAgent]
    assert isinstance(plan, NodePlan)
    assert plan.status == "install"
    venv = plan.steps[0]
    assert isinstance(venv, MakeVenv) and venv.python == "/usr/bin/python3"
    assert venv.venv == f"{WORKDIR}/venv" and not venv.clear
    deps = plan.steps[1]
    assert isinstance(deps, InstallDeps) and deps.requirements == REQS
    start = plan.steps[-1]
    assert isinstance(start, StartAgent)
    assert start.argv[0] == f"{WORKDIR}/venv/bin/python"
    assert start.pythonpath == f"{WORKDIR}/lib/{BUILD}"


def test_a_venvs_python_is_used_as_is_and_only_the_wheel_installed() -> None:
    probe = parse_probe(
        "studio-1", probe_text(python=venv_python_text(), runtime=runtime_ok(VENV_PY))
    )
    plan = plan_node(probe, node_with_venv(), wanted())
    assert kinds(plan) == [InstallWheel, InstallFiles, StartAgent]
    assert isinstance(plan, NodePlan) and plan.python == VENV_PY


def test_missing_dependencies_are_installed_and_mlx_checked() -> None:
    probe = parse_probe(
        "studio-1",
        probe_text(python=venv_python_text(), runtime=runtime_ok(VENV_PY, ("mlx>=0.25",))),
    )
    plan = plan_node(probe, node_with_venv(), wanted())
    assert kinds(plan) == [InstallDeps, CheckMlx, InstallWheel, InstallFiles, StartAgent]
    assert isinstance(plan, NodePlan)
    assert plan.steps[0] == InstallDeps(VENV_PY, ("mlx>=0.25",))


def test_existing_venv_of_other_python_is_recreated() -> None:
    venv = f"path={WORKDIR}/venv/bin/python\nversion=3.11.2\nvenv=1\nrc=0"
    probe = parse_probe("studio-1", probe_text(venv=venv))
    plan = plan_node(probe, NODE, wanted())
    assert isinstance(plan, NodePlan)
    assert plan.steps[0] == MakeVenv("/usr/bin/python3", f"{WORKDIR}/venv", clear=True)


def _running(build: str = BUILD, keys: str = "k1", pid: int = 4242) -> str:
    return probe_text(
        python=f"path={VENV_PY}\nversion=3.12.4\nvenv=1\nbind.28500=in_use\nbind.28501=in_use\nrc=0",
        runtime=runtime_ok(VENV_PY),
        agent=f"pid={pid}\nalive=1\ncommand={VENV_PY} -m worker --home {WORKDIR}",
        deployed=deployed_json(node_with_venv(), VENV_PY, build, keys),
        builds=build,
    )


def test_up_to_date_agent_means_nothing_to_do() -> None:
    probe = parse_probe("studio-1", _running())
    plan = plan_node(probe, node_with_venv(), wanted(), hello=AgentHello("0.1.0", 4242))
    assert isinstance(plan, NodePlan)
    assert plan.status == "unchanged" and plan.steps == ()
    # Even a full disk does not matter when nothing is installed.
    low = plan_node(
        probe, node_with_venv(), wanted(), hello=AgentHello("0.1.0", 4242), min_free_bytes=10**18
    )
    assert isinstance(low, NodePlan) and low.status == "unchanged"


def test_agent_of_another_build_is_kept_unless_upgrade() -> None:
    probe = parse_probe("studio-1", _running(build="0.0.9+old"))
    hello = AgentHello("0.0.9", 4242)
    kept = plan_node(probe, node_with_venv(), wanted(), hello=hello)
    assert isinstance(kept, NodePlan) and kept.status == "kept" and kept.steps == ()
    assert "--upgrade" in kept.reason and "0.0.9+old" in kept.reason

    plan = plan_node(probe, node_with_venv(), wanted(), hello=hello, upgrade=True)
    assert kinds(plan) == [InstallWheel, StopAgent, InstallFiles, StartAgent, Prune]
    assert isinstance(plan, NodePlan) and plan.status == "replace"
    stop = plan.steps[1]
    assert isinstance(stop, StopAgent) and stop.pid == 4242 and "build" in stop.reason
    prune = plan.steps[-1]
    assert isinstance(prune, Prune) and prune.dirs == (f"{WORKDIR}/lib/0.0.9+old",)


def test_a_venv_is_not_rebuilt_under_a_running_agent() -> None:
    venv_py = f"{WORKDIR}/venv/bin/python"
    node = replace(NODE, python="python3")
    text = probe_text(
        python="path=/usr/bin/python3\nversion=3.12.4\nvenv=0\nbind.28500=in_use\nrc=0",
        venv=f"path={venv_py}\nversion=3.11.2\nvenv=1\nrc=0",
        agent=f"pid=4242\nalive=1\ncommand={venv_py} -m worker --home {WORKDIR}",
        deployed=deployed_json(node, venv_py, "0.0.9+old"),
    )
    plan = plan_node(parse_probe("studio-1", text), node, wanted(), upgrade=True)
    assert kinds(plan)[:2] == [StopAgent, MakeVenv]


def test_new_keys_are_installed_under_the_running_agent_a_silent_one_needs_upgrade() -> None:
    probe = parse_probe("studio-1", _running(keys="k0"))
    # The agent reloads its keys from disk: only the files change, nothing restarts.
    rekey = plan_node(probe, node_with_venv(), wanted(), hello=AgentHello("0.1.0", 4242))
    assert isinstance(rekey, NodePlan) and rekey.status == "rekey"
    assert kinds(rekey) == [InstallFiles]
    # Keys and version both changed: that is still an upgrade to ask for.
    kept = plan_node(probe, node_with_venv(), wanted(), hello=AgentHello("0.0.9", 4242))
    assert isinstance(kept, NodePlan) and kept.status == "kept"
    assert "CURVE keys changed" in kept.reason
    silent = plan_node(parse_probe("studio-1", _running()), node_with_venv(), wanted(), hello=None)
    assert isinstance(silent, NodePlan) and silent.status == "kept"
    assert "does not answer" in silent.reason


def test_dead_agent_is_started_again_without_reinstalling() -> None:
    text = _running().replace("alive=1\n", "").replace("in_use", "ok")
    plan = plan_node(parse_probe("studio-1", text), node_with_venv(), wanted())
    assert kinds(plan) == [InstallFiles, StartAgent]
    assert isinstance(plan, NodePlan) and plan.status == "start"


def test_pid_file_of_someone_else_is_not_our_agent() -> None:
    text = _running().replace(f"command={VENV_PY} -m worker", "command=/usr/sbin/cupsd -l")
    plan = plan_node(parse_probe("studio-1", text), node_with_venv(), wanted())
    # Not ours, and the port is taken: the operator has to look.
    assert isinstance(plan, Refusal) and "already in use" in plan.message


# --------------------------------------------------------------------------- refusals


def refusal(text: str, node: NodeSpec = NODE, **kw: object) -> Refusal:
    plan = plan_node(parse_probe(node.name, text), node, wanted(), **kw)  # type: ignore[arg-type]
    assert isinstance(plan, Refusal), plan
    assert node.name in str(plan) and plan.hint
    return plan


def test_refuses_missing_and_old_python() -> None:
    r = refusal(probe_text(python=None))
    assert "no Python at 'python3'" in r.message and "3.11" in r.hint
    r = refusal(probe_text(python="path=/usr/bin/python3\nversion=3.9.6\nvenv=0\nrc=0"))
    assert "is Python 3.9.6" in r.message and "needs 3.11" in r.message
    r = refusal(probe_text(python="path=/usr/bin/python3\nSyntaxError: invalid syntax\nrc=1"))
    assert "does not run as Python" in r.message and "SyntaxError" in r.message


def test_refuses_low_disk_naming_how_much_is_free_where() -> None:
    r = refusal(probe_text(free_kb=1024 * 1024))
    assert "only 1.0 GB free on /Users/me" in r.message and "needs 2.0 GB" in r.message
    assert MIN_FREE_BYTES == 2 * 1024**3


def test_refuses_broken_mlx_and_intel_macs() -> None:
    facts = json.dumps({"unmet": [], "pip": True})
    error = "Traceback (most recent call last):\nImportError: libmlx.so: cannot open shared object"
    text = probe_text(python=venv_python_text(), runtime=f"path={VENV_PY}\n{facts}\n{error}\nrc=1")
    r = refusal(text, node_with_venv())
    assert "MLX is installed" in r.message and "libmlx.so" in r.message
    assert "Apple silicon" in r.hint
    intel = probe_text(os_name="Darwin").replace("arch=arm64", "arch=x86_64")
    assert "Intel Mac" in refusal(intel).message


def test_refuses_foreign_address_and_busy_port() -> None:
    text = probe_text(python="path=/p\nversion=3.12.0\nvenv=0\nbind.28500=not_local\nrc=0")
    r = refusal(text)
    assert "169.254.10.1 is not an address of studio-1" in r.message
    text = probe_text(python="path=/p\nversion=3.12.0\nvenv=0\nbind.28501=in_use\nrc=0")
    r = refusal(text)
    assert "port 28501 on 169.254.10.1 is already in use" in r.message
    assert "lsof" in r.hint
    r = refusal(text, hello=AgentHello("0.0.1", 999))
    assert "agent.pid does not name it" in r.message and "kill 999" in r.hint


# --------------------------------------------------------------------------- node-side snippets


def _old_pythons() -> list[str]:
    root = Path("~/.pyenv/versions").expanduser()
    found = [str(p) for p in sorted(root.glob("[23].*/bin/python")) if p.exists()]
    return [p for p in found if not p.split("/")[-3].startswith(("3.11", "3.12", "3.13", "3.14"))]


@pytest.mark.parametrize("python", [sys.executable, *_old_pythons()[:2]])
def test_light_snippet_runs_on_any_python(python: str) -> None:
    out = subprocess.run(
        [python, "-c", remote.LIGHT_SNIPPET, "127.0.0.1", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "version=" in out and "bind.0=ok" in out


def test_probe_script_runs_here_and_parses(tmp_path: Path) -> None:
    """The real script through a real sh on this machine (no SSH): Linux facts come out."""
    workdir = tmp_path / "work dir 'q'"
    node = replace(NODE, python=sys.executable, workdir=str(workdir), address="127.0.0.1")
    argv = remote.probe_argv(node, ["pyzmq>=26", "no-such-package-xyz>=1"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    probe = parse_probe("here", out)
    assert probe.os == "Linux" and probe.workdir == str(workdir)
    assert probe.free_bytes and probe.free_bytes > 0
    assert probe.memory_total and probe.memory_total > 0
    assert probe.python is not None and probe.python.version == tuple(sys.version_info[:3])
    assert probe.runtime is not None and probe.runtime.unmet == ("no-such-package-xyz>=1",)
    assert probe.runtime.mlx_version
    assert "127.0.0.1" in probe.addresses or not probe.interfaces


def test_last_start_keeps_only_the_latest_run() -> None:
    text = (
        "old line\n=== studiotui: starting agent at 1 ===\nrun one\n"
        "=== studiotui: starting agent at 2 ===\nTraceback\nImportError: x\n"
    )
    assert last_start(text) == "Traceback\nImportError: x"
    assert last_start("no marker\nat all") == "no marker\nat all"


def test_nodes_get_no_operator_only_requirement_of_the_project() -> None:
    """What the dashboard, the API, the browser view and documents need stays off the Macs
    that only run shards (and off their pip, which may have no index to reach); what the
    node side imports is all there."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    on_nodes = {requirement_name(r) for r in node_requirements(project["project"])}
    needed = {"mlx-lm", "pyzmq", "msgspec", "psutil", "numpy", "huggingface-hub"}
    assert needed <= on_nodes
    assert not on_nodes & {"textual", "textual-serve", "rich", "asyncssh", "aiohttp", "pypdf"}
    # The operator installs what a node runs too (local nodes, demo models, the bench).
    assert "studiotui[node]" in project["project"]["dependencies"]
