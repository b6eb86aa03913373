"""The node side of provisioning, as argv lists run over SSH (see `ssh.run`).

Every remote program is `sh -c SCRIPT sh ARG...` or `PYTHON -c SNIPPET ARG...`:
the script text and each argument travel as separate, shell-quoted words, so a
work dir with spaces or quotes in it reaches the node verbatim and no value is
ever pasted into code. Scripts stick to POSIX sh and to tools both macOS and
Linux have (no `setsid`, which macOS lacks; no GNU options).

Paths may start with `~/`; scripts expand it against the node's $HOME.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import asyncssh

from studiotui.core.inventory import NodeSpec
from studiotui.provision.plan import SECTION_PREFIX, parse_kv
from studiotui.ssh import client as ssh

# Shared by every script: `~` expansion and a liveness test that does not take
# a zombie for a running agent (a container's pid 1 may never reap it).
# Left in every build studiotui unpacks into a workdir's lib/: only those are pruned.
BUILD_MARKER = ".studiotui-build"

_PRELUDE = r"""
expand() {
  case $1 in
    "~") printf '%s' "$HOME" ;;
    "~/"*) printf '%s/%s' "$HOME" "${1#"~/"}" ;;
    *) printf '%s' "$1" ;;
  esac
}
alive() {
  kill -0 "$1" 2>/dev/null || return 1
  case $(ps -o stat= -p "$1" 2>/dev/null) in Z*) return 1 ;; esac
  return 0
}
"""

# $1 python, $2 workdir, $3 address, $4 ports (space separated), $5 requirements
# (newline separated), $6 light snippet, $7 facts snippet.
PROBE_SCRIPT = (
    _PRELUDE
    + r"""
py=$(expand "$1"); wd=$(expand "$2"); addr=$3; ports=$4; reqs=$5
m() { printf '\n%s%s\n' '"""
    + SECTION_PREFIX
    + r"""' "$1"; }
m env
printf 'os=%s\nrelease=%s\narch=%s\nhome=%s\nworkdir=%s\n' \
  "$(uname -s)" "$(uname -r)" "$(uname -m)" "$HOME" "$wd"
d=$wd
while [ ! -d "$d" ]; do d=$(dirname "$d"); done
m df; df -Pk "$d" 2>&1
m df_path; printf '%s\n' "$d"
if [ "$(uname -s)" = Darwin ]; then
  m memsize; sysctl -n hw.memsize 2>&1
  m chip; sysctl -n machdep.cpu.brand_string 2>&1
  m sw_vers; sw_vers -productVersion 2>&1
  m ifconfig; ifconfig 2>&1
  m rdma_ctl; rdma_ctl status 2>&1
  m ibv_devices; ibv_devices 2>&1
  m thunderbolt; system_profiler SPThunderboltDataType -json 2>/dev/null
else
  m meminfo; cat /proc/meminfo 2>&1
  m chip; grep -m1 'model name' /proc/cpuinfo 2>/dev/null
  m os_release; cat /etc/os-release 2>/dev/null
  m ip; ip -j addr 2>&1
fi
rt=
m python
p=$(command -v "$py" 2>/dev/null)
if [ -n "$p" ] && [ -x "$p" ]; then
  printf 'path=%s\n' "$p"
  out=$("$p" -c "$6" "$addr" $ports 2>&1); rc=$?
  printf '%s\nrc=%s\n' "$out" "$rc"
  case $out in *venv=1*) rt=$p ;; esac
else
  printf 'missing=%s\n' "$py"
fi
m venv
v=$wd/venv/bin/python
if [ -x "$v" ]; then
  printf 'path=%s\n' "$v"; "$v" -c "$6" "$addr" 2>&1; printf 'rc=%s\n' "$?"
  [ -z "$rt" ] && rt=$v
elif [ -e "$v" ] || [ -L "$v" ]; then echo broken=1
else echo missing=1
fi
m runtime
if [ -n "$rt" ]; then
  printf 'path=%s\n' "$rt"; "$rt" -c "$7" "$reqs" 2>&1; printf 'rc=%s\n' "$?"
fi
m agent
if [ -f "$wd/agent.pid" ]; then
  pid=$(cat "$wd/agent.pid" 2>/dev/null)
  printf 'pid=%s\n' "$pid"
  case $pid in
    ''|*[!0-9]*) ;;
    *) if alive "$pid"; then
         echo alive=1
         printf 'command=%s\n' "$(ps -ww -o command= -p "$pid" 2>/dev/null)"
       fi ;;
  esac
fi
m deployed; cat "$wd/node.json" 2>/dev/null
m home_mark; cat "$wd/.studiotui-home" 2>/dev/null
m builds
# Only what studiotui unpacked (it leaves .studiotui-build inside): a workdir pointed at
# ~ or /opt/homebrew must never have ~/lib or /opt/homebrew/lib taken for old builds.
for d in "$wd"/lib/*/; do
  [ -f "$d.studiotui-build" ] && basename "$d"
done
m end
exit 0
"""
)

