"""The suite's cheap-compile XLA flags (set by conftest.py) and an environment without
them, for subprocesses that must compile as users do (XLA's full optimization)."""

import os

from hpnlp.compile_flags import (  # noqa: F401 (the suite's, defined there)
    CODEGEN_SPLIT_FLAG,
    FUSION_EMITTER_FLAG,
    FUSION_EMITTER_JAXLIB,
    cheap_compile_flags,
    with_flags,
)


def full_optimization_env(*drop: str, **extra: str) -> dict:
    """os.environ plus `extra`, without the cheap-compile flags (nor flags starting with any
    of `drop`) and without the suite's compilation cache."""
    env = dict(os.environ, **extra)
    gone = tuple(f.split("=")[0] for f in (*cheap_compile_flags(), FUSION_EMITTER_FLAG,
                                           CODEGEN_SPLIT_FLAG)) + drop
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(gone))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env
