"""What an agent reports about RDMA over Thunderbolt (`facts["rdma"]`), typed.

The agent fills it from its probes (worker/node_probe.py, parsed by
worker.shared.probes) and sends it as a plain map in its status and telemetry; the
operator reads it back with `read_rdma` before it decides anything from it (the JACCL
device matrix, whether a pair has RDMA). `ports` is what makes a device matrix
possible: each Thunderbolt port's own domain UUID, its `rdma_enX` device and state,
and the domain UUID of the Mac at the other end of its cable.
"""

from __future__ import annotations

from typing import Any

from worker.shared.protocol.control import Wire, parse


class RdmaPort(Wire, frozen=True, kw_only=True):
    receptacle: int  # the port's number: networksetup's "Thunderbolt N"
    domain_uuid: str | None = None  # this port's own Thunderbolt domain UUID
    interface: str | None = None  # enX
    device: str | None = None  # rdma_enX (None: ibv_devices does not list one)
    state: str | None = None  # PORT_ACTIVE, PORT_DOWN; None when ibv_devinfo said nothing
    peer_uuid: str | None = None  # the cabled Mac's domain UUID; None: no Mac there
    peer_model: str | None = None  # its model identifier ("Mac15,14")
    link_gbps: float | None = None
    ipv4: str | None = None  # the interface's own; "" listed without one; None unknown

    @property
    def active(self) -> bool:
        return self.state == "PORT_ACTIVE"


class RdmaFacts(Wire, frozen=True, kw_only=True):
    os: str = ""
    os_version: str = ""
    status: str = "unknown"  # rdma_ctl status: enabled, disabled, unknown
    usable: bool = False  # ibv_devices lists rdma_enX devices and rdma_ctl does not say disabled
    devices: tuple[str, ...] = ()
    active_devices: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    bridge_exists: bool = False
    bridge_members: tuple[str, ...] = ()
    bridge_active: bool = False
    notes: tuple[str, ...] = ()
    steps: tuple[str, ...] = ()
    ports: tuple[RdmaPort, ...] = ()  # every Thunderbolt port, by number; () when not probed

    @property
    def own_uuids(self) -> frozenset[str]:
        """This Mac's Thunderbolt domain UUIDs (one per port): what a peer's port names."""
        return frozenset(p.domain_uuid for p in self.ports if p.domain_uuid)


def read_rdma(raw: Any) -> RdmaFacts | None:
    """An agent's `facts["rdma"]` as RdmaFacts; None when it sent none (not probed yet).
    A malformed one raises MessageError naming the field."""
    if raw is None:
        return None
    return parse(raw, RdmaFacts)
