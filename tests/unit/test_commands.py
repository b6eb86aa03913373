"""Command-line helpers that need no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from studiotui.cli.commands import resolve_model
from studiotui.cli.main import main
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
