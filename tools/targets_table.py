"""Every target recorded under docs/benchmarks, in one table: docs/benchmarks/targets.md.

    python tools/targets_table.py          # rewrite docs/benchmarks/targets.md
    python tools/targets_table.py --check  # exit 1 if it is out of date

A benchmark run that an issue sets targets for writes a `targets` map into its
`results.json` (see docs/benchmarks.md). The records of one benchmark on several CPUs (or
a GPU) each hold their own map, so whether a target holds depends on the machine; this
table puts every map side by side, one row per (target, record), with the machine its
header names; then, per benchmark, one row per record and one column per target, the
tables the README embeds (`<!-- BEGIN generated: docs/benchmarks/targets.md ### rnn -->`).
Nothing in it is typed: it is rendered from the records, and `tests/test_readme.py` fails
when it is out of date.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re

from sync_readme import BENCHES, bench_name, interrupted, write_or_check

from hpnlp.bench import report
from hpnlp.bench.harness import CPU_IDS, PARTIAL
from hpnlp.bench.report import TARGET_OPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join("docs", "benchmarks", "targets.md")


# AMD's (family, model) of the EPYCs the records name, by core generation
AMD_CORES = {(25, 1): "Zen 3", (25, 17): "Zen 4", (26, 2): "Zen 5"}


def machine(info: dict) -> str:
    """The machine a record names: its accelerator, or its CPU with family, model and
    stepping (an Arm CPU's implementer, part, variant and revision) and whether the kernels
    had AVX-512 there."""
    if info.get("backend", "cpu") != "cpu":
        return (info.get("devices") or ["?"])[0]
    d = info.get("cpu_detail") or {}
    ident = ", ".join(f"{k} {d[k]}" for k in CPU_IDS if k in d)
    isa = "AVX-512" if "avx512f" in d.get("features", []) else "AVX2" if "avx2" in d.get("features", []) else ""
    return " ".join(x for x in (info.get("cpu") or "?", f"({ident})" if ident else "", isa) if x)


def short_machine(info: dict) -> str:
    """The machine in a few words: an EPYC by its core generation, a Xeon by model and
    stepping (each only where its model name says so: a review, session 109, found a Ryzen
    and a Core i7 named "AMD EPYC" and "Intel Xeon"), another x86 CPU by its model name, an
    Arm CPU by implementer and part; "AVX2 only" where the kernels had AVX2 but no AVX-512,
    the architecture where they had neither (session 107: an aarch64 record read "? (AVX2
    only)")."""
    if info.get("backend", "cpu") != "cpu":
        return (info.get("devices") or ["?"])[0]
    d = info.get("cpu_detail") or {}
    family, model, stepping = d.get("family"), d.get("model"), d.get("stepping")
    cpu, vendor = info.get("cpu") or "", d.get("vendor")
    x86 = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(vendor)
    if x86 == "AMD" and "epyc" in cpu.lower():
        name = "AMD EPYC " + AMD_CORES.get((family, model), f"family {family} model {model}")
    elif x86 == "Intel" and "xeon" in cpu.lower():
        name = f"Intel Xeon model {model}, stepping {stepping}"
    elif x86:
        name = cpu or f"{x86} family {family} model {model}, stepping {stepping}"
    else:
        arm = ", ".join(f"{k} {d[k]}" for k in ("implementer", "part") if k in d)
        name = (cpu or "?") + (f" ({arm})" if arm else "")
    features, arch = d.get("features", []), info.get("machine")
    if "avx512f" in features:
        return name
    if "avx2" in features:
        return name + " (AVX2 only)"
    return name + (f" ({arch})" if arch and arch not in name else "")


def number(v, bound=None) -> str:
    """`v` in 3 significant digits, more where fewer would show a value that misses (or
    meets) `bound` as equal to it (`report.beside_bound`)."""
    if v is None:
        return "–"
    if not isinstance(v, float):
        return str(v)
    return report.beside_bound(v, bound, 3, "g") if _number(bound) else f"{v:.3g}"


FIX = "rerun its benchmark, or restore the file (git checkout -- PATH)"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _real(x) -> bool:  # finite too (a bug hunt, session 99: a value Infinity read as met)
    return _number(x) and math.isfinite(x)


def target(path: str, name: str, t) -> dict:
    """A record's target `name` as `hpnlp.bench.report.target` writes it, its `met` computed
    from value, op and bound (a bug hunt, session 96: a target without `op` read "None 2.5",
    and `met` was copied as stored, whatever the value); SystemExit naming the file and the
    target where an entry is not one. A value NaN or infinite (a diverged run's loss) is
    one, not met (a bug hunt, session 103: report.target wrote NaN, and this refused the
    whole record)."""
    if not (isinstance(t, dict) and t.get("op") in TARGET_OPS and _real(t.get("bound"))
            and (t.get("value") is None or _number(t.get("value")))):
        raise SystemExit(f"{path}: target {name!r} = {t!r} is not a target (a value, a bound "
                         f"and an op of {list(TARGET_OPS)}); {FIX.replace('PATH', path)}")
    return {**t, **report.target(t["value"], t["bound"], t["op"])}


# a record's `machine` fields the tables read, and what each must be where present
MACHINE_FIELDS = {"date": (str, "a string"), "cpu": (str, "a string"),
                  "backend": (str, "a string"), "devices": (list, "a list"),
                  "cpu_detail": (dict, "a map")}


def check_machine(path: str, info) -> None:
    """SystemExit naming the file and the field where a record's `machine` is not what
    `harness.machine_info` writes (a bug hunt, session 99: "machine": "epyc", a number for
    its date or a string for its cpu_detail were tracebacks)."""
    fix = FIX.replace("PATH", path)
    if info is None:
        return
    if not isinstance(info, dict):
        raise SystemExit(f"{path}: `machine` = {info!r} is not a map of the machine's fields; "
                         f"{fix}")
    for key, (kind, what) in MACHINE_FIELDS.items():
        if info.get(key) is not None and not isinstance(info[key], kind):
            raise SystemExit(f"{path}: `machine.{key}` = {info[key]!r} is not {what}; {fix}")
    detail = info.get("cpu_detail") or {}
    for key in ("family", "model", "stepping"):  # AMD_CORES' keys
        # (a number, or the text /proc/cpuinfo gave where it is none: harness.cpu_detail)
        if detail.get(key) is not None and not (_real(detail[key]) or
                                                 isinstance(detail[key], str)):
            raise SystemExit(f"{path}: `machine.cpu_detail.{key}` = {detail[key]!r} is not a "
                             f"number or text; {fix}")
    features = detail.get("features", [])
    if not (isinstance(features, list) and all(isinstance(f, str) for f in features)):
        raise SystemExit(f"{path}: `machine.cpu_detail.features` = {features!r} is not a list "
                         f"of strings; {fix}")


# what makes a results.json the report of less than a whole run, as tools/sync_readme.py's
# check_whole reads it (less its `--parts`, taken below)
NOT_WHOLE = ("quick", "subset", "interrupted", "died", "profiled")


def records() -> list[tuple[str, dict]]:
    """(folder under docs/benchmarks, results.json) of every record with a targets map; not
    the rows of an interrupted run kept beside a whole report (`OUT/interrupted`, a bug hunt,
    session 99: counted as a record of its own), nor a report of less than a whole run
    written into its own folder (`NOT_WHOLE`: review r10, an LRA run stopped after one dense
    seed wrote a target defined over three, which this table listed while sync_readme.py
    refused the record). A record of some of its bench's parts (`--parts`) is taken: its
    targets are those of the parts it ran (`report.targets_of_parts`)."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "benchmarks", "**", "results.json"),
                                 recursive=True)):
        if PARTIAL in os.path.relpath(path, ROOT).split(os.sep)[:-1]:
            continue
        try:  # a bug hunt (session 96): a cut file was a JSONDecodeError naming no file
            with open(path) as f:
                payload = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"{path}: cannot be read ({e}); {FIX.replace('PATH', path)}") \
                from None
        if not isinstance(payload, dict):
            raise SystemExit(f"{path}: not a results.json (a JSON object); "
                             f"{FIX.replace('PATH', path)}")
        targets = payload.get("targets")
        if targets and not isinstance(targets, dict):
            raise SystemExit(f"{path}: `targets` is not a map of targets; "
                             f"{FIX.replace('PATH', path)}")
        name = payload.get("benchmark")
        if name is not None and not (isinstance(name, str) and re.fullmatch(r"\w+", name)):
            raise SystemExit(f"{path}: `benchmark` = {name!r} is not a bench's name; "
                             f"{FIX.replace('PATH', path)}")
        if targets and not any(payload.get(k) for k in NOT_WHOLE) and not interrupted(payload):
            check_machine(path, payload.get("machine"))
            payload = {**payload, "targets": {n: target(path, n, t) for n, t in targets.items()}}
            out.append((os.path.relpath(os.path.dirname(path),
                                        os.path.join(ROOT, "docs", "benchmarks")), payload))
    return out


def rows() -> list[tuple]:
    """(target, record folder, machine, date, value, op, bound, met) of every record."""
    out = []
    for folder, payload in records():
        info = payload.get("machine") or {}
        for name, t in payload["targets"].items():
            out.append((name, folder, machine(info), (info.get("date") or "?")[:10], t.get("value"),
                        t.get("op"), t.get("bound"), bool(t.get("met"))))
    return sorted(out, key=lambda r: (r[0], r[1]))


def benchmark(folder: str, payload: dict) -> str:
    """The bench a record (its folder under docs/benchmarks) is of: the one its results.json
    names (`benchmark`), else its results.md's title (as tools/sync_readme.py reads them),
    else the longest start of the folder's name, cut at a `_`, that names a module of
    hpnlp/bench (`rnn_epyc_zen3`: rnn), else the folder's name."""
    name = bench_name(os.path.join(ROOT, "docs", "benchmarks", folder), payload)
    if name:
        return name
    words = os.path.basename(folder).split("_")
    for n in range(len(words), 0, -1):
        if os.path.isfile(os.path.join(BENCHES, "_".join(words[:n]) + ".py")):
            return "_".join(words[:n])
    return os.path.basename(folder)


def by_benchmark() -> list[str]:
    """A table per benchmark: a row per record, its main folder (the bench's name) first, a
    column per target any of them holds, "–" where a record holds no target of that name.
    (Review r6: records grouped by their set of targets split a bench that gained a target
    in two sections that could share one heading, and README.md copied the first.)"""
    groups: dict[str, list] = {}
    for folder, payload in records():
        groups.setdefault(benchmark(folder, payload), []).append((folder, payload))
    lines = []
    for name, members in sorted(groups.items()):
        members.sort(key=lambda m: (m[0] != name, m[0]))
        names = sorted({n for _, p in members for n in p["targets"]})
        heads = []
        for n in names:
            given = {(p["targets"][n].get("op"), p["targets"][n].get("bound"))
                     for _, p in members if n in p["targets"]}
            op, bound = next(iter(given))
            heads.append(f"`{n}` {op} {number(bound)}" if len(given) == 1 else f"`{n}`")
        lines += [f"### {name}", "",
                  "| record | machine | date | " + " | ".join(heads) + " | met |",
                  "|---|---|---|" + "---|" * len(names) + "---|"]
        for folder, payload in members:
            info = payload.get("machine") or {}
            cells, met = [], 0
            for n in names:
                tg = payload["targets"].get(n)
                if tg is None:  # a target its bench gained after this record
                    cells.append("–")
                    continue
                met += bool(tg.get("met"))
                value = number(tg.get("value"), tg.get("bound"))
                cells.append(value if tg.get("met") else f"**{value}**")
            lines.append(f"| [`{folder}`]({folder}/results.md) | {short_machine(info)} | "
                         f"{(info.get('date') or '?')[:10]} | " + " | ".join(cells)
                         + f" | {met} of {len(payload['targets'])} |")
        lines.append("")
    return lines


def render() -> str:
    rs = rows()
    met = sum(r[7] for r in rs)
    lines = ["# Every recorded target", "",
             "Rendered by `python tools/targets_table.py` from each `docs/benchmarks/*/results.json` "
             "that carries a `targets` map; a record holds for the machine its header names, so "
             "one target can be met on one machine and missed on another. Commands: "
             "[benchmarks.md](../benchmarks.md). The attention targets are issue 25's for a "
             "CPU kernel; a GPU record of the attention bench carries the map too (the bench "
             "writes it wherever `chunked` ran), where `chunked` is XLA's blocks and the peer "
             "PyTorch's CUDA kernels. A target whose rows did not run (no L = 4096) reads – and "
             "is not met; a record of an interrupted, --quick, died or profiled run is left "
             "out (a --parts run's holds its parts' targets).", "",
             f"{len(rs)} (target, record) pairs, {met} met.", "",
             "| target | record | machine | date | measured | bound | met |",
             "|---|---|---|---|---|---|---|"]
    for name, folder, mach, date, value, op, bound, ok in rs:
        lines.append(f"| `{name}` | [`{folder}`]({folder}/results.md) | {mach} | {date} | "
                     f"{number(value, bound)} | {op} {number(bound)} | "
                     f"{'yes' if ok else '**no**'} |")
    lines += ["", "## By benchmark", "",
              "Each benchmark's records side by side: a row per record, a column per target with "
              "its bound, misses in bold.", ""] + by_benchmark()
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    write_or_check(os.path.join(ROOT, OUT), render(), check=args.check,
                   fix="python tools/targets_table.py")


if __name__ == "__main__":
    main()
