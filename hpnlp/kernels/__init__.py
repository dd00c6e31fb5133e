"""hpnlp's hand-written CPU kernels: C++ sources compiled on first use, as XLA FFI targets.

    kernel = CpuKernel("hpnlp/attention/flash_cpu.cc", {"ffi_target": "HandlerSymbol"},
                       what="flash attention")
    if kernel.available():
        jax.ffi.ffi_call("ffi_target", ...)

A source is compiled with the machine's `g++` (`-O3 -march=native`) against the XLA FFI
headers that ship with jaxlib and this folder's `simd.h`, and cached in
`HPNLP_KERNEL_CACHE` (default `~/.cache/hpnlp/kernels`), keyed by the sources, the compiler
(`$CXX`'s whole command, its resolved path and its `--version`), jaxlib (its version and a
digest of its FFI headers), the flags and the CPU (its model, stepping and cache size as well
as its feature flags: `-march=native` tunes for all of them). A file lock keeps concurrent
processes (test workers) from building the same library twice. Where there is no compiler or
the backend is not a CPU, `available()` is False and `unavailable_reason()` says why; callers
then use their XLA twin.

`-march=native` lets a source choose its instructions by the CPU's features at build time
(`#if defined(__AVX512BF16__)`, ...), with a portable path where a feature is missing.
`HPNLP_KERNEL_MARCH` replaces `native` (`x86-64-v3`: AVX2 without AVX-512), which is how
the tests run the portable paths on a machine that has the features. A value the compiler
rejects, or one that enables an instruction set this CPU lacks (its ISA macros against
`-march=native`'s), is an error naming it (a warning once, where a kernel falls back). Block
sizes are chosen per CPU by a short measurement on first use (`hpnlp.kernels.tuning`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import glob
import hashlib
import math
import operator
import os
import platform
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

HEADER_DIR = os.path.dirname(os.path.abspath(__file__))
_HEADERS = [os.path.join(HEADER_DIR, "simd.h")]
# -fno-semantic-interposition: simd.h's helpers are called directly, not through the PLT
# (an out-of-line `store` called through it spilled every live vector around the call).
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=fast",
         "-fno-math-errno", "-fno-semantic-interposition"]


def march() -> str:
    """The -march the kernels are built for: `native` unless HPNLP_KERNEL_MARCH says."""
    return os.environ.get("HPNLP_KERNEL_MARCH") or "native"


def flags() -> list[str]:
    return [*FLAGS, f"-march={march()}"]


class MarchError(RuntimeError):
    """HPNLP_KERNEL_MARCH names a -march the compiler rejects, or one this CPU cannot run."""


@functools.lru_cache(maxsize=None)
def _preprocess(cxx: tuple[str, ...], *options: str) -> subprocess.CompletedProcess | None:
    """`cxx` run with `options` on an empty file as the preprocessor (a few milliseconds,
    once per process), or None where it cannot run at all (the build names why)."""
    try:
        return subprocess.run([*cxx, *options, "-E", "-x", "c++", os.devnull, "-o",
                               os.devnull], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _march_error(cxx: tuple[str, ...], value: str) -> str | None:
    """Why `cxx` rejects `-march=value` (its message on one line), or None."""
    proc = _preprocess(cxx, f"-march={value}")
    if proc is None or proc.returncode == 0:
        return None
    plain = _preprocess(cxx)
    if plain is None or plain.returncode != 0:  # a bug hunt (session 102): a compiler that
        # fails without -march= too (CXX=/bin/false, a broken wrapper) blamed the variable,
        # and the build's "(no output; the compiler is ...)" was lost: the build names it
        return None
    said = [re.sub(r"^\S+: (?:fatal error|error|note): ", "", line.strip())
            for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    # a bug hunt (session 102): x86-64-v3 was offered on Arm too, where it is no -march
    hint = " (x86-64-v3: AVX2 without AVX-512)" if platform.machine() == "x86_64" else ""
    return (f"HPNLP_KERNEL_MARCH={value} is not a -march that {_compiler_name(list(cxx))} "
            f"accepts ({'; '.join(said)[:2000] or f'exit status {proc.returncode}'}); set it "
            f"to one it accepts{hint} or unset it (native)")


# The macros that name an instruction set a -march lets the compiler emit (x86's, then Arm's):
# __AVX512F__, __AMX_TILE__, __FMA__, __ARM_FEATURE_SVE. Not the CPU names (__znver3__,
# __tune_icelake_server__) nor system instructions (SGX, PCONFIG) that a VM hides from
# -march=native but that no kernel is compiled into.
_ISA_MACRO = re.compile(r"^#define __((?:AVX|AMX|EVEX|SSE|FMA|F16C|BMI|POPCNT|LZCNT|ADX|MOVBE|"
                        r"GFNI|VAES|VPCLMULQDQ|PCLMUL|ARM_FEATURE_|ARM_NEON)\w*?)(?:__)? ", re.M)


@functools.lru_cache(maxsize=None)
def _isa_macros(cxx: tuple[str, ...], value: str) -> frozenset[str] | None:
    """The instruction sets `cxx -march=value` enables, by their macros' names ("AVX512F",
    "AMX_TILE"): its preprocessor's definitions for an empty file (a few milliseconds, once
    per process); None where it cannot say."""
    try:
        proc = subprocess.run([*cxx, f"-march={value}", "-dM", "-E", "-x", "c++", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return frozenset(_ISA_MACRO.findall(proc.stdout)) if proc.returncode == 0 else None


def _isa_error(cxx: tuple[str, ...], value: str) -> str | None:
    """Why this CPU cannot run what `cxx -march=value` builds (the instruction sets it enables
    that `-march=native` does not), or None; None too where either cannot be preprocessed
    (the build, or the -march check, names why)."""
    want, have = _isa_macros(cxx, value), _isa_macros(cxx, "native")
    if want is None or have is None or want <= have:
        return None
    hint = " (x86-64-v3: AVX2 without AVX-512)" if "AVX2" in have else ""
    return (f"HPNLP_KERNEL_MARCH={value} enables {', '.join(sorted(want - have))}, which this "
            f"CPU ({cpu_name()}) lacks (its library would die of an illegal instruction); set "
            f"it to a -march this CPU runs{hint} or unset it (native)")


def check_march(cxx: list[str]) -> None:
    """MarchError where HPNLP_KERNEL_MARCH names a -march `cxx` rejects (a bug hunt (session
    102): `avx2` failed every build with the compiler's multi-line error, which impl="auto"
    hid, so every kernel ran its XLA twin without a word), or one that enables instructions
    this CPU lacks (found in review: `x86-64-v4` on an AVX2-only EPYC built and loaded, and
    its first AVX-512 instruction killed the process with SIGILL, no message, no twin)."""
    value = os.environ.get("HPNLP_KERNEL_MARCH")
    error = (_march_error(tuple(cxx), value) or _isa_error(tuple(cxx), value)) if value else None
    if error:
        raise MarchError(error)


# /proc/cpuinfo's fields that name the CPU a library is built and tuned for (x86's, then
# Arm's). A bug hunt (session 102): the flags alone keyed the cache, so two CPUs with the
# same flags but another model or cache size (Genoa and Genoa-X, two steppings of a Xeon)
# shared one -march=native library, tuned for the first, and one tuning record.
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "cache size",
               "flags", "CPU implementer", "CPU architecture", "CPU variant", "CPU part",
               "CPU revision", "Features")


def _read_cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The fields of `path`'s first processor block ({} where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if fields:  # the first block ends: one CPU model per machine
                        break
                    continue
                key, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        return {}
    return fields


@functools.lru_cache(maxsize=None)
def cpu_info() -> dict[str, str]:
    """This machine's /proc/cpuinfo fields (its first processor's), read once."""
    return _read_cpuinfo()


def _cpu_id() -> str:
    info = cpu_info()
    named = [f"{field}: {info[field]}" for field in _CPU_FIELDS if field in info]
    return "\n".join(named) if named else platform.processor()


def cpu_name() -> str:
    """The CPU as a person names it, with what tells its models apart: "AMD EPYC 9654
    96-Core Processor (AuthenticAMD family 25 model 17 stepping 1, cache size 1024 KB)"."""
    info = cpu_info()
    ids = " ".join(f"{label} {info[field]}".strip() for field, label in (
        ("vendor_id", ""), ("cpu family", "family"), ("model", "model"),
        ("stepping", "stepping"), ("CPU implementer", "implementer"), ("CPU part", "part"),
        ("CPU variant", "variant"), ("CPU revision", "revision")) if field in info)
    ids = ", ".join(x for x in (ids, info.get("cache size") and
                                f"cache size {info['cache size']}") if x)
    name = info.get("model name") or platform.processor() or platform.machine() or "a CPU"
    return f"{name} ({ids})" if ids else name


