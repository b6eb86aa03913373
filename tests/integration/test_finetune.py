"""Fine-tuning across a real local cluster of 2 nodes: mlx-lm's trainer in each rank,
gradients averaged by MLX's ring backend, the jobs run and followed through the agents.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import psutil
import pytest
from mlx_lm import load

from studiotui.cli.main import main
from studiotui.cluster import jobs, local_cluster
from studiotui.cluster.controller import Controller
from studiotui.core.inventory import dump_inventory
from studiotui.core.jobs import JobWatch
from studiotui.tune import finetune as ft
from studiotui.tune.data import DataError
from tests.support.adapter_model import WORDS, write_training_text
from tests.support.cluster_fixture import LocalCluster, cluster_fixture
from worker.shared.adapters import check_identity, identity_of
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = pytest.mark.integration
BASE, PORT = 161, 58800  # 127.0.0.161-162
NODES = ("local-1", "local-2")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from cluster_fixture(tmp_path_factory.mktemp("ft-home"), 2, BASE, PORT)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, dtype="float32", seed=5)
    return write_demo_model(tmp_path_factory.mktemp("ft-model") / "tiny", spec)


def run(cluster: LocalCluster, work: Any) -> Any:
    async def go() -> Any:
        ctl = cluster.controller()
        try:
            await ctl.start(telemetry=False)
            return await work(ctl)
        finally:
            await ctl.close()

    return asyncio.run(go())


async def train(ctl: Controller, req: ft.FinetuneRequest, resume: bool = False) -> JobWatch:
    prepared = ft.prepare(ctl, req, resuming=resume)
    record = await ft.launch(ctl, prepared, resume=resume)
    watch = JobWatch(record.name, nodes=list(record.nodes))
    end = await ft.attach(ctl, record, watch)
    assert end.state == "done", end.message
    return watch


def rank_pids(cluster: LocalCluster) -> list[int]:
    """Processes running a job rank under this cluster's agents' work dirs."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "worker.finetune" in cmd and any(str(cluster.home) in part for part in cmd):
            found.append(proc.pid)
    return found


def test_loss_goes_down_and_the_adapter_is_mlx_lms(
    cluster: LocalCluster, model: Path, tmp_path: Path
) -> None:
    data = write_training_text(tmp_path / "data.jsonl")
    req = ft.FinetuneRequest(
        str(model), str(data), NODES, "down", iters=30, batch_size=4, learning_rate=2e-3
    )
    watch = run(cluster, lambda ctl: train(ctl, req))
    losses = [p.value for p in watch.progress.train_loss]
    assert len(losses) == 30
    # Noisy step to step (a batch of 4); clearly lower at the end than at the start.
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert watch.progress.val_loss[-1].value < watch.progress.val_loss[0].value
    assert all(n.state == "done" and n.memory for n in watch.progress.nodes)
    assert watch.progress.tokens_per_second and watch.progress.tokens_per_second > 0
    # mlx-lm's adapter format on every node, with the base model's identity.
    for node in cluster.inventory.nodes:
        adapters = Path(node.workdir) / "jobs" / "down" / "adapters"
        config = json.loads((adapters / "adapter_config.json").read_text())
        assert config["studiotui_base"] == identity_of(model).as_dict()
        assert config["studiotui_base"]["model"] == "tiny"
        assert check_identity(adapters, model) is None  # what placing an adapter checks
        assert config["lora_parameters"]["rank"] == 8
        assert (adapters / "0000030_adapters.safetensors").is_file()
    # mlx-lm itself loads it onto the base, and it changes the model's output.
    adapted, tok = load(str(model), adapter_path=str(adapters))
    base, _ = load(str(model))
    tokens = mx.array([tok.encode("the quick brown fox")])
    assert not mx.allclose(adapted(tokens), base(tokens), atol=1e-3)


