"""Saved benchmark runs with every section filled, literal so drawings are the same on
every machine (the unit tests and the Benchmark screen's snapshot); the tiny sizes the
tests measure real agents with."""

from __future__ import annotations

from dataclasses import fields

from studiotui.core.benchmark import (
    GroupFigures,
    LinkFigures,
    NodeFigures,
    PlacementFigures,
    Run,
    Sizes,
    StreamPoint,
)

# Seconds, not minutes, on two cores: these check the figures are real measurements,
# not how fast anything is.
TINY = Sizes(
    matmul_n=128,
    copy_mib=4,
    seconds=0.05,
    link_seconds=0.1,
    link_pings=5,
    link_pad_bytes=4096,
    group_reps=3,
    stream_tokens=4,
    prompt_tokens=8,
)


def size_args(sizes: Sizes) -> list[str]:
    """`studiotui benchmark` options asking for `sizes`: one --size for each that is
    not the default."""
    default = Sizes()
    out = []
    for f in fields(sizes):
        value = getattr(sizes, f.name)
        if value != getattr(default, f.name):
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            out.append(f"--size={f.name}={text}")
    return out


def sample_run(run_id: str = "20260101-000000-desk", scale: float = 1.0) -> Run:
    """A two-node run with every section filled (figures times `scale`)."""
    return Run(
        id=run_id,
        date=f"{run_id[:4]}-{run_id[4:6]}-{run_id[6:8]}T00:00:00Z",
        cluster="desk",
        machine={"host": "op", "system": "Darwin 25.2 arm64", "python": "3.12", "mlx": "0.32"},
        build="0.1.0 (abc123)",
        sizes=Sizes(),
        nodes=(
            NodeFigures(
                "studio-1",
                "Apple M3 Ultra",
                "gpu",
                {"float32": 20000 * scale, "bfloat16": 40000 * scale, "float16": 41000 * scale},
                {"float32": 4096, "bfloat16": 4096, "float16": 4096},
                700 * scale,
                750 * scale,
            ),
            NodeFigures("studio-2", error="device_bench timed out"),
        ),
        links=(LinkFigures("studio-1", "studio-2", "thunderbolt", 40.0, 55.0, 60 * scale, 58.0),),
        group=GroupFigures(
            ("studio-1", "studio-2"), "ring", 4096, 30000 * scale, 40000, 0.02, 0.03, 0.0, "x"
        ),
        placements=(
            PlacementFigures(
                "qwen",
                "qwen3-32b",
                ("studio-1", "studio-2"),
                4,
                tuple(
                    StreamPoint(k, 20.0 * k**0.5 * scale, 300.0 + 50 * k, 64 * k)
                    for k in (1, 2, 4, 8)
                ),
            ),
        ),
        seconds=42.0,
    )
