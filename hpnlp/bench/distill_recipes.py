"""`python -m hpnlp.bench distill_recipes`: distillation recipes and learning rates, on validation.

`python -m hpnlp.bench compress` reads its distillation targets on one recipe per model
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

Every recipe trains at `RECIPE_LR` times its experiment's learning rate (5x for both
models, their students' best rate). The learning-rate check then trains
the scratch student and the best recipe again at the other `LR_SCALES` times the
experiment's rate (same steps and seeds) and reads the gap each closes against the scratch
student at the same rate: whether the recipes are compared with a scratch student trained
at a rate that fits it.
The compress bench trains the students at the rates best here
(`compress.STUDENT_LR`; a test holds it to the record).

`--model 'text classifier'` (the default; `docs/benchmarks/distill_recipes`) or `--model
'byte LM'` (`docs/benchmarks/distill_recipes_lm`): the byte LM's students train the
teacher's 800 steps, one seed each (as in the compress bench), and read on validation loss;
nine recipes more are its alone (`EXTRA_RECIPES`: important weights with soft targets
alone, alpha = 1, at T = 2, alpha = 0.9, at T = 1 with alpha = 0.3 and 0.7, and at T = 1,
alpha = 0.5 with hidden-state or attention-map matching at weight 0.1; and the
teacher's weights rotated into the principal components of its residual stream,
`train.distill.init=pca` (SliceGPT, Ashkboos et al. 2024), alone, with soft targets at T =
1, alpha = 0.5, and with attention-map matching at weight 0.1 too); its
learning-rate check also tries half the experiment's rate, which is already 3x the
classifier's. Both models' teachers then train
again at 1x, 2x, 3x and 5x their experiment's rate (`TEACHER_LR_SCALES`), less the rate
the teacher of every student above trains at (`compress.TEACHER_LR`: 3x for the byte LM,
whose experiment's rate left it short, 1x for the classifier). Last, the byte LM's
structured check (`STRUCTURED_CHECK`): the compress bench's structured-pruning fine-tune of
that teacher (to about half its parameters by whole heads and MLP neurons) at several
learning rates and steps, scored on validation against the teacher; the compress bench
fine-tunes at the best pair (`compress.STRUCTURED_LR` and `structured_steps`).

The runs train side by side as the compress bench's do (`train_independent_runs`: a process
a core, `compress.side_by_side_processes`): the teachers, then every run that waits on
the teacher alone, then the best recipe's learning-rate runs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
from tqdm.auto import tqdm

from hpnlp.bench import compress, harness, report

MODEL = "text classifier"  # the default --model
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
# More candidates for the byte LM alone, where soft targets over the next byte carry more
# than a class: Minitron's important weights with soft targets alone (alpha = 1, as LM
# distillation often trains: DistilGPT2, MiniLLM's forward-KL baseline) and with Hinton et
# al.'s softer targets at T = 2, alpha = 0.9; on either side of the best at 5x (2026-11-29:
# alpha 0 read 1.471, 0.5 1.462, 1 1.493), alpha = 0.3 and 0.7; and TinyBERT's hidden-state
# and attention-map matching at a tenth of the weight the shared recipes give them (at
# weight 1 on selected weights at 5x: hidden 1.616, attention 1.500, none 1.462); and
# SliceGPT's rotation (`init=pca`: importance's heads and MLP neurons, the width as the
# leading principal components of the teacher's residual stream rather than a subset of its
# channels; hpnlp.compress.slicing) alone, with soft targets, and with the attention maps
EXTRA_RECIPES = {"byte LM": (
    ("important weights, T=1, alpha=1", dict(SELECT_T1, init="importance", alpha=1.0)),
    ("important weights, T=1, alpha=0.3", dict(SELECT_T1, init="importance", alpha=0.3)),
    ("important weights, T=1, alpha=0.7", dict(SELECT_T1, init="importance", alpha=0.7)),
    ("important weights, T=1, alpha=0.5, hidden 0.1",
     dict(SELECT_T1, init="importance", hidden=0.1)),
    ("important weights, T=1, alpha=0.5, attention 0.1",
     dict(SELECT_T1, init="importance", attention=0.1)),
    ("important weights, T=2, alpha=0.9",
     dict(SELECT_T1, init="importance", temperature=2.0, alpha=0.9)),
    ("rotated weights, no soft targets", dict(alpha=0.0, init="pca")),
    ("rotated weights, T=1, alpha=0.5", dict(SELECT_T1, init="pca")),
    ("rotated weights, T=1, alpha=0.5, attention 0.1", dict(SELECT_T1, init="pca", attention=0.1)),
)}
# The multiple of its experiment's learning rate every recipe row of a model trains at: for
# the byte LM its students' best rate on the record before (2026-11-29: the scratch student
# and the best recipe were best at 5-8x, and at 1x under-trained, which flatters the recipes
# that start from the teacher's weights); for the classifier likewise (the record before,
# 2026-11-29, its recipes at 1x: the scratch student and the best recipe best at 5x).
RECIPE_LR = {"text classifier": 5.0, "byte LM": 5.0}
SEEDS = {"text classifier": {"full": 3, "quick": 2}, "byte LM": {"full": 1, "quick": 1}}
# The learning-rate check: the scratch student and the best recipe again at these multiples
# of the experiment's learning rate (every row above trains at `RECIPE_LR`'s), the same steps
# and seeds: whether the comparison is between two students each trained at a fitting
# rate. --quick: one multiple.
LR_SCALES = {"text classifier": {"full": (1.0, 2.0, 3.0, 5.0, 8.0), "quick": (3.0,)},
             "byte LM": {"full": (0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 12.0), "quick": (2.0,)}}
# The teacher's own rate, checked the same way after the students: the teacher alone again
# at these multiples of its experiment's rate (less `compress.TEACHER_LR`'s, the rate every
# student distils from): whether a teacher's rate leaves it short (at its experiment's rate
# the byte LM's teacher was, 2026-11-29: its students at their best rate came within 0.03 of
# it on validation and beat it on the eval chapters).
TEACHER_LR_SCALES = {"text classifier": {"full": (1.0, 2.0, 3.0, 5.0), "quick": ()},
                     "byte LM": {"full": (1.0, 2.0, 3.0, 5.0), "quick": ()}}

# The byte LM's structured check (the compress bench's `structured` part, whose fine-tune no
# distillation recipe touches but whose rate and steps are a choice the same way): the
# teacher pruned by whole heads and MLP neurons to about half its parameters while
# fine-tuned, at these (multiple of the experiment's rate, steps); the compress bench
# fine-tunes at the best pair (`compress.STRUCTURED_LR`, `structured_steps`). The pruned
# run's eval is its shrunk model's (`python -m hpnlp.compress shrink` checks the two equal).
STRUCTURED_CHECK = {"byte LM": {
    "full": ((0.3, 400), (0.6, 400), (1.0, 400), (2.0, 400), (3.0, 400), (1.0, 600),
             (0.3, 800), (0.6, 800), (1.0, 800), (1.5, 800)),
    "quick": ((1.0, 6),)}}


def recipes(model: str) -> tuple:
    """`model`'s recipes: (name, `train.distill` fields; None: the scratch student)."""
    return RECIPES + EXTRA_RECIPES.get(model, ())


