"""One conversation being had: what the chat screen drives, with no screen in it.

`ChatSession` owns the open conversation (its record, messages, documents and
settings), turns a question into a request that fits the context (earlier turns
and document passages within a budget), streams the answer from the cluster into a
`Turn` the screen draws from, runs the slash commands, and keeps the history in
SQLite, every write queued to the history's own thread (`HistoryStore`) in the
order it was made, so the event loop never waits for a disk.

Stopping is cancelling the task that runs `run`: the CancelledError lands inside
`Controller.generate` at its await, and its `finally` sends the cancel that frees
the KV cache on every shard. Whatever text had arrived is kept, in the turn and in
the history, whether the answer stopped, failed or finished; `close` keeps it too
when the chat goes away mid-answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from studiotui.chat.budget import (
    GUESS_CHARS_PER_TOKEN,
    learned_ratio,
    passage_room,
    prompt_budget_chars,
    request_messages,
)
from studiotui.chat.commands import Command, help_text
from studiotui.chat.documents import Selection, build_prompt, local_chars_per_token, select_passages
from studiotui.chat.history import (
    Conversation,
    Document,
    History,
    HistoryError,
    Message,
    Settings,
)
from studiotui.chat.store import HistoryStore
from studiotui.cluster.controller import Controller, GenerationError
from studiotui.core.documents import Passage, read_document, split_passages
from studiotui.core.errors import StudioError
from studiotui.core.state import LogLevel, PlacementState
from studiotui.core.text import printable
from worker.shared.protocol import control

CHECKPOINT_S = 2.0  # a crash mid-answer loses at most this much text
NO_CLUSTER = "no cluster is connected (this is a fixed view)"


class ChatError(StudioError):
    """Something asked of the conversation that cannot be done now (said as is)."""


@dataclass(frozen=True)
class Target:
    """Where a question goes: the placement chosen by name, and its state when the
    cluster knows it (for its nodes and its model's tokenizer)."""

    name: str | None = None
    placement: PlacementState | None = None


def _context(target: Target) -> int | None:
    """The tokens the target placement's shards reserved room for, if it is known."""
    return target.placement.context_tokens if target.placement else None


@dataclass
class Turn:
    """One answer being made: what was sent, and what has come back so far."""

    user: Message
    answer: Message
    placement: str | None
    request: dict[str, Any]
    params: dict[str, Any]
    meta: dict[str, Any]
    chars_sent: int
    replaced: tuple[int, ...] = ()  # ids of the messages this turn took the place of
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
    done: control.Done | None = None
    error: str | None = None
    stopped: bool = False
    # The final write, once queued; `finished` once it is in the history.
    saved: Future[None] | None = None
    finished: bool = False

    def __post_init__(self) -> None:
        self.spark_at = self.started

    def ttft_ms(self) -> float | None:
        return None if self.first_at is None else (self.first_at - self.started) * 1000

    def tps(self, now: float) -> float | None:
        if self.first_at is None or self.tokens < 2 or now <= self.first_at:
            return None
        return (self.tokens - 1) / (now - self.first_at)

    def take_pending(self) -> str:
        """The text that arrived since the last call (for the screen to draw)."""
        text = "".join(self.pending)
        self.pending.clear()
        return text

    def sample_rate(self, now: float, every: float, keep: int) -> bool:
        """Add a tokens-per-second sample when `every` seconds have passed since the
        last; True when the figures gained one."""
        if now - self.spark_at < every:
            return False
        rate = (self.tokens - self.spark_tokens) / (now - self.spark_at)
        added = self.first_at is not None
        if added:
            self.spark = [*self.spark[-(keep - 1) :], rate]
        self.spark_at, self.spark_tokens = now, self.tokens
        return added

    def final_meta(self, now: float) -> dict[str, Any]:
        """The answer's meta as the history keeps it once the answer has ended."""
        if self.tokens > self.spark_tokens and now > self.spark_at:
            # The stretch since the last sample ends the line: an answer shorter than a
            # few sample periods (or one whose redraws a busy machine delayed) still
            # draws one, and its last part counts.
            self.sample_rate(now, 0.0, len(self.spark) + 1)
        done = self.done
        usage = done.usage if done else {}
        timings = done.timings if done else {}
        meta = dict(self.meta)
        meta.update(
            ttft_ms=round(ttft, 1) if (ttft := self.ttft_ms()) is not None else None,
            # The tail's own decode rate when it finished; the chat's own figure otherwise.
            decode_tps=round(float(timings.get("decode_tps") or self.tps(now) or 0.0), 2),
            prompt_tokens=usage.get("prompt_tokens", self.prompt_tokens),
            completion_tokens=usage.get("completion_tokens", self.tokens),
            # Of the prompt's tokens, those the placement's prefix cache served.
            cached_tokens=int(usage.get("cached_tokens") or 0),
            finish_reason=(done.finish_reason if done else "")
            or ("stopped" if self.stopped else "error"),
            spark=[round(x, 1) for x in self.spark],
        )
        if (rate := acceptance(usage)) is not None:
            meta["acceptance"] = rate
        if self.error:
            meta["error"] = self.error
        if self.stopped and not self.error:
            meta["stopped"] = True
        return meta


def acceptance(usage: dict[str, Any]) -> float | None:
    """The share of speculative decoding's guesses the answer kept (OpenAI's
    accepted/rejected_prediction_tokens); None when nothing was guessed."""
    details = usage.get("completion_tokens_details") or {}
    kept = int(details.get("accepted_prediction_tokens") or 0)
    made = kept + int(details.get("rejected_prediction_tokens") or 0)
    return round(kept / made, 3) if made else None


@dataclass(frozen=True)
class Reply:
    """What a slash command has to show. `then` is what only the screen can do:
    "pick-file" (the attach dialog) or "new" (a new conversation)."""

    status: str = ""  # the line under the conversation
    report: str = ""  # for the dashboard's log (and a toast)
    level: LogLevel = "info"  # of the report
    notify: str = ""  # a toast only
    redraw: frozenset[str] = frozenset()  # "title", "documents", "system"
    then: str = ""


class ChatSession:
    # Learned per placement from each answer's prompt token count; shared by every
    # session of the process, since it is a fact about the model's tokenizer.
    chars_per_token: ClassVar[dict[str, float]] = {}

    def __init__(self, store: HistoryStore, exports: Path) -> None:
        self.store = store
        self.exports = exports
        self.conversation: Conversation | None = None
        self.settings = Settings()
        self.messages: list[Message] = []
        self.documents: list[Document] = []
        self.turn: Turn | None = None
        # (question id, answer id) of a stopped answer: a draft that asking replaces.
        self.draft: tuple[int, int] | None = None
        self._passages: dict[int, list[Passage]] = {}
        # Commands run one at a time, in the order they were typed.
        self._commands = asyncio.Lock()

    @property
    def answering(self) -> bool:
        return self.turn is not None and not self.turn.finished

    # ---- conversations ------------------------------------------------------------

    async def open(self, conversation_id: int | None) -> None:
        """Make a conversation the open one (None: a new one, created when first used)."""
        if conversation_id is None:
            conv, messages, documents = None, [], []
        else:
            conv = await self.store.call(History.get, conversation_id)
            messages = await self.store.call(History.messages, conversation_id)
            documents = await self.store.call(History.documents, conversation_id)
        self.conversation, self.messages, self.documents = conv, messages, documents
        self.settings = conv.settings if conv else Settings()
        self.draft = None
        self._passages = await asyncio.to_thread(
            lambda: {d.id: split_passages(d.name, d.text) for d in documents}
        )

    async def open_latest(self) -> None:
        latest = await self.store.call(History.latest)
        await self.open(latest.id if latest else None)

    async def refresh(self) -> bool:
        """Read the open conversation's record again (renamed or deleted elsewhere);
        False when it is gone and a new one is open instead."""
        if self.conversation is None:
            return True
        try:
            self.conversation = await self.store.call(History.get, self.conversation.id)
        except HistoryError:
            await self.open(None)
            return False
        return True

    async def conversations(self) -> list[Conversation]:
        return await self.store.call(History.conversations)

    async def _ensure_conversation(self, placement: str) -> Conversation:
        if self.conversation is None:
            self.conversation = await self.store.call(History.create, "", placement, self.settings)
        return self.conversation

    def use_settings(self, settings: Settings) -> None:
        """The settings the next question goes with (validated by the caller)."""
        if settings == self.settings:
            return
        self.settings = settings
        if self.conversation is not None:
            self.conversation = replace(self.conversation, settings=settings)
            self.store.write(History.set_settings, self.conversation.id, settings)

    def use_placement(self, name: str) -> None:
        if self.conversation is not None and name != self.conversation.placement:
            self.conversation = replace(self.conversation, placement=name)
            self.store.write(History.set_placement, self.conversation.id, name)

    async def rename(self, title: str, placement: str = "") -> Conversation:
        conv = await self._ensure_conversation(placement)
        self.conversation = await self.store.call(History.rename, conv.id, title)
        return self.conversation

    async def export(self) -> Path:
        if self.conversation is None:
            raise ChatError("nothing to export yet")
        return await self.store.call(History.export_file, self.conversation.id, self.exports)

    # ---- documents ------------------------------------------------------------------

    async def attach(self, path: Path, placement: str = "") -> tuple[Document, int]:
        """Attach a file to the conversation: (the document, its passage count).
        DocumentError or OSError say why not; nothing is stored then."""
        kind, text = await asyncio.to_thread(read_document, path)
        conv = await self._ensure_conversation(placement)
        source = str(path.expanduser().resolve())
        doc = await self.store.call(History.add_document, conv.id, path.name, text, source, kind)
        self._passages[doc.id] = await asyncio.to_thread(split_passages, doc.name, doc.text)
        self.documents.append(doc)
        return doc, len(self._passages[doc.id])

    def detach(self, name: str = "") -> list[Document]:
        """Remove the document called `name` (every one when empty)."""
        if self.conversation is None:
            raise ChatError("no document attached")
        gone = [d for d in self.documents if not name or d.name == name]
        if not gone:
            names = ", ".join(d.name for d in self.documents) or "none"
            raise ChatError(f"no document named {name!r} (attached: {names})")
        for doc in gone:
            self.store.write(History.remove_document, doc.id)
            self._passages.pop(doc.id, None)
        self.documents = [d for d in self.documents if d not in gone]
        return gone

    async def _passages_for(
        self, question: str, context: str, target: Target
    ) -> tuple[Selection | None, str | None]:
        """The passages to send with `question`, and the user message they make."""
        if not self.documents:
            return None, None
        passages = [p for d in self.documents for p in self._passages.get(d.id, [])]
        budget = prompt_budget_chars(
            self.settings.max_tokens, await self.ratio(target), _context(target)
        )
        room = passage_room(budget, self.settings.system_prompt, question)
        # BM25 over a long document is CPU work: off the event loop too.
        selection = await asyncio.to_thread(select_passages, passages, question, room, context)
        return selection, build_prompt(question, selection)

    async def ratio(self, target: Target) -> float:
        """Characters per token for budgeting: learned from this placement's answers,
        else measured with its tokenizer if the model is on this machine, else a guess."""
        learned = self.chars_per_token.get(target.name or "")
        if learned:
            return learned
        placement = target.placement
        local = (
            await asyncio.to_thread(local_chars_per_token, placement.model_dir)
            if placement
            else None
        )
        return local or GUESS_CHARS_PER_TOKEN

    # ---- asking ---------------------------------------------------------------------

    async def ask(self, text: str, target: Target) -> Turn:
        """Store the question and an empty answer; the turn to `run`. A stopped
        answer left as a draft is replaced (its question and answer go)."""
        conv = await self._ensure_conversation(target.name or "")
        replaced: tuple[int, ...] = ()
        if self.draft is not None:
            replaced, self.draft = self.draft, None
            self._drop(list(replaced))
        earlier = [m for m in self.messages if m.role == "user"]
        context = earlier[-1].content if earlier else ""
        selection, sent = await self._passages_for(text, context, target)
        user = await self.store.call(History.add_message, conv.id, "user", text, sent)
        self.messages.append(user)
        # The first question names an untitled conversation.
        self.conversation = await self.store.call(History.get, conv.id)
        return await self._start(user, selection, target, replaced)

    def last_question(self) -> Message | None:
        users = [m for m in self.messages if m.role == "user"]
        return users[-1] if users else None

    async def regenerate(self, target: Target) -> Turn:
        """Answer the last question again, in place of what followed it."""
        users = [m for m in self.messages if m.role == "user"]
        if self.conversation is None or not users:
            raise ChatError("nothing to regenerate yet")
        user = users[-1]
        replaced = tuple(m.id for m in self.messages if m.id > user.id)
        self._drop(list(replaced))
        self.draft = None
        context = users[-2].content if len(users) > 1 else ""
        selection, sent = await self._passages_for(user.content, context, target)
        if sent != user.sent:
            self.store.write(History.set_sent, user.id, sent)
            user = replace(user, sent=sent)
            self.messages = [user if m.id == user.id else m for m in self.messages]
        return await self._start(user, selection, target, replaced)

    def _drop(self, ids: list[int]) -> None:
        self.store.write(History.delete_messages, ids)
        self.messages = [m for m in self.messages if m.id not in ids]

    async def _start(
        self, user: Message, selection: Selection | None, target: Target, replaced: tuple[int, ...]
    ) -> Turn:
        assert self.conversation is not None
        s = self.settings
        messages = [m for m in self.messages if m.id <= user.id]
        budget = prompt_budget_chars(s.max_tokens, await self.ratio(target), _context(target))
        request, dropped = request_messages(s.system_prompt, messages, budget)
        seed = random.randrange(1 << 31)
        params = {
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            # A fresh seed per answer, so regenerating a sampled answer gives another;
            # it is kept in the history, so an answer can be reproduced.
            "seed": seed,
            "stop": [],
        }
        meta: dict[str, Any] = {
            "placement": target.name or "",
            # One entry per stage, a tensor group's nodes as `a+b` (drawn `a+b → c+d`).
            "nodes": ["+".join(n) for n, _, _ in target.placement.stages]
            if target.placement
            else [],
            "seed": seed,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        if selection is not None:
            meta["passages"] = selection.used()
            if not selection.matched and not selection.whole:
                meta["unmatched"] = True
        if dropped:
            meta["dropped"] = dropped
        answer = await self.store.call(
            History.add_message, self.conversation.id, "assistant", "", None, meta
        )
        self.messages.append(answer)
        self.turn = Turn(
            user=user,
            answer=answer,
            placement=target.name,
            request={"messages": request},
            params=params,
            meta=meta,
            chars_sent=sum(len(m["content"]) for m in request),
            replaced=replaced,
        )
        return self.turn

    async def run(self, turn: Turn, controller: Controller | None) -> None:
        """Stream the answer into `turn` and keep it in the history, however it ends.
        Only a cancel is raised (after the answer is kept): a failure is `turn.error`."""
        try:
            if controller is None:
                turn.error = NO_CLUSTER
                return
            generator = controller.generate(turn.placement, turn.request, turn.params)
            try:
                async for msg in generator:
                    if turn.stopped or turn.saved is not None:
                        # A cancel can be lost as a message arrives (Python 3.11's
                        # wait_for); the flag catches that case.
                        break
                    self._take(turn, msg)
            finally:
                with contextlib.suppress(Exception):
                    await generator.aclose()
        except GenerationError as exc:
            turn.error = str(exc)
        except asyncio.CancelledError:
            turn.stopped = True
            raise
        except Exception as exc:  # a bug or a broken wire: say it, keep the text
            turn.error = f"{type(exc).__name__}: {exc}"
        finally:
            await self._end(turn)

    def _take(self, turn: Turn, msg: control.Answer) -> None:
        match msg:
            case control.Accepted():
                turn.prompt_tokens = msg.prompt_tokens or None
                ratio = learned_ratio(turn.chars_sent, turn.prompt_tokens)
                if turn.placement and ratio is not None:
                    self.chars_per_token[turn.placement] = ratio
            case control.Delta():
                now = time.monotonic()
                if turn.first_at is None:
                    turn.first_at = now
                turn.tokens += len(msg.tokens) or 1
                text = printable(msg.text)
                if text:
                    turn.text += text
                    turn.pending.append(text)
                if now - turn.saved_at >= CHECKPOINT_S:
                    turn.saved_at = now
                    self.store.write(History.update_message, turn.answer.id, turn.text)
            case control.Done():
                turn.done = msg

    def stop(self) -> Turn | None:
        """Mark the answer being made as stopped (the caller cancels its task); it
        becomes a draft that asking again replaces. None when none is being made."""
        turn = self.turn
        if turn is None or turn.finished:
            return None
        turn.stopped = True
        self.draft = (turn.user.id, turn.answer.id)
        return turn

    def _save(self, turn: Turn) -> None:
        """Queue the answer's final text and meta: from here on it cannot be lost."""
        turn.meta = turn.final_meta(time.monotonic())
        try:
            turn.saved = self.store.write(
                History.update_message, turn.answer.id, turn.text, turn.meta
            )
        except HistoryError as exc:  # closed under it: say so, the text stays on screen
            turn.saved = Future()
            turn.saved.set_exception(exc)
        answer = replace(turn.answer, content=turn.text, meta=turn.meta)
        self.messages = [answer if m.id == answer.id else m for m in self.messages]

    async def _end(self, turn: Turn) -> None:
        if turn.saved is None:
            self._save(turn)
        assert turn.saved is not None
        with contextlib.suppress(Exception):  # a failed write is reported by the store
            await asyncio.shield(asyncio.wrap_future(turn.saved))
        turn.finished = True

    def close(self) -> None:
        """Keep an answer still coming as it is (stopped), then close the history once
        every write is done. The caller cancels the answer's task."""
        turn = self.turn
        if turn is not None and not turn.finished and turn.saved is None:
            turn.stopped = True
            self._save(turn)
            turn.finished = True
        self.store.close()

    # ---- commands -------------------------------------------------------------------

    async def command(self, command: Command, placement: str = "") -> Reply:
        """Run a slash command; what the screen should show of it."""
        async with self._commands:
            return await self._command(command, placement)

    async def _command(self, command: Command, placement: str) -> Reply:
        word, arg = command.word, command.arg
        if word == "/attach":
            if not arg:
                return Reply(then="pick-file")
            return await self.attach_reply(Path(arg), placement)
        if word == "/detach":
            try:
                gone = self.detach(arg)
            except ChatError as exc:
                return Reply(status=str(exc))
            return Reply(
                status=f"detached {', '.join(d.name for d in gone)}",
                redraw=frozenset({"documents"}),
            )
        if word == "/rename":
            if not arg:
                return Reply(status="usage: /rename TITLE")
            await self.rename(arg, placement)
            return Reply(redraw=frozenset({"title"}))
        if word == "/system":
            self.use_settings(replace(self.settings, system_prompt=arg))
            return Reply(
                status="system prompt set" if arg else "system prompt cleared",
                redraw=frozenset({"system"}),
            )
        if word == "/new":
            return Reply(then="new")
        if word == "/export":
            if self.conversation is None:
                return Reply(status="nothing to export yet")
            path = await self.export()
            return Reply(report=f"exported {self.conversation.display_title!r} to {path}")
        if word == "/help":
            return Reply(status=help_text())
        raise ChatError(f"unknown command {word}", "/help lists the commands")

    async def attach_reply(self, path: Path, placement: str = "") -> Reply:
        """Attach a file, saying how it went as a command's reply."""
        try:
            doc, count = await self.attach(path, placement)
        except StudioError as exc:
            return Reply(report=f"cannot attach: {exc}", level="warning")
        except OSError as exc:
            return Reply(report=f"cannot attach {path}: {exc.strerror or exc}", level="warning")
        words = len(doc.text.split())
        return Reply(
            notify=f"attached {doc.name}: {words:,} words in {count} passages",
            redraw=frozenset({"documents"}),
        )
