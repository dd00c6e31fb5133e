"""What the A/B tools share: compare two compiled variants' outputs, time them interleaved."""

import time

import jax
import numpy as np


def largest_relative_difference(a, b) -> float:
    """The largest |a - b| over each floating leaf, relative to that leaf's largest |a|."""
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                     / max(float(np.max(np.abs(np.asarray(x, np.float64)))), 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
               if np.issubdtype(np.asarray(x).dtype, np.floating))


def interleaved_medians(compiled: dict, fresh, *, rounds: int, calls: int) -> dict:
    """Median seconds per call of each compiled function (name -> fn), called on `fresh()`'s
    arguments; a round times every variant once, in turn, `calls` calls each."""
    times = {k: [] for k in compiled}
    for _ in range(rounds):
        for k, c in compiled.items():
            inputs = [fresh() for _ in range(calls)]
            t0 = time.perf_counter()
            for x in inputs:
                out = c(*x)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / calls)
    return {k: float(np.median(v)) for k, v in times.items()}
