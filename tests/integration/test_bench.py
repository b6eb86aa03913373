"""`studiotui bench`: the quick run end to end, and how it turns runs into figures.

The quick bench starts its own four agents on 127.0.0.71-74:56500 and stops them by
pid when it ends, also when it fails. Its speed figures are printed, not asserted:
this machine's speed comes and goes.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from studiotui.bench.batching import BareHop
from studiotui.bench.run import BenchConfig, hop_pairing, moe_pairing, run_bench, summarize

FIGURES = {
    "single_tps",
    "pipe2_tps",
    "pipe4_tps",
    "pipe2_ratio",
    "pipe4_ratio",
    "streams",
    "streams4_ratio",
    "mlx_ring2_tps",
    "hop_us_p50",
    "frame_overhead_us_p50",
    "ring_overhead_us_p50",
    "ring_token_us_p50",
    "ring_mlx_us_p50",
    "ttft_single_ms",
    "ttft_pipe2_ms",
    "ttft_pipe2_ratio",
    "moe_ttft_ratio",
    "structured_tok_ratio",
    "tokens_match",
    "moe_pipe2_ratio",
    "moe_pipe2_floor_ratio",
    "moe_pipe2_over_floor",
    "batch8_ratio",
    "mlx_batch8_ratio",
    "bare_hop_us",
    "hop_over_bare",
    "finetune2_ratio",
    "kv8_context_ratio",
    "tp2_ratio",
    "mlx_tp2_ratio",
}


# A hang guard: 232 s at load ~20 before the cache and TTFT phases, ~13 min at ~9 after.
@pytest.mark.timeout(1200)
def test_quick_bench_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(quick=True, as_json=True) == 0
    captured = capsys.readouterr()
    figures = json.loads(captured.out)
    # Each part says on stderr that it started (minutes with nothing shown, before).
    assert all(f"bench: {name}…" in captured.err for name in figures["phases_s"]), captured.err
    print(json.dumps(figures, indent=1))  # shown with -s: the figures of this run
    assert figures.keys() >= FIGURES
    assert figures["tokens_match"] is True
    assert set(figures["streams"]) == {"1", "2", "4"}
    rates = [figures[k] for k in ("single_tps", "pipe2_tps", "pipe4_tps", "mlx_ring2_tps")]
    assert all(r > 0 for r in rates + list(figures["streams"].values()))
    assert figures["hop_us_p50"] > 0 and figures["ttft_pipe2_ms"] > 0
    # The time-to-first-token rows: paired runs, a prompt of several prefill chunks, and
    # the 4-bit MoE's ~600 tokens (their first tokens count in tokens_match).
    assert figures["ttft_prompt_tokens"] > 512 and figures["moe_ttft_prompt_tokens"] == 600
    assert figures["ttft_pipe2_ratio"] > 0 and len(figures["ttft_pipe2_pairs"]) == 1
    assert figures["moe_ttft_ratio"] > 0 and len(figures["moe_ttft_pairs"]) == 1
    # A schema's decode, paired with the free one; the grammar never cut a run short.
    assert figures["structured_tok_ratio"] > 0 and len(figures["structured_pairs"]) == 2
    assert figures["structured_full_runs"] is True
    assert figures["moe_pipe2_tps"] > 0 and figures["moe_pipe2_ratio"] > 0
    assert len(figures["moe_pipe2_pairs"]) == 4  # the pairs behind the MoE row's median
    # Its floor ran in the same rounds, paired with the same single runs (and its tokens
    # are in tokens_match).
    assert figures["moe_pipe2_floor_ratio"] > 0 and len(figures["moe_pipe2_floor_pairs"]) == 4
    assert figures["moe_pipe2_over_floor"] == pytest.approx(
        figures["moe_pipe2_ratio"] / figures["moe_pipe2_floor_ratio"], abs=0.01
    )
    assert figures["batch8_ratio"] > 0 and figures["mlx_batch8_ratio"] > 0
    # The goal: 8-bit KV offers at least 1.8x the context on the same nodes.
    assert figures["kv8_context_ratio"] >= 1.8
    assert figures["batch8_mean_rows"] > 1  # the eight streams really met in batches
    assert figures["bare_hop_us"] > 0 and figures["hop_over_bare"] > 0
    # One hop-over-floor pair per pipe2 run, shown beside the ratio: the run's own hops
    # (its head's, in the answer's timings) over the bare hops measured right after it.
    assert len(figures["hop_over_bare_pairs"]) == 3  # --quick too runs pipe2 three times
    # pipe2's steps, measured on its head: per step, the token's time is MLX's evaluation
    # plus the ring's overhead, and the overhead is two hops plus two stages' Python per
    # frame, each part measured and none negative; so the medians keep those orders.
    hop, frame = figures["hop_us_p50"], figures["frame_overhead_us_p50"]
    overhead, token = figures["ring_overhead_us_p50"], figures["ring_token_us_p50"]
    assert hop > 0 and frame > 0 and figures["ring_mlx_us_p50"] > 0
    assert overhead >= 2 * hop - 0.2 and overhead >= 2 * frame - 0.2  # (each rounded)
    assert token >= overhead and token >= figures["ring_mlx_us_p50"]
    assert figures["finetune2_ratio"] is None  # and so is fine-tuning
    assert figures["tp2_tps"] > 0 and figures["mlx_tp2_tps"] > 0  # both tensor-parallel runs ran
    assert figures["tp2_over_mlx"] > 0  # and were paired run by run, under the same load
    assert figures["provision4_ratio"] is None  # --quick leaves provisioning out
    assert sum(figures["phases_s"].values()) <= figures["bench_seconds"] + 1


def test_the_bare_hop_finds_each_receiver_asleep_and_is_worked_out_as_the_rings() -> None:
    """Both ends wait a decode step before they send, so each message reaches a receiver
    that has slept (the far end used to answer at once); the far end's own span, wait
    included, comes back in its token frame and is taken off the round trip, as a ring
    stage's `work_us` is: what is left is two hops, not the waits."""
    gap = 0.02
    bare = BareHop("127.0.0.76", 56700, 64, gap_s=gap)
    try:
        began = time.monotonic()
        bare.measure(4, warm=1)
        elapsed = time.monotonic() - began
    finally:
        bare.close()
    assert not bare.failed and len(bare.hops) == 4
    assert elapsed >= 5 * 2 * gap  # each of the 5 round trips waited at both ends
    hop = bare.hop_us()
    assert hop is not None and 0 < hop < gap * 1e6 / 2  # the far end's wait is not in it


