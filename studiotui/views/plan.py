"""A placement plan drawn: the preview's table (one row per shard, in ring order) with
the ring and its slowest link below, or the refusal in words. Printed by `place
--dry-run` and shown by the dashboard's preview."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from studiotui.core.placement import Link, Plan, Refusal, ShardPlan, format_bytes


def layer_label(shard: ShardPlan, index: int, count: int) -> str:
    span = f"{shard.start}" if shard.end - shard.start == 1 else f"{shard.start}–{shard.end - 1}"
    extras = [
        label for label, held in (("embed", index == 0), ("head", index == count - 1)) if held
    ]
    suffix = f" +{'+'.join(extras)}" if extras else ""
    return f"{span} ({shard.end - shard.start}){suffix}"


def describe_link(link: Link) -> str:
    facts = [link.kind]
    if link.latency_us is not None:
        facts.append(f"{link.latency_us:.0f} µs")
    if link.gbps is not None:
        facts.append(f"{link.gbps:.1f} Gb/s")
    return f"{link.a} ↔ {link.b} ({', '.join(facts)})"


def ring_line(p: Plan) -> str:
    names = ["+".join(s.nodes) for s in p.shards]
    if len(names) == 1:
        alone = "alone, no links" if len(p.shards[0].nodes) == 1 else "as one tensor group"
        return f"ring: {names[0]} {alone} · total {format_bytes(p.total_bytes)}"
    ring = " → ".join([*names, names[0]])
    slowest = describe_link(p.slowest_link) if p.slowest_link else "none"
    return f"ring: {ring} · slowest link: {slowest} · total {format_bytes(p.total_bytes)}"


def streams_words(n: int) -> str:
    return f"{n} stream{'s' if n != 1 else ''} at once"


def render_plan(p: Plan | Refusal) -> Table | Text:
    """The placement preview: one row per shard in ring order, ring and slowest link below."""
    if isinstance(p, Refusal):
        return Text.assemble(("cannot place: ", "bold red"), p.reason)
    backends = [
        f"{s.backend} for {', '.join(s.group)}: {s.backend_reason}" for s in p.shards if s.group
    ]
    table = Table(
        title=f"{p.model} · {p.shape} · {p.context_tokens} tokens of context × "
        f"{streams_words(p.streams)}{kv_label(p)}",
        caption="\n".join([ring_line(p), *backends, *p.notes]),
        caption_justify="left",
        collapse_padding=True,  # a cell more for the figures at each column at 80 columns
    )
    # A placement with an adapter shows each shard's share of it beside its weights.
    adapter = any(s.adapter_bytes for s in p.shards)
    cache = any(s.prompt_cache_bytes or s.prompt_cache_disk_bytes for s in p.shards)
    draft = any(s.draft_bytes for s in p.shards)
    columns = (
        "layers",
        "weights",
        *(("adapter",) if adapter else ()),
        *(("draft",) if draft else ()),
        "KV cache",
        *(("prompt cache", "on disk") if cache else ()),
    )
    rows = [
        (
            " + ".join(s.nodes),
            layer_label(s, i, len(p.shards)),
            format_bytes(s.weight_bytes),
            *((format_bytes(s.adapter_bytes),) if adapter else ()),
            *((format_bytes(s.draft_bytes),) if draft else ()),
            format_bytes(s.kv_bytes),
            *(
                (format_bytes(s.prompt_cache_bytes), format_bytes(s.prompt_cache_disk_bytes))
                if cache
                else ()
            ),
            format_bytes(s.free_before),
            format_bytes(s.free_after),
        )
        for i, s in enumerate(p.shards)
    ]
    # A figure or a node's name never breaks (at 80 columns "245.0 GB" came out on two
    # lines and names were cut to "studio…"): the headers and the layers wrap instead.
    for k, column in enumerate(("node", *columns, "free before", "free after")):
        whole = k != 1 and (k == 0 or column != "layers")
        table.add_column(
            column,
            justify="left" if k == 0 else "right",
            overflow="fold",  # never "studio…" for each of four studios
            min_width=max(len(r[k]) for r in rows) if whole and rows else None,
        )
    for row in rows:
        table.add_row(*row)
    return table


def kv_label(p: Plan) -> str:
    """ " · KV 8-bit (groups of 64)" for quantized KV, "" at full precision."""
    return f" · KV {p.kv_bits}-bit (groups of {p.kv_group_size})" if p.kv_bits else ""
