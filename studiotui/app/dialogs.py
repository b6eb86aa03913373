"""Modal screens: the key help and a node's agent log."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from studiotui.app.guard import guard_actions


@guard_actions
class HelpScreen(ModalScreen[None]):
    """Every key of the app, generated from the bindings so it cannot go stale."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,question_mark", "dismiss", "Close", id="close-help"),
    ]

    def __init__(self, rows: Sequence[tuple[str, str]], notes: Sequence[str] = ()) -> None:
        super().__init__(id="help-screen")
        self.rows = list(rows)
        self.notes = list(notes)

    def compose(self) -> ComposeResult:
        width = max((len(k) for k, _ in self.rows), default=4)
        lines = [
            Content.assemble((f"{key:>{width}}", "$accent bold"), "  ", text)
            for key, text in self.rows
        ]
        for note in self.notes:
            lines += [Content(""), Content(note)]
        with Vertical(id="help-dialog") as dialog:
            dialog.border_title = "Keys"
            dialog.border_subtitle = "esc to close"
            with VerticalScroll():
                yield Static(Content("\n").join(lines), id="help-body")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


@guard_actions
class NodeLogScreen(ModalScreen[None]):
    """The last lines of one agent's log, read through the controller."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "dismiss", "Close", id="close-logs"),
        Binding("r", "reload", "Reload", id="reload-logs"),
    ]

    def __init__(self, node: str, read: Callable[[str], Awaitable[list[str]]]) -> None:
        super().__init__(id="logs-screen")
        self.node = node
        self.read = read
        self.lines: list[str] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="logs-dialog") as dialog:
            dialog.border_title = f"Log of {self.node}"
            dialog.border_subtitle = "r reload · esc close"
            with VerticalScroll(id="logs-scroll"):
                yield Static(Content.styled("reading…", "$text-muted"), id="logs-body")

    def on_mount(self) -> None:
        self.action_reload()

    def action_reload(self) -> None:
        self.run_worker(self._load(), exclusive=True, exit_on_error=False)

    async def _load(self) -> None:
        body = self.query_one("#logs-body", Static)
        try:
            self.lines = await self.read(self.node)
        except Exception as exc:  # shown in the dialog: the operator asked for this node
            message = f"cannot read the log of {self.node}: {exc}"
            body.update(Content.styled(message, "$error"))
            self.app.notify(message, severity="error")
            return
        body.update(Content("\n".join(self.lines) or "(the log is empty)"))
        self.query_one("#logs-scroll", VerticalScroll).scroll_end(animate=False)

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


@guard_actions
class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question for commands that break something running."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y,enter", "answer(True)", "Yes", id="confirm-yes"),
        Binding("n,escape", "answer(False)", "No", id="confirm-no"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__(id="confirm-screen")
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-dialog") as dialog:
            dialog.border_title = "Confirm"
            dialog.border_subtitle = "y yes · n no"
            yield Static(Content(self.question), id="confirm-body")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


@guard_actions
class DeleteScreen(ConfirmScreen, inherit_bindings=False):
    """A yes/no question before something is removed for good (a model's files, a
    conversation): enter, the key pressed out of habit, keeps it; only `y` deletes."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Delete", id="confirm-yes"),
        Binding("n,escape,enter", "answer(False)", "Keep", id="confirm-no"),
    ]

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-dialog") as dialog:
            dialog.border_title = "Delete"
            dialog.border_subtitle = "y delete · n / enter keep"
            yield Static(Content(self.question), id="confirm-body")


@guard_actions
class QuitScreen(ModalScreen[str | None]):
    """Quitting with local agents running: they stay unless the operator stops them."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("k,enter", "answer('keep')", "Keep running", id="quit-keep"),
        Binding("s", "answer('stop')", "Stop the cluster", id="quit-stop"),
        Binding("escape,n", "answer(None)", "Stay", id="quit-stay"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__(id="quit-screen")
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="quit-dialog") as dialog:
            dialog.border_title = "Quit"
            dialog.border_subtitle = "k keep running · s stop the cluster · esc stay"
            yield Static(Content(self.question), id="quit-body")

    def action_answer(self, answer: str | None) -> None:
        self.dismiss(answer)
