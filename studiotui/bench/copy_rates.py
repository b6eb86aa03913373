"""How fast model files reach nodes, three ways, on the same files in one run.

- `copy_operator_sftp_mb_s`: the operator's SFTP copy to one SSH node (what a node
  gets when no node holds the model), verified by the node's agent;
- `copy_node_to_node_mb_s`: one node's agent to another's over their cluster
  addresses (CURVE ZeroMQ, hashed as it lands); `copy_node_to_node_x2_mb_s`: one
  source feeding two targets at once (bytes landed on both, per second);
- `copy_mlx_share_mb_s`: mlx-lm's own broadcaster (`mlx_lm.share`, all_sum over an
  `mx.distributed` ring of two processes), which neither encrypts nor verifies.
Run by the full bench on the SSH nodes it provisions (a real sshd on loopback).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from studiotui.bench.launch import ring_of_two
from studiotui.cluster import model_files, model_sync
from studiotui.cluster.controller import Controller
from studiotui.core.inventory import Inventory

SHARE_PORT = 57390


def bench_model(work: Path) -> Path:
    """~100 MB in four weight files: big enough for a rate, small enough for 2 vCPUs."""
    from worker.shared.demo_model import DemoSpec, write_demo_model

    spec = DemoSpec(layers=4, hidden=768, heads=8, kv_heads=4, dtype="float32", files=4)
    return write_demo_model(work / "copybench", spec)


async def copy_rates(home: Path, inv: Inventory, work: Path) -> dict[str, Any]:
    if len(inv.nodes) < 4:
        return {"copy_error": "the copy bench needs four SSH nodes"}
    model = bench_model(work)
    n1, n2, n3, n4 = (n.name for n in inv.nodes[:4])
    files = model_files.needed_files(model, 0, 4, 4)
    size = sum(f.size for f in files)
    model_files.local_manifest(model, files)  # hashed before the clock starts
    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        sftp = await _timed(ctl, model, {n1: files})
        n2n = await _timed(ctl, model, {n2: files}, sources=[n1])
        both = await _timed(ctl, model, {n3: files, n4: files}, sources=[n1])
    finally:
        await ctl.close()
    share = mlx_share_rate(model)
    return {
        "copy_mb": round(size / 1e6, 1),
        "copy_operator_sftp_mb_s": round(size / 1e6 / sftp, 1),
        "copy_node_to_node_mb_s": round(size / 1e6 / n2n, 1),
        "copy_node_to_node_x2_mb_s": round(2 * size / 1e6 / both, 1),
        "copy_mlx_share_mb_s": round(share, 1) if share else None,
    }


async def _timed(
    ctl: Controller, model: Path, needs: dict[str, Any], sources: list[str] | None = None
) -> float:
    began = time.perf_counter()
    await model_sync.provide(ctl, model, needs, sources=sources)
    return time.perf_counter() - began


def mlx_share_rate(model: Path, keep: Path | None = None) -> float | None:
    """MB/s of mlx-lm's broadcaster between two ranks on this machine, or None.
    `keep`: where rank 1's copy goes (else a temporary folder, removed)."""
    script = Path(__file__).with_name("share.py")
    with tempfile.TemporaryDirectory(prefix="studiotui-share-") as tmp:
        out = ring_of_two(script, SHARE_PORT, [str(model), str(keep or Path(tmp) / "dest")])
    if out is None:
        return None
    return float(out["bytes"]) / 1e6 / float(out["seconds"])
