"""Stand-in `train`s for `hpnlp.bench.harness.train_side_by_side`'s test: they run in the
spawned processes, so they live in a module they can import (tests/ is on their sys.path)."""

import json
import os
import time


def record(i: int, out: str) -> None:
    """Append which process ran job `i`, on which cores, starting when, to `out`/ran.jsonl
    (a line a time it ran); fail for i < 0."""
    if i < 0:
        raise ValueError(f"job {i} fails")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "ran.jsonl"), "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)),
                            "start": time.time()}) + "\n")


def record_slowly(i: int, out: str) -> None:
    """`record`, then half a second's work: a run that keeps its process busy."""
    record(i, out)
    time.sleep(0.5)


def record_then_wait(i: int, out: str) -> None:
    """`record`, then a minute's wait, then `out`/done: a run still training when its
    processes are ended."""
    record(i, out)
    time.sleep(60)
    with open(os.path.join(out, "done"), "w") as f:
        f.write("done")
