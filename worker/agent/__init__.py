"""The node agent, one module per capability.

`core` holds the daemon (its sockets, the dispatch of a request by its message type,
its lifecycle); `host` what each capability works with; `shards` the shards it runs,
`links` link measurement, `files` a model's files, `hub` Hub downloads, `bench` the
device benchmark, `jobs` cluster jobs, `node` hello, telemetry, probes and the log.
"""

from worker.agent.bench import BENCH_TIMEOUT_S, BenchError, bench_exit_reason
from worker.agent.core import (
    LOG_BACKUPS,
    LOG_BYTES,
    MAX_CONTROL_TASKS,
    PEER_REQUESTS,
    Agent,
    log_handlers,
    run_agent,
)
from worker.agent.host import AgentConfig, Ask
from worker.agent.jobs import MAX_FOLLOWERS
from worker.agent.links import LINK_TIMEOUT_S, LinkSizes, link_sizes
from worker.agent.node import PROBE_EVERY_S, TELEMETRY_EVERY_S
from worker.agent.shards import (
    LOAD_HEARTBEAT_S,
    SILENT_AFTER_S,
    STUCK_AFTER_S,
    ShardProc,
    exit_reason,
    tensor_member,
)

__all__ = [
    "BENCH_TIMEOUT_S",
    "LINK_TIMEOUT_S",
    "LOAD_HEARTBEAT_S",
    "LOG_BACKUPS",
    "LOG_BYTES",
    "MAX_CONTROL_TASKS",
    "MAX_FOLLOWERS",
    "PEER_REQUESTS",
    "PROBE_EVERY_S",
    "SILENT_AFTER_S",
    "STUCK_AFTER_S",
    "TELEMETRY_EVERY_S",
    "Agent",
    "AgentConfig",
    "Ask",
    "BenchError",
    "LinkSizes",
    "ShardProc",
    "bench_exit_reason",
    "exit_reason",
    "link_sizes",
    "log_handlers",
    "run_agent",
    "tensor_member",
]