def _validation(cd):
    cd.data.eval_split = "validation"
    return cd


def teacher_rows(s: dict, workdir: str, scales, model: str = MODEL) -> list[dict]:
    """`model`'s teacher trained on the validation split at each of `scales` times its
    experiment's learning rate but `compress.TEACHER_LR`'s (the teacher's row of
    `recipe_rows`): the teacher's learning-rate check."""
    metric, rows = compress.MODELS[model][2], []
    for k, (cd, out) in tqdm(_teacher_runs(s, workdir, scales, model).items(),
                             desc="teacher's learning rate", leave=False):
        row = compress._row(model, f"teacher, lr x{k:g}", "", compress._train(cd, out), out,
                            metric)
        row["lr_scale"] = k
        rows.append(row)
    return rows


def _teacher_runs(s: dict, workdir: str, scales, model: str) -> dict:
    """{scale: (config, workdir)} of `teacher_rows`' runs."""
    return {k: (_validation(compress.teacher_config(model, s, lr_scale=k)),
                os.path.join(workdir, f"teacher_lr_x{k:g}"))
            for k in scales if k != compress.TEACHER_LR[model]}


def structured_rows(s: dict, workdir: str, pairs, model: str = MODEL) -> list[dict]:
    """The structured check: the compress bench's structured fine-tune of the validation
    teacher in `workdir` at each (learning-rate multiple, steps) of `pairs`, scored on the
    validation split; its `loss_rel` against the teacher, as the compress target reads it."""
    rows, sp = [], compress.structured_sparsity(s)
    teacher = compress._teacher_value(os.path.join(workdir, "teacher"), "loss")
    for (k, n), (cd, out) in tqdm(_structured_runs(s, workdir, pairs).items(),
                                  desc="structured fine-tune", leave=False):
        row = compress._row(model, "structured prune", f"{sp:.0%}", compress._train(cd, out),
                            out, "loss")
        row.update(lr_scale=k, steps=n, loss_rel=(row["value"] - teacher) / teacher)
        rows.append(row)
    return rows


