"""worker.tensor, pure parts: which frames are a mirrored item, which failure a lost member."""

from __future__ import annotations

import pytest

from worker.tensor import CANCEL, GENERATE, INTERNAL, RING, MirrorError, check_event, lost_member


@pytest.mark.parametrize(
    "frames", [[INTERNAL], [RING, b"h", b"p"], [GENERATE, b"m"], [CANCEL, b"rid"]]
)
def test_every_kind_the_leader_sends_is_accepted(frames: list[bytes]) -> None:
    assert check_event(frames) == frames[0]


@pytest.mark.parametrize("frames", [[], [b"x"], [RING, b"h"], [INTERNAL, b"extra"], [CANCEL]])
def test_anything_else_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(MirrorError):
        check_event(frames)


def test_a_lost_member_is_told_by_mlx_backends_words() -> None:
    assert lost_member("RuntimeError: [ring] connection to a peer was lost")
    assert lost_member("RuntimeError: [jaccl] recv failed")
    assert not lost_member("the prompt is empty")
