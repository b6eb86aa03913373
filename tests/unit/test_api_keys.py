"""The API key file: `NAME KEY` lines, read again when the file changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from studiotui.api.keys import KeyFileError, Keys, parse_keys


def test_key_lines_name_their_keys_and_bad_lines_are_named() -> None:
    text = "# who uses the cluster\nalice sk-a\n\nbob sk-b  # laptop\n"
    assert parse_keys(text) == {"sk-a": "alice", "sk-b": "bob"}
    for bad, words in (
        ("alice\n", "line 1 has 1 words"),
        ("alice sk-a extra\n", "line 1 has 3 words"),
        ("alice sk-a\nbob sk-a\n", "line 2: this key is already given to 'alice'"),
        ("alice sk-a\nalice sk-b\n", "line 2: the name 'alice' is used twice"),
    ):
        with pytest.raises(KeyFileError, match=words):
            parse_keys(bad)


def test_a_key_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("alice sk-a\nbob sk-b\n")
    keys = Keys(path=path)
    assert keys.required
    assert (keys.name_of("sk-a"), keys.name_of("sk-b"), keys.name_of("sk-c")) == (
        "alice",
        "bob",
        None,
    )
    path.write_text("alice sk-a\n")  # bob revoked
    assert keys.name_of("sk-b") is None and keys.name_of("sk-a") == "alice"
    path.write_text("alice sk-a\nthis line is wrong\n")  # never fails open
    assert keys.name_of("sk-a") is None
    path.unlink()
    assert keys.name_of("sk-a") is None
    with pytest.raises(KeyFileError, match="cannot read"):
        Keys(path=path)
    assert Keys(single="sk-1").name_of("sk-1") == "key" and not Keys().required
