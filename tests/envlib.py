"""The suite's cheap-compile XLA flags (set by conftest.py) and an environment without
them, for subprocesses that must compile as users do (XLA's full optimization)."""

import os

# The third flag makes XLA:CPU emit its loop fusions with the elemental IR emitter instead of
# the MLIR fusion emitters: 2.3x less compile time on a 2-core EPYC Zen 3 (a tiny training test
# 6.5 -> 2.5 s; 39.6 -> 17.3 s of compiles in four heavy tests), the same operations (the
# last bits may round differently). jaxlib is pinned (setup.py); XLA aborts on a flag it
# does not know, so a new jaxlib must still have this one.
CHEAP_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                       "--xla_cpu_use_fusion_emitters=false")


def full_optimization_env(*drop: str, **extra: str) -> dict:
    """os.environ plus `extra`, without the cheap-compile flags (nor flags starting with any
    of `drop`) and without the suite's compilation cache."""
    env = dict(os.environ, **extra)
    gone = tuple(f.split("=")[0] for f in CHEAP_COMPILE_FLAGS) + drop
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(gone))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env
