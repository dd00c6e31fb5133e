"""Per-CPU tuning of a kernel's block sizes: measured once, cached beside the build.

    FWD = Tuning(KERNEL, "fwd", default={"bq": 128, "bk": 128},
                 candidates=[{"bq": q, "bk": k} for q in (64, 128, 256) for k in (64, 128, 256)],
                 probe=lambda lib, cfg: lib.hpnlp_flash_probe(...),  # seconds, one run
                 shape="B=1 L=4096 H=2 D=64")
    blocks = FWD.config()  # {"bq": ..., "bk": ...}

The best tile sizes depend on the CPU (an AMD EPYC's 32 KB L1 against a Xeon's 48 KB, the
L2 size, how many loads a cycle), so a kernel does not ship one choice. The first time a
kernel runs on a CPU, `config()` times every candidate on a fixed probe problem through
the library's plain C entry point (no XLA, no compile: seconds a pass), keeps the
fastest, and writes it beside the library as `<library>.<name>.t<threads>.tune.json`. The
library's name already carries the source, the compiler, jaxlib, the flags and the CPU (its
model, stepping, cache size and feature flags: `CpuKernel.library_path`), so a changed kernel
or another CPU gets its own file; the file also names the CPU it was measured on
(`kernels.cpu_name`), and the threads the probes ran on (`kernels.cores()`, the kernels'
default thread count) name the file and are in its key: the same CPU model with another core
count (two VM sizes sharing a cache folder, or a process pinned to one core beside one that
is not) keeps its own record beside the other's.

The search is bounded and steady: every candidate is timed `repeats` times after a warmup
(more, up to `MIN_TIME_S` of runs, when a run is short);
the default and the three fastest are then timed again in `ROUNDS` interleaved rounds (so
a drift of the machine's speed hits them alike); each is scored by its fastest run; and
the default wins unless another candidate beats it by more than `MARGIN`, so two runs
agree within noise. A search stops early past `budget_s`. `python -m hpnlp.kernels
--repeat 2` shows every pass's choice and searches again to check that agreement.

A cache file is used only when it parses, its checksum matches its contents, it was
measured on this CPU and thread count, its key matches this kernel build, probe and
candidate list, and its choice is one of the candidates; otherwise (a truncated write, a
hand edit, a file copied from another machine or kernel version) it is reported,
re-measured and rewritten, never used.

`HPNLP_KERNEL_TUNE=0` skips tuning (the defaults run); the kernels' Python wrappers take
explicit block sizes, which override both. A cache folder this process cannot write (a
shared, read-only one) runs the defaults, with a warning saying how to tune; a search whose
file cannot be written runs its choice in this process only.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from typing import Callable

from hpnlp import kernels

VERSION = 2
MARGIN = 0.03  # another candidate must beat the default by 3% to replace it
FINALISTS = 3  # the fastest candidates timed again beside the default
ROUNDS = 5
MIN_TIME_S = 0.1  # a candidate's first timing runs at least this long in all

REGISTRY: list["Tuning"] = []


def run_probe(lib, symbol: str, args, what: str, cfg: dict) -> float:
    """Seconds of one run of a kernel library's plain C probe `symbol(int64, ...)` (a
    negative return is its failure: a RuntimeError naming `what` and `cfg`)."""
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_double
    seconds = fn(*(ctypes.c_int64(int(a)) for a in args))
    if seconds < 0:
        raise RuntimeError(f"{what} failed at {cfg}")
    return seconds


def enabled() -> bool:
    """Whether to tune (HPNLP_KERNEL_TUNE unset or 1); 0, false, off or no: the defaults (a
    bug hunt, session 90: any value but 0 tuned)."""
    return os.environ.get("HPNLP_KERNEL_TUNE", "1").strip().lower() not in (
        "0", "false", "off", "no")


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Tuning:
    """The tunable block sizes of one kernel pass, chosen per CPU (see the module doc)."""

    def __init__(self, kernel, name: str, *, default: dict[str, int],
                 candidates: list[dict[str, int]], probe: Callable[[object, dict], float],
                 shape: str, repeats: int = 3, budget_s: float = 20.0,
                 applies: Callable[[object, dict], bool] | None = None):
        candidates = [default, *(c for c in candidates if c != default)]  # the default first
        self.kernel, self.name = kernel, name
        self.default, self.candidates = dict(default), [dict(c) for c in candidates]
        self.probe, self.shape = probe, shape
        # applies(lib, cfg): whether this build can run cfg (a register block past the
        # build's widest is skipped, not timed); the default must always apply.
        self.applies = applies
        self.repeats, self.budget_s = repeats, budget_s
        self._lock = threading.Lock()
        self._config: dict | None = None
        self.source: str | None = None  # "default", "cache" or "tuned", once resolved
        REGISTRY.append(self)

    def path(self) -> str:
        """The record's file: one per thread count (found in review: a process pinned to one
        core and a two-core one sharing a cache folder each found the other's record stale
        and measured again, up to `budget_s` a pass, at every switch)."""
        stem = os.path.splitext(self.kernel.library_path())[0]
        return f"{stem}.{self.name}.t{kernels.cores()}.tune.json"

    def key(self) -> str:
        """What a cached choice is valid for: the build, this pass, probe, candidates and the
        probes' thread count (found in review: a choice measured on 2 threads was used on a
        64-core instance of the same CPU model, where its blocks left most threads idle)."""
        return _checksum({"version": VERSION,
                          "library": os.path.basename(self.kernel.library_path()),
                          "name": self.name, "shape": self.shape, "default": self.default,
                          "candidates": self.candidates, "threads": kernels.cores()})

    def config(self) -> dict[str, int]:
        """The block sizes to run with on this CPU (tuned on first use, then cached)."""
        with self._lock:
            if self._config is None:
                if not enabled() or not self.kernel.available():
                    self._config, self.source = dict(self.default), "default"
                else:
                    self._config = self._resolve()
            return dict(self._config)

    def check(self, data) -> str | None:
        """Why a cache file's contents may not be used (None: they may)."""
        if not isinstance(data, dict) or not {"key", "config", "timings", "checksum"} <= set(data):
            return "malformed"
        body = {k: v for k, v in data.items() if k != "checksum"}
        if data["checksum"] != _checksum(body):
            return "corrupted (its checksum does not match its contents)"
        if not data.get("cpu"):  # a bug hunt (session 102): a record from before the field
            # was reported as measured on a foreign CPU
            return "stale (written before records named their CPU)"
        if data["cpu"] != kernels.cpu_name():  # a bug hunt (session 102): block sizes
            # measured on a CPU with the same flags but another model were used here
            return f"foreign (measured on {data['cpu']}; this CPU is {kernels.cpu_name()})"
        if "threads" in data and data["threads"] != kernels.cores():
            return (f"stale (measured on {data['threads']} threads; this process runs "
                    f"{kernels.cores()})")
        if data["key"] != self.key():
            return "stale (written for another kernel build, probe or candidate list)"
        if data["config"] not in self.candidates:
            return "invalid (its choice is not a candidate)"
        return None

    def _read(self) -> tuple[dict | None, str | None]:
        """(the cache file's contents, None) where they may be used; else (None, why not:
        None where there is no file)."""
        path = self.path()
        if not os.path.exists(path):
            return None, None
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            return None, f"unreadable ({type(e).__name__})"
        reason = self.check(data)
        return (data, None) if reason is None else (None, reason)

    def _resolve(self) -> dict[str, int]:
        data, bad = self._read()
        if data is not None:
            self.source = "cache"
            return dict(data["config"])
        try:
            lock = open(self.path() + ".lock", "w")
        except OSError as e:  # a cache folder this process may not write (a shared one)
            # one warning (found in review: a stale file here also said "measuring again")
            state = f"is {bad}" if bad else "holds no choice yet"
            warnings.warn(f"hpnlp: the kernel tuning cache {self.path()} {state}, and this "
                          f"process cannot write it ({e}); "
                          f"{self.kernel.what}/{self.name} runs its default blocks "
                          f"{self.default}. To tune them, point HPNLP_KERNEL_CACHE at a folder "
                          "this process can write (HPNLP_KERNEL_TUNE=0 runs the defaults "
                          "without this warning)", RuntimeWarning, stacklevel=4)
            self.source = "default"
            return dict(self.default)
        if bad:
            warnings.warn(f"hpnlp: the kernel tuning cache {self.path()} is {bad}; measuring "
                          "again and rewriting it", RuntimeWarning, stacklevel=4)
        with lock:  # one process measures at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            data, _ = self._read()  # another process may have measured meanwhile
            if data is not None:
                self.source = "cache"
                return dict(data["config"])
            try:
                data = self.search()
            except (OSError, RuntimeError) as e:  # a probe failed: run the defaults
                warnings.warn(f"hpnlp: tuning {self.kernel.what}/{self.name} failed "
                              f"({e}); using its default blocks {self.default}",
                              RuntimeWarning, stacklevel=4)
                self.source = "default"
                return dict(self.default)
            try:
                self._write(data)
            except OSError as e:  # measured, but not kept (a full disk): this process uses it
                warnings.warn(f"hpnlp: could not write the kernel tuning cache {self.path()} "
                              f"({e}); {self.kernel.what}/{self.name} runs its measured choice "
                              f"{data['config']} in this process and measures again in the "
                              "next", RuntimeWarning, stacklevel=4)
            self.source = "tuned"
            return dict(data["config"])

    def search(self) -> dict:
        """Time every candidate on the probe problem; the cache file's contents."""
        lib = self.kernel.library()
        start = time.perf_counter()
        timings = []
        for cfg in self.candidates:  # the default first
            if self.applies is not None and not self.applies(lib, cfg):
                continue
            first = self.probe(lib, cfg)  # also the warmup: pages, caches, frequency
            runs = max(self.repeats, min(50, int(MIN_TIME_S / max(first, 1e-6))))
            best = min(self.probe(lib, cfg) for _ in range(runs))
            timings.append({"config": cfg, "seconds": best})
            if time.perf_counter() - start > self.budget_s:
                break
        ranked = sorted(range(1, len(timings)), key=lambda i: timings[i]["seconds"])
        finalists = [0, *ranked[:FINALISTS]]
        for _ in range(ROUNDS):  # interleaved: drift hits every finalist alike
            if time.perf_counter() - start > self.budget_s:
                break
            for i in finalists:
                timings[i]["seconds"] = min(timings[i]["seconds"],
                                            self.probe(lib, timings[i]["config"]))
        base = timings[0]["seconds"]
        fastest = min(timings, key=lambda t: t["seconds"])
        choice = fastest if fastest["seconds"] < (1 - MARGIN) * base else timings[0]
        body = {"key": self.key(), "cpu": kernels.cpu_name(), "threads": kernels.cores(),
                "kernel": self.kernel.what, "pass": self.name, "shape": self.shape,
                "config": choice["config"],
                "timings": timings, "search_s": time.perf_counter() - start}
        return {**body, "checksum": _checksum(body)}

    def _write(self, data: dict) -> None:
        path = self.path()
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            # readable as the umask allows, not mkstemp's 0600: a shared cache's other users
            # read it (a bug hunt, session 97)
            os.chmod(tmp, kernels.readable_mode(0o644))
            os.replace(tmp, path)  # atomic: a reader never sees half a file
        except BaseException:
            os.unlink(tmp)
            raise


