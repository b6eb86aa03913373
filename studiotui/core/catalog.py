"""The models this operator can place: model folders and the Hugging Face cache.

Controller side, no Textual: the Models pane, and any verb that wants a list of
models, read it from here. Everything is read from `config.json` and the
safetensors headers (through `model_facts`), never the weights, so scanning a
disk holding a 700 GB model takes milliseconds.

Where models are looked for:

* `STUDIOTUI_HOME/models` and every folder in `models_dirs = [...]` of an optional
  `STUDIOTUI_HOME/config.toml` (`~` expanded, relative paths taken from the home).
  A model is a directory holding `config.json`; one level of nesting is followed
  so that `models/mlx-community/Qwen3-8B-4bit` works as well as `models/demo`.
* the Hugging Face hub cache (`$HF_HUB_CACHE`, `$HF_HOME/hub` or
  `~/.cache/huggingface/hub`): `models--org--name/snapshots/<rev>/`, the revision
  `refs/main` names (else the newest), when it holds `config.json` and safetensors.

A directory that looks like a model (its config.json, or weights) but cannot be read
is not dropped silently: it comes back as `Skipped` with the reason, for the pane to
show. A directory beside the models that holds neither (notes, datasets, a checkout)
is only counted (`Catalog.empty`): a models folder is often a folder of many things.
"""

from __future__ import annotations

import contextlib
import json
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from studiotui.core.model_facts import ModelDirError, ModelInfo, read_model, safetensors_tensors

CONFIG_FILE = "config.toml"
HF_SOURCE = "hf cache"
# The default cache argument; resolved at call time so $HF_HUB_CACHE / $HF_HOME count.
DEFAULT_HF_CACHE = Path("~/.cache/huggingface/hub")
# Causal language models by their transformers class name; a cached BERT or Whisper
# also has config.json and safetensors but nothing here can serve it.
_GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


@dataclass(frozen=True)
class Skipped:
    """A directory that looked like a model but cannot be offered, and why."""

    name: str
    path: Path
    reason: str
    source: str


