"""Copy generated benchmark tables into README.md, so no number there is typed by hand.

    python tools/sync_readme.py          # rewrite the marked blocks
    python tools/sync_readme.py --check  # exit 1 if README.md is out of date

README.md marks each generated block as

    <!-- BEGIN generated: docs/benchmarks/softmax/results.md ### V = 262144 -->
    ...
    <!-- END generated -->

The block is replaced by that file's text: the section under the given heading (up to the
next heading of the same level), or the whole file after its title when no heading is
given; either way its relative links are rewritten to read from the root, where README.md
is. The files themselves are written by `python -m hpnlp.bench ...` (see
docs/benchmarks.md for the command behind each folder).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the benches' modules, whose `PARTS` say what a whole run of a bench of parts holds (this
# checkout's, also where ROOT is pointed at a folder of records alone)
BENCHES = os.path.join(ROOT, "hpnlp", "bench")
DIFF_LINES = 40  # of the unified diff --check shows
BLOCK = re.compile(r"(<!-- BEGIN generated: (\S+)(?: (#+ [^\n]*?))? -->\n)(.*?)(<!-- END generated -->)",
                   re.S)
# anything that reads as a block's marker, taken by BLOCK or not (review r6: a marker BLOCK
# did not take, say `###B` or a CRLF, was skipped without a word and its numbers kept)
MARKER = re.compile(r"<!--\s*(?:BEGIN|END)\s+generated", re.I)


def section(path: str, heading: str | None) -> str:
    if not os.path.isfile(os.path.join(ROOT, path)):  # a bug hunt: a traceback
        raise SystemExit(f"README.md's generated block names {path}, which does not exist; "
                         "rerun its benchmark or fix the block's BEGIN line in README.md")
    check_whole(path)
    try:
        with open(os.path.join(ROOT, path)) as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:  # a bug hunt (session 99): a traceback
        raise SystemExit(f"{path}: is not UTF-8 text ({e}); rerun its benchmark, or restore "
                         f"the file (git checkout -- {path})") from None
    if heading is None:
        body = lines[1:] if lines and lines[0].startswith("# ") else lines
        # relinked as a section is (review r6: a whole file's links were copied as written)
        return relink("\n".join(body).strip() + "\n", os.path.dirname(path))
    level = heading.split(" ", 1)[0]
    if heading not in lines:
        raise SystemExit(f"{path} has no line {heading!r}; rerun its benchmark or fix README.md")
    if lines.count(heading) > 1:  # review r6: the first was copied, whichever it was
        raise SystemExit(f"{path} has {lines.count(heading)} lines {heading!r}, so the block "
                         "would copy the first of them; regenerate the file (its benchmark, or "
                         "python tools/targets_table.py for targets.md) so the heading is unique")
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines))
                if lines[i].startswith("#") and len(lines[i].split(" ", 1)[0]) <= len(level)), len(lines))
    return relink("\n".join(lines[start:end]).strip() + "\n", os.path.dirname(path))


INTERRUPTED_ROW = "not run: interrupted"  # hpnlp.bench.harness.INTERRUPTED (no hpnlp here)


def interrupted(payload: dict) -> bool:
    """Whether a results.json is of a run stopped part-way: its `interrupted` key, or (a
    record from before the bench wrote the key, session 99) a row of its `results` that
    reads `INTERRUPTED_ROW` (a review, session 118: two H100 records stopped by a time limit
    were counted whole, their targets' rows never run)."""
    rows = payload.get("results")
    return bool(payload.get("interrupted")) or isinstance(rows, list) and any(
        isinstance(r, dict) and r.get("status") == INTERRUPTED_ROW for r in rows)


def check_whole(path: str) -> None:
    """SystemExit, naming the results.json beside `path`, where it records a --quick, a
    subset's or an interrupted run, or one of some of its bench's parts (a bug hunt, session
    99: `bench rope --quick` into the recorded folder put a 12-step table into README.md,
    unmarked; session 102: so would `bench rnn --impls "hpnlp GRU"` its 2 rows; session 103:
    and `bench moe --parts parallel` its one table)."""
    record = os.path.join(os.path.dirname(path), "results.json")
    try:
        with open(os.path.join(ROOT, record)) as f:
            payload = json.load(f)
    except (OSError, ValueError):  # none (targets.md), or unreadable: tools/targets_table.py's
        return
    if not isinstance(payload, dict):
        return
    left_out = parts_left_out(os.path.dirname(os.path.join(ROOT, record)), payload)
    what = ("a --quick run (`quick`: true)" if payload.get("quick") else
            f"a run of a part of the rows (`subset`: {json.dumps(payload['subset'])})"
            if payload.get("subset") else
            "an interrupted run (`interrupted` set)" if payload.get("interrupted") else
            f"an interrupted run (rows that read {INTERRUPTED_ROW!r})" if interrupted(payload)
            else
            f"a run whose child died (`died`: {payload['died']})" if payload.get("died") else
            f"a run timed under the profiler (`profiled`: {payload['profiled']})"
            if payload.get("profiled") else
            f"a run without its part(s) {', '.join(left_out)} (`--parts`)" if left_out else None)
    if what:
        raise SystemExit(f"{record}: README.md's generated block names {path}, the report of "
                         f"{what}, not of a whole run; rerun its benchmark in full "
                         "(docs/benchmarks.md names the command), or restore the folder "
                         f"(git checkout -- {os.path.dirname(path)})")


def parts_left_out(folder: str, payload: dict) -> list[str]:
    """The parts of its bench (the module's `PARTS`) that the run whose results.json in
    `folder` is `payload` did not run: those missing from the `parts` it records, else from
    the parts it timed (`seconds`), as `python -m hpnlp.bench` judges a report whole
    (`_full_report`); [] for a bench without parts. The bench is the one the payload names,
    else the title of the results.md beside it."""
    name = bench_name(folder, payload)
    if name is None:
        return []
    every = bench_parts(name)
    ran = payload.get("parts", payload.get("seconds"))
    if not every or not isinstance(ran, (list, dict)):
        return []
    return [p for p in every if p not in ran]


TITLE = "# hpnlp benchmark: "  # results.md's first line, as hpnlp.bench.report writes it


def bench_name(folder: str, payload: dict) -> str | None:
    """The bench whose record in `folder` is `payload` (its results.json): the name the
    payload gives (`benchmark`), else the title of the results.md beside it; None where
    neither names one."""
    name = payload.get("benchmark")
    if isinstance(name, str):
        return name
    try:
        with open(os.path.join(folder, "results.md")) as f:
            title = f.readline().rstrip("\n")
    except (OSError, UnicodeDecodeError):
        return None
    name = title.removeprefix(TITLE).strip().replace(" ", "_")  # as report.write names it
    return name if title.startswith(TITLE) and re.fullmatch(r"\w+", name) else None


def bench_parts(name: str) -> tuple[str, ...]:
    """hpnlp.bench.`name`'s `PARTS` (() where it has none), read from its source: importing
    it would import JAX, seconds for a tool that otherwise takes a fraction of one."""
    path = os.path.join(BENCHES, f"{name}.py")
    if not re.fullmatch(r"\w+", name) or not os.path.isfile(path):
        return ()
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        if [t.id for t in targets if isinstance(t, ast.Name)] == ["PARTS"]:
            try:
                return tuple(ast.literal_eval(node.value))
            except ValueError:
                raise SystemExit(f"{path}: `PARTS` is not a literal tuple of names, which "
                                 "tools/sync_readme.py reads without importing the module; "
                                 "write it as one") from None
    return ()


# a relative link's target (no scheme, not an anchor): the whole target, up to its end (a
# review, session 117: "https" of https://... was matched, and the URL made a path)
LINK = re.compile(r"\]\(([^)#:\s]+)(?=[)#\s])")


def relink(text: str, folder: str) -> str:
    """`text`'s relative links, written from `folder`, as README.md at the root reads them."""
    return LINK.sub(lambda m: "](" + os.path.normpath(os.path.join(folder, m.group(1))), text)


def render(readme: str) -> str:
    """`readme` with each generated block's body copied anew; SystemExit naming the line of
    a marker BLOCK does not take (review r6: it was skipped, so --check passed on a block
    never rewritten; a BEGIN left without its END took the next block's BEGIN as text)."""
    taken = {i for m in BLOCK.finditer(readme) for i in (m.start(1), m.start(5))}
    for m in MARKER.finditer(readme):
        if m.start() not in taken:
            number = readme.count("\n", 0, m.start()) + 1
            raise SystemExit(
                f"README.md:{number}: {readme.splitlines()[number - 1].strip()!r} is not a "
                "generated block's marker that tools/sync_readme.py reads; write "
                "'<!-- BEGIN generated: PATH -->' or '<!-- BEGIN generated: PATH ### HEADING -->'"
                " and, lines below, '<!-- END generated -->', each on a line of its own")
    return BLOCK.sub(lambda m: m.group(1) + section(m.group(2), m.group(3)) + m.group(5), readme)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        old = f.read()
    write_or_check(path, render(old), check=args.check, fix="python tools/sync_readme.py")


def write_or_check(path: str, new: str, *, check: bool, fix: str) -> None:
    """Write `new` to `path`, or with `check` exit 1 (naming `fix`) if the file differs."""
    if check:
        old = ""
        if os.path.exists(path):
            with open(path) as f:
                old = f.read()
        if new != old:  # what differs, first lines (a bug hunt, session 98: a record edited
            # by hand was not named, and the fix would copy its number in unseen)
            name = os.path.relpath(path, ROOT)
            diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), name,
                                             f"{name} as {fix} writes it", lineterm="", n=1))
            shown = "\n".join(diff[:DIFF_LINES]) + (
                f"\n... ({len(diff) - DIFF_LINES} more lines)" if len(diff) > DIFF_LINES else "")
            print(f"{shown}\n{name} is out of date: run {fix}", file=sys.stderr)
            sys.exit(1)
        return
    tmp = path + ".tmp"  # whole or not at all (a review, session 117: a kill mid-write left
    with open(tmp, "w") as f:  # README.md cut)
        f.write(new)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
