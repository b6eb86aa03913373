"""Conversations in SQLite: what the chat screen keeps across restarts (pure)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from studiotui.chat.history import History, HistoryError, Settings, passages_note, title_from


def test_conversations_messages_and_documents_survive_reopening(tmp_path: Path) -> None:
    history = History.open(tmp_path)
    conv = history.create(placement="demo", settings=Settings("be brief", 0.2, 0.9, 64))
    assert conv.display_title == f"conversation {conv.id}"
    q = history.add_message(conv.id, "user", "What is in the report?", sent="[r.pdf, passage 3]…")
    a = history.add_message(conv.id, "assistant", "", meta={"passages": []})
    history.update_message(a.id, "It says hello.", {"completion_tokens": 4, "stopped": True})
    history.add_document(conv.id, "r.pdf", "text of r", source="/x/r.pdf", kind="pdf")
    history.close()

    again = History.open(tmp_path)
    [kept] = again.conversations()
    assert kept.title == "What is in the report?"  # named by its first question
    assert kept.placement == "demo" and kept.message_count == 2
    assert kept.settings == Settings("be brief", 0.2, 0.9, 64)
    msgs = again.messages(conv.id)
    assert [(m.role, m.content) for m in msgs] == [
        ("user", "What is in the report?"),
        ("assistant", "It says hello."),
    ]
    assert msgs[0].id == q.id and msgs[0].sent == "[r.pdf, passage 3]…"
    assert msgs[1].meta == {"completion_tokens": 4, "stopped": True}
    [doc] = again.documents(conv.id)
    assert (doc.name, doc.kind, doc.text, doc.source) == ("r.pdf", "pdf", "text of r", "/x/r.pdf")


def test_rename_settings_order_and_delete(tmp_path: Path) -> None:
    history = History.open(tmp_path)
    first = history.create()
    second = history.create()
    history.add_message(first.id, "user", "x" * 100)
    assert [c.id for c in history.conversations()] == [first.id, second.id]  # recent first
    assert history.latest() is not None and history.latest().id == first.id  # type: ignore[union-attr]
    assert history.rename(second.id, "  my   title ").title == "my title"
    # A title given by hand is not replaced by the first question.
    history.add_message(second.id, "user", "hello")
    assert history.get(second.id).title == "my title"
    history.set_settings(second.id, Settings(temperature=1.5))
    assert history.get(second.id).settings.temperature == 1.5
    with pytest.raises(ValueError, match="top-p"):
        history.set_settings(second.id, Settings(top_p=1.5))
    with pytest.raises(ValueError, match="max tokens"):
        Settings(max_tokens=0).validated()

    history.add_document(first.id, "a.txt", "a")
    history.delete(first.id)
    assert [c.id for c in history.conversations()] == [second.id]
    # Messages and documents go with their conversation.
    db = sqlite3.connect(tmp_path / "chat.sqlite3")
    assert db.execute(
        "SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (first.id,)
    ).fetchone() == (0,)
    assert db.execute("SELECT COUNT(*) FROM documents").fetchone() == (0,)
    with pytest.raises(HistoryError):
        history.get(first.id)
    with pytest.raises(HistoryError):
        history.delete(first.id)


def test_delete_and_set_sent_for_regenerating(tmp_path: Path) -> None:
    history = History.open(tmp_path)
    conv = history.create()
    q = history.add_message(conv.id, "user", "q")
    a = history.add_message(conv.id, "assistant", "a")
    history.delete_messages([a.id])
    history.set_sent(q.id, "passages + q")
    [only] = history.messages(conv.id)
    assert only.sent == "passages + q"


def test_export_markdown(tmp_path: Path) -> None:
    history = History.open(tmp_path)
    conv = history.create(placement="demo", settings=Settings(system_prompt="You are terse."))
    history.add_message(conv.id, "user", "Summarise the report")
    history.add_message(
        conv.id,
        "assistant",
        "It grew.\n\n```python\nprint(1)\n```",
        meta={"passages": [{"document": "report.pdf", "passages": [3, 7]}]},
    )
    history.add_message(conv.id, "user", "More?")
    history.add_message(conv.id, "assistant", "Par", meta={"error": "node local-2 stopped"})
    history.add_document(conv.id, "report.pdf", "…")
    text = history.export_markdown(conv.id)
    assert text.startswith("# Summarise the report\n")
    assert "placement `demo`" in text and "Attached: `report.pdf`" in text
    assert "## System\n\nYou are terse." in text
    assert "## You\n\nSummarise the report" in text
    assert "```python\nprint(1)\n```" in text
    assert "*used passages 3, 7 of report.pdf*" in text
    assert "*stopped by an error: node local-2 stopped*" in text
    path = history.export_file(conv.id, tmp_path / "exports")
    assert path.name == f"{conv.id:04d}-summarise-the-report.md"
    assert path.read_text() == text


def test_small_helpers() -> None:
    assert title_from("  hello\n  world ") == "hello world"
    long = title_from("word " * 40)
    assert long.endswith("…") and len(long) <= 61
    assert passages_note([{"document": "a.pdf", "passages": [2]}]) == "used passage 2 of a.pdf"
    assert (
        passages_note(
            [{"document": "a.pdf", "passages": [1, 4]}, {"document": "b.md", "passages": [2]}]
        )
        == "used passages 1, 4 of a.pdf; 2 of b.md"
    )
    assert passages_note([]) == ""


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "chat.sqlite3")
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(HistoryError, match="newer studiotui"):
        History.open(tmp_path)


@pytest.mark.parametrize("damage", ["junk", "truncated"])
def test_a_damaged_history_is_kept_aside_not_overwritten(tmp_path: Path, damage: str) -> None:
    """Before, a damaged file left every later session without a history (memory
    only, for ever), with no word of what to do; now it is renamed, untouched, and a
    new history starts, the note saying where the old one is."""
    history = History.open(tmp_path)
    conv = history.create("kept")
    for i in range(200):
        history.add_message(conv.id, "user", f"message {i} " * 100)
    history.close()
    db = tmp_path / "chat.sqlite3"
    raw = db.read_bytes()
    damaged = b"not a database at all" * 100 if damage == "junk" else raw[: len(raw) // 2]
    db.write_bytes(damaged)
    history = History.open(tmp_path)
    (aside,) = tmp_path.glob("chat.sqlite3.damaged-*")
    assert aside.read_bytes() == damaged
    assert history.note and aside.name in history.note and ".recover" in history.note
    assert history.conversations() == []
    history.create("new")
    history.close()
    assert History.open(tmp_path).note is None
    assert [c.title for c in History.open(tmp_path).conversations()] == ["new"]
    assert aside.read_bytes() == damaged


def test_a_locked_or_unreadable_history_is_not_set_aside(tmp_path: Path) -> None:
    (tmp_path / "chat.sqlite3").mkdir()  # a folder where the file belongs: not damage
    with pytest.raises((HistoryError, OSError)):
        History.open(tmp_path)
    assert not list(tmp_path.glob("*.damaged-*"))
