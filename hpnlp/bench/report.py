"""Reports: `results.json`, `results.md` (tables) and PNG plots in one output folder."""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any, Callable, Sequence

import matplotlib

matplotlib.use("Agg")

from hpnlp.bench.harness import CPU_IDS, fit_exponent  # noqa: E402


def _bytes_short(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} B"


def cpu_md(info: dict) -> str | None:
    """The CPU line: model name, vendor, family/model/stepping (an Arm CPU's implementer,
    part, variant and revision), the kernels' ISA extensions and the cache sizes
    (`harness.cpu_detail`), so a reader can tell one Xeon generation, or an EPYC, from
    another. None for results recorded without `cpu_detail`."""
    d = info.get("cpu_detail")
    if not d:
        return None
    parts = [info.get("cpu") or "?"]
    ident = ", ".join(f"{k} {d[k]}" for k in CPU_IDS if k in d)
    parts.append(" ".join(x for x in (d.get("vendor"), ident) if x))
    if "features" in d:
        parts.append("ISA: " + (", ".join(d["features"]) or "none of the kernels' extensions"))
    c = d.get("cache_bytes", {})
    caches = [f"{label} {_bytes_short(c[k])}{' per core' if k != 'l3' else ''}"
              for k, label in (("l1d", "L1d"), ("l2", "L2"), ("l3", "L3")) if k in c]
    if caches:
        parts.append("caches: " + ", ".join(caches))
    return "- CPU: " + "; ".join(p for p in parts if p)


def header_md(info: dict, rates: dict) -> str:
    v = info["versions"]
    vers = ", ".join(f"{k} {x}" for k, x in v.items() if x)
    lines = [f"- date: {info['date']}",
             f"- machine: {info['cpu']} ({info['machine']}), {info['cores']} cores, backend `{info['backend']}`"]
    cpu = cpu_md(info)
    if cpu:
        lines.append(cpu)
    if info.get("backend", "cpu") != "cpu":
        devs = info.get("devices") or []
        lines.append(f"- accelerator: {len(devs)} x {devs[0] if devs else '?'}; float32 products "
                     f"at JAX precision {info.get('float32_precision', 'not recorded')}")
    lines.append(f"- versions: {vers}")
    kernels = info.get("kernels")
    if kernels and "flash_gpu_blocks" in kernels:
        blocks = "; ".join(f"{key} {', '.join(f'{k}={v}' for k, v in cfg.items())}"
                           for key, cfg in kernels["flash_gpu_blocks"].items())
        lines.append(f"- kernels: `chunked`'s GPU kernels' blocks: {blocks}")
    elif kernels:
        blocks = "; ".join(f"{name} {', '.join(f'{k}={v}' for k, v in t['config'].items())} "
                           f"({t['source']})" for name, t in kernels["tuning"].items())
        lines.append(f"- kernels: bfloat16 attention products on {kernels['bf16_products']} "
                     f"(widened to float32 in a pass tuned to widen=1); blocks: {blocks}")
    for name, r in rates.items():
        lines.append(f"- measured {name} matrix-product rate: {r:.1f} GFLOP/s")
    if info.get("fma_peak_gflops"):
        lines.append(f"- measured float32 FMA peak of the cores (registers only, `python -m "
                     f"hpnlp.kernels.peak`): {info['fma_peak_gflops']:.1f} GFLOP/s")
    return "\n".join(lines)


def peak_memory(machine: dict, isolated: bool) -> tuple[str, str, str]:
    """(result key, column header, what the column is) for a run's peak memory: RSS on a
    CPU; on an accelerator the device's, from a fresh process per configuration for JAX
    rows and `max_memory_allocated` (reset per configuration) for PyTorch's."""
    if machine.get("backend", "cpu") == "cpu":
        what = ("the peak RSS of a fresh process" if isolated else
                "the peak RSS (not measured: this run shared one process)")
        return "peak_rss_bytes", "peak RSS MiB", what
    what = ("the peak device memory of a fresh process (PyTorch: `max_memory_allocated`)"
            if isolated else "PyTorch's `max_memory_allocated` (JAX rows not measured: this run "
                             "shared one process)")
    return "peak_device_bytes", "peak device MiB", what


def fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    if unit == "ms":
        return f"{x * 1e3:.2f}" if x * 1e3 < 100 else f"{x * 1e3:.0f}"
    if unit == "MiB":
        return f"{x / 2**20:.0f}" if x >= 2**20 else f"{x / 2**20:.2f}"
    if unit == "x":
        return f"{x:.2f}x"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


TARGET_OPS = (">=", "<=")


def target(value: float | None, bound: float, op: str) -> dict:
    """One entry of a results.json `targets` map: the measured `value` (None: not
    measured; NaN or an infinity, e.g. a diverged run's loss: kept, and not met either),
    the issue's `bound` and `op`, and `met`."""
    if op not in TARGET_OPS:
        raise ValueError(f"target op {op!r} is not one of {TARGET_OPS}")
    # a bug hunt (session 103): an infinite value met a ">=" target
    met = (value is not None and math.isfinite(value)
           and (value >= bound if op == ">=" else value <= bound))
    return {"value": value, "bound": bound, "op": op, "met": bool(met)}


def targets_of_parts(ran, by_part: dict[str, dict]) -> dict:
    """The targets of a bench of parts (`by_part`: part -> its targets) of the parts in
    `ran` (those the run timed, its `seconds`; None: every part), in order. A part --parts
    left out has no targets, not missed ones (a bug hunt, session 103: its targets read
    "not measured ... NO", where lra's leave out a task --tasks left out)."""
    return {name: t for part, targets in by_part.items() if ran is None or part in ran
            for name, t in targets.items()}


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either was not measured."""
    return num / den if num is not None and den else None


QUICK_NO_TARGETS = ("No targets: this run's sizes or steps (`--quick`, `--steps`) are not the "
                    "ones the targets are set for; run without them to measure the targets.")


def targets_unless_quick(payload: dict, quick: bool, make: Callable[[], dict]) -> None:
    """payload["quick"], and its `targets` map (`make()`) unless `quick`: a quick run's numbers
    at other sizes read as the targets met or missed (a bug hunt, session 95: `attention
    --quick` wrote the L=4096 targets as met at H=4, D=32, beside the recorded runs)."""
    payload["quick"] = bool(quick)
    if not quick:
        payload["targets"] = make()


def beside_bound(value, bound, digits: int, kind: str) -> str:
    """`value` written with `digits` (kind "f": decimals, "g": significant digits), more
    where fewer would show it equal to `bound` while it is not (a review, session 117:
    0.8004 under "<= 0.8" read "0.800 ... NO")."""
    text = f"{value:.{digits}{kind}}"
    try:
        same = float(text) == float(bound) != value
    except (TypeError, ValueError, OverflowError):
        return text
    while same and digits < 12:
        digits += 1
        text = f"{value:.{digits}{kind}}"
        same = float(text) == float(bound)
    return text


def targets_md(targets: dict | None, quick: bool = False) -> str:
    """The "### Targets" table of a payload's `targets` map ("" when it has none; a line
    saying why for a `--quick` run)."""
    if quick:
        return QUICK_NO_TARGETS
    if not targets:
        return ""
    rows = [[f"`{name}`", "not measured" if t["value"] is None else
             beside_bound(t["value"], t["bound"], 3, "f"),
             f"{t['op']} {t['bound']}", "yes" if t["met"] else "NO"]
            for name, t in targets.items()]
    return "### Targets\n\n" + table(["target", "measured", "bound", "met"], rows)


def seconds_md(p: dict) -> list[str]:
    """The payload's wall time per part (`seconds`), noting the runs reused from --workdir
    (`reused_runs`), whose training the times leave out; [] when none was kept."""
    if not p.get("seconds"):
        return []
    n = p.get("reused_runs", 0)
    reused = (f" {n} finished run{' was' if n == 1 else 's were'} reused from --workdir, so "
              "their training is not in these times." if n else "")
    return ["Wall time per part (s): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                  p["seconds"].items()) + "." + reused, ""]


class ReportWriteError(OSError):
    """A report's file that could not be written whole (a full disk, a file-size limit): the
    one there before is kept; `python -m hpnlp.bench` says so in one line."""


# What `python -m hpnlp.bench` was asked for (`recorded`): every report written meanwhile keeps
# it, so a later run can tell a full run's report from a --quick or --parts one's
_RUN: dict = {}


@contextlib.contextmanager
def recorded(**flags):
    """Inside this block every report `write` writes records `flags` (e.g. quick=True,
    parts=[...]) where the bench did not set them itself."""
    global _RUN
    outer, _RUN = _RUN, flags
    try:
        yield
    finally:
        _RUN = outer


def _written_beside(path: str, save: Callable[[str], Any]) -> str:
    """`save(tmp)` of the file that will replace `path`, written beside it; its name. Nothing
    is left of it where it fails (an OSError then reads as a `ReportWriteError`)."""
    tmp = path + ".tmp"
    try:
        save(tmp)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise ReportWriteError(f"{path}: cannot be written ({e.strerror or e}); the file "
                                   "there before is kept") from e
        raise
    return tmp


def savefig(fig, path: str, dpi: int = 120) -> None:
    """`fig` as the PNG `path`, whole or not at all (drawn beside it, then moved over it), and
    closed."""
    import matplotlib.pyplot as plt
    try:
        os.replace(_written_beside(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png")),
                   path)
    finally:
        plt.close(fig)


def drop_plot(path: str) -> None:
    """No plot at `path`: for a run that draws none there, so that an earlier run's does not
    stand beside a report without its rows (a bug hunt, session 97: retrieval --parts knnlm
    kept the retrieval.png of an earlier run's search rows)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def write(out_dir: str, name: str, payload: dict, markdown: str) -> None:
    """`results.md` and `results.json` in `out_dir`, each written whole beside the old one
    before either replaces its old one, results.json last: a failed write (a full disk) keeps
    the report there before, and a whole results.json means a whole report (a bug hunt,
    session 97: both were written in place, and a file-size limit left results.json cut)."""
    os.makedirs(out_dir, exist_ok=True)
    payload.setdefault("benchmark", name.replace(" ", "_"))  # which bench, in every results.json
    for key, value in _RUN.items():
        payload.setdefault(key, value)
    stop = ("**Interrupted:** the rows that read `not run: interrupted` did not run; rerun the "
            "command for the whole table.\n\n" if payload.get("interrupted") else "")
    md, js = (os.path.join(out_dir, f) for f in ("results.md", "results.json"))

    def save_md(tmp):
        with open(tmp, "w") as f:
            f.write(f"# hpnlp benchmark: {name}\n\n{stop}{markdown}\n")

    def save_json(tmp):
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1, default=str)
    md_tmp = _written_beside(md, save_md)
    try:
        js_tmp = _written_beside(js, save_json)
    except BaseException:
        os.remove(md_tmp)
        raise
    os.replace(md_tmp, md)
    os.replace(js_tmp, js)


