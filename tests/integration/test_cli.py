"""The headless command line, end to end, as a script would drive it: real
processes, a real local cluster on its own port, real shards."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from studiotui.cluster import local_cluster
from studiotui.core.inventory import load_inventory
from tests.support.tool_model import write_tool_model
from worker.shared.demo_model import DemoSpec, write_demo_model

PORT = 57900  # beside the default 28500, so a developer's own local cluster is untouched
# What a model may say that a terminal obeys: SGR red, OSC "set the window title" ended
# by BEL, and the one-character C1 CSI (U+009B) clearing the screen.
ESCAPES = "Red\x1b[31m alert\x1b]0;pwned\x07 done\x9b2J!"
ESCAPES_SPEC = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32")


def run(
    home: Path, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "STUDIOTUI_HOME": str(home),
        "NO_COLOR": "1",
        "COLUMNS": "160",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "studiotui", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    yield home
    # Whatever the test did, stop the agents it started, by the pids they recorded.
    path = local_cluster.local_inventory_path(home)
    if path.exists():
        for node in load_inventory(path).nodes:
            if (pid := local_cluster.running_pid(node)) is not None:
                local_cluster.kill_pid(pid)


def status(home: Path) -> dict:
    out = run(home, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_up_place_chat_status_down(home: Path) -> None:
    up = run(home, "up", "--local", "2", "--port", str(PORT))
    assert up.returncode == 0, up.stderr
    nodes = status(home)["nodes"]
    assert [n["name"] for n in nodes] == ["local-1", "local-2"]
    assert {n["state"] for n in nodes} == {"up"}
    assert all(n["address"].endswith(f":{PORT}") for n in nodes)
    assert all(0 < n["memory_used"] < n["memory_total"] for n in nodes)
    pids = [
        local_cluster.running_pid(node)
        for node in load_inventory(local_cluster.local_inventory_path(home)).nodes
    ]
    assert all(pids)

    # Global options work after the verb as well as before it.
    path = str(local_cluster.local_inventory_path(home))
    before = run(home, "-i", path, "status", "--json")
    after = run(home, "status", "--json", "-i", path)
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    seen = [
        [(n["name"], n["address"]) for n in json.loads(o.stdout)["nodes"]] for o in (before, after)
    ]
    assert seen[0] == seen[1] and [name for name, _ in seen[1]] == ["local-1", "local-2"]

    model = home / "tiny"
    # What `demo-model DIR --layers 4 --hidden 64` writes (that verb is tested in
    # test_demo_model), written here without another process's imports.
    write_demo_model(model, DemoSpec(layers=4, hidden=64))
    placed = run(home, "place", str(model), "--name", "tiny")
    assert placed.returncode == 0, placed.stderr
    assert "placement tiny is ready" in placed.stdout
    [placement] = status(home)["placements"]
    assert placement["name"] == "tiny" and placement["nodes"] == ["local-1", "local-2"]
    assert placement["layers"] == [[0, 2], [2, 4]]

    # The same name again is refused before any plan or progress is shown.
    again = run(home, "place", str(model), "--name", "tiny")
    assert again.returncode == 2
    assert "'tiny' exists (ready): unload it first (studiotui unload tiny)" in again.stderr
    assert "ring:" not in again.stdout
    # Planned for 3 requests at once: the preview says so; the placed one serves 1.
    dry = run(home, "place", str(model), "--name", "t3", "--streams", "3", "--dry-run")
    assert dry.returncode == 0 and "3 streams at once" in dry.stdout, dry.stdout
    zero = run(home, "place", str(model), "--streams", "0", "--dry-run")
    assert zero.returncode == 2 and "--streams" in zero.stderr
    assert placement["streams"] == 4 and placement["context_tokens"] == 4096

    chat = run(home, "chat", "--placement", "tiny", "--max-tokens", "12", "hello")
    assert chat.returncode == 0, chat.stderr
    figures = re.search(r"(\d+) tokens in, (\d+) out, .* finish: (\w+)", chat.stderr)
    assert figures, chat.stderr
    out, finish = int(figures[2]), figures[3]
    assert finish in ("length", "stop") and 1 <= out <= 12
    assert (out == 12) == (finish == "length")

    # The same prompt again reuses the first's prefill (the prefix cache): status says
    # so once the shards' stats (once a second) have come; `cache clear` empties it.
    again_chat = run(home, "chat", "--placement", "tiny", "--max-tokens", "4", "hello")
    assert again_chat.returncode == 0, again_chat.stderr
    cache = status(home)["placements"][0]["prompt_cache"]
    deadline = time.monotonic() + 10
    while cache["hits"] < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
        cache = status(home)["placements"][0]["prompt_cache"]
    assert cache["hits"] >= 1 and cache["entries"] >= 1 and cache["bytes"] > 0, cache
    assert 0 < cache["hit_rate"] <= 1
    cleared = run(home, "cache", "clear", "tiny")
    assert cleared.returncode == 0, cleared.stderr
    assert re.search(r"placement tiny: prompt cache cleared \(\d+ entries", cleared.stdout)
    while cache["entries"] and time.monotonic() < deadline + 10:
        time.sleep(0.5)
        cache = status(home)["placements"][0]["prompt_cache"]
    assert cache["entries"] == 0 and cache["bytes"] == 0, cache
    unknown = run(home, "cache", "clear", "nope")
    assert unknown.returncode == 2 and "no placement named 'nope'" in unknown.stderr

    # Ctrl-C mid-answer: the answer so far ends its line and says it stopped. (Greedy
    # on the demo's noise never picks end-of-text: only letters' output rows are set.)
    env = {**os.environ, "STUDIOTUI_HOME": str(home), "NO_COLOR": "1"}
    argv = ["chat", "--placement", "tiny", "--temperature", "0", "--max-tokens", "3000", "hi"]
    long = subprocess.Popen(
        [sys.executable, "-m", "studiotui", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        # A run started in the background inherits SIGINT ignored: as from a terminal.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert long.stdout is not None
    assert long.stdout.read(1), "no answer began"
    long.send_signal(signal.SIGINT)
    rest, err = long.communicate(timeout=30)
    assert long.returncode == 130, err
    assert rest.endswith(b"\n") and b"stopped: the answer was cancelled" in err, (rest, err)

    # A model whose answer holds terminal escapes (colour, the window title, a C1 CSI):
    # what `chat` writes is the text without the controls, as the dashboard shows it.
    escapes = write_tool_model(home / "escapes", ESCAPES_SPEC, ESCAPES)
    placed = run(home, "place", str(escapes), "--name", "esc", "--nodes", "local-1")
    assert placed.returncode == 0, placed.stderr
    said = run(home, "chat", "--placement", "esc", "--max-tokens", "32", "hello")
    assert said.returncode == 0 and "finish: stop" in said.stderr, said.stderr
    assert said.stdout == "Red[31m alert]0;pwned done2J!\n", repr(said.stdout)
    assert run(home, "unload", "esc").returncode == 0

    # The `serve` verb as a user runs it: its own process, the official client, then
    # SIGTERM stops it cleanly.
    serve_it(home, "tiny")

    # Piped at 80 columns: addresses and memory figures stay whole, one line each.
    narrow = run(home, "status", env={"COLUMNS": "80"})
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, narrow.stdout
    for node in status(home)["nodes"]:
        [row] = [line for line in lines if node["name"] in line and node["address"] in line]
        assert re.search(r"\d+(\.\d+)? [KMG]B / \d+\.\d GB", row), row

    missing = run(home, "chat", "--placement", "nope", "hi")
    assert missing.returncode == 2 and "no placement named 'nope' (known: tiny)" in missing.stderr
    # `unload` names the placements there are, as `chat` does.
    not_there = run(home, "unload", "nope")
    assert (
        not_there.returncode == 2 and "no placement named 'nope' (known: tiny)" in not_there.stderr
    )

    down = run(home, "down")
    assert down.returncode == 0, down.stderr
    assert down.stderr.count("studiotui: inventory ") == 1, down.stderr  # it said it twice
    assert not any(psutil.pid_exists(pid) and _is_agent(pid) for pid in pids if pid)
    # Stopped agents are not asked again (each would wait out a 5 s request first).
    again = run(home, "down")
    assert again.returncode == 0 and again.stdout.count("not running") == len(pids), again.stdout
    # Every node of 'tiny' was stopped: kept, for `up` or `restart` to load again.
    assert "`studiotui up` starts it and loads that shard again" in down.stdout, down.stdout
    after = run(home, "status", "--json")
    assert after.returncode == 1 and "start it with `studiotui up`" in after.stderr
    [kept] = json.loads(after.stdout)["placements"]
    assert (kept["name"], kept["state"], kept["nodes"]) == ("tiny", "broken", [])
    # `unload` forgets it for good, its nodes down or not.
    assert run(home, "unload", "tiny").returncode == 0
    gone = run(home, "status", "--json")
    assert json.loads(gone.stdout)["placements"] == []


def serve_it(home: Path, placement: str) -> None:
    from openai import OpenAI

    # Not 127.0.0.1: every loopback connection's own end takes an ephemeral port there
    # (32768-60999, which holds this port), so a fixed port on it is sometimes taken.
    host, port = "127.0.0.14", PORT + 50
    env = {**os.environ, "STUDIOTUI_HOME": str(home), "STUDIOTUI_API_KEY": "s3cret"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "studiotui", "serve", "--host", host, "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = OpenAI(base_url=f"http://{host}:{port}/v1", api_key="s3cret", max_retries=0)
        deadline = time.monotonic() + 30
        while True:
            try:
                models = [m.id for m in client.models.list().data]
                break
            except Exception:
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "serve did not answer within 30 s"
                time.sleep(0.2)
        assert models == [placement]
        answer = client.chat.completions.create(
            model=placement, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 5
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "studiotui serve: stopped" in out, out + err


def _is_agent(pid: int) -> bool:
    try:
        return "worker" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def test_global_options_after_any_verb(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Every verb's --help lists the global options, and every verb takes -i after it."""
    from studiotui.cli.main import main

    with pytest.raises(SystemExit):
        main(["--help"])
    # Listed under COMMAND, one a line, each indented four spaces before its help.
    names = re.findall(r"^ {4}([a-z][a-z-]*)\b", capsys.readouterr().out, re.M)
    assert names, "the top-level help lists the verbs"
    assert {"up", "status", "place", "chat", "serve", "down"} <= set(names)
    for verb in names:
        with pytest.raises(SystemExit) as done:
            main([verb, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert "global options" in text and "-i INVENTORY, --inventory INVENTORY" in text, verb
        assert "--serve [HOST:]PORT" in text and "--api-key" in text, verb

    missing = tmp_path / "nowhere.toml"
    for argv in (["status", "-i", str(missing)], ["-i", str(missing), "status"]):
        out = run(tmp_path / "home", *argv)
        assert out.returncode == 2, (argv, out.stderr)
        assert f"inventory {missing} does not exist" in out.stderr, argv

    # The value before the verb is kept when the verb does not repeat it.
    from studiotui.cli.main import build_parser

    args = build_parser().parse_args(["-i", "a.toml", "place", "m", "--dry-run"])
    assert args.inventory == Path("a.toml") and args.serve is None
    args = build_parser().parse_args(["place", "m", "--inventory", "b.toml"])
    assert args.inventory == Path("b.toml")

    # --serve belongs to the dashboard: with a verb it is refused, saying what to do.
    with pytest.raises(SystemExit) as refused:
        main(["status", "--serve", "8000"])
    assert refused.value.code == 2
    assert "--serve works with the dashboard only" in capsys.readouterr().err


def test_with_no_agent_running_each_verb_says_the_whole_way(home: Path) -> None:
    local_cluster.write_local_inventory(home, 2, 8.0, control_port=PORT + 10)
    status = run(home, "status")
    assert status.returncode == 1
    assert "no node of cluster local is up: start it with `studiotui up`" in status.stderr
    chat = run(home, "chat", "hello")
    assert chat.returncode == 2
    for step in ("`studiotui up`", "`studiotui place MODEL_DIR`", "then chat"):
        assert step in chat.stderr, chat.stderr
    # A model a shard can run (one that cannot is refused before any node is asked).
    model = write_demo_model(
        home / "some-model", DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2)
    )
    place = run(home, "place", str(model))
    assert place.returncode == 2
    assert "no node is up: start the cluster with `studiotui up`" in place.stderr


def test_demo_model_help_describes_every_option(tmp_path: Path) -> None:
    out = run(tmp_path, "demo-model", "--help")
    assert out.returncode == 0, out.stderr
    for option, words in (
        ("--arch", "model family"),
        ("--layers", "what shards split"),
        ("--hidden", "hidden size"),
        ("--heads", "attention heads"),
        ("--kv-heads", "key/value heads"),
        ("--seed", "same weights"),
        ("--dtype", "weight data type"),
        ("--recite", "fixed passage"),
    ):
        assert option in out.stdout and words in out.stdout, (option, out.stdout)
    assert "(default: 8)" in out.stdout


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["place", "MODEL", "--context", "-5", "--dry-run"], "--context"),
        (["place", "MODEL", "--prefill-chunk", "0", "--dry-run"], "--prefill-chunk"),
        (["up", "--local", "0"], "--local"),
        (["up", "--local", "2", "--memory-gb", "-1"], "--memory-gb"),
        (["up", "--local", "2", "--port", "70000"], "--port"),
        (["serve", "--port", "99999"], "--port"),
        (["web", "--port", "-1"], "--port"),
        (["logs", "local-1", "--lines", "-5"], "--lines"),
        (["finetune", "MODEL", "--data", "d.jsonl", "--learning-rate", "nan"], "--learning-rate"),
        (["finetune", "MODEL", "--data", "d.jsonl", "--batch-size", "0"], "--batch-size"),
        (["finetune", "MODEL", "--data", "d.jsonl", "--layers", "0"], "--layers"),
        (["finetune", "--resume", "job", "--iters", "-1"], "--iters"),
    ],
)
def test_a_bad_number_is_refused_naming_its_option_before_anything_is_written(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    argv: list[str],
    named: str,
) -> None:
    """No traceback, no inventory written with a value it cannot read back."""
    from studiotui.cli.main import main

    home = tmp_path / "home"
    monkeypatch.setenv("STUDIOTUI_HOME", str(home))
    model = tmp_path / "m"
    argv = [str(model) if a == "MODEL" else a for a in argv]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {named}" in err and "Traceback" not in err, err
    assert not local_cluster.local_inventory_path(home).exists()


