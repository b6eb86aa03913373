"""`studiotui-worker` / `python -m worker`: run a node agent."""

from __future__ import annotations

import argparse
from pathlib import Path

from worker.agent import AgentConfig, run_agent


def parse_bind(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise argparse.ArgumentTypeError(f"--bind wants ADDRESS:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="studiotui-worker", description=__doc__)
    parser.add_argument(
        "--bind", required=True, type=parse_bind, help="ADDRESS:PORT of the control socket"
    )
    parser.add_argument("--home", required=True, type=Path, help="the node's work directory")
    parser.add_argument("--name", default=None, help="node name (default: the host name)")
    parser.add_argument(
        "--memory-gb", type=float, default=None, help="advertised memory (simulated nodes)"
    )
    args = parser.parse_args(argv)
    import socket

    address, port = args.bind
    config = AgentConfig(
        name=args.name or socket.gethostname(),
        address=address,
        control_port=port,
        home=args.home.expanduser().resolve(),
        memory_gb=args.memory_gb,
    )
    return run_agent(config)


if __name__ == "__main__":
    raise SystemExit(main())
