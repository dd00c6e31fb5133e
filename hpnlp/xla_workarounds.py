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
`HPNLP_ISA_WORKAROUND=0` skips this one alone (`=1` keeps it with `HPNLP_XLA_WORKAROUNDS=0`):
tools/xla_workaround_ab.py times it so, the other settings alike in both arms.

**XLA:CPU faults its buffers in again on every call (performance).** XLA:CPU allocates each
call's temporaries (one block: 134 MB for the default byte LM's train step) and outputs
with `malloc`, and frees them when the call ends. glibc serves blocks that large with a
fresh `mmap` and returns them with `munmap`, so every call takes a page fault (and a zeroed
page from the kernel) for each 4 KiB it touches: 32,700 faults in every byte-LM train
step, whose time falls 1.3x without them (`tools/malloc_ab.py`). Importing hpnlp sets
glibc's malloc to keep freed memory for reuse instead (`mallopt`: one arena, heap rather
than `mmap` for large blocks, no trimming), which takes the faults to zero after the first
few calls. Only with glibc, only where JAX runs on the CPU (no accelerator plugin
installed, `JAX_PLATFORMS` unset or naming cpu first), and not where the user tuned malloc
themselves (`GLIBC_TUNABLES`, `MALLOC_*_` variables or an `LD_PRELOAD`ed allocator). The
cost is memory: freed memory stays with the process, and peak RSS rose 1.2x to 2x on the
steps measured. `HPNLP_MALLOC_WORKAROUND=0` skips this one alone (`=1` keeps it with
`HPNLP_XLA_WORKAROUNDS=0`).

**XLA:CPU's cached multi-device programs can deadlock (hang, then abort).** On several CPU
devices a program loaded from JAX's persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`)
can fill XLA's thread pool with collectives waiting on each other (by XLA's source, the
cache's copy no longer orders the collectives inside its loops against the others): XLA
aborts after 40 s ("Termination timeout for `all reduce` ... only 2 of them arrived").
Freshly compiled, the same program runs. A process that asks for several CPU devices
(`--xla_force_host_platform_device_count=N` in XLA_FLAGS, or `JAX_NUM_CPU_DEVICES=N`, N > 1)
on jaxlib 0.10.2 runs with the cache off (`jax_enable_compilation_cache=False`): it
compiles its programs afresh.
`HPNLP_CACHE_WORKAROUND=0` skips this one alone (`=1` keeps it with
`HPNLP_XLA_WORKAROUNDS=0`).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys
import warnings

from hpnlp.compile_flags import with_flags, xla_reads

# jaxlib versions on which the pad over-read was reproduced (docs/xla_defects.md): 0.11.2
# on the 16-core host of a lent GPU machine, its CPU backend, by the suite's repro test.
PAD_OVERREAD_JAXLIB = ("0.10.2", "0.11.2")
# jaxlib versions whose programs loaded from JAX's persistent compilation cache can deadlock
# on several CPU devices (docs/xla_defects.md: the cache's copy loses the order of its
# collectives; seen on 0.10.2)
CACHED_COLLECTIVES_JAXLIB = ("0.10.2",)
CACHE_SETTING = "jax_enable_compilation_cache=False"
ISA_FLAG = "--xla_cpu_max_isa=AVX2"
APPLIED: list[str] = []  # the flags, malloc and cache settings `apply()` made in this process
# glibc's mallopt parameters (malloc.h) and the values the re-fault workaround gives them:
# every thread allocates from the one heap (other arenas' heaps cannot hold blocks over
# 64 MB and map them instead), large blocks come from that heap instead of their own
# mmap, and free() never gives its top back to the kernel (the default trims above 128 KiB).
MALLOPT = {"M_ARENA_MAX": (-8, 1), "M_MMAP_MAX": (-4, 0), "M_TRIM_THRESHOLD": (-1, 2**31 - 1)}
# Installed distributions that give JAX a device other than the CPU (the workaround was
# measured on CPU-only machines).
ACCELERATOR_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu")


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


OFF = ("0", "false", "off", "no")


