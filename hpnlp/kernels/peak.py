"""The cores' float32 FMA peak, measured: the ceiling no float32 kernel can pass here.

    python -m hpnlp.kernels.peak        # GFLOP/s on all cores, and on one

`fma_peak()` runs `peak.cc`'s register-only loop of vector FMAs on every core at once and
returns the fastest of a few timings in GFLOP/s. The benchmarks' "measured matrix-product
rate" is XLA's own product, which sits near this peak on a quiet machine but can read
lower (a drifting VM, a library below the peak), so a report that says a target asks a
kernel for more than 100% of that rate also states the share of this peak (`hpnlp.bench
rnn`): above 100% here, no float32 kernel can meet it on this CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import os

from hpnlp import kernels
from hpnlp.kernels import tuning

KERNEL = kernels.CpuKernel(os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak.cc"),
                           {}, what="the FMA peak probe")


def _query(lib, symbol: str) -> int:
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int64
    return fn()


def accumulators() -> int:
    """Independent vector FMAs in each round of the probe's loop."""
    return _query(KERNEL.library(), "hpnlp_fma_accumulators")


def fma_peak(threads: int | None = None, *, min_time_s: float = 0.3, rounds: int = 5) -> float:
    """GFLOP/s of float32 FMAs on `threads` threads (default: every core this process may
    use): the fastest of `rounds` timings of about `min_time_s / rounds` each, after one
    warm-up (the first lets the clocks rise). RuntimeError where the probe cannot be
    built (no compiler, or the backend is not a CPU)."""
    threads = threads or kernels.cores()
    lib = KERNEL.library()
    flops_per_iter = 2 * threads * _query(lib, "hpnlp_fma_lanes") * accumulators()

    def seconds(iters):
        return tuning.run_probe(lib, "hpnlp_fma_peak", (threads, iters), "the FMA peak probe",
                                {"threads": threads, "iters": iters})

    iters = 1 << 16
    while (t := seconds(iters)) < min_time_s / rounds / 4:  # also the warm-up
        iters *= 4
    iters = max(1, int(iters * (min_time_s / rounds) / t))
    best = min(seconds(iters) for _ in range(rounds))
    return flops_per_iter * iters / best / 1e9


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="default: every core")
    args = p.parse_args(argv)
    if args.threads is not None and not 1 <= args.threads <= kernels.cores():
        p.error(f"--threads must be from 1 to {kernels.cores()}, the cores this process may "
                f"use (more would time threads taking turns); got {args.threads}")
    threads = args.threads or kernels.cores()
    if not KERNEL.available():  # found in review: a traceback where no compiler was found
        raise SystemExit(f"hpnlp.kernels.peak: error: the FMA peak probe cannot run here: "
                         f"{KERNEL.unavailable_reason()}")
    print(f"float32 FMA peak: {fma_peak(threads):.1f} GFLOP/s on {threads} thread(s)")
    if threads > 1:
        print(f"float32 FMA peak: {fma_peak(1):.1f} GFLOP/s on 1 thread")


if __name__ == "__main__":
    main()
