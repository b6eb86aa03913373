"""`studiotui bench --speculative`'s rows, run quickly on a small reciting demo over two
agents of its own (127.0.0.71-72, stopped by pid however it ends).

The figures are this machine's speed: the test asserts that every row is there, that
the answers with guesses are those without, and that each ratio is a positive number
measured from the pairs, never a speed goal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from studiotui.bench import speculative
from studiotui.bench.run import BenchConfig, _on_agents, _speculative_cluster

ROWS = (
    "spec_draft_ratio",
    "mlx_spec_draft_ratio",
    "spec_lookup_ratio",
    "spec_miss_ratio",
    "spec_verify_ceiling",
    "spec_lookup_of_ceiling",
)


@pytest.mark.timeout(900)
def test_the_speculative_rows_are_measured_and_their_tokens_match() -> None:
    cfg = BenchConfig(layers=4, hidden=128, tokens=speculative.TOKENS)
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        home = Path(tmp)
        figures = _on_agents(home, 2, lambda inv: _speculative_cluster(home, inv, cfg, 2))
    print(json.dumps(figures, indent=1))  # shown with -s: this run's figures
    assert figures["spec_tokens_match"] is True
    for row in ROWS:
        value = figures[row]
        assert isinstance(value, float) and value > 0, (row, value)
    # The reciting draft and a prediction of the answer's own copy are kept whole; the
    # guesses that never agree are never kept.
    assert figures["spec_draft_acceptance"] == 1.0
    assert figures["spec_lookup_acceptance"] == 1.0
    assert figures["spec_miss_acceptance"] in (0.0, None)
    # The ceiling was measured on verify steps that grew to lookup's widest.
    assert figures["spec_verify_ceiling_guesses"] == 16
    ceiling = figures["spec_verify_ceiling"]
    assert figures["spec_lookup_of_ceiling"] == pytest.approx(
        figures["spec_lookup_ratio"] / ceiling, abs=0.002
    )
    assert figures["spec_load_avg"] >= 0


def test_a_side_counts_the_tokens_after_its_first_delta() -> None:
    """A speculating answer's first delta may carry several tokens (its first verify
    step rides on the prompt's last token): tok/s counts the tokens after it, over the
    time after it, and a step's time is the gap before its delta."""
    answer = speculative.Answer(
        deltas=[[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13, 14]],
        stamps=[10.0, 10.5, 10.7, 11.0],
        usage={},
    )
    assert answer.tokens == list(range(1, 15))
    assert answer.tps == pytest.approx(11 / 1.0)
    assert answer.steps(5) == pytest.approx([0.5, 0.3])
    assert answer.steps(1) == pytest.approx([0.2])
    assert speculative.Answer([[1]], [1.0], {}).tps == 0.0


@pytest.mark.timeout(300)
def test_sigterm_stops_the_bench_and_the_agents_it_started(tmp_path: Path) -> None:
    """`kill` of a running bench (a CI's timeout, a service manager) leaves no agent of
    it running: it says it was stopped, and its agents are gone."""
    env = {**os.environ, "STUDIOTUI_HOME": str(tmp_path)}
    bench = subprocess.Popen(
        [sys.executable, "-m", "studiotui", "bench", "--speculative", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    agents: list[psutil.Process] = []
    try:
        me = psutil.Process(bench.pid)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(agents) < 2:
            agents = [c for c in me.children() if "worker" in " ".join(c.cmdline())]
            time.sleep(0.2)
        assert len(agents) == 2, "the bench never started its two agents"
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode == 143, err
        assert "bench stopped (SIGTERM)" in err
        _, alive = psutil.wait_procs(agents, timeout=10)
        assert alive == [], [a.pid for a in alive]
    finally:
        # Only what this test started: the bench, and the agents it started.
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for agent in agents:
            if agent.is_running():
                agent.kill()
