"""The chat screen: talk to a placement, watch it work, keep the conversation.

A view of a `ChatSession` (studiotui/chat/conversation.py), which owns the
conversation: the history, the prompt's budget, the passages of attached documents,
the slash commands and the answer's stream. The screen reads the widgets, forwards
what the operator does, and draws the session's state.

The answer arrives from the cluster as one message per token, at the pipeline's
full rate. Drawing each token would make the screen (and so the keys) lag behind a
fast model, so the session only collects tokens as they come and a timer draws what
has arrived FLUSH_HZ times a second, through Textual's MarkdownStream (which
coalesces further if a redraw is still running). Figures are redrawn on the same
tick.

Stopping cancels the worker that runs the session's answer: the cancel reaches the
cluster and frees the KV cache on every shard; the text that had arrived stays, in
the transcript and in the history.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass
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
from studiotui.app.render import Drawing
from studiotui.app.screens.conversations import AttachScreen, ConversationsScreen, ListChoice
from studiotui.chat.commands import Command, complete_path, parse_command, suggest
from studiotui.chat.conversation import ChatSession, Reply, Target, Turn
from studiotui.chat.history import Conversation, Message, Settings, passages_note
from studiotui.chat.store import HistoryStore
from studiotui.cluster.controller import Controller
from studiotui.core.errors import StudioError
from studiotui.core.state import ClusterState, PlacementState

FLUSH_HZ = 15
SPARK_S = 0.25
SPARK_KEEP = 120
POLL_S = 1.0


# ---- pure helpers (tested without a screen) --------------------------------------------


def code_blocks(markdown: str) -> list[str]:
    tokens = MarkdownIt("commonmark").parse(markdown)
    return [t.content for t in tokens if t.type in ("fence", "code_block")]


class PromptSuggester(Suggester):
    """Completes slash commands, and paths after /attach."""

    def __init__(self) -> None:
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        return suggest(value)


class PathSuggester(Suggester):
    def __init__(self) -> None:
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        return complete_path(value)


def placement_option(p: PlacementState) -> str:
    """A placement as the picker lists it: its name, the adapter its shards apply (a
    placement with one answers otherwise than its base), and its state unless ready."""
    text = f"{p.name} · adapter {p.adapter}" if p.adapter else p.name
    return text if p.state == "ready" else f"{text} ({p.state})"


def shard_role(index: int, count: int) -> str:
    if count == 1:
        return "whole"
    return "head" if index == 0 else "tail" if index == count - 1 else "middle"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def nodes_card(placement: PlacementState, mine: bool, width: int) -> Content:
    """The placement's shards (node, role, layers, requests in flight, state) in
    `width` cells: the role column goes first when they do not fit, then node names
    are cut (…), so no row folds in the narrow side panel."""
    rows = [
        (
            s.node,
            shard_role(s.index, s.count),
            f"{s.start}–{s.end}",
            # Requests in flight on the shard, from the agents' telemetry (other clients too).
            str(s.in_flight) if s.in_flight else "",
            "" if s.state == "ready" else s.state,
            mine or s.in_flight > 0,
        )
        for s in placement.shards
    ]
    layers_w = max([6, *(len(r[2]) for r in rows)])
    state_w = max([0, *(len(r[4]) + 1 for r in rows)])
    node_w = max([4, *(len(r[0]) for r in rows)])
    fixed = 2 + 1 + layers_w + 1 + 4 + state_w  # mark, layers, reqs and states
    with_role = fixed + 7 + node_w <= width
    if not with_role:
        node_w = max(4, min(node_w, width - fixed))
    head = f"  {'node':<{node_w}}" + (f" {'role':<6}" if with_role else "")
    lines = [
        Content.styled(_cut(f"Nodes · {placement.name} ({placement.label})", width), "bold"),
        Content.styled(f"{head} {'layers':<{layers_w}} {'reqs':>4}", "$text-muted"),
    ]
    for node, role, layers, reqs, state, working in rows:
        mark = ("● ", "$success bold") if working else ("○ ", "$text-muted")
        rest = (f" {role:<6}" if with_role else "") + f" {layers:<{layers_w}} {reqs:>4}"
        lines.append(
            Content.assemble(
                mark,
                (f"{_cut(node, node_w):<{node_w}}", "bold" if working else ""),
                (rest + (f" {state}" if state else ""), "$text-muted"),
            )
        )
    return Content("\n").join(lines)


def figures_text(
    ttft_ms: float | None,
    tps: float | None,
    tokens_in: int | None,
    tokens_out: int,
    state: str,
    acceptance: float | None = None,
) -> Content:
    def figure(label: str, value: str) -> Content:
        return Content.assemble((f"{label:<12}", "$text-muted"), (value, "bold"))

    lines = [
        Content.styled(state, "$accent bold"),
        figure("first token", f"{ttft_ms:,.0f} ms" if ttft_ms is not None else "–"),
        figure("speed", f"{tps:,.1f} tok/s" if tps else "–"),
        # Speculative decoding: the share of guesses kept, beside the speed it brought.
        *([figure("guesses kept", f"{acceptance:.0%}")] if acceptance is not None else []),
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
        if meta.get("acceptance") is not None:
            figures.append(f"{meta['acceptance']:.0%} of guesses kept")
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


@dataclass
class Showing:
    """The answer being drawn: the session's turn, and where it is drawn."""

    turn: Turn
    view: AnswerView
    stream: MarkdownStream


