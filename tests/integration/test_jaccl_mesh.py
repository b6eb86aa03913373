"""Four real local agents that report a full RDMA mesh of Mac Studios (recorded macOS
outputs replayed from each node's `probe-replay/`, derived by tests/support/rdma_mesh.py): a
tensor placement, a fine-tuning job and the cluster benchmark's group product each
choose MLX's JACCL backend, and every rank is launched with the device matrix (the
`rdma_enX` each rank reaches each other rank through) and rank 0's coordinator.

MLX on Linux has no JACCL (`mx.distributed.is_available("jaccl")` is False), so no
rank can join here: each test follows the launch up to the files and environment a
rank gets, which the rank's own refusal names, and no further. The ring path runs for
real in the other integration tests."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from studiotui.cli.status_cmd import status_json
from studiotui.cluster.benchmark import Benchmark
from studiotui.cluster.controller import Controller, PlacementError
from studiotui.core.benchmark import Sizes
from studiotui.core.inventory import local_inventory
from studiotui.core.jobs import JobWatch
from studiotui.core.members import jaccl_devices
from studiotui.tune import finetune as ft
from studiotui.tune.finetune import FinetuneRequest
from tests.support import rdma_mesh
from tests.support.adapter_model import write_training_text
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = pytest.mark.integration
BASE, PORT = 181, 58400  # 127.0.0.181-184
NAMES = ["local-1", "local-2", "local-3", "local-4"]
# The matrix the derived mesh gives (tests/unit/test_rdma_ports.py checks it against
# MLX's own reading of the raw outputs): row i, the device rank i reaches rank j by.
MATRIX = [
    [None, "rdma_en5", "rdma_en2", "rdma_en7"],
    ["rdma_en2", None, "rdma_en7", "rdma_en6"],
    ["rdma_en7", "rdma_en6", None, "rdma_en4"],
    ["rdma_en6", "rdma_en4", "rdma_en5", None],
]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    home = tmp_path_factory.mktemp("jaccl-home")
    outputs = rdma_mesh.mesh(rdma_mesh.STUDIO, NAMES)
    for node in local_inventory(4, base_octet=BASE, control_port=PORT, home=home).nodes:
        Path(node.workdir).mkdir(parents=True, mode=0o700)
        rdma_mesh.replay(Path(node.workdir), outputs[node.name])
    yield from cluster_fixture(home, 4, BASE, PORT, memory_gb=2.0)


def run(cluster: LocalCluster, work: Any) -> Any:
    async def go() -> Any:
        ctl = cluster.controller()
        try:
            await ctl.start(telemetry=False)
            deadline = time.monotonic() + 30
            # The agents probe once they are up: wait for the ports they report.
            while not all((n.facts.get("rdma") or {}).get("ports") for n in ctl.state.nodes):
                assert time.monotonic() < deadline, "the agents did not report their ports"
                await asyncio.sleep(0.2)
                await ctl.refresh(timeout=1.0)
            return await work(ctl)
        finally:
            await ctl.close()

    return asyncio.run(go())


def _workdir(cluster: LocalCluster, rank: int) -> Path:
    return Path(cluster.inventory.nodes[rank].workdir)


def _coordinator_and_devices(message: str) -> tuple[str, str]:
    """What a rank says MLX was given, in its refusal to join (worker/group.join)."""
    given = dict(part.split("=", 1) for part in message.split("(", 1)[1].rstrip(")").split(", "))
    return given["MLX_JACCL_COORDINATOR"], given["MLX_IBV_DEVICES"]


def test_the_mesh_is_what_the_agents_report(mesh: LocalCluster) -> None:
    assert not mx.distributed.is_available("jaccl")  # why nothing below can run a rank

    async def work(ctl: Controller) -> Any:
        return jaccl_devices(NAMES, {n.name: n.facts["rdma"] for n in ctl.state.nodes})

    assert run(mesh, work) == MATRIX

    async def shown(ctl: Controller) -> Any:
        return status_json(ctl)

    # `status --json` says which port of a node leads to which node.
    nodes = {n["name"]: n["thunderbolt"] for n in run(mesh, shown)["nodes"]}
    assert nodes["local-1"] == [
        {"port": 1, "device": "rdma_en5", "state": "PORT_ACTIVE", "reaches": "local-2"},
        {"port": 2, "device": "rdma_en2", "state": "PORT_ACTIVE", "reaches": "local-3"},
        {"port": 3, "device": "rdma_en7", "state": "PORT_ACTIVE", "reaches": "local-4"},
    ]
    # local-4's port 4 holds the recorded drive: no Mac, so not listed.
    assert [(c["port"], c["reaches"]) for c in nodes["local-4"]] == [
        (1, "local-3"),
        (5, "local-1"),
        (6, "local-2"),
    ]


def test_a_tensor_placement_launches_every_rank_with_jaccls_files(
    mesh: LocalCluster, tmp_path: Path
) -> None:
    model = write_demo_model(
        tmp_path / "tiny",
        DemoSpec(layers=4, hidden=64, heads=4, kv_heads=4, dtype="float32", seed=3),
    )

    async def work(ctl: Controller) -> str:
        try:
            await ctl.place(model, NAMES, "tp", tensor=4)
        except PlacementError as exc:
            return str(exc)
        raise AssertionError("a JACCL group joined on a machine without JACCL")

    said = run(mesh, work)
    assert "MLX here has no 'jaccl' distributed backend" in said, said
    for rank in range(4):
        run_dir = _workdir(mesh, rank) / "shards"
        spec = json.loads((run_dir / "tp.json").read_text())
        assert (spec["backend"], spec["rank"], spec["group_size"]) == ("jaccl", rank, 4)
        assert json.loads((run_dir / "tp.devices.json").read_text()) == MATRIX


def test_a_finetuning_job_chooses_jaccl_and_writes_each_ranks_files(
    mesh: LocalCluster, tmp_path: Path
) -> None:
    model = write_demo_model(
        tmp_path / "tiny", DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32")
    )
    data = write_training_text(tmp_path / "data.jsonl")
    req = FinetuneRequest(str(model), str(data), tuple(NAMES), "mesh", iters=2, batch_size=4)

    async def work(ctl: Controller) -> tuple[ft.Prepared, Any]:
        prepared = ft.prepare(ctl, req)
        record = await ft.launch(ctl, prepared)
        watch = JobWatch(record.name, nodes=list(record.nodes))
        return prepared, await asyncio.wait_for(ft.attach(ctl, record, watch), 60)

    prepared, end = run(mesh, work)
    assert prepared.backend == "jaccl" and prepared.devices == MATRIX
    assert prepared.backend_reason.startswith("every pair of local-1, local-2, local-3")
    assert end.state == "failed" and "no 'jaccl' distributed backend" in end.message
    address = mesh.inventory.nodes[0].address
    for rank in range(4):
        rank_dir = _workdir(mesh, rank) / "jobs" / "mesh" / f"rank{rank}"
        spec = json.loads((rank_dir / "spec.json").read_text())
        assert (spec["backend"], spec["rank"], spec["size"]) == ("jaccl", rank, 4)
        assert json.loads((rank_dir / "devices.json").read_text()) == MATRIX
    coordinator, devices = _coordinator_and_devices(end.message)
    assert coordinator.startswith(f"{address}:") and devices.endswith("devices.json")


def test_the_benchmark_measures_the_group_over_jaccl(mesh: LocalCluster) -> None:
    sizes = Sizes(matmul_n=64, group_reps=1)

    async def work(ctl: Controller) -> Any:
        bench = Benchmark(ctl, NAMES, sizes)
        return await bench.group(NAMES, []), bench.notes

    figures, notes = run(mesh, work)
    assert figures.backend == "jaccl" and not notes
    assert "no 'jaccl' distributed backend" in figures.error
    jobs = [p for p in (_workdir(mesh, 0) / "jobs").iterdir() if p.name.startswith("benchmark-")]
    (job,) = jobs
    for rank in range(4):
        rank_dir = _workdir(mesh, rank) / "jobs" / job.name / f"rank{rank}"
        assert json.loads((rank_dir / "devices.json").read_text()) == MATRIX
        assert json.loads((rank_dir / "spec.json").read_text())["backend"] == "jaccl"
