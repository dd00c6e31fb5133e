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

Every recipe trains at the teacher's learning rate. The learning-rate check then trains
the scratch student and the best recipe again at `LR_SCALES` times that rate (same steps
and seeds) and reads the gap each closes against the scratch student at the same rate:
whether the recipes are compared with a scratch student trained at a rate that fits it.
The compress bench trains the classifier's students at the rates best here
(`compress.STUDENT_LR`; a test holds it to the record).
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
# The learning-rate check: the scratch student and the best recipe again at these multiples
# of the teacher's learning rate (every row above trains at the teacher's), the same steps
# and seeds: whether the comparison is between two students each trained at a fitting
# rate. --quick: one multiple.
LR_SCALES = {"full": (2.0, 3.0, 5.0, 8.0), "quick": (3.0,)}


def _validation(cd):
    cd.data.eval_split = "validation"
    return cd


def _recipe_row(s: dict, workdir: str, seeds: int, name: str, fields: dict | None,
                lr_scale: float = 1.0) -> dict:
    """Recipe `name` (`fields`; None: the scratch student) trained on the validation split
    at `lr_scale` times the teacher's learning rate, at `seeds` seeds."""
    metric = compress.MODELS[MODEL][2]
    if fields is None:
        cd = compress.scratch_student(MODEL, s, lr_scale=lr_scale)
    else:
        cd = compress.distilled_student(MODEL, s, os.path.join(workdir, "teacher"), fields,
                                        lr_scale=lr_scale)
    out = os.path.join(workdir, name.replace(", ", "_").replace(" ", "_").replace("=", ""))
    row = compress._seeded_row(MODEL, name, "", _validation(cd), out, metric, seeds)
    row["fields"], row["lr_scale"] = fields, lr_scale
    return row


def recipe_rows(s: dict, workdir: str, seeds: int,
                lr_scales=()) -> tuple[dict, list[dict], list[dict]]:
    """(the teacher's row, one row per recipe, the learning-rate check's rows: the scratch
    student and the best recipe at each of `lr_scales`), all on the validation split."""
    metric = compress.MODELS[MODEL][2]
    tdir = os.path.join(workdir, "teacher")
    teacher = compress._row(MODEL, "teacher", "", compress._train(
        _validation(compress.experiment(MODEL, s)), tdir), tdir, metric)
    rows = [_recipe_row(s, workdir, seeds, name, fields)
            for name, fields in tqdm(RECIPES, desc="recipes", leave=False)]
    best = max(rows[1:], key=lambda r: r["value"])
    lr_rows = [_recipe_row(s, workdir, seeds, f"{r['method']}, lr x{k:g}", r["fields"], k)
               for k in tqdm(lr_scales, desc="learning rates", leave=False)
               for r in (rows[0], best)]
    scratch = rows[0]["value"]
    for r in rows:
        r["gap_closed"] = (None if r is rows[0] else
                           (r["value"] - scratch) / (teacher["value"] - scratch))
    for r in lr_rows:  # against the scratch student at the same rate
        base = next(x["value"] for x in lr_rows if x["fields"] is None
                    and x["lr_scale"] == r["lr_scale"])
        r["gap_closed"] = (None if r["fields"] is None else
                           (r["value"] - base) / (teacher["value"] - base))
    return teacher, rows, lr_rows


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
    lr_rows = p.get("lr_check") or []
    if lr_rows:
        scratch = [rows[0]] + [r for r in lr_rows if r["fields"] is None]
        recipe = [best] + [r for r in lr_rows if r["fields"] is not None]
        out += [f"Learning-rate check: the scratch student and the best recipe at multiples of "
                f"the teacher's learning rate (every row above trains at the teacher's, "
                f"{p['teacher_lr']:g}); the same steps and seeds; gap closed against the "
                "scratch student at the same rate. The compress bench trains the "
                "classifier's students at the rates best here "
                "(`hpnlp.bench.compress.STUDENT_LR`).", "",
                report.table(["learning rate", "student, scratch", best["method"],
                              "gap closed"],
                             [[f"x{a.get('lr_scale', 1.0):g}", f"{a['value']:.4f}",
                               f"{b['value']:.4f}",
                               _gap((b["value"] - a["value"]) / (t["value"] - a["value"]))]
                              for a, b in zip(scratch, recipe)]), ""]
        a, b = max(scratch, key=lambda r: r["value"]), max(recipe, key=lambda r: r["value"])
        out += [f"Each at its best rate here (scratch x{a.get('lr_scale', 1.0):g}: "
                f"{a['value']:.4f}; the recipe x{b.get('lr_scale', 1.0):g}: {b['value']:.4f}), "
                f"the recipe closes {_gap((b['value'] - a['value']) / (t['value'] - a['value']))}"
                " of the gap.", ""]
    if p.get("reused_runs"):
        out += [f"{p['reused_runs']} finished runs of the same configs were reused from "
                f"--workdir, so the wall time, {p['seconds']:.0f} s, leaves their training "
                "out.", ""]
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
        teacher, rows, lr_rows = recipe_rows(s, workdir or tmp, seeds,
                                             LR_SCALES["quick" if quick else "full"])
        payload = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
                   "machine": harness.machine_info(), "seeds": seeds, "teacher": teacher,
                   "teacher_lr": compress.experiment(MODEL, s).train.lr,
                   "recipes": rows, "lr_check": lr_rows, "seconds": time.perf_counter() - t0,
                   "reused_runs": len(compress.REUSED) - reused}
    report.write(out_dir, "distill_recipes", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=None, help="keep the runs' workdirs here (reused)")


def main(args) -> None:
    run(args.out, quick=args.quick, workdir=args.workdir)