# Python 2 and 3 syntax: it must run on whatever `python` names, to say how old it is.
LIGHT_SNIPPET = r"""
import sys, socket, errno
print("version=%d.%d.%d" % tuple(sys.version_info[:3]))
base = getattr(sys, "base_prefix", getattr(sys, "real_prefix", sys.prefix))
print("venv=%d" % int(sys.prefix != base))
print("executable=%s" % sys.executable)
addr = sys.argv[1] if len(sys.argv) > 1 else ""
for port in sys.argv[2:]:
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    # ZeroMQ sets SO_REUSEADDR too, so a port in TIME_WAIT counts as free.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, int(port)))
        result = "ok"
    except socket.error as e:
        code = getattr(e, "errno", None)
        if code == errno.EADDRINUSE:
            result = "in_use"
        elif code == errno.EADDRNOTAVAIL:
            result = "not_local"
        else:
            result = "error %s" % (e,)
    s.close()
    print("bind.%s=%s" % (port, result))
"""

# Which of the node's requirements (pyproject's `node` extra) are unmet; markers are
# evaluated with that extra, as a wheel's lines carry it. Extras are checked one level
# deep (mlx[cpu] -> mlx-cpu); pip does the full resolution when installing.
FACTS_SNIPPET = r"""
import json, sys
from importlib import metadata, util
try:
    from packaging.requirements import Requirement
except ImportError:
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        Requirement = None

def unmet(text, env=None):
    if Requirement is None:
        name = text.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0]
        try:
            metadata.version(name.strip())
            return []
        except metadata.PackageNotFoundError:
            return [text]
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate(env or {"extra": "node"}):
        return []
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return [text.split(";")[0].strip()]
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        return [text.split(";")[0].strip()]
    missing = []
    for extra in sorted(req.extras):
        for sub in metadata.requires(req.name) or []:
            if "extra" in sub:
                missing += unmet(sub, {"extra": extra})
    return missing

found = []
for line in sys.argv[1].splitlines():
    if line.strip():
        found += unmet(line.strip())
print(json.dumps({"unmet": sorted(set(found)), "pip": util.find_spec("pip") is not None}))
# The MLX check shares this interpreter start; the facts are out first, so
# even a crash inside MLX's native code loses nothing but the MLX line.
sys.stdout.flush()
"""

MLX_SNIPPET = r"""
import mlx.core as mx
a = mx.array([1.0, 2.0]) + 1
mx.eval(a)
print("mlx=%s" % mx.__version__)
print("device=%s" % mx.default_device())
"""
FACTS_SNIPPET += MLX_SNIPPET