def test_jobs_follow_without_a_name_says_to_name_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from studiotui.cli.main import main

    home = tmp_path / "home"
    monkeypatch.setenv("STUDIOTUI_HOME", str(home))
    local_cluster.write_local_inventory(home, 1, 8.0, control_port=PORT + 20)
    for action in ("follow", "stop", "forget", "fetch"):
        assert main(["jobs", action]) == 2
        err = capsys.readouterr().err
        assert f"jobs {action} needs a job's name" in err and "None" not in err, err
        assert "studiotui jobs" in err


def test_up_local_of_another_size_is_refused_while_that_cluster_runs(home: Path) -> None:
    """Rewriting the inventory under running agents would orphan the ones it drops:
    `studiotui down` could no longer stop them."""
    up = run(home, "up", "--local", "2", "--port", str(PORT + 30))
    assert up.returncode == 0, up.stderr
    path = local_cluster.local_inventory_path(home)
    before = path.read_text()
    smaller = run(home, "up", "--local", "1", "--port", str(PORT + 30))
    assert smaller.returncode == 2
    assert "local-2 is running" in smaller.stderr and "studiotui down" in smaller.stderr
    assert path.read_text() == before
    again = run(home, "up", "--local", "2", "--port", str(PORT + 30))
    assert again.returncode == 0, again.stderr
    down = run(home, "down")
    assert down.returncode == 0, down.stderr


