"""What the A/B tools share: a Trainer for an experiment, compare two compiled variants'
outputs, time them interleaved."""

import atexit
import os
import platform
import shutil
import tempfile
import time

import jax
import numpy as np


def at_least(least: int):
    """An argparse type: an integer >= `least` (a tool's --rounds: 0 rounds would compile
    everything and then print nan)."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {least}")
        return value
    return parse


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
    tr = Trainer(from_configdict(cd), scratch_dir())
    state, _ = tr.initial_state()
    return tr, state, _global(next(iter(tr.train_iter)), tr.batch_sharding)


def scratch_dir(prefix: str = "hpnlp_tool_") -> str:
    """A temporary folder removed when the process exits (a review, session 116: the tools'
    Trainer folders, and qgemm_ab's copy of the package and its two kernel caches, were left
    in /tmp on every call)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def largest_relative_difference(a, b) -> float:
    """The largest |a - b| over each floating leaf, relative to that leaf's largest |a|."""
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                     / max(float(np.max(np.abs(np.asarray(x, np.float64)))), 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
               if np.issubdtype(np.asarray(x).dtype, np.floating))


def interleaved_times(programs: dict, *, rounds: int, calls: int, shuffle: bool = False) -> dict:
    """Seconds per call of each program (name -> (fn, fresh)) in each round, fn called on
    `fresh()`'s arguments; a round times every program once, `calls` calls each, in turn
    or (`shuffle`) in a new random order."""
    times = {k: [] for k in programs}
    order, rng = list(programs), np.random.default_rng(0)
    for _ in range(rounds):
        if shuffle:
            rng.shuffle(order)
        for k in order:
            fn, fresh = programs[k]
            inputs = [fresh() for _ in range(calls)]
            # made before the clock starts (review r6): JAX dispatches asynchronously, so an
            # input still being computed at t0 counted as the calls' time (XLA:CPU runs a lone
            # copy inline, but not a program with a dot or a loop, and a GPU runs none inline)
            jax.block_until_ready(inputs)
            t0 = time.perf_counter()
            for x in inputs:
                out = fn(*x)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / calls)
    return times


def interleaved_medians(compiled: dict, fresh, *, rounds: int, calls: int) -> dict:
    """Median seconds per call of each compiled function (name -> fn), called on `fresh()`'s
    arguments; a round times every variant once, in turn, `calls` calls each."""
    times = interleaved_times({k: (c, fresh) for k, c in compiled.items()}, rounds=rounds,
                              calls=calls)
    return {k: float(np.median(v)) for k, v in times.items()}


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo), for a tool's header line."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def compare(compiled: dict, fresh, *, rounds: int, calls: int) -> tuple[dict, float]:
    """(median seconds per call of each compiled variant, the largest relative difference
    between the first two variants' outputs), every variant called on `fresh()`'s arguments."""
    outs = [jax.block_until_ready(c(*fresh())) for c in compiled.values()]
    diff = largest_relative_difference(outs[0], outs[1])
    return interleaved_medians(compiled, fresh, rounds=rounds, calls=calls), diff


def print_cpu(extra: str = "") -> None:
    """A tool's first line: the CPU, its cores and the jax version."""
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; jax {jax.__version__}{extra}")


def print_header(columns: tuple[str, str, str], width: int, extra: str = "",
                 label: str = "") -> None:
    """`print_cpu`, then the column names of `print_row`'s rows."""
    print_cpu(extra)
    print(f"{label:{width}s} {columns[0]:>12s} {columns[1]:>12s} {columns[2]:>7s}")


def print_row(name: str, before_s: float, after_s: float, diff: float, width: int,
              note: str = "", digits: int = 1) -> None:
    """One A/B row: both medians in ms (`digits` decimals), before over after, and the
    outputs' difference."""
    print(f"{name:{width}s} {before_s * 1e3:9.{digits}f} ms {after_s * 1e3:9.{digits}f} ms "
          f"{before_s / after_s:6.2f}x   largest difference {diff:.1e} (relative{note})",
          flush=True)
