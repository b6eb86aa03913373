"""core.jobs and the pure parts of cluster.jobs / worker.jobs: blame, events (a job's
backend: core.members.group_backend, tests/unit/test_rdma_ports.py)."""

from __future__ import annotations

import json
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from studiotui.bench.finetune import BATCH, bench_data, job_rate
from studiotui.cluster.jobs import JobRecord, load_record, outcome, records_dir
from studiotui.core import benchmark
from studiotui.core.jobs import JobWatch, blame
from studiotui.tune.data import load_examples
from studiotui.tune.finetune import jobs_ended_by
from worker.jobs import JobError, check_name, exit_message
from worker.shared.protocol.control import JobRank


def test_blame_falls_on_the_node_that_went_first() -> None:
    peer_lost = ("failed", "RuntimeError: [ring] connection to a peer was lost")
    # A node that stopped answering is to blame, not the rank that lost its peer.
    assert blame({"a": peer_lost}, ["b"]) == ["b"]
    # A rank killed on its own node, the other only lost its peer.
    assert blame({"a": peer_lost, "b": ("failed", "killed by SIGKILL")}, []) == ["b"]
    # Nothing but bystanders: every failed node.
    assert blame({"a": peer_lost, "b": peer_lost}, []) == ["a", "b"]


def test_outcome_names_the_blamed_node() -> None:
    ends = {
        "a": ("failed", "connection to a peer was lost"),
        "b": ("failed", "b stopped answering (nothing for 2.6 s)"),
    }
    end = outcome("j", ["a", "b"], ends, ["b"])
    assert end.state == "failed" and end.blamed == ("b",)
    assert "failed on b" in end.message and "stopped answering" in end.message
    assert outcome("j", ["a"], {"a": ("done", "")}, []).state == "done"
    assert outcome("j", ["a"], {"a": ("stopped", "stopped")}, []).state == "stopped"


def test_watch_adds_events_up() -> None:
    watch = JobWatch("j", nodes=["a", "b"])
    watch.feed("a", {"event": "ready", "seq": 1, "start_iteration": 10, "total": 30})
    for it, loss in ((11, 3.0), (12, 2.0)):
        for node in ("a", "b"):
            watch.feed(
                node,
                {
                    "event": "metrics",
                    "seq": it,
                    "iteration": it,
                    "total": 30,
                    "train_loss": loss,
                    "iterations_per_second": 2.0,
                    "tokens_per_second": 100.0,
                    "trained_tokens": 50 * it,
                    "peak_memory": 0.5,
                    "memory": 1000 + it,
                },
            )
    watch.feed("a", {"event": "metrics", "seq": 11, "iteration": 99})  # heard already: ignored
    watch.feed("a", {"event": "val", "seq": 13, "iteration": 12, "val_loss": 2.5})
    p = watch.progress
    assert [(x.iteration, x.value) for x in p.train_loss] == [(11, 3.0), (12, 2.0)]
    assert [x.value for x in p.val_loss] == [2.5]
    assert p.iteration == 12 and p.start_iteration == 10
    assert p.eta_s == pytest.approx(18 / 2.0)
    assert [n.memory for n in p.nodes] == [1012, 1012]
    assert watch.since("a") == 13
    watch.feed("b", {"event": "ended", "seq": 20, "state": "failed", "message": "killed"})
    assert p.nodes[1].state == "running" and watch.progress.nodes[1].state == "failed"
    watch.finish("failed", "job failed")
    assert watch.progress.eta_s is None


def test_job_names_and_exit_words() -> None:
    assert check_name("run-1.a") == "run-1.a"
    for bad in ("", "../x", "-x", "a b", "x" * 65):
        with pytest.raises(JobError):
            check_name(bad)
    assert "SIGKILL" in exit_message(-signal.SIGKILL, "", [])
    assert exit_message(1, "", ["Traceback", "ValueError: bad"]).endswith("ValueError: bad")
    assert exit_message(1, "RuntimeError: no", ["x"]) == "RuntimeError: no"


def test_job_record_round_trips() -> None:
    rec = JobRecord("j", "finetune", ("a", "b"), "ring", 5.0, {"iters": 3})
    assert JobRecord.from_json(rec.to_json()) == rec


def test_the_bench_rate_leaves_the_warm_up_out(tmp_path: Path) -> None:
    watch = JobWatch("b", nodes=["a"])
    assert job_rate(watch, [10.0, 20.0, 30.0, 100.0, 110.0, 120.0]) == 110.0
    assert job_rate(watch, [50.0]) == 50.0  # too short a job: what there is
    with pytest.raises(RuntimeError, match="reported no rate"):
        job_rate(watch, [])
    rows = load_examples(bench_data(tmp_path / "d.jsonl"), least=BATCH)
    assert rows.format == "text" and len(rows.train) >= 4 * BATCH


json_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(
        st.sampled_from(["name", "kind", "nodes", "backend", "started", "request", "runs",
                         "cluster", "model", "results", "version"]) | st.text(max_size=4),
        inner,
        max_size=5,
    ),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=150, deadline=None, database=None)
@given(st.one_of(json_junk.map(json.dumps), st.text(max_size=40)))
def test_a_garbage_job_record_or_benchmark_run_is_left_out_or_named(text: str) -> None:
    """The files under STUDIOTUI_HOME a job list and the benchmark screen read: a
    damaged one is left out (a job) or refused naming the file (a run), never raised
    as something else."""
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        records_dir(home).mkdir()
        (records_dir(home) / "j.json").write_text(text)
        found = load_record(home, "j")
        assert found is None or isinstance(found, JobRecord)
        run = home / "run.json"
        run.write_text(text)
        try:
            benchmark.read(run)
        except benchmark.BenchmarkError as exc:
            assert str(run) in str(exc)


def test_jobs_ended_by_names_the_running_jobs_with_a_rank_on_the_nodes() -> None:
    def rank(job: str, state: str) -> JobRank:
        return JobRank(job=job, state=state)

    found = {
        "long": {"a": rank("long", "running"), "b": rank("long", "silent")},
        "done": {"a": rank("done", "done")},
        "new": {"b": rank("new", "starting")},
        "elsewhere": {"c": rank("elsewhere", "running")},
    }
    assert jobs_ended_by(found, ["a"]) == {"long": ["a"]}
    assert jobs_ended_by(found, ["b", "a"]) == {"long": ["a", "b"], "new": ["b"]}
    assert jobs_ended_by(found, ["d"]) == {}
    assert jobs_ended_by({}, ["a"]) == {}