def test_the_tour_after_a_larger_first_run_places_and_answers(home: Path) -> None:
    """The README's tour after the first run: that run placed `demo` over four nodes and
    `down` stopped them; `up --local 2` cannot bring back a placement on nodes it does
    not start, so it forgets it, saying so, and the tour's `place` of its own `demo`
    works (it was refused: "a placement named 'demo' exists (broken)", and `up` exit 1).
    Three nodes here, for the same trip."""
    model = home.parent / "models" / "demo"
    assert run(home, "demo-model", str(model), "--layers", "6").returncode == 0
    port = str(PORT + 80)
    assert run(home, "up", "--local", "3", "--port", port).returncode == 0
    first = run(home, "place", str(model))
    assert first.returncode == 0, first.stderr
    assert run(home, "down").returncode == 0
    up = run(home, "up", "--local", "2", "--port", port)
    said = " ".join((up.stdout + up.stderr).split())
    assert up.returncode == 0, said
    assert "placement 'demo' ran on local-3, which this cluster has no more" in said, said
    placed = run(home, "place", str(model))
    assert placed.returncode == 0, placed.stderr
    answer = run(home, "chat", "What is studiotui?")
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.startswith("Hello from studiotui!"), answer.stdout
    assert [p["name"] for p in status(home)["placements"]] == ["demo"]
    assert run(home, "down").returncode == 0


