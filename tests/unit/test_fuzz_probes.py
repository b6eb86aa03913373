"""Fuzz the probe parsers with mutated recordings of real macOS output: a parser either
returns its result or raises ProbeParseError, never anything else.

Short in CI; STUDIOTUI_FUZZ_LONG=1 runs many more examples."""

from __future__ import annotations

import contextlib
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fixture_paths import macos_fixtures
from tests.unit.test_probes import _fixture_files, _parser_for
from worker.shared.probes import ProbeParseError

LONG = os.environ.get("STUDIOTUI_FUZZ_LONG") == "1"
EXAMPLES = 2000 if LONG else 40

FIXTURES = macos_fixtures()


@st.composite
def mutated(draw: st.DrawFn, original: bytes) -> bytes:
    """The recording cut, with bytes flipped, lines dropped or doubled, junk put in."""
    data = bytearray(original)
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["cut", "flip", "insert", "drop_line", "dup_line", "utf8"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if op == "cut":
            data = data[:at]
        elif op == "flip":
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(max_size=16))
        elif op == "utf8":
            data[at:at] = b"\xff\xfe\xc3"  # invalid UTF-8
        else:
            lines = bytes(data).split(b"\n")
            i = draw(st.integers(0, len(lines) - 1))
            if op == "drop_line":
                del lines[i]
            else:
                lines.insert(i, lines[i])
            data = bytearray(b"\n".join(lines))
    return bytes(data)


@pytest.mark.parametrize("name", _fixture_files())
def test_probe_parsers_survive_mutated_recordings(name: str) -> None:
    parser = _parser_for(name)
    original = (FIXTURES / name).read_bytes()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=mutated(original))
    def parse(data: bytes) -> None:
        # A clear refusal is the right answer to a broken recording; anything else is a bug.
        with contextlib.suppress(ProbeParseError):
            parser(data)

    parse()
