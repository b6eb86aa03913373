"""Speed and time left of a copy or load, as the CLI and the TUI's progress blocks show them."""

from __future__ import annotations

import time

from studiotui.app.panes.placements import progress_lines
from studiotui.core.rates import Mark, Paced, Rates, format_eta, format_speed


def test_a_phase_has_its_own_clock_and_says_speed_and_time_left() -> None:
    rates = Rates()
    rates.update("mac-1", 0, 1000, now=100.0)
    assert rates.text("mac-1", 0, 1000, now=100.0) == ""  # nothing moved yet
    rates.update("mac-1", 400, 1000, now=104.0)
    assert rates.speed("mac-1", 400, now=104.0) == 100.0
    assert rates.text("mac-1", 400, 1000, now=104.0) == "100 B/s, 0:06 left"
    # The load after the copy: another total, another clock.
    rates.update("mac-1", 0, 5_000_000_000, now=110.0)
    rates.update("mac-1", 2_000_000_000, 5_000_000_000, now=120.0)
    assert rates.text("mac-1", 2_000_000_000, 5_000_000_000, now=120.0) == "200.0 MB/s, 0:15 left"
    assert rates.text("mac-1", 5_000_000_000, 5_000_000_000, now=130.0) == ""
    assert format_speed(2.5e9) == "2.5 GB/s" and format_eta(3725) == "1:02:05"


def test_the_progress_block_shows_bytes_speed_and_eta_per_node() -> None:
    rates = Rates({"mac-1": Mark(time.monotonic() - 10.0, 0, 100_000_000)})
    lines = progress_lines({"mac-1": (50_000_000, 100_000_000), "mac-2": (0, 0)}, rates=rates)
    first, second = (line.plain for line in lines)
    assert "MB / " in first and "MB/s" in first and "left" in first
    assert second.endswith("waiting")


def test_paced_reports_draw_the_first_the_last_and_one_per_interval() -> None:
    paced = Paced(every_s=0.1)
    assert paced.due(0, 100, now=10.0)  # the start
    assert not paced.due(5, 100, now=10.05)
    assert paced.due(10, 100, now=10.2)
    assert not paced.due(20, 100, now=10.25)
    assert paced.due(100, 100, now=10.26)  # the end, however soon
