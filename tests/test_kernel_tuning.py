"""Per-CPU kernel tuning (`hpnlp.kernels.tuning`) and what it feeds: the cache is used only
when it is sound (corrupted, stale or foreign files are measured again, never used), every
pass's probe runs on its kernel and a real search chooses a candidate, every candidate a
search could choose computes what the defaults compute (outputs and gradients to 1e-5;
the rest of the suite runs the defaults: tuning is off in conftest.py), the attention
backward split over key blocks for few heads, and the bfloat16 attention kernel
against the float32 reference (bfloat16 tolerance, no NaN on fully masked rows). The
portable build (no AVX-512) runs the same checks in a subprocess (slow)."""

import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.attention.flash_cpu as F
from hpnlp.attention import cache_cpu
from hpnlp.compress import kernels as qkernels
from hpnlp.compress import spmm
from hpnlp.retrieval import exact
from hpnlp.attention.dense import dense_attention
from hpnlp import kernels
from hpnlp.kernels import tuning
from hpnlp.rnn import fused


class FakeKernel:
    """What Tuning needs of a CpuKernel, with its cache in a temporary folder."""

    what = "fake kernel"

    def __init__(self, folder):
        self.folder = folder

    def library_path(self):
        return os.path.join(self.folder, "fake-0123456789abcdef.so")

    def available(self):
        return True

    def library(self):
        return None


def _tuning(folder, seconds, calls, candidates=None):
    def probe(_lib, cfg):
        calls.append(cfg["b"])
        return seconds[cfg["b"]]
    cands = candidates or [{"b": b} for b in sorted(seconds)]
    t = tuning.Tuning(FakeKernel(folder), "pass", default={"b": 128}, candidates=cands,
                      probe=probe, shape="test")
    tuning.REGISTRY.remove(t)
    return t


@pytest.fixture
def tuning_on(monkeypatch):
    """Tuning as users run it (the suite turns it off, conftest.py), for the fake kernels."""
    monkeypatch.setenv("HPNLP_KERNEL_TUNE", "1")


@pytest.mark.usefixtures("tuning_on")
def test_search_caches_and_keeps_the_default_within_noise(tmp_path):
    calls = []
    t = _tuning(tmp_path, {64: 1.0, 128: 1.02, 256: 1.5}, calls)  # 64 is 2% faster: noise
    assert t.config() == {"b": 128} and t.source == "tuned"
    assert calls[:4] == [128] * 4  # the default first: warmup + 3 repeats
    calls.clear()
    again = _tuning(tmp_path, {64: 1.0, 128: 1.02, 256: 1.5}, calls)
    assert again.config() == {"b": 128} and again.source == "cache" and calls == []
    faster = _tuning(tmp_path / "other", {64: 0.5, 128: 1.0, 256: 1.5}, [])
    os.makedirs(tmp_path / "other")
    assert faster.config() == {"b": 64}


@pytest.mark.usefixtures("tuning_on")
@pytest.mark.parametrize("damage", ["garbage", "truncated", "checksum", "stale", "no cpu",
                                    "not a candidate"])
