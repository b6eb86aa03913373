"""Command-line helpers that need no cluster."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from studiotui.cli.commands import resolve_model
from studiotui.cli.main import build_parser, main
from studiotui.core.errors import UserError
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
    assert parser.parse_args(["--serve", "52415"]).serve == ("127.0.0.1", 52415)
    assert parser.parse_args(["--serve", "0.0.0.0:8000"]).serve == ("0.0.0.0", 8000)


def _readme_invocations() -> list[tuple[list[str], str]]:
    """Each `studiotui …` README shows (the command table's rows, the lines of its bash
    blocks): the words before the first option, and the text naming its flags."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    found = []
    for usage, said in re.findall(r"^\| `studiotui ([^`]*)` \|(.*)$", readme, re.M):
        found.append((usage.split()[:1], usage + said))
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("studiotui"):
                words = shlex.split(line)[1:]
                head = list(itertools.takewhile(lambda w: not w.startswith("-"), words))
                found.append((head, line))
    return found


def test_every_flag_the_readme_shows_is_in_its_verbs_help(
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
