"""The chat history on a thread of its own, so that no SQLite write (a commit waits
for the disk) runs on the event loop that draws the screen and answers keys.

One `History` is opened, used and closed on one worker thread (sqlite3 connections
belong to the thread that made them), and every call is queued to it: calls run
one at a time in the order they were made, so a checkpoint of an answer can never
land after its final text. `write` queues and returns at once (a failure is
reported through `on_error`, on the event loop); `call` waits for the result. A
call that is queued is done even if its caller is cancelled or the event loop has
gone: the thread finishes its queue before the process exits (concurrent.futures
joins its threads at exit), which is what keeps an answer whose screen was closed
mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from studiotui.chat.history import History, HistoryError

P = ParamSpec("P")
T = TypeVar("T")


class HistoryStore:
    def __init__(
        self, open_history: Callable[[], History], on_error: Callable[[str], None] | None = None
    ) -> None:
        """Open the history with `open_history` on the store's thread. A failure to
        open surfaces at the first call, as HistoryError (see `opened`)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chat-history")
        self._history: History | None = None
        self._closed = False
        self._closing: Future[None] | None = None
        self.on_error = on_error
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._opening = self._pool.submit(self._open, open_history)

    def _open(self, open_history: Callable[[], History]) -> None:
        self._history = open_history()

    @classmethod
    async def open(
        cls, home: Path, on_error: Callable[[str], None] | None = None
    ) -> tuple[HistoryStore, str | None]:
        """The store of `home`'s history, and a problem to show when it cannot be
        opened: then the store keeps this session's chat in memory only."""
        store = cls(lambda: History.open(home), on_error)
        problem = await store.opened()
        if problem is None:
            return store, None
        store.close()
        return cls(lambda: History(Path(":memory:")), on_error), problem

    @property
    def note(self) -> str | None:
        """What opening found and did that the user must hear of (a damaged history
        kept aside), once open."""
        return self._history.note if self._history is not None else None

    async def opened(self) -> str | None:
        """None once the history is open, else why it could not be."""
        try:
            await asyncio.wrap_future(self._opening)
        except (HistoryError, OSError) as exc:
            return str(exc)
        return None

    def _run(
        self, fn: Callable[Concatenate[History, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        if self._history is None:
            self._opening.result()  # raises why it could not be opened
            raise HistoryError("the chat history is not open")
        return fn(self._history, *args, **kwargs)

    def submit(
        self, fn: Callable[Concatenate[History, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Queue `fn(history, *args)` after every call queued before it."""
        if self._closed:
            raise HistoryError("the chat history is closed", "reopen the chat")

        def job() -> T:
            return self._run(fn, *args, **kwargs)

        return self._pool.submit(job)

    async def call(
        self, fn: Callable[Concatenate[History, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Queue `fn(history, *args)` and wait for its result. Cancelling the wait does
        not cancel the call: what was asked is done, in order."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(fn, *args, **kwargs)))

    def write(
        self, fn: Callable[Concatenate[History, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Queue `fn(history, *args)` without waiting; a failure goes to `on_error`."""
        future = self.submit(fn, *args, **kwargs)
        future.add_done_callback(self._check)
        return future

    def _check(self, future: Future[Any]) -> None:
        if future.cancelled() or future.exception() is None or self.on_error is None:
            return
        text = str(future.exception())
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                self._loop.call_soon_threadsafe(self.on_error, text)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> Future[None]:
        """Close the history after every call queued so far; returns at once, with a
        future that is done when the history is closed (the same one each time)."""
        if self._closing is None:
            self._closing = self._pool.submit(self._close)
            self._closed = True
            self._pool.shutdown(wait=False)
        return self._closing

    def _close(self) -> None:
        if self._history is not None:
            self._history.close()
