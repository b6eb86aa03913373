"""The API keys a server takes: one given on the command line, or a file of named keys.

The file holds one key a line, `NAME KEY`, with `#` comments and blank lines. It is
read again whenever its modification time or size changes, so a key is added or
revoked by editing the file, without a restart. A file that cannot be read any more
takes every key with it: revoking must never fail open.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("studiotui.api.keys")
log.addHandler(logging.NullHandler())


class KeyFileError(ValueError):
    """A key file that cannot be used; the words name the line and what to write."""


def parse_keys(text: str, source: str = "the key file") -> dict[str, str]:
    """`NAME KEY` lines as {key: name}; a malformed line is an error naming it."""
    keys: dict[str, str] = {}
    names: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source} line {number}"
        if len(words) != 2:
            raise KeyFileError(
                f"{where} has {len(words)} words: write one key a line as 'NAME KEY' "
                "(a name for the logs, then the key, no spaces in either)"
            )
        name, key = words
        if key in keys:
            raise KeyFileError(f"{where}: this key is already given to {keys[key]!r}")
        if name in names:
            raise KeyFileError(f"{where}: the name {name!r} is used twice; name each key once")
        keys[key] = name
        names.add(name)
    return keys


@dataclass
class Keys:
    """Which keys are valid now, and the name of each."""

    single: str = ""
    path: Path | None = None
    _keys: dict[str, str] = field(default_factory=dict)
    _stamp: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.path is not None:
            # At start a bad file is the operator's mistake, said at once.
            self._keys = parse_keys(self._read(self.path), str(self.path))
            self._stamp = _stamp(self.path)

    @property
    def required(self) -> bool:
        return bool(self.single) or self.path is not None

    def name_of(self, token: str) -> str | None:
        """The name of `token` if it is a valid key now, else None."""
        if self.single and hmac.compare_digest(token.encode(), self.single.encode()):
            return "key"
        if self.path is None:
            return None
        self._refresh(self.path)
        # compare_digest on every key: the time taken must not tell which was close.
        found = None
        for key, name in self._keys.items():
            if hmac.compare_digest(token.encode(), key.encode()):
                found = name
        return found

    def _refresh(self, path: Path) -> None:
        try:
            stamp = _stamp(path)
        except OSError as exc:
            if self._keys:
                log.warning("API key file %s cannot be read (%s): no key is valid", path, exc)
            self._keys, self._stamp = {}, None
            return
        if stamp == self._stamp:
            return
        try:
            self._keys = parse_keys(self._read(path), str(path))
            log.info("API key file %s read again: %d keys", path, len(self._keys))
        except (KeyFileError, OSError) as exc:
            log.warning("API key file %s: %s; no key is valid until it is fixed", path, exc)
            self._keys = {}
        self._stamp = stamp

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"cannot read the API key file {path}: {exc}") from None


def _stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size