def _structured_runs(s: dict, workdir: str, pairs) -> dict:
    """{(scale, steps): (config, workdir)} of `structured_rows`' runs."""
    tdir, sp = os.path.join(workdir, "teacher"), compress.structured_sparsity(s)
    return {(k, n): (_validation(compress.structured_pruned(s, tdir, lr_scale=k, steps=n,
                                                            sparsity=sp)),
                     os.path.join(workdir, f"structured_lr_x{k:g}_{n}_steps"))
            for k, n in pairs}


def _key(model: str):
    """Sort key under which the best row is the largest: accuracy up, loss down."""
    return (lambda r: -r["value"]) if compress.MODELS[model][2] == "loss" else (
        lambda r: r["value"])


def _recipe_row(s: dict, workdir: str, seeds: int, name: str, fields: dict | None,
                lr_scale: float = 1.0, model: str = MODEL) -> dict:
    """Recipe `name` (`fields`; None: the scratch student) of `model` trained on the
    validation split at `lr_scale` times its experiment's learning rate, at `seeds` seeds."""
    cd, out = _recipe_run(s, workdir, name, fields, lr_scale, model)
    row = compress._seeded_row(model, name, "", cd, out, compress.MODELS[model][2], seeds)
    row["fields"], row["lr_scale"] = fields, lr_scale
    return row


def _recipe_run(s: dict, workdir: str, name: str, fields: dict | None, lr_scale: float,
                model: str) -> tuple:
    """(config, workdir) of `_recipe_row`'s run (its first seed's)."""
    if fields is None:
        cd = compress.scratch_student(model, s, lr_scale=lr_scale)
    else:
        cd = compress.distilled_student(model, s, os.path.join(workdir, "teacher"), fields,
                                        lr_scale=lr_scale)
    run = name + (f", lr x{lr_scale:g}" if lr_scale != 1.0 else "")  # the check's names
    return _validation(cd), os.path.join(
        workdir, run.replace(", ", "_").replace(" ", "_").replace("=", ""))


def _seeded_runs(s: dict, workdir: str, seeds: int, name: str, fields: dict | None,
                 lr_scale: float, model: str) -> list[tuple]:
    """[(config, workdir)] of `_recipe_row`'s runs, one a seed."""
    return compress._seeded(*_recipe_run(s, workdir, name, fields, lr_scale, model), seeds)


