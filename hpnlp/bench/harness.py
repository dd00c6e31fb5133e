"""The timing harness every speed claim in hpnlp goes through.

Rules it enforces: compile and warm up outside the timing; block until results are
ready; repeat and report median with min and max; measure memory twice, from the
compiled executable (`memory_analysis()`) and as the peak resident memory of a fresh
process per configuration (`isolated`); compare only within one run, and state the
machine it ran on (`machine_info`) and that machine's own matrix-product rate
(`matmul_rate`), the ceiling that kernels are measured against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Timing:
    median_s: float
    min_s: float
    max_s: float
    repeats: int
    compile_s: float
    # True when the one timed call was the warm-up call itself (`time_jax`'s `max_time_s`).
    first_call_only: bool = False
    # The timed executable's `memory_analysis()` (see `compiled_memory`); None for Python
    # callables. Kept out of `as_dict`: it is reported on its own.
    memory: dict | None = dataclasses.field(default=None, compare=False)

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "memory"}


def _block(x):
    return jax.block_until_ready(x)


def compile_timed(fn: Callable, *args, compiler_options: dict | None = None):
    """(`jax.jit(fn)` compiled for `args`, seconds the lowering and compile took)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn, compiler_options=compiler_options).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def time_jax(fn: Callable, *args, repeats: int = 5, warmup: int = 1, min_time_s: float = 0.0,
             max_time_s: float | None = None, compiler_options: dict | None = None) -> Timing:
    """Time a jitted `fn(*args)`: compile first (timed separately), warm up, then repeat.

    `min_time_s` raises the repeat count for very fast functions so the median is not
    noise, up to 50 repeats; `max_time_s` bounds the warm-up and the repeats together,
    judged by the warm-up call: the repeats are lowered (to at least 1) so that they and
    the warm-up fit in it. A warm-up call that alone takes `max_time_s` or more is the
    timing (`first_call_only`; the compile is still outside it): on a machine whose speed
    drifts by more than a first call's extra cost, one more such call would add minutes
    and tell little. The result's `memory` is the
    timed executable's memory (as `compiled_memory` reports it), from the same compile.
    `compiler_options` go to `jax.jit` (e.g. `train.step.step_compiler_options()`).
    """
    compiled, compile_s = compile_timed(fn, *args, compiler_options=compiler_options)
    memory = executable_memory(compiled)
    for _ in range(warmup):
        t = time.perf_counter()
        _block(compiled(*args))
        dt = time.perf_counter() - t
        if max_time_s is not None:
            if dt >= max_time_s:
                return Timing(dt, dt, dt, 1, compile_s, True, memory)
            repeats = max(1, min(repeats, int((max_time_s - dt) / max(dt, 1e-9))))
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_time_s and len(times) < 50):
        t = time.perf_counter()
        _block(compiled(*args))
        times.append(time.perf_counter() - t)
    return Timing(statistics.median(times), min(times), max(times), len(times), compile_s,
                  memory=memory)


def time_python(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1, min_time_s: float = 0.0) -> Timing:
    """Time a zero-argument callable that blocks on its own (e.g. a PyTorch call)."""
    t0 = time.perf_counter()
    fn()
    compile_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        fn()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_time_s and len(times) < 50):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return Timing(statistics.median(times), min(times), max(times), len(times), compile_s)


def time_interleaved(calls: dict, *, repeats: int = 5, warmup: int = 1,
                     min_time_s: float = 0.0) -> dict:
    """Time several zero-argument blocking callables in rounds, one call of each per round,
    so a machine whose speed drifts over minutes (a shared VM) slows every contender alike
    and their ratios stay fair. Returns {key: (Timing, fastest process CPU seconds of a
    call)}; `compile_s` is the first (warm-up) call's time. Rounds go on until every
    callable has `repeats` calls and `min_time_s` of time in total (at most 50 rounds)."""
    first = {}
    for key, fn in calls.items():
        t0 = time.perf_counter()
        for _ in range(max(warmup, 1)):
            fn()
        first[key] = time.perf_counter() - t0
    wall = {k: [] for k in calls}
    cpu = {k: [] for k in calls}
    rounds = 0
    while calls and (rounds < repeats or (min(sum(v) for v in wall.values()) < min_time_s
                                          and rounds < 50)):
        rounds += 1
        for key, fn in calls.items():
            c, t = time.process_time(), time.perf_counter()
            fn()
            wall[key].append(time.perf_counter() - t)
            cpu[key].append(time.process_time() - c)
    return {k: (Timing(statistics.median(w), min(w), max(w), len(w), first[k]), min(cpu[k]))
            for k, w in wall.items()}