# $1 wheel, $2 target dir. Unpacks beside the target and renames, so a half
# unpacked build is never taken for an installed one.
UNPACK_SNIPPET = r"""
import os, shutil, sys, zipfile
wheel, target = sys.argv[1], sys.argv[2]
tmp = "%s.tmp-%d" % (target, os.getpid())
shutil.rmtree(tmp, ignore_errors=True)
with zipfile.ZipFile(wheel) as z:
    z.extractall(tmp)
open(os.path.join(tmp, ".studiotui-build"), "w").close()
if os.path.isdir(target):
    shutil.rmtree(target)
os.rename(tmp, target)
os.remove(wheel)
print("installed=%s" % target)
"""

# $1 workdir, $2 PYTHONPATH, $3 address, $4 port, $5 seconds, $6... the agent's
# argv. Starts the agent in a session of its own (macOS has no setsid(1)) with no
# tie to the SSH channel, so it outlives the connection, and writes the pid file.
# Then it waits, on the node, until the agent listens or exits: that moment is
# seen at once here, where the controller's ZeroMQ reconnect back-off would
# notice it up to seconds late.
LAUNCH_SNIPPET = r"""
import os, socket, subprocess, sys, time
wd, pythonpath, addr, port, wait_s = sys.argv[1:6]
argv = sys.argv[6:]
env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1")
out = open(os.path.join(wd, "agent.out"), "ab")
stamp = time.strftime("%Y-%m-%d %H:%M:%S")
out.write(("\n=== studiotui: starting agent at %s ===\n" % stamp).encode())
out.flush()
proc = subprocess.Popen(
    argv, cwd=wd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
    start_new_session=True, close_fds=True,
)
pid_file = os.path.join(wd, "agent.pid")
with open(pid_file + ".tmp", "w") as f:
    f.write(str(proc.pid))
os.replace(pid_file + ".tmp", pid_file)
print("pid=%d" % proc.pid)
sys.stdout.flush()
state = "timeout"
deadline = time.time() + float(wait_s)
while time.time() < deadline:
    code = proc.poll()
    if code is not None:
        state = "exited"
        print("code=%d" % code)
        break
    try:
        socket.create_connection((addr, int(port)), timeout=0.5).close()
        state = "listening"
        break
    except OSError:
        time.sleep(0.05)
print("state=%s" % state)
"""

# $1 workdir, $2 seconds before SIGKILL. Stops the agent named by the pid
# file, and only if that process looks like our agent.
STOP_SCRIPT = (
    _PRELUDE
    + r"""
wd=$(expand "$1"); grace=$2; f=$wd/agent.pid
[ -f "$f" ] || { echo state=not_running; exit 0; }
pid=$(cat "$f" 2>/dev/null)
case $pid in ''|*[!0-9]*) rm -f "$f"; echo state=not_running; exit 0 ;; esac
if ! alive "$pid"; then rm -f "$f"; echo state=not_running; printf 'pid=%s\n' "$pid"; exit 0; fi
cmd=$(ps -ww -o command= -p "$pid" 2>/dev/null)
# The agent's own argv (python -m worker ... --home WORKDIR --name ...), not just any
# command with "worker" in it: a stale pid file may name anybody's process by now.
case $cmd in
  '') ;;
  *" -m worker"*" --home $wd "*) ;;
  *) echo state=foreign; printf 'pid=%s\ncommand=%s\n' "$pid" "$cmd"; exit 0 ;;
esac
kill -TERM "$pid" 2>/dev/null
i=0; limit=$((grace * 10))
while alive "$pid"; do
  i=$((i + 1))
  if [ "$i" -ge "$limit" ]; then kill -KILL "$pid" 2>/dev/null; echo forced=1; sleep 0.2; break; fi
  sleep 0.1
done
rm -f "$f"
echo state=stopped; printf 'pid=%s\n' "$pid"
"""
)

ALIVE_SCRIPT = (
    _PRELUDE
    + r"""
if alive "$1"; then echo alive=1; else echo alive=0; fi
"""
)


# --------------------------------------------------------------------------- argv builders