def _teacher_run(s: dict, workdir: str, model: str) -> tuple:
    """(config, workdir) of the teacher every recipe distils from, on the validation split."""
    return _validation(compress.teacher_config(model, s)), os.path.join(workdir, "teacher")


def train_independent_runs(s: dict, workdir: str, seeds: int, lr_scales, teacher_scales,
                           structured_pairs, model: str) -> None:
    """Every run of `run` whose config does not wait on another's result, trained side by
    side (`compress._side_by_side`, where `s` says so): the teachers (the one every recipe
    distils from, and the teacher's learning-rate check), then every recipe, the scratch
    student at each learning rate of the check, and the structured check, all queued ahead
    at the start (`compress._ahead`); the best recipe's learning-rate runs wait for the
    recipes (`recipe_rows`). The row builders then find these runs finished."""
    at = RECIPE_LR[model]
    runs = [run for name, fields in recipes(model)
            for run in _seeded_runs(s, workdir, seeds, name, fields, at, model)]
    runs += [run for k in lr_scales if k != at
             for run in _seeded_runs(s, workdir, seeds, recipes(model)[0][0], None, k, model)]
    runs += list(_structured_runs(s, workdir, structured_pairs).values())
    teachers = [_teacher_run(s, workdir, model)] + list(
        _teacher_runs(s, workdir, teacher_scales, model).values())
    # all queued at once, the teachers first, each run once what it reads is trained: a
    # core the teachers' batch has no run left for takes a recipe
    compress._ahead(s, teachers + runs)
    compress._side_by_side(s, teachers, "teachers")
    compress._side_by_side(s, runs, "recipes")


def recipe_rows(s: dict, workdir: str, seeds: int, lr_scales=(),
                model: str = MODEL) -> tuple[dict, list[dict], list[dict]]:
    """(the teacher's row, one row per recipe at `RECIPE_LR`'s rate, the learning-rate
    check's rows: the scratch student and the best recipe at each of `lr_scales` but
    `RECIPE_LR`'s), all of `model` on the validation split."""
    metric = compress.MODELS[model][2]
    tcd, tdir = _teacher_run(s, workdir, model)
    teacher = compress._row(model, "teacher", "", compress._train(tcd, tdir), tdir, metric)
    teacher["lr_scale"] = compress.TEACHER_LR[model]
    at = RECIPE_LR[model]
    rows = [_recipe_row(s, workdir, seeds, name, fields, at, model=model)
            for name, fields in tqdm(recipes(model), desc="recipes", leave=False)]
    best = max(rows[1:], key=_key(model))
    scales = [k for k in lr_scales if k != at]
    compress._side_by_side(s, [run for k in scales for run in _seeded_runs(
        s, workdir, seeds, best["method"], best["fields"], k, model)], "learning rates")
    lr_rows = [_recipe_row(s, workdir, seeds, r["method"], r["fields"], k, model=model)
               for k in tqdm(scales, desc="learning rates", leave=False)
               for r in (rows[0], best)]
    scratch, metric = rows[0]["value"], compress.MODELS[model][2]
    for r in rows:
        r["gap_closed"] = (None if r is rows[0] else
                           compress.gap_closed(r["value"], scratch, teacher["value"], metric))
    for r in lr_rows:  # against the scratch student at the same rate
        base = next(x["value"] for x in lr_rows if x["fields"] is None
                    and x["lr_scale"] == r["lr_scale"])
        r["gap_closed"] = (None if r["fields"] is None else
                           compress.gap_closed(r["value"], base, teacher["value"], metric))
    return teacher, rows, lr_rows


