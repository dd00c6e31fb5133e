"""XLA:CPU flags that make compiles cheaper: the test suite's (tests/conftest.py sets them
for every test) and a `--quick` bench's training runs' (`hpnlp.bench.compress`), where
compiling, not running, is most of the time. They change how fast the compiled code runs,
not which operations it computes (the emitters may round the last bits differently). They
must be in XLA_FLAGS before the process's JAX backend starts; this module imports no JAX.
"""

import importlib.metadata

# The third flag makes XLA:CPU emit its loop fusions with the elemental IR emitter instead of
# the MLIR fusion emitters: 2.3x less compile time on a 2-core EPYC Zen 3 (a tiny training test
# 6.5 -> 2.5 s; 39.6 -> 17.3 s of compiles in four heavy tests), the same operations (the
# last bits may round differently). XLA aborts on a flag it does not know, and newer XLA
# dropped this one: jaxlib 0.11.2 (a lent GPU machine's, 2026-11-26) aborted every test
# worker at start ("Unknown flags in XLA_FLAGS"). So it is passed only to the jaxlib versions
# known to take it (setup.py pins one of them).
FUSION_EMITTER_FLAG = "--xla_cpu_use_fusion_emitters=false"
FUSION_EMITTER_JAXLIB = ("0.10.2",)
# The fourth compiles each program's LLVM module in one piece instead of splitting it for
# parallel code generation: the suite's programs are tiny and its workers already keep every
# core busy, so the split was overhead. Compiling four tiny training runs in fresh
# processes (cheap flags, no cache), alternated three times on a 2-core EPYC Zen 3: 10.5 ->
# 7.9 s of XLA compiles (median; each pair 11.1 -> 9.8, 10.5 -> 7.9, 8.9 -> 7.3 s), the
# same code. Passed with the same jaxlib versions as the emitter flag.
CODEGEN_SPLIT_FLAG = "--xla_cpu_parallel_codegen_split_count=1"


def cheap_compile_flags(jaxlib_version: str | None = None) -> tuple[str, ...]:
    """The cheap-compile XLA flags for this (or the given) jaxlib."""
    if jaxlib_version is None:
        try:
            jaxlib_version = importlib.metadata.version("jaxlib")
        except importlib.metadata.PackageNotFoundError:
            jaxlib_version = ""
    extra = ((FUSION_EMITTER_FLAG, CODEGEN_SPLIT_FLAG) if jaxlib_version in FUSION_EMITTER_JAXLIB
             else ())
    return ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
            *extra)


def with_flags(xla_flags: str, flags) -> str:
    """`xla_flags` plus each of `flags` it does not hold yet (xdist workers inherit the
    controller's XLA_FLAGS, and read conftest.py again)."""
    have = xla_flags.split()
    return " ".join(have + [f for f in flags if f not in have])