def test_a_damaged_or_stale_cache_is_measured_again_never_used(tmp_path, damage):
    """A record without a `cpu` field (written before records named it) is stale, not
    foreign (a bug hunt, session 102: "foreign (measured on a CPU it does not name)")."""
    seconds = {64: 0.5, 128: 1.0, 256: 1.5}
    _tuning(tmp_path, seconds, []).config()
    path = _tuning(tmp_path, seconds, []).path()
    with open(path) as f:
        text = f.read()
    data = json.loads(text)
    if damage == "garbage":
        text = "\x00\x13 not json"
    elif damage == "truncated":
        text = text[: len(text) // 2]
    elif damage == "checksum":  # a hand edit: the choice changed, the checksum not
        data["config"] = {"b": 256}
        text = json.dumps(data)
    elif damage == "stale":  # written for another candidate list (or kernel build)
        data["key"] = "0" * 64
        body = {k: v for k, v in data.items() if k != "checksum"}
        text = json.dumps({**body, "checksum": tuning._checksum(body)})
    elif damage == "no cpu":
        body = {k: v for k, v in data.items() if k not in ("checksum", "cpu")}
        text = json.dumps({**body, "checksum": tuning._checksum(body)})
    else:  # consistent, but its choice is no candidate
        data["config"] = {"b": 48}
        body = {k: v for k, v in data.items() if k != "checksum"}
        text = json.dumps({**body, "checksum": tuning._checksum(body)})
    with open(path, "w") as f:
        f.write(text)
    calls = []
    t = _tuning(tmp_path, seconds, calls)
    why = r"stale \(written before records named their CPU\); " if damage == "no cpu" else ".*"
    with pytest.warns(RuntimeWarning, match=f"tuning cache .* is {why}measuring again"):
        assert t.config() == {"b": 64}
    assert t.source == "tuned" and calls  # measured again
    with open(path) as f:
        assert t.check(json.load(f)) is None  # and rewritten sound


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
cpu family\t: {family}
model\t\t: {model}
model name\t: {name}
stepping\t: {stepping}
cache size\t: {cache}
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16

processor\t: 1
model name\t: not the first processor's
"""


@pytest.mark.usefixtures("tuning_on")
def test_cpus_with_the_same_flags_but_another_model_share_no_library_or_tuning(tmp_path,
                                                                               monkeypatch):
    """A bug hunt (session 102): the kernel cache and the tuning records were keyed by the
    CPU's flags alone, so Genoa and Genoa-X (or two steppings of a Xeon) shared one
    -march=native library and one tuning record, measured on the other CPU. Now the model,
    stepping and cache size name the library too, and a record measured on another CPU is
    reported and measured again. (Only names are computed here: nothing compiles.)"""
    cpus = {"genoa": ("AuthenticAMD", 25, 17, "AMD EPYC 9654 96-Core Processor", 1, "1024 KB"),
            "genoa-x": ("AuthenticAMD", 25, 17, "AMD EPYC 9684X 96-Core Processor", 2,
                        "1024 KB"),
            "xeon-1": ("GenuineIntel", 6, 167, "Intel(R) Xeon(R)", 1, "16384 KB"),
            "xeon-8": ("GenuineIntel", 6, 167, "Intel(R) Xeon(R)", 8, "16384 KB")}

    def on(cpu):
        (tmp_path / cpu).write_text(CPUINFO.format(**dict(zip(
            ("vendor", "family", "model", "name", "stepping", "cache"), cpus[cpu]))))
        monkeypatch.setattr(kernels, "cpu_info", lambda: kernels._read_cpuinfo(str(tmp_path / cpu)))

    monkeypatch.setenv("HPNLP_KERNEL_CACHE", str(tmp_path / "cache"))
    names = set()
    for cpu in cpus:
        on(cpu)
        names.add(kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel").library_path())
    assert len(names) == len(cpus)
    assert kernels.cpu_name() == ("Intel(R) Xeon(R) (GenuineIntel family 6 model 167 stepping 8, "
                                  "cache size 16384 KB)")
    # the benchmarks' record reads the same fields (a bug hunt, session 102: a parser of its own)
    from hpnlp.bench import harness
    assert harness.cpu_detail(cache_dir=str(tmp_path / "missing")) == {
        "vendor": "GenuineIntel", "family": 6, "model": 167, "stepping": 8,
        "features": ["avx2", "avx512_bf16", "avx512f"]}
    assert kernels._read_cpuinfo(str(tmp_path / "missing")) == {}
    monkeypatch.setattr(kernels, "cpu_info", dict)  # no /proc/cpuinfo: what platform says
    assert kernels._cpu_id() == platform.processor() and kernels.cpu_name()
    on("genoa")
    assert _tuning(tmp_path, {64: 0.5, 128: 1.0}, []).config() == {"b": 64}
    on("genoa-x")
    calls = []
    t = _tuning(tmp_path, {64: 1.0, 128: 0.5}, calls)
    with pytest.warns(RuntimeWarning, match=r"is foreign \(measured on AMD EPYC 9654 .*this CPU "
                                            r"is AMD EPYC 9684X .*stepping 2.*measuring again"):
        assert t.config() == {"b": 128}
    assert t.source == "tuned" and calls
    with open(t.path()) as f:
        assert json.load(f)["cpu"] == kernels.cpu_name()


@pytest.mark.usefixtures("tuning_on")
def test_a_failing_probe_runs_the_defaults_and_writes_nothing(tmp_path, monkeypatch, capsys):
    def probe(_lib, cfg):
        raise RuntimeError("probe failed")
    t = tuning.Tuning(FakeKernel(tmp_path), "pass", default={"b": 128}, candidates=[{"b": 64}],
                      probe=probe, shape="test")
    tuning.REGISTRY.remove(t)
    with pytest.warns(RuntimeWarning, match="tuning fake kernel/pass failed .*default blocks"):
        assert t.config() == {"b": 128}
    assert t.source == "default" and not os.path.exists(t.path())
    # --repeat has no search of it to compare, and says no agreement (a review, session 115)
    monkeypatch.setattr(tuning, "REGISTRY", [t])  # main's imports registered theirs already
    assert tuning.main(["--repeat", "1"]) == 1
    assert "not repeated: no recorded search of this pass" in capsys.readouterr().out


@pytest.mark.usefixtures("tuning_on")
def test_a_cache_folder_it_cannot_write_runs_the_defaults_and_a_failed_write_the_choice(
        tmp_path, monkeypatch):
    """Found in review: a cache this process may not write (a shared, read-only folder of
    prebuilt kernels) raised OSError from every kernel call. Now: the defaults, with a
    warning that says how to tune; a search whose result cannot be written (a full disk)
    runs its choice in this process, leaving no file behind."""
    calls = []
    t = _tuning(tmp_path / "missing", {64: 0.5, 128: 1.0}, calls)
    with pytest.warns(RuntimeWarning, match="tuning cache .* holds no choice yet, and this "
                                            "process cannot write it .*HPNLP_KERNEL_CACHE"):
        assert t.config() == {"b": 128}
    assert t.source == "default" and calls == []
    # a stale file there: one warning, not "measuring again" and then the defaults (review)
    os.makedirs(tmp_path / "shared")
    with open(_tuning(tmp_path / "shared", {64: 0.5}, []).path(), "w") as f:
        f.write("{}")

    def no_lock(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied")
        return open(path, *args, **kwargs)
    monkeypatch.setattr(tuning, "open", no_lock, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _tuning(tmp_path / "shared", {64: 0.5, 128: 1.0}, calls).config() == {"b": 128}
    assert [str(w.message).split(";")[0].split(" tuning cache ")[1].split(" ", 1)[1]
            for w in caught] == ["is malformed, and this process cannot write it ([Errno 13] "
                                 "Permission denied)"] and calls == []
    monkeypatch.delattr(tuning, "open")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tuning.tempfile, "mkstemp", full_disk)
    t = _tuning(tmp_path, {64: 0.5, 128: 1.0}, calls)
    with pytest.warns(RuntimeWarning, match="could not write .* measured choice"):
        assert t.config() == {"b": 64}
    assert t.source == "tuned" and calls and not os.path.exists(t.path())


@pytest.mark.usefixtures("tuning_on")
def test_repeat_says_when_its_search_stopped_before_the_cached_choice(tmp_path, monkeypatch,
                                                                      capsys):
    """Found in review: `python -m hpnlp.kernels --repeat` raised KeyError when the repeat
    search stopped at its time budget before timing the cached choice."""
    t = _tuning(tmp_path, {64: 0.5, 128: 1.0}, [])
    assert t.config() == {"b": 64}
    t.budget_s = 0.0  # the repeat times the default alone
    monkeypatch.setattr(tuning, "REGISTRY", [t])  # main's imports registered theirs already
    assert tuning.main(["--repeat", "1"]) == 1
    assert "the cached choice was not timed" in capsys.readouterr().out


def test_compiler_command_and_a_missing_compiler(tmp_path, monkeypatch):
    """$CXX is split as a shell would (`ccache g++`); one that names no program is reported
    as the compiler, not as the cache, and its failed build leaves no file behind."""
    monkeypatch.setenv("CXX", "ccache  g++ -v")
    assert kernels.compiler() == ["ccache", "g++", "-v"]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("HPNLP_KERNEL_CACHE", str(tmp_path / "cache"))
    kernel = kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel")
    reason = kernel.unavailable_reason()
    assert "cannot run the C++ compiler" in reason and "no-such-compiler" in reason
    assert [f for f in os.listdir(tmp_path / "cache") if not f.endswith(".lock")] == []
    # one a shell cannot split is the kernel's reason too, not a ValueError out of every
    # `impl="auto"` layer (a review, session 118)
    monkeypatch.setenv("CXX", 'g++ -DX="a')
    kernel = kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel")
    assert kernel.unavailable_reason().startswith(
        "$CXX='g++ -DX=\"a' cannot be split as a shell would (No closing quotation); fix its")


def test_a_march_the_compiler_rejects_is_named_not_a_silent_fallback(tmp_path, monkeypatch):
    """A bug hunt (session 102): HPNLP_KERNEL_MARCH=avx2 (not a -march g++ knows) failed every
    build with the compiler's multi-line error, which impl="auto" hid: every kernel ran its
    XLA twin without a word. Now the reason is one line naming the variable and the values
    the compiler accepts, and a warning says it once a process (a preprocessor run of an
    empty file finds it: nothing compiles here)."""
    try:
        cxx = kernels.compiler()
    except RuntimeError as e:
        pytest.skip(str(e))
    if kernels._march_error(tuple(cxx), "avx2") is None:
        pytest.skip(f"{' '.join(cxx)} accepts -march=avx2")
    monkeypatch.setenv("HPNLP_KERNEL_MARCH", "avx2")
    monkeypatch.setenv("HPNLP_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="CPU kernels cannot be built: HPNLP_KERNEL_MARCH=avx2"):
        reason = kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel").load()
    assert re.fullmatch(r"HPNLP_KERNEL_MARCH=avx2 is not a -march that "  # CXX="ccache g++"
                        + re.escape(kernels._compiler_name(cxx)) + r" accepts \(.*\); set it to "
                        r"one it accepts( \(x86-64-v3: .*\))? or unset it \(native\)", reason)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert kernels.CpuKernel(fused.KERNEL.source, {}, what="another").load() == reason
    assert [f for f in os.listdir(tmp_path) if not f.endswith(".lock")] == []


def test_a_compiler_that_always_fails_is_named_not_the_march(tmp_path, monkeypatch):
    """A bug hunt (session 102): a compiler that fails every run (CXX=false, a broken
    wrapper) was reported as rejecting HPNLP_KERNEL_MARCH=x86-64-v3 (as the portable tests
    set it), and the build's "(no output; the compiler is ...)" was lost; and the x86-64-v3
    hint was given on Arm too. (Scripts stand for the compilers: nothing compiles here.)"""
    monkeypatch.setenv("HPNLP_KERNEL_MARCH", "x86-64-v3")
    monkeypatch.setenv("HPNLP_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "false")
    reason = kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel").load()
    assert reason.endswith("(no output; the compiler is $CXX=false)"), reason
    assert "HPNLP_KERNEL_MARCH" not in reason
    picky = tmp_path / "picky"  # rejects every -march=, accepts the rest
    picky.write_text('#!/bin/sh\ncase "$*" in *-march=*) echo "picky: error: bad -march" >&2;'
                     ' exit 1;; esac\n')
    picky.chmod(0o755)
    monkeypatch.setenv("CXX", str(picky))
    for machine, hint in (("x86_64", " (x86-64-v3: AVX2 without AVX-512)"), ("aarch64", "")):
        monkeypatch.setattr(platform, "machine", lambda: machine)
        assert kernels._march_error((str(picky),), "avx2") == (
            f"HPNLP_KERNEL_MARCH=avx2 is not a -march that $CXX={picky} accepts (bad -march); "
            f"set it to one it accepts{hint} or unset it (native)")


# A compiler for an AVX2-only CPU (an EPYC Zen 3), as a script: it answers the preprocessor
# runs (`-march=... -dM -E`: the ISA macros; `-E`: accepts every -march) and `--version`, and
# writes the command of anything else (a compile) to `compiled` beside itself.
AVX2_ONLY_CXX = """#!/bin/sh
case "$*" in
  *--version*) echo "fakecc 1.0";;
  *-march=native*-dM*) printf '#define __AVX2__ 1\\n#define __FMA__ 1\\n#define __SSE4_2__ 1\\n'
                       printf '#define __znver3__ 1\\n';;
  *-march=x86-64-v3*-dM*) printf '#define __AVX2__ 1\\n#define __FMA__ 1\\n';;
  *-march=x86-64-v4*-dM*) printf '#define __AVX2__ 1\\n#define __AVX512F__ 1\\n'
                          printf '#define __AVX512BW__ 1\\n#define __SSE4_2__ 1\\n';;
  *-E*) ;;
  *) echo "$*" >> "$(dirname "$0")/compiled"; exit 1;;
