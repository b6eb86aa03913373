"""Where the recorded macOS command outputs are: inside the repository.

`tests/fixtures/macos/` is a copy of the outputs the probe parsers are tested on (its
README says where each came from). `STUDIOTUI_FIXTURES` may point elsewhere, to try the
parsers on other recordings (the macos folder itself or a folder holding `macos/`); it
is an override, never a requirement.
"""

from __future__ import annotations

import os
from pathlib import Path

IN_REPO = Path(__file__).resolve().parents[1] / "fixtures" / "macos"


def macos_fixtures() -> Path:
    env = os.environ.get("STUDIOTUI_FIXTURES")
    if not env:
        return IN_REPO
    root = Path(env)
    return root / "macos" if (root / "macos").is_dir() else root


def read_fixture(name: str) -> str:
    """The text of one recorded output; a missing one names where it was looked for."""
    folder = macos_fixtures()
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(
            f"fixture {name!r} not found in {folder} (STUDIOTUI_FIXTURES="
            f"{os.environ.get('STUDIOTUI_FIXTURES', '<unset>')}); the repository carries "
            f"them in {IN_REPO}"
        )
    return path.read_text(encoding="utf-8")


# The recordings by name (tests/fixtures/macos/README.md says where each came from).
TB_STUDIO = "system_profiler_SPThunderboltDataType.json.tb5-peer-and-usb4v2-drive.m3ultra-studio-mac15-14.omlx-test.json"  # noqa: E501
TB_MBP = (
    "system_profiler_SPThunderboltDataType.json.tb5-peer.m5max-macbookpro-mac17-7.omlx-test.json"
)
TB_OFF = "system_profiler_SPThunderboltDataType.json.tb5-peer-rdma-disabled-side.m5max-macbookpro-mac17-6.macos27.osaurus-test.REDACTED-IDS.json"  # noqa: E501
TB_ON = "system_profiler_SPThunderboltDataType.json.tb5-peer-rdma-enabled-side.m5max-macbookpro-mac17-6.macos27.osaurus-test.REDACTED-IDS.json"  # noqa: E501
TB_TEXT_NONE = (
    "system_profiler_SPThunderboltDataType.text.no-peer.m4pro-macmini.maccluster-fixture.txt"
)
TB_TEXT_PEER = "system_profiler_SPThunderboltDataType.text.tb5-peer-mac16-9.m4pro-macmini.exo-issue-1390.PARTIAL-truncated.txt"  # noqa: E501
IBV_STUDIO = "ibv_devices.m3ultra-6-ports.mlx-docs.txt"
IBV_MINI = "ibv_devices.m4pro-macmini-3-ports.apple-tn3205.txt"
IBV_NONE = "ibv_devices.rdma-disabled-header-only.osaurus-test.txt"
IBV_MBP = (
    "ibv_devices.rdma-enabled-3-ports.m5max-macbookpro.macos27.osaurus-test.REDACTED-GUIDS.txt"
)
DEVINFO_DOWN = (
    "ibv_devinfo.3-ports-port-down.m5max-macbookpro.macos27.osaurus-test.REDACTED-GUIDS.txt"
)
DEVINFO_ACTIVE = "ibv_devinfo.m4pro-macmini-cluster.port-active.apple-tn3205.PARTIAL-elided.txt"
DEVINFO_GID = "ibv_devinfo_-d_rdma_en2_-v.gid-table.apple-tn3205.PARTIAL-elided-and-rewrapped.txt"
IFC_ALL = "ifconfig.all-interfaces.bridge0-members-en1-en3.apple-silicon-mac.jmw-parsing-test.txt"
IFC_EN8 = "ifconfig.en8-self-assigned-169.254.m4pro-macmini.exo-issue-1390.txt"
IFC_NOADDR = "ifconfig.tb-ports-en2-en4-no-address.m4pro-macmini.exo-issue-1390.txt"
IFC_BRIDGE = "ifconfig_bridge0.tb-bridge-members-en2-en4.apple-tn3205.PARTIAL-elided.txt"
IFC_EN2 = "ifconfig_en2.tb-port-own-ipv4-ipv6.apple-tn3205.txt"
NS_EXO = "networksetup_-listallhardwareports.m5max-macbookpro-macos26.5.team-wcv-exo-test.txt"
NS_OSAURUS = (
    "networksetup_-listallhardwareports.m5max-macbookpro.macos27.osaurus-test.REDACTED-MACS.txt"
)
MACMON_V07_JSONL = (
    "macmon_pipe.v0.7-format.readme-example.vladkens-macmon.DERIVED-comments-stripped.jsonl"
)
MACMON_V07_JSONC = "macmon_pipe.v0.7-format.readme-example.vladkens-macmon.jsonc"
MACMON_V08_JSONC = "macmon_pipe.v0.8-format.readme-example.vladkens-macmon.jsonc"
MACMON_M4_CUT = (
    "macmon_pipe_--samples_1_--soc-info.jq.m4-macbookair.macmon-issue-51.PARTIAL-truncated.txt"
)
MEMORY_PRESSURE = "memory_pressure_-Q.m5-macbookpro-24gb.voltry-fixture.txt"
RDMA_CTL = "rdma_ctl_status.enabled.omlx-issue-3037.txt"
HW_JSON = (
    "system_profiler_SPHardwareDataType.json.m5-macbookpro-mac17-2.voltry-fixture.REDACTED-IDS.json"
)
HW_TEXT = "system_profiler_SPHardwareDataType.text.with-stderr-noise.m4-macbookair-mac16-12.macmon-issue-51.PARTIAL.txt"  # noqa: E501
