"""The chat's dialogs: the list of conversations (open, rename, delete, export) and
the document picker."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.suggester import Suggester
from textual.widgets import DataTable, Input, Static

from studiotui.app.dialogs import DeleteScreen
from studiotui.app.guard import guard_actions
from studiotui.chat.history import History, HistoryError
from studiotui.chat.store import HistoryStore


@dataclass(frozen=True)
class ListChoice:
    action: str  # "open" or "new"
    conversation_id: int | None = None


def when(t: float, now: float | None = None) -> str:
    now = time.time() if now is None else now
    if now - t < 86_400:
        return time.strftime("%H:%M", time.localtime(t))
    return time.strftime("%Y-%m-%d", time.localtime(t))


@guard_actions
class ConversationsScreen(ModalScreen[ListChoice | None]):
    DEFAULT_CSS = """
    ConversationsScreen { align: center middle; }
    #conv-dialog {
        width: 100; max-width: 95%; height: 80%;
        border: round $primary; background: $surface; padding: 0 1;
    }
    #conv-table { height: 1fr; background: transparent; }
    #conv-rename { display: none; margin-top: 1; }
    #conv-rename.-shown { display: block; }
    #conv-hint { color: $text-muted; height: auto; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close", id="conv-close"),
        Binding("n", "new", "New", id="conv-new"),
        Binding("r", "rename", "Rename", id="conv-rename"),
        Binding("d,delete", "delete", "Delete", id="conv-delete"),
        Binding("e", "export", "Export", id="conv-export"),
    ]

    def __init__(self, store: HistoryStore, current: int | None, exports: Path) -> None:
        super().__init__(id="conversations-screen")
        # Every read and write goes through the history's own thread (the chat's).
        self.store = store
        self.current = current
        self.exports = exports
        self.ids: list[int] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="conv-dialog") as dialog:
            dialog.border_title = "Conversations"
            dialog.border_subtitle = (
                "enter open · n new · r rename · d delete · e export · esc closes"
            )
            yield DataTable(id="conv-table", cursor_type="row", zebra_stripes=True)
            rename = Input(id="conv-rename", placeholder="enter saves · esc cancels")
            rename.border_title = "Rename the conversation to"
            yield rename
            yield Static("", id="conv-hint")

    async def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("", "title", "messages", "last used", "placement")
        await self.reload()
        table.focus()

    async def reload(self, keep: int | None = None) -> None:
        conversations = await self.store.call(History.conversations)
        table = self.query_one(DataTable)
        table.clear()
        self.ids = [c.id for c in conversations]
        now = time.time()
        for c in conversations:
            # Rich Text, not str: a str cell is read as markup, and a title may hold [brackets].
            table.add_row(
                Text("●" if c.id == self.current else "", style="bold"),
                Text(c.display_title),
                str(c.message_count),
                when(c.updated, now),
                Text(c.placement or "–"),
            )
        if not conversations:
            self.query_one("#conv-hint", Static).update("no conversation yet · n starts one")
        target = keep if keep in self.ids else self.current
        if target in self.ids:
            table.move_cursor(row=self.ids.index(target))

    def _selected(self) -> int | None:
        table = self.query_one(DataTable)
        if not self.ids or table.cursor_row < 0 or table.cursor_row >= len(self.ids):
            return None
        return self.ids[table.cursor_row]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        chosen = self._selected()
        if chosen is not None:
            self.dismiss(ListChoice("open", chosen))

    def action_close(self) -> None:
        rename = self.query_one("#conv-rename", Input)
        if rename.has_class("-shown"):
            rename.remove_class("-shown")
            self.query_one(DataTable).focus()
            return
        self.dismiss(None)

    def action_new(self) -> None:
        self.dismiss(ListChoice("new"))

    async def action_rename(self) -> None:
        chosen = self._selected()
        if chosen is None:
            return
        rename = self.query_one("#conv-rename", Input)
        rename.value = (await self.store.call(History.get, chosen)).title
        rename.add_class("-shown")
        # A hidden widget cannot take focus: focus it once it is shown, or the first
        # letters typed would go to the table (where e exports, d deletes).
        self.call_after_refresh(rename.focus)

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        chosen = self._selected()
        event.input.remove_class("-shown")
        if chosen is not None and event.value.strip():
            await self.store.call(History.rename, chosen, event.value)
            await self.reload(keep=chosen)
        self.query_one(DataTable).focus()

    async def action_delete(self) -> None:
        chosen = self._selected()
        if chosen is None:
            return
        conv = await self.store.call(History.get, chosen)

        async def answered(yes: bool | None) -> None:
            if yes:
                try:
                    await self.store.call(History.delete, chosen)
                except HistoryError as exc:
                    self.app.notify(str(exc), severity="error")
                await self.reload()

        self.app.push_screen(
            DeleteScreen(
                f"Delete {conv.display_title!r} and its {conv.message_count} messages? "
                "This cannot be undone (e exports it first)."
            ),
            answered,
        )

    async def action_export(self) -> None:
        chosen = self._selected()
        if chosen is None:
            return
        path = await self.store.call(History.export_file, chosen, self.exports)
        self.query_one("#conv-hint", Static).update(Content(f"exported to {path}"))
        self.app.notify(f"exported to {path}", timeout=4)


@guard_actions
class AttachScreen(ModalScreen[Path | None]):
    DEFAULT_CSS = """
    AttachScreen { align: center middle; }
    #attach-dialog {
        width: 80; max-width: 95%; height: auto;
        border: round $primary; background: $surface; padding: 1 2;
    }
    #attach-hint { color: $text-muted; margin-top: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="attach-cancel"),
    ]

    def __init__(self, suggester: Suggester | None = None) -> None:
        super().__init__(id="attach-screen")
        self.suggester = suggester

    def compose(self) -> ComposeResult:
        with Vertical(id="attach-dialog") as dialog:
            dialog.border_title = "Attach a document"
            yield Input(
                value=str(Path.cwd()) + "/",
                placeholder="path to a text, Markdown or PDF file",
                suggester=self.suggester,
                id="attach-path",
            )
            yield Static(
                "text, Markdown or PDF · → completes the path · enter attaches · esc cancels\n"
                "It stays on this machine and on the cluster: only its passages go into prompts.",
                id="attach-hint",
            )

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if value:
            self.dismiss(Path(value).expanduser())

    def action_cancel(self) -> None:
        self.dismiss(None)
