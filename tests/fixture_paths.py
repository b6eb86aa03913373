"""Where the recorded macOS command outputs are: inside the repository.

`tests/fixtures/macos/` is a copy of the outputs the probe parsers are tested on (its
README says where each came from). `STUDIOTUI_FIXTURES` may point elsewhere, to try the
parsers on other recordings (the macos folder itself or a folder holding `macos/`); it
is an override, never a requirement.
"""

from __future__ import annotations

import os
from pathlib import Path

IN_REPO = Path(__file__).resolve().parent / "fixtures" / "macos"


def macos_fixtures() -> Path:
    env = os.environ.get("STUDIOTUI_FIXTURES")
    if not env:
        return IN_REPO
    root = Path(env)
    return root / "macos" if (root / "macos").is_dir() else root


def read_fixture(name: str) -> str:
    """The text of one recorded output; a missing one names where it was looked for."""
    folder = macos_fixtures()
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(
            f"fixture {name!r} not found in {folder} (STUDIOTUI_FIXTURES="
            f"{os.environ.get('STUDIOTUI_FIXTURES', '<unset>')}); the repository carries "
            f"them in {IN_REPO}"
        )
    return path.read_text(encoding="utf-8")
