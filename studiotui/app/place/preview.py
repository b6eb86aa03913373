"""The placement preview: what would load where, before anything loads.

The screen asks the controller for a preview (model facts + the planner's plan or
refusal, computed from the memory the nodes report right now) and shows per node
its layer range, memory before and after, whether it fits, the ring order and its
slowest link, or the planner's reason in words. Enter deploys; the same screen then
shows each node's loading progress, closes itself when the placement is ready and
keeps the controller's message on screen when loading fails (it was rolled back).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.geometry import Region
from textual.screen import ModalScreen

from studiotui.app.guard import guard_actions
from studiotui.app.panes.placements import HASHING_SAID, OPERATOR, progress_lines
from studiotui.app.render import Drawing, bar, short_count, state_style, usage_style
from studiotui.core.forecast import (
    UNMEASURED,
    Forecast,
    LastMeasured,
    chips_from_state,
    describe,
    forecast,
    links_from_state,
)
from studiotui.core.model_facts import ModelInfo
from studiotui.core.placement import (
    Plan,
    Refusal,
    context_beyond,
    format_bytes,
    plan_to_dict,
    tensor_sizes,
)
from studiotui.core.rates import Paced, Rates
from studiotui.core.state import ClusterState, model_label, shape_label
from studiotui.views.plan import render_plan
from worker.shared.adapters import Adapter
from worker.shared.manifest import Hashing


class Previewing(Protocol):
    """What the screen needs of the controller: its state and its preview."""

    @property
    def state(self) -> ClusterState: ...

    def preview(
        self,
        model_dir: Path,
        nodes: list[str],
        context_tokens: int = ...,
        streams: int | None = ...,
        tensor: int | None = ...,
        adapter: Adapter | None = ...,
        kv_bits: int = ...,
        kv_group_size: int | None = ...,
    ) -> tuple[ModelInfo, Plan | Refusal]: ...

    def check_adapter(
        self, adapter_dir: Path, model_dir: Path, on_progress: Hashing | None = ...
    ) -> Adapter: ...


MIN_CONTEXT = 256
MAX_CONTEXT = 1 << 20
MAX_STREAMS = 256
# What `k` cycles through: full-precision KV, then mlx-lm's QuantizedKVCache at 8 and 4.
KV_CHOICES = (0, 8, 4)


@dataclass(frozen=True)
class PlaceRequest:
    """A model, the nodes picked for it and how they were picked."""

    model: Path
    model_name: str
    nodes: tuple[str, ...]
    target: str  # "node local-1", "group left", "marked nodes", "all up nodes"
    name: str  # the placement's name
    context_tokens: int = 4096
    adapter: Path | None = None  # an mlx-lm adapter the shards apply (checked first)


Deploy = Callable[["PreviewScreen"], None]


# --------------------------------------------------------------------------- drawing


def _adapter_line(adapter: Adapter) -> Content:
    base = adapter.base.model if adapter.base else "?"
    span = f"{adapter.layers[0]}–{adapter.layers[-1]}" if adapter.layers else "none"
    return Content.assemble(
        ("adapter ", "$text-muted"),
        (adapter.name, "bold"),
        (f"  {adapter.fine_tune_type} rank {adapter.rank}, layers {span}", "$text-muted"),
        ("  ✓ trained on this model", "$success"),
        (f" ({base})", "$text-muted"),
    )


def _table(rows: Sequence[Sequence[Content]], right: set[int]) -> list[Content]:
    """Cells padded into columns; `right` holds the columns aligned right."""
    widths = [max(row[i].cell_length for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.right(widths[i]) if i in right else cell.pad_right(widths[i] - cell.cell_length)
            for i, cell in enumerate(row)
        ]
        lines.append(Content("  ").join(cells).rstrip())
    return lines


def _model_line(info: ModelInfo) -> Content:
    quant = info.quantization or info.dtype.lower()
    facts = [
        info.family,
        f"{short_count(info.params)} params",
        f"{info.n_layers} layers",
        quant,
        f"{format_bytes(info.disk_bytes)} on disk",
    ]
    # Said before any byte moves: the shards' own table of families and quantizations.
    support = (
        ("  ✗ not supported", "bold $error") if info.unsupported else ("  ✓ supported", "$success")
    )
    return Content.assemble((info.name, "bold"), ("  " + " · ".join(facts), "$text-muted"), support)


def _holds(state: ClusterState, node: str, skip: str) -> str:
    held = state.node(node)
    if held is None:
        return ""
    names = sorted({s.placement for s in held.shards if s.placement != skip})
    return ", ".join(names)


def _memory_cell(used: int, total: int, width: int) -> Content:
    frac = used / total if total else 0.0
    figures = Content.styled(f"{format_bytes(used):>8}", usage_style(frac))
    return Content.assemble(bar(frac, width), " ", figures) if width else figures


# Richest first: the first layout that fits the dialog's width is drawn, so a narrow
# terminal loses the gauges and the "holds" column rather than getting wrapped rows.
# (gauge cells, "holds" column, weights and KV columns)
_LAYOUTS = (
    (10, True, True),
    (10, False, True),
    (5, False, True),
    (0, False, True),
    (0, False, False),
)


def _fitting(build: Callable[[int, bool, bool], list[Content]], width: int) -> list[Content]:
    lines: list[Content] = []
    for gauge, holds, sizes in _LAYOUTS:
        lines = build(gauge, holds, sizes)
        if max(line.cell_length for line in lines) <= width:
            break
    return lines


def plan_lines(
    the_plan: Plan, state: ClusterState, placement: str, width: int = 200
) -> list[Content]:
    """One row per node in ring order (each node of a tensor group): layers, sizes,
    memory now and after, fits."""
    data = plan_to_dict(the_plan)
    count = len(data["shards"])
    any_held = any(
        _holds(state, n, placement) for s in data["shards"] for n in s["group"] or [s["node"]]
    )
    # With an adapter, each shard's share of it is shown beside (and counted with) its weights.
    adapted = any(s["adapter_bytes"] for s in data["shards"])
    weights = "weights+adapter" if adapted else "weights"

    def weight_cell(shard: dict[str, Any]) -> Content:
        if not adapted:
            return Content(format_bytes(shard["weight_bytes"]))
        extra = f" +{format_bytes(shard['adapter_bytes'])}"
        return Content.assemble(format_bytes(shard["weight_bytes"]), (extra, "$accent"))

    def build(gauge: int, holds: bool, sizes: bool) -> list[Content]:
        titles = ["node", "layers", weights, "KV+prompt cache", "memory now", "after loading", ""]
        if not sizes:
            titles[2:4] = []
        if holds and any_held:
            titles.append("holds")
        rows = [[Content.styled(h, "bold $text-muted") for h in titles]]
        members = [
            (
                i,
                shard,
                name,
                free
                - shard["weight_bytes"]
                - shard["adapter_bytes"]
                - shard["kv_bytes"]
                - shard["prompt_cache_bytes"],
            )
            for i, shard in enumerate(data["shards"])
            for name, free in zip(
                shard["group"] or [shard["node"]],
                shard["group_free"] or [shard["free_before"]],
                strict=True,
            )
        ]
        for i, shard, name, free_after in members:
            node = state.node(name)
            total = node.memory_total if node else 0
            span = f"{shard['start']}–{shard['end'] - 1}"
            ends = [x for x, held in (("embed", i == 0), ("head", i == count - 1)) if held]
            # A tensor group's nodes each hold a slice of the same layers: "÷2".
            part = f" ÷{len(shard['group'])}" if shard["group"] else ""
            row = [
                Content.styled(name, "bold"),
                Content.assemble(
                    f"{span} ({shard['end'] - shard['start']}){part}",
                    (f" +{'+'.join(ends)}" if ends else "", "$text-muted"),
                ),
                weight_cell(shard),
                # The prompt cache's budget beside the KV (both grow as requests come).
                Content.assemble(
                    format_bytes(shard["kv_bytes"]),
                    (f" +{format_bytes(shard['prompt_cache_bytes'])}", "$accent"),
                ),
                # What the node reports in use, the figure its card shows; the plan's
                # "free before" also holds back what loading shards and a runner take.
                _memory_cell(node.memory_used if node else 0, total, gauge),
                _memory_cell(total - free_after, total, gauge),
                Content.styled("✓ fits", "$success")
                if free_after >= 0
                else Content.styled("✗ short", "$error"),
            ]
            if not sizes:
                row[2:4] = []
            if len(titles) > len(row):
                row.append(Content.styled(_holds(state, name, placement), "$text-muted"))
            rows.append(row)
        return _table(rows, right={2, 3} if sizes else set())

    lines = _fitting(build, width)
    # The planner's own words for the ring and its slowest link, as `studiotui place`.
    caption = render_plan(the_plan).caption  # type: ignore[union-attr]
    return [*lines, Content(""), Content.styled(str(caption), "$text-muted")]


def shape_lines(
    shapes: Sequence[tuple[int, Plan | Refusal, Forecast | None]],
    shown: Plan | None,
    node_count: int,
    width: int = 200,
    measured: Mapping[str, LastMeasured] | None = None,
) -> list[Content]:
    """Each shape that divides, with its forecast or why it does not fit; the one on
    screen marked (its groups' backends and why are in the plan's caption above).

    A forecast too long for `width` folds between its figures, under the forecast
    column, rather than wherever the terminal breaks it."""
    # Said once for every shape: whether a benchmark measured these nodes.
    guessed = [guess for _, _, guess in shapes if guess is not None]
    lines = [Content(""), Content.styled("shapes (t cycles)  ·  forecast", "bold $text-muted")]
    if any(not g.measured for g in guessed):
        lines.append(Content.styled(f"  {UNMEASURED}", "$text-muted"))
    labels = [
        verdict.shape
        if isinstance(verdict, Plan) and guess is not None
        else shape_label(max(node_count // size, 1), size)
        for size, verdict, guess in shapes
    ]
    column = max((len(label) for label in labels), default=0) + 2
    indent = " " * (2 + column)
    for (size, verdict, guess), label in zip(shapes, labels, strict=True):
        here = shown is not None and shown.tensor == size
        mark = ("▸ ", "bold $accent") if here else ("  ", "")
        if isinstance(verdict, Plan) and guess is not None:
            head = Content.assemble(mark, (f"{label:<{column}}", "bold" if here else ""))
            last = (measured or {}).get(verdict.shape)
            parts = describe(guess, last, unmeasured=False).split(" · ")
            line = Content.assemble(head, parts[0])
            for part in parts[1:]:
                if line.cell_length + 3 + len(part) > width:
                    lines.append(line)
                    line = Content(indent + part)
                else:
                    line = Content.assemble(line, " · ", part)
            lines.append(line)
        else:
            reason = verdict.reason if isinstance(verdict, Refusal) else ""
            lines.append(
                Content.assemble(
                    mark, f"{label:<{column}}", ("does not fit: " + reason, "$text-muted")
                )
            )
    return lines


def refusal_lines(
    refusal: Refusal, state: ClusterState, nodes: Sequence[str], name: str, width: int = 200
) -> list[Content]:
    """The reason first, then each node's memory now, so the reason can be checked."""

    def build(gauge: int, _with_holds: bool, _with_sizes: bool) -> list[Content]:
        titles = ("node", "state", "memory now", "free", "holds")
        rows = [[Content.styled(h, "bold $text-muted") for h in titles]]
        for node_name in nodes:
            node = state.node(node_name)
            if node is None:
                rows.append(
                    [Content(node_name), Content.styled("unknown", "$error")] + [Content("")] * 3
                )
                continue
            rows.append(
                [
                    Content.styled(node.name, "bold"),
                    Content.styled(node.state, state_style(node.state)),
                    _memory_cell(node.memory_used, node.memory_total, gauge),
                    Content(format_bytes(node.memory_free)),
                    Content.styled(_holds(state, node.name, name), "$text-muted"),
                ]
            )
        return _table(rows, right={3})

    reason = Content.assemble(("✗ cannot place: ", "bold $error"), (refusal.reason, "$error"))
    return [reason, Content(""), *_fitting(build, width)]