def scaling_plot(path: str, series: dict[str, tuple[list, list]], *, xlabel: str, ylabel: str,
                 title: str, ceiling: tuple[list, list] | None = None,
                 ceiling_label: str = "") -> dict[str, float | None]:
    """Log-log plot, one line per series, fitted exponent in each label. Returns exponents."""
    import matplotlib.pyplot as plt  # here, not at import: a benchmark's worker processes never plot

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    exps = {}
    for i, (label, (xs, ys)) in enumerate(series.items()):
        pts = [(x, y) for x, y in zip(xs, ys) if y]
        if not pts:
            continue
        e = fit_exponent([p[0] for p in pts], [p[1] for p in pts])
        exps[label] = e
        # a colour, marker and dash of its own up to 20 lines (a bug hunt, session 95: the
        # default 10 colours drew chunked and performer alike in the attention plots)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="osD^v<>ph*"[i % 10], ms=3,
                color=plt.get_cmap("tab20")(i % 20), ls=("-", "--", ":", "-.")[i % 4],
                label=f"{label} (~x^{e:.2f})" if e is not None else label)
    if ceiling is not None:
        ax.plot(*ceiling, color="black", ls="--", lw=1, label=ceiling_label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run whose rows all failed plots no line
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    savefig(fig, path)
    return exps
