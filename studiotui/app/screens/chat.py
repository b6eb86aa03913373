"""The chat screen: talk to a placement, watch it work, keep the conversation.

The answer arrives from `Controller.generate` as one message per token, at the
pipeline's full rate. Drawing each token would make the screen (and so the keys)
lag behind a fast model, so tokens are only collected as they come and a timer
draws what has arrived FLUSH_HZ times a second, through Textual's MarkdownStream
(which coalesces further if a redraw is still running). Figures are redrawn on
the same tick.

Stopping cancels the worker that iterates the generator: the CancelledError
lands inside `generate` at its await, and its `finally` sends the cancel that
frees the KV cache on every shard. Whatever text had arrived is kept, in the
transcript and in the history, whether the answer stopped, failed or finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

from markdown_it import MarkdownIt
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import Screen
from textual.suggester import Suggester
from textual.widgets import (
    Footer,
    Header,
    Input,
    Label,
    Markdown,
    Select,
    Sparkline,
    Static,
    TextArea,
)
from textual.widgets.markdown import MarkdownStream
from textual.worker import Worker

from studiotui.app.guard import guard_actions
from studiotui.app.host import Dashboard
from studiotui.app.screens.conversations import AttachScreen, ConversationsScreen, ListChoice
from studiotui.chat.documents import (
    DocumentError,
    Passage,
    Selection,
    build_prompt,
    local_chars_per_token,
    read_document,
    select_passages,
    split_passages,
)
from studiotui.chat.history import (
    Conversation,
    History,
    HistoryError,
    Message,
    Settings,
    passages_note,
)
from studiotui.cluster.controller import Controller, GenerationError
from studiotui.core.state import ClusterState, PlacementState

# `studiotui place` reserves KV memory for this many tokens by default, and a
# placement does not report its own figure, so the chat budgets its prompts for it.
CONTEXT_TOKENS = 4096
TEMPLATE_TOKENS = 64  # what a chat template adds around the messages, roughly
# Until a placement's first answer tells how many tokens a prompt really made,
# assume 3 characters a token (English with a BPE vocabulary makes about 4).
GUESS_CHARS_PER_TOKEN = 3.0
CALIBRATE_CHARS = 2000
PASSAGE_SHARE = 0.75  # of the prompt budget, for passages; the rest for earlier turns
FLUSH_HZ = 15
SPARK_S = 0.25
SPARK_KEEP = 120
CHECKPOINT_S = 2.0  # a crash of the TUI mid-answer loses at most this much text
POLL_S = 1.0

COMMANDS = {
    "/attach": "/attach PATH — attach a text, Markdown or PDF file",
    "/detach": "/detach [NAME] — remove one attached document (or all)",
    "/rename": "/rename TITLE — rename this conversation",
    "/system": "/system TEXT — set the system prompt",
    "/new": "/new — start a new conversation",
    "/export": "/export — write this conversation as Markdown",
    "/help": "/help — these commands",
}


# ---- pure helpers (tested without a screen) --------------------------------------------


def prompt_budget_chars(max_tokens: int, chars_per_token: float) -> int:
    """Characters of prompt that leave room for the answer in the context."""
    tokens = max(CONTEXT_TOKENS - max_tokens - TEMPLATE_TOKENS, CONTEXT_TOKENS // 8)
    return int(tokens * chars_per_token)


def request_messages(
    system: str, messages: list[Message], budget_chars: int
) -> tuple[list[dict[str, str]], int]:
    """The messages to send for the last (user) message, and how many earlier ones
    were left out to fit the budget. Earlier questions go as typed: only the
    question being answered carries its document passages."""
    *earlier, last = messages
    final = {"role": "user", "content": last.sent or last.content}
    used = len(system) + len(final["content"])
    wanted = [m for m in earlier if m.content.strip()]
    kept: list[dict[str, str]] = []
    for m in reversed(wanted):
        size = len(m.content) + 16
        if used + size > budget_chars:
            break
        kept.append({"role": m.role, "content": m.content})
        used += size
    kept.reverse()
    # Chat templates expect a user turn first.
    while kept and kept[0]["role"] == "assistant":
        kept.pop(0)
    head = [{"role": "system", "content": system}] if system else []
    return [*head, *kept, final], len(wanted) - len(kept)


def code_blocks(markdown: str) -> list[str]:
    tokens = MarkdownIt("commonmark").parse(markdown)
    return [t.content for t in tokens if t.type in ("fence", "code_block")]


def complete_path(fragment: str) -> str | None:
    """The unambiguous continuation of a path being typed, like a shell's tab."""
    if not fragment:
        return None
    path = Path(fragment).expanduser()
    folder, stem = (path, "") if fragment.endswith("/") else (path.parent, path.name)
    try:
        names = sorted(
            e.name + ("/" if e.is_dir() else "")
            for e in folder.iterdir()
            if e.name.startswith(stem) and (stem.startswith(".") or not e.name.startswith("."))
        )
    except OSError:
        return None
    if not names:
        return None
    common = names[0]
    for name in names[1:]:
        while not name.startswith(common):
            common = common[:-1]
    if len(common) <= len(stem):
        return None
    return fragment + common[len(stem) :]


