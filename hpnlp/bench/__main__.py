"""`python -m hpnlp.bench ENTRY --out DIR [--quick] [--profile DIR]`.

Each entry writes DIR/results.json and DIR/results.md, most also PNG plots (the closing
line names those it wrote; tricks, quant, data, kv_cache, moe_convert and rnn --quality
write none). `--quick` runs a small
version in a few minutes; `--profile DIR` also writes a jax.profiler trace of the run
(open with TensorBoard's profile plugin or https://ui.perfetto.dev): of this process, so it is
refused where the measured work runs in worker processes (compress, data, distill_recipes,
lra, memory, moe_convert, prune_transfer, moe's parallel part; attention, softmax's timing
run and train unless --no-isolate or --quick).

Entries that train keep their runs in `--workdir W` where given and reuse the finished runs
of the same config found there; `--quick` keeps its own in W/quick, so its small runs never
meet the full run's. A run folder holding a saved run of another config is refused, never
deleted; so is a --quick or --parts run, or one of fewer rows, steps or seconds (lra's
--steps, rnn's --impls, softmax --quality's --seconds, ...) or of another setup (memory's
--devices, train's and softmax's --no-isolate), whose --out holds a full run's report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

# On a GPU, JAX otherwise takes 75% of its memory at start in every process: the bench's own,
# each isolated worker's and PyTorch's peers would compete for the rest. Allocate on demand
# (read when JAX starts its GPU backend; nothing changes on a CPU).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from hpnlp.bench import (attention, compress, data, distill_recipes, gqa, kv_cache, lra, memory,
                         moe, moe_convert, prune_transfer, quant, retrieval, rnn, rope,
                         softmax, sparse, speculative, train, tricks)

from hpnlp.bench import report  # noqa: E402
from hpnlp.bench.harness import INTERRUPTED, BenchInputError  # noqa: E402
from hpnlp.paths import WorkdirBusy  # noqa: E402

ENTRIES = {"attention": attention, "softmax": softmax, "train": train, "lra": lra, "rnn": rnn,
           "tricks": tricks, "memory": memory, "quant": quant, "compress": compress, "moe": moe,
           "moe_convert": moe_convert,
           "retrieval": retrieval, "data": data, "distill_recipes": distill_recipes,
           "speculative": speculative, "gqa": gqa, "rope": rope, "kv_cache": kv_cache,
           "sparse": sparse, "prune_transfer": prune_transfer}


# entries whose measured work always runs in worker processes (lra's tasks, data's loaders,
# memory's per-setting runs, the runs the training benches train side by side), which a
# jax.profiler trace of this process does not see
ALWAYS_ISOLATED = ("compress", "data", "distill_recipes", "lra", "memory", "moe_convert",
                   "prune_transfer")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m hpnlp.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="entry", required=True)
    parsers = {}
    for name, mod in ENTRIES.items():
        sp = parsers[name] = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        sp.add_argument("--out", required=True, help="output folder")
        sp.add_argument("--quick", action="store_true", help="small sizes; a few minutes")
        sp.add_argument("--profile", default=None, help="write a jax.profiler trace here")
        mod.add_arguments(sp)
    args = p.parse_args(argv)
    sp = parsers[args.entry]
    try:  # before any training or compiling
        check_args(args)
        if hasattr(ENTRIES[args.entry], "check_args"):
            ENTRIES[args.entry].check_args(args)
    except ValueError as e:
        sp.error(str(e))
    if args.quick and getattr(args, "workdir", None):  # its small runs beside the full run's
        args.workdir = os.path.join(args.workdir, "quick")
    ctx = contextlib.nullcontext()
    if args.profile:
        import jax
        ctx = jax.profiler.trace(args.profile)
    before = _plots(args.out)
    parts = getattr(args, "parts", None)
    # a profiled run is recorded as such (a review, session 114: timed under the tracer, which
    # sees this process's JAX work and not PyTorch's peers, it wrote an ordinary record)
    with ctx, report.recorded(quick=bool(args.quick),
                              **({} if parts is None else {"parts": list(parts)}),
                              **({"profiled": args.profile} if args.profile else {})):
        try:
            ENTRIES[args.entry].main(args)
        except compress.RunConflict as e:  # the runs trained before it are kept, and reused
            sys.exit(f"python -m hpnlp.bench {args.entry}: error: {e}")
        except WorkdirBusy as e:  # a run folder another process trains (a review, s117)
            sys.exit(f"python -m hpnlp.bench {args.entry}: error: {e}")
        except BenchInputError as e:
            sp.error(str(e))
        except OSError as e:  # a bug hunt (session 97): a full disk was a traceback
            if not (isinstance(e, report.ReportWriteError) or _inside(e.filename, args.out)):
                raise
            sys.exit(f"python -m hpnlp.bench {args.entry}: error: {e}")
    print(wrote_message(args.out, before), file=sys.stderr)


def _inside(path, folder: str) -> bool:
    """Whether the file `path` (an OSError's `filename`, maybe None) lies in `folder`."""
    if not isinstance(path, str):
        return False
    folder = os.path.realpath(folder)
    return os.path.realpath(path).startswith(folder + os.sep)


def _plots(out: str) -> dict[str, int]:
    """The PNGs in `out` and their modification times (ns); {} where `out` is not there yet."""
    try:
        return {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in os.listdir(out)
                if n.endswith(".png")}
    except OSError:
        return {}


def wrote_message(out: str, before: dict[str, int]) -> str:
    """The closing line: results.json, results.md and the plots this run wrote (new, or
    rewritten since `before`), by name. Not every entry plots (tricks, data write tables)."""
    plots = sorted(n for n, t in _plots(out).items() if before.get(n) != t)
    return (f"wrote {out}/results.json, results.md"
            + (f" and {len(plots)} plot{'s' * (len(plots) > 1)}: {', '.join(plots)}" if plots
               else " (no plots)"))


def check_args(args) -> None:
    """The folders: writable, named (an empty --workdir would train in a temporary folder and
    lose the runs), and --out not holding another bench's report, which this one would replace,
    nor a full run's report where this run is a --quick or --parts one."""
    from hpnlp.paths import check_writable_dir
    for flag in ("out", "profile", "workdir"):
        value = getattr(args, flag, None)
        if value is not None and not value.strip():
            raise ValueError(f"--{flag} is empty; give a folder"
                             + ("" if flag == "out" else " (or leave the flag out)"))
        if value:
            check_writable_dir(value, f"--{flag}")
    used = getattr(ENTRIES.get(getattr(args, "entry", None)), "WORKDIR_PARTS", None)
    if used and getattr(args, "workdir", None) and not set(args.parts) & set(used):
        # a review (session 117): taken and ignored where no part asked for trains a run
        raise ValueError(f"--workdir {args.workdir}: only the {' and '.join(used)} "
                         f"{'parts keep' if len(used) > 1 else 'part keeps'} runs there; drop "
                         f"it, or add --parts {','.join(used)}")
    isolates = (getattr(args, "no_isolate", True) is False and not args.quick
                and not getattr(args, "quality", False))  # (softmax --quality: here)
    parallel = args.entry == "moe" and "parallel" in (getattr(args, "parts", None) or ())
    if args.profile and (args.entry in ALWAYS_ISOLATED or isolates or parallel):
        # a review (session 117): the trace held the parent's calibration and none of the
        # rows, each measured in a worker process of its own that jax.profiler does not see
        raise ValueError(f"--profile traces this process, and {args.entry} runs its measured "
                         "work in processes of its own"
                         + ("; add --no-isolate (or --quick)" if isolates else
                            "; leave out --parts parallel" if parallel else ""))
    try:
        with open(os.path.join(args.out, "results.md")) as f:
            first = f.readline()
    except OSError:
        first = None
    except UnicodeDecodeError:
        first = ""
    if not (first or "").startswith("# hpnlp benchmark: ") and (
            first is not None or os.path.exists(os.path.join(args.out, "results.json"))):
        # a bug hunt (session 95): a folder of the user's own results.md/json was written over
        kind = 'md' if first is not None else 'json'
        raise ValueError(f"--out {args.out} holds a results.{kind} "
                         "that is not an hpnlp bench's report, which this run would replace; "
                         "give another folder")
    if first is None:
        return
    other = first.removeprefix("# hpnlp benchmark: ").strip()
    ours = args.entry + (" quality" if getattr(args, "quality", False) else "")  # report.write's name
    if first.startswith("# hpnlp benchmark: ") and other != ours:
        raise ValueError(f"--out {args.out} holds the {other} bench's results, which this run would "
                         "replace; give another folder")
    held = _full_report(args.out, ENTRIES[args.entry])
    less = held and _less_than_full(args, held[1])
    if less:
        # a bug hunt (session 97): `moe --quick --parts parallel --out docs/benchmarks/moe`
        # replaced the recorded 1.5-hour report with one table
        raise ValueError(f"--out {args.out} holds {held[0]} of the {ours} bench, which this {less} "
                         "run would replace; give another --out")


def _less_than_full(args, held: dict) -> str | None:
    """The flags that make this run less than a full one (`--quick`, `--parts P` naming not
    every part, those a bench names in `LESS_THAN_FULL`, given: runs its report marks
    quick, and those its `less_than(args, held)` names against the report `held` in --out),
    or None. A bug hunt (session 99): `lra --steps 2` replaced the recorded report; (session
    102): so did `rnn --impls "hpnlp GRU"` and `softmax --quality --seconds 3`, flags whose
    full value is the recorded report's, not a fixed one (its command gives --seconds 90)."""
    mod = ENTRIES[args.entry]
    flags = ["--quick"] if args.quick else []
    if args.profile:
        flags.append(f"--profile {args.profile}")
    for flag in getattr(mod, "LESS_THAN_FULL", ()):
        if getattr(args, flag, None) is not None:
            flags.append(f"--{flag} {getattr(args, flag)}")
    if hasattr(mod, "less_than") and not args.quick:  # (--quick says it)
        flags += mod.less_than(args, held)
    parts = getattr(args, "parts", None)
    every = getattr(ENTRIES[args.entry], "PARTS", None)
    if parts is not None and every is not None and set(parts) != set(every):
        flags.append(f"--parts {','.join(parts)}")
    return " ".join(flags) or None


def _full_report(out: str, mod) -> tuple[str, dict] | None:
    """(what `out` holds, its payload) where it is a whole run's results.json (not --quick,
    not a `subset` of the rows, not interrupted and, for a bench of parts, of every part:
    those it records, else those it timed, `seconds`), else None. Reports from before
    session 97 may not say whether they were quick: those count as full (the recorded ones
    are), and the message says why."""
    try:
        with open(os.path.join(out, "results.json")) as f:
            p = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(p, dict) or p.get("quick") or p.get("subset") or p.get("interrupted") \
            or p.get("died") or p.get("profiled"):  # (a memory bench whose child died:
        return None  # partial; session 109)
    rows = p.get("results")  # a record from before `interrupted` was written (session 99)
    if isinstance(rows, list) and any(isinstance(r, dict) and r.get("status") == INTERRUPTED
                                      for r in rows):
        return None
    ran = p.get("parts", p.get("seconds"))
    every = getattr(mod, "PARTS", None)
    if every and isinstance(ran, (list, dict)) and not set(every) <= set(ran):
        return None
    return ("a full run's report" if "quick" in p else "a report that does not record whether "
            "it was a --quick run (one older than this check, taken as a full run's)"), p


if __name__ == "__main__":
    main()
