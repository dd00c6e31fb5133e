"""hpnlp.xla_workarounds: the XLA:CPU pad over-read (docs/xla_defects.md) cannot crash a
process that imported hpnlp, and the workaround applies only where it is needed."""

import os
import subprocess
import sys

import pytest

import envlib
from envlib import full_optimization_env
from hpnlp import xla_workarounds as xw
from hpnlp.compile_flags import with_flags, xla_reads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPRO = os.path.join(ROOT, "docs", "repro", "xla_cpu_pad_overread.py")
# Each case starts as a user's process would: full optimization, no hpnlp flag inherited,
# on the CPU (the defect is XLA:CPU's).


# 3.0 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_repro_runs_clean_after_importing_hpnlp():
    code = f"import hpnlp, runpy; runpy.run_path({REPRO!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], env=full_optimization_env(xw.ISA_FLAG, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), (proc.returncode, proc.stderr[-2000:])


# (CPU, jaxlib) pairs on which the reproduction faulted without the workaround; a CPU is its
# (vendor, family, model, stepping) in /proc/cpuinfo. The 2-core Xeon model 167, stepping 1,
# with jaxlib 0.10.2 (SIGSEGV in this test, 2026-12-06). jaxlib 0.11.2 faulted on another
# host (docs/xla_defects.md), whose CPU was not recorded. On other AVX-512 CPUs the back end
# may not emit the unmasked load; a pair goes here once it has been seen faulting.
XEON_167 = ("GenuineIntel", "6", "167", "1")
FAULTED_ON = {(XEON_167, "0.10.2")}


def _ran_clean(cpu: tuple, version: str):
    """A clean run of the reproduction without the workaround on `cpu` with jaxlib `version`:
    a failure where that pair faulted before (XLA may have fixed it), else a skip (found in
    review d2: keyed by the CPU alone, a model-167 Xeon with jaxlib 0.11.2, never seen
    faulting there, failed saying the workaround could be retired for 0.11.2, which faults
    elsewhere)."""
    if (cpu, version) not in FAULTED_ON:
        pytest.skip(f"the over-read was not yet seen faulting here (CPU {cpu}, jaxlib "
                    f"{version}; the unmasked load was not emitted)")
    pytest.fail(f"the pad over-read no longer faults on this CPU {cpu} with jaxlib {version}, "
                f"where it did: the workaround ({xw.ISA_FLAG}) can be retired for jaxlib "
                f"{version} (drop it from xla_workarounds.PAD_OVERREAD_JAXLIB)")


def test_repro_crashes_without_the_workaround_where_it_applies():
    """The defect the workaround exists for is real here; on a CPU where it faulted before
    with this jaxlib, a clean run fails: XLA may have fixed it, and the workaround may go for
    this jaxlib."""
    if xw.pad_overread_flag() is None and xw.ISA_FLAG not in xw.APPLIED:
        pytest.skip("the workaround does not apply to this jaxlib/CPU")
    env = full_optimization_env(xw.ISA_FLAG, HPNLP_XLA_WORKAROUNDS="0", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, REPRO], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == 0:
        from hpnlp import kernels
        info = kernels.cpu_info()
        cpu = tuple(info.get(k, "") for k in ("vendor_id", "cpu family", "model", "stepping"))
        _ran_clean(cpu, xw.importlib.metadata.version("jaxlib"))
    assert proc.returncode in (-11, 139), (proc.returncode, proc.stderr[-2000:])


def test_a_clean_run_fails_only_where_that_cpu_and_jaxlib_faulted():
    with pytest.raises(pytest.fail.Exception, match="can be retired for jaxlib 0.10.2"):
        _ran_clean(XEON_167, "0.10.2")
    for cpu, version in ((XEON_167, "0.11.2"), (("AuthenticAMD", "25", "17", "1"), "0.10.2")):
        with pytest.raises(pytest.skip.Exception, match="not yet seen faulting here"):
            _ran_clean(cpu, version)


