"""`place`, `fetch`, `unload` and `cache`: a model onto nodes and off them."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from studiotui.cli import exits
from studiotui.cli.args import inventory_of, nodes_of
from studiotui.cli.nodes_cmd import start_hint
from studiotui.cli.output import console, errors, hashing_shown, node_bars
from studiotui.cluster import jobs, model_fetch
from studiotui.cluster import peers as agents
from studiotui.cluster.adapter_fetch import fetch_adapter
from studiotui.cluster.controller import (
    Controller,
    GenerationError,
    PlacementError,
    PlacementRefused,
)
from studiotui.cluster.model_sync import SyncRefused
from studiotui.cluster.session import open_controller
from studiotui.core.adapter_catalog import (
    AdapterRefused,
    adapter_placement_name,
    adapter_tensor,
    check_adapter,
    resolve_adapter,
)
from studiotui.core.catalog import scan_home
from studiotui.core.errors import UserError
from studiotui.core.forecast import describe, forecast, links_from_state
from studiotui.core.inventory import (
    Inventory,
)
from studiotui.core.model_facts import ModelDirError, ModelInfo, read_model
from studiotui.core.placement import (
    ModelFacts,
    Plan,
    Refusal,
    context_beyond,
    format_bytes,
    tensor_refusal,
    tensor_sizes,
)
from studiotui.core.state import (
    model_label,
    node_start_hint,
)
from studiotui.views.plan import render_plan
from worker.shared.adapters import Adapter


def resolve_model(spec: Path, home: Path) -> Path:
    """A model directory, or the catalog's model of that name (models folders, HF cache)."""
    if spec.expanduser().exists():
        return spec.expanduser()
    catalog = scan_home(home)
    named = [m.path for m in catalog.models if m.name == str(spec) or m.path.name == str(spec)]
    if len(named) == 1:
        return named[0]
    known = ", ".join(sorted(m.name for m in catalog.models)) or "none"
    if named:
        raise UserError(f"several models are named {spec}: give its directory")
    raise UserError(
        f"model directory {spec} does not exist and no model has that name (models found: {known})"
    )


async def adapter_here(spec: str | Path, home: Path, inv: Inventory) -> Path:
    """`resolve_adapter`, and when `spec` names a job whose adapter is not on the
    operator yet, that adapter fetched from the job's node first."""
    try:
        return resolve_adapter(spec, home)
    except AdapterRefused:
        record = jobs.load_record(home, str(spec))
        if record is None or Path(spec).expanduser().exists():
            raise
    console.print(f"adapter {spec} is job {spec}'s, not here yet: fetching it from its node")
    async with open_controller(inv, home) as ctl:
        await fetch_adapter(ctl, record)
        for line in ctl.state.log[-1:]:
            console.print(line.text)
    return resolve_adapter(spec, home)


def check_adapter_shown(adapter_dir: Path, model_dir: Path, info: ModelInfo) -> Adapter:
    """`check_adapter`, the base's hashing shown (see hashing_shown)."""
    with hashing_shown(model_dir, "to check the adapter's base") as shown:
        return check_adapter(adapter_dir, model_dir, info, shown)


