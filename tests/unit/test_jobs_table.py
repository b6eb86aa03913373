"""`studiotui jobs` at 80 columns: a row per node on one line, the name whole."""

from __future__ import annotations

from rich.console import Console

from studiotui.cli.tune_cmd import jobs_table


def test_the_jobs_table_keeps_names_whole_at_80_columns() -> None:
    path = "/Users/me/.studiotui/jobs/legal-summaries-v2/adapters"
    rows = [
        ["legal-summaries-v2", "finetune", "studio-a", "done", "1000/1000", "1.234", "812", ""],
        ["legal-summaries-v2", "finetune", "studio-b", "done", "1000/1000", "1.250", "799", ""],
        ["tiny", "finetune", "studio-c", "failed", "3/40", "", "", f"adapter: {path}"],
    ]
    console = Console(width=80, record=True, color_system=None)
    console.print(jobs_table(rows))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    # Each node's row on one line, its job's name and node whole in it.
    for name, node, state in [(r[0], r[2], r[3]) for r in rows]:
        assert any(name in line and node in line and state in line for line in lines), lines
    # The message, however long, is all there (under the table, where it has the width).
    assert path in "".join(line.strip() for line in lines)
