"""Stop strings cost O(the text a token adds), and cut exactly where the old rescan did."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.sampling import ParamError, SamplingParams, TextStream
from worker.shared.protocol.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS


class Segments:
    """A detokenizer whose token i adds `segments[i]`: the stream's view of mlx-lm's."""

    def __init__(self, segments: list[str]) -> None:
        self.segments = segments
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = self.segments[token]

    def finalize(self) -> None:
        self.last_segment = ""


class RescanStream:
    """The stream as it was: the whole answer kept and searched again on every token."""

    def __init__(self, detokenizer: Any, stop: tuple[str, ...]) -> None:
        self._detok, self._stop = detokenizer, tuple(s for s in stop if s)
        self._emitted, self._text, self.stopped = 0, "", False

    def add(self, token: int) -> str:
        self._detok.add_token(token)
        self._text += self._detok.last_segment
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._detok.finalize()
        self._text += self._detok.last_segment
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        since = self._emitted
        found = [
            i for s in self._stop if (i := self._text.find(s, max(0, since - len(s) + 1))) >= 0
        ]
        if found:
            self.stopped = True
            return self._take(min(found))
        hold = 0
        if not final:
            for s in self._stop:
                for n in range(min(len(s) - 1, len(self._text)), 0, -1):
                    if s.startswith(self._text[-n:]):
                        hold = max(hold, n)
                        break
        return self._take(len(self._text) - hold)

    def _take(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out


def run(cls: type, segments: list[str], stop: tuple[str, ...]) -> tuple[list[str], bool]:
    stream = cls(Segments(segments), stop)
    out = []
    for i in range(len(segments)):
        out.append(stream.add(i))
        if stream.stopped:
            break
    out.append(stream.finish())
    return out, stream.stopped


# A two-letter alphabet makes stop strings match, overlap and straddle tokens often.
TEXT = st.text(alphabet="ab", max_size=4)


@settings(max_examples=1500, deadline=None)
@given(segments=st.lists(TEXT, max_size=30), stop=st.lists(st.text("ab", max_size=5), max_size=4))
def test_stop_strings_cut_where_the_rescan_did(segments: list[str], stop: list[str]) -> None:
    assert run(TextStream, segments, tuple(stop)) == run(RescanStream, segments, tuple(stop))


@settings(max_examples=300, deadline=None)
@given(
    segments=st.lists(st.text(alphabet="abc\n é", max_size=6), max_size=40),
    stop=st.lists(st.text(alphabet="abc\n é", min_size=1, max_size=8), max_size=16),
)
def test_stop_strings_with_a_wider_alphabet(segments: list[str], stop: list[str]) -> None:
    assert run(TextStream, segments, tuple(stop)) == run(RescanStream, segments, tuple(stop))


def test_a_token_costs_its_own_text_not_the_answer() -> None:
    # The worst case for a rescan: 16 long stop strings whose every prefix is the
    # answer's tail, so everything is held and searched again and again.
    stops = tuple("a" * (MAX_STOP_CHARS - 1) + chr(ord("b") + i) for i in range(MAX_STOP_STRINGS))
    tokens = 20_000
    stream = TextStream(Segments(["a"] * tokens), stops)
    work = []
    for i in range(tokens):
        stream.add(i)
        work.append(stream.work)
    assert not stream.stopped
    # The matchers' steps are amortised O(1) a character per stop string ...
    assert stream.work <= 2 * tokens * len(stops)
    # ... so the last thousand tokens cost what the first thousand after warm-up did.
    early = work[3000] - work[2000]
    late = work[-1] - work[-1001]
    assert late <= early
    # What is kept is the held-back tail, not the answer.
    assert len(stream._pending) < MAX_STOP_CHARS


def test_the_whole_answer_comes_out_when_nothing_stops_it() -> None:
    stream = TextStream(Segments(["Hel", "lo ", "wor", "ld"]), ("low", "xyz"))
    out = [stream.add(i) for i in range(4)]
    out.append(stream.finish())
    assert "".join(out) == "Hello world" and not stream.stopped
    assert out[:2] == ["He", "llo "]  # "l" could begin "low" until "o " came


def test_stop_string_limits_are_refused_by_the_runner() -> None:
    ok = SamplingParams.from_dict({"stop": ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS})
    assert len(ok.stop) == MAX_STOP_STRINGS
    for bad in (
        {"stop": ["x" * (MAX_STOP_CHARS + 1)]},
        {"stop": ["x"] * (MAX_STOP_STRINGS + 1)},
        {"stop": "END"},
        {"stop": [1]},
        {"seed": -1},
        {"seed": 2**63},
    ):
        try:
            SamplingParams.from_dict(bad)
        except ParamError as exc:
            assert str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")
