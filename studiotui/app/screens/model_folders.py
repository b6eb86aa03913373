"""The Models pane's dialogs: the model folders (add, remove) and a fetch from the hub.

Views only: what a folder holds comes from the app (`list_folders`), adding and
removing go back to it (`add`, `remove`: they write config.toml through
core/model_folders.py and say what happened, or raise a StudioError that the
dialog shows in its own words).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.suggester import Suggester
from textual.widgets import DataTable, Input, Static

from studiotui.app.guard import guard_actions
from studiotui.chat.commands import complete_path
from studiotui.core.errors import StudioError
from studiotui.core.model_folders import FolderCount


class _PathSuggester(Suggester):
    def __init__(self) -> None:
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        return complete_path(value)


def folder_cells(row: FolderCount) -> tuple[str, str, str]:
    """A folder's row: where, what it holds, and whether it can be removed."""
    if not row.exists:
        held = "missing"
    else:
        held = f"{row.models} model{'s' if row.models != 1 else ''}"
        if row.empty:
            held += f" · {row.empty} other folder{'s' if row.empty != 1 else ''}"
    kind = "home (always)" if not row.entry else "config.toml"
    return row.entry or str(row.path), held, kind


@guard_actions
class ModelFoldersScreen(ModalScreen[None]):
    """Where models are looked for; type a path to add one, x removes the selected."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close", id="folders-close"),
        Binding("x,delete", "remove", "Remove folder", id="folders-remove"),
    ]

    def __init__(
        self,
        list_folders: Callable[[], Sequence[FolderCount]],
        add: Callable[[Path], str],
        remove: Callable[[Path], str],
        hf_cache: str,
    ) -> None:
        super().__init__(id="folders-screen")
        self.list_folders = list_folders
        self.add_folder = add
        self.remove_folder = remove
        self.hf_cache = hf_cache
        self.rows: list[FolderCount] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="folders-dialog") as dialog:
            dialog.border_title = "Model folders"
            dialog.border_subtitle = "enter adds · x removes · esc closes"
            yield DataTable(cursor_type="row", id="folders-table")
            yield Static(Content.styled(self.hf_cache, "$text-muted"), id="folders-hf")
            yield Input(
                placeholder="a folder to look in for models, e.g. ~/models",
                suggester=_PathSuggester(),
                id="folders-input",
            )
            yield Static(id="folders-said")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("folder", "holds", "from")
        self.refresh_rows()
        self.query_one(Input).focus()

    def refresh_rows(self) -> None:
        self.rows = list(self.list_folders())
        table = self.query_one(DataTable)
        table.clear()
        for row in self.rows:
            table.add_row(*folder_cells(row), key=str(row.path))

    def _say(self, text: str, error: bool = False) -> None:
        self.query_one("#folders-said", Static).update(
            Content.styled(text, "$error" if error else "$success")
        )

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if not text:
            self._say("type a folder's path first", error=True)
            return
        try:
            said = self.add_folder(Path(text))
        except StudioError as exc:
            self._say(str(exc), error=True)
            return
        event.input.value = ""
        self._say(said)
        self.refresh_rows()

    def action_remove(self) -> None:
        table = self.query_one(DataTable)
        if not self.rows or not 0 <= table.cursor_row < len(self.rows):
            self._say("select a folder in the list first (tab, ↑↓)", error=True)
            return
        row = self.rows[table.cursor_row]
        try:
            said = self.remove_folder(row.path)
        except StudioError as exc:
            self._say(str(exc), error=True)
            return
        self._say(said)
        self.refresh_rows()

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


@guard_actions
class HubFetchScreen(ModalScreen[tuple[str, str] | None]):
    """A hub repository (org/name) and its revision, for the nodes to download."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Cancel", id="hub-cancel"),
    ]

    def __init__(self, nodes: Sequence[str], check: Callable[[str], str | None]) -> None:
        super().__init__(id="hub-screen")
        self.nodes = list(nodes)
        self.check = check  # why a repo id is refused, None when it is one

    def compose(self) -> ComposeResult:
        with Vertical(id="hub-dialog") as dialog:
            dialog.border_title = "Fetch from the hub"
            dialog.border_subtitle = "enter fetches · esc cancels"
            yield Static(
                Content(
                    f"Each of {', '.join(self.nodes)} downloads its share of the layers "
                    "into its hub cache, at one commit, as `studiotui fetch` does."
                ),
                id="hub-said",
            )
            yield Input(placeholder="org/name, e.g. mlx-community/Qwen3-8B-4bit", id="hub-repo")
            yield Input(value="main", placeholder="revision: branch, tag or commit", id="hub-rev")
            yield Static(id="hub-error")

    def on_mount(self) -> None:
        self.query_one("#hub-repo", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        repo = self.query_one("#hub-repo", Input).value.strip()
        revision = self.query_one("#hub-rev", Input).value.strip() or "main"
        problem = self.check(repo)
        if problem is not None:
            self.query_one("#hub-error", Static).update(Content.styled(problem, "$error"))
            self.query_one("#hub-repo", Input).focus()
            return
        self.dismiss((repo, revision))

    def action_dismiss(self, result: Any = None) -> None:  # type: ignore[override]
        self.dismiss(None)
