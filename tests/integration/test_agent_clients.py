"""Claude Code and Codex CLI, the real programs from npm, against a real placement.

One real agent on 127.0.0.176:59400 holds two placements with room for the agents'
system prompts: the reciting demo (a readable answer to print) and a model that, as
an agent, calls a tool and, given the tool's result, answers (tests/tool_model.py).
The server runs in this test's event loop; the programs run as child processes.
CI installs both programs (.ci/run): there a missing program fails the test.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from studiotui.api.server import ApiServer, start_server
from studiotui.cluster.controller import Controller
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from tests.support.tool_model import write_agent_model
from worker.shared.demo_model import PASSAGE, DemoSpec, write_demo_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sk-agents"
# Claude Code's system prompt and the schemas of all its tools come to about 80k
# characters, a token each with the demo's byte-level tokenizer; Codex's to about 45k.
# One layer 64 wide prefills them in seconds.
CONTEXT = 131072
SPEC = DemoSpec(layers=1, hidden=64, heads=4, kv_heads=2, dtype="float32")
SECRET = "the launch code is 4217"
CALL = 'Reading<tool_call>{"name":"Read","arguments":{"file_path": "notes.txt"}}</tool_call>'
ANSWER = "All good"
# Codex's shell tool, called the same way.
SHELL_CALL = (
    'Running<tool_call>{"name":"exec_command","arguments":{"cmd": "cat notes.txt"}}</tool_call>'
)
# What keeps the programs quiet and local: no telemetry, no updates, no surveys.
QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
}


def program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (npm install -g, as .ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@dataclass
class Served:
    ctl: Controller
    server: ApiServer

    @property
    def base(self) -> str:
        return self.server.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def agents_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("agents-home"), 1, 176, 59400)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(
    agents_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    root = tmp_path_factory.mktemp("agents-models")
    recite = write_demo_model(
        root / "recite", DemoSpec(layers=1, hidden=64, heads=4, kv_heads=2, recite=True)
    )
    agent = write_agent_model(root / "agent", SPEC, CALL, ANSWER)
    shell = write_agent_model(root / "shell", SPEC, SHELL_CALL, ANSWER)
    ctl = agents_cluster.controller()
    (node,) = agents_cluster.inventory.names
    server = None
    try:
        await ctl.start(telemetry=False)
        for name, model in (("recite", recite), ("agent", agent), ("shell", shell)):
            await ctl.place(model, [node], name, prefill_chunk=2048, context_tokens=CONTEXT)
        server = await start_server(ctl, "127.0.0.1", 0, api_key=KEY)
        yield Served(ctl, server)
    finally:
        if server is not None:
            await server.close()
        await ctl.close()


async def run(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *args,
        env=env,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 240)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        pytest.fail(f"{args[0]} did not finish: {out.decode()[-2000:]} {err.decode()[-2000:]}")
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def claude_env(served: Served, home: Path, model: str) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": served.base,
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        **QUIET,
    }


async def test_claude_code_prints_the_answer(served: Served, tmp_path: Path) -> None:
    claude = program("claude")
    code, out, err = await run(
        [claude, "-p", "say hi"], claude_env(served, tmp_path, "recite"), tmp_path
    )
    assert code == 0, err + out
    assert out.strip() == PASSAGE, out


async def test_claude_code_reads_a_file_as_an_agent(served: Served, tmp_path: Path) -> None:
    claude = program("claude")
    (tmp_path / "notes.txt").write_text(SECRET + "\n")
    code, out, err = await run(
        [
            claude,
            "-p",
            "What do my notes say?",
            "--tools=Read",
            "--allowedTools=Read",
            "--output-format=stream-json",
            "--verbose",
        ],
        claude_env(served, tmp_path, "agent"),
        tmp_path,
    )
    assert code == 0, err + out
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    calls = [
        block
        for e in events
        if e.get("type") == "assistant"
        for block in e["message"]["content"]
        if block.get("type") == "tool_use"
    ]
    assert [(c["name"], c["input"]) for c in calls] == [("Read", {"file_path": "notes.txt"})]
    results = [
        block
        for e in events
        if e.get("type") == "user"
        for block in e["message"]["content"]
        if isinstance(block, dict) and block.get("type") == "tool_result"
    ]
    # Claude Code read the file and sent its text back to the model.
    assert len(results) == 1 and SECRET in json.dumps(results[0]), results
    (result,) = [e for e in events if e.get("type") == "result"]
    assert result["is_error"] is False and result["result"] == ANSWER, result


def codex_env(served: Served, home: Path, model: str) -> dict[str, str]:
    codex_home = home / "codex-home"
    codex_home.mkdir()
    # The provider block docs/clients.md gives, pointing at this server.
    (codex_home / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "studiotui"\n'
        "\n"
        "[model_providers.studiotui]\n"
        'name = "studiotui"\n'
        f'base_url = "{served.server.url}"\n'
        'wire_api = "responses"\n'
        'env_key = "STUDIOTUI_API_KEY"\n'
    )
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
        "STUDIOTUI_API_KEY": KEY,
    }


async def test_codex_answers_through_the_responses_api(served: Served, tmp_path: Path) -> None:
    codex = program("codex")
    code, out, err = await run(
        [codex, "exec", "--skip-git-repo-check", "say hi"],
        codex_env(served, tmp_path, "recite"),
        tmp_path,
    )
    assert code == 0, err + out
    assert PASSAGE in out, out + err


async def test_codex_runs_a_command_as_an_agent(served: Served, tmp_path: Path) -> None:
    codex = program("codex")
    (tmp_path / "notes.txt").write_text(SECRET + "\n")
    code, out, err = await run(
        [
            codex,
            "exec",
            "--skip-git-repo-check",
            "--json",
            # The test's own folder is the sandbox: bubblewrap needs namespaces CI lacks.
            "--dangerously-bypass-approvals-and-sandbox",
            "What do my notes say?",
        ],
        codex_env(served, tmp_path, "shell"),
        tmp_path,
    )
    assert code == 0, err + out
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    commands = [i for i in items if i.get("type") == "command_execution"]
    # Codex ran the command the model called, and its output went back to the model.
    assert len(commands) == 1 and "cat notes.txt" in commands[0]["command"], items
    assert SECRET in commands[0]["aggregated_output"], commands
    messages = [i["text"] for i in items if i.get("type") == "agent_message"]
    assert messages[-1] == ANSWER, items
