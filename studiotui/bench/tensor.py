"""The bench's tensor-parallel figures: our 2-way tensor group beside mlx-lm's own.

`tp2_tps` / `tp2_ratio`: the bench model placed as one stage run by a tensor group of
two local nodes (MLX's ring backend on loopback), decoded next to mlx-lm's loop in one
process, paired run by run as the pipeline figures are. `mlx_tp2_ratio`: mlx-lm's own
tensor parallel (`model.shard()` and mlx-lm's generate loop on two ranks of the ring
backend, tp_rank.py, started as `mlx.launch --backend ring -n 2` starts them) on the
same model in the same run, over the same single-process figure. On a 2-vCPU machine
the ring backend busy-polls while it waits for the other rank, so both are below 1
here; the comparison that matters is ours against mlx-lm's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from studiotui.bench.launch import ring_of_two
from studiotui.cluster.controller import Controller
from studiotui.core.inventory import Inventory
from studiotui.core.placement import Plan

TP_PORT_OFFSET = 950
FIGURES = (
    "tp2_tps",
    "tp2_ratio",
    "mlx_tp2_tps",
    "mlx_tp2_ratio",
    "mlx_tp2_launch_tps",
    "tp2_over_mlx",
    "tp2_tokens_match",
)


def tensor_plan(ctl: Controller, model_dir: Path, nodes: list[str]) -> Plan:
    """The planner's one-node plan, run by a tensor group of `nodes` on the ring backend."""
    _, one = ctl.preview(model_dir, nodes[:1])
    if not isinstance(one, Plan):
        raise RuntimeError(f"the bench model does not fit one node: {one.reason}")
    stage = dataclasses.replace(
        one.shards[0], group=tuple(nodes), backend="ring", backend_reason="bench: loopback"
    )
    return dataclasses.replace(one, shards=(stage,))


async def tensor_figures(
    home: Path,
    inv: Inventory,
    model_dir: Path,
    prefill_chunk: int,
    measure: Callable[[Controller, str], Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """Place the model as a tensor group of the first two nodes, `measure` it (the
    bench's paired decode), unload it."""
    ctl = Controller(home, inv)
    nodes = list(inv.names)[:2]
    try:
        await ctl.refresh()
        plan = tensor_plan(ctl, model_dir, nodes)
        await ctl.place(model_dir, nodes, "tp2", expected=plan, prefill_chunk=prefill_chunk)
        out = await measure(ctl, "tp2")
        await ctl.unload("tp2")
    finally:
        await ctl.close()
    return out


def mlx_tp2_tps(model_dir: Path, port: int, tokens: int) -> dict[str, Any] | None:
    """mlx-lm's own 2-way tensor parallel here, its two ranks started directly with the
    environment `mlx.launch --backend ring` gives them (rank, world size, a hostfile of
    one address:port per rank): tokens/s and its tokens, or None if the run failed.

    Not through mlx.launch itself: its launcher's threads wait on `select` with the
    ranks' always-writable stdin pipes, so they wake without pause, and on two vCPUs
    with both ranks busy-polling the ring every such wake-up descheduled a rank (5.3 tok/s
    through mlx.launch against 31.7 direct, same script and model). `mlx_tp2_launch_tps`
    keeps the launcher's figure (full run only)."""
    script = Path(__file__).with_name("tp_rank.py")
    ports = [port + TP_PORT_OFFSET, port + TP_PORT_OFFSET + 1]
    with tempfile.TemporaryDirectory(prefix="studiotui-tp2-") as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        base = {**os.environ, "MLX_WORLD_SIZE": "2", "MLX_HOSTFILE": str(hostfile)}
        cmd = [sys.executable, str(script), str(model_dir), "16", str(tokens)]
        ranks = [
            subprocess.Popen(
                cmd,
                env={**base, "MLX_RANK": str(rank)},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for rank in range(2)
        ]
        try:
            out = ranks[0].communicate(timeout=300)[0]
            ranks[1].wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None
        finally:
            for proc in ranks:  # only the two this function started
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return dict(json.loads(lines[-1])) if lines else None


async def versus_mlx(
    ours: Callable[[], Awaitable[dict[str, Any]]],
    model_dir: Path,
    port: int,
    tokens: int,
    rounds: int,
) -> list[dict[str, Any]]:
    """mlx-lm's own tensor parallel run between our group's runs, alternating which goes
    first, while the same agents are up: one of its runs per round, so each of our runs
    has a partner measured under the same load (`tp2_over_mlx` is the median of the
    pairs' ratios). Ours is measured by `ours` only to keep the alternation; its figures
    come from the bench's own paired decode."""
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        order = ("ours", "mlx") if r % 2 else ("mlx", "ours")
        pair: dict[str, Any] = {}
        for side in order:
            if side == "ours":
                pair["ours"] = await ours()
            else:
                pair["mlx"] = await asyncio.to_thread(mlx_tp2_tps, model_dir, port, tokens)
        runs.append(pair)
    return runs


def mlx_tp2_launch_tps(model_dir: Path, port: int, tokens: int) -> dict[str, Any] | None:
    """The same through `mlx.launch --backend ring -n 2`, launcher and all."""
    script = Path(__file__).with_name("tp_rank.py")
    return ring_of_two(script, port + TP_PORT_OFFSET + 10, [str(model_dir), "16", str(tokens)])


def summarize_tensor(
    tp: dict[str, Any] | None, mlx: dict[str, Any] | None, launched: dict[str, Any] | None = None
) -> dict[str, Any]:
    if not tp:
        return dict.fromkeys(FIGURES)
    single = statistics.median(r["tps"] for r in tp["single"])
    # Not part of tokens_match: a sum re-associated over ranks may flip a near-tie token
    # of a 256-token float32 answer (tests/integration/test_tensor_parallel.py judges
    # only where the margin allows); reported so a difference is seen.
    want = tp["single"][0]["tokens"]
    answers = list(tp["tokens"]) + ([mlx["tokens"]] if mlx else [])
    pairs = [
        p["ours"]["tps"] / p["mlx"]["tps"]
        for p in tp.get("versus_mlx", [])
        if p.get("mlx") and p["mlx"]["tps"] > 0
    ]
    return {
        "tp2_tps": round(tp["tps"], 2),
        "tp2_ratio": round(tp["ratio"], 3),
        "mlx_tp2_tps": round(mlx["tps"], 2) if mlx else None,
        "mlx_tp2_ratio": round(mlx["tps"] / single, 3) if mlx else None,
        "mlx_tp2_launch_tps": round(launched["tps"], 2) if launched else None,
        "tp2_over_mlx": round(statistics.median(pairs), 3) if pairs else None,
        "tp2_tokens_match": all(a == want for a in answers),
    }