def cores() -> int:
    """CPU cores this process may run on: the default thread count of every kernel. The
    CPUs it may be scheduled on, fewer where its cgroup's CPU bandwidth is less (a container
    run with `docker --cpus=2`, or a Kubernetes CPU limit, keeps every CPU of its host in
    its affinity, and a kernel that split its work over 96 threads there would have them
    wait their turns on 2 cores' worth of time: a bug hunt, session 109)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(n, math.ceil(limit))) if limit is not None else n


def _cgroup_quota(directory: str) -> float | None:
    """The CPU bandwidth one cgroup directory sets, in cores (quota / period), or None:
    cgroup v2's `cpu.max` ("max 100000" or "200000 100000") or v1's `cpu.cfs_quota_us`
    (-1: none) over `cpu.cfs_period_us`."""
    try:
        with open(os.path.join(directory, "cpu.max")) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
    except OSError:
        try:
            with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        except OSError:
            return None
    try:
        quota_f, period_f = float(quota), float(period)
    except ValueError:  # "max"
        return None
    return quota_f / period_f if quota_f > 0 and period_f > 0 else None


@functools.lru_cache(maxsize=None)
def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
                     ) -> float | None:
    """The smallest CPU bandwidth limit, in cores, of this process's cgroup and its parents
    (v2, or v1's cpu controller), None where none is set or cgroups cannot be read. Its path
    in `self_cgroup` is looked for under the mount (where a container sees its own cgroup as
    the mount's root, the path there is the host's and is not found: the root's own limit
    is read then)."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    mounts = []  # (mount directory, this process's path under it)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy (under unified/ on hybrid hosts)
            mounts += [(root, path), (os.path.join(root, "unified"), path)]
        elif "cpu" in controllers.split(","):
            mounts += [(os.path.join(root, controllers), path), (os.path.join(root, "cpu"), path)]
    limits = []
    for mount, path in mounts:
        if not os.path.isdir(mount):
            continue
        here = os.path.normpath(os.path.join(mount, path.lstrip("/")))
        if not os.path.isdir(here) or os.path.commonpath([here, mount]) != mount:
            here = mount
        while True:
            quota = _cgroup_quota(here)
            if quota is not None:
                limits.append(quota)
            if here == mount:
                break
            here = os.path.dirname(here)
    return min(limits) if limits else None


def is_integer(x) -> bool:
    """Whether x is an integer (Python's, NumPy's, anything with __index__), not a bool: what
    the kernels' wrappers take for a thread count or a block size."""
    try:
        operator.index(x)
    except TypeError:
        return False
    return not isinstance(x, (bool, np.bool_))


def with_twin_gradient(kernel, twin, *args):
    """`kernel(*args)`, differentiated as `twin(*args)`: an FFI call has no derivative of
    its own, and a kernel's XLA twin computes the same function, so its derivatives are the
    twin's (what `impl="xla"` differentiates), and `impl="auto"` has the same ones whether
    or not the kernel runs: a `custom_jvp`, so forward mode (`jax.jvp`, `jacfwd`) and
    higher orders work as well as `jax.grad` (found in review: a `custom_vjp` took first-order
    reverse mode only). `args` are pytrees of arrays (None allowed); settings go in the two
    functions' closures, never traced values."""
    @jax.custom_jvp
    def call(*a):
        return kernel(*a)

    def jvp(primals, tangents):
        # the twin differentiated in the leaves that have a tangent only: symbolic zeros
        # (a weight closed over) would otherwise be instantiated, and the twin's product
        # of zeros computed (found in review: one wasted matmul in forward mode)
        flat_p, tree = jax.tree.flatten(primals)
        flat_t = jax.tree.leaves(tangents, is_leaf=lambda t: isinstance(t, SymbolicZero))
        live = [i for i, t in enumerate(flat_t) if not isinstance(t, SymbolicZero)]
        out = call(*primals)
        if not live:
            return out, jnp.zeros_like(out)

        def part(*xs):
            full = list(flat_p)
            for i, x in zip(live, xs):
                full[i] = x
            return twin(*jax.tree.unflatten(tree, full))

        return out, jax.jvp(part, [flat_p[i] for i in live], [flat_t[i] for i in live])[1]

    call.defjvp(jvp, symbolic_zeros=True)
    return call(*args)


def _cxx() -> list[str]:
    """$CXX split as a shell would; RuntimeError (which every kernel's fallback reads as its
    reason) where it cannot be (a review, session 118: an unbalanced quote's ValueError
    escaped the fallbacks, and every `impl="auto"` layer failed naming nothing)."""
    raw = os.environ.get("CXX", "")
    try:
        return shlex.split(raw)
    except ValueError as e:
        raise RuntimeError(f"$CXX={raw!r} cannot be split as a shell would ({e}); fix its "
                           "quoting, or unset it") from None


def compiler() -> list[str]:
    """The C++ compiler's command: $CXX split as a shell would (`ccache g++`), else the
    machine's g++ or c++; RuntimeError where there is none."""
    cxx = _cxx() or [shutil.which("g++") or shutil.which("c++")]
    if cxx[0] is None:
        raise RuntimeError("no C++ compiler found (install g++, or set CXX)")
    return cxx


def _compiler_name(cxx: list[str]) -> str:
    """The compiler as messages name it: `$CXX=...` where the environment chose it."""
    named = " ".join(cxx)
    return f"$CXX={named}" if os.environ.get("CXX", "").strip() else named


@functools.lru_cache(maxsize=None)
def _compiler_identity(cxx: tuple[str, ...], resolved: str) -> str:
    """The compiler as a library's key names it: the program its command runs (`resolved`,
    with links followed: `CXX=g++` and no CXX name one compiler), the rest of the command
    (flags in $CXX, such as `-O0 -g` or `-fsanitize=address`, change the library) and its
    release (`--version`'s first line; "" where it prints none): one short run per command
    and process."""
    try:
        proc = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60)
        release = (proc.stdout.strip().splitlines() or [""])[0] if proc.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        release = ""
    return "\n".join([resolved, shlex.join(cxx[1:]), release])


