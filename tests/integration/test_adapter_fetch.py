"""A fine-tuning job's adapter, saved on an SSH node only, brought back to the operator.

Two nodes reached over a real sshd on loopback (their agents run here, on its
addresses, each with its own home): the job's adapter exists only under the rank-0
node's `jobs/NAME/adapters`. It is written there directly (tests/support/adapter_model.py,
stamped with its base as a finetune job stamps it) rather than trained by a whole
finetune over SSH, to keep the test fast; the job's training itself is covered by
tests/integration/test_finetune.py and test_adapters.py. The CLI's `place --adapter
NAME` fetches it (SFTP, sha256 checked against the node's agent) into
STUDIOTUI_HOME/adapters/NAME, places it, and it answers as `mlx_lm.load(model,
adapter_path=)` does. `jobs fetch` copies again only when the operator's copy differs;
an adapter of other weights is not kept; refusals name what to do.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from studiotui.cli.main import main
from studiotui.cluster import local_cluster
from studiotui.cluster.controller import Controller
from studiotui.cluster.jobs import JobRecord, save_record
from studiotui.core.inventory import Inventory, dump_inventory
from tests.integration.test_adapters import SPEC, collect, encode, reference
from tests.support.adapter_model import write_adapter
from tests.support.cluster_fixture import wait_up
from tests.support.sshd import SshdServer, ssh_node, sshd_server  # noqa: F401 - the fixture
from worker.shared.adapters import FILES, identity_of
from worker.shared.demo_model import DemoSpec, write_demo_model


def test_a_jobs_adapter_on_an_ssh_node_is_fetched_then_placed_as_mlx_lm_loads_it(
    sshd_server: SshdServer,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = write_demo_model(tmp_path / "models" / "tiny", SPEC)
    nodes = tuple(
        ssh_node(sshd_server, a, f"mac-{a[-2:]}", tmp_path / "nodes", 59976)
        for a in sshd_server.addresses[2:4]
    )
    first, second = (n.name for n in nodes)
    inv = Inventory(name="desk", nodes=nodes)
    home = tmp_path / "home"
    home.mkdir()
    sshd_server.write_known_hosts(home / "known_hosts")
    (tmp_path / "cluster.toml").write_text(dump_inventory(inv))
    monkeypatch.setenv("STUDIOTUI_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "200")
    cluster = ["-i", str(tmp_path / "cluster.toml")]
    # The job's adapter, on its rank-0 node only.
    on_node = write_adapter(
        base, Path(nodes[0].workdir) / "jobs" / "legal" / "adapters", num_layers=3
    )
    request = {"model": str(base), "base": identity_of(base).as_dict()}
    save_record(home, JobRecord("legal", "finetune", (first, second), "ring", request=request))
    save_record(home, JobRecord("early", "finetune", (second,), "ring", request=request))
    # A job of this base whose saved adapter is stamped with other weights: never kept.
    other = write_demo_model(
        tmp_path / "models" / "other", DemoSpec(**{**SPEC.__dict__, "seed": 8})
    )
    write_adapter(other, Path(nodes[1].workdir) / "jobs" / "odd" / "adapters", num_layers=2)
    save_record(home, JobRecord("odd", "finetune", (second,), "ring", request=request))
    fetched = home / "adapters" / "legal"
    tokens = encode(base)

    def cli(*argv: str) -> tuple[int, str]:
        code = main([*cluster, *argv])
        out = capsys.readouterr()
        return code, " ".join((out.out + out.err).split())

    pids = [local_cluster.start_agent(home, node, inv) for node in nodes]

    async def answer() -> list[int]:
        ctl = Controller(home, inv)
        try:
            await ctl.refresh()
            got = await collect(ctl, "tiny+legal", tokens)
            await ctl.unload("tiny+legal")
            return got
        finally:
            await ctl.close()

    try:
        asyncio.run(wait_up(home, inv, timeout=60))
        code, said = cli("jobs", "fetch", "ghost")
        assert code == 2 and "no job named 'ghost'" in said and "known: " in said, said
        # Nothing saved yet on the node: refused, saying how to go on.
        code, said = cli("jobs", "fetch", "early")
        assert code == 2 and f"job early has no saved adapter on {second} yet" in said, said
        assert "studiotui jobs follow early" in said, said
        assert not fetched.exists()
        # fuse does not reach nodes: it names the command that brings the adapter here.
        code, said = cli("fuse", str(base), "--adapter", "early")
        assert code == 2 and "studiotui jobs fetch early" in said, said

        # `place --adapter legal`: not on the operator, so fetched from the job's node.
        code, said = cli(
            "place", str(base), "--adapter", "legal", "--nodes", f"{first},{second}",
            "--prefill-chunk", "16",
        )  # fmt: skip
        assert code == 0, said
        assert "adapter legal is job legal's, not here yet" in said, said
        assert f"fetched the adapter of job legal from {first} over SFTP to {fetched}" in said
        assert "placement tiny+legal is ready" in said, said
        for name in FILES:
            assert (fetched / name).read_bytes() == (on_node / name).read_bytes(), name
        got = asyncio.run(answer())

        # Asked again: the operator's copy is the node's, by hash; nothing moves.
        code, said = cli("jobs", "fetch", "legal")
        assert code == 0 and "already here" in said and "nothing copied" in said, said
        # The operator's copy changed: by hash it is not the node's, so it is copied again.
        with open(fetched / "adapters.safetensors", "ab") as f:
            f.write(b"\0")
        code, said = cli("jobs", "fetch", "legal")
        assert code == 0 and f"from {first} over SFTP" in said, said
        assert (fetched / "adapters.safetensors").read_bytes() == (
            on_node / "adapters.safetensors"
        ).read_bytes()
        code, said = cli("jobs", "fetch", "odd")
        assert code == 2 and "not kept" in said and "trained on other" in said, said
        assert not (home / "adapters" / "odd").exists()
        assert sorted(p.name for p in (home / "adapters").iterdir()) == ["legal"]

        # The node holding it is down: refused, naming it and what to do.
        local_cluster.kill_pid(pids[0])
        code, said = cli("jobs", "fetch", "legal")
        assert code == 2 and f"is on {first} (its rank 0), which is down" in said, said
        assert "studiotui jobs fetch legal" in said, said
    finally:
        for pid in pids:
            local_cluster.kill_pid(pid)
    want = reference(base, tokens, fetched)
    assert want != reference(base, tokens), "the adapter must change the greedy answer"
    assert got == want