def switched_off(name: str = "HPNLP_XLA_WORKAROUNDS") -> bool:
    """Whether the workaround switch `name` (or, where it is unset or empty, the global
    HPNLP_XLA_WORKAROUNDS) says 0, false, off or no, as HPNLP_KERNEL_TUNE reads them (a
    review, session 115: only an exact "0" turned a workaround off, and an empty
    HPNLP_ISA_WORKAROUND= shadowed HPNLP_XLA_WORKAROUNDS=0)."""
    value = os.environ.get(name, "").strip() or os.environ.get("HPNLP_XLA_WORKAROUNDS", "")
    return value.strip().lower() in OFF


def pad_overread_flag() -> str | None:
    """The XLA flag this process needs against the pad over-read, or None.

    None when: it is switched off (`HPNLP_ISA_WORKAROUND=0`, or `HPNLP_XLA_WORKAROUNDS=0`
    unless `HPNLP_ISA_WORKAROUND=1`), the user chose an ISA cap themselves (where XLA reads it:
    one after a bare token in XLA_FLAGS is ignored by XLA, so it caps nothing; review d2), the
    jaxlib is not one the defect was seen on, or the CPU has no AVX-512.
    """
    if switched_off("HPNLP_ISA_WORKAROUND"):
        return None
    read, _ = xla_reads(os.environ.get("XLA_FLAGS", ""))
    if any(f.split("=", 1)[0] == "--xla_cpu_max_isa" for f in read):
        return None
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return None
    if version not in PAD_OVERREAD_JAXLIB or "avx512f" not in cpu_flags():
        return None
    return ISA_FLAG


def host_devices() -> int:
    """The CPU devices this process asks for: `JAX_NUM_CPU_DEVICES` (JAX's
    `jax_num_cpu_devices`, which JAX gives the CPU client in place of the flag), else
    XLA_FLAGS' `--xla_force_host_platform_device_count` (where XLA reads it), else 1. Once
    JAX is imported its config comes first: it holds the variable as read at import, and a
    later `jax.config.update` replaces it, which the CPU client then takes (a review,
    session 118: the variable was read first, so code asking for 8 over an exported 1 kept
    the cache on for 8 devices)."""
    if "jax" in sys.modules:  # set in code, `jax.config.update("jax_num_cpu_devices", N)`
        # (a review, session 117: read from the environment alone, missed)
        n = getattr(sys.modules["jax"].config, "jax_num_cpu_devices", -1)
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:  # (JAX's -1: unset)
            return max(n, 1)
    env = os.environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    if env.isdigit():
        return max(int(env), 1)
    read, _ = xla_reads(os.environ.get("XLA_FLAGS", ""))
    n = 1
    for f in read:
        name, _, value = f.partition("=")
        if name == "--xla_force_host_platform_device_count" and value.strip().isdigit():
            n = int(value)
    return n


def cache_workaround_wanted() -> bool:
    """Whether this process should keep its programs out of JAX's persistent compilation
    cache: it asks for several CPU devices (`host_devices`; on a machine with an accelerator
    too, as the test suite's `JAX_PLATFORMS=cuda,cpu` runs meshes of CPU devices), with a
    jaxlib whose cached multi-device programs can deadlock, and it is not switched off
    (`HPNLP_CACHE_WORKAROUND=0`, or `HPNLP_XLA_WORKAROUNDS=0` unless
    `HPNLP_CACHE_WORKAROUND=1`)."""
    if switched_off("HPNLP_CACHE_WORKAROUND") or host_devices() <= 1:
        return False
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return False
    return version in CACHED_COLLECTIVES_JAXLIB


def _user_tuned_malloc() -> str | None:
    """The environment variable by which the user chose their own malloc settings, if any."""
    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    for name in os.environ:
        if name.startswith("MALLOC_"):  # MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, ...
            return name
    if any(k in os.environ.get("LD_PRELOAD", "") for k in ("malloc", "jemalloc", "tcmalloc")):
        return "LD_PRELOAD"
    return None