esac
"""


def test_a_march_this_cpu_cannot_run_is_refused_not_built_or_loaded(tmp_path, monkeypatch):
    """Found in review: HPNLP_KERNEL_MARCH=x86-64-v4 (or icelake-server) on an AVX2-only CPU
    passed the check (the compiler accepts it), built and loaded, and its first AVX-512
    instruction killed the process with SIGILL: no message, no XLA twin, and the library
    stayed in the cache for the next process. Now the instruction sets the value enables
    are compared with -march=native's (their macros): one line naming the variable and the
    sets this CPU lacks, a warning once, the twin; nothing compiles, and a library already
    cached for the value is not loaded. (A script stands for the compiler.)"""
    cxx = tmp_path / "cxx"
    cxx.write_text(AVX2_ONLY_CXX)
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("HPNLP_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HPNLP_KERNEL_MARCH", "x86-64-v4")
    monkeypatch.setattr(kernels, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="CPU kernels cannot be built: HPNLP_KERNEL_MARCH="
                                            "x86-64-v4 enables AVX512BW, AVX512F, which"):
        reason = kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel").load()
    assert reason == (
        f"HPNLP_KERNEL_MARCH=x86-64-v4 enables AVX512BW, AVX512F, which this CPU "
        f"({kernels.cpu_name()}) lacks (its library would die of an illegal instruction); set "
        "it to a -march this CPU runs (x86-64-v3: AVX2 without AVX-512) or unset it (native)")
    assert not (tmp_path / "compiled").exists()
    kernel = kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel")
    os.makedirs(tmp_path / "cache", exist_ok=True)  # a library built for it before the check
    import _ctypes
    shutil.copy(_ctypes.__file__, kernel.library_path())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once a process
        assert kernel.load() == reason and kernel._lib is None
    # a subset of this CPU's (the portable tests' value) passes; a compiler that cannot
    # preprocess -march=native leaves the value to the build
    assert kernels._isa_error((str(cxx),), "x86-64-v3") is None
    assert kernels._isa_error(("false",), "x86-64-v4") is None
    assert not (tmp_path / "compiled").exists()


def test_the_compilers_command_and_release_name_the_library(tmp_path, monkeypatch):
    """Found in review: the library's name left out $CXX, so `CXX="g++ -O0 -g"` (or
    `-fsanitize=address`) loaded the cached optimized library, or cached its own under the
    name every later process loads, and another g++ release rebuilt nothing. Now the
    command's program (links followed), its flags and its `--version` name the library.
    (Only names are computed: nothing compiles.)"""
    monkeypatch.setenv("HPNLP_KERNEL_CACHE", str(tmp_path / "cache"))

    def name(cxx=None):
        if cxx is None:
            monkeypatch.delenv("CXX", raising=False)
        else:
            monkeypatch.setenv("CXX", cxx)
        return kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel").library_path()

    if shutil.which("g++"):  # what compiler() runs without CXX
        plain = name("g++")
        assert name() == plain  # one compiler, one library
        assert len({plain, name("g++ -O0"), name("g++ -fsanitize=address")}) == 3
    # one program at one path upgraded in place (found in review: two releases in two folders
    # differed by their paths alone, so this held with `--version` left out of the key)
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    releases = []
    for release in ("12.2.0", "13.1.0"):
        (folder / "cxx").write_text(f'#!/bin/sh\necho "cxx (fake) {release}"\n')
        (folder / "cxx").chmod(0o755)
        kernels._compiler_identity.cache_clear()  # one `--version` run per command and process
        releases.append(name("cxx"))
    assert releases[0] != releases[1]
    assert not (tmp_path / "cache").exists()


def test_jaxlibs_version_and_ffi_headers_name_the_library(tmp_path, monkeypatch):
    """Found in review: the library's name held jax's version, not the jaxlib whose FFI
    headers it is compiled against (jax runs with an older jaxlib than itself). Now
    jaxlib's version and a digest of the headers name it: the same headers elsewhere name the
    same library, a changed c_api.h or version another. (Nothing compiles.)"""
    import jaxlib
    real = jax.ffi.include_dir()
    monkeypatch.setenv("HPNLP_KERNEL_CACHE", str(tmp_path / "cache"))

    def name(folder, c_api):
        api = folder / "xla" / "ffi" / "api"
        api.mkdir(parents=True)
        for header in ("api.h", "ffi.h", "c_api.h"):
            (api / header).write_bytes(open(os.path.join(real, "xla", "ffi", "api", header),
                                            "rb").read())
        with open(api / "c_api.h", "a") as f:
            f.write(c_api)
        monkeypatch.setattr(jax.ffi, "include_dir", lambda: str(folder))
        return kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel").library_path()

    a = name(tmp_path / "a", "")
    assert name(tmp_path / "copy", "") == a  # where the headers lie does not matter
    assert name(tmp_path / "b", "// XLA_FFI_API_MINOR 2\n") != a
    monkeypatch.setattr(jaxlib, "__version__", "0.0.1")
    assert name(tmp_path / "old", "") != a
    assert kernels.ffi_key(str(tmp_path / "old")).startswith("jaxlib 0.0.1 ")


@pytest.mark.usefixtures("tuning_on")
def test_each_core_count_keeps_its_own_record(tmp_path, monkeypatch):
    """Found in review: a tuning record named its CPU but not the threads its probes ran on
    (`kernels.cores()`), so two sizes of one VM sharing a cache folder shared one choice:
    blocks measured on 2 threads left most of 64 idle. The count went into the record and its
    key, but not the file's name, so a process pinned to one core and a two-core one each
    found the other's record stale and measured again at every switch. Now the count names
    the file: both records live side by side, and one copied onto another count's name is
    reported stale and measured again."""
    monkeypatch.setattr(kernels, "cores", lambda: 2)
    two = _tuning(tmp_path, {64: 0.5, 128: 1.0}, [])
    assert two.config() == {"b": 64} and two.source == "tuned"
    monkeypatch.setattr(kernels, "cores", lambda: 8)
    eight = _tuning(tmp_path, {64: 1.0, 128: 0.5}, [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "stale": the 2-thread record is not this one's
        assert eight.config() == {"b": 128} and eight.source == "tuned"
    eight_path = eight.path()
    with open(eight_path) as f:
        assert json.load(f)["threads"] == 8
    monkeypatch.setattr(kernels, "cores", lambda: 2)
    calls = []
    again = _tuning(tmp_path, {64: 1.0, 128: 0.5}, calls)
    assert again.config() == {"b": 64} and again.source == "cache" and calls == []
    assert again.path() != eight_path
    shutil.copy(again.path(), eight_path)  # a 2-thread record under the 8-thread name
    monkeypatch.setattr(kernels, "cores", lambda: 8)
    calls = []
    t = _tuning(tmp_path, {64: 1.0, 128: 0.5}, calls)
    with pytest.warns(RuntimeWarning, match=r"is stale \(measured on 2 threads; this process "
                                            r"runs 8\); measuring again"):
        assert t.config() == {"b": 128}
    assert t.source == "tuned" and calls


@pytest.mark.parametrize("version", ["v1", "v2", "v2 in a container"])
def test_a_cgroup_cpu_limit_caps_the_cores(tmp_path, monkeypatch, version):
    """A bug hunt (session 109): `cores()` read the affinity alone, so a container limited to
    2 cores' worth of time (`docker --cpus=2`, a Kubernetes CPU limit) on a 96-CPU host
    split every kernel over 96 threads. The smallest quota along the process's cgroup path
    caps it (rounded up), v1 and v2, and where the path is the host's (a container's
    namespace shows its own cgroup as the mount's root) the root's limit is read."""
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    if version == "v1":
        proc.write_text("4:memory:/a\n2:cpu,cpuacct:/job/task\n0::/\n")
        for d, quota in (("cpu,cpuacct/job", "350000"), ("cpu,cpuacct/job/task", "-1")):
            (root / d).mkdir(parents=True)
            (root / d / "cpu.cfs_quota_us").write_text(quota + "\n")
            (root / d / "cpu.cfs_period_us").write_text("100000\n")
        want = 3.5
    else:
        proc.write_text("0::/host/slice/pod\n")
        top = root if version == "v2 in a container" else root / "host/slice/pod"
        top.mkdir(parents=True)
        (top / "cpu.max").write_text("150000 100000\n")
        if version == "v2":
            (root / "host" / "cpu.max").write_text("max 100000\n")
        want = 1.5
    assert kernels.cgroup_cpu_limit(str(root), str(proc)) == want
    (tmp_path / "none").mkdir()
    assert kernels.cgroup_cpu_limit(str(tmp_path / "none"), str(proc)) is None
    assert kernels.cgroup_cpu_limit(str(root), str(tmp_path / "missing")) is None
    monkeypatch.setattr(kernels, "cgroup_cpu_limit", lambda: want)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)))
    assert kernels.cores() == {1.5: 2, 3.5: 4}[want]  # rounded up
    monkeypatch.setattr(kernels, "cgroup_cpu_limit", lambda: None)
    assert kernels.cores() == 96


def test_tuning_off_runs_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("HPNLP_KERNEL_TUNE", "0")
    calls = []
    t = _tuning(tmp_path, {64: 0.5, 128: 1.0}, calls)
    assert t.config() == {"b": 128} and t.source == "default" and calls == []


needs_flash = pytest.mark.kernel(F.KERNEL)
needs_lstm = pytest.mark.kernel(fused.KERNEL)


# 13.2 s in the suite on the 2-core Zen 3 (2026-12-02: every pass's probe at its probe
# shape); CI's slow part runs it. The default run keeps the real search just below.
@pytest.mark.slow
@needs_flash  # a compiler: every kernel builds
def test_every_pass_probes_its_kernel():
    """Each registered pass's probe (its kernel's plain C entry point, at its probe shape)
    runs its default and returns seconds."""
    import hpnlp.attention.flash_cpu  # noqa: F401  (every kernel registers its passes)
    import hpnlp.compress.kernels  # noqa: F401
    import hpnlp.retrieval.exact  # noqa: F401
    import hpnlp.rnn.fused  # noqa: F401
    passes = [t for t in tuning.REGISTRY if t.kernel.available()]
    assert {t.kernel.what for t in passes} >= {F.KERNEL.what, spmm.KERNEL.what}
    for t in passes:
        seconds = t.probe(t.kernel.library(), t.default)
        assert 0 < seconds < 10, (t.kernel.what, t.name, seconds)


@pytest.mark.kernel(spmm.KERNEL)
def test_a_real_search_chooses_a_candidate():
    """A search of a real pass (the sparse product's, the quickest: about 0.3 s) times every
    candidate and returns a sound cache body whose choice is one of them. Nothing is
    written: the choice measured here, beside the other tests, is no CPU's to keep."""
    before = os.path.exists(spmm.TUNING.path())
    data = spmm.TUNING.search()
    assert spmm.TUNING.check(data) is None and data["config"] in spmm.TUNING.candidates
    assert [x["config"] for x in data["timings"]] == spmm.TUNING.candidates
    assert all(x["seconds"] > 0 for x in data["timings"])
    assert os.path.exists(spmm.TUNING.path()) == before


def _qkv(B, L, H, D, seed, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v, w = (jax.random.normal(kk, (B, L, H, D)) for kk in ks)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), w


def _segments(B, L):
    """Row 0: packed segments, a padded tail and padded queries at the start (rows that
    see no key); other rows one segment."""
    seg = np.ones((B, L), np.int32)
    seg[0, :5], seg[0, L // 2:], seg[0, -7:] = 0, 2, 0
    return jnp.asarray(seg)


def _out_and_grads(fn, q, k, v, w):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(w.astype(out.dtype)))


def _pairs(fwd: list, bwd: list, shift: int = 1) -> list:
    """Every forward and every backward candidate once, each forward paired with a backward
    `shift` places on (so a pass's blocks meet another pass's other than its own)."""
    assert len(fwd) == len(bwd)
    return list(zip(fwd, bwd[shift:] + bwd[:shift]))


@needs_flash
@pytest.mark.parametrize("causal", [False, True])
def test_every_candidate_block_pair_computes_what_the_defaults_do(causal):
    """Whatever a CPU's search picks computes what the defaults compute (outputs and
    gradients to 1e-5): every candidate of both passes (a cached choice is used only when
    it is a candidate), and the short causal regime's defaults. The suite runs with
    tuning off (conftest.py), so this covers the choices a search could make on any CPU."""
    blocks = lambda t: [(c["bq"], c["bk"]) for c in t.candidates]  # noqa: E731
    fwd, bwd = blocks(F.TUNINGS["fwd", False, "long"]), blocks(F.TUNINGS["bwd", False, "long"])
    assert all(sorted(blocks(t)) == sorted(fwd) for (_, bf16, _), t in F.TUNINGS.items()
               if not bf16)  # every float32 regime chooses among the same blocks
    q, k, v, w = _qkv(2, 300, 2, 64, seed=1)
    seg = _segments(2, 300)
    run = lambda fb, bb: _out_and_grads(  # noqa: E731
        lambda q, k, v: F.flash_attention(q, k, v, seg, seg, causal=causal, fwd_blocks=fb,
                                          bwd_blocks=bb), q, k, v, w)
    want = run(F.FWD_BLOCKS, F.BWD_BLOCKS)
    for fb, bb in [*_pairs(fwd, bwd), (F.SHORT_CAUSAL_BLOCKS,) * 2]:
        for a, b, name in zip(run(fb, bb), want, ("out", "dq", "dk", "dv")):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"{name} {fb} {bb}")


