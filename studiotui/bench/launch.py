"""mlx-lm's own multi-process runs, for comparison: two ranks on this machine over
MLX's ring backend, started with `mlx.launch` beside this Python."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def ring_of_two(
    script: Path, port: int, args: list[str], timeout: float = 300
) -> dict[str, Any] | None:
    """Run `script args` as two ranks; the JSON line it prints, or None when mlx.launch
    is not installed, the run fails or it prints none."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        return None
    cmd = [str(launcher), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2"]
    cmd += ["--starting-port", str(port), "--", sys.executable, str(script), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    for line in proc.stdout.splitlines():
        if line.strip().startswith("{"):
            return dict(json.loads(line))
    return None
