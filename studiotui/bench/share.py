"""mlx-lm's own file broadcaster (`mlx_lm.share`), timed, for `studiotui bench`.

Run by `mlx.launch --backend ring -n 2`: rank 0 holds the files and sends them with
`mlx_lm.share.share_files` (all_sum over mx.distributed, 100 MB chunks); rank 1
writes them into its folder. Rank 0 prints the bytes and the seconds the transfer
took (process start and MLX import are left out) as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.share import get_files, share_files


def main() -> None:
    source, dest = Path(sys.argv[1]), Path(sys.argv[2])
    mx.set_default_device(mx.cpu)
    group = mx.distributed.init()
    root, files = get_files(source)
    if group.rank() != 0:
        root = dest
        root.mkdir(parents=True, exist_ok=True)
        files = []
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # both ranks ready
    began = time.perf_counter()
    share_files(root, files, 0, group)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # both ranks done
    seconds = time.perf_counter() - began
    if group.rank() == 0:
        size = sum((root / f.path).stat().st_size for f in files if f.entry_type == "file")
        print(json.dumps({"bytes": size, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