def compiled_memory(fn: Callable, *args) -> dict:
    """Bytes the compiled executable needs: arguments, outputs and temporaries."""
    return executable_memory(jax.jit(fn).lower(*args).compile())


def executable_memory(compiled) -> dict:
    """`compiled.memory_analysis()` as a dict of byte counts, with their `total_bytes`."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    out = {k: int(getattr(ma, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                              "temp_size_in_bytes", "alias_size_in_bytes")
           if hasattr(ma, k)}
    out["total_bytes"] = (out.get("argument_size_in_bytes", 0) + out.get("output_size_in_bytes", 0)
                          + out.get("temp_size_in_bytes", 0) - out.get("alias_size_in_bytes", 0))
    return out


# where Linux keeps this process image's own high-water mark (`peak_rss_bytes`)
PROC_STATUS = "/proc/self/status"


def peak_rss_bytes() -> int:
    """Peak resident memory of this process image so far: Linux's `VmHWM`, which starts at
    zero at exec. Not `ru_maxrss` there: it survives exec, so a child that `subprocess.run`
    starts (vfork) begins at its parent's peak, and every `isolated` row read at least the
    bench parent's peak (a review, session 109: a 14 MiB child read 1051 MiB under a parent
    that had touched 1 GiB). Without /proc (macOS, which resets it at exec) `ru_maxrss`:
    KiB on Linux, bytes on macOS (a review, session 107: every macOS "peak RSS MiB" cell read
    1024 times its size)."""
    try:
        with open(PROC_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):  # "VmHWM:\t   13676 kB"
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
        1 if sys.platform == "darwin" else 1024)


def positive_ints(example: str) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated positive integers (`example` shows the form)."""
    import argparse

    def parse(text: str) -> list[int]:
        try:
            out = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                             f"integers (e.g. {example})") from None
        if not out:
            raise argparse.ArgumentTypeError(f"{text!r} names no value (e.g. {example})")
        if any(n < 1 for n in out):
            raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
        return out
    return parse


def positive_number(kind: type = int) -> Callable[[str], int | float]:
    """An argparse type: one number of `kind` (int or float) above zero."""
    import argparse

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be > 0 (leave the flag out for the default)")
        return value
    return parse


def add_isolate_flag(p) -> None:
    """`--no-isolate`, as the benches that measure each row in a fresh process offer it."""
    p.add_argument("--no-isolate", action="store_true",
                   help="measure in this process (faster; no per-configuration peak RSS); "
                        "--quick always does")