@needs_flash
def test_short_causal_attention_runs_its_own_tuning(monkeypatch):
    """Causal attention over at most SHORT_CAUSAL keys asks for the short causal regime's
    blocks; bidirectional and longer causal attention for the long regime's."""
    asked = []
    monkeypatch.setattr(F, "tuned_blocks", lambda bf16=False, regime="long": (
        asked.append(regime), ((16, 16), (16, 16)))[1])
    q, k, v, _ = _qkv(1, 32, 1, 16, seed=0)
    F.flash_attention(q, k, v, causal=True)
    F.flash_attention(q, k, v, causal=False)
    assert asked == ["short causal", "long"]
    n = F.SHORT_CAUSAL
    assert [F.regime(n, n, True), F.regime(n + 1, n + 1, True), F.regime(n, n, False)] == [
        "short causal", "long", "long"]


@needs_flash
@pytest.mark.parametrize("causal, batch", [(False, 1), (True, 1), (True, 3)])
def test_few_heads_on_two_threads_split_their_key_blocks(causal, batch):
    """B*H = 1 < 2 threads, or an uneven 3 (found in review: untested): the backward splits
    each head's key blocks over the threads (3 shares a head at B*H = 3) and sums their dQ
    shares; the same as one thread and as the dense oracle."""
    q, k, v, w = _qkv(batch, 200, 1, 32, seed=2)
    seg = _segments(batch, 200)
    blocks = dict(fwd_blocks=(32, 32), bwd_blocks=(32, 32))  # 7 key blocks to split
    run = lambda t: _out_and_grads(lambda q, k, v: F.flash_attention(  # noqa: E731
        q, k, v, seg, seg, causal=causal, threads=t, **blocks), q, k, v, w)
    two, one = run(2), run(1)
    want = _out_and_grads(lambda q, k, v: dense_attention(q, k, v, seg, causal=causal), q, k, v, w)
    for a, b, c in zip(two, one, want):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(a, c, atol=1e-5, rtol=1e-5)


