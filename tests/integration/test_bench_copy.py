"""The copy bench's mlx-lm side: `mlx_lm.share` really moves the files between two ranks.

The full bench reports its rate beside node-to-node copies; this checks the run it
times delivers the same bytes (the rate itself is printed, not asserted).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from studiotui.bench import copy_rates as bench_copy
from worker.shared.demo_model import DemoSpec, write_demo_model


@pytest.mark.skipif(
    not Path(sys.executable).with_name("mlx.launch").exists(),
    reason="mlx.launch is not installed beside this python",
)
def test_mlx_share_delivers_the_files_and_gives_a_rate(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "m", DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2))
    dest = tmp_path / "dest"
    rate = bench_copy.mlx_share_rate(model, keep=dest)
    print(f"mlx_lm.share: {rate} MB/s")
    assert rate is not None and rate > 0
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in model.iterdir())
    for f in model.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes(), f.name
    shutil.rmtree(dest)
