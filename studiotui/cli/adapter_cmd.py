"""`studiotui fuse` and `studiotui adapter`: adapters outside a placement.

`fuse` writes a new model directory with the adapter folded into the weights, by
mlx-lm's own fuse (`python -m mlx_lm fuse`: `mlx_lm.load(adapter_path=...)`, each
LoRA layer's own `fuse()`, `mlx_lm.utils.save`) in a child process, so the memory of
a whole model is held there and given back when it ends. The adapter's base identity
is checked first, as placing checks it, so nothing is loaded for a mismatch.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

from studiotui.cli.output import hashing_shown
from studiotui.cli.place_cmd import resolve_model
from studiotui.cluster import jobs
from studiotui.core.adapter_catalog import (
    AdapterRefused,
    adapter_placement_name,
    check_base,
    resolve_adapter,
    scan_home_adapters,
)
from studiotui.core.errors import UserError
from studiotui.core.model_facts import ModelDirError, read_model
from worker.shared.adapters import AdapterError, stamp_identity


def add_adapter_parsers(sub: Any) -> None:
    fuse = sub.add_parser(
        "fuse", help="fold an adapter into its base model: a new model directory to place"
    )
    fuse.add_argument("model_dir", type=Path, help="the base model (directory or catalog name)")
    fuse.add_argument("--adapter", required=True, help="adapter directory or name")
    fuse.add_argument(
        "--out",
        type=Path,
        help="the new model directory (default: STUDIOTUI_HOME/models/MODEL+ADAPTER-fused)",
    )
    fuse.add_argument(
        "--dequantize", action="store_true", help="write float weights (of a quantized base)"
    )
    adapter = sub.add_parser("adapter", help="list adapters, or stamp one with its base model")
    # Without a verb it lists, as `studiotui jobs` does (argparse would name its dest).
    verbs = adapter.add_subparsers(dest="adapter_verb", metavar="{list,stamp}")
    listing = verbs.add_parser("list", help="the adapters found, by base model")
    listing.add_argument("model", nargs="?", help="only those of this model (directory name)")
    stamp = verbs.add_parser(
        "stamp", help="record which model an adapter was trained on (its name and digest)"
    )
    stamp.add_argument("dir", type=Path, help="the adapter directory")
    stamp.add_argument("--model", type=Path, required=True, help="the base model it was trained on")


def fuse_argv(model_dir: Path, adapter_dir: Path, out: Path, dequantize: bool) -> list[str]:
    """mlx-lm's own fuse command line."""
    argv = [sys.executable, "-m", "mlx_lm", "fuse", "--model", str(model_dir)]
    argv += ["--adapter-path", str(adapter_dir), "--save-path", str(out)]
    return [*argv, "--dequantize"] if dequantize else argv


def fuse_target(out: Path | None, home: Path, model_dir: Path, adapter_dir: Path) -> Path:
    """Where the fused model goes: `out`, else the home's models folder (so the catalog
    lists it) as MODEL+ADAPTER-fused — not MODEL+ADAPTER itself, the name of the base
    placed with the adapter. A non-empty folder there is refused: nothing is replaced."""
    fused = f"{adapter_placement_name(model_dir, adapter_dir)}-fused"
    target = (out or home / "models" / fused).expanduser().resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(
            f"{target} exists and is not empty: pick another --out (nothing was written)"
        )
    return target


def cmd_fuse(args: argparse.Namespace, home: Path) -> int:
    model_dir = resolve_model(args.model_dir, home).expanduser().resolve()
    try:
        adapter_dir = resolve_adapter(args.adapter, home)
    except AdapterRefused as exc:
        if jobs.load_record(home, str(args.adapter)) is None:
            raise
        name = args.adapter
        raise AdapterRefused(
            f"{exc.message}; {name} is a job whose adapter is still on its nodes",
            f"bring it here first: studiotui jobs fetch {name}",
        ) from None
    with hashing_shown(model_dir, "to check the adapter's base") as shown:
        adapter = check_base(adapter_dir, model_dir, shown)
    out = fuse_target(args.out, home, model_dir, adapter_dir)
    print(f"fusing {adapter.name} into {model_dir.name} with mlx-lm's fuse -> {out}")
    done = subprocess.run(
        fuse_argv(model_dir, adapter_dir, out, args.dequantize),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stdout.strip().splitlines()[-5:])
        raise UserError(f"mlx-lm's fuse failed (exit {done.returncode}):\n{tail}")
    try:
        info = read_model(out)
    except ModelDirError as exc:
        raise UserError(f"mlx-lm's fuse wrote {out}, but it cannot be read: {exc}") from None
    print(f"fused model {info.name}: {info.n_layers} layers; place it with: studiotui place {out}")
    return 0


def cmd_adapter(args: argparse.Namespace, home: Path) -> int:
    if args.adapter_verb == "stamp":
        model_dir = resolve_model(args.model, home).expanduser().resolve()
        try:
            with hashing_shown(model_dir, "to stamp the adapter with its base") as hashed:
                identity = stamp_identity(args.dir.expanduser(), model_dir, hashed)
        except AdapterError as exc:
            raise AdapterRefused(str(exc)) from None
        print(f"{args.dir}: base {identity.model} (digest {identity.digest[:12]})")
        return 0
    model = getattr(args, "model", None)  # absent without the `list` verb
    catalog = scan_home_adapters(home)
    shown = catalog.for_model(model) if model else list(catalog.adapters)
    for a in shown:
        base = f"{a.base.model} ({a.base.digest[:12]})" if a.base else "no base recorded"
        span = f"layers {a.layers[0]}-{a.layers[-1]}" if a.layers else "no layers"
        print(f"{a.name}\t{a.fine_tune_type} rank {a.rank}, {span}\tbase {base}\t{a.path}")
    for path, why in catalog.skipped:
        print(f"skipped {path}: {why}", file=sys.stderr)
    if not shown:
        where = ", ".join(str(f) for f in catalog.searched)
        print(f"no adapters{f' of {model}' if model else ''} in {where}")
    return 0