def check_bfloat16(configs=({},), causals=(False, True), batch=2, heads=2, threads=2):
    """The bfloat16 kernel against the float32 oracle on the same (bfloat16) inputs: outputs
    and gradients within bfloat16 tolerance, no NaN, and exact zeros on rows that see no
    key; for each of `configs` (flash_attention's block and widen arguments; {}: this run's
    own), on `threads` threads. Shared with the portable-build subprocess below."""
    for causal in causals:
        q, k, v, w = _qkv(batch, 150, heads, 32, seed=3, dtype=jnp.bfloat16)
        seg = _segments(batch, 150)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        want = _out_and_grads(lambda q, k, v: dense_attention(q, k, v, seg, causal=causal), *f32, w)
        for blocks in configs:
            got = _out_and_grads(lambda q, k, v: F.flash_attention(
                q, k, v, seg, seg, causal=causal, threads=threads, **blocks), q, k, v, w)
            assert all(x.dtype == jnp.bfloat16 for x in got)
            for a, b, name in zip(got, want, ("out", "dq", "dk", "dv")):
                a = np.asarray(a.astype(jnp.float32))
                assert np.isfinite(a).all(), (name, blocks)
                scale = float(np.abs(b).max())
                np.testing.assert_allclose(a, b, atol=2e-2 * scale, err_msg=f"{name} {blocks}")
            out, dq = (np.asarray(x.astype(jnp.float32)) for x in got[:2])
            assert (out[0, :5] == 0).all() and (dq[0, :5] == 0).all()  # padded queries: zeros


# 3.2 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
@needs_flash
def test_bfloat16_kernel_matches_float32_within_bfloat16_tolerance():
    hlo = jax.jit(lambda q: F.flash_attention(q, q, q)).lower(
        jnp.zeros((1, 16, 1, 16), jnp.bfloat16)).as_text()
    assert "hpnlp_flash_fwd_bf16" in hlo
    # tails, odd key counts; the CPU's own products and widened; the default blocks
    check_bfloat16([dict(fwd_blocks=(32, 64), bwd_blocks=(32, 48), widen=widen)
                    for widen in (False, True)] + [{}])
    # every candidate a bfloat16 search could choose, blocks and products: each forward
    # candidate beside a backward one of the same products (on causal rows, whose diagonal
    # tiles are masked; both masks ran above)
    def cands(p, widen):  # those that apply to this build (widening needs products of its own)
        t = F.TUNINGS[p, True, "long"]
        return [(c["bq"], c["bk"]) for c in t.candidates
                if c["widen"] == widen and t.applies(F.KERNEL.library(), c)]
    check_bfloat16([dict(fwd_blocks=f, bwd_blocks=b, widen=bool(w)) for w in (0, 1)
                    for f, b in _pairs(cands("fwd", w), cands("bwd", w))], causals=(True,))
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    if "avx512_bf16" in flags and kernels.march() == "native":  # the products this CPU has
        assert F.bf16_products() in (("amx", "avx512_bf16") if "amx_bf16" in flags
                                     else ("avx512_bf16",))


@needs_flash
@pytest.mark.parametrize("batch, heads, threads", [(2, 2, 3), (1, 1, 2)])
def test_bfloat16_backward_splits_key_blocks_over_few_or_uneven_heads(batch, heads, threads):
    """Found in review: the bfloat16 backward's key-block split (each share's dQ written
    unscaled in float32, then summed and scaled into bfloat16) was untested: the bfloat16
    checks ran B*H = 4 on 2 threads, never split. B*H = 4 on 3 threads splits each head's 5
    key blocks in 3 shares, B*H = 1 on 2 threads in 5."""
    check_bfloat16([dict(fwd_blocks=(32, 32), bwd_blocks=(32, 32))], causals=(True,),
                   batch=batch, heads=heads, threads=threads)


