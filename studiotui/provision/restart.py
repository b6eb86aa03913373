"""Restarting nodes with the shards they hold: the one sequence behind `studiotui
restart`, the dashboard's `r` and `studiotui provision --upgrade`.

An agent's shards stop with it, so a restart that only restarted agents would break
every placement on them. `keep_placements` saves what the nodes hold (and what `down`
kept for them), runs what restarts or replaces their agents (`restart_nodes`: local
ones here, SSH ones over SSH; the CLI's upgrade: `provision`), loads the shards that
are gone again on the same layers and ports (a tensor group relaunched whole), and
says what it could not keep whole. It prints nothing: it returns a `Restarted` for
the CLI to print and the dashboard to log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence, Set
from dataclasses import dataclass

from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller, ReloadResult, SavedShard
from studiotui.cluster.peers import AgentError, AgentUnreachable
from studiotui.cluster.session import wait_until_up
from studiotui.core.inventory import NodeSpec
from studiotui.core.state import PlacementState
from studiotui.provision.deploy import Outcome, restart_agent
from studiotui.ssh.client import SshError
from worker.shared.protocol import control

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
    ctl: Controller, nodes: Sequence[NodeSpec], timeout: float = UP_TIMEOUT_S, stop: bool = True
) -> list[Outcome]:
    """Stop and start local agents (by pid file), then wait for them to answer: an
    outcome per node, with the new agent's pid, or its last output if it did not come.
    With `stop` False (`up`) a running agent is left as it is."""
    started = time.monotonic()
    if stop:
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
                f"{'restarted' if stop else 'started'}: agent {state.version or '?'} up "
                f"(pid {pid})",
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


Bounce = Callable[[], Awaitable[Sequence[Outcome]]]
# Called with a placement's name and where its shards go, before they are loaded again.
OnReload = Callable[[str, str], None]


async def restart_nodes(
    ctl: Controller,
    names: Sequence[str],
    timeout: float = UP_TIMEOUT_S,
    on_reload: OnReload | None = None,
    on_back: Callable[[Sequence[Outcome]], None] | None = None,
) -> Restarted:
    """Restart the agents of `names` and load again the shards they held, so their
    placements stay whole; what cannot be reloaded is named in the result."""
    nodes = [ctl.spec(n) for n in names]

    async def bounce() -> list[Outcome]:
        local = [n for n in nodes if n.is_local]
        local_outcomes, ssh_outcomes = await asyncio.gather(
            restart_local_agents(ctl, local, timeout),
            asyncio.gather(*(_restart_ssh(ctl, n) for n in nodes if not n.is_local)),
        )
        return [*local_outcomes, *ssh_outcomes]

    return await keep_placements(ctl, names, bounce, on_reload, on_back=on_back)


def has_kept(ctl: Controller, names: Sequence[str]) -> bool:
    """Whether `down` kept shards for any of `names`: provisioning them loads those again
    (`keep_placements`), as a restart does."""
    return any(k.node in names for k in ctl.kept_shards())


async def keep_placements(
    ctl: Controller,
    names: Sequence[str],
    bounce: Bounce,
    on_reload: OnReload | None = None,
    doing: str = "restart",
    on_back: Callable[[Sequence[Outcome]], None] | None = None,
) -> Restarted:
    """Run `bounce` (whatever restarts or replaces the agents of `names`: `restart`,
    `provision --upgrade`), then load again the shards it took away, on the same layers
    and ports, so the placements on `names` stay whole; what cannot be is named.

    Only shards gone afterwards are loaded again (with the rest of their tensor group):
    an upgrade that left a node's agent alone (same version, or refused before
    stopping it) left its shards running."""
    # What `down` took off these nodes comes back with them.
    kept = [k for k in ctl.kept_shards() if k.node in names]
    saved, dropped = await ctl.shards_on(list(names), kept)
    by_name = {o.node: o for o in await bounce()}
    outcomes = tuple(by_name[n] for n in names)
    back = {o.node for o in outcomes if o.ok}
    if on_back is not None:
        on_back(outcomes)  # said before the reloads begin: they take a while

    held = await _held(ctl, sorted({s.node for s in saved}))
    # A tensor group's members elsewhere are relaunched with it where their agents are up.
    await ctl.refresh()
    up = back | {n.name for n in ctl.state.nodes if n.name not in names and n.state == "up"}
    again, lost = to_reload(saved, held, up)
    reloads: list[ReloadResult] = []
    if again or kept:
        ctl.keep_shards([], forget=sorted(back))
        await ctl.refresh()
        for placement, shards in _by_placement(again).items():
            if on_reload is not None:
                on_reload(
                    placement,
                    ", ".join(
                        f"{s.node} (layers {s.report.start}-{s.report.end - 1})" for s in shards
                    ),
                )
            reloads.extend(await ctl.reload_shards(shards))
    named = set(lost) | {r.placement for r in reloads if not r.ok}
    await ctl.refresh()
    broken = [p for p in ctl.state.placements if p.name not in named and _not_whole(p, names)]
    return Restarted(
        dropped=tuple(dropped),
        outcomes=outcomes,
        lost=tuple(
            f"placement {name!r} is broken: {_why_lost(nodes, by_name)}; unload it and "
            "place it again"
            for name, nodes in sorted(lost.items())
        ),
        reloads=tuple(reloads),
        broken=tuple(
            f"placement {p.name!r} is {p.state} after the {doing}: unload it and place it "
            "again (studiotui unload, then studiotui place; R in the dashboard)"
            for p in broken
        ),
    )


def to_reload(
    saved: Sequence[SavedShard], held: Set[tuple[str, str]], back: Set[str]
) -> tuple[list[SavedShard], dict[str, list[str]]]:
    """Which saved shards to load again, given the (node, placement) shards `held` now
    and the nodes `back` up: those gone whose node is back, with every member of a
    tensor group one of them was in (a group is relaunched whole). A placement with a
    shard gone on a node not back is lost (returned with those nodes): not reloaded."""
    gone = [s for s in saved if (s.node, s.placement) not in held]
    lost: dict[str, list[str]] = {}
    for s in gone:
        if s.node not in back:
            lost.setdefault(s.placement, []).append(s.node)
    regroup = {(s.placement, s.report.index) for s in gone if s.report.group}
    again = [
        s
        for s in saved
        if s.placement not in lost
        and ((s.node, s.placement) not in held or (s.placement, s.report.index) in regroup)
    ]
    return again, lost


async def _held(ctl: Controller, nodes: Sequence[str]) -> set[tuple[str, str]]:
    """The (node, placement) shards the agents of `nodes` run now, asked of each agent:
    not the controller's state, where a late telemetry message from a runner that
    died with its agent could still show the shard."""

    async def one(node: str) -> set[tuple[str, str]]:
        try:
            reply = await ctl.peer(node).ask("list_shards", control.Shards, timeout=5.0)
        except (AgentError, AgentUnreachable):
            return set()  # no agent answering: it runs nothing
        return {(node, r.placement) for r in reply.shards}

    return set().union(*await asyncio.gather(*(one(n) for n in nodes)))


def _by_placement(shards: Sequence[SavedShard]) -> dict[str, list[SavedShard]]:
    out: dict[str, list[SavedShard]] = {}
    for s in shards:
        out.setdefault(s.placement, []).append(s)
    return out


def _why_lost(nodes: Sequence[str], outcomes: Mapping[str, Outcome]) -> str:
    """Which node holding it did not come back, and what it said."""
    parts = []
    for node in sorted(set(nodes)):
        outcome = outcomes.get(node)
        said = outcome.message.splitlines()[0].rstrip(":") if outcome and outcome.message else ""
        parts.append(
            f"{node}, which held a shard of it, did not come back"
            + (f" ({said})" if said else " (it is down)")
        )
    return "; ".join(parts)


def _not_whole(placement: PlacementState, restarted: Sequence[str]) -> bool:
    """A placement on the restarted nodes that is not ready, or one missing shards."""
    if placement.state == "ready":
        return False
    # Planned on them (a placement whose every shard is gone reports none: its ring is
    # the plan's), or missing a shard anywhere (a tensor group's every member counts).
    on_them = bool(set(restarted) & {s.node for s in placement.ring})
    missing = len(placement.shards) != placement.expected
    return on_them or missing