def summary() -> dict[str, dict]:
    """Every registered tuning's choice on this CPU ({"kernel/pass": {config, source,
    default, cache}}), resolving them (measuring where not cached): for benchmark reports."""
    out = {}
    for t in REGISTRY:
        cfg = t.config()
        out[f"{t.kernel.what}/{t.name}"] = {"config": cfg, "source": t.source,
                                            "default": t.default, "cache": t.path()}
    return out


def main(argv=None) -> int:
    """`python -m hpnlp.kernels`: every kernel pass's block sizes on this CPU."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m hpnlp.kernels",
        description="Show each kernel pass's tuned block sizes on this CPU (measuring them if "
                    "not cached); --retune measures again; --repeat N runs each search N more "
                    "times without writing and says whether the choices agree within noise.")
    p.add_argument("--retune", action="store_true", help="measure again and rewrite the caches")
    p.add_argument("--repeat", type=int, default=0, help="extra searches per pass (not written)")
    args = p.parse_args(argv)
    if args.repeat < 0:
        p.error(f"--repeat must be >= 0 (extra searches per pass); got {args.repeat}")
    if (args.retune or args.repeat) and not enabled():  # a bug hunt (session 90): --retune
        # deleted every saved search and measured nothing (a review, session 115: --repeat
        # measured nothing and said the choices agreed)
        flag = "--retune" if args.retune else "--repeat"
        p.error(f"{flag} measures the block sizes, which HPNLP_KERNEL_TUNE="
                f"{os.environ['HPNLP_KERNEL_TUNE']} turns off; unset it (or set it to 1)")
    import hpnlp.attention.flash_cpu  # noqa: F401  (registers its tunings)
    import hpnlp.rnn.fused  # noqa: F401
    import hpnlp.retrieval.exact  # noqa: F401
    import hpnlp.compress.kernels  # noqa: F401
    import hpnlp.compress.spmm  # noqa: F401
    agree = True
    for t in REGISTRY:
        name = f"{t.kernel.what}/{t.name}"
        if args.retune and os.path.exists(t.path()) and t.kernel.available():
            try:
                os.unlink(t.path())
            except OSError as e:  # a bug hunt (session 90): a read-only cache, a traceback
                p.error(f"--retune cannot rewrite {name}'s tuning cache {t.path()}: "
                        f"{e.strerror}; point HPNLP_KERNEL_CACHE at a folder this process can "
                        "write")
        cfg = t.config()
        data = t._read()[0] if t.source != "default" else None
        if data is None:  # why the defaults: tuning off, or (a bug hunt) a kernel that
            # cannot run here, such as a damaged library or no compiler, was shown as if off
            why = (f": the kernel cannot run here: {t.kernel.unavailable_reason()}"
                   if enabled() and not t.kernel.available() else "")
            print(f"{name}: {cfg} ({t.source}{why})")
            if args.repeat and not why:  # a search not kept (a cache folder it could not
                # write, a probe that failed): nothing to compare again, no agreement said
                agree = False
                print("  not repeated: no recorded search of this pass to compare with (see "
                      "the warning above)")
            continue
        secs = {json.dumps(x["config"], sort_keys=True): x["seconds"] for x in data["timings"]}
        mine, base = secs[json.dumps(cfg, sort_keys=True)], data["timings"][0]["seconds"]
        print(f"{name}: {cfg} ({t.source}; {mine * 1e3:.2f} ms on {t.shape}, the default "
              f"{t.default} {base * 1e3:.2f} ms; search {data['search_s']:.1f} s)")
        for r in range(args.repeat):
            again = t.search()
            secs = {json.dumps(x["config"], sort_keys=True): x["seconds"] for x in again["timings"]}
            if json.dumps(cfg, sort_keys=True) not in secs:  # the search stopped at its budget
                agree = False
                print(f"  repeat {r + 1}: chose {again['config']}; the cached choice was not "
                      f"timed (the search stopped at its {t.budget_s:.0f} s budget)")
                continue
            first, now = secs[json.dumps(cfg, sort_keys=True)], secs[json.dumps(again["config"],
                                                                                sort_keys=True)]
            within = first <= now * (1 + MARGIN)
            agree &= within
            print(f"  repeat {r + 1}: chose {again['config']}; the cached choice takes "
                  f"{first / now:.3f}x its time ({'within' if within else 'OUTSIDE'} the "
                  f"{MARGIN:.0%} margin)")
    return 0 if agree else 1