def names_from(allowed: Callable[[], Iterable[str]] | Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of names, each one of `allowed` (or of what it returns,
    asked when the flag is read). A comma inside parentheses belongs to the name, so
    `hpnlp LSTM (scan, one product)` is one name."""
    import argparse

    def parse(text: str) -> list[str]:
        choices = list(allowed() if callable(allowed) else allowed)
        out = list(dict.fromkeys(n.strip() for n in re.split(r",(?![^()]*\))", text) if n.strip()))
        if not out:
            raise argparse.ArgumentTypeError(f"{text!r} names nothing; choose from {choices}")
        bad = [n for n in out if n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {choices}, comma-separated")
        return out
    return parse


def on_accelerator() -> bool:
    """True when JAX runs on a GPU or TPU: memory is then the device's, not RSS."""
    return jax.default_backend() != "cpu"


def _device_stats() -> dict:
    stats = jax.local_devices()[0].memory_stats() if on_accelerator() else None
    return stats or {}


def peak_device_bytes() -> int | None:
    """Peak bytes in use on JAX's first device so far in this process (its allocator's
    count); None on a CPU, where `peak_rss_bytes` is the measure."""
    return _device_stats().get("peak_bytes_in_use")


def memory_capacity_bytes() -> int:
    """Memory the computation runs in: the first accelerator's allocatable bytes (JAX's
    allocator limit), else this machine's RAM. Benchmarks skip a configuration estimated to
    need over a fraction of it."""
    return int(_device_stats().get("bytes_limit")
               or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def full_float32_on_gpu() -> None:
    """On a GPU, float32 products at float32 precision ("highest", unless the user chose one
    through JAX_DEFAULT_MATMUL_PRECISION), as PyTorch's are by default (TF32 off): the
    float32 rows of a benchmark then compare like with like. Set in the environment too,
    for `isolated` workers. Nothing changes on a CPU."""
    if jax.default_backend() == "gpu" and not jax.config.jax_default_matmul_precision:
        jax.config.update("jax_default_matmul_precision", "highest")
        os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"


def float32_precision() -> str:
    """How float32 products run: JAX's `jax_default_matmul_precision`, else XLA's default
    for the backend (on a GPU that is TF32, on a CPU full float32)."""
    set_to = jax.config.jax_default_matmul_precision
    if set_to:
        return str(set_to)
    return "default (TF32 on NVIDIA GPUs)" if jax.default_backend() == "gpu" else "default"


def matmul_rate(dtype=jnp.float32, n: int = 2048, repeats: int = 5, min_time_s: float = 1.0,
                warmup: int = 3) -> float:
    """This machine's dense matrix-product rate in GFLOP/s (the ceiling for kernels).

    A ceiling, so the best call counts: after three warm-up calls (the first calls of a
    process run slower while its thread pool starts), the fastest of `min_time_s` of calls.
    This machine's speed drifts (a 2-core VM: the median of a short run read 145 and then
    287 GFLOP/s minutes apart), so compare kernels with peers timed in the same run, or
    probe the rate again beside a timing that was not (a shorter `min_time_s`, and fewer
    `warmup` calls: the fastest call counts, so a slow first one changes nothing)."""
    run, flops = matmul_call(dtype, n, calls=1)
    t = time_python(run, repeats=repeats, warmup=warmup, min_time_s=min_time_s)
    return flops / t.min_s / 1e9


def ceiling_rates(dtypes=(jnp.float32,), *, quick: bool) -> dict:
    """{dtype name: `matmul_rate`}: the ceiling a benchmark's header records. `quick` (the
    `--quick` runs): 1024 x 1024 products for 0.25 s each instead of 2048 x 2048 for 1 s,
    a rougher ceiling in a fifth of the time."""
    kw = dict(n=1024, min_time_s=0.25) if quick else {}
    if on_accelerator():  # products of 2048 would time its launch more than its math
        kw = dict(n=4096 if quick else 8192, min_time_s=0.25 if quick else 1.0)
    return {jnp.dtype(d).name: matmul_rate(d, **kw) for d in dtypes}


def fma_peak() -> float | None:
    """The cores' float32 FMA peak in GFLOP/s (`hpnlp.kernels.peak`: registers only, every
    core at once), the ceiling above `matmul_rate` that no float32 kernel can pass; None
    off a CPU or where the probe cannot be built (no compiler)."""
    if jax.default_backend() != "cpu":
        return None
    from hpnlp.kernels import peak
    try:
        return peak.fma_peak()
    except RuntimeError:
        return None


@functools.lru_cache(maxsize=None)
def _compiled_matmul(dtype, n: int):
    """Compiled once per process: rate probes beside every timing then cost no compile."""
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    return jax.jit(lambda a, b: a @ b).lower(a, b).compile(), a, b


def matmul_call(dtype=jnp.float32, n: int = 2048, calls: int = 3):
    """(blocking zero-argument callable, its FLOPs): `calls` n x n products, the unit that
    `matmul_rate` times, for timing the machine's rate interleaved with a kernel
    (`time_interleaved`), so a drifting machine slows the kernel and its ceiling alike."""
    mm, a, b = _compiled_matmul(jnp.dtype(dtype), n)

    def run():
        for _ in range(calls):
            _block(mm(a, b))
    return run, 2 * n ** 3 * calls


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:
        return None


# The instruction-set extensions hpnlp's kernels choose paths by (`/proc/cpuinfo` flags).
KERNEL_ISA = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_vpopcntdq", "amx_bf16", "amx_int8", "amx_tile")


def _cache_bytes(size: str) -> int:
    """A sysfs cache size ("48K", "2048K", "32M" or plain bytes) in bytes."""
    size = size.strip()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:].upper(), 1)
    return int(size[:-1] if scale > 1 else size) * scale


# cpu_detail's names of the /proc/cpuinfo fields that tell one CPU model from another: x86's,
# then Arm's, which has no vendor, family or model line (session 107: an aarch64 header read
# "- CPU: ?"); `CPU_IDS` are those after the vendor, in the order a report names them
CPU_FIELDS = {"vendor_id": "vendor", "cpu family": "family", "model": "model",
              "stepping": "stepping", "CPU implementer": "implementer", "CPU part": "part",
              "CPU variant": "variant", "CPU revision": "revision"}
CPU_IDS = tuple(name for name in CPU_FIELDS.values() if name != "vendor")


