"""Reports: `results.json`, `results.md` (tables) and PNG plots in one output folder."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")

from hpnlp.bench.harness import fit_exponent  # noqa: E402


def header_md(info: dict, rates: dict) -> str:
    v = info["versions"]
    vers = ", ".join(f"{k} {x}" for k, x in v.items() if x)
    lines = [f"- date: {info['date']}",
             f"- machine: {info['cpu']} ({info['machine']}), {info['cores']} cores, backend `{info['backend']}`",
             f"- versions: {vers}"]
    for name, r in rates.items():
        lines.append(f"- measured {name} matrix-product rate: {r:.1f} GFLOP/s")
    return "\n".join(lines)


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


def write(out_dir: str, name: str, payload: dict, markdown: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(payload, f, indent=1, default=str)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(f"# hpnlp benchmark: {name}\n\n{markdown}\n")


def scaling_plot(path: str, series: dict[str, tuple[list, list]], *, xlabel: str, ylabel: str,
                 title: str, ceiling: tuple[list, list] | None = None,
                 ceiling_label: str = "") -> dict[str, float | None]:
    """Log-log plot, one line per series, fitted exponent in each label. Returns exponents."""
    import matplotlib.pyplot as plt  # here, not at import: a benchmark's worker processes never plot

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    exps = {}
    for label, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y]
        if not pts:
            continue
        e = fit_exponent([p[0] for p in pts], [p[1] for p in pts])
        exps[label] = e
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                label=f"{label} (~x^{e:.2f})" if e is not None else label)
    if ceiling is not None:
        ax.plot(*ceiling, color="black", ls="--", lw=1, label=ceiling_label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return exps