def _accelerator_plugin() -> str | None:
    """What gives JAX a device other than the CPU in this process, if anything."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:  # the user's choice: JAX runs on its first entry
        first = platforms.split(",")[0].strip()
        return None if first == "cpu" else f"JAX_PLATFORMS={platforms}"
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(ACCELERATOR_PLUGINS):
            return name
    return None


def _glibc():
    """The C library, if it is glibc (it has the mallopt this workaround calls); else None."""
    try:
        libc = ctypes.CDLL(None)  # the process's own C library (find_library would fork)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def malloc_workaround_wanted() -> bool:
    """Whether importing hpnlp should keep freed memory for reuse (`reuse_freed_memory`):
    not where it is switched off (`HPNLP_MALLOC_WORKAROUND=0`, or `HPNLP_XLA_WORKAROUNDS=0`
    unless `HPNLP_MALLOC_WORKAROUND=1`), malloc was tuned by the user, JAX has an
    accelerator, or the C library is not glibc."""
    if switched_off("HPNLP_MALLOC_WORKAROUND"):
        return False
    # cheapest first: the plugin check reads every installed distribution's metadata
    return not (_glibc() is None or _user_tuned_malloc() or _accelerator_plugin())


def reuse_freed_memory() -> list[str]:
    """Set glibc's malloc to keep freed memory for reuse (the `MALLOPT` settings), whatever
    the environment says; returns the settings glibc accepted as `NAME=value` strings
    (empty where the C library is not glibc). Importing hpnlp calls this where
    `malloc_workaround_wanted()`; benchmarks call it themselves so that every row, XLA's
    included, is timed without the re-faults."""
    libc = _glibc()
    if libc is None:
        return []
    return [f"{name}={value}" for name, (param, value) in MALLOPT.items()
            if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1]


def malloc_reused() -> bool:
    """Whether importing hpnlp set malloc to keep freed memory (`apply`)."""
    return any(a.startswith("M_") for a in APPLIED)


def apply() -> list[str]:
    """Set malloc against re-faulting (once per process), add the needed XLA flags to
    XLA_FLAGS (child processes inherit them), and keep a process on several simulated CPU
    devices out of the persistent compilation cache; returns what this call did."""
    done = []
    started = _backend_started()
    # After JAX started, its threads keep the malloc arenas they took (and their re-faults):
    # the setting would cost its memory for little of its gain.
    if not started and not malloc_reused() and malloc_workaround_wanted():
        done += reuse_freed_memory()
    flag = pad_overread_flag()
    if flag is not None and started:
        warnings.warn(
            f"hpnlp was imported after JAX started its CPU backend, so it cannot add {flag}, "
            "which avoids a segmentation fault of jaxlib 0.10.2 on AVX-512 CPUs "
            "(docs/xla_defects.md); import hpnlp before running any JAX computation, or set "
            f"XLA_FLAGS='{flag}' yourself", RuntimeWarning, stacklevel=3)
    elif flag is not None:
        try:  # before any token XLA stops reading at (appended after it, XLA drops the flag)
            os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), [flag])
            done.append(flag)
        except ValueError:  # a file of flags: XLA would not read the value as flags at all
            warnings.warn(
                f"XLA_FLAGS names a file of flags (it does not start with '-'), so hpnlp cannot "
                f"add {flag}, which avoids a segmentation fault of this jaxlib on AVX-512 CPUs "
                f"(docs/xla_defects.md); add {flag} to that file", RuntimeWarning, stacklevel=3)
    APPLIED.extend(done)
    return done + guard_cache()  # (which records its own in APPLIED)


def guard_cache() -> list[str]:
    """Keep this process out of JAX's persistent compilation cache where it asks for several
    CPU devices (`cache_workaround_wanted`), once: at `import hpnlp`, and again where a mesh
    is made (`hpnlp.parallel.make_mesh`; a review, session 117: devices asked for after the
    import, by XLA_FLAGS or jax.config, left the cache on). Returns what it did."""
    done = []
    if CACHE_SETTING not in APPLIED and cache_workaround_wanted():
        import jax  # (reads no XLA flag: the backend starts at the first computation)
        jax.config.update("jax_enable_compilation_cache", False)
        try:  # JAX decides at its first compile whether to use the cache, and keeps that
            # answer: after a computation before `import hpnlp`, the setting alone did nothing
            from jax._src import compilation_cache
            compilation_cache.reset_cache()
        except (ImportError, AttributeError):  # a JAX without them: asks again, or never did
            pass
        done.append(CACHE_SETTING)
        APPLIED.append(CACHE_SETTING)
    return done