def probe_argv(node: NodeSpec, requirements: Sequence[str]) -> list[str]:
    ports = f"{node.control_port} {node.telemetry_port}"
    return [
        "sh",
        "-c",
        PROBE_SCRIPT,
        "sh",
        node.python,
        node.workdir,
        node.address,
        ports,
        "\n".join(requirements),
        LIGHT_SNIPPET,
        FACTS_SNIPPET,
    ]


def stop_argv(workdir: str, grace_s: int = 10) -> list[str]:
    return ["sh", "-c", STOP_SCRIPT, "sh", workdir, str(grace_s)]


def alive_argv(pid: int) -> list[str]:
    return ["sh", "-c", ALIVE_SCRIPT, "sh", str(pid)]


def launch_argv(
    python: str,
    workdir: str,
    pythonpath: str,
    listen: tuple[str, int],
    wait_s: float,
    argv: Sequence[str],
) -> list[str]:
    address, port = listen
    # -S: the launcher needs only the standard library; skipping site.py saves
    # a third of the interpreter's start-up, per node.
    return [
        python,
        "-S",
        "-c",
        LAUNCH_SNIPPET,
        workdir,
        pythonpath,
        address,
        str(port),
        f"{wait_s:g}",
        *argv,
    ]


def unpack_argv(python: str, wheel: str, target: str) -> list[str]:
    return [python, "-S", "-c", UNPACK_SNIPPET, wheel, target]


async def read_json(conn: asyncssh.SSHClientConnection, path: str) -> dict[str, Any] | None:
    """A small remote JSON file (e.g. node.json), or None if it is missing or unreadable."""
    result = await ssh.run(conn, ["cat", path], check=False, timeout=30)
    if result.exit_status != 0:
        return None
    try:
        data = json.loads(result.stdout)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


async def stop_agent(
    conn: asyncssh.SSHClientConnection, workdir: str, grace_s: int = 10
) -> dict[str, str]:
    """Stop the agent by its pid file; returns state=stopped|not_running|foreign (+pid)."""
    result = await ssh.run(conn, stop_argv(workdir, grace_s), timeout=grace_s + 15)
    return parse_kv(result.stdout)


async def is_alive(conn: asyncssh.SSHClientConnection, pid: int) -> bool:
    result = await ssh.run(conn, alive_argv(pid), timeout=15)
    return parse_kv(result.stdout).get("alive") == "1"


# How a launch ended on the node: the agent listens, exited (its status in `code`), or
# did neither within the wait.
LaunchState = Literal["listening", "exited", "timeout"]
LAUNCH_STATES: tuple[LaunchState, ...] = get_args(LaunchState)


@dataclass(frozen=True)
class Launched:
    """The agent the launcher started: its pid and how the wait for it ended."""

    pid: int
    state: LaunchState
    code: int | None = None  # the exit status, when it exited


def parse_launch(node: str, stdout: str) -> Launched:
    """The launcher's `key=value` lines as a Launched (SshError without a pid); a state
    it does not name is a timeout, the caller's cue to look at the agent's log."""
    kv = parse_kv(stdout)
    pid = kv.get("pid", "")
    if not pid.isdigit():
        raise ssh.SshError(node, f"the agent launcher printed no pid: {stdout.strip()[:200]!r}", "")
    said = kv.get("state", "timeout")
    state: LaunchState = next((s for s in LAUNCH_STATES if s == said), "timeout")
    code = kv.get("code", "")
    return Launched(int(pid), state, int(code) if code.lstrip("-").isdigit() else None)


async def launch(
    conn: asyncssh.SSHClientConnection,
    node: str,
    python: str,
    workdir: str,
    pythonpath: str,
    listen: tuple[str, int],
    wait_s: float,
    argv: Sequence[str],
) -> Launched:
    """Start the agent detached, and wait until it listens or exits (or `wait_s` ends)."""
    result = await ssh.run(
        conn,
        launch_argv(python, workdir, pythonpath, listen, wait_s, argv),
        timeout=wait_s + 60,
    )
    return parse_launch(node, result.stdout)