class PromptSuggester(Suggester):
    """Completes slash commands, and paths after /attach."""

    def __init__(self) -> None:
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        if value.startswith("/attach "):
            rest = complete_path(value[len("/attach ") :])
            return f"/attach {rest}" if rest else None
        if value.startswith("/") and " " not in value:
            return next((c + " " for c in COMMANDS if c.startswith(value) and c != value), None)
        return None


class PathSuggester(Suggester):
    def __init__(self) -> None:
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        return complete_path(value)


# Control characters from a model (an ESC above all) must not reach the terminal.
_CONTROL = {c: None for c in [*range(0x00, 0x09), 0x0B, 0x0C, 0x0D, *range(0x0E, 0x20), 0x7F]}
_CONTROL.update({c: None for c in range(0x80, 0xA0)})


def printable(text: str) -> str:
    return text.translate(_CONTROL)


def placement_option(p: PlacementState) -> str:
    """A placement as the picker lists it: its name, the adapter its shards apply (a
    placement with one answers otherwise than its base), and its state unless ready."""
    text = f"{p.name} · adapter {p.adapter}" if p.adapter else p.name
    return text if p.state == "ready" else f"{text} ({p.state})"


def shard_role(index: int, count: int) -> str:
    if count == 1:
        return "whole"
    return "head" if index == 0 else "tail" if index == count - 1 else "middle"


def figures_text(
    ttft_ms: float | None, tps: float | None, tokens_in: int | None, tokens_out: int, state: str
) -> Content:
    def figure(label: str, value: str) -> Content:
        return Content.assemble((f"{label:<12}", "$text-muted"), (value, "bold"))

    lines = [
        Content.styled(state, "$accent bold"),
        figure("first token", f"{ttft_ms:,.0f} ms" if ttft_ms is not None else "–"),
        figure("speed", f"{tps:,.1f} tok/s" if tps else "–"),
        figure("tokens in", f"{tokens_in:,}" if tokens_in is not None else "–"),
        figure("tokens out", f"{tokens_out:,}"),
    ]
    return Content("\n").join(lines)


# ---- widgets ---------------------------------------------------------------------------


class UserView(Static):
    def __init__(self, message: Message) -> None:
        # Content, not markup: a question with [brackets] must show as typed.
        super().__init__(Content(message.content), classes="msg user")
        self.message = message

    @property
    def text(self) -> str:
        return self.message.content


class AnswerView(Vertical):
    def __init__(self, message: Message) -> None:
        super().__init__(classes="msg answer")
        self.message = message
        self.markdown = Markdown(message.content)
        self.note = Static("", classes="note")

    def compose(self) -> ComposeResult:
        yield self.markdown
        yield self.note

    @property
    def text(self) -> str:
        return self.markdown.source

    def show_note(self, meta: dict[str, Any], live: str = "") -> None:
        lines: list[Content] = []
        used = passages_note(meta.get("passages", []))
        if used:
            if meta.get("unmatched"):
                used += " (no passage shares words with the question: the beginning)"
            lines.append(Content.styled(used, "$accent"))
        if meta.get("dropped"):
            n = meta["dropped"]
            lines.append(
                Content.styled(
                    f"{n} earlier message{'s' if n > 1 else ''} left out to fit the context",
                    "$text-muted",
                )
            )
        figures = []
        if meta.get("completion_tokens") is not None:
            figures.append(f"{meta['completion_tokens']} tokens")
        if meta.get("decode_tps"):
            figures.append(f"{meta['decode_tps']:.1f} tok/s")
        if meta.get("ttft_ms") is not None:
            figures.append(f"first token {meta['ttft_ms']:,.0f} ms")
        if meta.get("nodes"):
            figures.append(" → ".join(meta["nodes"]))
        if figures and not live:
            lines.append(Content.styled(" · ".join(figures), "$text-muted"))
        if live:
            lines.append(Content.styled(live, "$text-muted"))
        if meta.get("error"):
            kept = "the text above is what arrived before" if self.text else "no text arrived"
            lines.append(Content.styled(f"✗ {meta['error']} — {kept}", "$error"))
        elif meta.get("stopped"):
            lines.append(Content.styled("■ stopped", "$warning"))
        self.note.update(Content("\n").join(lines))
        self.note.display = bool(lines)