async def cmd_place(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    args.model_dir = resolve_model(args.model_dir, home)
    try:
        info = read_model(args.model_dir)
    except ModelDirError as exc:
        raise UserError(str(exc)) from None
    if info.unsupported:
        # Before asking any node anything: a model no shard can run is refused outright.
        console.print(
            render_plan(Refusal(f"{info.name} cannot run on a shard: {info.unsupported}", "model"))
        )
        return exits.REFUSED["model"]
    if info.note:
        console.print(f"[yellow]note:[/] {info.name} is {info.note}")
    adapter = None
    if args.adapter:
        # Before asking any node anything too: another model's or a malformed adapter.
        args.adapter = await adapter_here(args.adapter, home, inv)
        adapter = check_adapter_shown(args.adapter, args.model_dir.expanduser().resolve(), info)
        console.print(
            f"adapter [bold]{adapter.name}[/] ({adapter.fine_tune_type}, rank {adapter.rank}, "
            f"layers {adapter.layers[0]}-{adapter.layers[-1]}) matches {info.name}"
        )
    # An adapter is applied by pipeline stages, each to whole layers: no tensor groups.
    tensor = adapter_tensor(args.tensor) if adapter else args.tensor
    nodes = nodes_of(args, inv)
    async with open_controller(inv, home) as ctl:
        group = nodes or [n.name for n in ctl.state.nodes if n.state == "up"]
        if not group:
            raise UserError(
                f"no node is up: start the cluster with {start_hint(inv)}, then place again"
            )
        name = args.name or (
            adapter_placement_name(args.model_dir.expanduser().resolve(), args.adapter)
            if adapter
            # A hub snapshot is named by its repo (`org/qwen3` → qwen3), not its commit.
            else model_label(str(args.model_dir.expanduser().resolve())).rsplit("/", 1)[-1]
        )
        if (existing := ctl.state.placement(name)) is not None:
            # Before the plan and progress bars: nothing would be loaded.
            raise UserError(
                f"a placement named {name!r} exists ({existing.state}): unload it first "
                f"(studiotui unload {name}) or pick another --name"
            )
        if args.tensor is not None and (why := tensor_refusal(info.facts, args.tensor, len(group))):
            # Before the plan and before any node is asked to load anything.
            raise UserError(f"--tensor {args.tensor}: {why}")
        draft_arg = getattr(args, "draft", None) or ""
        draft = "lookup" if draft_arg == "lookup" else ("model" if draft_arg else "")
        guesser = Path(draft_arg).expanduser().resolve() if draft == "model" else None
        draft_tokens = getattr(args, "draft_tokens", 0) or 0
        try:
            info, the_plan = ctl.preview(
                args.model_dir.expanduser(),
                group,
                args.context,
                args.streams,
                tensor,
                adapter,
                **place_options(args),
                draft=draft,
                draft_dir=guesser,
                draft_tokens=draft_tokens,
            )
        except ModelDirError as exc:
            raise UserError(str(exc)) from None
        console.print(render_plan(the_plan))
        if isinstance(the_plan, Refusal):
            return exits.refused(the_plan)
        if beyond := context_beyond(info.facts, the_plan.context_tokens):
            errors.print(f"[yellow]note:[/] {beyond}", highlight=False)
        if isinstance(the_plan, Plan) and args.dry_run:
            most = ctl.context_offer(
                args.model_dir.expanduser(),
                [n for s in the_plan.shards for n in s.nodes],
                the_plan.streams,
                the_plan.tensor,
                args.kv_bits,
                args.kv_group_size,
            )
            kv = f"{args.kv_bits}-bit" if args.kv_bits else "full-precision"
            console.print(
                f"these nodes hold up to {most} tokens of context × {the_plan.streams} "
                f"stream{'s' if the_plan.streams != 1 else ''} with {kv} KV (--context)"
            )
        if isinstance(the_plan, Plan):
            print_shapes(ctl, info.facts, the_plan, group, args)
        if args.dry_run:
            return 0
        with node_bars() as bar:
            # One bar per process: every node of a tensor group loads (and reports) its own.
            tasks = {n: bar.add_task(n, total=None) for s in the_plan.shards for n in s.nodes}

            def progress(node: str, done: int, total: int) -> None:
                task = bar.tasks[tasks[node]]
                if task.total != total or done < task.completed:
                    # A new phase (files copied, then the shard loaded): a new clock.
                    bar.reset(tasks[node], total=total)
                bar.update(tasks[node], completed=done, total=total)

            def hashed(done: int, total: int) -> None:
                # From the copy's hashing thread (rich's bar takes its own lock): the
                # model's first hashing, before its files go to a remote node.
                if "" not in tasks:
                    label = f"hashing {info.name} for the copy (once: cached)"
                    tasks[""] = bar.add_task(label, total=total)
                bar.update(tasks[""], completed=done, total=total)

            try:
                result = await ctl.place(
                    args.model_dir,
                    group,
                    name,
                    progress,
                    prefill_chunk=args.prefill_chunk,
                    context_tokens=args.context,
                    streams=args.streams,
                    tensor=tensor,
                    adapter_dir=args.adapter,
                    hashing=hashed,
                    **place_options(args),
                    draft_dir=str(guesser) if guesser else "",
                    draft=draft,
                    draft_tokens=draft_tokens,
                )
            except PlacementRefused as exc:
                # Made again at placing (another placement's promise, a changed cluster):
                # the same status as the preview's refusal of that kind.
                raise exits.RefusedError(str(exc), exc.refusal) from None
            except (PlacementError, ModelDirError) as exc:
                raise UserError(str(exc)) from None
            except asyncio.CancelledError:  # Ctrl-C: ctl.place has unloaded what it loaded
                errors.print(f"interrupted: placement {name} rolled back, nothing left loaded")
                raise
        console.print(
            f"placement [bold]{result.placement.name}[/] is ready ({result.placement.label})"
        )
    return 0


GIB = 1024**3  # "GB" as the previews show sizes (core/placement.format_bytes)


def place_options(args: argparse.Namespace) -> dict[str, Any]:
    """What `place` asks of the KV cache and the prompt cache (GB said in bytes)."""
    return {
        "kv_bits": args.kv_bits,
        "kv_group_size": args.kv_group_size,
        **{
            key: None if gb is None else int(gb * GIB)
            for key, gb in (
                ("prompt_cache", args.prompt_cache),
                ("prompt_cache_disk", args.prompt_cache_disk),
            )
        },
    }


def print_shapes(
    ctl: Controller, facts: ModelFacts, the_plan: Plan, group: list[str], args: argparse.Namespace
) -> None:
    """The forecast of the plan shown, then of every other shape that divides (what
    `--tensor N` would take), as the preview lists them."""
    chips = ctl.node_chips(group)
    links = links_from_state(ctl.state)
    draft_arg = getattr(args, "draft", None) or ""
    draft = "lookup" if draft_arg == "lookup" else ("model" if draft_arg else "")
    guess = forecast(
        facts,
        the_plan,
        chips,
        links,
        streams=the_plan.streams,
        draft=draft,
        draft_tokens=getattr(args, "draft_tokens", 0) or 0,
    )
    # Saved as `status` names the model (a hub snapshot: org/name, not its commit).
    model = model_label(str(args.model_dir.expanduser().resolve()))
    last = ctl.last_measured(model, the_plan.shape)
    console.print(f"forecast ({the_plan.shape}): {describe(guess, last)}")
    if args.adapter:
        return  # an adapter is applied by pipeline stages only (adapter_tensor): one shape
    for size in tensor_sizes(facts, len(group)):
        if size == the_plan.tensor:
            continue
        _, other = ctl.preview(
            args.model_dir.expanduser(),
            group,
            args.context,
            the_plan.streams,
            size,
            **place_options(args),
        )
        if isinstance(other, Plan):
            said = describe(
                forecast(facts, other, chips, links, streams=other.streams),
                ctl.last_measured(model, other.shape),
            )
            console.print(f"  --tensor {size}, {other.shape}: {said}")
        else:
            console.print(f"  --tensor {size}: does not fit: {other.reason}")


async def cmd_fetch(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    source = Path(args.source).expanduser()
    if not source.is_dir() and not model_fetch.is_repo_id(args.source):
        # A model's name in the catalog, as `place` and `finetune` take it.
        try:
            source = resolve_model(Path(args.source), home)
        except UserError as exc:
            raise UserError(
                f"{args.source!r} is not a Hugging Face repo id (org/name), and {exc.message}"
            ) from None
    nodes = nodes_of(args, inv)
    async with open_controller(inv, home) as ctl:
        group = nodes or [n.name for n in ctl.state.nodes if n.state == "up"]
        down = [n for n in group if (s := ctl.state.node(n)) is None or s.state != "up"]
        if down or not group:
            if not group:
                raise UserError(f"no node is up: start the cluster with {start_hint(inv)}")
            raise UserError(
                f"{', '.join(down)} {'is' if len(down) == 1 else 'are'} not up",
                "; ".join(node_start_hint(n) for n in down),
            )
        with node_bars() as bar:
            tasks = {n: bar.add_task(n, total=None) for n in group}

            def progress(node: str, done: int, total: int) -> None:
                bar.update(tasks[node], completed=done, total=total)

            try:
                if source.is_dir():
                    where = await model_fetch.fetch_dir(ctl, source.resolve(), group, progress)
                else:
                    where = await model_fetch.fetch_repo(
                        ctl, args.source, group, args.revision, progress, args.cache_dir
                    )
            except (model_fetch.FetchError, SyncRefused, ModelDirError) as exc:
                raise UserError(str(exc)) from None
            except (agents.AgentError, agents.AgentUnreachable) as exc:
                raise UserError(f"fetch failed: {exc}") from None
        for entry in ctl.state.log:
            if entry.topic == "files":
                console.print(entry.text)
        for node, path in where.items():
            console.print(f"{node}: {path}")
    return 0


async def cmd_unload(args: argparse.Namespace, home: Path) -> int:
    inv = inventory_of(args, home)
    async with open_controller(inv, home, ask=None) as ctl:
        try:
            await ctl.unload(args.name)
        except PlacementError as exc:
            raise UserError(str(exc)) from None
    console.print(f"placement {args.name} unloaded")
    return 0


async def cmd_cache(args: argparse.Namespace, home: Path) -> int:
    """`studiotui cache clear [PLACEMENT]`: empty a placement's prefix cache (every
    placement's when none is named)."""
    inv = inventory_of(args, home)
    async with open_controller(inv, home) as ctl:
        names = [args.placement] if args.placement else [p.name for p in ctl.state.placements]
        if not names:
            raise UserError("no placement to clear: place a model first (studiotui place)")
        for name in names:
            try:
                entries, size = await ctl.clear_cache(name)
            except (PlacementError, GenerationError) as exc:
                raise UserError(str(exc)) from None
            console.print(
                f"placement {name}: prompt cache cleared ({entries} entries, "
                f"{format_bytes(size)} on the head)"
            )
    return 0
