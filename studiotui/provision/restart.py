"""Restarting nodes with the shards they hold: the one sequence behind `studiotui
restart` and the dashboard's `r`.

An agent's shards stop with it, so a restart that only restarted agents would break
every placement on them. `restart_nodes` saves what the nodes hold (and what `down`
kept for them), restarts their agents (local ones here, SSH ones over SSH), loads
the saved shards again on the same layers and ports (a tensor group relaunched
whole), and says what it could not keep whole. It prints nothing: it returns a
`Restarted` for the CLI to print and the dashboard to log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller, ReloadResult
from studiotui.cluster.session import wait_until_up
from studiotui.core.inventory import NodeSpec
from studiotui.core.state import PlacementState
from studiotui.provision.deploy import Outcome, restart_agent
from studiotui.ssh.client import SshError

UP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Restarted:
    """What a restart did, in the order it happened."""

    # Placements held on the nodes that were not whole before: not reloaded.
    dropped: tuple[str, ...]
    # One per node asked, in the order asked.
    outcomes: tuple[Outcome, ...]
    # Placements a node that did not come back held: not reloaded.
    lost: tuple[str, ...]
    reloads: tuple[ReloadResult, ...]
    # Placements on the nodes not whole after all (other than the lost and failed ones).
    broken: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return (
            all(o.ok for o in self.outcomes)
            and all(r.ok for r in self.reloads)
            and not self.lost
            and not self.broken
        )


async def restart_local_agents(
    ctl: Controller, nodes: Sequence[NodeSpec], timeout: float = UP_TIMEOUT_S
) -> list[Outcome]:
    """Stop and start local agents (by pid file), then wait for them to answer: an
    outcome per node, with the new agent's pid, or its last output if it did not come."""
    started = time.monotonic()
    await asyncio.gather(*(asyncio.to_thread(local_cluster.stop_agent, n) for n in nodes))
    pids = await asyncio.gather(
        *(asyncio.to_thread(local_cluster.start_agent, ctl.home, n, ctl.inventory) for n in nodes)
    )
    missing = await wait_until_up(ctl, [n.name for n in nodes], timeout=timeout) if nodes else []
    outcomes = []
    for node, pid in zip(nodes, pids, strict=True):
        state = ctl.state.node(node.name)
        if node.name in missing or state is None:
            tail = await asyncio.to_thread(local_cluster.agent_output_tail, node)
            outcomes.append(
                Outcome(
                    node.name,
                    "failed",
                    f"the local agent (pid {pid}) did not answer within {timeout:.0f} s",
                    log_tail=tail,
                )
            )
            continue
        outcomes.append(
            Outcome(
                node.name,
                "up",
                f"restarted: agent {state.version or '?'} up (pid {pid})",
                version=state.version,
                address=state.endpoint,
                memory_total=state.memory_total,
                pid=pid,
                seconds=time.monotonic() - started,
            )
        )
    return outcomes


async def _restart_ssh(ctl: Controller, node: NodeSpec) -> Outcome:
    try:
        return await restart_agent(ctl.home, ctl.inventory, node)
    except SshError as exc:
        return Outcome(node.name, "failed", exc.message, exc.hint)


async def restart_nodes(
    ctl: Controller, names: Sequence[str], timeout: float = UP_TIMEOUT_S
) -> Restarted:
    """Restart the agents of `names` and load again the shards they held, so their
    placements stay whole; what cannot be reloaded is named in the result."""
    nodes = [ctl.spec(n) for n in names]
    # What `down` took off these nodes comes back with them.
    kept = [k for k in ctl.kept_shards() if k.node in names]
    saved, dropped = await ctl.shards_on(list(names), kept)

    local = [n for n in nodes if n.is_local]
    local_outcomes, ssh_outcomes = await asyncio.gather(
        restart_local_agents(ctl, local, timeout),
        asyncio.gather(*(_restart_ssh(ctl, n) for n in nodes if not n.is_local)),
    )
    by_name = {o.node: o for o in [*local_outcomes, *ssh_outcomes]}
    outcomes = tuple(by_name[n] for n in names)
    back = {o.node for o in outcomes if o.ok}

    # A tensor group's members on nodes not restarted are relaunched with it (saved too).
    lost = sorted({s.placement for s in saved if s.node in names and s.node not in back})
    again = [
        s for s in saved if (s.node in back or s.node not in names) and s.placement not in lost
    ]
    reloads: list[ReloadResult] = []
    if again or kept:
        ctl.keep_shards([], forget=sorted(back))
        await ctl.refresh()
        reloads = await ctl.reload_shards(again)
    named = set(lost) | {r.placement for r in reloads if not r.ok}
    await ctl.refresh()
    broken = [p for p in ctl.state.placements if p.name not in named and _not_whole(p, names)]
    return Restarted(
        dropped=tuple(dropped),
        outcomes=outcomes,
        lost=tuple(
            f"placement {name!r} is broken: a node holding it did not come back; "
            "unload it and place it again"
            for name in lost
        ),
        reloads=tuple(reloads),
        broken=tuple(
            f"placement {p.name!r} is {p.state} after the restart: unload it and place it "
            "again (studiotui unload, then studiotui place; R in the dashboard)"
            for p in broken
        ),
    )


def _not_whole(placement: PlacementState, restarted: Sequence[str]) -> bool:
    """A placement on the restarted nodes that is not ready, or one missing shards."""
    if placement.state == "ready":
        return False
    # Planned on them (a placement whose every shard is gone reports none: its ring is
    # the plan's), or missing a shard anywhere (a tensor group's every member counts).
    on_them = bool(set(restarted) & {s.node for s in placement.ring})
    missing = len(placement.shards) != placement.expected
    return on_them or missing
