"""`studiotui bench`'s table as a user reads it: units and ratios said, a figure the
run left out said so. Found by hand: 50 bare keys with "None" among them."""

from __future__ import annotations

import io

from rich.console import Console

from studiotui.bench.run import figures_table


def test_the_table_says_units_and_what_was_not_measured() -> None:
    figures = {
        "single_tps": 48.68,
        "pipe2_ratio": 1.067,
        "provision4_ratio": None,
        "hop_over_bare_pairs": [1.06, 0.95],
        "phases_s": {"single": 12.4},
    }
    out = Console(file=io.StringIO(), width=100, record=True)
    out.print(figures_table(figures))
    text = " ".join(out.export_text().split())
    assert "provision4_ratio │ not measured" in text and "None" not in text
    assert "[1.06, 0.95]" in text and '{"single": 12.4}' in text
    for said in ("_tps: tokens/s", "_us: milli-, microseconds", "_ratio: above 1 is faster"):
        assert said in text, text
    assert "--quick leaves out provisioning and fine-tuning" in text