def test_first_step_on_two_nodes_equals_one_node(
    cluster: LocalCluster, model: Path, tmp_path: Path
) -> None:
    """One SGD step on a global batch of 4: on 1 node, and split 2 + 2 over 2 nodes.

    SGD, not Adam: Adam's first step is lr * sign(g), which would hide a wrong gradient
    scale. Every example has the same token count, so each rank's token mean weighs
    equally (mlx-lm averages the ranks' gradients, which equals the full batch's token
    mean only then). Tolerance: 1e-5 of the step's largest change, for float32 sums
    taken in another order over another split (measured: 1.4e-6 on a change of 4.2,
    3.4e-7 relative, a few float32 ulps)."""
    _, tok = load(str(model))
    by_length: dict[int, list[dict[str, str]]] = {}
    pick = random.Random(7)
    for _ in range(400):
        text = " ".join(pick.sample(WORDS, 6))
        by_length.setdefault(len(tok.encode(text)), []).append({"text": text})
    same = max(by_length.values(), key=len)[:8]
    assert len(same) == 8
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in same))

    def req(name: str, nodes: tuple[str, ...]) -> ft.FinetuneRequest:
        return ft.FinetuneRequest(
            str(model),
            str(data),
            nodes,
            name,
            iters=1,
            batch_size=4,
            learning_rate=0.5,
            optimizer="sgd",
        )

    async def both(ctl: Controller) -> None:
        await train(ctl, req("one", NODES[:1]))
        await train(ctl, req("two", NODES))

    run(cluster, both)
    home1 = Path(cluster.inventory.node("local-1").workdir) / "jobs"
    one = mx.load(str(home1 / "one" / "adapters" / "adapters.safetensors"))
    two = mx.load(str(home1 / "two" / "adapters" / "adapters.safetensors"))
    assert set(one) == set(two) and one
    b_keys = [k for k in one if k.endswith("lora_b")]
    # LoRA's B starts at zero: after one step it is exactly -lr * grad.
    largest = max(float(mx.abs(one[k]).max()) for k in b_keys)
    assert largest > 1e-4  # the step moved the weights
    for key in one:
        diff = float(mx.abs(one[key] - two[key]).max())
        assert diff <= 1e-5 * largest + 1e-7, (key, diff, largest)


def test_stop_leaves_no_process(cluster: LocalCluster, model: Path, tmp_path: Path) -> None:
    data = write_training_text(tmp_path / "data.jsonl")
    req = ft.FinetuneRequest(
        str(model), str(data), NODES, "stopme", iters=100000, batch_size=4, save_every=1000
    )

    async def start_then_stop(ctl: Controller) -> jobs.JobEnd:
        record = await ft.launch(ctl, ft.prepare(ctl, req))
        watch = JobWatch(record.name, nodes=list(record.nodes))
        follow = asyncio.create_task(ft.attach(ctl, record, watch))
        while watch.progress.iteration < 2:
            assert not follow.done(), watch.progress
            await asyncio.sleep(0.1)
        assert len(rank_pids(cluster)) == 2
        said = await jobs.stop(ctl, "stopme", list(NODES))
        assert said == {"local-1": "stopped", "local-2": "stopped"}
        return await asyncio.wait_for(follow, 10)

    end = run(cluster, start_then_stop)
    assert end.state == "stopped"
    assert rank_pids(cluster) == []


def test_a_killed_node_fails_the_job_in_3_s_then_resume(
    cluster: LocalCluster, model: Path, tmp_path: Path
) -> None:
    data = write_training_text(tmp_path / "data.jsonl")
    req = ft.FinetuneRequest(
        str(model), str(data), NODES, "killed", iters=400, batch_size=4, save_every=4
    )
    victim = cluster.inventory.node("local-2")

    async def kill_mid_job(ctl: Controller) -> tuple[jobs.JobEnd, float, int]:
        record = await ft.launch(ctl, ft.prepare(ctl, req))
        watch = JobWatch(record.name, nodes=list(record.nodes))
        follow = asyncio.create_task(ft.attach(ctl, record, watch))
        while (watch.progress.saved_iteration or 0) < 8:
            assert not follow.done(), watch.progress
            await asyncio.sleep(0.05)
        pid = local_cluster.running_pid(victim)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        end = await asyncio.wait_for(follow, 10)
        return end, time.monotonic() - killed, watch.progress.saved_iteration or 0

    end, took, saved = run(cluster, kill_mid_job)
    assert end.state == "failed" and end.blamed == ("local-2",), end
    assert "local-2" in end.message
    print(f"the job failed {took:.2f} s after the kill: {end.message}")  # shown with -s
    assert took <= 3.0, took
    time.sleep(1.0)
    assert rank_pids(cluster) == []  # the rank on the dead node went with its agent

    local_cluster.start_agent(cluster.home, victim, cluster.inventory)

    async def resume(ctl: Controller) -> JobWatch:
        deadline = time.monotonic() + 30
        while ctl.state.node("local-2").state != "up":  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            await ctl.refresh(timeout=1.0)
        again = ft.resume_request(ctl, "killed")
        return await train(ctl, replace(again, iters=saved + 4), resume=True)

    watch = run(cluster, resume)
    # It went on from the last adapter both nodes had saved, not from the start.
    assert watch.progress.start_iteration >= saved - 4 >= 4
    assert watch.progress.train_loss[0].iteration == watch.progress.start_iteration + 1
    assert watch.progress.iteration == saved + 4