def compiler_key() -> str:
    """What names the compiler in a library's key (`_compiler_identity`); "" where there is
    none (a build then says so). Found in review: the key left out $CXX, so a library built by
    `CXX="g++ -fsanitize=address"` or `-O0`, or by an older g++, was the one every later
    process loaded, and a new compiler or flags rebuilt nothing."""
    try:
        cxx = compiler()
    except RuntimeError:
        return ""
    found = shutil.which(cxx[0])
    return _compiler_identity(tuple(cxx), os.path.realpath(found) if found else cxx[0])


@functools.lru_cache(maxsize=None)
def ffi_key(include_dir: str) -> str:
    """What names jaxlib in a library's key: its version and a digest of the FFI headers the
    library is compiled against (`include_dir`'s files), read once. Found in review: the key
    held jax's version, though jax runs with an older jaxlib than itself, whose headers
    differ."""
    import jaxlib
    digest = hashlib.sha256(jaxlib.__version__.encode())
    for root, dirs, files in sorted(os.walk(include_dir)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, include_dir).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read())
    return f"jaxlib {jaxlib.__version__} {digest.hexdigest()}"


def compile_library(source: str, out: str, header_dir: str = HEADER_DIR) -> None:
    """Compile `source` into the shared library `out` with the kernels' flags, against the
    XLA FFI headers and `header_dir`'s simd.h (tools/kernel_ab.py passes another revision's)."""
    cxx = compiler()
    check_march(cxx)
    cmd = [*cxx, *flags(), "-I", jax.ffi.include_dir(), "-I", header_dir, source, "-o", out]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # CXX names no program this process can run
        raise RuntimeError(f"cannot run the C++ compiler {' '.join(cxx)!r} ({e}); install g++, "
                           "or set CXX to a compiler") from e
    if proc.returncode != 0:  # a bug hunt (session 97): a compiler that printed nothing
        # (CXX=/bin/false) was a message ending in an empty line
        status = (f"exit status {proc.returncode}" if proc.returncode > 0
                  else f"killed by signal {-proc.returncode}")
        said = (proc.stderr.strip() or proc.stdout.strip())[-2000:] or (
            f"(no output; the compiler is {_compiler_name(cxx)})")
        raise RuntimeError(f"compiling {source} failed ({status}; {' '.join(cmd)}):\n{said}")
    if not _whole_library(out):  # a bug hunt (session 97): CXX=/bin/true left an empty
        # file in the cache, which was then loaded (and failed) in every later process
        size = os.path.getsize(out) if os.path.exists(out) else 0
        raise RuntimeError(f"compiling {source} with {_compiler_name(cxx)} exited 0 but wrote "
                           f"no whole library ({out}: {size} bytes); set CXX to a C++ "
                           "compiler (g++)")


