"""Conversations kept in SQLite under STUDIOTUI_HOME, so a chat survives restarts.

One file (`chat.sqlite3`) holds conversations, their messages and the documents
attached to them. Each assistant message keeps what is worth knowing about how it
was made (figures, the passages it used, an error or a stop) in a JSON `meta`
column, so the schema does not change every time the screen learns a new figure.
A user message keeps both what the operator typed (`content`) and, when a document
was involved, what was really sent to the model (`sent`): the transcript shows the
first, the test of the retrieval (and a curious operator) reads the second.

Every call is a short transaction on the caller's thread. The chat calls it only
from the history's own thread (`store.HistoryStore`), never from the event loop: a
commit waits for the disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from studiotui.core.errors import StudioError
from worker.shared.protocol.limits import SAMPLING_LIMITS

SCHEMA_VERSION = 1
DB_NAME = "chat.sqlite3"
TITLE_CHARS = 60

DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.95
DEFAULT_MAX_TOKENS = 512

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    placement TEXT NOT NULL DEFAULT '',
    system_prompt TEXT NOT NULL DEFAULT '',
    temperature REAL NOT NULL,
    top_p REAL NOT NULL,
    max_tokens INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    -- AUTOINCREMENT: a regenerated answer must not take the id of the one it replaced.
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    created REAL NOT NULL,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    sent TEXT,
    meta TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE TABLE IF NOT EXISTS documents (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    source TEXT NOT NULL DEFAULT '',
    kind TEXT NOT NULL DEFAULT 'text',
    text TEXT NOT NULL,
    added REAL NOT NULL
);
"""


class HistoryError(StudioError, RuntimeError):
    def __init__(self, message: str, hint: str = "", sqlite_code: int | None = None) -> None:
        super().__init__(message, hint)
        self.sqlite_code = sqlite_code


# SQLite's codes for a file that is no database, or a damaged one: kept aside by open().
_DAMAGED = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}


@dataclass(frozen=True)
class Settings:
    """What a conversation sends with each question besides the messages."""

    system_prompt: str = ""
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    max_tokens: int = DEFAULT_MAX_TOKENS

    def validated(self) -> Settings:
        """The same settings, or ValueError naming the field that the shards would refuse
        (their ranges: SAMPLING_LIMITS, the table the API and the shards check)."""
        for name, label, value in (
            ("temperature", "temperature", self.temperature),
            ("top_p", "top-p", self.top_p),
            ("max_tokens", "max tokens", self.max_tokens),
        ):
            limit = SAMPLING_LIMITS[name]
            if not limit.admits(value):
                span = f"{limit.number(limit.lo)}..{limit.number(limit.hi)}"
                raise ValueError(f"{label} must be {span}, got {limit.number(value)}")
        return self


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    placement: str
    settings: Settings
    message_count: int = 0

    @property
    def display_title(self) -> str:
        return self.title or f"conversation {self.id}"


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    created: float
    role: str
    content: str
    sent: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Document:
    id: int
    conversation_id: int
    name: str
    source: str
    kind: str
    text: str
    added: float


def default_path(home: Path) -> Path:
    return home / DB_NAME


def title_from(text: str) -> str:
    """A title from the first question: its first line, cut at a word."""
    line = " ".join(text.strip().split())
    if len(line) <= TITLE_CHARS:
        return line
    cut = line[:TITLE_CHARS].rsplit(" ", 1)[0]
    return cut + "…"


