"""Model files on real SSH nodes (tests/support/sshd.py): content identity, node to node, resume.

Two "Macs" are provisioned over a real sshd on loopback. A fine-tune after its base
(same folder name, file names and sizes; other weights) must answer with its own
tokens; a second node is fed by the first one's agent; a copy cut halfway resumes;
a disk without room is refused before a byte moves.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from studiotui.cluster import model_fetch, model_files
from studiotui.cluster.controller import Controller, PlacementError
from tests.integration.test_engine import collect, prompt_tokens, reference_tokens
from tests.support.sshd import SshNodes
from worker.shared.demo_model import DemoSpec, write_demo_model

pytestmark = [
    pytest.mark.asyncio(loop_scope="function"),
    pytest.mark.skipif(
        shutil.which("ssh-keygen") is None and not os.environ.get("CI"),
        reason="run .ci/install-sshd.sh",
    ),
]


def _model(root: Path, seed: int) -> Path:
    # The same folder name for both: only the content tells them apart.
    spec = DemoSpec(layers=4, hidden=128, heads=4, kv_heads=2, files=4, seed=seed)
    return write_demo_model(root / f"seed{seed}" / "tune", spec)


async def _answer(ctl: Controller, model: Path, nodes: list[str], **kw: Any) -> list[int]:
    await ctl.place(model, nodes, "t", prefill_chunk=64, **kw)
    try:
        return (await collect(ctl, "t", prompt_tokens(model), 8))[0]
    finally:
        await ctl.unload("t")


def _log(ctl: Controller, since: int) -> list[str]:
    return [e.text for e in ctl.state.log[since:]]


async def test_content_identity_node_to_node_and_resume_on_ssh_nodes(
    tmp_path: Path,
    ssh_nodes: Callable[..., Awaitable[SshNodes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = await ssh_nodes(2)
    nodes, inv, home = made.nodes, made.inventory, made.home
    n1, n2 = (n.name for n in nodes)
    base, tune = _model(tmp_path, 1), _model(tmp_path, 2)
    ref_base = reference_tokens(base, prompt_tokens(base), 8)
    ref_tune = reference_tokens(tune, prompt_tokens(tune), 8)
    assert ref_base != ref_tune
    sizes = {p.name: p.stat().st_size for p in base.iterdir()}
    assert sizes == {p.name: p.stat().st_size for p in tune.iterdir()}

    ctl = Controller(home, inv)
    try:
        await ctl.refresh()
        # The base model, then its "fine-tune" on the same node: the tune's own tokens.
        assert await _answer(ctl, base, [n1]) == ref_base
        mark = len(ctl.state.log)
        assert await _answer(ctl, tune, [n1]) == ref_tune
        log = _log(ctl, mark)
        replaced = {
            t.split()[2] for t in log if t.startswith(f"{n1}: replacing ") and "sha256" in t
        }
        weights = {n for n in sizes if n.endswith(".safetensors")}
        assert len(weights) == 4 and weights <= replaced, log
        assert any(f"to {n1} from the operator over SFTP" in t for t in log), log

        # n1 holds the tune: n2 gets its share from n1's agent, not from the operator.
        mark = len(ctl.state.log)
        assert await _answer(ctl, tune, [n1, n2]) == ref_tune
        log = _log(ctl, mark)
        assert any(f"{n1} already holds tune" in t for t in log), log
        assert any(f"to {n2} from {n1} over {nodes[0].address}:" in t for t in log), log
        assert not any("from the operator" in t for t in log), log

        # A copy from the operator cut halfway (the operator's program stopped) resumes.
        monkeypatch.setattr(model_files, "SFTP_CHUNK", 256 * 1024)
        cut: list[asyncio.Task[Any]] = []

        def stop_halfway(node: str, done: int, total: int) -> None:
            if cut and done > total // 2 and not cut[0].done():
                cut[0].cancel()

        task = asyncio.create_task(ctl.place(base, [n2], "t", stop_halfway, prefill_chunk=64))
        cut.append(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        await ctl.refresh()
        if ctl.state.placement("t") is not None:  # its shard was prepared, not loaded
            await ctl.unload("t")
        folder = Path(nodes[1].workdir) / "models" / "tune"
        assert list(folder.glob("*.studiotui-part")), sorted(p.name for p in folder.iterdir())
        mark = len(ctl.state.log)
        assert await _answer(ctl, base, [n2]) == ref_base
        log = _log(ctl, mark)
        assert any(t.startswith(f"{n2}: resuming ") for t in log), log
        assert not list(folder.glob("*.studiotui-part"))

        # `studiotui fetch DIR --nodes n1,n2`: each SSH node gets its even share of a
        # folder of the operator's, as placing would copy it, and nothing else.
        spec = DemoSpec(layers=4, hidden=128, heads=4, kv_heads=2, files=4, seed=3)
        other = write_demo_model(tmp_path / "seed3" / "shared", spec)  # new to both nodes
        where = await model_fetch.fetch_dir(ctl, other, [n1, n2])
        shares = model_files.even_shares(4, [n1, n2])
        for node, (start, end) in shares.items():
            held = Path(where[node])
            assert held.parent == Path(inv.node(node).workdir) / "models", where
            names = {p.name for p in held.iterdir() if not p.name.startswith(".")}
            assert names == model_files.needed_names(other, start, end, 4), (node, names)
            for name in names:
                assert (held / name).read_bytes() == (other / name).read_bytes(), name
        assert names < {p.name for p in other.iterdir()}  # a share, not the whole model

        # No room on n2's disk: refused before anything is copied, with the numbers.
        small = folder.parent / "roomless"
        small.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)],
                          capture_output=True).returncode != 0:  # fmt: skip
            return  # not root here: the refusal itself is a pure function, tested apart
        try:
            roomless = shutil.copytree(base, tmp_path / "x" / "roomless")
            with pytest.raises(PlacementError) as refused:
                await ctl.place(roomless, [n2], "r")
            text = str(refused.value)
            assert f"{n2} has " in text and " free at " in text and "need" in text, text
            assert list(small.iterdir()) == []
        finally:
            subprocess.run(["umount", str(small)], check=False)
    finally:
        await ctl.close()