@needs_flash
def test_bfloat16_passes_tune_their_products_with_their_blocks():
    """Each bfloat16 pass chooses, with its blocks, between the CPU's own bfloat16 products
    and widening to float32 (slower vdpbf16ps than widening was measured on a Xeon): both
    for every block pair, the CPU's own by default; widening is timed only where the build
    has products of its own (elsewhere the two are the same code). float32 passes have no
    such choice. The choice reaches the kernel as its `widen` attribute."""
    native = F.KERNEL.library().hpnlp_flash_bf16_products() > 0
    for (_, bf16, _), t in F.TUNINGS.items():
        blocks = {(c["bq"], c["bk"]) for c in t.candidates}
        if not bf16:
            assert all("widen" not in c for c in t.candidates)
            continue
        assert t.default["widen"] == 0
        assert sorted((c["bq"], c["bk"], c["widen"]) for c in t.candidates) == sorted(
            (q, k, w) for q, k in blocks for w in (0, 1))
        assert t.applies(F.KERNEL.library(), dict(t.default, widen=1)) == native
        assert t.applies(F.KERNEL.library(), t.default)
    q = jnp.zeros((1, 16, 1, 16), jnp.bfloat16)
    for widen in (False, True):
        hlo = jax.jit(lambda q: F.flash_attention(q, q, q, fwd_blocks=(16, 16), bwd_blocks=(16, 16),
                                                  widen=widen)).lower(q).as_text()
        assert re.search(rf"widen = {str(widen).lower()}", hlo), hlo
    with pytest.raises(ValueError, match="widen must be True, False or None"):
        F.flash_attention(q, q, q, fwd_blocks=(16, 16), bwd_blocks=(16, 16), widen=1)


@needs_flash
def test_a_bfloat16_pass_given_its_blocks_tunes_nothing(monkeypatch):
    """Review r5: bfloat16 q, k, v with both passes' blocks given still asked both bfloat16
    tunings for `widen`, which on a fresh cache searched every block and widen pair (up to
    20 s a pass, inside the trace) for a choice paired with blocks the call does not run. A
    pass given its blocks runs the CPU's own products (its tuning's default) and asks no
    tuning; a pass left to tuning runs its tuned blocks and widen."""
    asked = []

    def config(self):  # every bfloat16 choice widens, as a search may choose
        asked.append(self.name)
        return dict(self.default, **({"widen": 1} if "widen" in self.default else {}))
    monkeypatch.setattr(tuning.Tuning, "config", config)
    q = jnp.zeros((1, 16, 1, 16), jnp.bfloat16)

    def widens(**blocks):  # {pass: the widen its kernel is given}
        def loss(q):
            return jnp.sum(F.flash_attention(q, q, q, **blocks).astype(jnp.float32))
        hlo = jax.jit(jax.grad(loss)).lower(q).as_text()
        return dict(re.findall(r"@hpnlp_flash_(fwd|bwd)_bf16\(.*?widen = (true|false)", hlo))

    assert widens(fwd_blocks=(16, 16), bwd_blocks=(16, 32)) == {"fwd": "false", "bwd": "false"}
    assert asked == []
    assert widens(fwd_blocks=(16, 16)) == {"fwd": "false", "bwd": "true"}
    assert set(asked) == {"bwd_bf16"}
    assert widens(bwd_blocks=(16, 32), widen=True) == {"fwd": "true", "bwd": "true"}


# 2.7 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
@needs_lstm
def test_every_lstm_blocking_candidate_computes_what_the_default_does():
    """The scans' and the weight gradients' blockings: every candidate a search could choose
    (the suite runs with tuning off, conftest.py), the default and blocks that split every
    loop, against each other and float64."""
    L, B, H, E = 5, 11, 48, 13
    ks = jax.random.split(jax.random.key(0), 8)
    xw = jax.random.normal(ks[0], (L, B, 4 * H))
    x, wx = jax.random.normal(ks[7], (L, B, E)), jax.random.normal(ks[1], (E, 4 * H)) / E ** 0.5
    b, w = jax.random.normal(ks[1], (4 * H,)) * 0.1, jax.random.normal(ks[2], (H, 4 * H)) / H ** 0.5
    c0, h0 = jax.random.normal(ks[3], (B, H)), jax.random.normal(ks[4], (B, H))
    valid = (jax.random.uniform(ks[5], (L, B)) > 0.2).astype(jnp.float32)
    d_out = jax.random.normal(ks[6], (B, L, H))
    cands = {n: t.candidates for n, t in fused.TUNINGS.items()}
    results = []
    for fwd_blk, bwd_blk in ((fused.DEFAULT_BLOCKING, fused.DEFAULT_BLOCKING),
                             *_pairs(cands["fwd"], cands["bwd"]),
                             ({"kc": 16, "mr": 1}, {"kc": 32, "mr": 4}),
                             # the largest k block the API takes (its block count overflowed)
                             ({"kc": 2 ** 31 - 1, "mr": 6}, {"kc": 2 ** 31 - 1, "mr": 6})):
        out, (c, h), hp, cc, act = fused.lstm_forward(x, wx, b, w, c0, h0, valid, blocking=fwd_blk)
        grads = fused.lstm_backward(act, cc, c0, w, wx, valid, d_out, h, c, blocking=bwd_blk)
        results.append((out, c, h, *grads))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="blocking must be"):
        fused.lstm_forward(x, wx, b, w, c0, h0, valid, blocking={"kc": 64, "mr": 9})
    # the weight gradients: every candidate, the default and blocks that split every loop
    # (row blocks of 6 with a short last one, several packed k blocks); E = 13 is not a
    # multiple of 6
    hp, x, dz = jax.random.normal(ks[0], (L, B, H)), jax.random.normal(ks[1], (L, B, 13)), xw
    want = [np.einsum("lbm,lbg->mg", np.asarray(a, np.float64), np.asarray(dz, np.float64))
            for a in (hp, x)]
    for i, blk in enumerate([*cands["dw"], fused.DEFAULT_DW_BLOCKING, {"kc": 7, "mc": 10}]):
        for threads in (1, 2) if i >= len(cands["dw"]) else (1 + i % 2,):
            got = fused.lstm_weight_grads(hp, x, dz, threads=threads, blocking=blk)
            for g, w_ in zip(got, want):
                np.testing.assert_allclose(g, w_, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="weight-gradient blocking must be"):
        fused.lstm_weight_grads(hp, x, dz, blocking={"kc": 64, "mr": 4})


def _kernel_exp(x, base2):
    fn = F.KERNEL.library().hpnlp_flash_vexp0
    fn.restype = None
    y = np.full_like(x, 7.0)
    fn(x.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p),
       ctypes.c_int64(x.size), ctypes.c_int64(base2))
    return y


