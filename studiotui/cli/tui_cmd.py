"""The dashboard, the verb-less command."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_tui(args: argparse.Namespace, home: Path) -> int:
    from studiotui.app.launch import launch
    from studiotui.cli.serve import api_service, key_file_of

    serve = getattr(args, "serve", None)
    services = (
        [api_service(serve[0], serve[1], getattr(args, "api_key", None), key_file_of(args))]
        if serve
        else []
    )
    return launch(args, home, services)