class History:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        on_disk = str(path) != ":memory:"
        if on_disk:
            # Created 0600 before SQLite opens it: SQLite gives its -wal and -shm the
            # database's mode, and conversations are private whatever the umask.
            try:
                os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            except OSError as exc:
                raise HistoryError(
                    f"cannot open the chat history {path}: {exc.strerror}",
                    "make it a file studiotui can write, or move it away",
                ) from None
        try:
            self.db = sqlite3.connect(path, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA foreign_keys = ON")
            # WAL so a second studiotui on the same home reads while this one writes.
            self.db.execute("PRAGMA journal_mode = WAL")
            # A damaged page shows only when read: look at every one now (milliseconds
            # for a chat history), not when a conversation is opened.
            check = self.db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                self.db.close()
                raise HistoryError(
                    f"cannot open the chat history {path}: it is damaged ({check})",
                    sqlite_code=sqlite3.SQLITE_CORRUPT,
                )
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise HistoryError(
                    f"{path} was written by a newer studiotui (schema {version}); "
                    f"this one knows schema {SCHEMA_VERSION}"
                )
            self.db.executescript(_SCHEMA)
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            with contextlib.suppress(AttributeError):
                self.db.close()
            raise HistoryError(
                f"cannot open the chat history {path}: {exc}",
                sqlite_code=getattr(exc, "sqlite_errorcode", None),
            ) from None
        if on_disk:
            _make_private(
                path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")
            )

    # Set when open() found the history damaged and kept it aside: what to tell the user.
    note: str | None = None

    @classmethod
    def open(cls, home: Path) -> History:
        """The history of `home`. One SQLite cannot read (not a database, or damaged:
        a crash mid-write, a disk filling up, a truncated copy) is kept aside under a
        new name, never overwritten, and a new one is started; `note` says where."""
        path = default_path(home)
        try:
            return cls(path)
        except HistoryError as exc:
            if exc.sqlite_code not in _DAMAGED:
                raise
            why = exc.message.rpartition(": ")[2]
            aside = set_aside(path)
        history = cls(path)
        history.note = (
            f"the chat history {path} could not be read ({why}); it is kept as "
            f"{aside.name} beside it and a new history is started: open the old one with "
            "sqlite3's .recover to get conversations out of it"
        )
        return history

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ---- conversations ---------------------------------------------------------------

    def create(
        self, title: str = "", placement: str = "", settings: Settings | None = None
    ) -> Conversation:
        s = (settings or Settings()).validated()
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO conversations (title, created, updated, placement, system_prompt,"
                " temperature, top_p, max_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (title, now, now, placement, s.system_prompt, s.temperature, s.top_p, s.max_tokens),
            )
        assert cur.lastrowid is not None
        return self.get(cur.lastrowid)

    def get(self, conversation_id: int) -> Conversation:
        row = self.db.execute(
            "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n "
            "FROM conversations c WHERE c.id = ?",
            (conversation_id,),
        ).fetchone()
        if row is None:
            raise HistoryError(f"no conversation {conversation_id}")
        return _conversation(row)

    def conversations(self) -> list[Conversation]:
        """Every conversation, the most recently used first."""
        rows = self.db.execute(
            "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n "
            "FROM conversations c ORDER BY c.updated DESC, c.id DESC"
        ).fetchall()
        return [_conversation(r) for r in rows]

    def latest(self) -> Conversation | None:
        found = self.conversations()
        return found[0] if found else None

    def rename(self, conversation_id: int, title: str) -> Conversation:
        title = " ".join(title.split())
        self._update(conversation_id, title=title)
        return self.get(conversation_id)

    def set_placement(self, conversation_id: int, placement: str) -> None:
        self._update(conversation_id, placement=placement, touch=False)

    def set_settings(self, conversation_id: int, settings: Settings) -> Conversation:
        s = settings.validated()
        self._update(
            conversation_id,
            system_prompt=s.system_prompt,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=s.max_tokens,
            touch=False,
        )
        return self.get(conversation_id)

    def _update(self, conversation_id: int, touch: bool = True, **fields: Any) -> None:
        if touch:
            fields["updated"] = time.time()
        sets = ", ".join(f"{name} = ?" for name in fields)
        with self._tx() as db:
            cur = db.execute(
                f"UPDATE conversations SET {sets} WHERE id = ?", (*fields.values(), conversation_id)
            )
        if cur.rowcount == 0:
            raise HistoryError(f"no conversation {conversation_id}")

    def delete(self, conversation_id: int) -> None:
        with self._tx() as db:
            cur = db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
        if cur.rowcount == 0:
            raise HistoryError(f"no conversation {conversation_id}")

    # ---- messages --------------------------------------------------------------------

    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        sent: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Message:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO messages (conversation_id, created, role, content, sent, meta)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, now, role, content, sent, json.dumps(meta or {})),
            )
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
            if role == "user":
                # The first question names an untitled conversation.
                db.execute(
                    "UPDATE conversations SET title = ? WHERE id = ? AND title = ''",
                    (title_from(content), conversation_id),
                )
        assert cur.lastrowid is not None
        return Message(cur.lastrowid, conversation_id, now, role, content, sent, dict(meta or {}))

    def update_message(
        self, message_id: int, content: str, meta: dict[str, Any] | None = None
    ) -> None:
        with self._tx() as db:
            if meta is None:
                db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, message_id))
            else:
                db.execute(
                    "UPDATE messages SET content = ?, meta = ? WHERE id = ?",
                    (content, json.dumps(meta), message_id),
                )

    def set_sent(self, message_id: int, sent: str | None) -> None:
        with self._tx() as db:
            db.execute("UPDATE messages SET sent = ? WHERE id = ?", (sent, message_id))

    def delete_messages(self, message_ids: list[int]) -> None:
        with self._tx() as db:
            db.executemany("DELETE FROM messages WHERE id = ?", [(i,) for i in message_ids])

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self.db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [
            Message(
                id=r["id"],
                conversation_id=r["conversation_id"],
                created=r["created"],
                role=r["role"],
                content=r["content"],
                sent=r["sent"],
                meta=_meta(r["meta"]),
            )
            for r in rows
        ]

    # ---- documents -------------------------------------------------------------------

    def add_document(
        self, conversation_id: int, name: str, text: str, source: str = "", kind: str = "text"
    ) -> Document:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO documents (conversation_id, name, source, kind, text, added)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, name, source, kind, text, now),
            )
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        assert cur.lastrowid is not None
        return Document(cur.lastrowid, conversation_id, name, source, kind, text, now)

    def documents(self, conversation_id: int) -> list[Document]:
        rows = self.db.execute(
            "SELECT * FROM documents WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [
            Document(
                r["id"],
                r["conversation_id"],
                r["name"],
                r["source"],
                r["kind"],
                r["text"],
                r["added"],
            )
            for r in rows
        ]

    def remove_document(self, document_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM documents WHERE id = ?", (document_id,))

    # ---- export ----------------------------------------------------------------------

    def export_markdown(self, conversation_id: int) -> str:
        return to_markdown(
            self.get(conversation_id),
            self.messages(conversation_id),
            self.documents(conversation_id),
        )

    def export_file(self, conversation_id: int, folder: Path) -> Path:
        """Write the conversation as Markdown into `folder`; return the file's path."""
        conv = self.get(conversation_id)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{conv.id:04d}-{slug(conv.display_title)}.md"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(self.export_markdown(conversation_id))
        _make_private(path)  # an export written before, with a wider mode
        return path


def set_aside(path: Path) -> Path:
    """Rename a damaged database (and its -wal and -shm, which belong to it) to
    `NAME.damaged-STAMP`; the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    for suffix in ("-wal", "-shm"):
        extra = path.with_name(path.name + suffix)
        if extra.exists():
            extra.rename(aside.with_name(aside.name + suffix))
    path.rename(aside)
    return aside


def _make_private(*paths: Path) -> None:
    """Mode 0600 for those of `paths` that exist (a database made by an older version)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.chmod(0o600)


def slug(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "-".join(words)[:48].strip("-") or "conversation"


def passages_note(used: list[dict[str, Any]]) -> str:
    """'used passages 3, 7 of report.pdf; 2 of notes.md' from a message's meta."""
    parts = []
    for entry in used:
        numbers = ", ".join(str(n) for n in entry.get("passages", []))
        if numbers:
            parts.append(f"{numbers} of {entry.get('document', '?')}")
    if not parts:
        return ""
    word = "passage" if len(used) == 1 and len(used[0].get("passages", [])) == 1 else "passages"
    return f"used {word} " + "; ".join(parts)


def to_markdown(conv: Conversation, messages: list[Message], documents: list[Document]) -> str:
    s = conv.settings
    lines = [f"# {conv.display_title}", ""]
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.created))
    facts = [f"started {when}"]
    if conv.placement:
        facts.append(f"placement `{conv.placement}`")
    facts.append(f"temperature {s.temperature:g}, top-p {s.top_p:g}, max tokens {s.max_tokens}")
    lines += ["*" + " · ".join(facts) + "*", ""]
    if documents:
        lines += ["Attached: " + ", ".join(f"`{d.name}`" for d in documents), ""]
    if s.system_prompt:
        lines += ["## System", "", s.system_prompt, ""]
    for m in messages:
        lines += ["## You" if m.role == "user" else "## Assistant", "", m.content or "*(no text)*"]
        notes = []
        if m.role == "assistant":
            note = passages_note(m.meta.get("passages", []))
            if note:
                notes.append(note)
            if m.meta.get("error"):
                notes.append(f"stopped by an error: {m.meta['error']}")
            elif m.meta.get("stopped"):
                notes.append("stopped by the operator")
        if notes:
            lines += ["", "*" + " · ".join(notes) + "*"]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(
        id=row["id"],
        title=row["title"],
        created=row["created"],
        updated=row["updated"],
        placement=row["placement"],
        settings=Settings(
            system_prompt=row["system_prompt"],
            temperature=row["temperature"],
            top_p=row["top_p"],
            max_tokens=row["max_tokens"],
        ),
        message_count=row["n"],
    )


def _meta(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
