"""The suite's cheap-compile XLA flags (set by conftest.py) and an environment without
them, for subprocesses that must compile as users do (XLA's full optimization)."""

import os

CHEAP_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def full_optimization_env(*drop: str, **extra: str) -> dict:
    """os.environ plus `extra`, without the cheap-compile flags (nor flags starting with any
    of `drop`) and without the suite's compilation cache."""
    env = dict(os.environ, **extra)
    gone = tuple(f.split("=")[0] for f in CHEAP_COMPILE_FLAGS) + drop
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(gone))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env
