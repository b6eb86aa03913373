"""`status`: nodes and placements, as a table or JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from studiotui.cli.args import inventory_of
from studiotui.cli.nodes_cmd import (
    nobody_home,
    print_nodes,
    print_running,
    running_json,
    start_hint,
)
from studiotui.cli.output import console, errors
from studiotui.cluster.controller import Controller
from studiotui.cluster.session import open_controller
from studiotui.core.members import cables
from studiotui.core.state import PlacementState
from studiotui.core.traffic import (
    RateMeter,
    placement_acceptance,
    placement_cache,
    placement_in_flight,
    placement_tokens,
)


async def cmd_status(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    # No agent process here to answer: ask briefly rather than wait the full timeout.
    async with open_controller(inv, home, ask=0.3 if nobody_home(inv) else 2.0) as ctl:
        if args.json:
            rates = await sample_rates(ctl, STATUS_RATE_WINDOW_S)
            console.print_json(
                json.dumps({**status_json(ctl, rates), "services": running_json(home)})
            )
        else:
            print_nodes(ctl)
            print_running(home)
    if not any(n.state == "up" for n in ctl.state.nodes):
        errors.print(f"no node of cluster {inv.name} is up: start it with {start_hint(inv)}")
        return 1
    return 0


# How long `status --json` watches the token counts for its tok/s: the runners count
# once a second, so a shorter window would read 0 for a placement that is answering.
STATUS_RATE_WINDOW_S = 2.0


def rates_to_sample(placements: Sequence[PlacementState]) -> list[str]:
    """The placements whose tok/s is worth watching for: ready ones at work on a
    request. An idle one makes 0 tok/s, known without waiting a window."""
    return [p.name for p in placements if p.state == "ready" and placement_in_flight(p) > 0]


async def sample_rates(ctl: Controller, window: float) -> dict[str, float]:
    """Each ready placement's tokens a second over `window` seconds (the dashboard's
    RateMeter over two of the agents' reports); no wait when none is answering."""
    if not rates_to_sample(ctl.state.placements):
        return {}  # none answering: 0 tok/s, said at once
    meter = RateMeter(window)
    loop = asyncio.get_running_loop()
    for p in ctl.state.placements:
        meter.update(p.name, placement_tokens(p), loop.time())
    await asyncio.sleep(window)
    await ctl.refresh()
    return {
        p.name: meter.update(p.name, placement_tokens(p), loop.time()) for p in ctl.state.placements
    }


def status_json(ctl: Controller, rates: Mapping[str, float] | None = None) -> dict[str, Any]:
    """What `status --json` prints; `rates`: tok/s by placement (`sample_rates`)."""
    st = ctl.state
    rates = rates or {}
    # Which Thunderbolt port of a node leads to which node (agents' RDMA facts matched
    # by domain UUID, core/members.cables): the cabling JACCL's device matrix comes from.
    wired = cables({n.name: n.facts.get("rdma") for n in st.nodes})
    return {
        "cluster": st.name,
        "nodes": [
            {
                "name": n.name,
                "address": n.endpoint,
                "transport": n.transport,
                "state": n.state,
                "version": n.version,
                "memory_total": n.memory_total,
                "memory_used": n.memory_used,
                "chip": n.chip,
                "message": n.message,
                "thunderbolt": [
                    {"port": c.receptacle, "device": c.device, "state": c.state, "reaches": c.peer}
                    for c in wired
                    if c.node == n.name
                ],
            }
            for n in st.nodes
        ],
        "placements": [
            {
                "name": p.name,
                "model": p.model,
                "model_dir": p.model_dir,
                "adapter": p.adapter,
                "state": p.state,
                "nodes": list(p.nodes),
                "layers": p.layers,
                "shape": p.shape,
                "context_tokens": p.context_tokens,
                "streams": p.streams,
                # Quantized KV (0: full precision) and the prompt cache's budget, summed
                # over the nodes (each counts its share in its memory).
                "kv_bits": max((s.kv_bits for s in p.shards), default=0),
                "prompt_cache_bytes": sum(s.prompt_cache_bytes for s in p.shards),
                "prompt_cache_disk_bytes": sum(s.prompt_cache_disk_bytes for s in p.shards),
                # What the dashboard's Placements pane shows (core/traffic.py).
                "in_flight": placement_in_flight(p),
                "tokens": placement_tokens(p),
                "tok_s": round(rates.get(p.name, 0.0), 2),
                # Speculative decoding: the head's guesser and the share of guesses kept.
                "draft": next((s.draft for s in p.shards if s.draft), ""),
                "drafted": sum(s.drafted for s in p.shards),
                "acceptance": placement_acceptance(p),
                "verified_ahead": sum(s.verified_ahead for s in p.shards),
                "prompt_cache": placement_cache(p).as_dict(),
            }
            for p in st.placements
        ],
    }
