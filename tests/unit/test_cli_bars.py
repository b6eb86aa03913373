"""The CLI's byte progress bars keep their figures whole at 80 columns.

Found by hand: `studiotui finetune` piped at 80 columns drew
"hashing demo to stamp the adapter with its base (once: cached) ━━━ 12… 111… 0:0…":
the long label took the room and the sizes, speed and time lost their units.
"""

from __future__ import annotations

import io
import re

from rich.console import Console

from studiotui.cli.output import Bars

LABEL = "hashing demo to stamp the adapter with its base (once: cached)"


def test_long_label_leaves_the_figures_whole_at_80_columns() -> None:
    out = Console(file=io.StringIO(), width=80, record=True, force_terminal=False)
    bars = Bars(out)
    bars.show("", LABEL, 12_400_000, 12_400_000)
    bars.show("local-2", "copying to local-2", 3_000_000, 6_000_000)
    bars.stop()
    text = out.export_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert all(len(line) <= 80 for line in lines), text
    hashing = next(line for line in lines if line.startswith("hashing"))
    # Size with its unit, a speed with its unit (or ? before one is known), the time.
    assert "12.4/12.4 MB" in hashing, text
    assert re.search(r"(\d+(\.\d+)? [kMG]?B/s|\?)", hashing), text
    assert re.search(r"\d+:\d\d:\d\d", hashing), text
    copying = next(line for line in lines if line.startswith("copying to local-2"))
    assert "3.0/6.0 MB" in copying, text