@dataclass(frozen=True)
class Catalog:
    models: tuple[ModelInfo, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    # Where each model was found ("~/.studiotui/models", "hf cache"), by its path.
    sources: dict[Path, str] = field(default_factory=dict)
    # What was looked at, for an empty pane to say where it looked.
    searched: tuple[str, ...] = ()
    # Directories in the model folders holding no model (no config.json, no weights).
    empty: tuple[Path, ...] = ()

    def source(self, info: ModelInfo) -> str:
        return self.sources.get(info.path, "")


@dataclass(frozen=True)
class Settings:
    folders: tuple[Path, ...]
    hf_cache: Path | None
    problems: tuple[Skipped, ...] = ()


# --------------------------------------------------------------------------- settings


def default_hf_cache() -> Path:
    """Where huggingface_hub itself puts downloads, honouring its environment."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def settings(home: Path) -> Settings:
    """The folders to scan for `home`: its `models/` plus `models_dirs` from config.toml.

    A broken config.toml is reported (as a Skipped entry) rather than raised: the
    default folders still work and the pane says what is wrong with the file.
    """
    folders = [home / "models"]
    hf_cache: Path | None = default_hf_cache()
    problems: list[Skipped] = []
    path = home / CONFIG_FILE
    config: dict = {}
    if path.is_file():
        try:
            config = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
            problems.append(Skipped(CONFIG_FILE, path, f"cannot read {path}: {exc}", "config"))
    dirs = config.get("models_dirs", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        problems.append(
            Skipped(CONFIG_FILE, path, f"{path}: models_dirs must be a list of paths", "config")
        )
        dirs = []
    for entry in dirs:
        folder = Path(entry).expanduser()
        folders.append(folder if folder.is_absolute() else home / folder)
    cache = config.get("hf_cache")
    if cache is False or cache == "":
        hf_cache = None  # the operator opted out of listing the cache
    elif isinstance(cache, str):
        hf_cache = Path(cache).expanduser()
    return Settings(tuple(dict.fromkeys(folders)), hf_cache, tuple(problems))


def scan_home(home: Path) -> Catalog:
    found = settings(home)
    catalog = scan(found.folders, found.hf_cache)
    return replace(catalog, skipped=(*found.problems, *catalog.skipped))


# --------------------------------------------------------------------------- scanning


def scan_models(
    folders: Iterable[Path], hf_cache: Path | None = DEFAULT_HF_CACHE
) -> list[ModelInfo]:
    """Every readable model under `folders` and in the Hugging Face cache (None: not it)."""
    return list(scan(folders, hf_cache).models)


def scan(folders: Iterable[Path], hf_cache: Path | None = DEFAULT_HF_CACHE) -> Catalog:
    """Models and the directories skipped with their reasons; `hf_cache=None` skips the cache."""
    if hf_cache is DEFAULT_HF_CACHE:
        hf_cache = default_hf_cache()
    models: list[ModelInfo] = []
    skipped: list[Skipped] = []
    sources: dict[Path, str] = {}
    searched: list[str] = []
    empty: list[Path] = []
    seen: set[Path] = set()

    def take(path: Path, name: str, source: str) -> None:
        real = path.resolve()
        if real in seen:  # the same folder configured twice, or a symlink to one
            return
        seen.add(real)
        outcome = _read(path, name)
        if isinstance(outcome, str):
            skipped.append(Skipped(name, path, outcome, source))
        else:
            models.append(outcome)
            sources[outcome.path] = source

    for folder in folders:
        label = _tilde(folder)
        searched.append(label)
        for path, name in _folder_models(folder, skipped, label, empty):
            take(path, name, label)
    if hf_cache is not None:
        searched.append(HF_SOURCE)
        for path, name in _hf_models(hf_cache, skipped):
            take(path, name, HF_SOURCE)
    models.sort(key=lambda m: (m.name.lower(), str(m.path)))
    return Catalog(tuple(models), tuple(skipped), sources, tuple(searched), tuple(empty))


def _folder_models(
    folder: Path, skipped: list[Skipped], label: str, empty: list[Path]
) -> list[tuple[Path, str]]:
    if not folder.exists():
        return []
    if (folder / "config.json").is_file():
        return [(folder, folder.name)]  # models_dirs may name a model directly
    found: list[tuple[Path, str]] = []
    for child in _subdirs(folder, skipped, label):
        if (child / "config.json").exists():
            found.append((child, child.name))
            continue
        nested = [d for d in _subdirs(child, skipped, label) if (d / "config.json").exists()]
        if nested:
            found.extend((d, f"{child.name}/{d.name}") for d in nested)
        elif _has_weights(child):
            # Weights without a config: a model cut short (or a copy under way): say so.
            skipped.append(
                Skipped(child.name, child, "no config.json: not an mlx-lm model directory", label)
            )
        else:
            empty.append(child)  # notes, data, a checkout: counted, not a problem
    return found


def _has_weights(folder: Path) -> bool:
    try:
        return any(folder.glob("*.safetensors"))
    except OSError:
        return False


def _subdirs(folder: Path, skipped: list[Skipped], label: str) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError as exc:
        skipped.append(Skipped(folder.name, folder, f"cannot list {folder}: {exc}", label))
        return []


def _hf_models(cache: Path, skipped: list[Skipped]) -> list[tuple[Path, str]]:
    if not cache.is_dir():
        return []
    found: list[tuple[Path, str]] = []
    for repo in sorted(_subdirs(cache, skipped, HF_SOURCE)):
        if not repo.name.startswith("models--"):
            continue  # datasets--…, spaces--…
        name = "/".join(repo.name.split("--")[1:]) if "--" in repo.name else repo.name
        snapshot = _snapshot(repo)
        if snapshot is None:
            continue
        # Only what mlx-lm could load is offered; a cached tokenizer or a PyTorch-only
        # repo is not a model for this tool, and listing it as broken would be noise.
        if not (snapshot / "config.json").exists():
            continue
        if not any(snapshot.glob("*.safetensors")):
            if any(snapshot.glob("*.bin")) or any(snapshot.glob("*.pth")):
                skipped.append(
                    Skipped(
                        name,
                        snapshot,
                        "PyTorch weights only; convert it with mlx_lm.convert",
                        HF_SOURCE,
                    )
                )
            continue
        found.append((snapshot, name))
    return found


def _snapshot(repo: Path) -> Path | None:
    """The revision `refs/main` points at, else the most recently written one."""
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    try:
        if ref.is_file():
            wanted = snapshots / ref.read_text(encoding="utf-8").strip()
            if wanted.is_dir():
                return wanted
        revisions = [p for p in snapshots.iterdir() if p.is_dir()]
    except OSError:
        return None
    return max(revisions, key=lambda p: (p.stat().st_mtime, p.name), default=None)


# --------------------------------------------------------------------------- one model


def _read(path: Path, name: str) -> ModelInfo | str:
    """The model's facts under its catalog name, or why it cannot be placed."""
    try:
        config = json.loads((path / "config.json").read_bytes())
    except OSError as exc:
        return f"cannot read config.json: {exc.strerror or exc}"
    except (ValueError, RecursionError) as exc:
        return f"config.json is not valid JSON: {exc}"
    if not isinstance(config, dict):
        return "config.json is not a JSON object"
    architectures = config.get("architectures") or []
    if (
        isinstance(architectures, list)
        and architectures
        and not any(str(a).endswith(_GENERATIVE_SUFFIXES) for a in architectures)
    ):
        return f"not a text-generation model ({', '.join(map(str, architectures))})"
    try:
        info = read_model(path)
    except ModelDirError as exc:
        return str(exc)
    except Exception as exc:  # a damaged or half-downloaded file must not end the scan
        return f"{type(exc).__name__}: {exc}"
    return replace(info, name=name, facts=replace(info.facts, name=name))


# --------------------------------------------------------------------------- watching


def models_stamp(home: Path) -> tuple[tuple[str, int], ...]:
    """What changes when a model appears in, or leaves, the folders `scan_home` reads:
    the modification time of config.toml, of each models folder and the directories in
    it (two levels, as the scan goes) with the time and size of a model's own files,
    and of the Hugging Face cache's snapshot directories. One stat a directory or
    file, no file opened: cheap enough to ask every few seconds, and a model written
    elsewhere (another terminal, a download) changes it."""
    found = settings(home)
    stamps = [_stamp(home / CONFIG_FILE)]
    for folder in found.folders:
        stamps += _dir_stamps(folder, depth=2)
    if found.hf_cache is not None:
        stamps.append(_stamp(found.hf_cache))
        for repo in _dirs(found.hf_cache):
            if repo.name.startswith("models--"):
                stamps += _dir_stamps(repo / "snapshots", depth=1)
    return tuple(stamps)


def settling(path: Path, quiet_s: float, now: float) -> bool:
    """Whether the directory or a file in it changed within `quiet_s` seconds: a model
    still being written (no config.json yet, a safetensors file still growing) rather
    than a broken one."""
    newest = _stamp(path)[1]
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime_ns)
    except OSError:
        pass
    return now - newest / 1e9 < quiet_s


