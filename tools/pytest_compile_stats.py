"""Where the test suite's time goes to XLA compilation, per test: a pytest plugin.

    PYTHONPATH=tools python -m pytest -q -n auto -m "not slow" -p pytest_compile_stats tests

At the end it prints the tests that compiled the most (count and seconds of XLA backend
compilation, from `jax.monitoring`'s compile-duration events) and writes them all to
`compile_stats.json` (`COMPILE_STATS=PATH` to choose). Most of the suite's time on a 2-core
CPU is compilation; a test with many cheap compiles is usually running a model pass
eagerly (every primitive compiled on its own), which `jax.jit` around the pass turns into
one compile.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile

import jax
import pytest

_EVENT = "/jax/core/compile/backend_compile_duration"
_stats: dict = collections.defaultdict(lambda: [0, 0.0])
_current: list = [None]


def _listener(event, duration, **_):
    if event == _EVENT and _current[0] is not None:
        entry = _stats[_current[0]]
        entry[0] += 1
        entry[1] += duration


jax.monitoring.register_event_duration_secs_listener(_listener)


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    """The controller makes a fresh folder for each process's share; xdist workers, started
    after this, find it through the environment."""
    if not _is_worker(config):
        os.environ["COMPILE_STATS_SHARDS"] = tempfile.mkdtemp(prefix="compile_stats_")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    yield
    _current[0] = None


def pytest_sessionfinish(session):
    name = session.config.workerinput["workerid"] if _is_worker(session.config) else "main"
    with open(os.path.join(os.environ["COMPILE_STATS_SHARDS"], f"{name}.json"), "w") as f:
        json.dump(dict(_stats), f)


def pytest_terminal_summary(terminalreporter, config):
    if _is_worker(config):
        return
    shards = os.environ["COMPILE_STATS_SHARDS"]
    merged: dict = {}
    for name in sorted(os.listdir(shards)):
        with open(os.path.join(shards, name)) as f:
            merged.update(json.load(f))
    shutil.rmtree(shards)
    out = os.environ.get("COMPILE_STATS", "compile_stats.json")
    with open(out, "w") as f:
        json.dump(dict(sorted(merged.items(), key=lambda kv: -kv[1][1])), f, indent=1)
    total = sum(v[1] for v in merged.values())
    tr = terminalreporter
    tr.section("XLA compilation per test")
    tr.write_line(f"{sum(v[0] for v in merged.values())} compiles, {total:.0f} s in all "
                  f"(summed over workers); every test in {out}")
    tr.write_line("by seconds:")
    for k, (n, s) in sorted(merged.items(), key=lambda kv: -kv[1][1])[:15]:
        tr.write_line(f"  {s:6.2f} s {n:5d}  {k}")
    tr.write_line("by count (many cheap compiles: an eager pass?):")
    for k, (n, s) in sorted(merged.items(), key=lambda kv: -kv[1][0])[:15]:
        tr.write_line(f"  {n:5d} {s:6.2f} s  {k}")
