"""A stand-in `train` for `hpnlp.bench.harness.train_side_by_side`'s test: it runs in the
spawned processes, so it lives in a module they can import (tests/ is on their sys.path)."""

import json
import os


def record(i: int, out: str) -> None:
    """Write which process ran job `i`, on which cores, into `out`/ran.json; fail for i < 0."""
    if i < 0:
        raise ValueError(f"job {i} fails")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "ran.json"), "w") as f:
        json.dump({"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0))}, f)