def cpu_detail(cpuinfo: str | None = None,
               cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> dict:
    """The first CPU's identity, the `KERNEL_ISA` extensions it has and its cache sizes:
    {"vendor", "family", "model", "stepping" (x86), "implementer", "part", "variant",
    "revision" (Arm), "features": sorted list, "cache_bytes": {"l1d", "l2", "l3"}}. The
    model name alone cannot tell a VM's Xeon generations apart ("Intel(R) Xeon(R)
    Processor"), and an Arm CPU has none. Fails soft: what a file does not say is left out.
    `cpuinfo` is read as the kernels read /proc/cpuinfo, the default (`kernels.cpu_info`)."""
    from hpnlp import kernels  # one parser of cpuinfo's first block (a bug hunt, session 102)
    out: dict = {}
    fields = kernels.cpu_info() if cpuinfo is None else kernels._read_cpuinfo(cpuinfo)
    for key, name in CPU_FIELDS.items():
        if key in fields:
            out[name] = int(fields[key]) if fields[key].isdigit() else fields[key]
    flags = fields.get("flags", fields.get("Features"))
    if flags is not None:
        have = set(flags.split())
        out["features"] = sorted(x for x in KERNEL_ISA if x in have)
    def read(*path):
        with open(os.path.join(cache_dir, *path)) as f:
            return f.read().strip()

    caches = {}
    try:
        entries = sorted(e for e in os.listdir(cache_dir) if e.startswith("index"))
    except OSError:
        entries = []
    for entry in entries:
        try:
            name = {("1", "Data"): "l1d", ("2", "Unified"): "l2", ("3", "Unified"): "l3"}.get(
                (read(entry, "level"), read(entry, "type")))
            if name:
                caches[name] = _cache_bytes(read(entry, "size"))
        except (OSError, ValueError):
            continue
    if caches:
        out["cache_bytes"] = caches
    return out


def kernel_info() -> dict:
    """What hpnlp's CPU kernels run with on this machine: each kernel pass's block sizes
    (tuned per CPU, or the defaults; resolving them measures them if not cached) and how
    the bfloat16 attention kernel's products run. Empty where the kernels cannot build,
    and when JAX runs on an accelerator (the kernels are then not used); on a GPU, the
    block sizes `chunked`'s Pallas kernels take at head dim 64 (`flash_gpu.default_blocks`)."""
    if jax.default_backend() == "gpu":
        from hpnlp.attention import flash_gpu
        return {"flash_gpu_blocks": {flash_gpu.tuned_key(dt, 64): flash_gpu.default_blocks(dt, 64)
                                     for dt in (jnp.float32, jnp.bfloat16)}}
    if on_accelerator():  # the run's computations are not on the CPU: nothing to build
        return {}
    from hpnlp.attention import flash_cpu
    from hpnlp.kernels import tuning
    from hpnlp.rnn import fused  # noqa: F401  (registers its tunings)
    if not flash_cpu.KERNEL.available():
        return {}
    return {"tuning": {name: {"config": t["config"], "source": t["source"]}
                       for name, t in tuning.summary().items()},
            "bf16_products": flash_cpu.bf16_products()}


def cpu_model() -> str:
    """The CPU's name: /proc/cpuinfo's model name; on macOS, sysctl's brand string ("Apple
    M2"); else the architecture (an Arm Linux has no model name: `cpu_detail` then names its
    implementer and part)."""
    from hpnlp import kernels
    name = kernels.cpu_info().get("model name")
    if not name and sys.platform == "darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            name = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
    return name or platform.processor() or platform.machine()


def machine_info() -> dict:
    from hpnlp import kernels
    cpu = cpu_model()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_detail": cpu_detail(),
        # the cores this process may run on (its affinity: a cpuset, `taskset`), which hpnlp's
        # kernels, XLA and the PyTorch peers (`torch_or_none`) use; the host may have more
        "cores": kernels.cores(),
        "host_cpus": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "float32_precision": float32_precision(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in ("jax", "jaxlib", "flax", "optax", "numpy", "torch")},
    }


def torch_or_none():
    """PyTorch if installed (the `bench` extra), else None: a peer is then 'skipped'. Its
    threads are the cores this process may run on (`kernels.cores()`, what hpnlp's kernels
    and XLA use), not the host's: more would oversubscribe the peer under a cpuset (review
    r6: it was given `os.cpu_count()`, and a slowed peer read as a met target)."""
    try:
        import torch
    except ImportError:
        return None
    from hpnlp import kernels
    torch.set_num_threads(kernels.cores())
    return torch


