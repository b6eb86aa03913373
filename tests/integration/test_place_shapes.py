"""`studiotui place --tensor N` and the shape in `status --json`, end to end: the real
command line against two real local agents on their own port."""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_cli import home, run, status  # noqa: F401 - the fixture
from worker.shared.demo_model import DemoSpec, write_demo_model

PORT = 59510


def test_tensor_sizes_are_refused_in_words_previewed_with_a_forecast_and_shapes_shown(
    home: Path,  # noqa: F811 - the fixture imported above
) -> None:
    up = run(home, "up", "--local", "2", "--port", str(PORT), "--memory-gb", "2")
    assert up.returncode == 0, up.stderr
    try:
        model = home / "tiny"
        # What `demo-model DIR --layers 4 --hidden 64` writes (that verb is tested in
        # test_demo_model), written here without another process's imports.
        write_demo_model(model, DemoSpec(layers=4, hidden=64))

        three = run(home, "place", str(model), "--tensor", "3", "--dry-run")
        assert three.returncode == 2
        assert "--tensor 3: a tensor group of 3 does not split 2 nodes" in three.stderr
        assert "tensor sizes that divide here: 1, 2" in three.stderr
        assert "ring:" not in three.stdout  # refused before any plan is shown

        two = run(home, "place", str(model), "--tensor", "2", "--dry-run")
        assert two.returncode == 0, two.stderr
        assert "1 stage × 2 (ring)" in two.stdout and "local-1 + local-2" in two.stdout
        assert "local-1 ↔ local-2 has no RDMA at both ends: ring backend over" in two.stdout
        assert "forecast (1 stage × 2 (ring)):" in two.stdout and "tok/s" in two.stdout
        # …and what the other shape would do.
        assert "  --tensor 1, 2 stages: " in two.stdout
        # With speculation, the forecast says what guesses gain at the share kept it assumes.
        guessing = run(home, "place", str(model), "--draft", "lookup", "--dry-run")
        assert guessing.returncode == 0, guessing.stderr
        assert "with guesses" in guessing.stdout and "if 50% of them are kept" in guessing.stdout

        # And placed for real: every member's load reports progress under its own node
        # (the command once kept a bar only per stage and failed on the follower's
        # first report: "placement 'tp' failed and was rolled back: 'local-2'").
        placed = run(home, "place", str(model), "--tensor", "2", "--name", "tp")
        assert placed.returncode == 0, placed.stderr
        assert "placement tp is ready" in placed.stdout
        [tp] = status(home)["placements"]
        assert tp["shape"] == "1 stage × 2 (ring)" and tp["state"] == "ready"
        assert sorted(tp["nodes"]) == ["local-1", "local-2"]
        shown = run(home, "status")
        # One stage held by a group of two: one hop, not `local-1[0:4] → local-2[0:4]`.
        assert "1 stage × 2 (ring): local-1+local-2[0:4]" in shown.stdout, shown.stdout
        chat = run(home, "chat", "--placement", "tp", "--max-tokens", "4", "hello")
        assert chat.returncode == 0, chat.stderr
        assert run(home, "unload", "tp").returncode == 0

        # Unasked, two nodes of one machine: the pipeline (a group gains nothing there).
        chosen = run(home, "place", str(model), "--name", "tiny")
        assert chosen.returncode == 0, chosen.stderr
        assert "2 stages" in chosen.stdout and "forecast (2 stages):" in chosen.stdout
        [placement] = status(home)["placements"]
        assert placement["shape"] == "2 stages"
    finally:
        run(home, "down")