def _gap(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def _split_line(model: str, t: dict, first: dict, steps, seeds: int) -> str:
    split = ("validation split (`data.eval_split='validation'`: 119 of the 1071 training "
             "chapters held out; the eval chapters never read)")
    metric = compress.MODELS[model][2]
    return (f"{model[0].upper()}{model[1:]}, {split}. Teacher: {metric} {t['value']:.4f}, "
            f"{t['params']:,} parameters. Students: {first['params']:,} parameters, "
            + (f"{steps} steps" if steps else "the teacher's steps")
            + (f", mean of {seeds} seeds." if seeds > 1 else ", one seed each."))


def _markdown(p: dict) -> str:
    model = p.get("model", MODEL)
    metric, key = compress.MODELS[model][2], _key(model)
    t, rows = p["teacher"], p["recipes"]
    best = max(rows[1:], key=key)
    rate = lambda r: r.get("lr_scale", 1.0)  # noqa: E731
    out = [report.header_md(p["machine"], {}), "",
           _split_line(model, t, rows[0], p["sizes"]["student_steps"].get(model), p["seeds"]),
           "",
           report.table(["recipe", f"{metric} (mean)" if p["seeds"] > 1 else metric,
                         "each seed", "gap closed"], [
               [r["method"], f"{r['value']:.4f}",
                ", ".join(f"{v:.4f}" for v in r.get("seed_values") or [r["value"]]),
                _gap(r["gap_closed"])] for r in rows]), "",
           f"Best on validation: `{best['method']}` (gap closed "
           f"{_gap(best['gap_closed'])}).", ""]
    lr_rows = p.get("lr_check") or []
    if lr_rows:
        scratch = sorted([rows[0]] + [r for r in lr_rows if r["fields"] is None], key=rate)
        recipe = sorted([best] + [r for r in lr_rows if r["fields"] is not None], key=rate)
        out += [f"Learning-rate check: the scratch student and the best recipe at multiples of "
                f"the experiment's learning rate, {p.get('base_lr', p.get('teacher_lr')):g} "
                f"(every row above trains at x{rate(rows[0]):g}); the same steps and seeds; gap "
                "closed against the scratch student at the same rate. The compress bench "
                "trains the students at the rates best here "
                "(`hpnlp.bench.compress.STUDENT_LR`).", "",
                report.table(["learning rate", "student, scratch", best["method"],
                              "gap closed"],
                             [[f"x{rate(a):g}", f"{a['value']:.4f}", f"{b['value']:.4f}",
                               _gap(compress.gap_closed(b["value"], a["value"], t["value"],
                                                        metric))]
                              for a, b in zip(scratch, recipe)]), ""]
        a, b = max(scratch, key=key), max(recipe, key=key)
        closes = _gap(compress.gap_closed(b["value"], a["value"], t["value"], metric))
        out += [f"Each at its best rate here (scratch x{rate(a):g}: {a['value']:.4f}; the "
                f"recipe x{rate(b):g}: {b['value']:.4f}), the recipe closes "
                f"{closes} of the gap.", ""]
    teachers = p.get("teacher_lr_check") or []
    if teachers:
        out += ["The teacher's learning-rate check: the teacher alone again at multiples of "
                "the experiment's rate (every student above distils from the teacher at "
                f"x{rate(t):g}, `hpnlp.bench.compress.TEACHER_LR`).", "",
                report.table(["learning rate", f"teacher, {metric}"],
                             [[f"x{rate(r):g}", f"{r['value']:.4f}"]
                              for r in sorted([t] + teachers, key=rate)]), ""]
    structured = p.get("structured_check") or []
    if structured:
        best = min(structured, key=lambda r: r["value"])
        out += ["The structured check: the teacher above pruned by whole heads and MLP neurons "
                f"to {structured[0]['setting']} sparsity (about half its parameters) while "
                "fine-tuned, as the compress bench's `structured` part, at multiples of the "
                "experiment's rate and for these steps; `vs teacher` = (loss - teacher's) / "
                "teacher's, the compress target `structured_half_params_loss_rel` (<= 0.03).",
                "",
                report.table(["learning rate", "steps", "loss", "vs teacher"],
                             [[f"x{r['lr_scale']:g}", str(r["steps"]), f"{r['value']:.4f}",
                               f"{r['loss_rel']:+.3f}"]
                              for r in sorted(structured,
                                              key=lambda r: (r["steps"], r["lr_scale"]))]),
                "", f"Best: x{best['lr_scale']:g} for {best['steps']} steps "
                f"({best['value']:.4f}, {best['loss_rel']:+.3f}); the compress bench fine-tunes "
                "so (`hpnlp.bench.compress.STRUCTURED_LR`, `SIZES` `structured_steps`).", ""]
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

    rows, metric = p["recipes"], compress.MODELS[p.get("model", MODEL)][2]
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, r in enumerate(rows):
        ax.barh(i, r["value"], color="tab:blue" if i else "tab:gray")
        vals = r.get("seed_values") or [r["value"]]
        ax.plot(vals, [i] * len(vals), "k.", markersize=4)
    ax.axvline(p["teacher"]["value"], color="tab:red", linestyle="--", label="teacher")
    ax.set_yticks(range(len(rows)), [r["method"] for r in rows], fontsize=8)
    values = [v for r in rows for v in r.get("seed_values") or [r["value"]]]
    values.append(p["teacher"]["value"])
    ax.set_xlim(min(values) - 0.02, max(values) + 0.02)
    ax.set_xlabel(f"validation {metric} (bars: seed mean; dots: each seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    report.savefig(fig, os.path.join(out_dir, "recipes.png"))


def run(out_dir: str, *, quick: bool, workdir: str | None = None, model: str = MODEL) -> dict:
    size = "quick" if quick else "full"
    s, seeds = compress.SIZES[size], SEEDS[model][size]
    with tempfile.TemporaryDirectory() as tmp:
        if not jax.config.jax_compilation_cache_dir:  # students of one shape compile once
            jax.config.update("jax_compilation_cache_dir", os.path.join(tmp, "jax_cache"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
        t0 = time.perf_counter()
        # each model's runs in their own folder: one --workdir serves both, and `_train`
        # would otherwise replace one model's finished runs by the other's of the same name
        wd = os.path.join(workdir or tmp, model.replace(" ", "_"))
        before = compress.runs_in(wd)
        lr_scales, teacher_scales = LR_SCALES[model][size], TEACHER_LR_SCALES[model][size]
        pairs = STRUCTURED_CHECK.get(model, {}).get(size, ())
        with compress.side_by_side_processes(s):
            train_independent_runs(s, wd, seeds, lr_scales, teacher_scales, pairs, model)
            teacher, rows, lr_rows = recipe_rows(s, wd, seeds, lr_scales, model)
        teachers = teacher_rows(s, wd, teacher_scales, model)
        structured = structured_rows(s, wd, pairs, model)
        payload = {"model": model,
                   "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
                   "machine": harness.machine_info(), "seeds": seeds, "teacher": teacher,
                   "base_lr": compress.experiment(model, s).train.lr,
                   "recipes": rows, "lr_check": lr_rows, "teacher_lr_check": teachers,
                   "structured_check": structured,
                   "seconds": time.perf_counter() - t0,
                   "reused_runs": compress.reused_since(before)}
    payload["quick"] = bool(quick)  # its own, not only the CLI's (session 107)
    report.write(out_dir, "distill_recipes", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def less_than(args, held: dict) -> list[str]:
    """--model where the report `held` in --out is another model's (a README walk, session
    116: the byte LM's command without its --model replaced the recorded byte LM report with
    the text classifier's; `python -m hpnlp.bench` refuses it, as it does --quick)."""
    if held.get("model", MODEL) != args.model:
        return [f"--model {args.model!r}"]
    return []


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=None, help="keep the runs' workdirs here (reused)")
    p.add_argument("--model", default=MODEL, choices=sorted(compress.MODELS),
                   help="whose students (default: %(default)s; 'byte LM': the default LM)")


def main(args) -> None:
    run(args.out, quick=args.quick, workdir=args.workdir, model=args.model)
