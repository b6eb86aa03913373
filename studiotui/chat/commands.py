"""The chat's slash commands: which there are, how a line is read as one, and what
completes them as they are typed. Running them is the conversation's job
(`ChatSession.command`); this module only reads text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

COMMANDS = {
    "/attach": "/attach PATH — attach a text, Markdown or PDF file",
    "/detach": "/detach [NAME] — remove one attached document (or all)",
    "/rename": "/rename TITLE — rename this conversation",
    "/system": "/system TEXT — set the system prompt",
    "/new": "/new — start a new conversation",
    "/export": "/export — write this conversation as Markdown",
    "/help": "/help — these commands",
}


@dataclass(frozen=True)
class Command:
    word: str  # one of COMMANDS, e.g. "/attach"
    arg: str  # the rest of the line, stripped ("" when none)


def parse_command(text: str) -> Command | None:
    """The command a line asks for, or None: a line that is not one of the commands
    (a question that starts with "/", say) is asked as it is."""
    text = text.strip()
    if not text.startswith("/"):
        return None
    word, *rest = text.split(maxsplit=1)
    if word not in COMMANDS:
        return None
    return Command(word, rest[0].strip() if rest else "")


# The answer's settings are fields of the chat's side panel, not commands: /help names
# them, or nothing says they can be changed.
SETTINGS_HELP = (
    "temperature, top-p and max tokens: edit them under the Answer panel on the right "
    "(tab from the prompt; enter or leaving the field keeps them)"
)


# The chat's keys the footer leaves out (it keeps what fits 80 columns).
KEYS_HELP = "ctrl+y copies the answer · ctrl+b its code · ctrl+l picks the placement"


def help_text() -> str:
    return " · ".join([*COMMANDS.values(), SETTINGS_HELP, KEYS_HELP])


def suggest(value: str) -> str | None:
    """What the prompt suggests for `value`: a command's name, or a path after /attach."""
    if value.startswith("/attach "):
        rest = complete_path(value[len("/attach ") :])
        return f"/attach {rest}" if rest else None
    if value.startswith("/") and " " not in value:
        return next((c + " " for c in COMMANDS if c.startswith(value) and c != value), None)
    return None


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
