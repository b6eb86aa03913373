"""Command-line helpers that need no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from studiotui.cli.commands import resolve_model
from studiotui.cli.main import build_parser
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


def test_the_api_and_the_browser_dashboard_listen_on_localhost_unless_told() -> None:
    """`serve`, `web` and the dashboard's `--serve PORT` bind 127.0.0.1 by default; a
    host given is taken as given."""
    parser = build_parser()
    assert parser.parse_args(["serve"]).host == "127.0.0.1"
    assert parser.parse_args(["web"]).host == "127.0.0.1"
    assert parser.parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"
    assert parser.parse_args(["--serve", "52415"]).serve == ("127.0.0.1", 52415)
    assert parser.parse_args(["--serve", "0.0.0.0:8000"]).serve == ("0.0.0.0", 8000)
