"""The app's colour themes (TOML files in the `themes` package) and the remembered choice.

Themes are data, not code, so a user can copy one, change a few colours and drop it
in without touching Python. The choice and other UI settings live in
`$STUDIOTUI_HOME/ui.json`, next to the rest of the operator's state.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from textual.theme import Theme

from studiotui.core.errors import StudioError

DEFAULT_THEME = "studio-dark"
UI_FILE = "ui.json"

_COLOURS = (
    "primary",
    "secondary",
    "warning",
    "error",
    "success",
    "accent",
    "foreground",
    "background",
    "surface",
    "panel",
    "boost",
)
_ALLOWED = {f.name for f in fields(Theme)}


class ThemeFileError(StudioError, ValueError):
    pass


def theme_from_toml(text: str, source: str) -> Theme:
    """A Theme from one TOML file; unknown keys are refused so typos do not pass silently."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ThemeFileError(f"{source}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ThemeFileError(f"{source}: invalid TOML: arrays nest too deep") from None
    unknown = sorted(set(data) - _ALLOWED)
    if unknown:
        raise ThemeFileError(f"{source}: unknown key(s) {', '.join(unknown)}")
    for key in ("name", "primary"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ThemeFileError(f"{source}: {key} must be a non-empty string")
    for key in _COLOURS:
        if key in data and not isinstance(data[key], str):
            raise ThemeFileError(f"{source}: {key} must be a colour string")
    variables = data.get("variables", {})
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise ThemeFileError(f"{source}: [variables] must map names to strings")
    try:
        return Theme(**data)
    except (TypeError, ValueError) as exc:
        raise ThemeFileError(f"{source}: {exc}") from None


def load_themes() -> tuple[list[Theme], list[str]]:
    """Every theme shipped in the `themes` package, and the problems with any that are broken."""
    themes: list[Theme] = []
    problems: list[str] = []
    for entry in sorted(theme_files(), key=lambda p: p.name):
        try:
            themes.append(theme_from_toml(entry.read_text(encoding="utf-8"), entry.name))
        except (ThemeFileError, OSError, UnicodeDecodeError) as exc:
            problems.append(str(exc))
    return themes, problems


def theme_files() -> list[Path]:
    """The TOML files of the `themes` package.

    Read through `__path__` rather than importlib.resources: an editable install made
    before `themes/__init__.py` existed maps it as a namespace package, whose path
    also holds a non-directory placeholder that importlib.resources chokes on.
    """
    import themes

    folders = [Path(p) for p in getattr(themes, "__path__", []) if Path(p).is_dir()]
    return [f for folder in folders for f in folder.glob("*.toml")]


def load_ui(home: Path) -> dict[str, Any]:
    """The saved UI settings; a missing or damaged file means defaults, never a crash."""
    try:
        data = json.loads((home / UI_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_ui(home: Path, **changes: Any) -> None:
    settings = {**load_ui(home), **changes}
    home.mkdir(parents=True, exist_ok=True)
    path = home / UI_FILE
    tmp = path.with_name(f".{UI_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # Replace atomically so a crash mid-write cannot leave half a file behind.
    tmp.replace(path)