def unmeasured(state: ClusterState, nodes: Sequence[str]) -> bool:
    """Some pair of these nodes has no measured link (none saved, or never measured)."""
    return any(
        (link := state.link(a, b)) is None or link.latency_us is None
        for i, a in enumerate(nodes)
        for b in nodes[i + 1 :]
    )


def warnings_for(state: ClusterState, nodes: Sequence[str], name: str) -> list[str]:
    """What the numbers above cannot know yet."""
    out = []
    for placement in state.placements:
        if placement.name == name or placement.state not in ("loading", "prepared"):
            continue
        shared = [n for n in placement.nodes if n in nodes]
        if shared:
            out.append(
                f"{', '.join(shared)} {'is' if len(shared) == 1 else 'are'} loading "
                f"'{placement.name}' now: the memory it will take is not counted yet"
            )
    return out


# --------------------------------------------------------------------------- screen


@guard_actions
class PreviewScreen(ModalScreen[None]):
    CSS_PATH = "preview.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter,y", "deploy", "Deploy", id="preview-deploy"),
        Binding("escape,n,q", "close", "Close", id="preview-close"),
        Binding("plus,equals_sign", "context(2)", "Context ×2", id="preview-context-up"),
        Binding("minus", "context(0.5)", "Context ÷2", id="preview-context-down"),
        Binding("s", "streams(1)", "Streams +1", id="preview-streams-up"),
        Binding("S", "streams(-1)", "Streams -1", id="preview-streams-down"),
        Binding("t", "cycle_shape", "Shape", id="preview-shape"),
        Binding("k", "cycle_kv", "KV bits", id="preview-kv"),
    ]

    def __init__(self, request: PlaceRequest, controller: Previewing, deploy: Deploy) -> None:
        super().__init__(id="preview-screen")
        self.request = request
        self.controller = controller
        self.deploy = deploy
        self.context_tokens = request.context_tokens
        # Requests served at once (KV is reserved for each): None lets the planner take
        # as many as fit, up to DEFAULT_STREAMS; s/S then set it.
        self.streams: int | None = None
        # Nodes per stage asked for with `t`; None lets the planner take the fastest.
        self.tensor: int | None = None
        # Quantized KV asked for with `k` (0: full precision; KV_CHOICES).
        self.kv_bits = 0
        # Every shape that divides: (tensor size, plan or refusal, forecast if it fits).
        self.shapes: list[tuple[int, Plan | Refusal, Forecast | None]] = []
        # What a saved benchmark last measured of this model, by shape.
        self.measured: dict[str, LastMeasured] = {}
        # measuring, planning, plan, refused, error, loading, ready, failed
        self.phase = "planning"
        self.info: ModelInfo | None = None
        self.verdict: Plan | Refusal | None = None
        self.message = ""
        self.loads: dict[str, tuple[int, int]] = {}
        self.rates = Rates()
        self.adapter: Adapter | None = None  # the request's adapter, once it checked out
        # Bytes of the base hashed to check the adapter against it (the first check of a
        # base reads all of it; cached after): (done, total), or None when not hashing.
        self.hashing: tuple[int, int] | None = None
        self._hashing_paced = Paced()
        # Bytes of the model hashed for its copy to a remote node while loading (its
        # first copy reads all of it; cached after), or None: gone once copies start.
        self.copy_hashed: tuple[int, int] | None = None
        # What the body draws above the shapes and how many lines they take (see
        # _lines), and whether the next plan drawn should bring them into view.
        self._shapes_at: tuple[Content, int] | None = None
        self._to_shapes = False

    def compose(self) -> ComposeResult:
        with Vertical(id="preview-dialog") as dialog:
            dialog.border_title = f"Place {self.request.model_name}"
            with VerticalScroll(id="preview-scroll"):
                yield Drawing(
                    lambda _: Content.styled("planning…", "$text-muted"), id="preview-body"
                )

    def on_mount(self) -> None:
        self.replan()

    # ---- planning ---------------------------------------------------------------------

    def replan(self) -> None:
        self.phase = "planning"
        self._draw()
        self.run_worker(self._plan(), exclusive=True, group="preview", exit_on_error=False)

    async def _plan(self) -> None:
        request = self.request
        measure = getattr(self.controller, "measure_links", None)
        if measure is not None and unmeasured(self.controller.state, request.nodes):
            # A plan's slowest link is only worth showing measured: measure first
            # (about a second on loopback), the way `m` does, saved for next time.
            self.phase = "measuring"
            self._draw()
            try:
                await measure()
            except Exception as exc:  # the plan is still worth showing without links
                self.app.notify(f"links not measured: {exc}", severity="warning")
            self.phase = "planning"
            self._draw()
        if request.adapter is not None and self.adapter is None:
            # Another model's (or a malformed) adapter is refused here, before the
            # plan: the same check `place` makes before anything is copied.
            try:
                self.adapter = await asyncio.to_thread(
                    self.controller.check_adapter, request.adapter, request.model, self._hashed
                )
                self.hashing = None
            except Exception as exc:  # PlacementError with both digests, or a read error
                self.verdict = Refusal(str(exc))
                self.phase = "refused"
                self._draw()
                return
        try:
            # Reading safetensors headers of a large model takes a moment: off the loop.
            self.info, self.verdict = await asyncio.to_thread(
                self.controller.preview,
                request.model,
                list(request.nodes),
                self.context_tokens,
                self.streams,
                self.tensor,
                self.adapter,  # each layer's share counted on its shard
                kv_bits=self.kv_bits,
                kv_group_size=None,  # one that divides the model's heads
            )
            self.shapes = await asyncio.to_thread(self._shapes)
        except Exception as exc:  # a model directory gone or unreadable since the scan
            self.phase, self.message = "error", f"cannot read {request.model}: {exc}"
        else:
            self.phase = "refused" if isinstance(self.verdict, Refusal) else "plan"
        self._draw()

    def _hashed(self, done: int, total: int) -> None:
        """From the hashing thread: a redraw at most 10 times a second (a 700 GB base
        reports every 4 MB), and at the start and the end."""
        if self._hashing_paced.due(done, total, time.monotonic()):
            self.app.call_from_thread(self._show_hashing, done, total)

    def _show_hashing(self, done: int, total: int) -> None:
        self.hashing = (done, total)
        self.rates.update("operator", done, total, time.monotonic())
        self._draw()

    def _shapes(self) -> list[tuple[int, Plan | Refusal, Forecast | None]]:
        """Every shape the model and these nodes divide into, planned for the streams
        on screen, with its forecast: what `t` cycles through."""
        if self.info is None or self.info.unsupported:
            return []
        state = self.controller.state
        nodes = list(self.request.nodes)
        # The controller's own figures (a saved benchmark's bandwidths) when it has them.
        node_chips = getattr(self.controller, "node_chips", None)
        chips = node_chips(nodes) if node_chips is not None else chips_from_state(state, nodes)
        links = links_from_state(state)
        out: list[tuple[int, Plan | Refusal, Forecast | None]] = []
        for size in tensor_sizes(self.info.facts, len(nodes)):
            if isinstance(self.verdict, Plan) and self.verdict.tensor == size:
                verdict: Plan | Refusal = self.verdict
            else:
                _, verdict = self.controller.preview(
                    self.request.model,
                    nodes,
                    self.context_tokens,
                    self.planned_streams,
                    size,
                    self.adapter,
                    kv_bits=self.kv_bits,
                    kv_group_size=None,
                )
            guess = (
                forecast(self.info.facts, verdict, chips, links, streams=verdict.streams)
                if isinstance(verdict, Plan)
                else None
            )
            out.append((size, verdict, guess))
            last = getattr(self.controller, "last_measured", None)
            if isinstance(verdict, Plan) and last is not None:
                # Saved as the Placements pane names it (a hub snapshot: org/name).
                found = last(model_label(str(self.request.model)), verdict.shape)
                if found is not None:
                    self.measured[verdict.shape] = found
        return out

    @property
    def plan(self) -> Plan | None:
        """The plan on screen: what Enter deploys, exactly."""
        return self.verdict if isinstance(self.verdict, Plan) else None

    @property
    def refusal(self) -> str | None:
        return self.verdict.reason if isinstance(self.verdict, Refusal) else None

    @property
    def text(self) -> str:
        """What the body shows, as plain text (for tests and screen readers alike)."""
        return self.query_one("#preview-body", Drawing).content.plain

    # ---- actions ----------------------------------------------------------------------

    def action_deploy(self) -> None:
        if self.phase != "plan":
            if self.phase in ("refused", "error"):
                self.app.bell()
            return
        self.phase = "loading"
        self.loads = {s.node: (0, 0) for s in self.verdict.shards}  # type: ignore[union-attr]
        self._draw()
        self.deploy(self)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_context(self, factor: float) -> None:
        if self.phase not in ("plan", "refused"):
            return
        wanted = int(self.context_tokens * factor)
        self.context_tokens = max(MIN_CONTEXT, min(MAX_CONTEXT, wanted))
        self.replan()

    def action_streams(self, delta: int) -> None:
        if self.phase not in ("plan", "refused"):
            return
        self.streams = max(1, min(MAX_STREAMS, self.planned_streams + delta))
        self.replan()

    def action_cycle_shape(self) -> None:
        """`t`: the next shape that fits (stages of 1, 2, 4… nodes), round to the first."""
        if self.phase not in ("plan", "refused"):
            return
        fitting = [size for size, verdict, _ in self.shapes if isinstance(verdict, Plan)]
        now = self.plan.tensor if self.plan else None
        if not fitting or fitting == [now]:
            self.app.notify("no other shape fits these nodes", severity="warning")
            return
        later = [size for size in fitting if now is None or size > now]
        self.tensor = later[0] if later else fitting[0]
        # While it re-plans the body is one line and the scroll goes back to the top:
        # bring the shapes back into view once the new plan is drawn.
        self._to_shapes = True
        self.replan()

    def action_cycle_kv(self) -> None:
        """`k`: full-precision KV, 8-bit, 4-bit, round again (the plan follows the sizes)."""
        if self.phase not in ("plan", "refused"):
            return
        self.kv_bits = KV_CHOICES[(KV_CHOICES.index(self.kv_bits) + 1) % len(KV_CHOICES)]
        self.replan()

    @property
    def planned_streams(self) -> int:
        """The streams the plan on screen is for (a refusal in auto mode is for one)."""
        if isinstance(self.verdict, Plan):
            return self.verdict.streams
        return self.streams or 1

    # ---- told by the deploying worker -------------------------------------------------

    def progress(self, node: str, done: int, total: int) -> None:
        self.loads[node] = (done, total)
        self.rates.update(node, done, total, time.monotonic())
        if self.is_attached:
            self._draw()

    def copy_hashing(self, done: int, total: int) -> None:
        """The model's first hashing for its copy to a remote node (on the loop)."""
        self.copy_hashed = (done, total)
        self.rates.update(OPERATOR, done, total, time.monotonic())
        if self.is_attached:
            self._draw()

    def end_copy_hashing(self) -> None:
        if self.copy_hashed is not None:
            self.copy_hashed = None
            if self.is_attached:
                self._draw()

    def finished(self, error: str | None) -> None:
        if error is None:
            self.phase = "ready"
            if self.is_attached and self.app.screen is self:
                self.dismiss(None)
            return
        self.phase, self.message = "failed", error
        if self.is_attached:
            self._draw()

    # ---- drawing ----------------------------------------------------------------------

    def _draw(self) -> None:
        if not self.is_mounted:
            return
        # Drawn for the width the dialog really has (see Drawing): the table picks
        # the richest layout that fits it.
        self.query_one("#preview-body", Drawing).redraw(self._lines)
        dialog = self.query_one("#preview-dialog")
        dialog.border_subtitle = {
            # 70 cells: whole in the dialog at 80 columns (it ended "esc …").
            "plan": "enter deploy · +/- context · s/S streams · t shape · k KV · esc cancel",
            "refused": "+/- context · s/S streams · k KV bits · esc close",
            "loading": "esc hide (loading goes on; see Placements)",
        }.get(self.phase, "esc close")
        dialog.set_class(self.phase in ("refused", "error", "failed"), "-refused")
        if self._to_shapes and self.phase in ("plan", "refused"):
            self._to_shapes = False
            self.call_after_refresh(self._show_shapes)

    def _show_shapes(self) -> None:
        """Scroll so the shapes, the chosen one marked ▸, are in view (the top of the
        plan goes out of view first on a short terminal)."""
        body = self.query_one("#preview-body", Drawing)
        width = body.content_size.width
        body.content_for(width)  # drawn for this width, so `_shapes_at` is too
        if self._shapes_at is None:
            return
        above, count = self._shapes_at
        # Lines above that the terminal folds count as they are drawn (as Drawing does).
        top = above.get_height(body.styles, width)  # type: ignore[arg-type]
        region = Region(0, body.virtual_region.y + top, width, count)
        self.query_one("#preview-scroll", VerticalScroll).scroll_to_region(
            region, animate=False, immediate=True
        )

    def _lines(self, width: int) -> Content:
        request = self.request
        state = self.controller.state
        lines: list[Content] = []
        if self.info is not None:
            lines.append(_model_line(self.info))
            if self.info.note:
                lines.append(Content.styled(f"⚠ {self.info.note}", "$warning"))
        if self.adapter is not None:
            lines.append(_adapter_line(self.adapter))
        # "node local-1" names its node already; a group or the marks are spelled out.
        members = "" if request.target.startswith("node ") else f" ({', '.join(request.nodes)})"
        lines.append(
            Content.assemble(
                ("on ", "$text-muted"),
                (request.target, "bold"),
                (members, "$text-muted"),
                ("  as ", "$text-muted"),
                (f"'{request.name}'", "bold"),
                ("  ·  ", "$text-muted"),
                f"{self.context_tokens} tokens of context",
                f" × {self.planned_streams} stream{'s' if self.planned_streams != 1 else ''}"
                " at once",
                f" · KV {self.kv_bits}-bit" if self.kv_bits else "",
            )
        )
        if self.info is not None and (
            beyond := context_beyond(self.info.facts, self.context_tokens)
        ):
            lines.append(Content.styled(beyond, "$warning"))
        lines.append(Content(""))
        if self.phase == "measuring":
            lines.append(Content.styled("measuring the links between these nodes…", "$text-muted"))
        elif self.phase == "planning" and self.hashing is not None:
            name = self.request.model.name
            said = f"hashing {name} to check the adapter was trained on it (once: cached)…"
            lines.append(Content.styled(said, "$text-muted"))
            lines += progress_lines({"operator": self.hashing}, rates=self.rates)
        elif self.phase == "planning":
            lines.append(Content.styled("planning…", "$text-muted"))
        elif self.phase == "error":
            lines.append(Content.styled(self.message, "$error"))
        elif isinstance(self.verdict, Refusal):
            lines += refusal_lines(self.verdict, state, request.nodes, request.name, width)
        elif isinstance(self.verdict, Plan):
            lines += plan_lines(self.verdict, state, request.name, width)
        # A refused single shape would only repeat the reason above.
        self._shapes_at = None
        if self.phase in ("plan", "refused") and (self.plan or len(self.shapes) > 1):
            block = shape_lines(self.shapes, self.plan, len(request.nodes), width, self.measured)
            self._shapes_at = (Content("\n").join(lines), len(block))
            lines += block
        for warning in warnings_for(state, request.nodes, request.name):
            lines.append(Content.styled(f"⚠ {warning}", "$warning"))
        if self.phase in ("loading", "ready", "failed"):
            lines += [Content(""), Content.styled("loading", "bold $accent")]
            if self.copy_hashed is not None:
                lines.append(Content.styled(HASHING_SAID, "$text-muted"))
                lines += progress_lines({OPERATOR: self.copy_hashed}, rates=self.rates)
            lines += progress_lines(self.loads, rates=self.rates)
        if self.phase == "failed":
            lines += [Content(""), Content.styled(self.message, "bold $error")]
        return Content("\n").join(lines)