def torch_device(torch) -> str:
    """Where a PyTorch peer runs: on the GPU when JAX runs on one and this torch build
    sees it, so both sides of a comparison use the same chip; else the CPU."""
    if jax.default_backend() == "gpu" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def torch_synced(torch, device: str, fn: Callable[[], Any]) -> Callable[[], None]:
    """`fn` made blocking for `time_python`: a CUDA call returns before the GPU finishes."""
    if device != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize()
    return run


def isolated(module: str, spec: dict, *, timeout_s: float = 600) -> dict:
    """Run one configuration in a fresh Python process and return its JSON result.

    The child runs `python -m <module> --worker '<json spec>'` and prints one JSON line;
    its peak RSS is then the honest peak of that configuration alone. A crash, a kill by
    the OOM killer or a timeout comes back as {"status": "failed: ..."}, never as a crash
    of the whole benchmark.
    """
    cmd = [sys.executable, "-m", module, "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: timeout after {timeout_s:.0f} s"}
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        if proc.returncode in (-9, 137):
            tail = ["killed (out of memory?)"]
        return {"status": f"failed: {tail[0][:200]}"}
    return json.loads(lines[-1])


def time_torch(torch, device: str, call: Callable[[], Any], **kw) -> tuple[Timing, int | None]:
    """(`time_python` of a PyTorch `call` on `device`, synchronized on CUDA, and its peak
    CUDA memory from `max_memory_allocated`, reset first; None off CUDA)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time_python(torch_synced(torch, device, call), **kw)
    return t, (torch.cuda.max_memory_allocated() if device == "cuda" else None)


def measure_row(module: str, measure: Callable[[dict], dict], spec: dict, head: dict, *,
                isolate: bool, own_peak: bool) -> dict:
    """One benchmark row: `measure(spec)` in a fresh process (`isolated`) or in this one, a
    failure reported in the row, never raised. In this process the peaks are not the row's
    own (dropped), except one the row measured itself (`own_peak`: PyTorch's, reset per
    row)."""
    if isolate:
        return {**head, **isolated(module, spec, timeout_s=1800)}
    try:
        res = measure(spec)
    except Exception as e:  # report, never crash the whole run
        return {**head, "status": f"failed: {type(e).__name__}: {str(e)[:150]}"}
    res.pop("peak_rss_bytes", None)
    if not own_peak:
        res.pop("peak_device_bytes", None)
    return {**head, **res}


def too_big(need_bytes: float, fraction: float) -> str | None:
    """A row's 'skipped: ...' status when its estimated need is over `fraction` of
    `memory_capacity_bytes()`; None when it fits."""
    cap = memory_capacity_bytes()
    if need_bytes <= fraction * cap:
        return None
    where = "device memory" if on_accelerator() else "memory"
    return f"skipped: needs ~{need_bytes / 2**30:.0f} GiB ({where}: {cap / 2**30:.0f})"


INTERRUPTED = "not run: interrupted"


class BenchInputError(ValueError):
    """A bench's input refused, in one line: `python -m hpnlp.bench` says it as a usage error;
    a notebook or script that calls a bench's `run` gets an exception it can catch (a bug
    hunt, session 95: a SystemExit, which `except Exception` misses and Jupyter garbles)."""


def run_rows(configs: list, row: Callable[[dict], dict], head: Callable[[dict], dict], *,
             desc: str) -> tuple[list[dict], int | bool]:
    """([row(spec) for each spec], False or the exit status of what stopped it), under a progress
    bar. A Ctrl-C (130) or SIGTERM (143) during a row ends the run there: that row and the
    rest read `INTERRUPTED` (with their `head(spec)` fields), and the caller still writes its
    report of the rows that ran."""
    from tqdm.auto import tqdm
    rows, interrupted = [], False
    for spec in tqdm(configs, desc=desc, dynamic_ncols=True):
        if not interrupted:
            try:
                rows.append(row(spec))
                continue
            except KeyboardInterrupt as e:  # hpnlp.stopping.Stopped carries 143 for SIGTERM
                interrupted = getattr(e, "exit_code", 130)
        rows.append({**head(spec), "status": INTERRUPTED})
    return rows, interrupted


PARTIAL = "interrupted"  # the folder in --out of an interrupted run's report beside a whole one


def report_dir(out_dir: str, interrupted: int | bool) -> str:
    """Where a `run_rows` bench writes its report: `out_dir`, but an interrupted run's (or a
    memory run's whose child died: `died`) goes to `out_dir/interrupted` where `out_dir`
    holds a whole report (a bug hunt, session 95: a
    rerun stopped early replaced the finished table with its few rows). Nothing is deleted:
    an interrupted run's rows may be hours of work (review)."""
    import json
    partial = os.path.join(out_dir, PARTIAL)
    if not interrupted:
        return out_dir
    try:
        with open(os.path.join(out_dir, "results.json")) as f:
            held = json.load(f)
        # (a memory bench whose child died is partial too: `died`; session 109)
        whole = not (held.get("interrupted") or held.get("died"))
    except (OSError, ValueError, AttributeError):
        whole = False
    if whole:
        os.makedirs(partial, exist_ok=True)  # its plots are drawn before the tables
    return partial if whole else out_dir