def test_up_local_on_ports_something_else_holds_is_refused_naming_a_free_port(
    home: Path,
) -> None:
    """Another simulated cluster (another STUDIOTUI_HOME's) on the same addresses: the
    agents could not bind, so nothing is started and a --port beside it is named."""
    port = PORT + 60
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.12", port + 1))  # local-2's telemetry port
        held.listen()
        up = run(home, "up", "--local", "2", "--port", str(port))
    err = " ".join(up.stderr.split())
    assert up.returncode == 2, up.stderr
    assert f"127.0.0.12:{port + 1} already in use" in err, err
    suggested = re.search(r"studiotui up --local 2 --port (\d+)", err)
    assert suggested is not None, err
    assert int(suggested.group(1)) > port
    assert not local_cluster.local_inventory_path(home).exists()
    assert "did not answer" not in err


def test_a_port_whose_connections_linger_in_time_wait_is_free_to_an_agent() -> None:
    """Right after `down`, the agents' closed connections linger in TIME_WAIT on their
    ports: ZeroMQ binds there all the same, so `up` must not call them taken."""
    address, port = "127.0.0.12", PORT + 70
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # an earlier run's
        server.bind((address, port))
        server.listen()
        assert not local_cluster.port_free(address, port)  # a live listener holds it
        client = socket.create_connection((address, port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: its port goes to TIME_WAIT
        time.sleep(0.2)
        client.close()
    assert local_cluster.port_free(address, port)
