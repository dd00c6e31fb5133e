"""hpnlp.xla_workarounds: the XLA:CPU pad over-read (docs/xla_defects.md) cannot crash a
process that imported hpnlp, and the workaround applies only where it is needed."""

import os
import subprocess
import sys

import pytest

from envlib import full_optimization_env
from hpnlp import xla_workarounds as xw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPRO = os.path.join(ROOT, "docs", "repro", "xla_cpu_pad_overread.py")
# Each case starts as a user's process would: full optimization, no hpnlp flag inherited,
# on the CPU (the defect is XLA:CPU's).


def test_repro_runs_clean_after_importing_hpnlp():
    code = f"import hpnlp, runpy; runpy.run_path({REPRO!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], env=full_optimization_env(xw.ISA_FLAG, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), (proc.returncode, proc.stderr[-2000:])


def test_repro_crashes_without_the_workaround_where_it_applies():
    """The defect the workaround exists for is real here (and would tell us once XLA fixes it)."""
    if xw.pad_overread_flag() is None and not xw.APPLIED:
        pytest.skip("the workaround does not apply to this jaxlib/CPU")
    env = full_optimization_env(xw.ISA_FLAG, HPNLP_XLA_WORKAROUNDS="0", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, REPRO], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        pytest.skip("the over-read does not fault on this CPU (the unmasked load was not emitted)")
    assert proc.returncode in (-11, 139), (proc.returncode, proc.stderr[-2000:])


def test_flag_only_where_needed(monkeypatch):
    monkeypatch.setattr(xw, "cpu_flags", lambda: {"avx2", "avx512f"})
    monkeypatch.setattr(xw.importlib.metadata, "version", lambda name: xw.PAD_OVERREAD_JAXLIB[0])
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.delenv("HPNLP_XLA_WORKAROUNDS", raising=False)
    assert xw.pad_overread_flag() == xw.ISA_FLAG
    monkeypatch.setenv("HPNLP_XLA_WORKAROUNDS", "0")  # switched off
    assert xw.pad_overread_flag() is None
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
