"""The model folders of `config.toml` (`models_dirs`), added and removed from the
dashboard, and whether a model may be deleted.

The decisions are pure (`with_folder`, `without_folder`, `delete_refusal`,
`folder_counts`); `add_folder` / `remove_folder` read and write the file. The file is
changed in place with tomlkit, as `cluster.toml` is (core/inventory.py): the
operator's comments, other keys and layout stay as they were.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError

from studiotui.core.catalog import CONFIG_FILE, Catalog, settings
from studiotui.core.errors import StudioError
from studiotui.core.state import PlacementState

KEY = "models_dirs"


class FolderError(StudioError):
    """A folder that cannot be added or removed; the message says what to do."""


@dataclass(frozen=True)
class FolderCount:
    """One model folder as the dashboard lists it."""

    path: Path
    entry: str  # as written in config.toml; "" for the home's own models/ (not removable)
    models: int
    empty: int  # directories in it that hold no model
    exists: bool


# --------------------------------------------------------------------------- pure


def folder_entry(folder: Path, home: Path) -> str:
    """How a folder is written in `models_dirs`: `~/…` under the user's home, else
    absolute (relative paths would be read from STUDIOTUI_HOME, not from where the
    operator typed them)."""
    folder = folder.expanduser()
    try:
        return "~/" + str(folder.relative_to(Path.home()))
    except ValueError:
        return str(folder)


def _same(entry: str, folder: Path, home: Path) -> bool:
    path = Path(entry).expanduser()
    path = path if path.is_absolute() else home / path
    return os.path.normpath(path) == os.path.normpath(folder.expanduser())


def _document(text: str, where: Path) -> tomlkit.TOMLDocument:
    try:
        return tomlkit.parse(text)
    except TOMLKitError as exc:
        raise FolderError(
            f"{where} is not valid TOML ({exc})", "fix or remove the file, then try again"
        ) from None


def _entries(doc: tomlkit.TOMLDocument, where: Path) -> list[str]:
    found = doc.get(KEY, [])
    if not isinstance(found, list) or not all(isinstance(d, str) for d in found):
        raise FolderError(f"{where}: {KEY} must be a list of paths", "fix it by hand first")
    return [str(d) for d in found]


def with_folder(text: str, folder: Path, home: Path, where: Path) -> str:
    """The config text with `folder` added to `models_dirs` (the file's other text
    kept); refused when it is already looked in."""
    if _same(str(home / "models"), folder, home):
        raise FolderError(f"{folder} is the home's own model folder: it is always looked in")
    doc = _document(text, where)
    entries = _entries(doc, where)
    if any(_same(e, folder, home) for e in entries):
        raise FolderError(f"{folder} is a model folder already")
    if KEY in doc:
        array = doc[KEY]
        array.append(folder_entry(folder, home))
    else:
        array = tomlkit.array()
        array.append(folder_entry(folder, home))
        doc[KEY] = array.multiline(True)
    return tomlkit.dumps(doc)


def without_folder(text: str, folder: Path, home: Path, where: Path) -> str:
    """The config text with `folder` gone from `models_dirs` (nothing on disk is
    touched); refused when it is not one of them."""
    doc = _document(text, where)
    entries = _entries(doc, where)
    keep = [i for i, e in enumerate(entries) if not _same(e, folder, home)]
    if len(keep) == len(entries):
        said = (
            "the home's own model folder is always looked in"
            if _same(str(home / "models"), folder, home)
            else f"it is not in {KEY} of {where}"
        )
        raise FolderError(f"{folder} cannot be removed: {said}")
    array = doc[KEY]
    for i in reversed(range(len(entries))):
        if i not in keep:
            del array[i]
    return tomlkit.dumps(doc)


def folder_counts(home: Path, folders: Sequence[Path], catalog: Catalog) -> list[FolderCount]:
    """Each model folder with its models and its directories that hold none."""
    defaults = {os.path.normpath(home / "models")}
    out = []
    for folder in folders:
        inside = [m.path for m in catalog.models]
        out.append(
            FolderCount(
                folder,
                "" if os.path.normpath(folder) in defaults else folder_entry(folder, home),
                sum(_under(p, folder) for p in inside),
                sum(_under(p, folder) for p in catalog.empty),
                folder.is_dir(),
            )
        )
    return out


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def empty_note(empty: Iterable[Path]) -> str:
    """The quiet line for directories that hold no model: a count and a few names."""
    names = sorted(p.name for p in empty)
    if not names:
        return ""
    shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
    said = "holds" if len(names) == 1 else "hold"
    return f"{len(names)} folder{'s' if len(names) != 1 else ''} there {said} no model ({shown})"


def outside_note(model_dir: Path, folders: Sequence[Path]) -> str | None:
    """What to say of a model written where the catalog does not look (None: it
    looks there). The catalog finds a model in a folder, one level down in it, or a
    folder that is the model itself."""
    model_dir = Path(os.path.normpath(model_dir.expanduser().absolute()))
    places = {Path(os.path.normpath(f.expanduser().absolute())) for f in folders}
    if model_dir in places or model_dir.parent in places or model_dir.parent.parent in places:
        return None
    looked = ", ".join(str(f) for f in folders)
    return (
        f"{model_dir.parent} is not a model folder (models are looked for in {looked} and "
        "the Hugging Face cache), so the dashboard does not list it: add the folder with "
        "`a` on the Models pane (models_dirs in config.toml), or place it by its path"
    )


def delete_refusal(
    model_dir: Path,
    placements: Iterable[PlacementState],
    folders: Sequence[Path],
    name: str = "",
) -> str | None:
    """Why the model at `model_dir` must not be deleted, None when it may: a
    placement uses it, or it is not a model inside a model folder (a folder named
    directly in models_dirs is the operator's, not a model the pane holds). `name`
    is the model as the pane lists it (a hub snapshot's folder is its commit)."""
    target = os.path.normpath(model_dir)
    for p in placements:
        dirs = {p.model_dir, *(s.model_dir for s in p.shards)} - {""}
        if any(os.path.normpath(d) == target for d in dirs) or (
            not dirs and p.model == model_dir.name
        ):
            return (
                f"placement {p.name!r} uses {name or model_dir.name}: unload it first "
                "(u on the Placements pane), then delete the model"
            )
    if any(os.path.normpath(f) == target for f in folders):
        return (
            f"{model_dir} is a model folder itself (in {KEY}): remove the folder from the "
            "list (a) and delete its files by hand if you mean to"
        )
    return None


# --------------------------------------------------------------------------- the file


def _write(path: Path, text: str) -> None:
    """Whole or not at all: a dashboard killed mid-write leaves the old file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise FolderError(f"cannot read {path}: {exc}") from None


def add_folder(home: Path, folder: Path) -> Path:
    """Add `folder` to the model folders of `home`'s config.toml; the folder as added.
    A folder that does not exist is refused: a typo would be looked in for ever."""
    folder = folder.expanduser()
    folder = (folder if folder.is_absolute() else Path.cwd() / folder).resolve()
    if not folder.is_dir():
        raise FolderError(
            f"{folder} is not a directory", "type the path of a folder that holds models"
        )
    path = home / CONFIG_FILE
    _write(path, with_folder(_read(path), folder, home, path))
    return folder


def remove_folder(home: Path, folder: Path) -> None:
    """Stop looking in `folder` (its files stay where they are)."""
    path = home / CONFIG_FILE
    _write(path, without_folder(_read(path), folder, home, path))


def model_folders(home: Path) -> tuple[Path, ...]:
    """The folders looked in, the home's own first (as the catalog scans them)."""
    return settings(home).folders