def _run(tps: float, tokens: list[int]) -> dict[str, Any]:
    return {"tps": tps, "tokens": tokens}


def _pipe(single: list[float], pipe: list[float], tokens: list[int]) -> dict[str, Any]:
    ratios = sorted(p / s for p, s in zip(pipe, single, strict=True))
    return {
        "tps": sorted(pipe)[len(pipe) // 2],
        "ratio": ratios[len(ratios) // 2],
        "ratios": ratios,
        "tokens": [tokens for _ in pipe],
        "single": [_run(s, [1, 2, 3]) for s in single],
    }


def _figures(pipe4_tokens: list[int]) -> dict[str, Any]:
    return {
        "pipe2": {
            **_pipe([50.0, 60.0, 70.0], [45.0, 54.0, 70.0], [1, 2, 3]),
            # each run's hop over the bare hop measured right after it
            "hop_over_bare": [1.8, 2.4, 1.9],
        },
        "pipe4": _pipe([50.0, 60.0, 70.0], [40.0, 48.0, 56.0], pipe4_tokens),
        "streams": {"1": 40.0, "2": 70.0, "4": 90.0},
        "streams1_tokens": [[1, 2, 3]],
        "streams2_tokens": [[1, 2, 3]] * 2,
        "streams4_tokens": [[1, 2, 3]] * 4,
        "pipe2_ring": {
            "hop_us_p50": 500.0,
            "frame_overhead_us_p50": 300.0,
            "ring_overhead_us_p50": 1600.0,
            "ring_token_us_p50": 6000.0,
            "ring_mlx_us_p50": 4400.0,
        },
        "bare_hop_us": 250.0,
        "tui_idle_cpu_pct": 1.0,
        "api": {"api_tps": 10.0, "direct_tps": 10.0, "api_overhead_ratio": 1.0},
    }


def test_summary_takes_ratios_from_pairs_and_checks_every_run() -> None:
    cfg = BenchConfig.make(quick=True)
    out = summarize(_figures([1, 2, 3]), None, cfg)
    assert out["single_tps"] == 60.0  # the median of all six single-process runs
    assert out["pipe2_ratio"] == 0.9 and out["pipe4_ratio"] == 0.8
    assert out["streams4_ratio"] == 1.5
    assert out["tokens_match"] is True and out["mlx_ring2_tps"] is None
    assert out["hop_us_p50"] == 500.0 and out["ring_overhead_us_p50"] == 1600.0
    # The hop's ratio is that of the medians of all steps; each run's own is shown too.
    assert out["bare_hop_us"] == 250.0 and out["hop_over_bare"] == 2.0
    assert out["hop_over_bare_pairs"] == [1.8, 2.4, 1.9]
    assert summarize(_figures([1, 2, 4]), None, cfg)["tokens_match"] is False


def test_the_full_run_reports_the_engine_on_one_node_and_checks_its_tokens() -> None:
    cfg = BenchConfig.make(quick=False)
    assert cfg.lone and not BenchConfig.make(quick=True).lone
    figures = _figures([1, 2, 3])
    figures["pipe1"] = _pipe([50.0, 60.0, 70.0], [55.0, 66.0, 77.0], [1, 2, 3])
    out = summarize(figures, None, cfg)
    assert out["pipe1_tps"] == 66.0 and out["pipe1_ratio"] == 1.1
    assert out["single_tps"] == 60.0  # its single-process runs count too
    assert summarize(_figures([1, 2, 3]), None, cfg)["pipe1_tps"] is None
    figures["pipe1"] = _pipe([50.0], [55.0], [9, 9, 9])
    assert summarize(figures, None, cfg)["tokens_match"] is False


def test_pipe2_runs_at_least_three_times_for_the_hop_and_its_floor() -> None:
    quick, full = (hop_pairing(BenchConfig.make(quick=q)) for q in (True, False))
    assert quick.decode_rounds == 3 and quick.tokens == BenchConfig.make(quick=True).tokens
    assert full == BenchConfig.make(quick=False)  # the full run had three already


def test_the_moe_row_pairs_an_even_number_of_runs_long_enough_to_span_a_hiccup() -> None:
    quick, full = (moe_pairing(BenchConfig.make(quick=q)) for q in (True, False))
    assert (quick.decode_rounds, quick.tokens) == (4, 96)  # was 2 runs of 48 a side
    assert (full.decode_rounds, full.tokens) == (4, 256)
    assert moe_pairing(BenchConfig(layers=8, hidden=256, tokens=300, decode_rounds=5)) == (
        BenchConfig(layers=8, hidden=256, tokens=300, decode_rounds=6)
    )  # more rounds asked for stay, made even (each order as often)


def test_the_moe_row_reads_against_its_floor_and_checks_the_floors_tokens() -> None:
    cfg = BenchConfig.make(quick=True)
    figures = _figures([1, 2, 3])
    moe = _pipe([100.0, 120.0, 140.0], [90.0, 108.0, 126.0], [5, 6])
    moe["single"] = [_run(s, [5, 6]) for s in (100.0, 120.0, 140.0)]
    moe["floor"] = _pipe([100.0, 120.0, 140.0], [100.0, 120.0, 140.0], [5, 6])
    figures["moe2"] = moe
    out = summarize(figures, None, cfg)
    assert out["moe_pipe2_ratio"] == 0.9 and out["moe_pipe2_floor_ratio"] == 1.0
    assert out["moe_pipe2_floor_pairs"] == [1.0, 1.0, 1.0]
    assert out["moe_pipe2_over_floor"] == 0.9 and out["tokens_match"] is True
    moe["floor"]["tokens"][1] = [5, 7]  # one floor run strayed from mlx-lm's answer
    assert summarize(figures, None, cfg)["tokens_match"] is False
    del moe["floor"]  # a run without a floor reports none
    out = summarize(figures, None, cfg)
    assert out["moe_pipe2_floor_ratio"] is None and out["moe_pipe2_over_floor"] is None
