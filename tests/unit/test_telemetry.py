"""Power and memory pressure: parsing (recorded outputs), the choice of source
given what a machine has, and the Meter reading through an injected runner.

The live path (a real agent on this Linux machine, through the dashboard) is in
tests/test_app_dashboard.py::test_first_run_places_the_demo_model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.support.fixture_paths import read_fixture
from worker import telemetry
from worker.shared import probes
from worker.telemetry import Meter, PowerFacts, Source, choose_power_source, choose_pressure_source

POWERMETRICS = (
    "powermetrics.default-samplers.m4max-macbookpro-mac16-6.macos15.5.powermetrics-go-sample.txt"
)
MACMON = "macmon_pipe.v0.8-format.readme-example.vladkens-macmon.jsonc"
MEMORY_PRESSURE = "memory_pressure_-Q.m5-macbookpro-24gb.voltry-fixture.txt"
# /proc/pressure/memory as this (Linux 6.x) machine printed it under load from a test.
PSI = """\
some avg10=1.52 avg60=0.40 avg300=0.09 total=3735281
full avg10=0.81 avg60=0.21 avg300=0.05 total=2160052
"""


def test_powermetrics_reads_the_summary_block_not_the_gpu_section() -> None:
    p = probes.parse_powermetrics(read_fixture(POWERMETRICS))
    # The summary block says 954/28/0 mW and 983 mW combined; the GPU section repeats 28.
    assert (p.cpu_w, p.gpu_w, p.ane_w, p.combined_w) == pytest.approx((0.954, 0.028, 0.0, 0.983))
    watts = probes.parse_powermetrics("CPU Power: 1.5 W\nGPU Power: 2 W\n")
    assert watts.combined_w == pytest.approx(3.5)  # no Combined line: the parts add up
    with pytest.raises(probes.ProbeParseError, match="powermetrics"):
        probes.parse_powermetrics("GPU Power: 28 mW\n")


def test_psi_and_rapl_arithmetic() -> None:
    psi = probes.parse_psi(PSI)
    assert (psi.some_avg10, psi.some_avg60, psi.full_avg10) == (1.52, 0.40, 0.81)
    assert probes.parse_psi("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n").full_avg10 is None
    # 30 J in 2 s on one zone; the other wrapped at its range: (range - start) + end more.
    before = {"a": 1_000_000, "b": 262_143_000_000}
    after = {"a": 31_000_000, "b": 4_328_000}
    ranges = {"b": 262_143_328_850}
    assert probes.rapl_watts(before, after, 2.0, ranges) == pytest.approx((30 + 4.65685) / 2)
    assert probes.rapl_watts({}, after, 2.0, ranges) is None
    assert probes.rapl_watts(before, after, 0.0, ranges) is None


MAC = PowerFacts("Darwin", frozenset({"memory_pressure", "vm_stat"}))


@pytest.mark.parametrize(
    ("facts", "kind", "argv0"),
    [
        (PowerFacts("Darwin", frozenset({"macmon", "powermetrics"})), "macmon", "macmon"),
        (
            PowerFacts("Darwin", frozenset({"powermetrics"}), is_root=True),
            "powermetrics",
            "powermetrics",
        ),
        (
            PowerFacts("Darwin", frozenset({"powermetrics"}), sudo_powermetrics=True),
            "powermetrics",
            "sudo",
        ),
        (PowerFacts("Darwin", frozenset({"powermetrics"})), "", None),
        (PowerFacts("Linux", rapl_zones=("/sys/class/powercap/intel-rapl:0",)), "rapl", None),
        (PowerFacts("Linux", rapl_note="RAPL energy counters are readable by root only"), "", None),
        (PowerFacts("FreeBSD"), "", None),
    ],
)
def test_power_source_choice(facts: PowerFacts, kind: str, argv0: str | None) -> None:
    source = choose_power_source(facts)
    assert source.kind == kind
    if argv0:
        assert source.argv[0] == argv0
    if not kind:
        assert source.reason  # never silent
    if facts.system == "Darwin" and not kind:
        assert "brew install macmon" in source.reason and "sudo -n powermetrics" in source.reason
    if facts.rapl_note:
        assert source.reason == facts.rapl_note


def test_pressure_source_choice() -> None:
    assert choose_pressure_source(MAC).argv == ("memory_pressure", "-Q")
    assert choose_pressure_source(PowerFacts("Darwin", frozenset({"vm_stat"}))).kind == "vm_stat"
    assert "PATH" in choose_pressure_source(PowerFacts("Darwin")).reason
    assert (
        choose_pressure_source(PowerFacts("Linux", psi_path="/proc/pressure/memory")).kind == "psi"
    )
    assert choose_pressure_source(PowerFacts("Linux", psi_note="no psi")).reason == "no psi"


class Recorder:
    """A command runner that answers from recorded outputs and notes what it ran."""

    def __init__(self, outputs: dict[str, str | None]) -> None:
        self.outputs = outputs
        self.ran: list[tuple[tuple[str, ...], float]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> str | None:
        self.ran.append((tuple(argv), timeout))
        return self.outputs.get(argv[0] if argv[0] != "sudo" else argv[2])


def test_meter_on_a_mac_with_macmon() -> None:
    run = Recorder(
        {"macmon": read_fixture(MACMON), "memory_pressure": read_fixture(MEMORY_PRESSURE)}
    )
    facts = PowerFacts("Darwin", frozenset({"macmon", "memory_pressure"}))
    meter = Meter(choose_power_source(facts), choose_pressure_source(facts), run, host="studio-1")
    out = meter.read()
    assert out["power"] == {
        "source": "macmon",
        "host": "studio-1",
        "total_w": pytest.approx(5.876533),  # sys_power: the whole machine
        "scope": "system",
        "cpu_w": pytest.approx(0.20486385),
        "gpu_w": pytest.approx(0.017451683),
        "ane_w": 0.0,
    }
    assert out["gpu_pct"] == pytest.approx(2.1497859)
    assert out["pressure"] == {"source": "memory_pressure", "pct": 37.0, "label": "pressure"}
    # Every command ran with a timeout, and a Mac's commands are read every few seconds.
    assert all(t == telemetry.COMMAND_TIMEOUT_S for _, t in run.ran)
    assert meter.every_s == telemetry.COMMAND_EVERY_S


def test_meter_on_a_mac_with_powermetrics_through_sudo() -> None:
    run = Recorder({"powermetrics": read_fixture(POWERMETRICS)})
    facts = PowerFacts("Darwin", frozenset({"powermetrics", "vm_stat"}), sudo_powermetrics=True)
    meter = Meter(choose_power_source(facts), choose_pressure_source(facts), run, host="h")
    out = meter.read()
    assert run.ran[0][0][:3] == ("sudo", "-n", "powermetrics")
    assert out["power"]["total_w"] == pytest.approx(0.983)
    assert out["power"]["scope"] == "soc" and "gpu_pct" not in out
    # vm_stat printed nothing (failed): the reason, not a figure.
    assert out["pressure"] == {"source": "vm_stat", "reason": "vm_stat failed"}


def test_meter_says_why_when_a_command_fails_or_prints_garbage() -> None:
    facts = PowerFacts("Darwin", frozenset({"macmon", "memory_pressure"}))
    out = Meter(
        choose_power_source(facts),
        choose_pressure_source(facts),
        Recorder({"macmon": None, "memory_pressure": "nonsense"}),
        host="h",
    ).read()
    assert out["power"]["reason"].startswith("macmon pipe") and "total_w" not in out["power"]
    assert "memory_pressure" in out["pressure"]["reason"] and "pct" not in out["pressure"]


def _zone(root: Path, name: str, label: str, energy: int) -> Path:
    zone = root / name
    zone.mkdir(parents=True, exist_ok=True)
    (zone / "name").write_text(f"{label}\n")
    (zone / "energy_uj").write_text(f"{energy}\n")
    (zone / "max_energy_range_uj").write_text("262143328850\n")
    return zone


def test_linux_rapl_and_psi_from_files(tmp_path: Path) -> None:
    powercap = tmp_path / "powercap"
    pkg = _zone(powercap, "intel-rapl:0", "package-0", 1_000_000)
    _zone(powercap, "intel-rapl:0:0", "core", 5)  # a part of the package: not added again
    psi = tmp_path / "memory"
    psi.write_text(PSI)
    facts = telemetry.gather_power_facts(powercap=powercap, psi=psi, system="Linux")
    assert facts.rapl_zones == (str(pkg),) and facts.psi_path == str(psi)
    now = [100.0]
    meter = Meter(
        choose_power_source(facts), choose_pressure_source(facts), clock=lambda: now[0], host="h"
    )
    first = meter.read()
    assert first["power"]["reason"].startswith("measuring") and "total_w" not in first["power"]
    assert first["pressure"] == {"source": "psi", "pct": 1.52, "label": "stall"}
    (pkg / "energy_uj").write_text("43000000\n")  # 42 J later
    now[0] += 2.0
    second = meter.read()["power"]
    assert second["total_w"] == pytest.approx(21.0) and second["scope"] == "package"
    assert meter.every_s == telemetry.FILE_EVERY_S


def test_linux_without_rapl_or_psi_says_why(tmp_path: Path) -> None:
    facts = telemetry.gather_power_facts(
        powercap=tmp_path / "none", psi=tmp_path / "nopsi", system="Linux"
    )
    out = Meter(choose_power_source(facts), choose_pressure_source(facts), host="h").read()
    assert out["power"] == {
        "source": None,
        "host": "h",
        "reason": f"no RAPL: {tmp_path / 'none'} does not exist (no powercap driver, or a VM)",
    }
    assert "does not exist" in out["pressure"]["reason"]
    empty = tmp_path / "empty"
    empty.mkdir()
    facts = telemetry.gather_power_facts(powercap=empty, psi=tmp_path / "nopsi", system="Linux")
    assert choose_power_source(facts) == Source("", reason=f"no RAPL zones in {empty}")
