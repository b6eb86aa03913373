"""Text from a model or a node made safe to write to the user's terminal.

A model can produce any character; an ESC starts a sequence the terminal obeys (colours,
cursor moves, a window title, on some terminals the clipboard). Everything that shows
a model's words on a terminal — the dashboard's chat and `studiotui chat` — passes them
through `printable` first. The API sends them as they are: JSON escapes them, and what
a client shows is the client's business.
"""

from __future__ import annotations

# C0 controls but tab and newline, DEL, and the C1 controls (U+0080–U+009F: U+009B is a
# one-character CSI on terminals that read 8-bit controls).
_CONTROL = {c: None for c in [*range(0x00, 0x09), 0x0B, 0x0C, 0x0D, *range(0x0E, 0x20), 0x7F]}
_CONTROL.update({c: None for c in range(0x80, 0xA0)})


def printable(text: str) -> str:
    """`text` without the control characters a terminal would act on; lines and tabs
    stay."""
    return text.translate(_CONTROL)


def counted(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless one: "1 training example", "3 nodes"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def last_lines(text: str, lines: int = 12) -> str:
    """The last `lines` lines of `text` (a command's output said beside its failure)."""
    return "\n".join(text.rstrip().splitlines()[-lines:])
