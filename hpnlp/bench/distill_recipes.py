"""`python -m hpnlp.bench distill_recipes`: the text classifier's distillation recipes, chosen on a validation split.

`python -m hpnlp.bench compress` reads its distillation targets on one recipe
(`compress.TARGETS_RECIPE`), scored on the eval chapters. Which recipe that should be is a
choice that must not read the eval chapters, or the target would be met by selection. Here
the choice is made on a validation split instead (`data.eval_split='validation'`), and the
compress bench trains the best recipe of this command's record (a test holds the two to
it): the teacher and every student train on the training chapters less one in nine (index
4 mod 10), and are scored on those held-out chapters; the eval chapters are never read. The teacher, the students' size and steps are the compress bench's (half depth,
width, heads and MLP width, a third of the teacher's steps); every student trains at
`seeds` seeds and reads as their mean. `gap closed` = (student - scratch) / (teacher -
scratch) on validation accuracy, as the compress bench computes it on eval accuracy.

The recipes are the literature's candidates: soft targets alone; weight selection alone
(Xu et al. 2024); both at T = 1 (the compress targets' row before 2026-11-25), at
DistilBERT's T = 2 and at Hinton et al.'s high temperature with mostly soft loss (T = 4, alpha = 0.9); selected
weights with soft targets plus TinyBERT's hidden-state or attention-map matching at
weight 1; Minitron's selection by importance (`train.distill.init=importance`: the
teacher's most active heads, neurons and width channels on the first training batches, not
the first ones), alone and with soft targets at T = 1; and both selections from the
teacher's last block rather than its first (`train.distill.init_blocks=last`: the block
its final norm and output layer read).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from hpnlp.bench import compress, harness, report

MODEL = "text classifier"
SELECT_T1 = dict(alpha=0.5, temperature=1.0, init="select")  # DistilBERT's, narrower
# (name, `train.distill` fields; None: the scratch student)
RECIPES = (
    ("student, scratch", None),
    ("soft targets, T=1, alpha=0.5", dict(alpha=0.5, temperature=1.0)),
    ("selected weights, no soft targets", dict(alpha=0.0, init="select")),
    ("selected weights, T=1, alpha=0.5", SELECT_T1),
    ("selected weights, T=2, alpha=0.5", dict(SELECT_T1, temperature=2.0)),
    ("selected weights, T=4, alpha=0.9", dict(SELECT_T1, temperature=4.0, alpha=0.9)),
    ("selected weights, T=1, alpha=0.5, hidden 1", dict(SELECT_T1, hidden=1.0)),
    ("selected weights, T=1, alpha=0.5, attention 1", dict(SELECT_T1, attention=1.0)),
    ("important weights, no soft targets", dict(alpha=0.0, init="importance")),
    ("important weights, T=1, alpha=0.5", dict(SELECT_T1, init="importance")),
    ("selected weights, last blocks, T=1, alpha=0.5", dict(SELECT_T1, init_blocks="last")),
    ("important weights, last blocks, T=1, alpha=0.5",
     dict(SELECT_T1, init="importance", init_blocks="last")),
)
SEEDS = {"full": 3, "quick": 2}


def _validation(cd):
    cd.data.eval_split = "validation"
    return cd


def recipe_rows(s: dict, workdir: str, seeds: int) -> tuple[dict, list[dict]]:
    """(the teacher's row, one row per recipe), all on the validation split."""
    metric = compress.MODELS[MODEL][2]
    tdir = os.path.join(workdir, "teacher")
    teacher = compress._row(MODEL, "teacher", "", compress._train(
        _validation(compress.experiment(MODEL, s)), tdir), tdir, metric)
    rows = []
    for name, fields in tqdm(RECIPES, desc="recipes", leave=False):
        if fields is None:
            cd = compress.student(compress.experiment(MODEL, s), s["student_steps"][MODEL])
        else:
            cd = compress.distilled_student(MODEL, s, tdir, fields)
        out = os.path.join(workdir, name.replace(", ", "_").replace(" ", "_").replace("=", ""))
        row = compress._seeded_row(MODEL, name, "", _validation(cd), out, metric, seeds)
        row["fields"] = fields
        rows.append(row)
    scratch = rows[0]["value"]
    for r in rows:
        r["gap_closed"] = (None if r is rows[0] else
                           (r["value"] - scratch) / (teacher["value"] - scratch))
    return teacher, rows


def _gap(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def _markdown(p: dict) -> str:
    t, rows = p["teacher"], p["recipes"]
    best = max(rows[1:], key=lambda r: r["value"])
    out = [report.header_md(p["machine"], {}), "",
           f"Text classifier, validation split (`data.eval_split='validation'`: 119 of "
           f"the 1071 training chapters held out; the eval chapters never read). Teacher: accuracy "
           f"{t['value']:.4f}, {t['params']:,} parameters. Students: {rows[0]['params']:,} "
           f"parameters, {p['sizes']['student_steps'][MODEL]} steps, mean of {p['seeds']} seeds.",
           "",
           report.table(["recipe", "accuracy (mean)", "each seed", "gap closed"], [
               [r["method"], f"{r['value']:.4f}",
                ", ".join(f"{v:.4f}" for v in r.get("seed_values") or [r["value"]]),
                _gap(r["gap_closed"])] for r in rows]), "",
           f"Best on validation: `{best['method']}` (gap closed "
           f"{_gap(best['gap_closed'])}).", ""]
    if p.get("reused_runs"):
        out += [f"{p['reused_runs']} finished runs were reused from --workdir (trained there by "
                f"an earlier run of this command), so the wall time, {p['seconds']:.0f} s, "
                "leaves their training out.", ""]
    elif p.get("seconds"):
        out += [f"Wall time: {p['seconds']:.0f} s.", ""]
    return "\n".join(out)


def _plot(p: dict, out_dir: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = p["recipes"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, r in enumerate(rows):
        ax.barh(i, r["value"], color="tab:blue" if i else "tab:gray")
        vals = r.get("seed_values") or [r["value"]]
        ax.plot(vals, [i] * len(vals), "k.", markersize=4)
    ax.axvline(p["teacher"]["value"], color="tab:red", linestyle="--", label="teacher")
    ax.set_yticks(range(len(rows)), [r["method"] for r in rows], fontsize=8)
    lo = min(min(r.get("seed_values") or [r["value"]]) for r in rows)
    ax.set_xlim(lo - 0.02, p["teacher"]["value"] + 0.02)
    ax.set_xlabel("validation accuracy (bars: seed mean; dots: each seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "recipes.png"), dpi=120)
    plt.close(fig)


def run(out_dir: str, *, quick: bool, workdir: str | None = None) -> dict:
    s = compress.SIZES["quick" if quick else "full"]
    seeds = SEEDS["quick" if quick else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        if not jax.config.jax_compilation_cache_dir:  # students of one shape compile once
            jax.config.update("jax_compilation_cache_dir", os.path.join(tmp, "jax_cache"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
        t0, reused = time.perf_counter(), len(compress.REUSED)
        teacher, rows = recipe_rows(s, workdir or tmp, seeds)
        payload = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
                   "machine": harness.machine_info(), "seeds": seeds, "teacher": teacher,
                   "recipes": rows, "seconds": time.perf_counter() - t0,
                   "reused_runs": len(compress.REUSED) - reused}
    report.write(out_dir, "distill_recipes", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=None, help="keep the runs' workdirs here (reused)")


def main(args) -> None:
    run(args.out, quick=args.quick, workdir=args.workdir)
