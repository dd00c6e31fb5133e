"""The suite's cheap-compile XLA flags (set by conftest.py) and an environment without
them, for subprocesses that must compile as users do (XLA's full optimization); what
tests that start `python -m hpnlp.main` processes share (a free port, a run's losses)."""

import importlib.util
import json
import os
import pathlib
import socket

# hpnlp/compile_flags.py, loaded by its path rather than imported from the package: importing
# hpnlp in pytest's controller (conftest.py reads this first) would apply hpnlp's XLA
# workarounds there, so the workers would inherit them in XLA_FLAGS instead of applying
# them (tests/test_xla_workarounds.py reads which a process applied), and the controller
# would load flax and the rest before it starts any worker
_spec = importlib.util.spec_from_file_location(
    "_hpnlp_compile_flags",
    pathlib.Path(__file__).resolve().parents[1] / "hpnlp" / "compile_flags.py")
_flags = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_flags)
CODEGEN_SPLIT_FLAG, FUSION_EMITTER_FLAG = _flags.CODEGEN_SPLIT_FLAG, _flags.FUSION_EMITTER_FLAG
FUSION_EMITTER_JAXLIB = _flags.FUSION_EMITTER_JAXLIB
cheap_compile_flags, with_flags = _flags.cheap_compile_flags, _flags.with_flags


def full_optimization_env(*drop: str, **extra: str) -> dict:
    """os.environ plus `extra`, without the cheap-compile flags (nor flags starting with any
    of `drop`) and without the suite's compilation cache."""
    env = dict(os.environ, **extra)
    gone = tuple(f.split("=")[0] for f in (*cheap_compile_flags(), FUSION_EMITTER_FLAG,
                                           CODEGEN_SPLIT_FLAG)) + drop
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(gone))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a coordinator's, for local processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_losses(workdir) -> list[tuple[int, float]]:
    """(step, loss) of each train line of the run's metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(x["step"], x["loss"]) for x in map(json.loads, f) if not x.get("eval")]
