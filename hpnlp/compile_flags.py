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


_WHITESPACE = " \t\r\n"  # what XLA's flag parser skips between flags


def xla_reads(xla_flags: str) -> tuple[list[str], str]:
    """`xla_flags` (an XLA_FLAGS value that starts with '-') split as XLA splits it
    (`ParseArgvFromString`, xla/parse_flags_from_env.cc): the flags it reads, and the rest,
    which it ignores without a word. XLA stops at the first token that does not start with
    '-' (`intra_op_parallelism_threads=1`, a TensorFlow session option, is one). A quoted
    value (`--flag="a b"`) belongs to its flag."""
    def skip(i):  # the first index at or after i that is not whitespace
        while i < len(xla_flags) and xla_flags[i] in _WHITESPACE:
            i += 1
        return i

    read, b = [], skip(0)
    while b < len(xla_flags) and xla_flags[b] == "-":
        e = b  # past the flag's name: ASCII letters, digits, '-' and '_'
        while e < len(xla_flags) and xla_flags[e].isascii() and (
                xla_flags[e].isalnum() or xla_flags[e] in "-_"):
            e += 1
        if xla_flags[e:e + 1] == "=" and xla_flags[e + 1:e + 2] in ("'", '"'):
            quote, e = xla_flags[e + 1], e + 2
            while e < len(xla_flags) and xla_flags[e] != quote:
                e += 2 if quote == '"' and xla_flags[e] == "\\" else 1  # an escaped character
            e = min(e + 1, len(xla_flags))  # past the closing quote
        else:
            while e < len(xla_flags) and xla_flags[e] not in _WHITESPACE:
                e += 1
        read.append(xla_flags[b:e])
        b = skip(e)
    return read, xla_flags[b:].rstrip(_WHITESPACE)


def with_flags(xla_flags: str, flags) -> str:
    """`xla_flags` plus each of `flags` that XLA does not read in it yet (xdist workers inherit
    the controller's XLA_FLAGS, and read conftest.py again). They go before the first token
    XLA would not read (`xla_reads`): appended after it, XLA would drop them silently. A
    value that does not start with '-' is to XLA the name of a file of flags: refused."""
    if xla_flags.strip(_WHITESPACE) and not xla_flags.lstrip(_WHITESPACE).startswith("-"):
        raise ValueError(
            f"XLA_FLAGS={xla_flags!r} does not start with '-', so XLA reads it as the name of a "
            f"file of flags, and hpnlp cannot add {' '.join(flags)} to it: put those flags in "
            "that file, or give XLA_FLAGS the flags themselves (each starting with '--')")
    read, ignored = xla_reads(xla_flags)
    return " ".join(read + [f for f in flags if f not in read] + ([ignored] if ignored else []))
