"""What the A/B tools share: a Trainer for an experiment, compare two compiled variants'
outputs, time them interleaved."""

import tempfile
import time

import jax
import numpy as np


def trainer(experiment: str, arg: str, **fields):
    """(Trainer, initial state, first train batch) for `experiments/EXPERIMENT:ARG` with
    dotted config `fields` set ({"model.lowrank.rank": 42}); the text classifier
    (`lra.py`) at 256 bytes, as the compress bench trains it."""
    from hpnlp.bench import harness
    from hpnlp.config import from_configdict
    from hpnlp.train import Trainer
    from hpnlp.train.loop import _global

    cd = harness.experiment_module(experiment).get_config(arg)
    cd.train.progress = False
    if experiment == "lra.py":
        cd.data.seq_len = cd.model.max_len = 256
    for field, value in fields.items():
        *path, last = field.split(".")
        node = cd
        for name in path:
            node = node[name]
        node[last] = value
    tr = Trainer(from_configdict(cd), tempfile.mkdtemp())
    state, _ = tr.initial_state()
    return tr, state, _global(next(iter(tr.train_iter)), tr.batch_sharding)


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
