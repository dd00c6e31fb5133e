"""Workarounds for defects in the XLA that hpnlp is pinned to, applied when hpnlp is imported.

Each one is a documented defect with a reproduction in `docs/xla_defects.md`, limited to
the jaxlib versions and CPUs it was seen on, and switched off with
`HPNLP_XLA_WORKAROUNDS=0` (to reproduce the defect, or once XLA is fixed).

**XLA:CPU over-reads a padded operand (jaxlib 0.10.2 and 0.11.2 on AVX-512 CPUs).** A loop fusion
that pads (or slices the transpose of) an elementwise result loads the operand as if it
had the output's length: LLVM turns the fusion's correct masked loads into full-width
loads that feed masked arithmetic, so the code reads up to (output - operand) elements
past the operand's buffer. Where that buffer ends at an unmapped page the process dies
with SIGSEGV. The sampled softmax's backward (a slice of one gather of targets and
negatives, transposed into a pad) hit this at V = 262,144 (issue 19). AVX2 has no masked
arithmetic to fold the loads into, so capping XLA's code generation at AVX2
(`--xla_cpu_max_isa=AVX2`) removes the whole class. XLA already prefers 256-bit vectors
on these CPUs; the byte LM trains at the same speed either way (docs/xla_defects.md).
The kernels hpnlp compiles itself (`hpnlp.kernels`) are not affected and keep AVX-512.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import warnings

# jaxlib versions on which the pad over-read was reproduced (docs/xla_defects.md): 0.11.2
# on the 16-core host of a lent GPU machine, its CPU backend, by the suite's repro test.
PAD_OVERREAD_JAXLIB = ("0.10.2", "0.11.2")
ISA_FLAG = "--xla_cpu_max_isa=AVX2"
APPLIED: list[str] = []  # the flags `apply()` added in this process


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def _backend_started() -> bool:
    """Whether JAX has already created its backends (XLA_FLAGS is read then, once)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:  # a JAX without this private name: assume the flags may still apply
        return False


def pad_overread_flag() -> str | None:
    """The XLA flag this process needs against the pad over-read, or None.

    None when: workarounds are off, the user chose an ISA cap themselves, the jaxlib is not
    one the defect was seen on, or the CPU has no AVX-512.
    """
    if os.environ.get("HPNLP_XLA_WORKAROUNDS", "1") == "0":
        return None
    if "--xla_cpu_max_isa" in os.environ.get("XLA_FLAGS", ""):
        return None
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return None
    if version not in PAD_OVERREAD_JAXLIB or "avx512f" not in cpu_flags():
        return None
    return ISA_FLAG


def apply() -> list[str]:
    """Add the needed XLA flags to XLA_FLAGS (child processes inherit them); returns them."""
    flag = pad_overread_flag()
    if flag is None:
        return []
    if _backend_started():
        warnings.warn(
            f"hpnlp was imported after JAX started its CPU backend, so it cannot add {flag}, "
            "which avoids a segmentation fault of jaxlib 0.10.2 on AVX-512 CPUs "
            "(docs/xla_defects.md); import hpnlp before running any JAX computation, or set "
            f"XLA_FLAGS='{flag}' yourself", RuntimeWarning, stacklevel=3)
        return []
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    APPLIED.append(flag)
    return [flag]