def readable_mode(mode: int) -> int:
    """`mode` less this process's umask: what a plain `open` gives a new file, where
    `mkstemp` gives 0600 whatever the umask (a bug hunt (session 97): the cache's libraries
    were 0711 and its tuning files 0600, so a cache shared between users could not work)."""
    try:
        with open("/proc/self/status") as f:  # read, not set: other threads create files
            umask = next((int(line.split()[1], 8) for line in f if line.startswith("Umask:")),
                         None)
    except (OSError, ValueError, IndexError):
        umask = None
    if umask is None:  # not Linux, or a kernel before 4.7: set and restore it
        umask = os.umask(0o077)
        os.umask(umask)
    return mode & ~umask


def _whole_library(path: str) -> bool:
    """Whether `path` holds a whole shared library: its ELF section table (which the linker
    writes last) ends within the file. A library cut short (a copy of the cache that ran out
    of space) killed the process in the loader with a bus error, no message (a bug hunt,
    session 90); one that is not ELF at all (zeros a crash left after the rename, a damaged
    copy) is no build of ours either (a review, session 114: left to the loader, it was never
    rebuilt, and impl="auto" ran the XLA twins for good, silently)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return False
    if not b"\x7fELF".startswith(head[:4]):  # not ELF: rebuilt where libraries are ELF
        return not sys.platform.startswith("linux")  # (elsewhere the loader's to name)
    if len(head) < 64:  # cut within its header, or empty (a bug hunt (session 97): such a
        # file was never rebuilt)
        return False
    if head[4] != 2:  # not 64-bit ELF: the loader's
        return True
    order = "<" if head[5] == 1 else ">"
    (shoff,) = struct.unpack_from(order + "Q", head, 0x28)
    shentsize, shnum = struct.unpack_from(order + "HH", head, 0x3A)
    return shoff + shentsize * shnum <= size


_WARNED: set[str] = set()  # the MarchError warnings given in this process


class CpuKernel:
    """One C++ source and the FFI targets it defines ({target name: handler symbol})."""

    def __init__(self, source: str, targets: dict[str, str], *, what: str):
        self.source = source
        self.targets = dict(targets)
        self.what = what  # for messages: "the fused LSTM", "flash attention"
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._loaded = False
        self._lib: ctypes.CDLL | None = None

    def library_path(self) -> str:
        cache = os.environ.get("HPNLP_KERNEL_CACHE") or os.path.join(
            os.path.expanduser("~"), ".cache", "hpnlp", "kernels")
        return os.path.join(cache, self._library_name(tuple(flags()), compiler_key(),
                                                      ffi_key(jax.ffi.include_dir())))

    @functools.lru_cache(maxsize=None)  # noqa: B019  (a few kernels, alive all process long)
    def _library_name(self, build_flags: tuple[str, ...], compiler_id: str, ffi_id: str) -> str:
        """The library's file name, from the sources and the CPU (read once), the compiler,
        jaxlib, and the flags."""
        digest = hashlib.sha256()
        for path in (self.source, *_HEADERS):
            with open(path, "rb") as f:
                digest.update(f.read())
        for part in (compiler_id, ffi_id, " ".join(build_flags), platform.machine(), _cpu_id()):
            digest.update(part.encode() + b"\0")
        stem = os.path.splitext(os.path.basename(self.source))[0]
        return f"{stem}-{digest.hexdigest()[:16]}.so"

    def _build(self, path: str) -> None:
        # named after the library: under its lock, one of these is a build that was killed
        # (a bug hunt, session 97: they stayed in the cache folder for good)
        for stale in glob.glob(glob.escape(path) + ".*.tmp.so"):
            with contextlib.suppress(OSError):
                os.unlink(stale)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp.so",
                                   dir=os.path.dirname(path))
        os.close(fd)
        try:
            compile_library(self.source, tmp)
            os.chmod(tmp, readable_mode(0o755))
        except BaseException:  # a failed build leaves no file behind
            os.unlink(tmp)
            raise
        os.replace(tmp, path)  # atomic: concurrent builders never see half a file

    def load(self) -> str | None:
        """Build (once per machine) and register the targets; the reason if they can't be."""
        with self._lock:
            if not self._loaded:
                try:
                    if jax.default_backend() != "cpu":
                        raise RuntimeError(f"{self.what} is a CPU kernel; the backend is "
                                           f"{jax.default_backend()!r}")
                    if os.environ.get("HPNLP_KERNEL_MARCH"):  # before a cached library
                        # too: one built for instructions this CPU lacks would kill the process
                        check_march(compiler())
                    path = self.library_path()
                    if not _whole_library(path):
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                        with open(path + ".lock", "w") as lock:  # one builder at a time
                            fcntl.flock(lock, fcntl.LOCK_EX)
                            if not _whole_library(path):
                                if os.path.exists(path):  # cut short, or no ELF: rebuilt
                                    os.unlink(path)
                                self._build(path)
                    lib = ctypes.cdll.LoadLibrary(path)
                    lost = [s for s in self.targets.values() if not hasattr(lib, s)]
                    if lost:  # a bug hunt (session 96): another valid library in its place
                        # was an AttributeError traceback, not the XLA twin
                        raise OSError(f"{path} has no symbol {', '.join(lost)}: not this "
                                      "kernel's library")
                    self._lib = lib
                    for target, symbol in self.targets.items():
                        jax.ffi.register_ffi_target(
                            target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                    self._reason = None
                except OSError as e:  # the cache cannot hold the library, or holds a bad one
                    self._reason = (f"{e}; check the kernel cache (HPNLP_KERNEL_CACHE, default "
                                    "~/.cache/hpnlp/kernels): a folder this process can write "
                                    "(delete a damaged library there to rebuild it)")
                except RuntimeError as e:
                    self._reason = str(e)
                    if isinstance(e, MarchError) and self._reason not in _WARNED:
                        # once a process: impl="auto" runs the XLA twins without a word
                        _WARNED.add(self._reason)
                        warnings.warn(f"hpnlp: the CPU kernels cannot be built: {e}",
                                      RuntimeWarning, stacklevel=3)
                self._loaded = True
            return self._reason

    def library(self) -> ctypes.CDLL:
        """The loaded library (for its plain C entry points, such as the tuning probes)."""
        reason = self.load()
        if reason is not None:
            raise RuntimeError(f"{self.what} is unavailable: {reason}")
        return self._lib

    def available(self) -> bool:
        """Whether the kernel can run here (compiles it on the first call)."""
        return self.load() is None

    def unavailable_reason(self) -> str | None:
        return self.load()

    def blocker(self) -> str | None:
        """Why the kernel should not run in the current trace (a multi-device mesh, or it
        cannot be built here); None if it can."""
        return single_device_reason() or self.unavailable_reason()


def single_device_reason() -> str | None:
    """Why an FFI kernel should not run in the current trace: XLA cannot partition a
    custom call, so on a mesh of several devices it would gather every operand."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        return (f"a mesh of {mesh.size} devices (XLA cannot partition the kernel's call; the "
                "XLA path shards like any XLA program)")
    return None


def reuse_freed_memory() -> bool:
    """Keep memory that XLA:CPU frees in the process for reuse instead of unmapping it
    (glibc `mallopt`, as a serving process would with tcmalloc); False where the C library
    is not glibc.

    XLA:CPU allocates each call's outputs and temporaries with malloc, and glibc maps large
    blocks afresh and unmaps them when freed, so every call page-faults them in again:
    about 10 ms a call for a [2048, 4096] float32 output on a 2-core machine (`python -m
    hpnlp.compress.kernels --malloc default` shows it). Importing hpnlp already does this
    where it can (`hpnlp.xla_workarounds`, switched off by `HPNLP_MALLOC_WORKAROUND=0`);
    benchmarks that compare kernels with XLA call it too, so every row is timed alike
    whatever the environment says. It changes nothing computed. It works fully only
    before JAX starts its threads: a thread that took a malloc arena of its own keeps it,
    and such an arena maps blocks over 64 MiB afresh whatever malloc is set to.
    """
    from hpnlp import xla_workarounds
    return bool(xla_workarounds.reuse_freed_memory())
