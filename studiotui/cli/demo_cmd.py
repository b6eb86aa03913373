"""`demo-model`: a deterministic model directory to place."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from pathlib import Path

from studiotui.cli.output import console
from studiotui.core.errors import UserError
from studiotui.core.model_facts import read_model
from studiotui.core.model_folders import model_folders, outside_note
from studiotui.core.placement import format_bytes


def cmd_demo_model(args: argparse.Namespace, home: Path) -> int:
    from worker.shared.demo_model import HAS_EXPERTS, DemoModelError, DemoSpec, write_demo_model

    dtype = args.dtype or (
        "float32" if args.arch in HAS_EXPERTS and not args.quantize else "bfloat16"
    )
    try:
        spec = DemoSpec(
            arch=args.arch,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            experts=args.experts,
            seed=args.seed,
            dtype=dtype,
            quantize=args.quantize,
            group_size=args.group_size,
            files=args.files,
            recite=not args.noise,
        )
        path = _interruptible(lambda stop: write_demo_model(args.dir.expanduser(), spec, stop))
    except DemoModelError as exc:
        raise UserError(str(exc)) from None
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    # The quantization as the Models pane and the preview name it, from the config
    # written (mlx-lm keeps a MoE's router at 8 bits: "mixed 4/8-bit", not "4-bit").
    info = read_model(path)
    packed = f", {info.quantization}" if info.quantization else ""
    writes = "writes noise" if args.noise else "recites a passage"
    console.print(
        f"wrote {spec.arch} demo model ({spec.layers} layers, {dtype}"
        f"{packed}, {format_bytes(size)}; it {writes}) to {path}"
    )
    # Written where the Models pane does not look, it would never appear: say so.
    outside = outside_note(path, model_folders(home))
    if outside:
        console.print(f"note: {outside}")
    return 0


def _interruptible(work: Callable[[Callable[[], bool]], Path]) -> Path:
    """Run `work(stop)` with Ctrl-C and SIGTERM turned into `stop()` being True: the
    work ends at its next check (and cleans up) instead of wherever the signal lands."""
    import signal

    requested = threading.Event()
    handlers = {
        sig: signal.signal(sig, lambda *_: requested.set())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return work(requested.is_set)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
