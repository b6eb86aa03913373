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
    # Every header whole (the rate's was cut to "tok…").
    header = next(line for line in lines if "job" in line and "state" in line)
    assert all(col in header for col in ("kind", "node", "iter", "loss", "tok/s")), header
    # Each node's row on one line, its job's name and node whole in it.
    for name, node, state in [(r[0], r[2], r[3]) for r in rows]:
        assert any(name in line and node in line and state in line for line in lines), lines
    # The message, however long, is all there (under the table, where it has the width).
    assert path in "".join(line.strip() for line in lines)


def test_a_progress_line_shows_the_validation_loss_only_when_it_was_measured() -> None:
    """It repeated the last validation loss on every line of `finetune`'s progress."""
    from studiotui.cli.tune_cmd import progress_line
    from studiotui.core.jobs import JobProgress, Point

    first = JobProgress(
        "tune",
        state="running",
        iteration=10,
        total=30,
        train_loss=(Point(10, 2.5),),
        val_loss=(Point(10, 2.75),),
    )
    assert "val 2.750" in progress_line(first, since=-1)
    later = JobProgress(
        "tune",
        state="running",
        iteration=20,
        total=30,
        train_loss=(Point(10, 2.5), Point(20, 2.0)),
        val_loss=(Point(10, 2.75),),
    )
    assert "val" not in progress_line(later, since=10) and "loss 2.000" in progress_line(later, 10)
