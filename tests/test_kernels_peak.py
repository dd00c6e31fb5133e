"""The FMA peak probe (hpnlp.kernels.peak): it runs, refuses bad arguments, and its loop is
the register-only FMAs it claims (checked in the compiler's output, native and AVX2), so
the ceiling it reports cannot silently be a loop the compiler dropped or spilled. No
timing assertions."""

import math
import platform
import re
import subprocess

import jax
import pytest

from hpnlp import kernels
from hpnlp.kernels import peak

needs_probe = pytest.mark.kernel(peak.KERNEL)


@needs_probe
def test_fma_peak_is_a_finite_positive_rate():
    assert math.isfinite(g := peak.fma_peak(1, min_time_s=0.02, rounds=2)) and g > 0, g


@needs_probe
def test_the_probe_refuses_bad_arguments():
    with pytest.raises(RuntimeError, match="the FMA peak probe failed"):
        kernels.tuning.run_probe(peak.KERNEL.library(), "hpnlp_fma_peak", (0, 10),
                                 "the FMA peak probe", {})


@pytest.mark.parametrize("threads", ["0", "100000"])  # more than the cores: a README walk
def test_the_command_refuses_a_thread_count_outside_the_cores(capsys, threads):
    with pytest.raises(SystemExit):
        peak.main(["--threads", threads])
    assert (f"--threads must be from 1 to {kernels.cores()}, the cores this process may use"
            in capsys.readouterr().err)


@needs_probe
# The portable build's case in CI's slow part (7.5 s in the suite, most of it the FFI header
# and GCC; on an AVX2-only CPU both builds have the same 16 ymm registers).
@pytest.mark.parametrize("march", ["native", pytest.param("x86-64-v3", marks=pytest.mark.slow)])
def test_the_loop_is_register_only_fmas(march):
    if platform.machine() != "x86_64":
        pytest.skip("reads x86 assembly")
    try:
        cxx = kernels.compiler()
    except RuntimeError:
        pytest.skip("needs GCC")
    if "Free Software Foundation" not in subprocess.run(
            [*cxx, "--version"], capture_output=True, text=True).stdout:
        pytest.skip("needs GCC")
    flags = [f for f in kernels.FLAGS if f not in ("-shared", "-fPIC")]
    proc = subprocess.run([*cxx, *flags, f"-march={march}", "-Wno-psabi",
                           "-Werror=vector-operation-performance", "-I", jax.ffi.include_dir(),
                           "-I", kernels.HEADER_DIR, "-S", peak.KERNEL.source, "-o", "-"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the innermost loop: a block of vfmadd on registers closed by a backward jump
    loops = re.findall(r"\n(\.L\d+):\n((?:\t[^\n]*\n)+?)\tj\w+\t\1\n", proc.stdout)
    fma_loops = [body for _, body in loops if "vfmadd" in body]
    assert fma_loops, proc.stdout[-3000:]
    body = fma_loops[0]
    assert body.count("vfmadd") == peak.accumulators(), body
    assert not re.search(r"vfmadd\S*\s+[^\n]*\(", body), body  # no memory operand
    assert not re.search(r"\bvmov\S*\s+%[xyz]mm\d+, [^\n]*\(", body), body  # no spill
