"""`bench`: the engine bench (studiotui.bench, which nothing else imports)."""

from __future__ import annotations

import argparse
from pathlib import Path

from studiotui.core.errors import UserError


def cmd_bench(args: argparse.Namespace, home: Path) -> int:
    from studiotui.bench.run import BenchError, run_bench, run_soak, run_speculative

    try:
        if getattr(args, "soak", False):
            return run_soak(quick=args.quick, as_json=args.json)
        if getattr(args, "speculative", False):
            return run_speculative(quick=args.quick, as_json=args.json)
        return run_bench(quick=args.quick, as_json=args.json)
    except BenchError as exc:
        raise UserError(f"bench failed: {exc}") from None
