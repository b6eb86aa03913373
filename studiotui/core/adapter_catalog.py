"""The adapters this operator can place with a model, and the checks before placing one.

Where adapters are looked for: `STUDIOTUI_HOME/adapters/` and every folder in
`adapters_dirs = [...]` of `STUDIOTUI_HOME/config.toml` (`~` expanded, relative paths
taken from the home). An adapter is a directory holding `adapter_config.json` (one
level of nesting is followed, as for models). An adapter belongs to the models whose
directory name its `studiotui_base.model` names: the listing compares names only
(no model is hashed to draw a pane); placing compares the base's digest, so a
model renamed or replaced since is caught there, before any file is copied.

Headers only: nothing here reads a tensor.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from studiotui.core.errors import UserError
from studiotui.core.model_facts import ModelInfo
from worker.shared.adapters import (
    CONFIG_NAME,
    Adapter,
    AdapterError,
    adapter_name,
    identity_mismatch,
    outside_layers_reason,
    read_adapter,
)
from worker.shared.manifest import Hashing

ADAPTERS_FOLDER = "adapters"
CONFIG_FILE = "config.toml"


class AdapterRefused(UserError):
    """An adapter that cannot be placed with a model; nothing was copied or loaded."""


@dataclass(frozen=True)
class AdapterCatalog:
    adapters: tuple[Adapter, ...] = ()
    skipped: tuple[tuple[Path, str], ...] = ()  # (directory, why it is not offered)
    searched: tuple[Path, ...] = ()

    def for_model(self, model_name: str) -> list[Adapter]:
        """The adapters stamped as trained on a model of this directory name."""
        return [a for a in self.adapters if a.base is not None and a.base.model == model_name]

    def named(self, name: str) -> list[Adapter]:
        return [a for a in self.adapters if a.name == name]


def adapter_folders(home: Path) -> tuple[Path, ...]:
    """`home/adapters` and the `adapters_dirs` of config.toml; a config.toml that cannot
    be read leaves the default folder (the Models pane reports the file itself)."""
    folders = [home / ADAPTERS_FOLDER]
    path = home / CONFIG_FILE
    entries: object = []
    if path.is_file():
        try:
            entries = tomllib.loads(path.read_text(encoding="utf-8")).get("adapters_dirs", [])
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
            entries = []
    if isinstance(entries, list):
        for entry in entries:
            if isinstance(entry, str):
                folder = Path(entry).expanduser()
                folders.append(folder if folder.is_absolute() else home / folder)
    return tuple(dict.fromkeys(folders))


def scan_adapters(folders: tuple[Path, ...]) -> AdapterCatalog:
    found: list[Adapter] = []
    skipped: list[tuple[Path, str]] = []
    for folder in folders:
        for candidate in _candidates(folder):
            try:
                found.append(read_adapter(candidate))
            except AdapterError as exc:
                skipped.append((candidate, str(exc)))
    return AdapterCatalog(tuple(found), tuple(skipped), folders)


def scan_home_adapters(home: Path) -> AdapterCatalog:
    return scan_adapters(adapter_folders(home))


def _candidates(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    out: list[Path] = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if (sub / CONFIG_NAME).is_file():
            out.append(sub)
        else:  # one level of nesting: adapters/<model>/<adapter>
            out += sorted(p for p in sub.iterdir() if p.is_dir() and (p / CONFIG_NAME).is_file())
    return out


def resolve_adapter(spec: str | Path, home: Path) -> Path:
    """An adapter directory, or the adapter of that name in the adapters folders."""
    path = Path(spec).expanduser()
    if path.exists():
        return path.resolve()
    catalog = scan_home_adapters(home)
    named = catalog.named(str(spec))
    if len(named) == 1:
        return named[0].path.resolve()
    if named:
        raise AdapterRefused(f"several adapters are named {spec}: give its directory")
    known = ", ".join(sorted(a.name for a in catalog.adapters)) or "none"
    where = ", ".join(str(f) for f in catalog.searched)
    raise AdapterRefused(
        f"adapter {spec} is neither a directory nor an adapter found in {where} "
        f"(adapters found: {known})"
    )


def check_base(adapter_dir: Path, model_dir: Path, on_progress: Hashing | None = None) -> Adapter:
    """The adapter, if well formed (as mlx-lm's load_adapters reads it) and trained on
    these very weights (the base's digest); else AdapterRefused naming both and what
    to do. Reads the adapter's config and header and hashes the model: every byte the
    first time (`on_progress(done, total)` hears it), nothing once cached."""
    try:
        adapter = read_adapter(adapter_dir)
    except AdapterError as exc:
        raise AdapterRefused(str(exc)) from None
    reason = identity_mismatch(adapter, model_dir, on_progress)
    if reason:
        raise AdapterRefused(reason)
    return adapter


def check_adapter(
    adapter_dir: Path, model_dir: Path, info: ModelInfo, on_progress: Hashing | None = None
) -> Adapter:
    """The adapter, if it can be placed with this model: `check_base`, and only in
    decoder layers the model has (a shard applies its own layers' part). No copy, no
    load."""
    adapter = check_base(adapter_dir, model_dir, on_progress)
    if adapter.outside:
        raise AdapterRefused(outside_layers_reason(adapter))
    beyond = [n for n in adapter.layers if n >= info.n_layers]
    if beyond:
        raise AdapterRefused(
            f"adapter {adapter.name} adapts layer {beyond[0]}, but {info.name} has "
            f"{info.n_layers} layers: it was not trained on this model"
        )
    first = converted_from(adapter.num_layers, info.n_layers)
    early = [n for n in adapter.layers if n < first]
    if early:
        # mlx-lm's load_adapters would refuse it too, but only on the node, after copying.
        raise AdapterRefused(
            f"adapter {adapter.name} holds tensors of layer {early[0]}, but its num_layers "
            f"({adapter.num_layers}) makes LoRA layers of layers {first}-{info.n_layers - 1} "
            "only: its adapter_config.json does not match its weights"
        )
    return adapter


def adapter_tensor(tensor: int | None) -> int:
    """The nodes per stage of a placement with an adapter: 1. mlx-lm's LoRA layers wrap
    whole projections, which a tensor-parallel rank holds only slices of; asking for
    more is refused, with what to do instead."""
    if tensor is not None and tensor > 1:
        raise AdapterRefused(
            f"--tensor {tensor}: an adapter is applied by pipeline stages (one node each), "
            "not by tensor-parallel groups; place it without --tensor, or fuse it into a "
            "model (studiotui fuse) and place that with --tensor"
        )
    return 1


def converted_from(num_layers: int, n_layers: int) -> int:
    """The first layer `linear_to_lora_layers(model, num_layers, ...)` converts: it takes
    `model.layers[-max(num_layers, 0):]`, so 0 or less (mlx-lm's -1) means every layer."""
    return max(0, n_layers - num_layers) if num_layers > 0 else 0


def adapter_placement_name(model_dir: Path, adapter_dir: Path) -> str:
    """The default name (and API model id) of a model placed with an adapter."""
    return f"{model_dir.name}+{adapter_name(adapter_dir)}"
