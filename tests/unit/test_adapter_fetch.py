"""The decisions of fetching a job's adapter: what the node holds, whether ours is it."""

from __future__ import annotations

import os
from pathlib import Path

from studiotui.cluster.adapter_fetch import fetched_dir, job_adapter_dir, node_files, up_to_date
from worker.shared.manifest import FileId, sha256_file
from worker.shared.protocol import control


def test_node_files_leaves_out_what_the_node_does_not_hold() -> None:
    raw = {
        "path": "/n/jobs/a/adapters",
        "files": [
            {"name": "adapter_config.json", "state": "differs", "size": 9, "sha256": "ab"},
            {"name": "adapters.safetensors", "state": "missing", "size": None, "sha256": None},
        ],
    }
    found = control.parse(raw, control.DirStatus)
    assert node_files(found) == {"adapter_config.json": FileId("adapter_config.json", 9, "ab")}


def test_up_to_date_compares_by_content(tmp_path: Path) -> None:
    here = fetched_dir(tmp_path, "legal")
    assert here == tmp_path / "adapters" / "legal"
    assert job_adapter_dir("legal") == "jobs/legal/adapters"
    wanted = {"a.json": FileId("a.json", 2, "")}
    assert not up_to_date(here, wanted)  # nothing here yet
    here.mkdir(parents=True)
    (here / "a.json").write_text("{}")
    wanted = {"a.json": FileId("a.json", 2, sha256_file(here / "a.json"))}
    assert up_to_date(here, wanted)
    (here / "a.json").write_text("[]")  # same size, other bytes, written later:
    st = (here / "a.json").stat()  # (a clock tick apart at least, as any real rewrite)
    os.utime(here / "a.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
    assert not up_to_date(here, wanted)