@needs_flash
def test_vexp0_is_exp_to_a_few_ulp_and_zero_below_minus_87():
    """The kernels' exp (`vexp0` in simd.h: the LSTM gates') and base-2 exp (`vexp2_0`: the
    attention softmax's, its scores scaled by log2 e) as the flash attention library's
    vectors compute them (16 floats with AVX-512, 8 with AVX2; the portable build's run
    checks the AVX2 path on any machine). Under 1.5 ulp on [-87, 88] and [-126, 127] (0.91
    over every float in [-87, 88], 0.95 over every float with 1/8 <= |x| < 4); exactly 0
    below -87 and -126 (-inf included: masked scores weigh nothing); NaN stays NaN."""
    for base2, lo, hi in ((0, -87.0, 88.0), (1, -126.0, 127.0)):
        x = np.concatenate([np.linspace(lo, hi, 100_003, dtype=np.float32),
                            np.float32([-np.inf, -1e30, -200.0, lo - 0.01, np.nan, 0.0, -0.0,
                                        hi + 0.5])])
        y = _kernel_exp(x, base2)
        inside = (x >= lo) & (x <= hi)
        want = (np.exp2 if base2 else np.exp)(x[inside].astype(np.float64))
        ulps = np.abs(y[inside] - want) / np.spacing(want.astype(np.float32))
        assert ulps.max() < 1.5, (base2, ulps.max(), x[inside][ulps.argmax()])
        assert np.all(y[x < lo] == 0.0), base2
        assert np.isnan(y[np.isnan(x)]).all(), base2
        assert y[x == hi + 0.5][0] >= np.float32(1.6e38)  # clamped (AVX2) or inf


PORTABLE = """
import os, sys
sys.path.insert(0, {tests!r})
import hpnlp.attention.flash_cpu as F
from hpnlp.rnn import fused
assert F.KERNEL.available(), F.KERNEL.unavailable_reason()
from hpnlp import kernels
assert "-march=x86-64-v3" in " ".join(kernels.flags())
import test_kernel_tuning as T
T.check_bfloat16()
T.test_vexp0_is_exp_to_a_few_ulp_and_zero_below_minus_87()
assert F.bf16_products() == "float32", F.bf16_products()
T.test_few_heads_on_two_threads_split_their_key_blocks(True, 3)
T.test_bfloat16_backward_splits_key_blocks_over_few_or_uneven_heads(2, 2, 3)
T.test_every_lstm_blocking_candidate_computes_what_the_default_does()
import test_rnn_fused  # the 8-float tiles against the XLA scan: E = 12, 17 and 100 split
for case in [(2, 5, 12), (3, 3, 100), (2, 2, 17)]:  # across tiles and threads otherwise
    test_rnn_fused.test_kernel_matches_the_scan_with_padding(*case)
import test_attention_cache_cpu
test_attention_cache_cpu.check_kernel_equals_twin()
import test_spmm  # the 8-float transposes and row blocks
test_spmm.test_kernel_matches_float64_at_every_row_block()
print("portable ok")
"""