def test_flag_only_where_needed(monkeypatch):
    monkeypatch.setattr(xw, "cpu_flags", lambda: {"avx2", "avx512f"})
    monkeypatch.setattr(xw.importlib.metadata, "version", lambda name: xw.PAD_OVERREAD_JAXLIB[0])
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.delenv("HPNLP_XLA_WORKAROUNDS", raising=False)
    assert xw.pad_overread_flag() == xw.ISA_FLAG
    monkeypatch.setenv("HPNLP_XLA_WORKAROUNDS", "0")  # switched off
    assert xw.pad_overread_flag() is None
    # as HPNLP_KERNEL_TUNE reads its switch; an empty own switch is unset (a review,
    # session 115: only an exact "0" was off, and HPNLP_ISA_WORKAROUND= shadowed the global)
    for off in ("false", "Off", " 0", "no"):
        monkeypatch.setenv("HPNLP_XLA_WORKAROUNDS", off)
        assert xw.pad_overread_flag() is None and not xw.malloc_workaround_wanted(), off
    monkeypatch.setenv("HPNLP_ISA_WORKAROUND", "")
    assert xw.pad_overread_flag() is None
    monkeypatch.setenv("HPNLP_ISA_WORKAROUND", "1")  # its own switch wins
    assert xw.pad_overread_flag() == xw.ISA_FLAG
    monkeypatch.delenv("HPNLP_ISA_WORKAROUND")
    monkeypatch.delenv("HPNLP_XLA_WORKAROUNDS")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX512_CORE")  # the user's own choice wins
    assert xw.pad_overread_flag() is None
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(xw, "cpu_flags", lambda: {"avx2"})  # no AVX-512: nothing to avoid
    assert xw.pad_overread_flag() is None
    monkeypatch.setattr(xw, "cpu_flags", lambda: {"avx512f"})
    monkeypatch.setattr(xw.importlib.metadata, "version", lambda name: "0.10.1")  # not seen there
    assert xw.pad_overread_flag() is None


