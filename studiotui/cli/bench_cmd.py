"""`bench`: the engine bench (studiotui.bench, which nothing else imports)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from studiotui.core.errors import UserError

# The shell's status for a process ended by SIGTERM (128 + 15).
TERMINATED = 143


class Stopped(BaseException):
    """SIGTERM during a bench: raised where it runs, past the phases' `except
    Exception`, so each phase's `finally` stops the agents, servers and processes it
    started, as Ctrl-C does."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise Stopped


def cmd_bench(args: argparse.Namespace, home: Path) -> int:
    from studiotui.bench.run import BenchError, run_bench, run_soak, run_speculative

    signal.signal(signal.SIGTERM, _stop)
    try:
        if getattr(args, "soak", False):
            return run_soak(quick=args.quick, as_json=args.json)
        if getattr(args, "speculative", False):
            return run_speculative(quick=args.quick, as_json=args.json)
        return run_bench(quick=args.quick, as_json=args.json)
    except BenchError as exc:
        raise UserError(f"bench failed: {exc}") from None
    except Stopped:
        print("studiotui: bench stopped (SIGTERM); its agents were stopped", file=sys.stderr)
        return TERMINATED