class Transcript(VerticalScroll, can_focus=True):
    """The conversation. Focused, the arrows pick a message to copy."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "step(-1)", "Previous", show=False),
        Binding("down,j", "step(1)", "Next", show=False),
        Binding("y", "screen.copy_answer", "Copy", id="chat-copy-selected"),
        Binding("b", "screen.copy_code", "Copy code", id="chat-copy-code-selected"),
        Binding("enter", "screen.focus_prompt", "Ask", show=False),
    ]

    def action_step(self, delta: int) -> None:
        cast("ChatScreen", self.screen).select_step(delta)


# ---- the turn being answered ------------------------------------------------------------


@dataclass
class Turn:
    user: Message
    answer: Message
    view: AnswerView
    stream: MarkdownStream
    placement: str | None
    meta: dict[str, Any]
    chars_sent: int
    started: float = field(default_factory=time.monotonic)
    first_at: float | None = None
    prompt_tokens: int | None = None
    tokens: int = 0
    text: str = ""
    pending: list[str] = field(default_factory=list)
    spark: list[float] = field(default_factory=list)
    spark_at: float = 0.0
    spark_tokens: int = 0
    saved_at: float = 0.0
    done: dict[str, Any] | None = None
    error: str | None = None
    stopped: bool = False
    finished: bool = False

    def ttft_ms(self) -> float | None:
        return None if self.first_at is None else (self.first_at - self.started) * 1000

    def tps(self, now: float) -> float | None:
        if self.first_at is None or self.tokens < 2 or now <= self.first_at:
            return None
        return (self.tokens - 1) / (now - self.first_at)


# ---- the screen ------------------------------------------------------------------------


@guard_actions
class ChatScreen(Screen[None]):
    CSS_PATH = "chat.tcss"
    AUTO_FOCUS = "#chat-prompt"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop_or_leave", "Stop / back", id="chat-stop"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="chat-regenerate"),
        Binding("ctrl+y", "copy_answer", "Copy answer", id="chat-copy"),
        Binding("ctrl+b", "copy_code", "Copy code", id="chat-copy-code"),
        Binding("ctrl+o", "conversations", "Conversations", id="chat-conversations"),
        Binding("ctrl+n", "new_conversation", "New", id="chat-new"),
        Binding("ctrl+t", "attach", "Attach", id="chat-attach"),
        Binding("ctrl+l", "pick_placement", "Placement", show=False, id="chat-placement"),
    ]
    # Learned per placement from each answer's prompt token count; shared by every
    # chat screen of the process, since it is a fact about the model's tokenizer.
    chars_per_token: ClassVar[dict[str, float]] = {}

    def __init__(self) -> None:
        super().__init__(id="chat-screen")
        self.history: History | None = None
        self.conv: Conversation | None = None
        self.settings = Settings()
        self._turn: Turn | None = None
        self._worker: Worker[None] | None = None
        self._stopped: tuple[int, int] | None = None  # (user id, answer id) of a stopped turn
        self._selected: int | None = None
        self._code_at: tuple[int, int] = (-1, -1)  # (answer id, block index) last copied
        self._passages: dict[int, list[Passage]] = {}
        self._options: list[tuple[str, str]] = []
        self._leaving = False

    @property
    def studio(self) -> Dashboard:
        return cast(Dashboard, self.app)

    @property
    def streaming(self) -> bool:
        return self._turn is not None and not self._turn.finished

    # ---- layout ---------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="chat-main"):
            with Vertical(id="chat-left"):
                with Horizontal(id="chat-bar"):
                    yield Select[str]([], prompt="placement", id="chat-placement", allow_blank=True)
                    yield Static("", id="chat-title")
                yield Transcript(id="chat-transcript")
                yield Static("", id="chat-status")
                yield Input(
                    placeholder="Ask…  (enter sends · /attach PATH · /help)",
                    id="chat-prompt",
                    suggester=PromptSuggester(),
                )
            with VerticalScroll(id="chat-side"):
                yield Static("", id="chat-figures")
                yield Sparkline([], id="chat-spark")
                yield Static("", id="chat-nodes")
                yield Label("System prompt", classes="side-label")
                yield TextArea("", id="chat-system", soft_wrap=True, compact=True)
                with Horizontal(classes="setting"):
                    yield Label("temperature")
                    yield Input(id="chat-temperature", type="number", compact=True)
                with Horizontal(classes="setting"):
                    yield Label("top-p")
                    yield Input(id="chat-top-p", type="number", compact=True)
                with Horizontal(classes="setting"):
                    yield Label("max tokens")
                    yield Input(id="chat-max-tokens", type="integer", compact=True)
                yield Static("", id="chat-docs")
        yield Footer()

    def on_mount(self) -> None:
        try:
            self.history = History.open(self.studio.home)
        except (HistoryError, OSError) as exc:
            self.studio.report(
                f"chat history unavailable ({exc}); this session's chat will not be kept",
                "error",
            )
            self.history = History(Path(":memory:"))
        self.query_one("#chat-side").border_title = "Answer"
        self.query_one("#chat-transcript").border_title = "Conversation"
        self._flush_timer = self.set_interval(1 / FLUSH_HZ, self._flush, pause=True)
        self.set_interval(POLL_S, self._poll_cluster)
        self.open_conversation(self.history.latest())
        self._poll_cluster()

    def on_screen_resume(self) -> None:
        # Whatever had the keys when the chat was left, typing goes to the Ask box.
        self.query_one("#chat-prompt", Input).focus()
        if self.history is not None:  # not the first showing: on_mount did this
            self._poll_cluster()

    def on_screen_suspend(self) -> None:
        self._save_settings(quiet=True)

    def on_unmount(self) -> None:
        self._leaving = True
        self._save_settings(quiet=True)
        if self.streaming and self._worker is not None:
            assert self._turn is not None
            self._turn.stopped = True
            self._worker.cancel()  # its `finally` saves the answer and closes the history
        elif self.history is not None:
            self.history.close()

    # ---- conversations ----------------------------------------------------------------

    def open_conversation(self, conv: Conversation | None) -> None:
        """Show a conversation (None: a new one, created when first used)."""
        assert self.history is not None
        self.conv = conv
        self.settings = conv.settings if conv else Settings()
        self._stopped = None
        self._selected = None
        transcript = self.query_one(Transcript)
        transcript.remove_children()
        views: list[UserView | AnswerView] = []
        last_meta: dict[str, Any] = {}
        if conv is not None:
            for m in self.history.messages(conv.id):
                if m.role == "user":
                    views.append(UserView(m))
                else:
                    views.append(AnswerView(m))
                    last_meta = m.meta
        transcript.mount_all(views)
        for view in views:
            if isinstance(view, AnswerView):
                view.show_note(view.message.meta)
        # Anchored: it follows the newest text until the operator scrolls up to read.
        transcript.anchor()
        self.query_one("#chat-system", TextArea).text = self.settings.system_prompt
        self.query_one("#chat-temperature", Input).value = f"{self.settings.temperature:g}"
        self.query_one("#chat-top-p", Input).value = f"{self.settings.top_p:g}"
        self.query_one("#chat-max-tokens", Input).value = str(self.settings.max_tokens)
        self._show_title()
        self._show_docs()
        self._show_stored_figures(last_meta)
        self._status("")
        if conv is not None and conv.placement and conv.placement in dict(self._options).values():
            self.query_one("#chat-placement", Select).value = conv.placement

    def _ensure_conversation(self) -> Conversation:
        assert self.history is not None
        if self.conv is None:
            self.conv = self.history.create(
                placement=self._chosen_name() or "", settings=self.settings
            )
            self._show_title()
        return self.conv

    def _show_title(self) -> None:
        title = self.conv.display_title if self.conv else "new conversation"
        self.query_one("#chat-title", Static).update(Content(title))
        self.sub_title = f"chat · {title}"

    def _refresh_conv(self) -> None:
        if self.conv is not None and self.history is not None:
            try:
                self.conv = self.history.get(self.conv.id)
            except HistoryError:
                self.open_conversation(None)
                return
            self._show_title()

    # ---- cluster ----------------------------------------------------------------------

    @property
    def controller(self) -> Controller | None:
        return getattr(self.app, "controller", None)

    @property
    def cluster(self) -> ClusterState:
        """The controller's state, or the fixed state a view without a cluster shows."""
        ctl = self.controller
        if ctl is not None:
            return ctl.state
        return getattr(self.app, "cluster", None) or ClusterState()

    def _poll_cluster(self) -> None:
        placements = self.cluster.placements
        options = [(placement_option(p), p.name) for p in placements]
        select = self.query_one("#chat-placement", Select)
        if options != self._options:
            before = select.selection
            self._options = options
            select.set_options(options)
            names = [v for _, v in options]
            wanted = before or (self.conv.placement if self.conv else None)
            ready = [p.name for p in placements if p.state == "ready"]
            if wanted in names:
                select.value = wanted
            elif len(ready) == 1:
                # The only placement is the one meant.
                select.value = ready[0]
        self._show_nodes()

    def _chosen_name(self) -> str | None:
        value = self.query_one("#chat-placement", Select).selection
        return str(value) if value is not None else None

    def _chosen(self) -> PlacementState | None:
        name = self._chosen_name()
        return self.cluster.placement(name) if name is not None else None

    def _show_nodes(self) -> None:
        placement = self._chosen()
        box = self.query_one("#chat-nodes", Static)
        if placement is None:
            box.update(Content.styled("no placement chosen", "$text-muted"))
            return
        mine = self.streaming and self._turn is not None and self._turn.placement == placement.name
        lines = [
            Content.styled(f"Nodes · {placement.name} ({placement.label})", "bold"),
            Content.styled(f"  {'node':<9} {'role':<6} {'layers':<6} {'reqs':>4}", "$text-muted"),
        ]
        count = len(placement.shards)
        for s in placement.shards:
            working = mine or s.in_flight > 0
            mark = ("● ", "$success bold") if working else ("○ ", "$text-muted")
            layers = f"{s.start}–{s.end}"
            # Requests in flight on the shard, from the agents' telemetry (other clients too).
            reqs = str(s.in_flight) if s.in_flight else ""
            state = "" if s.state == "ready" else f" {s.state}"
            lines.append(
                Content.assemble(
                    mark,
                    (f"{s.node:<9}", "bold" if working else ""),
                    (
                        f" {shard_role(s.index, count):<6} {layers:<6} {reqs:>4}{state}",
                        "$text-muted",
                    ),
                )
            )
        box.update(Content("\n").join(lines))

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id != "chat-placement":
            return
        if self.conv is not None and self.history is not None and event.value is not Select.BLANK:
            self.history.set_placement(self.conv.id, str(event.value))
        self._show_nodes()

    # ---- settings ---------------------------------------------------------------------

    def _read_settings(self) -> Settings:
        def number(selector: str, label: str, kind: type) -> Any:
            field = self.query_one(selector, Input)
            raw = field.value.strip()
            if not raw:
                # Emptied on the way to typing a new value: keep the one in force,
                # say so, and put it back so the field shows what is used.
                kept = getattr(self.settings, label.replace(" ", "_").replace("-", "_"))
                field.value = f"{kept:g}" if isinstance(kept, float) else str(kept)
                self._status(f"{label} was empty: kept {field.value}")
                return kind(field.value)
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{label} must be a number, got {raw!r}") from None

        return Settings(
            system_prompt=self.query_one("#chat-system", TextArea).text.strip(),
            temperature=number("#chat-temperature", "temperature", float),
            top_p=number("#chat-top-p", "top-p", float),
            max_tokens=number("#chat-max-tokens", "max tokens", int),
        ).validated()

    def _save_settings(self, quiet: bool = False) -> bool:
        try:
            settings = self._read_settings()
        except ValueError as exc:
            if not quiet:
                # Under the conversation, where the eyes are, not only as a toast.
                self.query_one("#chat-status", Static).update(
                    Content.styled(f"chat settings: {exc}; fix it and press enter", "$error")
                )
                self.studio.report(f"chat settings: {exc}", "warning")
            return False
        except Exception:  # the screen is being torn down
            return False
        if settings != self.settings:
            self.settings = settings
            if self.conv is not None and self.history is not None:
                self.conv = self.history.set_settings(self.conv.id, settings)
        return True

    @on(Input.Submitted, "#chat-temperature, #chat-top-p, #chat-max-tokens")
    def _settings_submitted(self) -> None:
        if self._save_settings():
            self.query_one("#chat-prompt", Input).focus()

    @on(Input.Blurred, "#chat-temperature, #chat-top-p, #chat-max-tokens")
    def _settings_blurred(self) -> None:
        self._save_settings()

    def on_descendant_blur(self, event: Any) -> None:
        if getattr(event.widget, "id", None) == "chat-system":
            self._save_settings()

    # ---- asking -----------------------------------------------------------------------

    @on(Input.Submitted, "#chat-prompt")
    def _prompt_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if text.startswith("/") and text.split()[0] in COMMANDS:
            event.input.value = ""
            self._command(text)
            return
        if self.streaming:
            self._status("an answer is still coming: esc stops it")
            return
        if not self._save_settings():
            return
        ready = [p.name for p in self.cluster.placements if p.state == "ready"]
        if self._chosen_name() is None and len(ready) > 1:
            self._status(f"several placements are ready ({', '.join(ready)}): ctrl+l picks one")
            return
        event.input.value = ""
        self.ask(text)

    def ask(self, text: str) -> None:
        assert self.history is not None
        conv = self._ensure_conversation()
        if self._stopped is not None:
            # A stopped answer is a draft: asking again replaces it.
            self._drop_messages(list(self._stopped))
            self._stopped = None
        earlier = [m for m in self.history.messages(conv.id) if m.role == "user"]
        context = earlier[-1].content if earlier else ""
        selection, sent = self._documents_for(text, context)
        user = self.history.add_message(conv.id, "user", text, sent=sent)
        self.query_one(Transcript).mount(UserView(user))
        self._refresh_conv()
        self._answer(user, selection)

    def _documents_for(self, question: str, context: str) -> tuple[Selection | None, str | None]:
        assert self.history is not None and self.conv is not None
        docs = self.history.documents(self.conv.id)
        if not docs:
            return None, None
        passages: list[Passage] = []
        for doc in docs:
            if doc.id not in self._passages:
                self._passages[doc.id] = split_passages(doc.name, doc.text)
            passages += self._passages[doc.id]
        budget = prompt_budget_chars(self.settings.max_tokens, self._ratio())
        room = budget - len(self.settings.system_prompt) - len(question)
        selection = select_passages(passages, question, int(max(room, 0) * PASSAGE_SHARE), context)
        return selection, build_prompt(question, selection)

    def _ratio(self) -> float:
        """Characters per token for budgeting: learned from this placement's answers,
        else measured with its tokenizer if the model is on this machine, else a guess."""
        learned = self.chars_per_token.get(self._chosen_name() or "")
        if learned:
            return learned
        placement = self._chosen()
        local = local_chars_per_token(placement.model_dir) if placement else None
        return local or GUESS_CHARS_PER_TOKEN

    def _answer(self, user: Message, selection: Selection | None) -> None:
        assert self.history is not None and self.conv is not None
        placement = self._chosen_name()
        messages = [m for m in self.history.messages(self.conv.id) if m.id <= user.id]
        budget = prompt_budget_chars(self.settings.max_tokens, self._ratio())
        request, dropped = request_messages(self.settings.system_prompt, messages, budget)
        seed = random.randrange(1 << 31)
        params = {
            "max_tokens": self.settings.max_tokens,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            # A fresh seed per answer, so regenerating a sampled answer gives another;
            # it is kept in the history, so an answer can be reproduced.
            "seed": seed,
            "stop": [],
        }
        chosen = self._chosen()
        meta: dict[str, Any] = {
            "placement": placement or "",
            "nodes": list(chosen.nodes) if chosen else [],
            "seed": seed,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
        }
        if selection is not None:
            meta["passages"] = selection.used()
            if not selection.matched and not selection.whole:
                meta["unmatched"] = True
        if dropped:
            meta["dropped"] = dropped
        answer = self.history.add_message(self.conv.id, "assistant", "", meta=meta)
        view = AnswerView(answer)
        transcript = self.query_one(Transcript)
        transcript.mount(view)
        view.show_note(meta, live="waiting for the first token…")
        transcript.anchor()
        turn = Turn(
            user=user,
            answer=answer,
            view=view,
            stream=Markdown.get_stream(view.markdown),
            placement=placement,
            meta=meta,
            chars_sent=sum(len(m["content"]) for m in request),
        )
        turn.spark_at = turn.started
        self._turn = turn
        self._selected = None
        self.query_one("#chat-spark", Sparkline).data = []
        self._status(f"answering{f' on {placement}' if placement else ''} · esc stops")
        self._flush_timer.resume()
        self._worker = self.run_worker(
            self._stream(turn, {"messages": request}, params),
            group="chat-answer",
            exit_on_error=False,
        )

    async def _stream(self, turn: Turn, request: dict[str, Any], params: dict[str, Any]) -> None:
        ctl = self.controller
        if ctl is None:
            turn.error = "no cluster is connected (this is a fixed view)"
            await self._finish(turn)
            return
        generator = ctl.generate(turn.placement, request, params)
        try:
            async for msg in generator:
                if turn.stopped:
                    # Python 3.11's asyncio.wait_for (inside generate) swallows a cancel
                    # that lands as a token arrives; the flag catches that case.
                    break
                kind = msg.get("type")
                if kind == "accepted":
                    turn.prompt_tokens = int(msg.get("prompt_tokens", 0)) or None
                    # A short prompt is mostly chat template: it would teach a wrong ratio.
                    content_tokens = (turn.prompt_tokens or 0) - TEMPLATE_TOKENS
                    if turn.placement and turn.chars_sent >= CALIBRATE_CHARS and content_tokens > 0:
                        ratio = turn.chars_sent / content_tokens
                        self.chars_per_token[turn.placement] = min(max(ratio, 0.5), 8.0)
                elif kind == "delta":
                    if turn.first_at is None:
                        turn.first_at = time.monotonic()
                    turn.tokens += len(msg.get("tokens") or ()) or 1
                    text = printable(str(msg.get("text", "")))
                    if text:
                        turn.text += text
                        turn.pending.append(text)
                elif kind == "done":
                    turn.done = msg
        except GenerationError as exc:
            turn.error = str(exc)
        except asyncio.CancelledError:
            turn.stopped = True
            raise
        except Exception as exc:  # a bug or a broken wire: say it, keep the text
            turn.error = f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(Exception):
                await generator.aclose()
            await self._finish(turn)

    async def _flush(self) -> None:
        turn = self._turn
        if turn is None or turn.finished:
            return
        now = time.monotonic()
        if turn.pending:
            text = "".join(turn.pending)
            turn.pending.clear()
            await turn.stream.write(text)
        if now - turn.spark_at >= SPARK_S:
            rate = (turn.tokens - turn.spark_tokens) / (now - turn.spark_at)
            if turn.first_at is not None:
                turn.spark = [*turn.spark[-(SPARK_KEEP - 1) :], rate]
                self.query_one("#chat-spark", Sparkline).data = turn.spark
            turn.spark_at, turn.spark_tokens = now, turn.tokens
        if now - turn.saved_at >= CHECKPOINT_S and self.history is not None:
            turn.saved_at = now
            self.history.update_message(turn.answer.id, turn.text)
        self._show_live_figures(turn, now)

    def _show_live_figures(self, turn: Turn, now: float) -> None:
        state = "waiting for the first token" if turn.first_at is None else "answering"
        self.query_one("#chat-figures", Static).update(
            figures_text(turn.ttft_ms(), turn.tps(now), turn.prompt_tokens, turn.tokens, state)
        )
        live = f"{turn.tokens} tokens…" if turn.first_at else "waiting for the first token…"
        turn.view.show_note(turn.meta, live=live)

    def _show_stored_figures(self, meta: dict[str, Any]) -> None:
        state = "last answer" if meta else "no answer yet"
        self.query_one("#chat-figures", Static).update(
            figures_text(
                meta.get("ttft_ms"),
                meta.get("decode_tps"),
                meta.get("prompt_tokens"),
                int(meta.get("completion_tokens") or 0),
                state,
            )
        )
        self.query_one("#chat-spark", Sparkline).data = list(meta.get("spark", []))

    async def _finish(self, turn: Turn) -> None:
        if turn.finished:
            return
        turn.finished = True
        now = time.monotonic()
        done = turn.done or {}
        usage = done.get("usage") or {}
        timings = done.get("timings") or {}
        meta = dict(turn.meta)
        meta.update(
            ttft_ms=round(ttft, 1) if (ttft := turn.ttft_ms()) is not None else None,
            # The tail's own decode rate when it finished; the screen's figure otherwise.
            decode_tps=round(float(timings.get("decode_tps") or turn.tps(now) or 0.0), 2),
            prompt_tokens=usage.get("prompt_tokens", turn.prompt_tokens),
            completion_tokens=usage.get("completion_tokens", turn.tokens),
            finish_reason=done.get("finish_reason") or ("stopped" if turn.stopped else "error"),
            spark=[round(x, 1) for x in turn.spark],
        )
        if turn.error:
            meta["error"] = turn.error
        if turn.stopped and not turn.error:
            meta["stopped"] = True
        turn.meta = meta
        if self.history is not None:
            self.history.update_message(turn.answer.id, turn.text, meta)
        if self._leaving:
            if self.history is not None:
                self.history.close()
            return
        try:
            if turn.pending:
                await turn.stream.write("".join(turn.pending))
                turn.pending.clear()
            await turn.stream.stop()
            turn.view.show_note(meta)
            self._show_stored_figures(meta)
            self._flush_timer.pause()
            self._show_nodes()
            if turn.error:
                self._status(f"✗ {turn.error}")
                self.studio.report(f"chat: {turn.error}", "error")
            elif turn.stopped:
                self._status(
                    "stopped · edit the question and press enter to ask again · ctrl+r regenerates"
                )
            else:
                self._status("")
        except Exception as exc:  # the screen went away while the answer ended
            if self.is_attached:
                self.studio.report(f"chat display error: {exc}", "error")

    # ---- stop, regenerate ---------------------------------------------------------------

    def action_stop_or_leave(self) -> None:
        turn = self._turn
        if turn is not None and not turn.finished:
            turn.stopped = True
            self._stopped = (turn.user.id, turn.answer.id)
            prompt = self.query_one("#chat-prompt", Input)
            prompt.value = turn.user.content
            prompt.cursor_position = len(prompt.value)
            prompt.focus()
            self._status("stopping…")
            if self._worker is not None:
                self._worker.cancel()
            return
        focused = self.focused
        if focused is not None and focused.id not in ("chat-prompt", "chat-transcript"):
            self.query_one("#chat-prompt", Input).focus()
            return
        self.app.pop_screen()

    def action_regenerate(self) -> None:
        if self.streaming:
            self._status("an answer is still coming: esc stops it first")
            return
        if self.history is None or self.conv is None:
            self._status("nothing to regenerate yet")
            return
        if not self._save_settings():
            return
        messages = self.history.messages(self.conv.id)
        users = [m for m in messages if m.role == "user"]
        if not users:
            self._status("nothing to regenerate yet")
            return
        user = users[-1]
        self._drop_messages([m.id for m in messages if m.id > user.id])
        prompt = self.query_one("#chat-prompt", Input)
        if self._stopped is not None and prompt.value == user.content:
            prompt.value = ""
        self._stopped = None
        context = users[-2].content if len(users) > 1 else ""
        selection, sent = self._documents_for(user.content, context)
        if sent != user.sent:
            self.history.set_sent(user.id, sent)
            user = Message(user.id, user.conversation_id, user.created, "user", user.content, sent)
        self._answer(user, selection)

    def _drop_messages(self, ids: list[int]) -> None:
        assert self.history is not None
        self.history.delete_messages(ids)
        for view in list(self.query_one(Transcript).children):
            if isinstance(view, (UserView, AnswerView)) and view.message.id in ids:
                view.remove()

    # ---- copying ---------------------------------------------------------------------

    def _views(self) -> list[UserView | AnswerView]:
        return [
            v for v in self.query_one(Transcript).children if isinstance(v, (UserView, AnswerView))
        ]

    def _target(self) -> UserView | AnswerView | None:
        views = self._views()
        if self._selected is not None and 0 <= self._selected < len(views):
            return views[self._selected]
        answers = [v for v in views if isinstance(v, AnswerView)]
        return answers[-1] if answers else None

    def select_step(self, delta: int) -> None:
        views = self._views()
        if not views:
            return
        if self._selected is None:
            target = self._target()
            self._selected = views.index(target) if target in views else len(views) - 1
        else:
            self._selected = max(0, min(len(views) - 1, self._selected + delta))
        for i, view in enumerate(views):
            view.set_class(i == self._selected, "-selected")
        self.query_one(Transcript).scroll_to_widget(views[self._selected], animate=False)

    def action_copy_answer(self) -> None:
        target = self._target()
        if target is None or not target.text:
            self._status("no answer to copy yet")
            return
        self.app.copy_to_clipboard(target.text)
        what = "the answer" if isinstance(target, AnswerView) else "the question"
        self.app.notify(f"copied {what} ({len(target.text):,} characters)", timeout=2)

    def action_copy_code(self) -> None:
        target = self._target()
        blocks = code_blocks(target.text) if target is not None else []
        if target is None or not blocks:
            self._status("no code block in this answer")
            return
        # Pressing again copies the next block of the same answer.
        last_id, last_index = self._code_at
        index = (last_index + 1) % len(blocks) if last_id == target.message.id else 0
        self._code_at = (target.message.id, index)
        self.app.copy_to_clipboard(blocks[index])
        self.app.notify(f"copied code block {index + 1} of {len(blocks)}", timeout=2)

    def action_focus_prompt(self) -> None:
        self.query_one("#chat-prompt", Input).focus()

    def action_pick_placement(self) -> None:
        select = self.query_one("#chat-placement", Select)
        select.focus()
        select.expanded = True

    # ---- conversations, documents ---------------------------------------------------

    def action_conversations(self) -> None:
        if self.streaming:
            self._status("an answer is still coming: esc stops it first")
            return
        assert self.history is not None
        self._save_settings(quiet=True)
        self.app.push_screen(
            ConversationsScreen(
                self.history, self.conv.id if self.conv else None, self.studio.home / "exports"
            ),
            self._after_list,
        )

    def _after_list(self, choice: ListChoice | None) -> None:
        assert self.history is not None
        if choice is not None and choice.action == "open" and choice.conversation_id is not None:
            self.open_conversation(self.history.get(choice.conversation_id))
        elif choice is not None and choice.action == "new":
            self.open_conversation(None)
        else:
            self._refresh_conv()  # renamed or deleted while the list was open
        self.query_one("#chat-prompt", Input).focus()

    def action_new_conversation(self) -> None:
        if self.streaming:
            self._status("an answer is still coming: esc stops it first")
            return
        self._save_settings(quiet=True)
        self.open_conversation(None)

    def action_attach(self) -> None:
        def chosen(path: Path | None) -> None:
            if path is not None:
                self.attach(path)

        self.app.push_screen(AttachScreen(PathSuggester()), chosen)

    def attach(self, path: Path) -> None:
        self.run_worker(self._attach_document(path), group="chat-attach", exit_on_error=False)

    async def _attach_document(self, path: Path) -> None:
        try:
            kind, text = await asyncio.to_thread(read_document, path)
        except DocumentError as exc:
            self.studio.report(f"cannot attach: {exc}", "warning")
            return
        except OSError as exc:
            self.studio.report(f"cannot attach {path}: {exc.strerror or exc}", "warning")
            return
        assert self.history is not None
        conv = self._ensure_conversation()
        doc = self.history.add_document(
            conv.id, path.name, text, source=str(path.expanduser().resolve()), kind=kind
        )
        self._passages[doc.id] = split_passages(doc.name, doc.text)
        count, words = len(self._passages[doc.id]), len(text.split())
        self.app.notify(f"attached {doc.name}: {words:,} words in {count} passages", timeout=3)
        self._show_docs()

    def _show_docs(self) -> None:
        box = self.query_one("#chat-docs", Static)
        docs = self.history.documents(self.conv.id) if self.history and self.conv else []
        if not docs:
            box.update(Content.styled("no document attached · ctrl+t or /attach", "$text-muted"))
            return
        lines = [Content.styled("Documents", "bold")]
        for doc in docs:
            words = len(doc.text.split())
            lines.append(Content.assemble(f"{doc.name} ", (f"{words:,} words", "$text-muted")))
        box.update(Content("\n").join(lines))

    def _command(self, text: str) -> None:
        assert self.history is not None
        word, _, rest = text.partition(" ")
        rest = rest.strip()
        if word == "/attach":
            if not rest:
                self.action_attach()
            else:
                self.attach(Path(rest))
        elif word == "/detach":
            if self.conv is None:
                self._status("no document attached")
                return
            docs = self.history.documents(self.conv.id)
            gone = [d for d in docs if not rest or d.name == rest]
            if not gone:
                names = ", ".join(d.name for d in docs) or "none"
                self._status(f"no document named {rest!r} (attached: {names})")
                return
            for doc in gone:
                self.history.remove_document(doc.id)
            self._status(f"detached {', '.join(d.name for d in gone)}")
            self._show_docs()
        elif word == "/rename":
            if not rest:
                self._status("usage: /rename TITLE")
                return
            conv = self._ensure_conversation()
            self.conv = self.history.rename(conv.id, rest)
            self._show_title()
        elif word == "/system":
            self.query_one("#chat-system", TextArea).text = rest
            if self._save_settings():
                self._status("system prompt set" if rest else "system prompt cleared")
        elif word == "/new":
            self.action_new_conversation()
        elif word == "/export":
            if self.conv is None:
                self._status("nothing to export yet")
                return
            path = self.history.export_file(self.conv.id, self.studio.home / "exports")
            self.studio.report(f"exported {self.conv.display_title!r} to {path}")
        elif word == "/help":
            self._status(" · ".join(COMMANDS.values()))

    def _status(self, text: str) -> None:
        self.query_one("#chat-status", Static).update(Content(text))