def test_apply_after_the_backend_started_warns_instead(monkeypatch):
    monkeypatch.setattr(xw, "pad_overread_flag", lambda: xw.ISA_FLAG)
    monkeypatch.setattr(xw, "_backend_started", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.warns(RuntimeWarning, match="import hpnlp before"):
        assert xw.apply() == []
    assert os.environ["XLA_FLAGS"] == ""


# An XLA_FLAGS value as docs/benchmarks.md once gave it for the lra bench: the second token is
# a TensorFlow session option, not an XLA flag, and has no leading '-'.
BARE = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _xla_would_read(xla_flags: str) -> list[str]:
    """The tokens XLA reads (xla/parse_flags_from_env.cc, for values without quotes): those
    up to the first that does not start with '-'; it ignores that one and the rest."""
    tokens = xla_flags.split()
    bare = next((i for i, t in enumerate(tokens) if not t.startswith("-")), len(tokens))
    return tokens[:bare]


def test_an_isa_cap_xla_does_not_read_is_not_the_users_choice(monkeypatch):
    """Found in review (d2): `--xla_cpu_max_isa` anywhere in XLA_FLAGS counted as the user's
    cap, also after a bare token, where XLA ignores it: no cap, and no workaround either."""
    monkeypatch.setattr(xw, "cpu_flags", lambda: {"avx2", "avx512f"})
    monkeypatch.setattr(xw.importlib.metadata, "version", lambda name: xw.PAD_OVERREAD_JAXLIB[0])
    monkeypatch.delenv("HPNLP_XLA_WORKAROUNDS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", f"{BARE} --xla_cpu_max_isa=AVX512_CORE")  # not read
    assert xw.pad_overread_flag() == xw.ISA_FLAG
    monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_max_isa=AVX512_CORE {BARE}")  # read: theirs
    assert xw.pad_overread_flag() is None


def test_apply_puts_the_flag_where_xla_reads_it(monkeypatch):
    """Appended after a bare token XLA stopped before the ISA cap: the repro crashed after
    `import hpnlp` on the Xeon model 167 (SIGSEGV) with XLA_FLAGS=BARE."""
    monkeypatch.setattr(xw, "pad_overread_flag", lambda: xw.ISA_FLAG)
    monkeypatch.setattr(xw, "_backend_started", lambda: False)
    monkeypatch.setattr(xw, "malloc_workaround_wanted", lambda: False)
    monkeypatch.setattr(xw, "APPLIED", [])
    monkeypatch.setenv("XLA_FLAGS", BARE)
    assert xw.apply() == [xw.ISA_FLAG]
    assert xw.ISA_FLAG in _xla_would_read(os.environ["XLA_FLAGS"]), os.environ["XLA_FLAGS"]
    assert os.environ["XLA_FLAGS"].endswith("intra_op_parallelism_threads=1")  # the user's, kept
    # A value that does not start with '-' is a file of flags to XLA: left alone, and said so
    monkeypatch.setenv("XLA_FLAGS", "/etc/xla_flags")
    with pytest.warns(RuntimeWarning, match="add --xla_cpu_max_isa=AVX2 to that file"):
        assert xw.apply() == []
    assert os.environ["XLA_FLAGS"] == "/etc/xla_flags"


def test_with_flags_puts_them_where_xla_reads_them():
    device = "--xla_force_host_platform_device_count=8"  # the moe and memory benches' flag
    for have in ("", BARE, f"{BARE} --xla_dump_to=/tmp/d", "  --a=1\t ", "--a=1 x --b=2"):
        got = with_flags(have, [device, "--c=3"])
        assert {device, "--c=3"} <= set(_xla_would_read(got)), (have, got)
        assert [t for t in got.split() if t not in (device, "--c=3")] == have.split(), got
    assert with_flags(f"{BARE} {device}", [device]).split()[1] == device  # read, not skipped
    assert with_flags("--a=1 --b=2", ["--b=2"]) == "--a=1 --b=2"
    with pytest.raises(ValueError, match="XLA_FLAGS='flags.txt' does not start with '-'"):
        with_flags("flags.txt", [device])
    # As XLA's parser reads quotes: a quoted value holds spaces and ends its flag
    assert xla_reads('--a="x y" --b=\'p q\' c --d') == (['--a="x y"', "--b='p q'"], "c --d")
    assert xla_reads('--a="x \\" y" --b=1') == (['--a="x \\" y"', "--b=1"], "")
    assert xla_reads('--a="x"y --b') == (['--a="x"'], "y --b")
    assert xla_reads("--a=1 -") == (["--a=1", "-"], "")


def test_steps_compile_without_ynn_fusions(monkeypatch):
    """Train and eval steps compile with XLA:CPU's YNN fusions off (`train.step`; they ran
    hpnlp's models slower, docs/xla_defects.md), to the same outputs; the day this XLA
    stops making them for a dot and its neighbours shows here."""
    import jax
    import numpy as np

    from hpnlp.train import step

    if jax.default_backend() != "cpu":
        pytest.skip("an XLA:CPU option")
    if not step._xla_knows(tuple(step.CPU_NO_YNN_FUSION_OPTIONS.items())):
        pytest.skip("this jaxlib's XLA has no YNN fusion option")
    options = step.step_compiler_options()
    assert options == {**step.CPU_REMAT_COMPILER_OPTIONS, **step.CPU_NO_YNN_FUSION_OPTIONS}
    f = jax.jit(lambda x, w: jax.nn.log_softmax(jax.nn.gelu(x @ w), axis=-1))
    x = jax.random.normal(jax.random.key(0), (64, 48))
    w = jax.random.normal(jax.random.key(1), (48, 96))
    default, ours = f.lower(x, w).compile(), f.lower(x, w).compile(compiler_options=options)
    assert "__ynn_fusion" in default.as_text()
    assert "__ynn_fusion" not in ours.as_text()
    np.testing.assert_allclose(ours(x, w), default(x, w), rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("HPNLP_XLA_WORKAROUNDS", "0")  # the switch that keeps XLA's default
    assert step.step_compiler_options() == step.CPU_REMAT_COMPILER_OPTIONS


def test_every_step_compiler_option_is_a_documented_defect():
    """docs/xla_defects.md lists each XLA option the train and eval steps compile with (the
    remat one was missing, and it stays on with HPNLP_XLA_WORKAROUNDS=0)."""
    from hpnlp.train import step

    doc = open(os.path.join(ROOT, "docs", "xla_defects.md")).read()
    for options in (step.CPU_REMAT_COMPILER_OPTIONS, step.CPU_NO_YNN_FUSION_OPTIONS):
        for name, value in options.items():
            assert name in doc and value in doc, (name, value)
    assert "cse_barrier_expander` pass off" in doc.split("\n## ")[0]  # the intro says it stays


# A jitted call whose 64 MiB output XLA:CPU allocates with malloc on every call: the page
# faults of each of three calls after 30 (the heap grows over the first few, more of them
# on a busy machine: a call's output is freed a little after the call returns).
FAULTS = """
import os, resource, sys
import hpnlp, jax, jax.numpy as jnp
from hpnlp import xla_workarounds
f = jax.jit(lambda x: x * 2.0 + 1.0)
x = jnp.ones((16 << 20,), jnp.float32)
for _ in range(30):
    jax.block_until_ready(f(x))
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(f(x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults), xla_workarounds.APPLIED)
"""


def _child_env(switch: str) -> dict:
    env = {**full_optimization_env(JAX_PLATFORMS="cpu"), "HPNLP_MALLOC_WORKAROUND": switch}
    for name in [n for n in env if n.startswith("MALLOC_") or n in ("GLIBC_TUNABLES", "LD_PRELOAD")]:
        del env[name]
    return env


@pytest.mark.slow  # 10.7 s in the suite on the 2-core Zen 3 (2026-12-01): CI's slow part runs it
@pytest.mark.skipif(not sys.platform.startswith("linux") or xw._glibc() is None,
                    reason="glibc's mallopt")
def test_xla_buffers_are_not_faulted_in_again_on_every_call():
    """Importing hpnlp keeps the memory XLA:CPU frees for its next call; with
    `HPNLP_MALLOC_WORKAROUND=0` each call faults its output in afresh (16K pages a call)."""
    faults, applied = {}, {}
    for mode, switch in (("import", "1"), ("off", "0")):
        proc = subprocess.run([sys.executable, "-c", FAULTS], env=_child_env(switch),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        count, _, applied[mode] = proc.stdout.strip().partition(" ")
        faults[mode] = int(count)
    assert "M_MMAP_MAX=0" in applied["import"] and "M_MMAP_MAX" not in applied["off"], applied
    if faults["off"] < 1000:
        pytest.skip(f"huge pages back the output here: {faults['off']} faults a call without the setting")
    assert faults["import"] * 10 < faults["off"], faults


def test_malloc_workaround_only_where_wanted(monkeypatch):
    for name in ("HPNLP_XLA_WORKAROUNDS", "HPNLP_MALLOC_WORKAROUND", "GLIBC_TUNABLES",
                 "LD_PRELOAD", "JAX_PLATFORMS"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(xw, "_glibc", lambda: object())
    monkeypatch.setattr(xw.importlib.metadata, "distributions", lambda: [])
    assert xw.malloc_workaround_wanted()
    for name, value in (("HPNLP_MALLOC_WORKAROUND", "0"), ("HPNLP_XLA_WORKAROUNDS", "0"),
                        ("MALLOC_ARENA_MAX", "4"), ("MALLOC_ARENA_TEST", "2"), ("MALLOC_MMAP_THRESHOLD_", "65536"),
                        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
                        ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2"), ("JAX_PLATFORMS", "cuda")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert not xw.malloc_workaround_wanted(), name  # switched off, or the user's choice
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(xw.importlib.metadata, "distributions",  # a CUDA plugin, but on the CPU
                        lambda: [type("D", (), {"metadata": {"Name": "jax-cuda13-plugin"}})()])
    assert xw.malloc_workaround_wanted()
    monkeypatch.delenv("JAX_PLATFORMS")
    assert not xw.malloc_workaround_wanted()
    monkeypatch.setenv("HPNLP_XLA_WORKAROUNDS", "0")
    monkeypatch.setenv("HPNLP_MALLOC_WORKAROUND", "1")  # this one kept, the others off
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert xw.malloc_workaround_wanted()
    monkeypatch.setattr(xw, "_glibc", lambda: None)  # not glibc: nothing to call
    assert not xw.malloc_workaround_wanted()


def test_cache_workaround_only_on_several_simulated_cpu_devices(monkeypatch):
    """XLA:CPU's cached multi-device programs can deadlock (docs/xla_defects.md): a process
    simulating several CPU devices on jaxlib 0.10.2 keeps out of the persistent compilation
    cache, and only such a process (tests/test_crash_hunt.py runs the deadlock)."""
    import jax
    for name in ("HPNLP_XLA_WORKAROUNDS", "HPNLP_CACHE_WORKAROUND", "JAX_NUM_CPU_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(xw.importlib.metadata, "version",
                        lambda name: xw.CACHED_COLLECTIVES_JAXLIB[0])
    count = "--xla_force_host_platform_device_count="
    for flags, n in (("", 1), (count + "4", 4), (count + "1", 1), (f"{count}8 {count}2", 2),
                     (f"{BARE} {count}4", 1)):  # XLA stops reading at the bare token
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert xw.host_devices() == n, flags
        assert xw.cache_workaround_wanted() == (n > 1), flags
    for env, flags, n in (("4", "", 4), ("1", count + "4", 1)):  # JAX's own setting wins
        with monkeypatch.context() as m:
            m.setenv("JAX_NUM_CPU_DEVICES", env)
            m.setenv("XLA_FLAGS", flags)
            assert xw.host_devices() == n and xw.cache_workaround_wanted() == (n > 1), env
    with monkeypatch.context() as m:  # set in code (a review, session 117: missed)
        import sys
        import types
        m.setenv("XLA_FLAGS", "")
        m.setitem(sys.modules, "jax", types.SimpleNamespace(
            config=types.SimpleNamespace(jax_num_cpu_devices=4)))
        assert xw.host_devices() == 4 and xw.cache_workaround_wanted()
        # over the variable, which JAX read at import and the code replaced since (a review,
        # session 118: the variable's 1 was taken, the cache kept on for 4 devices)
        m.setenv("JAX_NUM_CPU_DEVICES", "1")
        assert xw.host_devices() == 4 and xw.cache_workaround_wanted()
    monkeypatch.setenv("XLA_FLAGS", count + "4")
    with monkeypatch.context() as m:  # meshes of CPU devices beside an accelerator
        m.setenv("JAX_PLATFORMS", "cuda,cpu")
        assert xw.cache_workaround_wanted()
    for name, value in (("HPNLP_CACHE_WORKAROUND", "0"), ("HPNLP_XLA_WORKAROUNDS", "0")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert not xw.cache_workaround_wanted(), name
    monkeypatch.setenv("HPNLP_XLA_WORKAROUNDS", "0")
    monkeypatch.setenv("HPNLP_CACHE_WORKAROUND", "1")  # this one kept, the others off
    assert xw.cache_workaround_wanted()
    monkeypatch.setattr(xw.importlib.metadata, "version", lambda name: "0.10.1")  # not seen
    assert not xw.cache_workaround_wanted()
    # apply() turns the cache off (recorded, not done: this process keeps its cache)
    updates = []
    monkeypatch.setattr(xw, "cache_workaround_wanted", lambda: True)
    monkeypatch.setattr(xw, "pad_overread_flag", lambda: None)
    monkeypatch.setattr(xw, "malloc_workaround_wanted", lambda: False)
    monkeypatch.setattr(xw, "APPLIED", [])
    monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
    from jax._src import compilation_cache
    monkeypatch.setattr(compilation_cache, "reset_cache", lambda: updates.append("reset"))
    assert xw.apply() == [xw.CACHE_SETTING] and xw.apply() == []  # once a process
    # JAX asks whether to use the cache again (its answer is kept from its first compile)
    assert updates == [("jax_enable_compilation_cache", False), "reset"]
    assert xw.APPLIED == [xw.CACHE_SETTING]
    # devices asked for after the import: a mesh's making turns it off (a review, s117)
    monkeypatch.setattr(xw, "APPLIED", [])
    from hpnlp.config import MeshConfig
    from hpnlp.parallel import make_mesh
    make_mesh(MeshConfig(), jax.devices()[:1])
    assert xw.APPLIED == [xw.CACHE_SETTING] and updates[2:] == updates[:2]


def test_cheap_compile_flags_only_what_the_jaxlib_knows(monkeypatch):
    # XLA aborts on a flag it does not know: jaxlib 0.11.2 dropped the fusion-emitter one.
    # The codegen-split one is passed to the same versions (not checked on newer ones).
    pinned = envlib.cheap_compile_flags("0.10.2")
    assert envlib.FUSION_EMITTER_FLAG in pinned and envlib.CODEGEN_SPLIT_FLAG in pinned
    newer = envlib.cheap_compile_flags("0.11.2")
    assert envlib.FUSION_EMITTER_FLAG not in newer and len(newer) == 2
    if not os.environ.get("HPNLP_TEST_FULL_OPT"):  # this run's flags, each once
        flags = os.environ["XLA_FLAGS"].split()
        assert all(flags.count(f) == 1 for f in envlib.cheap_compile_flags())
    assert envlib.with_flags("--a=1 --b=2", ["--b=2", "--c=3"]) == "--a=1 --b=2 --c=3"
    monkeypatch.setenv("XLA_FLAGS", f"--keep=1 {' '.join(pinned)}")
    assert full_optimization_env()["XLA_FLAGS"] == "--keep=1"
