"""Fixed data for the dashboard's snapshot tests: a four-Mac desk cluster frozen in time.

Everything is literal (times, memory, history) so the SVG snapshots are the same
on every run and every machine.
"""

from __future__ import annotations

from studiotui.app.panes.models import ModelRow
from studiotui.core.state import ClusterState, LogEntry, NodeState, ShardState

GB = 1024**3
T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC


def _history(start: float, end: float, n: int = 60) -> tuple[float, ...]:
    return tuple(start + (end - start) * i / (n - 1) for i in range(n))


def _shard(placement: str, node: str, index: int, count: int, start: int, end: int, **kw):
    return ShardState(
        placement=placement,
        node=node,
        index=index,
        count=count,
        start=start,
        end=end,
        state=kw.pop("state", "ready"),
        model_dir=f"/Users/op/.studiotui/models/{kw.pop('model', placement)}",
        **kw,
    )


def _mac(name: str, octet: int, total_gb: int, used_gb: float, **kw) -> NodeState:
    macos = {
        "os": "Darwin",
        "os_version": kw.pop("os_version", "26.2"),
        "chip": "Apple M3 Ultra",
    }
    rdma = kw.pop("rdma", None)
    if rdma is not None:
        macos["rdma"] = rdma
    # Agents bound on the Thunderbolt bridge, as `networksetup` names it.
    macos["link_end"] = {
        "address": f"10.0.0.{octet}",
        "interface": "bridge0",
        "port": "Thunderbolt Bridge",
        "prefix": 24,
        "kind": "thunderbolt",
    }
    # As an agent with macmon reports them: sys_power is the whole Mac, the parts are
    # macmon's CPU/GPU/ANE rails (the rest is memory, fabric, fans, ports).
    watts = kw.pop("watts", (6.2, 41.5, 0.0, 58.4))
    power: dict = {}
    if watts is not None:
        cpu_w, gpu_w, ane_w, total_w = watts
        power = {
            "source": "macmon",
            "host": f"{name}.local",
            "scope": "system",
            "total_w": total_w,
            "cpu_w": cpu_w,
            "gpu_w": gpu_w,
            "ane_w": ane_w,
        }
    used = used_gb / total_gb
    # memory_pressure counts inactive and purgeable pages as free: below the used share.
    pressure_pct = kw.pop("pressure", round(used * 85))
    return NodeState(
        name=name,
        address=f"10.0.0.{octet}",
        control_port=52500,
        transport="ssh",
        state=kw.pop("state", "up"),
        version="0.1.0",
        memory_total=total_gb * GB,
        memory_used=int(used_gb * GB),
        cpu_pct=kw.pop("cpu", 12.0),
        gpu_pct=kw.pop("gpu", 40.0),
        power_w=power.get("total_w"),
        power=power,
        power_history=_history(power["total_w"] * 0.4, power["total_w"]) if power else (),
        pressure={"source": "memory_pressure", "pct": float(pressure_pct), "label": "pressure"}
        if pressure_pct is not None
        else {},
        pressure_history=_history(pressure_pct * 0.6, pressure_pct) if pressure_pct else (),
        chip="Apple M3 Ultra",
        os="Darwin",
        last_seen=T0,
        memory_history=kw.pop("history", _history(used_gb / total_gb * 0.6, used_gb / total_gb)),
        facts=macos,
        **kw,
    )


def fixed_state() -> ClusterState:
    ds = "deepseek-v3"
    qw = "qwen3-32b"
    studio1 = _mac(
        "studio-1",
        11,
        512,
        441.0,
        shards=(_shard(ds, "studio-1", 0, 2, 0, 31, tokens=1834, in_flight=2),),
        # A current agent's report: it has a `ports` field (an older one's has none).
        rdma={
            "status": "enabled",
            "usable": True,
            "devices": ["rdma_en3", "rdma_en5"],
            "ports": [],
        },
    )
    studio2 = _mac(
        "studio-2",
        12,
        512,
        497.0,
        cpu=71.0,
        gpu=96.0,
        watts=(18.7, 97.3, 0.0, 131.9),
        shards=(_shard(ds, "studio-2", 1, 2, 31, 61, tokens=1834, in_flight=2),),
        rdma={"status": "enabled", "usable": True, "devices": ["rdma_en3"], "ports": []},
    )
    studio3 = _mac(
        "studio-3",
        13,
        256,
        70.0,
        os_version="15.6",
        gpu=15.0,
        watts=(4.1, 12.6, 0.0, 31.2),
        shards=(_shard(qw, "studio-3", 0, 2, 0, 40, tokens=220, in_flight=1),),
    )
    studio4 = _mac(
        "studio-4",
        14,
        256,
        12.0,
        state="down",
        cpu=0.0,
        gpu=None,
        watts=None,
        pressure=None,
        message="no telemetry for 3 s",
        history=_history(0.05, 0.05),
    )
    studio4 = NodeState(**{**studio4.__dict__, "shards": ()})
    nodes = (studio1, studio2, studio3, studio4)
    from studiotui.core.state import placements_from_shards

    log = (
        LogEntry(T0 + 1, "info", "studio-1 is up (0.1.0)"),
        LogEntry(T0 + 2, "info", "studio-2 is up (0.1.0)"),
        LogEntry(T0 + 3, "info", "placing deepseek-v3 as 'deepseek-v3' on studio-1, studio-2"),
        LogEntry(T0 + 40, "info", "placement 'deepseek-v3' is ready"),
        LogEntry(
            T0 + 61,
            "warning",
            "studio-2 memory at 97 %: a longer context may not fit",
        ),
        LogEntry(
            T0 + 75,
            "error",
            "studio-4 is down: no telemetry for 3 s (last seen at 00:01:12; the agent "
            "may have been killed or the cable pulled)",
        ),
    )
    return ClusterState(name="desk", nodes=nodes, placements=placements_from_shards(nodes), log=log)


def fixed_models() -> list[ModelRow]:
    return [
        ModelRow(
            "deepseek-v3",
            "/m/deepseek-v3",
            "deepseek_v3",
            671_000_000_000,
            61,
            int(713.4 * GB),
            "8-bit",
        ),
        ModelRow("demo", "/m/demo", "llama", 3_700_000, 8, 7_400_000, "bf16"),
        ModelRow("qwen3-32b", "/m/qwen3-32b", "qwen3", 32_800_000_000, 64, 34 * GB, "8-bit"),
        ModelRow("broken", "/m/broken", problem="/m/broken has no config.json"),
    ]
