"""Reading a command's announced line (an address) off its output."""

import re
from typing import IO


def read_until(stream: IO[str], pattern: str) -> tuple[re.Match[str], list[str]]:
    """Read lines until one matches `pattern`; fail with every line read if none does.

    Reads on past anything printed before the line (a library's warning, a log line)
    and stops at end of output, so a command that dies says what it said.
    """
    said: list[str] = []
    while line := stream.readline():
        said.append(line)
        if found := re.search(pattern, line):
            return found, said
    raise AssertionError(f"no line matched {pattern!r}; the output was: {said}")
