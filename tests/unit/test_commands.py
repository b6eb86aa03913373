"""Command-line helpers that need no cluster."""

from __future__ import annotations

import io
import itertools
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from studiotui.cli.main import build_parser, main
from studiotui.cli.place_cmd import resolve_model
from studiotui.core.errors import UserError
from studiotui.core.state import ClusterState
from studiotui.views.status import (
    SHARD_NAME_MIN,
    fit_status,
    shard_lines,
    status_table,
    table_width,
)
from tests.support.app_fixtures import fixed_state
from worker.shared.demo_model import DemoSpec, write_demo_model


def test_place_takes_a_directory_or_a_catalog_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    home = tmp_path / "home"
    model = write_demo_model(
        home / "models" / "tiny", DemoSpec(layers=2, hidden=32, heads=4, kv_heads=2)
    )
    assert resolve_model(model, home) == model
    assert resolve_model(Path("tiny"), home) == model
    with pytest.raises(UserError, match=r"no model has that name \(models found: tiny\)"):
        resolve_model(Path("huge"), home)


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_home_that_cannot_be_written_is_said_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """Before, `studiotui status` with STUDIOTUI_HOME on a file ended in a traceback
    (FileExistsError from mkdir). Permissions cannot stand in here: the tests run as root."""
    blocker = tmp_path / "home"
    blocker.write_text("not a folder")
    home = blocker if where == "a file" else blocker / "inner"
    monkeypatch.setenv("STUDIOTUI_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert f"studiotui's home {home} is not a folder it can write" in err
    assert "set STUDIOTUI_HOME to a writable folder" in err and "Traceback" not in err
    assert blocker.read_text() == "not a folder"


def test_the_api_and_the_browser_dashboard_listen_on_localhost_unless_told() -> None:
    """`serve`, `web` and the dashboard's `--serve PORT` bind 127.0.0.1 by default; a
    host given is taken as given."""
    parser = build_parser()
    assert parser.parse_args(["serve"]).host == "127.0.0.1"
    assert parser.parse_args(["web"]).host == "127.0.0.1"
    assert parser.parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"
    assert parser.parse_args(["--serve", "28415"]).serve == ("127.0.0.1", 28415)
    assert parser.parse_args(["--serve", "0.0.0.0:8000"]).serve == ("0.0.0.0", 8000)


def _readme_invocations() -> list[tuple[list[str], str]]:
    """Each `studiotui …` the README and the docs pages show (a table's rows, the lines
    of their bash blocks): the words before the first option, and the text naming its
    flags. (docs/cli.md is written from the parsers themselves.)"""
    root = Path(__file__).resolve().parents[2]
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    readme = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    found = []
    for usage, said in re.findall(r"^\| `studiotui ([^`]*)` \|(.*)$", readme, re.M):
        # The verb and any sub-verb (`adapter stamp`): the lowercase words before the
        # first placeholder, bracket or option.
        verb = list(itertools.takewhile(lambda w: re.fullmatch(r"[a-z][a-z-]*", w), usage.split()))
        found.append((verb, usage + said))
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("studiotui"):
                words = shlex.split(line)[1:]
                head = list(itertools.takewhile(lambda w: not w.startswith("-"), words))
                found.append((head, line))
    return found


def test_every_flag_the_docs_show_is_in_its_verbs_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    shown = _readme_invocations()
    assert len(shown) > 30, shown
    # Named in its prose rather than in a row or a block.
    prose = [
        (["finetune"], "--save-every"),
        (["demo-model"], "--group-size"),
        (["status"], "--trust-inventory"),
        (["web"], "--host"),
    ]
    for words, text in [*shown, *prose]:
        with pytest.raises(SystemExit) as done:
            parser.parse_args([*words, "--help"])
        assert done.value.code == 0, words
        helped = capsys.readouterr().out
        for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", text)):
            assert flag in helped, f"`studiotui {' '.join(words)} --help` lacks {flag}"


def _rendered(state: ClusterState, width: int) -> list[str]:
    out = Console(width=width, file=io.StringIO(), no_color=True)
    out.print(status_table(state, width))
    return out.file.getvalue().splitlines()  # type: ignore[attr-defined]


@pytest.mark.parametrize("width", [160, 80, 60])
def test_the_status_table_fits_without_folding_a_shard(width: int) -> None:
    """A placement cell is never split over lines ("qwen4[0:4" / "] ready"): columns
    go (the version first), long names are cut with "…", `[a:b] state` stays whole."""
    state = fixed_state()
    long = "mlx-community/Qwen3-30B-A3B-Instruct-2507-4bit"
    nodes = tuple(
        replace(n, shards=tuple(replace(s, placement=long) for s in n.shards))
        if n.name == "studio-3"
        else n
        for n in state.nodes
    )
    state = replace(state, nodes=nodes)
    lines = _rendered(state, width)
    assert max(len(line) for line in lines) <= width, "\n".join(lines)
    for node in state.nodes:
        [row] = [line for line in lines if f" {node.name} " in line]
        for shard in node.shards:
            suffix = f"[{shard.start}:{shard.end}] {shard.state}"
            assert suffix in row, "\n".join(lines)
            name = shard.placement
            assert name in row if width == 160 else (name in row or "…" + suffix in row)
    header = next(line for line in lines if " node " in line)
    assert ("version" in header) == (width == 160), header
    assert ("memory" in header) == (width >= 80) and " shards " in header, header


def test_fit_status_gives_up_columns_in_order() -> None:
    widths = {"node": 7, "address": 17, "state": 5, "version": 7, "memory": 16}
    # Everything fits on a wide terminal.
    assert fit_status(widths, 4, 11, 200) == (tuple(widths), 4)
    # At 80: the version goes, "demo[0:2] ready" stays whole.
    assert fit_status(widths, 4, 11, 80) == (("node", "address", "state", "memory"), 4)
    # A long name is cut before the address goes.
    kept, room = fit_status(widths, 46, 11, 80)
    assert kept == ("node", "address", "state", "memory") and SHARD_NAME_MIN <= room < 46
    assert table_width([widths[c] for c in kept] + [room + 11]) == 80
    # Narrower still: the address, then the memory go; names keep SHARD_NAME_MIN.
    kept, room = fit_status(widths, 46, 11, 60)
    assert kept == ("node", "state", "memory") and room >= SHARD_NAME_MIN
    assert fit_status(widths, 46, 11, 40)[0] == ("node", "state")
    assert shard_lines([("abcdefghij", "[0:2] ready"), ("ab", "[2:4] ready")], 5) == (
        "abcd…[0:2] ready\nab[2:4] ready"
    )


def test_status_json_waits_for_tok_s_only_while_a_placement_answers() -> None:
    """An idle placement makes 0 tok/s, known without watching the counts for a window
    (`status --json` used to wait 2 s for it whenever a placement was ready)."""
    from studiotui.cli.status_cmd import rates_to_sample
    from studiotui.core.state import PlacementState, ShardState

    def placement(name: str, in_flight: int, state: str = "ready") -> PlacementState:
        shards = tuple(
            ShardState(name, f"n{i}", i, 2, 2 * i, 2 * i + 2, state, in_flight=in_flight)  # type: ignore[arg-type]
            for i in range(2)
        )
        return PlacementState(name, "m", "/m", shards)

    assert rates_to_sample([placement("idle", 0)]) == []
    assert rates_to_sample([placement("idle", 0), placement("busy", 1)]) == ["busy"]
    assert rates_to_sample([placement("loading", 1, "loading")]) == []


def test_the_usage_line_names_commands_once() -> None:
    """`studiotui --help` listed the twenty commands in braces in its usage line and
    again above their descriptions."""
    usage = build_parser().format_usage()
    assert "COMMAND ..." in usage and "{provision" not in usage, usage
    assert "{provision" not in build_parser().format_help()