def exit_if_interrupted(interrupted: int | bool, out_dir: str) -> None:
    """After the report of an interrupted run is written: exit with `run_rows`' status (130
    for Ctrl-C, 143 for SIGTERM), as an interrupted command does, so a script sees the run
    was cut short."""
    if interrupted:
        what = "stopped (SIGTERM)" if interrupted == 143 else "interrupted"
        where = report_dir(out_dir, interrupted)
        kept = (f" (the whole report of the run before is kept in {out_dir})"
                if where != out_dir else "")
        print(f"{what}: {where} reports the rows that ran{kept}", file=sys.stderr)
        raise SystemExit(130 if interrupted is True else interrupted)


def length_options(attention: str, L: int) -> dict:
    """Constructor options that size a variant for length L: those with a learned
    [max_len, *] table (linformer, synthesizer) get max_len=L; the rest need nothing."""
    from hpnlp import attention as attention_lib
    return {"max_len": L} if "max_len" in attention_lib.get(attention).__dataclass_fields__ else {}


@functools.lru_cache(maxsize=None)
def experiment_module(filename: str):
    """The experiment config file `experiments/<filename>` as a module (loaded once)."""
    import importlib.util
    folder = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")
    if not os.path.isdir(folder):  # else os.listdir's FileNotFoundError below, naming no fix
        raise ValueError(f"experiments/{filename}: there is no experiments/ folder beside this "
                         f"hpnlp ({os.path.normpath(folder)}): the experiment configs come with a "
                         "checkout of the repository, not a pip install of the package; clone "
                         "it and `pip install -e .` there")
    path = os.path.join(folder, filename)
    if not filename.endswith(".py") or not os.path.isfile(path):
        raise ValueError(f"experiments/{filename}: no such experiment; choose from "
                         f"{sorted(f for f in os.listdir(folder) if f.endswith('.py'))}")
    spec = importlib.util.spec_from_file_location(f"hpnlp_experiment_{filename[:-3]}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fit_exponent(xs, ys) -> float | None:
    """Slope of log(y) against log(x): time ~ x^slope."""
    pts = [(x, y) for x, y in zip(xs, ys) if y and y > 0]
    if len(pts) < 2:
        return None
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(lx, ly, 1)[0])


# ------------------------------------------------------------------ benches made of parts

def add_parts_arguments(p, parts, *, workdir_help: str) -> None:
    """`--parts` (a comma list of `parts`, all by default) and `--workdir` (runs kept and
    reused there) for a bench made of parts."""
    p.add_argument("--parts", type=names_from(parts), default=list(parts),
                   help=f"comma list of {', '.join(parts)}")
    p.add_argument("--workdir", default=None, help=workdir_help)


def parts_main(run):
    """`main(args)` of a bench whose `run(out, *, quick, parts, workdir)` takes those flags."""
    return lambda args: run(args.out, quick=args.quick, parts=tuple(args.parts),
                            workdir=args.workdir)


def check_parts(parts, names) -> None:
    """A ValueError naming the `parts` that are not among `names`, and the choices."""
    unknown = sorted(set(parts) - set(names))
    if unknown:
        raise ValueError(f"--parts: unknown {unknown}; choose from {list(names)}")


def run_parts(payload: dict, makers: dict, parts) -> None:
    """`payload[name] = makers[name]()` for each part asked for (in `makers`' order; [] for
    the rest), its seconds in `payload["seconds"]`; an unknown part fails first."""
    check_parts(parts, makers)
    for name, make in makers.items():
        if name not in parts:
            payload[name] = []
            continue
        t0 = time.perf_counter()
        payload[name] = make()
        payload.setdefault("seconds", {})[name] = time.perf_counter() - t0


