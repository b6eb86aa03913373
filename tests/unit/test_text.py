"""What a model's text loses before it reaches a terminal (studiotui/core/text.py)."""

from __future__ import annotations

from studiotui.core.text import printable


def test_printable_drops_control_characters_but_keeps_lines_and_tabs() -> None:
    assert printable("a\x1b[31mb\x07c\r\n\td\x9b") == "a[31mbc\n\td"
    # Letters beyond ASCII are words, not controls: only U+0080–U+009F go.
    assert printable("é ü 日本 \u00a0\x85") == "é ü 日本 \u00a0"
