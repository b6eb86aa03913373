"""The app's side of placing and unloading: from a model and some nodes to a placement.

Both ways in (a drop from the Models pane, `p` on the marked nodes) end here: a
preview screen first, then on confirmation a guarded worker that calls the
controller's `place` with a progress callback feeding the preview and the
Placements pane. The controller rolls a failed placement back; this side only
tells the operator, with the controller's own message.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from textual.widgets import TabbedContent

from studiotui.app.dialogs import ConfirmScreen
from studiotui.app.host import Dashboard
from studiotui.app.panes.models import ModelRow, ModelsPane
from studiotui.app.panes.nodes import NodesPane
from studiotui.app.panes.placements import PlacementsPane
from studiotui.app.place.preview import PlaceRequest, PreviewScreen
from studiotui.core.rates import Paced

if TYPE_CHECKING:
    from studiotui.cluster.controller import Controller
    from studiotui.core.state import ClusterState, PlacementState


def placement_name(model: str, taken: set[str]) -> str:
    """A placement name from the model's: its last path part, numbered when taken."""
    base = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    return name


class Placer:
    def __init__(self, app: Dashboard) -> None:
        self.app = app
        self.loading: set[str] = set()  # names being deployed by this app, not yet reported

    # ---- placing ----------------------------------------------------------------------

    def place_selected(self, nodes: Sequence[str] | None = None, target: str = "") -> None:
        """`p`: the model under the Models cursor on `nodes`, the marked nodes or all up."""
        app = self.app
        model = app.query_one(ModelsPane).selected_row
        if nodes is None:
            marked = app.query_one(NodesPane).marked_in_order()
            if marked:
                nodes, target = marked, "marked nodes"
            else:
                ctl = app.controller
                state = ctl.state if ctl is not None else app.cluster
                nodes = tuple(n.name for n in state.nodes if n.state == "up")
                target = "all up nodes"
        self.open(model, nodes, target)

    def open(
        self, model: ModelRow | None, nodes: Sequence[str], target: str, name: str | None = None
    ) -> None:
        app = self.app
        ctl = app.need_controller("placing")
        if ctl is None:
            return
        if model is None:
            app.report("placing: no model is selected; pick one in the Models tab (4)", "warning")
            return
        if not model.placeable:
            app.report(f"{model.name} cannot be placed: {model.problem}", "warning")
            return
        if not nodes:
            app.report("placing: no node is up to place on", "warning")
            return
        taken = {p.name for p in ctl.state.placements} | self.loading
        request = PlaceRequest(
            model=Path(model.path),
            model_name=model.name,
            nodes=tuple(nodes),
            target=target,
            name=name if name and name not in taken else placement_name(model.name, taken),
            # An adapter row places its base model with the adapter (named MODEL+ADAPTER).
            adapter=Path(model.adapter) if model.adapter else None,
        )
        app.push_screen(PreviewScreen(request, ctl, self._deploy))

    def _deploy(self, screen: PreviewScreen) -> None:
        app = self.app
        ctl = app.controller
        if ctl is None or ctl is not screen.controller:
            screen.finished("the cluster connection changed; preview again")
            return
        request = screen.request
        self.loading.add(request.name)
        if request.target == "marked nodes":
            # The marks were a choice for this placement; the next one starts clean.
            app.query_one(NodesPane).set_marked(set())
        app.background(self._load(ctl, screen), f"placing {request.name}")

    async def _load(self, ctl: Controller, screen: PreviewScreen) -> None:
        app = self.app
        request = screen.request
        pane = app.query_one(PlacementsPane)
        # In ring order, as the log and the ring say it (the plan on screen is loaded).
        ring = [s.node for s in screen.plan.shards] if screen.plan else list(request.nodes)
        title = f"placing {request.model_name} as '{request.name}' on {', '.join(ring)}"
        pane.start_progress(title, ring, key=request.name)

        paced = Paced()

        def show_hashing(done: int, total: int) -> None:
            pane.hashing(done, total, key=request.name)
            screen.copy_hashing(done, total)

        def hashed(done: int, total: int) -> None:
            # From the copy's hashing thread (a remote node's copy hashes the model once
            # first; cached beside its files after).
            if paced.due(done, total, time.monotonic()):
                app.call_from_thread(show_hashing, done, total)

        def progress(node: str, done: int, total: int) -> None:
            # The copies start once the hashing is done: its gauge goes.
            pane.end_hashing(key=request.name)
            screen.end_copy_hashing()
            pane.progress(node, done, total, key=request.name)
            screen.progress(node, done, total)

        try:
            await ctl.place(
                request.model,
                list(request.nodes),
                request.name,
                progress=progress,
                context_tokens=screen.context_tokens,
                expected=screen.plan,
                streams=screen.planned_streams,
                adapter_dir=request.adapter,
                hashing=hashed,
            )
        except Exception as exc:  # PlacementError says it was rolled back; say it as is
            screen.finished(str(exc))
            app.report(str(exc), "error")
            return
        finally:
            screen.end_copy_hashing()
            pane.end_progress(key=request.name)
            self.loading.discard(request.name)
        screen.finished(None)
        app.notify(f"placement '{request.name}' is ready")
        # Show the new placement without taking the keys from wherever they are.
        app.query_one("#bottom-tabs", TabbedContent).active = "tab-placements"
        # The table fills from the next state update; select the new row when it is there.
        app.call_after_refresh(pane.select, request.name)

    # ---- placing a broken placement again ------------------------------------------------

    def _selected(self, doing: str) -> tuple[Controller, PlacementState] | None:
        """The controller and the placement under the Placements cursor, or None (said)."""
        app = self.app
        ctl = app.need_controller(doing)
        if ctl is None:
            return None
        name = app.query_one(PlacementsPane).selected
        placement = ctl.state.placement(name) if name else None
        if placement is None:
            app.report(f"{doing}: no placement is selected (Placements tab, 3)", "warning")
            return None
        return ctl, placement

    def place_again(self) -> None:
        """`R`: unload a broken or failed placement and preview its model again."""
        app = self.app
        if (chosen := self._selected("place again")) is None:
            return
        ctl, placement = chosen
        name = placement.name
        if placement.state not in ("broken", "failed"):
            app.report(
                f"'{name}' is {placement.state}: only a broken or failed placement is placed "
                "again (u unloads any)",
                "warning",
            )
            return
        nodes, target = repair_nodes(placement, ctl.state)
        if not nodes:
            app.report("place again: no node is up to place on", "warning")
            return
        row = self._model_row(placement)
        question = (
            f"Unload '{name}' ({placement.state}) and place {placement.model} again on "
            f"{', '.join(nodes)}? The plan is shown before anything loads."
        )

        def answered(yes: bool | None) -> None:
            if yes and app.controller is ctl:
                app.background(self._again(ctl, name, row, nodes, target), f"placing {name} again")

        app.push_screen(ConfirmScreen(question), answered)

    def _model_row(self, placement: PlacementState) -> ModelRow:
        for row in self.app.query_one(ModelsPane).rows_shown:
            if Path(row.path) == Path(placement.model_dir) and row.adapter == placement.adapter_dir:
                return row
        return ModelRow(
            name=placement.label.replace(" + ", "+"),
            path=placement.model_dir,
            adapter=placement.adapter_dir,
        )

    async def _again(
        self, ctl: Controller, name: str, row: ModelRow, nodes: Sequence[str], target: str
    ) -> None:
        await ctl.unload(name)
        self.open(row, nodes, target, name=name)

    # ---- unloading --------------------------------------------------------------------

    def unload_selected(self) -> None:
        app = self.app
        if (chosen := self._selected("unload")) is None:
            return
        ctl, placement = chosen
        name = placement.name
        busy = max((s.in_flight for s in placement.shards), default=0)
        question = f"Unload '{name}' from {', '.join(placement.nodes)} and free its memory?"
        if busy:
            question += f" {busy} request{'s are' if busy > 1 else ' is'} in flight and will fail."

        def answered(yes: bool | None) -> None:
            if yes and app.controller is ctl:
                app.background(self._unload(ctl, name), f"unloading {name}")

        app.push_screen(ConfirmScreen(question), answered)

    async def _unload(self, ctl: Controller, name: str) -> None:
        await ctl.unload(name)
        self.app.notify(f"placement '{name}' unloaded")


def repair_nodes(placement: PlacementState, state: ClusterState) -> tuple[tuple[str, ...], str]:
    """Where to place a broken placement again: its own nodes (the ring it was planned
    on, remembered until it is unloaded) when every one of them is up, else every node
    that is up. Without a remembered plan a dead node's shard is not listed, so the
    ring is known only when every shard still reports."""
    up = tuple(n.name for n in state.nodes if n.state == "up")
    own = tuple(p.node for p in placement.ring)
    complete = bool(own) and len(own) == placement.expected
    if complete and set(own) <= set(up):
        return own, "its own nodes"
    return up, "all up nodes"