def _pinned_worker(core: int, todo, done, cache_dir: str | None, xla_flags: tuple) -> None:
    """(A spawned process's target) for each `(key, train, args)` taken from `todo` until
    its None, `train(*args)`, then `key` put in `done`, on core `core` alone: pinned before
    jax's CPU client exists, so that XLA's thread pool and the kernels' threads
    (`hpnlp.kernels.cores`) count one core; `xla_flags` added to its XLA_FLAGS then too."""
    from hpnlp.compile_flags import with_flags
    os.sched_setaffinity(0, {core})
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), xla_flags)
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    for key, train, args in iter(todo.get, None):
        train(*args)
        done.put(key)


def _must_pickle(train: Callable, jobs: list) -> None:
    """Refuse here, not in a queue's feeder thread (which would drop the run while the
    caller waited on it), a `train` or job that cannot reach another process."""
    import pickle
    try:
        pickle.dumps((train, jobs))
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"side-by-side runs go to other processes, so `train` (a "
                        f"module-level function) and the jobs must pickle: {e}") from e


class SideBySide:
    """Processes one per core, each pinned to its core, that train independent runs
    (`run`), kept alive from the first batch of two or more runs until `close`: a bench of
    many small runs in batches (the compress bench's parts) starts them once, not once a
    batch (a spawned process imports jax and hpnlp again, about 2 s, and traces its first
    run's library functions cold); `xla_flags` are added to theirs (e.g.
    `hpnlp.compile_flags.cheap_compile_flags()`). `one_batch`: they serve one batch, so
    there are no more of them than its runs. Runs go to a process only when it is free,
    a batch's first; runs queued by `ahead` (those later batches will ask for) fill a
    process that the batch has nothing left for, each once the runs it waits on are done,
    so a core does not sit idle through a batch's longest run. A run is keyed by its
    workdir (a job's last item): one a batch asks for that is already running or done
    (ahead) is waited on, not run again. See `train_side_by_side`."""

    def __init__(self, xla_flags: tuple = (), one_batch: bool = False):
        from hpnlp import kernels
        # no more than the cgroup's CPU bandwidth allows, as `kernels.cores` counts them (a
        # review, session 118: a container of 2 CPUs on a 64-CPU host started 64 runs)
        self.cores = (sorted(os.sched_getaffinity(0))[:kernels.cores()]
                      if hasattr(os, "sched_setaffinity") else [])
        self.procs: list = []
        self.xla_flags, self.one_batch = tuple(xla_flags), one_batch
        self.queued: list = []  # (key, train, job, the keys it waits on): runs ahead, not
        # handed to a process yet
        self.running: dict = {}  # key -> the workdir, handed to a process
        self.finished: set = set()  # keys done

    def _start(self, n: int) -> None:
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        self.todo, self.done = ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=_pinned_worker, args=(
            core, self.todo, self.done, jax.config.jax_compilation_cache_dir, self.xla_flags))
            for core in self.cores[:n]]
        for p in self.procs:
            p.start()

    @staticmethod
    def _key(job) -> str:
        return os.path.abspath(job[-1])

    def _hand_out(self, batch: list) -> None:
        """Give each free process a run: `batch`'s (taken from it) first, then the first
        one ahead whose runs it waits on are done."""
        while len(self.running) < len(self.procs):
            ready = [i for i, q in enumerate(self.queued) if q[3] <= self.finished]
            if not batch and not ready:
                return
            key, train, job = batch.pop(0) if batch else self.queued.pop(ready[0])[:3]
            self.running[key] = job[-1]
            self.todo.put((key, train, job))

    def _collect(self, timeout: float, asked: list) -> None:
        """Wait up to `timeout` s for a run to finish; a process that died (its run raised)
        raises here, naming the runs then training and those asked for (`asked`,
        workdirs)."""
        import queue
        try:
            key = self.done.get(timeout=timeout)
        except queue.Empty:
            key = None
        if key is not None:
            self.running.pop(key, None)
            self.finished.add(key)
        for p in self.procs:
            if p.exitcode is not None:
                raise RuntimeError(
                    f"a training run failed in its own process (exit code {p.exitcode}; its "
                    f"traceback is above); the runs training then were "
                    f"{list(self.running.values())}, of the runs asked for {asked}")

    def ahead(self, train: Callable, jobs: list, after: list | None = None) -> None:
        """Queue `jobs` ([(config, workdir)]) to train with `train`, in their order,
        whenever a process has no run of a batch to take and (`after`: for each job, the
        workdirs of the runs it waits on) those runs are done here; a later batch (`run`)
        that asks for one waits on it, or takes it as its own if no process has started it
        (the caller then answers for what it waits on). Nothing where there is one core:
        the batches train them then."""
        if len(self.cores) < 2:
            return
        _must_pickle(train, jobs)
        if not self.procs:
            self._start(len(self.cores))
        known = self.finished | set(self.running) | {q[0] for q in self.queued}
        self.queued += [(self._key(job), train, job, {os.path.abspath(d) for d in waits})
                        for job, waits in zip(jobs, after or [()] * len(jobs))
                        if self._key(job) not in known]
        self._hand_out([])

    def run(self, train: Callable, jobs: list, desc: str = "runs side by side") -> None:
        """`train(config, workdir)` for each of `jobs` ([(config, workdir)]), side by side
        where there are two or more cores and (or once the processes are up) jobs; else
        here, one after another. A failed run stops the rest (`close`) and raises here."""
        if not self.procs and (len(self.cores) < 2 or len(jobs) < 2):
            for cd, out in jobs:
                train(cd, out)
            return
        from tqdm.auto import tqdm
        _must_pickle(train, jobs)
        if not self.procs:  # a process a core (`one_batch`: at most one a job)
            self._start(min(len(jobs), len(self.cores)) if self.one_batch else len(self.cores))
        keys = [self._key(job) for job in jobs]
        self.queued = [q for q in self.queued if q[0] not in keys]  # ahead: this batch's now
        batch = [(key, train, job) for key, job in zip(keys, jobs)
                 if key not in self.finished and key not in self.running]
        try:
            with tqdm(total=len(jobs), desc=desc, leave=False) as bar:
                while True:
                    self._hand_out(batch)
                    bar.update(sum(k in self.finished for k in keys) - bar.n)
                    if bar.n == len(jobs):
                        break
                    self._collect(1.0, [job[-1] for job in jobs])
        except BaseException:
            self.close(at_once=True)
            raise

    def close(self, at_once: bool = False) -> None:
        """End the processes: once their runs end (runs ahead that no batch asked for and no
        process started are dropped), or `at_once` (after a failure)."""
        self.queued = []
        for p in self.procs:
            if at_once:  # SIGKILL: a SIGTERM would let a training run save its next step
                p.kill()     # first (hpnlp.train.stop)
            else:
                self.todo.put(None)
        for p in self.procs:
            p.join()
        self.procs, self.running = [], {}