# The files of a model directory whose change changes the model: a weight file written
# over in place (same name, same directory entry) changes no directory's time.
_MODEL_FILES = (".safetensors", ".json")


def _file_stamps(folder: Path) -> list[tuple[str, int]]:
    """The time and size of each model file in `folder`, if it holds a model (its
    config.json): one stat a file, no file opened."""
    if not (folder / "config.json").is_file():
        return []
    stamps = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.endswith(_MODEL_FILES):
                    with contextlib.suppress(OSError):
                        st = entry.stat()
                        stamps.append((entry.path, hash((st.st_mtime_ns, st.st_size))))
    except OSError:
        pass
    return sorted(stamps)


def _stamp(path: Path) -> tuple[str, int]:
    try:
        return str(path), path.stat().st_mtime_ns
    except OSError:
        return str(path), 0


def _dirs(folder: Path) -> list[Path]:
    # The scan's own listing; a folder it cannot list is the scan's to report.
    return _subdirs(folder, [], "")


def _dir_stamps(folder: Path, depth: int) -> list[tuple[str, int]]:
    stamps = [_stamp(folder), *_file_stamps(folder)]
    if depth > 0:
        for child in _dirs(folder):
            stamps += _dir_stamps(child, depth - 1)
    return stamps


def safetensors_header(file: Path) -> dict[str, tuple[str, int]]:
    """Tensor name → (dtype, element count), from the JSON header alone."""
    return {key: (t.dtype, t.count) for key, t in safetensors_tensors(file).items()}


def _tilde(path: Path) -> str:
    """A path as the operator would type it: under the home directory as `~/…`."""
    try:
        return "~/" + str(path.expanduser().relative_to(Path.home()))
    except ValueError:
        return str(path)
