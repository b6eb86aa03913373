"""The cluster benchmark's pure parts: the arithmetic, the sizes both sides refuse, the
saved runs, comparing two, and the drawings (bars, the streams curve, Markdown)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from studiotui.core import benchmark as bm
from studiotui.core.benchmark import (
    BenchmarkError,
    NodeFigures,
    Sizes,
    Step,
    StreamPoint,
)
from studiotui.views import benchmark as view
from tests.support.benchmark_fixtures import sample_run
from worker import device_bench
from worker.agent import link_sizes
from worker.shared.protocol import control
from worker.shared.protocol.messages import MessageError

# ---- node side: the device program's arithmetic and refusals ------------------------------


def test_matmul_flops_and_rate() -> None:
    assert device_bench.matmul_flops(2, 3, 4) == 48.0
    assert device_bench.rate(100.0, [2.0, 1.0, 4.0]) == 50.0  # the median repetition
    with pytest.raises(ValueError):
        device_bench.rate(1.0, [])


def test_pick_n_sizes_the_product_to_the_time() -> None:
    # 1 ms at 128: 512 takes 64 ms, 1024 takes 512 ms.
    assert device_bench.pick_n(0.001, 128, 4096, 0.1) == 512
    assert device_bench.pick_n(0.001, 128, 256, 10.0) == 256  # never past the cap
    assert device_bench.pick_n(10.0, 128, 4096, 0.001) == device_bench.MIN_N  # a floor


@pytest.mark.parametrize(
    ("spec", "word"),
    [
        ({"matmul_n": 10, "copy_mib": 8, "seconds": 0.1}, "matmul_n"),
        ({"matmul_n": 256, "copy_mib": 0, "seconds": 0.1}, "copy_mib"),
        ({"matmul_n": 256, "copy_mib": 8, "seconds": 600}, "seconds"),
        ({"matmul_n": 256, "copy_mib": 8}, "missing"),
        ({"matmul_n": 256, "copy_mib": 8, "seconds": 0.1, "dtypes": ["int8"]}, "dtypes"),
        ({"matmul_n": 256, "copy_mib": 8, "seconds": 0.1, "surprise": 1}, "unknown"),
    ],
)
def test_device_sizes_out_of_bounds_are_refused(spec: dict, word: str) -> None:
    with pytest.raises(device_bench.SpecError, match=word):
        device_bench.check_spec(spec)


def test_a_rank_refuses_endless_steps_before_joining_its_group() -> None:
    # No group environment here: a rank that got as far as joining would fail otherwise.
    for reps in (1001, 10**9, "many"):
        with pytest.raises(device_bench.SpecError, match="reps must be between 1 and 1000"):
            device_bench.group_run({"n": 128, "reps": reps})


def _sizes(**asked: object) -> control.LinkSizes:
    msg = {"type": "measure_links", "peers": [], "sizes": asked}
    return control.parse(msg, control.MeasureLinks).sizes


def test_link_sizes_keep_defaults_and_refuse_out_of_bounds() -> None:
    sizes = link_sizes(_sizes(bulk_seconds=0.5, in_flight=8))
    assert (sizes.bulk_seconds, sizes.in_flight, sizes.chunk_bytes) == (0.5, 8, 4 << 20)
    for bad in ({"bulk_seconds": 600}, {"chunk_bytes": 1 << 30}, {"pings": 2}):
        with pytest.raises(ValueError, match="link measurement"):
            link_sizes(_sizes(**bad))
    # A size of the wrong type, or one no agent knows, is refused naming it.
    for bad, words in (({"pings": True}, "$.sizes.pings"), ({"x": 1}, "unknown field `x`")):
        with pytest.raises(MessageError, match="measure_links") as caught:
            _sizes(**bad)
        assert words in str(caught.value)


# ---- operator side: sizes, steps, arithmetic ------------------------------------------------


def test_sizes_overrides_are_checked_before_anything_runs() -> None:
    sizes = Sizes().changed(["matmul_n=512", "link-seconds=0.2", "stream_counts=1,2"])
    assert (sizes.matmul_n, sizes.link_seconds, sizes.stream_counts) == (512, 0.2, (1, 2))
    for bad, word in (
        (["matmul=5"], "known name"),
        (["matmul_n=abc"], "matmul_n='abc': wants a whole number$"),
        (["seconds=fast"], "seconds='fast': wants a number$"),
        (["stream_counts=1,x"], "wants a whole number$"),
        (["matmul_n=16"], "between"),
        (["stream_counts=0"], "at least 1"),
        # Named as the user typed it, not by the agent's field (chunk_bytes, bulk_seconds).
        (["link_chunk_bytes=1"], "link_chunk_bytes must be between"),
        (["link_seconds=nan"], "link_seconds must be between 0.01 and 10, not nan"),
    ):
        with pytest.raises(BenchmarkError, match=word):
            Sizes().changed(bad)
    assert Sizes().problem() == "" and Sizes.quick().problem() == ""


@pytest.mark.parametrize(
    ("name", "value", "words", "default"),
    [
        ("stream_tokens", 100000, "must be between 1 and 4096, not 100000", "64"),
        ("prompt_tokens", 1280000, "must be between 1 and 32768, not 1280000", "128"),
        ("group_reps", 50000, "must be between 1 and 1000, not 50000", "5"),
        ("stream_counts", (1, 2, 4, 800), "must each be between 1 and 64, not 800", "1,2,4,8"),
        ("stream_counts", (1,) * 17, "may list at most 16 counts, not 17", "1,2,4,8"),
    ],
)
def test_run_sizes_have_upper_bounds(
    name: str, value: int | tuple[int, ...], words: str, default: str
) -> None:
    """A typo (an extra zero or two) would ask for hours of decoding or products: the
    size is refused naming itself, its bounds and its default."""
    text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
    with pytest.raises(BenchmarkError) as caught:
        Sizes().changed([f"{name}={text}"])
    assert caught.value.message == f"--size: {name} {words}"
    assert caught.value.hint == f"give {name} a value within them (the default is {default})"
    # Sizes made in code (the dashboard's) meet the same bounds.
    assert replace(Sizes(), **{name: value}).problem() == f"{name} {words}"


def test_run_sizes_at_their_bounds_are_taken() -> None:
    sizes = Sizes().changed(["stream_tokens=4096", "group_reps=1000", "stream_counts=1,64"])
    assert (sizes.stream_tokens, sizes.group_reps, sizes.stream_counts) == (4096, 1000, (1, 64))


def test_plan_steps_orders_nodes_links_group_placements() -> None:
    steps = bm.plan_steps(["a", "b"], ["p"], (1, 8))
    assert steps == [
        "a: device",
        "b: device",
        "link a → b",
        "link b → a",
        "group of 2: distributed product",
        "p: 1 stream",
        "p: 8 streams",
    ]
    assert bm.plan_steps(["a"], [], (1,)) == ["a: device"]  # no link, no group alone
    assert Step(2, 4, "x").fraction == 0.25 and Step(2, 4, "x", state="done").fraction == 0.5


def test_group_against_the_sum_of_its_parts() -> None:
    nodes = [
        NodeFigures("a", gflops={"float32": 10.0}, matmul_n={"float32": 1024}),
        NodeFigures("b", gflops={"float32": 30.0}, matmul_n={"float32": 512}),
    ]
    assert bm.parts_gflops(nodes, ["a", "b"], "float32") == 40.0
    assert bm.parts_gflops(nodes, ["a", "c"], "float32") is None
    assert bm.scaling(30.0, 40.0) == 0.75 and bm.scaling(None, 40.0) is None
    assert bm.group_n(nodes, ["a", "b"], 4096) == 512  # the smallest product timed
    assert bm.group_n(nodes, ["a", "b", "c"], 100) == 99  # a multiple of the ranks


def test_merge_directions_keeps_each_way() -> None:
    results = [
        {"from": "a", "peer": "b", "latency_us": 50.0, "latency_pad_us": 70.0, "gbps": 9.0},
        {"from": "b", "peer": "a", "latency_us": 40.0, "gbps": 7.0},
    ]
    link = bm.merge_directions("a", "b", results, "ethernet")
    assert (link.latency_us, link.latency_pad_us, link.gbps, link.gbps_back) == (
        40.0,
        70.0,
        9.0,
        7.0,
    )
    assert link.best_gbps == 9.0 and not link.error
    failed = bm.merge_directions("a", "b", [{"from": "a", "error": "b: timeout"}], "wifi")
    assert failed.error == "b: timeout" and failed.latency_us is None


def test_stream_point_counts_every_token_over_the_wall_time() -> None:
    runs = [
        {"tokens": [1] * 10, "start": 0.0, "end": 2.0, "ttft_ms": 100.0},
        {"tokens": [1] * 10, "start": 0.5, "end": 4.0, "ttft_ms": 300.0},
    ]
    point = bm.stream_point(2, runs)
    assert point == StreamPoint(2, 5.0, 200.0, 20)


# ---- saved runs and comparing ---------------------------------------------------------------


def test_a_saved_run_reads_back_equal(tmp_path: Path) -> None:
    run = sample_run()
    path = bm.save(tmp_path, run)
    assert path == tmp_path / "benchmarks" / f"{run.id}.json"
    assert bm.read(path) == run
    assert json.loads(path.read_text())["format"] == bm.FORMAT


def test_find_by_id_start_latest_previous_and_path(tmp_path: Path) -> None:
    old, new = sample_run("20260101-000000-desk"), sample_run("20260102-000000-desk")
    bm.save(tmp_path, old)
    path = bm.save(tmp_path, new)
    assert bm.find(tmp_path, "latest") == new and bm.find(tmp_path, "previous") == old
    assert bm.find(tmp_path, "20260101") == old and bm.find(tmp_path, str(path)) == new
    with pytest.raises(BenchmarkError, match="names 2 runs"):
        bm.find(tmp_path, "2026")
    with pytest.raises(BenchmarkError, match="no saved benchmark run"):
        bm.find(tmp_path, "1999")
    (tmp_path / "benchmarks" / "junk.json").write_text('{"format": 99}')
    assert [r.id for r in bm.saved(tmp_path)] == [new.id, old.id]  # junk left out
    with pytest.raises(BenchmarkError, match="format"):
        bm.read(tmp_path / "benchmarks" / "junk.json")


def test_compare_lines_up_both_runs_with_the_change() -> None:
    a, b = sample_run("a"), sample_run("b", scale=2.0)
    rows = {(r.section, r.item, r.figure): r for r in bm.compare(a, b)}
    f32 = rows[("node", "studio-1", "matmul float32")]
    assert (f32.a, f32.b, f32.change) == (20000.0, 40000.0, 1.0)
    first = rows[("placement", "qwen", "8 streams first token")]
    assert first.change == 0.0 and not first.higher_is_better
    assert ("node", "studio-2", "matmul float32") not in rows  # failed on both: no row
    fewer = replace(b, links=())
    gone = {(r.section, r.figure): r for r in bm.compare(a, fewer)}[("link", "latency")]
    assert gone.b is None and gone.change is None


# ---- drawing ----------------------------------------------------------------------------


def test_bars_are_drawn_in_eighths_of_a_cell() -> None:
    assert view.bar(1.0, 1.0, 4) == "████"
    assert view.bar(0.5, 1.0, 3) == "█▌"
    assert view.bar(0.5, 1.0, 1) == "▌" and view.bar(1 / 8, 1.0, 1) == "▏"
    assert view.bar(0.0, 1.0, 5) == "" and view.bar(2.0, 1.0, 2) == "██"
    lines = view.bar_chart([("a", 10.0), ("bb", 5.0), ("c", None)], "GB/s", 30)
    assert [len(x) for x in lines] == [len(lines[0])] * 3
    assert lines[0].count("█") == 2 * lines[1].count("█") and "–" in lines[2]


def test_the_curve_puts_each_point_at_its_height() -> None:
    lines = view.curve([(1, 10.0), (2, 20.0), (4, 40.0), (8, 40.0)], 30, 5)
    plot = [line.split("┤", 1)[1] for line in lines[:5]]
    assert lines[0].startswith("40.0") and plot[0].count("●") == 2  # 4 and 8 at the top
    assert plot[4 - round(10 / 40 * 4)].startswith("●")  # 1 stream, a quarter up, left
    assert lines[-1].split() == ["1", "2", "4", "8"]
    assert "·" in "".join(plot)


def test_markdown_has_every_table_and_the_failures() -> None:
    text = view.markdown(sample_run())
    for heading in ("## Nodes", "## Links", "## Group", "## Placements", "## Failed"):
        assert heading in text
    assert "| studio-1 | Apple M3 Ultra gpu | 20,000 | 40,000 | 41,000 | 700 | 750 |" in text
    assert "| qwen | qwen3-32b | 8 | 56.6 | 700 |" in text
    assert "studio-2: device_bench timed out" in text
    both = view.compare_markdown(sample_run("a"), sample_run("b", scale=2.0))
    assert "| node | studio-1 | matmul float32 | GFLOP/s | 20,000 | 40,000 | +100.0 % |" in both


def test_the_report_draws_every_section_and_marks_queued_streams() -> None:
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(view.report(sample_run(), 120))
    text = console.export_text()
    for word in ("GFLOP/s", "Gbit/s", "sum of parts", "0.750× the sum", "8 (queued)", "●"):
        assert word in text, word
    assert "4 (queued)" not in text  # 4 streams are what the placement admits
    assert "failed: studio-2: device_bench timed out" in text


def test_number_keeps_three_significant_digits() -> None:
    assert [view.number(v) for v in (0.0004567, 1.23456, 123.456, 98765.4)] == [
        "0.000457",
        "1.23",
        "123",
        "98,765",
    ]
    assert view.number(None) == "–" and view.number(float("nan")) == "–"


def test_the_comparison_keeps_each_figure_named_at_80_columns() -> None:
    """A group of four nodes made the item column so wide at 80 columns that rich
    narrowed the figure column to nothing: a node's five rows could not be told apart."""
    from rich.console import Console

    a, b = sample_run("a"), sample_run("b", scale=2.0)
    assert a.group is not None
    four = replace(a.group, nodes=("local-1", "local-2", "local-3", "local-4"))
    a, b = replace(a, group=four), replace(b, group=four)
    console = Console(width=80, record=True)
    console.print(view.compare_table(a, b))
    text = console.export_text()
    for figure in (
        "matmul float32",
        "matmul bfloat16",
        "memory read",
        "latency, activation",
        "sum of parts",
        "8 streams first token",
    ):
        assert figure in text, figure
    assert max(len(line) for line in text.splitlines()) <= 80
