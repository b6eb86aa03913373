"""The Models pane's operations on files: fetching a model to nodes (`F`), the folders
models are looked for in (`a`), fetching from the Hugging Face hub (`H`) and deleting
a model (`D`, after asking). The app's actions hand them here, as placing is handed to
`place.flow`; progress goes to the Placements pane, words to the Log pane."""

from __future__ import annotations

import asyncio
from pathlib import Path

from textual.widgets import TabbedContent

from studiotui.app.dialogs import DeleteScreen
from studiotui.app.host import Dashboard
from studiotui.app.panes.models import ModelRow, ModelsPane
from studiotui.app.panes.nodes import NodesPane
from studiotui.app.panes.placements import PlacementsPane
from studiotui.app.screens.model_folders import HubFetchScreen, ModelFoldersScreen
from studiotui.cluster.controller import Controller
from studiotui.core.catalog import scan_home, settings
from studiotui.core.model_folders import (
    FolderCount,
    add_folder,
    delete_refusal,
    folder_counts,
    remove_folder,
)
from studiotui.core.placement import format_bytes


class ModelFiles:
    def __init__(self, app: Dashboard) -> None:
        self.app = app

    def fetch_selected(self) -> None:
        ctl = self.app.need_controller("fetch")
        row = self.app.query_one(ModelsPane).selected_row
        if ctl is None:
            return
        if row is None or not row.placeable:
            self.app.report("fetch: select a model in the Models pane first", "warning")
            return
        marked = sorted(self.app.query_one(NodesPane).marked)
        nodes = marked or [n.name for n in ctl.state.nodes if n.state == "up"]
        self.app.background(self._fetch(ctl, row, nodes), f"fetching {row.name}")

    async def _fetch(self, ctl: Controller, row: ModelRow, nodes: list[str]) -> None:
        from studiotui.cluster.model_fetch import fetch_model

        pane, key = self.app.query_one(PlacementsPane), f"fetch {row.path}"
        pane.start_progress(f"fetching {row.name} to {', '.join(nodes)}", nodes, key=key)
        try:
            await fetch_model(
                ctl, Path(row.path), nodes, lambda n, d, t: pane.progress(n, d, t, key)
            )
        finally:
            pane.end_progress(key=key)
        self.app.notify(f"{row.name}: each of {', '.join(nodes)} holds its share")

    def folders(self) -> None:
        cache = settings(self.app.home).hf_cache
        said = (
            f"and the Hugging Face cache: {cache}"
            if cache is not None
            else "(the Hugging Face cache is not looked in: hf_cache = false in config.toml)"
        )
        self.app.push_screen(
            ModelFoldersScreen(self._folder_counts, self._add_folder, self._remove_folder, said),
            lambda _: self.app.action_rescan_models(),
        )

    def _folder_counts(self) -> list[FolderCount]:
        return folder_counts(
            self.app.home, settings(self.app.home).folders, scan_home(self.app.home)
        )

    def _add_folder(self, folder: Path) -> str:
        added = add_folder(self.app.home, folder)
        said = f"models are looked for in {added} too (config.toml models_dirs)"
        self.app.report(said)
        return said

    def _remove_folder(self, folder: Path) -> str:
        remove_folder(self.app.home, folder)
        said = f"{folder} is no longer looked in (its files stay where they are)"
        self.app.report(said)
        return said

    def fetch_hub(self) -> None:
        from studiotui.cluster.model_fetch import is_repo_id

        ctl = self.app.need_controller("fetch from the hub")
        if ctl is None:
            return
        marked = sorted(self.app.query_one(NodesPane).marked)
        nodes = marked or [n.name for n in ctl.state.nodes if n.state == "up"]
        if not nodes:
            self.app.report("fetch from the hub: no node is up (r on a node starts it)", "warning")
            return

        def check(repo: str) -> str | None:
            if is_repo_id(repo):
                return None
            return f"{repo!r} is not a Hugging Face repo id: type org/name"

        def answered(wanted: tuple[str, str] | None) -> None:
            if wanted is not None and self.app.controller is ctl:
                repo, revision = wanted
                self.app.background(self._fetch_hub(ctl, repo, revision, nodes), f"fetching {repo}")

        self.app.push_screen(HubFetchScreen(nodes, check), answered)

    async def _fetch_hub(self, ctl: Controller, repo: str, revision: str, nodes: list[str]) -> None:
        """What `studiotui fetch org/name` does, its progress in the Placements pane."""
        from studiotui.cluster.model_fetch import FetchError, fetch_repo

        pane, key = self.app.query_one(PlacementsPane), f"hub {repo}"
        self.app.query_one("#bottom-tabs", TabbedContent).active = "tab-placements"
        pane.start_progress(f"fetching {repo}@{revision} from the hub", nodes, key=key)
        try:
            await fetch_repo(
                ctl, repo, nodes, revision, lambda n, d, t: pane.progress(n, d, t, key)
            )
        except FetchError as exc:
            self.app.report(f"fetch {repo}: {exc}", "error")
            return
        finally:
            pane.end_progress(key=key)
        await self.app.scan_models()
        if any(r.name == repo for r in self.app.query_one(ModelsPane).all_rows):
            self.app.notify(f"{repo}: each of {', '.join(nodes)} holds its share; in Models (4)")
        else:
            self.app.report(
                f"{repo}: each of {', '.join(nodes)} holds its share in its hub cache; this "
                "machine holds only its small files, so Models does not list it",
                "warning",
            )

    def delete_selected(self) -> None:
        row = self.app.query_one(ModelsPane).selected_row
        if row is None or row.adapter:
            self.app.report("delete: select a model in the Models pane (4) first", "warning")
            return
        path = Path(row.path)
        refusal = delete_refusal(
            path, self.app.cluster.placements, settings(self.app.home).folders, row.name
        )
        if refusal is not None:
            self.app.report(f"{row.name} is not deleted: {refusal}", "warning")
            return
        size = f" ({format_bytes(row.size)})" if row.size else ""

        def answered(yes: bool | None) -> None:
            if yes:
                self.app.background(self._delete_model(row), f"deleting {row.name}")

        self.app.push_screen(
            DeleteScreen(
                f"Delete {row.name}? Its files{size} at {row.path} are removed from this "
                "machine, for good. Copies already on other nodes stay."
            ),
            answered,
        )

    async def _delete_model(self, row: ModelRow) -> None:
        from studiotui.cluster.model_delete import delete_model

        path = Path(row.path)
        # Asked again: a placement may have started while the question was up.
        placements = (
            self.app.controller.state.placements
            if self.app.controller
            else self.app.cluster.placements
        )
        refusal = delete_refusal(path, placements, settings(self.app.home).folders, row.name)
        if refusal is not None:
            self.app.report(f"{row.name} is not deleted: {refusal}", "warning")
            return
        done = await asyncio.to_thread(delete_model, path)
        self.app.report(f"deleted {row.name}: {format_bytes(done.freed)} freed ({done.path})")
        await self.app.scan_models()