_ACTIVE: SideBySide | None = None  # `side_by_side_processes`' pool, while one is open


@contextlib.contextmanager
def side_by_side_processes(xla_flags: tuple = ()):
    """`train_side_by_side` inside this block trains in one set of processes (`SideBySide`,
    with `xla_flags`), started at its first batch of runs and ended when the block ends:
    once their runs end, or at once where the block raises (an interrupt, a failed part),
    rather than after the runs queued ahead (`train_ahead`) that are training then."""
    global _ACTIVE
    outer, _ACTIVE = _ACTIVE, SideBySide(xla_flags)
    try:
        yield _ACTIVE
    except BaseException:
        _ACTIVE.close(at_once=True)
        raise
    finally:
        _ACTIVE.close()
        _ACTIVE = outer


def train_ahead(train: Callable, jobs: list, after: list | None = None) -> None:
    """Inside `side_by_side_processes`, queue the runs `jobs` ([(config, workdir)]) that
    later batches (`train_side_by_side`) will ask for, to train in a process that a batch
    has nothing left for, each once the runs it waits on (`after`: their workdirs, a list
    a job) are done (`SideBySide.ahead`); outside one, or on one core, nothing: the batches
    train them."""
    if _ACTIVE is not None:
        _ACTIVE.ahead(train, jobs, after)


def train_side_by_side(train: Callable, jobs: list, desc: str = "runs side by side") -> None:
    """Train the independent runs `jobs` ([(config, workdir)]) with `train(config, workdir)`
    (a module-level function: it runs in spawned processes), one process per core, each
    pinned to its core and taking the next run from a shared queue; the caller's own
    `train` then finds each run finished and reuses it. For benches of many small runs:
    their steps gain little from a second core. On a 2-core Xeon model 207 the byte LM
    trained 5.2-5.4 steps/s on one core and 5.8-6.5 on both, and two runs side by side, one
    a core, 5.0 and 5.4 each: 1.7x the steps a second of one run on both. With one core or
    one run, or where the OS cannot pin a process (`sched_setaffinity`), it trains them here
    one after another. Inside `side_by_side_processes` the processes are that block's,
    reused by each batch; else they last this batch. A failed run stops the rest and raises
    here. A progress bar (`desc`) counts the finished runs."""
    if _ACTIVE is not None:
        _ACTIVE.run(train, jobs, desc)
        return
    pool = SideBySide(one_batch=True)
    try:
        pool.run(train, jobs, desc)
    finally:
        pool.close()