@pytest.mark.slow
@needs_flash
def test_portable_build_without_avx512(tmp_path):
    """Built for x86-64-v3 (AVX2, no AVX-512, no BF16): the fallback paths compute the same
    (flash attention, the fused LSTM, against its blockings and the XLA scan, the cached
    attention of a decoding step)."""
    env = dict(os.environ, HPNLP_KERNEL_MARCH="x86-64-v3", HPNLP_KERNEL_TUNE="0",
               HPNLP_KERNEL_CACHE=str(tmp_path))
    code = PORTABLE.format(tests=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "portable ok" in proc.stdout, proc.stderr[-3000:]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tune.json")]  # tuning was off


@pytest.mark.slow
@needs_flash
@pytest.mark.parametrize("kernel", [F.KERNEL, fused.KERNEL, cache_cpu.KERNEL, exact.KERNEL,
                                    qkernels.KERNEL, spmm.KERNEL],
                         ids=["flash", "lstm", "cache", "mips", "quant", "spmm"])
def test_avx2_builds_lower_no_vector_operation_piecewise(kernel):
    """Built for x86-64-v3, every kernel keeps its vector operations in AVX2 registers
    (native 8-float vectors, HPNLP_NATIVE_VECTORS in simd.h, or explicit halves). With a
    16-float vector there, GCC lowered their arithmetic lane by lane through memory and
    flash attention ran 19x slower than PyTorch's on an AVX2-only EPYC; GCC says so with
    this warning."""
    cxx = kernels.compiler()
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:  # the warning is GCC's
        pytest.skip(f"{' '.join(cxx)} is not GCC")
    flags = [f for f in kernels.FLAGS if f not in ("-shared", "-fPIC")]
    cmd = [*cxx, *flags, "-march=x86-64-v3", "-Wno-psabi",
           "-Werror=vector-operation-performance", "-I", jax.ffi.include_dir(), "-I",
           kernels.HEADER_DIR, "-S", kernel.source, "-o", os.devnull]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_command_lists_every_pass(monkeypatch, capsys):
    """`python -m hpnlp.kernels` (here with tuning off: the defaults, nothing measured)."""
    monkeypatch.setenv("HPNLP_KERNEL_TUNE", "0")
    fresh = [tuning.Tuning(t.kernel, t.name, default=t.default, candidates=t.candidates,
                           probe=t.probe, shape=t.shape) for t in list(tuning.REGISTRY)]
    monkeypatch.setattr(tuning, "REGISTRY", fresh)  # unresolved copies: the env applies
    assert tuning.main([]) == 0
    out = capsys.readouterr().out
    for t in fresh:
        assert f"{t.kernel.what}/{t.name}: {t.default} (default)" in out




def test_the_command_names_a_kernel_that_cannot_run_and_refuses_a_retune_with_tuning_off(
        monkeypatch, capsys):
    """A bug hunt (session 90): a kernel that cannot run (no compiler, a damaged library)
    was listed "(default)" as if tuning were off, its reason hidden; and with
    HPNLP_KERNEL_TUNE=0, --retune deleted every saved search and measured nothing."""
    class Broken:  # the kernel's side the command reads
        what = "broken_cpu"

        def available(self):
            return False

        def unavailable_reason(self):
            return "cannot run the C++ compiler"
    t = tuning.REGISTRY[0]
    fresh = tuning.Tuning(Broken(), t.name, default=t.default, candidates=t.candidates,
                          probe=t.probe, shape=t.shape)
    monkeypatch.setattr(tuning, "REGISTRY", [fresh])
    monkeypatch.setenv("HPNLP_KERNEL_TUNE", "1")
    assert tuning.main([]) == 0
    assert (f"broken_cpu/{t.name}: {t.default} (default: the kernel cannot run here: cannot "
            "run the C++ compiler)") in capsys.readouterr().out
    monkeypatch.setenv("HPNLP_KERNEL_TUNE", "0")
    with pytest.raises(SystemExit):
        tuning.main(["--retune"])
    assert "--retune measures the block sizes, which HPNLP_KERNEL_TUNE=0 turns off" in \
        capsys.readouterr().err
    # nor does --repeat say the choices agree, having measured nothing (a review, s. 115)
    with pytest.raises(SystemExit):
        tuning.main(["--repeat", "1"])
    assert "--repeat measures the block sizes, which HPNLP_KERNEL_TUNE=0 turns off" in \
        capsys.readouterr().err


def test_the_command_refuses_a_negative_repeat(capsys):
    """A README walk: `--repeat -1` ran as 0."""
    with pytest.raises(SystemExit):
        tuning.main(["--repeat", "-1"])
    assert "--repeat must be >= 0 (extra searches per pass); got -1" in capsys.readouterr().err


def test_a_library_cut_short_in_the_cache_is_rebuilt_not_loaded(tmp_path):
    """A bug hunt (session 90): a kernel library cut to half its size in the cache (a copy
    that ran out of space) killed the process in the loader with a bus error, no message.
    `load` now rebuilds one whose ELF section table ends past the file, and one that is not
    ELF at all. (A shared object of Python's own stands for a built kernel: nothing
    compiles here.)"""
    import _ctypes
    import shutil
    lib = tmp_path / "lib.so"
    shutil.copy(_ctypes.__file__, lib)
    assert kernels._whole_library(str(lib))
    with open(lib, "r+b") as f:
        f.truncate(os.path.getsize(lib) // 2)
    assert not kernels._whole_library(str(lib))
    assert not kernels._whole_library(str(tmp_path / "missing.so"))  # built on first use
    # not ELF at all: rebuilt too (a review, session 114: left to the loader's "invalid ELF
    # header", never rebuilt, so impl="auto" ran the XLA twins for good, silently)
    for junk in (b"not a library", bytes(4096)):
        lib.write_bytes(junk)
        assert not kernels._whole_library(str(lib))


def test_another_library_in_the_cache_is_a_reason_not_a_traceback(tmp_path):
    """A bug hunt (session 96): a kernel's cached library replaced by another valid one was
    "AttributeError: undefined symbol" rather than the fallback to the XLA twin; the missing
    symbol is now a reason, as a library that will not load is. (Python's own shared
    object stands for the foreign library: nothing compiles here.)"""
    import _ctypes
    import shutil
    lib = tmp_path / "lib.so"
    shutil.copy(_ctypes.__file__, lib)
    k = kernels.CpuKernel("unused.cc", {"hpnlp_test_missing": "HpnlpNoSuchSymbol"},
                          what="a test kernel")
    k.library_path = lambda: str(lib)
    assert not k.available()
    assert re.search(r"lib.so has no symbol HpnlpNoSuchSymbol: not this kernel's library; "
                     r"check the kernel cache .*delete a damaged library", k.unavailable_reason())


@pytest.fixture
def umask_027():
    """A umask other than the usual 022, so that modes are seen to follow it."""
    old = os.umask(0o027)
    yield
    os.umask(old)


@pytest.mark.usefixtures("umask_027")
def test_a_build_without_a_whole_library_fails_and_an_empty_one_is_rebuilt(tmp_path,
                                                                          monkeypatch):
    """A bug hunt (session 97): a compiler that exited 0 without output (CXX=/bin/true)
    left an empty library in the cache, and a library under 64 bytes was never rebuilt, so
    every later process failed to load it; one that exited 1 in silence was a message
    ending in an empty line; a build killed mid-compile left its temporary file for good;
    and the library was 0711 whatever the umask, unreadable in a shared cache. (A script
    copying Python's own shared object stands for the compiler: nothing compiles here.)"""
    import _ctypes
    cache = tmp_path / "cache"
    monkeypatch.setenv("HPNLP_KERNEL_CACHE", str(cache))

    def reason(cxx):
        monkeypatch.setenv("CXX", cxx)
        return kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel").load()

    false = reason("false")
    assert "failed (exit status 1; " in false
    assert false.endswith("(no output; the compiler is $CXX=false)")
    assert re.search(r"with \$CXX=true exited 0 but wrote no whole library \(.*: 0 bytes\); "
                     "set CXX to a C\\+\\+ compiler", reason("true"))
    assert [f for f in os.listdir(cache) if not f.endswith(".lock")] == []
    for head in (b"", b"\x7fEL", b"\x7fELF\x02\x01" + bytes(40)):  # cut within the header
        (tmp_path / "short.so").write_bytes(head)
        assert not kernels._whole_library(str(tmp_path / "short.so"))
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\nfor a; do out="$a"; done\ncp {_ctypes.__file__} "$out"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))  # the compiler names the library
    kernel = kernels.CpuKernel(fused.KERNEL.source, {}, what="a test kernel")
    lib = kernel.library_path()
    with open(lib, "wb") as f:  # zeros a crash left after the build's rename (session 114)
        f.write(bytes(4096))
    assert reason(str(cxx)) is None
    assert os.path.getsize(lib) == os.path.getsize(_ctypes.__file__)
    open(lib, "wb").close()  # what CXX=/bin/true left before the fix
    open(lib + ".abc123.tmp.so", "wb").close()  # a build that was killed
    assert reason(str(cxx)) is None
    assert os.path.getsize(lib) == os.path.getsize(_ctypes.__file__)
    assert os.stat(lib).st_mode & 0o777 == 0o750
    # the killed build's file is gone (the locks of false's and true's builds, named after
    # their compilers, stay)
    assert [f for f in os.listdir(cache) if not f.endswith(".lock")] == [os.path.basename(lib)]


@pytest.mark.usefixtures("tuning_on", "umask_027")
def test_the_tuning_file_is_readable_as_the_umask_allows(tmp_path):
    """A bug hunt (session 97): tuning files were 0600 (mkstemp's) whatever the umask, so a
    cache shared between users could not be read by the others."""
    t = _tuning(tmp_path, {64: 1.0, 128: 1.0}, [])
    t.config()
    assert t.source == "tuned" and os.stat(t.path()).st_mode & 0o777 == 0o640


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), ("Off", False),
                                       ("no", False), ("1", True), ("", True)])
def test_tuning_is_off_for_each_way_of_saying_so(monkeypatch, value, on):
    """A bug hunt (session 90): HPNLP_KERNEL_TUNE=false, off or no tuned, as any value but 0."""
    monkeypatch.setenv("HPNLP_KERNEL_TUNE", value)
    assert tuning.enabled() is on


def test_peak_command_says_why_the_probe_cannot_run(monkeypatch):
    """Found in review: `python -m hpnlp.kernels.peak` without a compiler was a traceback."""
    from hpnlp.kernels import peak
    monkeypatch.setattr(peak.KERNEL, "available", lambda: False)
    monkeypatch.setattr(peak.KERNEL, "unavailable_reason", lambda: "no C++ compiler found")
    with pytest.raises(SystemExit, match="the FMA peak probe cannot run here: no C"):
        peak.main([])


def test_every_kernel_source_compiles_where_a_compiler_is():
    """A review (session 115): a kernel whose source failed to compile was "unavailable", as
    on a machine with no compiler, so every test of it skipped, impl='auto' ran its XLA twin,
    and the suite passed. Where a compiler runs, each source must build (its branches for
    this CPU's instructions included)."""
    from hpnlp.kernels import peak
    if platform.machine() != "x86_64":
        pytest.skip("the kernels target x86-64")
    try:
        subprocess.run([*kernels.compiler(), "--version"], capture_output=True, check=True)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no C++ compiler runs here ({e})")
    for kernel in (F.KERNEL, cache_cpu.KERNEL, fused.KERNEL, exact.KERNEL, qkernels.KERNEL,
                   spmm.KERNEL, peak.KERNEL):
        reason = kernel.unavailable_reason()
        assert reason is None or not reason.startswith("compiling "), reason