# ---- the screen ------------------------------------------------------------------------


@guard_actions
class ChatScreen(Screen[None]):
    CSS_PATH = "chat.tcss"
    AUTO_FOCUS = "#chat-prompt"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop_or_leave", "Stop / back", id="chat-stop"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="chat-regenerate"),
        # Out of the footer so the rest fits 80 columns: /help names them (KEYS_HELP).
        Binding("ctrl+y", "copy_answer", "Copy answer", show=False, id="chat-copy"),
        Binding("ctrl+b", "copy_code", "Copy code", show=False, id="chat-copy-code"),
        Binding("ctrl+o", "conversations", "Conversations", id="chat-conversations"),
        Binding("ctrl+n", "new_conversation", "New", id="chat-new"),
        Binding("ctrl+t", "attach", "Attach", id="chat-attach"),
        Binding("ctrl+l", "pick_placement", "Placement", show=False, id="chat-placement"),
    ]

    def __init__(self) -> None:
        super().__init__(id="chat-screen")
        # Made on mount, when the app (and so the history's home) is known.
        self._session: ChatSession | None = None
        self._showing: Showing | None = None
        self._worker: Worker[None] | None = None
        self._selected: int | None = None
        self._code_at: tuple[int, int] = (-1, -1)  # (answer id, block index) last copied
        self._options: list[tuple[str, str]] = []
        self._leaving = False

    @property
    def studio(self) -> Dashboard:
        return cast(Dashboard, self.app)

    @property
    def session(self) -> ChatSession:
        assert self._session is not None, "the chat's session is made on mount"
        return self._session

    @property
    def conv(self) -> Conversation | None:
        """The open conversation's record (None until its first question)."""
        return self._session.conversation if self._session else None

    @property
    def turn(self) -> Turn | None:
        """The answer being made, or the last one made on this screen."""
        return self._session.turn if self._session else None

    @property
    def streaming(self) -> bool:
        """An answer is being asked for, made or drawn."""
        return self._worker is not None and not self._worker.is_finished

    # ---- layout ---------------------------------------------------------------------

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
                # Drawn for the width it has (a scrollbar takes a cell of the side's 30).
                yield Drawing(self._nodes_card, id="chat-nodes")
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

    async def on_mount(self) -> None:
        self.query_one("#chat-side").border_title = "Answer"
        self.query_one("#chat-transcript").border_title = "Conversation"
        self._flush_timer = self.set_interval(1 / FLUSH_HZ, self._flush, pause=True)
        store, problem = await HistoryStore.open(self.studio.home, self._history_failed)
        if problem is not None:
            self.studio.report(
                f"chat history unavailable ({problem}); this session's chat will not be kept",
                "error",
            )
        elif store.note:
            self.studio.report(store.note, "warning")
        self._session = ChatSession(store, self.studio.home / "exports")
        await self.session.open_latest()
        self._show_conversation()
        self.set_interval(POLL_S, self._poll_cluster)
        self._poll_cluster()

    def _history_failed(self, problem: str) -> None:
        if self.is_attached:
            self.studio.report(f"chat history: {problem}", "error")

    def on_screen_resume(self) -> None:
        # Whatever had the keys when the chat was left, typing goes to the Ask box.
        self.query_one("#chat-prompt", Input).focus()
        if self._session is not None:  # not the first showing: on_mount did this
            self._poll_cluster()
            # A notice about what was done before leaving ("no code block in this
            # answer") is stale on coming back; an answer still coming keeps its line.
            if not self.streaming:
                self._status("")

    def on_screen_suspend(self) -> None:
        self._save_settings(quiet=True)

    def on_unmount(self) -> None:
        self._leaving = True
        if self._session is None:
            return
        self._save_settings(quiet=True)
        # The answer still coming is kept as it is (stopped) and the history closes
        # once every write is done; the cancel then frees the cluster's caches.
        self.session.close()
        if self._worker is not None and not self._worker.is_finished:
            self._worker.cancel()

    # ---- conversations ----------------------------------------------------------------

    async def open_conversation(self, conversation_id: int | None) -> None:
        """Show a conversation (None: a new one, created when first used)."""
        await self.session.open(conversation_id)
        self._show_conversation()

    def _show_conversation(self) -> None:
        session = self.session
        self._selected = None
        transcript = self.query_one(Transcript)
        transcript.remove_children()
        views: list[UserView | AnswerView] = []
        last_meta: dict[str, Any] = {}
        for m in session.messages:
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
        self._show_settings(session.settings)
        self._show_title()
        self._show_docs()
        self._show_stored_figures(last_meta)
        self._status("")
        conv = session.conversation
        if conv is not None and conv.placement and conv.placement in dict(self._options).values():
            self.query_one("#chat-placement", Select).value = conv.placement

    def _show_settings(self, settings: Settings) -> None:
        self.query_one("#chat-system", TextArea).text = settings.system_prompt
        self.query_one("#chat-temperature", Input).value = f"{settings.temperature:g}"
        self.query_one("#chat-top-p", Input).value = f"{settings.top_p:g}"
        self.query_one("#chat-max-tokens", Input).value = str(settings.max_tokens)

    def _show_title(self) -> None:
        conv = self.session.conversation
        title = conv.display_title if conv else "new conversation"
        self.query_one("#chat-title", Static).update(Content(title))
        self.sub_title = f"chat · {title}"

    async def _refresh_conv(self) -> None:
        if await self.session.refresh():
            self._show_title()
        else:  # deleted while the list was open
            self._show_conversation()

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
            conv = self.session.conversation
            wanted = before or (conv.placement if conv else None)
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

    def _destination(self) -> Target:
        return Target(self._chosen_name(), self._chosen())

    def _show_nodes(self) -> None:
        self.query_one("#chat-nodes", Drawing).redraw()

    def _nodes_card(self, width: int) -> Content:
        placement = self._chosen()
        if placement is None:
            return Content.styled("no placement chosen", "$text-muted")
        turn = self.turn
        mine = turn is not None and not turn.finished and turn.placement == placement.name
        return nodes_card(placement, mine, width)

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id != "chat-placement":
            return
        if self._session is not None and event.value is not Select.BLANK:
            self.session.use_placement(str(event.value))
        self._show_nodes()
        if event.select.has_focus and not event.select.expanded:
            # Picked by hand (ctrl+l): the next keys are the question, not the menu's.
            self.query_one("#chat-prompt").focus()

    # ---- settings ---------------------------------------------------------------------

    def _read_settings(self) -> Settings:
        in_force = self.session.settings

        def number(selector: str, label: str, kind: type) -> Any:
            field = self.query_one(selector, Input)
            raw = field.value.strip()
            if not raw:
                # Emptied on the way to typing a new value: keep the one in force,
                # say so, and put it back so the field shows what is used.
                kept = getattr(in_force, label.replace(" ", "_").replace("-", "_"))
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
        if self._session is None:
            return False
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
        self.session.use_settings(settings)
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
        if not text or self._session is None:
            return
        command = parse_command(text)
        if command is not None:
            event.input.value = ""
            self.run_worker(self._command(command), group="chat-command", exit_on_error=False)
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
        self._start(self.session.ask(text, self._destination()))

    def _start(self, turn: Awaitable[Turn]) -> None:
        self._worker = self.run_worker(self._answer(turn), group="chat-answer", exit_on_error=False)

    async def _answer(self, starting: Awaitable[Turn]) -> None:
        try:
            turn = await starting
        except StudioError as exc:  # nothing to regenerate, the history gone, …
            self._status(str(exc))
            return
        self._show_turn(turn)
        try:
            await self.session.run(turn, self.controller)
        finally:
            await self._show_end()

    def _show_turn(self, turn: Turn) -> None:
        transcript = self.query_one(Transcript)
        for view in list(transcript.children):
            if isinstance(view, (UserView, AnswerView)) and view.message.id in turn.replaced:
                view.remove()
        if not any(
            isinstance(v, UserView) and v.message.id == turn.user.id for v in transcript.children
        ):
            transcript.mount(UserView(turn.user))
        view = AnswerView(turn.answer)
        transcript.mount(view)
        view.show_note(turn.meta, live="waiting for the first token…")
        transcript.anchor()
        self._showing = Showing(turn, view, Markdown.get_stream(view.markdown))
        self._selected = None
        self._show_title()
        self.query_one("#chat-spark", Sparkline).data = []
        placement = turn.placement
        self._status(f"answering{f' on {placement}' if placement else ''} · esc stops")
        self._flush_timer.resume()

    async def _flush(self) -> None:
        showing = self._showing
        if showing is None or showing.turn.finished:
            return
        turn = showing.turn
        now = time.monotonic()
        text = turn.take_pending()
        if text:
            await showing.stream.write(text)
        if turn.sample_rate(now, SPARK_S, SPARK_KEEP):
            self.query_one("#chat-spark", Sparkline).data = turn.spark
        self._show_live_figures(showing, now)

    def _show_live_figures(self, showing: Showing, now: float) -> None:
        turn = showing.turn
        state = "waiting for the first token" if turn.first_at is None else "answering"
        self.query_one("#chat-figures", Static).update(
            figures_text(turn.ttft_ms(), turn.tps(now), turn.prompt_tokens, turn.tokens, state)
        )
        live = f"{turn.tokens} tokens…" if turn.first_at else "waiting for the first token…"
        showing.view.show_note(turn.meta, live=live)

    def _show_stored_figures(self, meta: dict[str, Any]) -> None:
        state = "last answer" if meta else "no answer yet"
        self.query_one("#chat-figures", Static).update(
            figures_text(
                meta.get("ttft_ms"),
                meta.get("decode_tps"),
                meta.get("prompt_tokens"),
                int(meta.get("completion_tokens") or 0),
                state,
                meta.get("acceptance"),
            )
        )
        self.query_one("#chat-spark", Sparkline).data = list(meta.get("spark", []))

    async def _show_end(self) -> None:
        """Draw the answer as it ended (the session has kept it by now)."""
        showing = self._showing
        if self._leaving or showing is None:
            return
        turn, meta = showing.turn, showing.turn.meta
        try:
            rest = turn.take_pending()
            if rest:
                await showing.stream.write(rest)
            await showing.stream.stop()
            showing.view.show_note(meta)
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
        turn = self.session.stop() if self._session is not None else None
        if turn is not None:
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
        question = self.session.last_question() if self._session is not None else None
        if question is None:
            self._status("nothing to regenerate yet")
            return
        if not self._save_settings():
            return
        prompt = self.query_one("#chat-prompt", Input)
        if self.session.draft is not None and prompt.value == question.content:
            prompt.value = ""
        self._start(self.session.regenerate(self._destination()))

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
        self._save_settings(quiet=True)
        conv = self.session.conversation
        self.app.push_screen(
            ConversationsScreen(
                self.session.store, conv.id if conv else None, self.studio.home / "exports"
            ),
            self._after_list,
        )

    async def _after_list(self, choice: ListChoice | None) -> None:
        if choice is not None and choice.action == "open" and choice.conversation_id is not None:
            await self.open_conversation(choice.conversation_id)
        elif choice is not None and choice.action == "new":
            await self.open_conversation(None)
        else:
            await self._refresh_conv()  # renamed or deleted while the list was open
        self.query_one("#chat-prompt", Input).focus()

    async def action_new_conversation(self) -> None:
        if self.streaming:
            self._status("an answer is still coming: esc stops it first")
            return
        self._save_settings(quiet=True)
        await self.open_conversation(None)

    def action_attach(self) -> None:
        def chosen(path: Path | None) -> None:
            if path is not None:
                self.attach(path)

        self.app.push_screen(AttachScreen(PathSuggester()), chosen)

    def attach(self, path: Path) -> None:
        self.run_worker(
            self._command(Command("/attach", str(path))), group="chat-command", exit_on_error=False
        )

    def _show_docs(self) -> None:
        box = self.query_one("#chat-docs", Static)
        docs = self.session.documents
        if not docs:
            box.update(Content.styled("no document attached · ctrl+t or /attach", "$text-muted"))
            return
        lines = [Content.styled("Documents", "bold")]
        for doc in docs:
            words = len(doc.text.split())
            lines.append(Content.assemble(f"{doc.name} ", (f"{words:,} words", "$text-muted")))
        box.update(Content("\n").join(lines))

    async def _command(self, command: Command) -> None:
        reply = await self.session.command(command, self._chosen_name() or "")
        self._show_reply(reply)
        if reply.then == "pick-file":
            self.action_attach()
        elif reply.then == "new":
            await self.action_new_conversation()

    def _show_reply(self, reply: Reply) -> None:
        if "title" in reply.redraw:
            self._show_title()
        if "documents" in reply.redraw:
            self._show_docs()
        if "system" in reply.redraw:
            self.query_one("#chat-system", TextArea).text = self.session.settings.system_prompt
        if reply.status:
            self._status(reply.status)
        if reply.notify:
            self.app.notify(reply.notify, timeout=3)
        if reply.report:
            self.studio.report(reply.report, reply.level)

    def _status(self, text: str) -> None:
        self.query_one("#chat-status", Static).update(Content(text))
