"""`studiotui bench`'s floor under the MoE row: the same two shards of the same model
run by two plain processes over a bare CURVE ZeroMQ hop each way (`pipe_floor.py`),
with no engine and no request logic.

A goal may be out of reach on this machine for reasons that have nothing to do with
the engine (two processes, four threads and two wake-ups a token on two shared vCPUs);
the floor says what the bare mechanism costs here, in the same run and under the same
load, so `moe_pipe2_over_floor` (the pipeline's ratio to mlx-lm over the floor's) says
what the engine itself adds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from studiotui.bench.bare import pair_keys


class FloorFailed(RuntimeError):
    pass


class PipeFloor:
    """The floor's two processes: the head (layers [0, split)), driven over its stdin
    and stdout, and the tail ([split, n)), on keys of their own. Started here, they
    load while the caller does other work; `wait_ready` waits for the head's word."""

    def __init__(self, model_dir: Path, split: int, address: str, port: int, chunk: int) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="studiotui-floor-")
        home = Path(self._tmp.name)
        pair_keys(home)
        here, there = f"tcp://{address}:{port}", f"tcp://{address}:{port + 1}"
        base = [sys.executable, "-m", "studiotui.bench.pipe_floor"]
        common = [str(home), str(model_dir), str(split)]
        self.tail = subprocess.Popen([*base, "tail", *common, there, here])
        self.head = subprocess.Popen(
            [*base, "head", *common, here, there, str(chunk)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = False

    def _answer(self) -> dict[str, Any]:
        """The head's next JSON line (other lines skipped)."""
        out: IO[str] | None = self.head.stdout
        assert out is not None
        for line in out:
            if line.startswith("{"):
                answer = dict(json.loads(line))
                if "error" in answer:
                    raise FloorFailed(f"the floor failed: {answer['error']}")
                return answer
        raise FloorFailed(f"the floor's head exited ({self.head.wait()}) without answering")

    def wait_ready(self) -> None:
        if not self.ready:
            self._answer()
            self.ready = True

    def decode(self, prompt: list[int], n: int) -> dict[str, Any]:
        """n greedy tokens after `prompt` through both processes, and their tokens/s."""
        self.wait_ready()
        stdin = self.head.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps({"prompt": prompt, "tokens": n}) + "\n")
            stdin.flush()
        except BrokenPipeError:
            raise FloorFailed(f"the floor's head exited ({self.head.wait()})") from None
        return self._answer()

    def close(self) -> None:
        """Ask both to stop (an empty line: the head tells the tail), then make sure; only
        the processes this object started."""
        try:
            if self.head.poll() is None and self.head.stdin is not None:
                self.head.stdin.write("\n")
                self.head.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        for proc in (self.head, self.tail):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.head.stdout is not None:
            self.head.stdout.close()
        self._tmp.cleanup()