def test_bad_input_is_refused_before_anything_runs(
    cluster: LocalCluster, model: Path, tmp_path: Path
) -> None:
    good = write_training_text(tmp_path / "good.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"text": "two"}\n{"prompt": 3}\n')
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "one"}\n\n{"text": "two"\n')
    few = write_training_text(tmp_path / "few.jsonl", n=4)

    def req(**changes: Any) -> ft.FinetuneRequest:
        base = {"model": str(model), "data": str(good), "nodes": NODES, "name": "bad"}
        return ft.FinetuneRequest(**{**base, **changes})

    async def check(ctl: Controller) -> None:
        cases: list[tuple[ft.FinetuneRequest, str]] = [
            (req(model=str(tmp_path / "nope")), "does not exist"),
            (req(data=str(bad)), f"{bad}:3: not a training example"),
            (req(data=str(broken)), f"{broken}:3: not JSON"),
            (req(data=str(few)), "fewer than one batch of 8"),
            (req(batch_size=3), "cannot be split evenly over 2 nodes"),
            (req(batch_size=0), "--batch-size must be at least 1, got 0"),
            (req(num_layers=0), "--layers must be at least 1, got 0"),
            (req(learning_rate=float("nan")), "--learning-rate must be a number above 0"),
            (req(learning_rate=float("inf")), "--learning-rate must be a number above 0"),
            (req(nodes=("local-1", "nowhere")), "unknown node 'nowhere'"),
            (req(name="../x"), "job name"),
        ]
        for request, words in cases:
            with pytest.raises((ft.FinetuneError, DataError)) as caught:
                ft.prepare(ctl, request)
            assert words in str(caught.value), (words, str(caught.value))
        assert jobs.load_record(ctl.home, "bad") is None  # nothing was started or kept

    run(cluster, check)


def test_qlora_on_a_quantized_model(cluster: LocalCluster, tmp_path: Path) -> None:
    spec = DemoSpec(layers=2, hidden=64, heads=4, kv_heads=2, quantize="4", group_size=64, seed=6)
    quantized = write_demo_model(tmp_path / "q4", spec)
    data = write_training_text(tmp_path / "data.jsonl", n=24)
    req = ft.FinetuneRequest(
        str(quantized), str(data), NODES[:1], "qlora", iters=3, batch_size=4, learning_rate=1e-3
    )

    async def go(ctl: Controller) -> tuple[str, JobWatch]:
        prepared = ft.prepare(ctl, req)
        return prepared.method, await train(ctl, req)

    method, watch = run(cluster, go)
    assert method == "QLoRA" and watch.progress.iteration == 3
    adapters = Path(cluster.inventory.node("local-1").workdir) / "jobs" / "qlora" / "adapters"
    adapted, _ = load(str(quantized), adapter_path=str(adapters))
    # mlx-lm put LoRA on the quantized layers themselves: the base stays 4-bit.
    proj = adapted.layers[-1].self_attn.q_proj
    assert type(proj).__name__ == "LoRALinear"
    assert type(proj.linear).__name__ == "QuantizedLinear"


def test_the_command_line(
    cluster: LocalCluster, model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = tmp_path / "cluster.toml"
    inventory.write_text(dump_inventory(cluster.inventory))
    data = write_training_text(tmp_path / "data.jsonl", n=24)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    common = ["-i", str(inventory), "--nodes", "local-1,local-2", "--batch-size", "4"]
    os.environ["STUDIOTUI_HOME"] = str(cluster.home)
    try:
        assert main(["finetune", str(model), "--data", str(bad), *common]) == 2
        assert f"{bad}:2: not a training example" in capsys.readouterr().err
        args = ["finetune", str(model), "--data", str(data), "--iters", "3", "--name", "cli"]
        assert main([*args, *common, "--detach"]) == 0
        out = " ".join(capsys.readouterr().out.split())  # as one line: rich folds it
        assert "LoRA of tiny as job cli on local-1, local-2" in out
        assert "no RDMA at both ends: ring backend over TCP" in out
        assert main(["jobs", "follow", "cli", "-i", str(inventory)]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "iter 3/3" in out and "job cli done" in out
        # Done: its adapter is brought to where `place --adapter cli` finds it.
        saved = Path(cluster.inventory.node("local-1").workdir) / "jobs" / "cli" / "adapters"
        fetched = cluster.home / "adapters" / "cli"
        assert "fetched the adapter of job cli from local-1" in out, out
        # The base is known: the hint names it, not a placeholder.
        assert f"studiotui place {model} --adapter cli" in out, out
        assert (fetched / "adapters.safetensors").read_bytes() == (
            saved / "adapters.safetensors"
        ).read_bytes()
        after_3 = (fetched / "adapters.safetensors").read_bytes()
        assert main(["jobs", "-i", str(inventory)]) == 0
        listed = capsys.readouterr().out
        assert "cli" in listed and "done" in listed and "3/3" in listed
        assert "adapter:" in listed  # where the finished job's adapter is (folded here)
        # Resumed with nothing more to train: refused, and its record on the nodes
        # (iterations, losses) stays as it was.
        for more in ([], ["--iters", "3"]):
            assert main(["finetune", "--resume", "cli", *more, "-i", str(inventory)]) == 2
            err = " ".join(capsys.readouterr().err.split())
            assert "job 'cli' is done: its 3 iterations are trained, nothing to resume" in err
            assert "studiotui finetune --resume cli --iters N (N above 3)" in err
        assert main(["jobs", "-i", str(inventory)]) == 0
        assert capsys.readouterr().out == listed
        # Stopping a job that has ended says there was nothing to stop (it printed
        # "local-1: done", as if the stop had done something).
        assert main(["jobs", "stop", "cli", "-i", str(inventory)]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "local-1: already done, nothing to stop" in out, out
        # What a resumed job cannot change is refused, not silently ignored.
        other = ["--nodes", "local-1", "--data", str(bad), "--rank", "4"]
        assert main(["finetune", "--resume", "cli", *other, "-i", str(inventory)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "--data, --nodes, --rank cannot change them" in err, err
        # Resumed with more iterations: on from its last save (iteration 3) to 5.
        assert main(["finetune", "--resume", "cli", "--iters", "5", "-i", str(inventory)]) == 0
        out = capsys.readouterr().out
        assert "iter 4/5" in out and "iter 5/5" in out and "iter 1/" not in out
        # Its newer adapter replaced the one fetched at iteration 3.
        assert (
            (fetched / "adapters.safetensors").read_bytes()
            == (saved / "adapters.safetensors").read_bytes()
            != after_3
        )
        assert main(["jobs", "forget", "cli", "-i", str(inventory)]) == 0
        assert "job cli forgotten" in capsys.readouterr().out
        assert main(["jobs", "-i", str(inventory)]) == 0
        assert "cli" not in capsys.readouterr().out
        assert jobs.load_record(cluster.home, "cli") is None
        assert main(["jobs", "stop", "nope", "-i", str(inventory)]) == 2
        assert "no job named 'nope'" in capsys.readouterr().err
    finally:
        del os.environ["STUDIOTUI_HOME"]


def test_a_stopped_adam_run_resumed_is_the_unstopped_run(
    cluster: LocalCluster, model: Path, tmp_path: Path
) -> None:
    """Adam on 2 nodes: stopped (a real stop) after a save, resumed, it ends with the
    adapter of a run never stopped, because the optimizer's state (Adam's moments) is
    saved beside each adapter and restored, and the batches go on where they stopped.
    Without the optimizer state the resumed run restarts Adam's moments at zero, and
    its first steps move the weights by about the learning rate each (measured: the
    adapters then differ by 0.23 on weights of 0.30 after 40 iterations; with the
    state restored but the batch order drawn as mlx-lm draws it, by 0.15). Stopped in
    the second pass over the data, with validation batches drawn in between (mlx-lm's
    batching draws from numpy's global generator for both), so the batch order must
    not depend on when validation ran either."""
    data = tmp_path / "data"
    data.mkdir()
    write_training_text(data / "train.jsonl", n=40)  # 20 a rank: 10 batches a pass
    write_training_text(data / "valid.jsonl", n=16)  # 4 validation batches a rank

    def req(name: str) -> ft.FinetuneRequest:
        return ft.FinetuneRequest(
            str(model),
            str(data),
            NODES,
            name,
            iters=40,
            batch_size=4,
            learning_rate=2e-3,
            save_every=4,
        )

    async def straight_then_stopped(ctl: Controller) -> tuple[jobs.JobEnd, JobWatch]:
        await train(ctl, req("straight"))
        record = await ft.launch(ctl, ft.prepare(ctl, req("stopped")))
        watch = JobWatch(record.name, nodes=list(record.nodes))
        follow = asyncio.create_task(ft.attach(ctl, record, watch))
        while (watch.progress.saved_iteration or 0) < 16:
            assert not follow.done(), watch.progress
            await asyncio.sleep(0.02)
        # Resumed while it runs: refused before anything is copied, naming its nodes.
        again = ft.prepare(ctl, ft.resume_request(ctl, "stopped"), resuming=True)
        with pytest.raises(ft.FinetuneError, match="job 'stopped' still runs on local-1, local-2"):
            await ft.launch(ctl, again, resume=True)
        await jobs.stop(ctl, "stopped", list(NODES))
        return await asyncio.wait_for(follow, 10), watch

    end, stopped = run(cluster, straight_then_stopped)
    assert end.state == "stopped", end  # not done: there is something to resume
    assert stopped.progress.iteration < 40

    async def resume(ctl: Controller) -> JobWatch:
        return await train(ctl, ft.resume_request(ctl, "stopped"), resume=True)

    resumed = run(cluster, resume)
    # From the last save every rank finished: the one seen (16+) or the one before,
    # past the first pass over the data (10 batches) either way.
    assert 12 <= resumed.progress.start_iteration < 40
    assert resumed.progress.iteration == 40
    for node in NODES:
        jobs_dir = Path(cluster.inventory.node(node).workdir) / "jobs"
        one = mx.load(str(jobs_dir / "straight" / "adapters" / "adapters.safetensors"))
        two = mx.load(str(jobs_dir / "stopped" / "adapters" / "adapters.safetensors"))
        assert set(one) == set(two) and one
        largest = max(float(mx.abs(v).max()) for v in one.values())
        worst = max(float(mx.abs(one[k] - two[k]).max()) for k in one)
        # Same inputs, same order of sums: measured equal to the bit; a few float32
        # ulps allowed, far below the 0.23 a reset optimizer makes.
        assert worst <= 1e-6 * largest, (node, worst, largest)
    # The saved optimizer states are the same on both ranks (the gradients were
    # all-reduced before every update), each beside its own node's adapter.
    states = [
        mx.load(
            str(
                Path(cluster.inventory.node(n).workdir)
                / "jobs/straight/adapters"
                / "0000040_optimizer.safetensors"
            )
        )
        for n in NODES
    ]
    assert set(states[0]) == set(states[1]) and any("lora_b" in k for k in states[0])
    # Kept and pruned with the adapter checkpoints (the last three): one beside each.
    kept = Path(cluster.inventory.node("local-1").workdir) / "jobs/stopped/adapters"
    saved = sorted(p.name[:7] for p in kept.glob("*_adapters.safetensors"))
    assert sorted(p.name[:7] for p in kept.glob("*_optimizer.safetensors")) == saved
    assert saved[-1] == "0000040" and len(saved) == 3
    for key, value in states[0].items():
        assert mx.array_equal(value, states[1][key]), key
