"""How fast this host itself is from moment to moment: one fixed piece of MLX work (a
decode step of a small demo model) timed on each of the host's CPUs.

A test that sets two measurements of the same machine side by side (the forecast,
priced from device figures taken at one moment, against streams timed at another)
needs to know how much the machine's own speed moved between them. On a virtual
machine it can move a lot: the same step, pinned to one CPU, takes ~6 ms for some
seconds and ~10 ms for the next ones, as the hypervisor shares the core. `HostSpeed`
keeps one probe process pinned to each CPU, idle until asked; `sample()` times the
step on each CPU in turn (never two at once) and `spread()` is the slowest sample over
the fastest: what no forecast, however right, can be closer than.

Run as a program (`python -m tests.support.host_speed CPU`) it is one probe: pinned
to CPU, it answers each line on stdin with the median time of the step in seconds.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
from types import TracebackType

import psutil

STEPS = 25
READY = "ready"


class HostSpeed:
    """Probes pinned to each CPU of this process's affinity, stopped on exit."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.cpu_s = 0.0  # CPU seconds the probes used, counted as they stop
        self.probes: list[subprocess.Popen[str]] = []
        try:
            for cpu in sorted(os.sched_getaffinity(0)):
                self.probes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.support.host_speed", str(cpu)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            for probe in self.probes:
                assert probe.stdout is not None
                line = probe.stdout.readline().strip()
                assert line == READY, f"host speed probe {probe.pid} said {line!r}"
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> HostSpeed:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def sample(self) -> None:
        """Time the step once on each CPU, one CPU after the other."""
        for probe in self.probes:
            assert probe.stdin is not None and probe.stdout is not None
            probe.stdin.write("go\n")
            probe.stdin.flush()
            self.samples.append(float(probe.stdout.readline()))

    def spread(self) -> float:
        """The slowest sample over the fastest (1.0: the host's speed never moved)."""
        return max(self.samples) / min(self.samples) if self.samples else 1.0

    def close(self) -> None:
        for probe in self.probes:
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(probe.pid).cpu_times()
                self.cpu_s += times.user + times.system
            if probe.poll() is None:
                probe.kill()
            probe.wait(timeout=10)
        self.probes.clear()


def main(cpu: int) -> int:
    os.sched_setaffinity(0, {cpu})
    import mlx.core as mx

    from worker import device_bench

    # The deeper of the two models the device figures time a dense layer with.
    depth = device_bench.DECODE_LAYERS[-1]
    model = device_bench._decode_model("llama", depth, None, mx.float32)
    print(READY, flush=True)
    for _ in sys.stdin:
        step = device_bench._decoder(model)  # a fresh cache: every sample the same work
        times = [device_bench._time_one(step) for _ in range(STEPS)]
        print(statistics.median(times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1])))
