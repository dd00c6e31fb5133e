"""`python -m hpnlp.bench compress`: distillation, pruning and low-rank against honest baselines.

In one run on this CPU:

1. Distillation (`distill`): on the default byte LM (experiments/lm.py) and the text
   classifier (experiments/lra.py:text at 256 bytes), the teacher is trained (the byte LM
   at 3x its experiment's learning rate, `TEACHER_LR`: the rate distill_recipes' teacher
   check finds best on the validation split, where the experiment's own 3e-3 leaves it short
   in its 800 steps; the same-size models the parts below train from scratch train at the
   teacher's rate too; the fine-tunes at 0.3x the experiment's but the structured one,
   `STRUCTURED_LR`); a student at
   half the depth, width, heads and MLP width is trained for the teacher's steps (the LM)
   or a third of them (the classifier, whose half student matched its teacher at equal
   steps: `SIZES`), the same steps for each student: from scratch; distilled from the
   teacher (soft targets at T = 1, alpha = 0.5); started from the teacher's weights as
   the targets' recipe selects them, with no soft targets, the control; and the targets'
   recipe (`TARGETS_RECIPE`, the row the distillation targets read), chosen for each model
   by `python -m hpnlp.bench distill_recipes --model M` as the best on M's validation
   split, so without reading the eval chapters: for the classifier the teacher's selected
   weights (`train.distill.init=select`, `init_blocks=last`: the teacher's last block of
   every two, its first heads, MLP neurons and width channels; Xu et al. 2024) with soft
   targets at T = 1; for the byte LM the teacher's first block of every two rotated into
   the principal components of its residual stream (`init=pca`: SliceGPT, Ashkboos et al.
   2024, with Minitron's most active heads and neurons; hpnlp.compress.slicing), no soft
   targets (which read worse there with this start: 0.653 of the gap at alpha = 0.5
   against 0.686 without), so its initialization-alone control is the row itself and is
   not trained twice.
   Reported: eval metric (loss for the LM, accuracy for the classifier), parameters, size,
   and forward time relative to the teacher. `gap closed` = (scratch -
   distilled) / (scratch - teacher) on the eval metric. The classifier's scratch student
   and its targets' row train at three seeds each and read as their mean (`SIZES`
   `seeds`): between seeds its scratch accuracy spread as widely as its gap to the
   teacher. Every student trains at the multiple of its experiment's learning rate that
   distill_recipes' check finds best on the validation split (`STUDENT_LR`: 5x for the
   classifier's students, 8x for the LM's scratch student and 5x for its distilled ones;
   at the experiment's rate both models' scratch students were far short of trained).
   Hidden-state matching (`train.distill.hidden`) is in no model's targets' recipe, so
   not in the run.
2. Pruning (`prune`): the byte-LM teacher fine-tuned for the same steps at 50/75/90/95%
   sparsity with magnitude, movement (Sanh et al. 2020) and random (the control) masks, all
   on the same gradual cubic schedule (`prune_schedule`: from a tenth of the steps, so
   movement scores have accumulated before the first mask, to the target at three
   quarters of them, masks recomputed every 5 steps), beside the dense fine-tune of the
   same steps. The paper's claim to check: movement beats magnitude at high sparsity
   during fine-tuning (a transfer fine-tuning there; here the teacher's own task, on which
   `tools/movement_oneshot.py` shows what the movement scores rank). A pruned model runs
   at its dense speed on XLA:CPU, which has no sparse product; each run at least
   `sparsify.MIN_SPARSITY` sparse is also served by hpnlp's sparse kernel (`python -m
   hpnlp.compress sparsify`, into its workdir's `_sparse` twin), and its row gives that
   model's forward speed too (`sparse_forward_s`; the products alone: `python -m hpnlp.bench
   sparse`).
3. Structured pruning (`structured`): the byte-LM teacher pruned by whole attention heads
   and MLP neurons (`train.prune.structure=structured`, magnitude, the same schedule over
   `structured_steps` fine-tuning steps at `STRUCTURED_LR` times the experiment's rate: the
   pair distill_recipes' structured check finds best on the validation split) at the
   sparsity whose shrunk model has about half its parameters, then shrunk (`python -m
   hpnlp.compress shrink`) to a smaller dense Transformer; beside it that small config
   trained from scratch, as the teacher is, for the same total steps (the teacher's and the
   fine-tuning's).
4. Low-rank factorization (`lowrank`): the byte-LM teacher's qkv, out and MLP weights
   replaced by truncated-SVD factors (`model.lowrank.rank`, `train.init_from`) at the rank
   that halves its parameters, half that rank and twice it, each fine-tuned for the pruning
   runs' steps; beside them a dense model of about the half-parameter size (width scaled)
   trained from scratch as the teacher is, for the same steps in all (the teacher's plus
   the fine-tune's; the records up to 2026-12-06 gave it the teacher's alone).
5. Pipeline (`pipeline`, Deep Compression's order): the targets' distilled LM student pruned to 50%
   while fine-tuned, then int8 weights by `python -m hpnlp.compress quantize`: its
   quantized.npz against the float32 teacher's parameters at 4 bytes each (the quant.json
   beside it, config and layouts, ~5 KB, is counted on neither side, as the teacher's
   config.json is not). Beside it low rank
   composed with quantization: the `lowrank` part's half-parameter model under w8a8 (each
   factor of qkv, out and the MLP int8, its input int8 per token: two int8-kernel products
   per weight; the tied output table int8 too), no further training, its size counted
   the same way (its quant.json ~7 KB).

Forward speed (`measure_forward`): every model of the run, compiled and warmed, timed in
turn over the same rounds at the end, each against its own teacher.

Targets (issue 21; `targets` in results.json): distillation closes at least half of the
scratch-teacher gap on both models (`distill_gap_closed_lm`, `distill_gap_closed_text`
>= 0.5); the structurally pruned and the factorized model at half the parameters run at
least 1.6x faster than the teacher (`structured_half_params_speedup`,
`lowrank_half_params_speedup`) and lose at most 3% relative eval loss
(`..._loss_rel`); the pipeline's quantized.npz is at least 8x smaller than the float32
teacher's parameters (`pipeline_size_ratio` >= 8). `--quick` shrinks every run; its runs
train side by side as the full run's, in processes that compile with the cheap-compile flags
(`hpnlp.compile_flags`: a few steps are mostly compiling), while the forward timing
compiles as users do. Every part's runs (and the pipeline's quantizations) go to one set of
processes, one a core, started once (`harness.side_by_side_processes`), and every run the
parts will ask for is queued there at the start (`runs_ahead`), each to start once the runs
it reads are done, whenever a process has no run of the part at hand left to take: a core
does not idle while the classifier's teacher outlasts the byte LM's, or through a part's
longest run; each part's `seconds` then counts what it waited for, some of it trained during
the parts before. The runs' results do not depend on which process trains them when. Why low rank's
speed-up stays below the structured model's at the same size (it leaves attention whole):
`python tools/compress_speed_budget.py`.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from hpnlp.bench import harness, report
from hpnlp.compress import sparsify

SIZES = {
    # the students train for the teacher's steps on the LM, a third of them on the classifier
    # (at the teacher's 600 the half student matched it, 0.481 vs 0.490, within seed noise:
    # no gap to close); `student_steps` per model, None = the teacher's.
    # `lowrank_sweep`: ranks at half, once and twice the half-size rank (else the half-size
    # rank alone: --quick, whose 3 minutes the two other compiles overran).
    # `sparse_methods`: the pruning criteria whose runs (from sparsify.MIN_SPARSITY on) are
    # also served by the sparse kernel and timed so (--quick: one, for its 3 minutes)
    # `side_by_side`: each part's independent runs train in one process per core
    # (harness.train_side_by_side): a step of these small models gains little from a
    # second core, so two runs side by side train 1.7x the steps a second of one on both
    # `cheap_compile`: those processes compile with `hpnlp.compile_flags`' cheap-compile
    # flags (--quick, whose runs of a few steps are mostly compiling: a distilled LM
    # student's quick run 19.7 -> 13.8 s on one core of a Xeon model 207, the same loss);
    # the forward timing compiles as users do, in this process
    # `seeds`: seeds of the scratch student and of the targets' distilled row, per model,
    # each row their mean: the classifier's scratch student read 0.415, 0.368 and 0.371
    # accuracy at seeds 0-2 (2026-11-25), a spread as large as its gap to the teacher
    # `structured_steps`: the structured fine-tune's (with `STRUCTURED_LR`, the best pair of
    # distill_recipes' structured check on validation); its scratch twin trains the
    # teacher's steps plus these
    "full": dict(lm_steps=None, cls_steps=600, cls_len=256, prune_steps=200, structured_steps=800,
                 student_steps={"byte LM": None, "text classifier": 200},
                 seeds={"byte LM": 1, "text classifier": 3},
                 sparsities=(0.5, 0.75, 0.9, 0.95), lowrank_sweep=True, eval_batches=None,
                 timing_rounds=15, sparse_methods=("magnitude", "movement", "random"),
                 side_by_side=True, cheap_compile=False),
    "quick": dict(lm_steps=12, cls_steps=12, cls_len=64, prune_steps=6, structured_steps=6,
                  sparsities=(0.9,), lowrank_sweep=False,
                  student_steps={"byte LM": None, "text classifier": 6},
                  seeds={"byte LM": 1, "text classifier": 2},
                  eval_batches=2, timing_rounds=2, sparse_methods=("magnitude",),
                  side_by_side=True, cheap_compile=True),
}
MODELS = {"byte LM": ("lm.py", "bytes", "loss"), "text classifier": ("lra.py", "text", "accuracy")}


def experiment(model: str, s: dict):
    """The model's experiment config, the default byte LM or the text classifier (shrunk by
    --quick), at its experiment's learning rate (the teacher is `teacher_config`'s)."""
    module, arg, _ = MODELS[model]
    cd = harness.experiment_module(module).get_config(arg)
    if model == "byte LM":
        if s["lm_steps"]:
            cd.train.steps, cd.train.warmup_steps = s["lm_steps"], 2
    else:
        cd.data.seq_len = cd.model.max_len = s["cls_len"]
        cd.train.steps, cd.train.warmup_steps = s["cls_steps"], min(100, s["cls_steps"] // 5)
    if s["eval_batches"]:
        cd.train.eval_batches = s["eval_batches"]
    cd.train.checkpoint_every = 0
    cd.train.eval_every = 0
    cd.train.progress = False
    return cd


# Each teacher's learning rate as a multiple of its experiment's: the rate `python -m
# hpnlp.bench distill_recipes --model M`'s teacher check finds best on M's validation split,
# where it beats the experiment's own by more than 1% of the metric (tests/test_bench.py
# holds each to its record). The byte LM's (docs/benchmarks/distill_recipes_lm, 2026-11-29):
# loss 1.511 at experiments/lm.py's 3e-3 for its 800 steps, 1.393 at 2x, 1.385 at 3x, 1.459
# at 5x; at 1x its students (at their own best rate) came within 0.03 of it, so the gap they
# were to close was mostly the teacher's under-training. The classifier's: accuracy 0.539 at
# 1x, 0.542 at 2x (one seed; its seeds spread by 0.04), 0.532 at 3x: its rate fits.
TEACHER_LR = {"byte LM": 3.0, "text classifier": 1.0}


def teacher_config(model: str, s: dict, lr_scale: float | None = None):
    """`model`'s teacher: its experiment (`experiment`) at `lr_scale` (default `TEACHER_LR`'s)
    times its rate."""
    cd = experiment(model, s)
    cd.train.lr = cd.train.lr * (TEACHER_LR[model] if lr_scale is None else lr_scale)
    return cd


def student(cd, steps: int | None = None):
    """Half the teacher's depth, width, heads and MLP width (trained for `steps`, None = the
    teacher's)."""
    m = cd.model
    m.depth, m.width = max(1, m.depth // 2), m.width // 2
    m.num_heads, m.mlp_dim = max(1, m.num_heads // 2), m.mlp_dim // 2
    if steps:
        cd.train.steps, cd.train.warmup_steps = steps, min(cd.train.warmup_steps, steps // 5)
    return cd


def _forward_fn(workdir: str, quantized: str | None = None, sparse: str | None = None):
    """(jitted forward on one eval batch, its arguments) of a trained run, of the packed
    model `python -m hpnlp.compress quantize` wrote to `quantized` (served by the integer
    kernels where they apply, as its user runs it), or of the sparse one `python -m
    hpnlp.compress sparsify` wrote to `sparse`."""
    from hpnlp import data as data_lib
    from hpnlp import models
    from hpnlp.config import validate
    from hpnlp.train.checkpoint import load_run_config, restore_params
    from hpnlp.train.step import step_compiler_options

    cfg = validate(load_run_config(workdir))
    task = data_lib.make_task(cfg.data, workdir=workdir, save_tokenizer=False)
    batch = next(iter(data_lib.make_iterator(task, cfg.data, split="eval",
                                             batch_size=cfg.train.batch_size)))
    if quantized is None:
        model = models.build(cfg, deterministic=True, token_counts=task.token_counts)
        fn = jax.jit(lambda p, b: model.apply({"params": p}, b, method="evaluate"),
                     compiler_options=step_compiler_options())  # as hpnlp's eval step compiles
        if sparse:
            return fn, (sparsify.load(sparse)[1], batch)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            _abstract_params(cfg, model))  # no trainer built: the model alone
        return fn, (restore_params(workdir, like), batch)
    from hpnlp.compress import ptq
    cfg_q, packed, qv = ptq.load(quantized)
    model_q = models.build(cfg_q, deterministic=True, token_counts=task.token_counts)
    served = ptq.serve(model_q, packed, batch, qv)
    fn = jax.jit(lambda p, q, b: model_q.apply({"params": p, **({"quant": q} if q else {})}, b,
                                               method="evaluate"),
                 compiler_options=step_compiler_options())
    return fn, (served, qv, batch)


def measure_forward(rows: list[dict], teachers: dict, *, rounds: int = 15) -> None:
    """Each row's `forward_s` and its teacher's `teacher_forward_s` (`teachers`: model ->
    teacher workdir), measured together at the end of the run: every model compiled and
    warmed, then `rounds` rounds timing each in turn (about 0.1 s of calls per turn, in a
    new order each round; the median of its rounds), so slow drift of the machine and what
    the model before it left in the caches fall on every model alike."""
    from hpnlp.kernels import reuse_freed_memory
    from hpnlp.train.loop import shared_program
    reuse_freed_memory()
    def key(r, sparse=False):  # (model, workdir, quantized, sparse)
        return r["model"], r["workdir"], r.get("quantized"), r["sparse"] if sparse else None

    keys = {key(r) for r in rows} | {key(r, True) for r in rows if r.get("sparse")}
    keys |= {(m, w, None, None) for m, w in teachers.items() if any(r["model"] == m for r in rows)}
    fns = {}
    for k in tqdm(sorted(keys, key=str), desc="load and compile", leave=False):
        fn, args = _forward_fn(*k[1:])
        fn = shared_program(fn, *args)  # models of one shape (the pruned ones) compile once
        jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        # calls per turn: about 0.1 s of them, so a small model's turn is not one short call
        # that the model timed before it (its caches, the thread pool's wake-up) dominates
        calls = max(1, round(0.1 / max(time.perf_counter() - t0, 1e-4)))
        fns[k] = (fn, args, calls)
    times = {k: [] for k in fns}
    order = list(fns)
    rng = np.random.default_rng(0)
    for _ in tqdm(range(rounds), desc="forward timing", leave=False):
        rng.shuffle(order)  # a new order each round: no model always follows the same one
        for k in order:
            fn, args, calls = fns[k]
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / calls)
    med = {k: float(np.median(v)) for k, v in times.items()}
    for r in rows:
        r["forward_s"] = med[key(r)]
        r["teacher_forward_s"] = med[(r["model"], teachers[r["model"]], None, None)]
        if r.get("sparse"):
            r["sparse_forward_s"] = med[key(r, True)]


REUSED: list[str] = []  # runs `_train` found finished (by an earlier bench run, or this
# run's side-by-side processes: `reused_since`)


def _summary_mtime(run: str) -> int | None:
    try:
        return os.stat(os.path.join(run, "summary.json")).st_mtime_ns
    except OSError:
        return None


def runs_in(workdir: str) -> dict[str, int]:
    """The finished runs in `workdir` now, each with its summary.json's modification time
    (before a bench run starts: `reused_since`)."""
    wd = os.path.abspath(workdir)
    names = os.listdir(wd) if os.path.isdir(wd) else []
    found = {os.path.join(wd, n): _summary_mtime(os.path.join(wd, n)) for n in names}
    return {p: t for p, t in found.items() if t is not None}


def reused_since(before: dict[str, int]) -> int:
    """How many runs `_train` reused that were finished in their workdir before (`runs_in`)
    and are as they were: those an earlier bench run left, not those this run trained (in its
    side-by-side processes, or in a part before: the teacher; or a folder an interrupted run
    left unfinished, or one retrained for a newer source: a review, session 115, found both
    counted) and found again."""
    return len({p for p in map(os.path.abspath, REUSED)
                if p in before and _summary_mtime(p) == before[p]})


class RunConflict(ValueError):
    """A bench's run folder holds another config's saved run, which it will not delete."""


def _train(cd, out: str) -> dict:
    """The summary of `hpnlp.train.run(cd, out)`; a finished run of the same config already
    in `out` is reused (so a run with --workdir that stopped continues where it stopped).
    RunConflict where `out` holds a saved run of another config (or one whose config.json
    this version cannot read): a bug hunt found such runs deleted (a --quick run of the
    same bench, or another bench's runs in a shared --workdir)."""
    from hpnlp.paths import hold_workdir
    # held from the look to the run's end (a review, session 117: a second bench process on
    # the same --workdir found a run still training, with no checkpoint yet, "unreadable",
    # and deleted it under the first); another process's run: WorkdirBusy
    release = hold_workdir(out)  # (made here and released empty: removed again)
    try:
        return _train_held(cd, out)
    finally:
        release()


def _train_held(cd, out: str) -> dict:
    import json

    from hpnlp.config import from_configdict, validate
    from hpnlp.config.checks import without_unread
    from hpnlp.paths import RUN_FILES, RUN_FOLDERS
    from hpnlp.train import run
    from hpnlp.train.checkpoint import has_checkpoint, load_run_config
    done = os.path.join(out, "summary.json")
    if os.path.exists(out):
        try:
            saved, now = validate(load_run_config(out)), validate(from_configdict(cd))
            # fields nothing reads, set back to their defaults (review d2: runs saved before
            # experiments/lm.py stopped setting data.word_vocab_size on bytes were retrained)
            saved, now = without_unread(saved), without_unread(now)
            same = saved == now
            why = f"a saved run of another config ({_config_diff(saved, now)})"
        except Exception as e:  # noqa: BLE001 (an unreadable or unfinished run is retrained)
            # (a bug hunt: the cause, a missing checkpoint or config.json, was not said)
            cause = str(e.args[0] if e.args else e).splitlines()[0][:300]
            same, why = False, f"a saved run this bench cannot read ({cause})"
        if not same and (os.path.exists(done) or has_checkpoint(out)):
            raise RunConflict(f"{out} holds {why}, which this bench would replace; give "
                              f"another --workdir, or delete {out}")
        if same and os.path.exists(done) and _newer_source(cd, done):
            same = False  # its teacher or starting run was retrained since: so is it
        other = sorted(set(os.listdir(out)) - set(RUN_FILES + RUN_FOLDERS) - {"config.json.tmp"})
        if not same and other:  # a bug hunt: deleted with the rest, unsaid (and, a review,
            # session 115, with a run retrained for a newer source, checked before that)
            raise RunConflict(f"{out} holds files that are not a run's ({', '.join(other[:3])}"
                              f"{', ...' if len(other) > 3 else ''}), which this bench would "
                              "delete with the run it trains anew; move them aside, or give "
                              "another --workdir")
        if same and os.path.exists(done):
            try:
                with open(done) as f:
                    summary = json.load(f)
            except (OSError, ValueError):  # a bug hunt (session 96): a cut summary was two
                summary = None  # tracebacks; the finished run evaluates again, as without one
            if isinstance(summary, dict):
                REUSED.append(out)
                return summary
        if not same:  # another config's run with nothing saved: start afresh (emptied, not
            # removed: the folder keeps the lock this process holds)
            import shutil
            for name in os.listdir(out):
                path = os.path.join(out, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
    return run(cd, out)


def _config_diff(saved, now) -> str:
    """The fields two configs differ in, up to three, saved value then now's; a run whose
    sources (`train.init_from`, a teacher) alone moved is said so (a bug hunt: a workdir
    copied to another path read as another config, with "delete" as the fix)."""
    from flax import traverse_util

    from hpnlp.config import to_json
    a, b = (traverse_util.flatten_dict(to_json(c), sep=".") for c in (saved, now))
    keys = sorted(k for k in {**a, **b} if a.get(k) != b.get(k))
    shown = "; ".join(f"{k}: saved {a.get(k)!r}, now {b.get(k)!r}" for k in keys[:3])
    if keys and set(keys) <= {"train.init_from", "train.distill.teacher"}:
        shown += (": it starts from a run in another folder (a --workdir copied or moved "
                  "from there?); rerun the bench with its own --workdir")
    return shown + (f"; and {len(keys) - 3} more" if len(keys) > 3 else "")


def _sources(cd) -> list[str]:
    """The runs a run `cd` reads: its distillation teacher, its `train.init_from`."""
    return [d for d in (cd.train.distill.teacher, cd.train.init_from) if d]


def _newer_source(cd, done: str) -> bool:
    """Whether a run `cd` reads (`_sources`) finished after the run whose summary is
    `done`: the same config then names a run that changed."""
    mine = os.path.getmtime(done)
    return any(os.path.exists(f) and os.path.getmtime(f) > mine
               for f in (os.path.join(d, "summary.json") for d in _sources(cd)))


def _row(model: str, method: str, setting: str, summary: dict, workdir: str, metric: str) -> dict:
    """A table row of a trained run from its summary (its forward time is measured by
    `measure_forward`)."""
    params = summary["param_count"]
    ev = summary["eval"]
    return {"model": model, "method": method, "setting": setting, "params": params,
            "size_bytes": params * 4, "metric": metric, "value": ev.get(metric),
            "eval": ev, "workdir": os.path.abspath(workdir)}


# Each model's targets' recipe: the `train.distill` fields that `python -m hpnlp.bench
# distill_recipes --model M` finds best of its recipes on M's validation split, so chosen
# without reading the eval chapters the targets are scored on (tests/test_bench.py holds
# each to its record). The classifier's (docs/benchmarks/distill_recipes, 2026-11-29, its
# students at 5x the experiment's rate): the teacher's first heads, neurons and channels of
# its last block of every two (weight selection, Xu et al. 2024) plus soft targets at T = 1,
# 0.735 of the gap closed (Minitron's important weights of the same blocks 0.637, the
# accuracy 0.006 lower, about a seed's spread); with the students at 1x the important
# weights had been best (0.731). The byte LM's (docs/benchmarks/distill_recipes_lm, 2026-11-30,
# the Xeon model 207, its teacher at `TEACHER_LR`'s 3x, its students at 5x the experiment's
# rate): the teacher's weights rotated into its residual stream's principal components
# (`init=pca`) with no soft targets, 0.686 (with soft targets at T = 1 0.653, and
# attention-map matching at 0.1 too 0.628; the best of the rest, Minitron's important
# weights with soft targets and attention-map matching, 0.538). Until then (2026-11-29,
# without the rotated recipes) that last had been best (0.536); with the teacher and the
# students at 1x selected weights with soft targets and attention-map matching (0.722 then,
# 0.263 at 5x against the trained teacher), and before that the classifier's recipe.
TARGETS_RECIPE = {
    "byte LM": dict(alpha=0.0, init="pca"),
    "text classifier": dict(alpha=0.5, temperature=1.0, init="select", init_blocks="last"),
}
DISTILLED = "student, distilled, the targets' recipe"  # the row the distillation targets read
_INIT_NAMES = {"select": "selected", "importance": "important", "pca": "rotated"}


def recipe_setting(fields: dict) -> str:
    """A `train.distill` recipe in words, for a table's setting column."""
    out = [f"init={fields['init']}"] if fields.get("init", "none") != "none" else []
    out += ["last blocks"] if fields.get("init_blocks") == "last" else []
    if fields.get("alpha", 0.5):
        out += [f"T={fields.get('temperature', 1.0):g}, alpha={fields.get('alpha', 0.5):g}"]
    else:
        out += ["alpha=0"]
    out += [f"{k} {fields[k]:g}" for k in ("hidden", "attention") if fields.get(k)]
    return ", ".join(out)


def distilled_students(model: str) -> list[tuple[str, str, dict, str]]:
    """`model`'s distilled students, each trained for its `student_steps`: (method, setting,
    `train.distill` fields, workdir suffix). Soft targets alone; the targets' recipe's
    initialization alone (no soft targets), its control, unless that is the recipe itself;
    and the targets' recipe (last: the row the distillation targets read)."""
    recipe = TARGETS_RECIPE[model]
    init = {k: recipe[k] for k in ("init", "init_blocks") if k in recipe}
    alone = dict(init, alpha=0.0)
    control = [] if alone == recipe else [
        (f"student, {_INIT_NAMES[recipe['init']]} weights, no soft targets",
         recipe_setting(alone), alone, "init_only")]
    return [("student, distilled", "T=1, alpha=0.5", dict(alpha=0.5, temperature=1.0),
             "distilled")] + control + [(DISTILLED, recipe_setting(recipe), recipe, "targets")]


# Each student's learning rate as a multiple of its experiment's (not of its teacher's,
# `TEACHER_LR`), by model and kind (the scratch student; every distilled one): the rates the
# model's distill_recipes record's learning-rate check found best on the validation split
# for its scratch student and its targets' recipe (tests/test_bench.py holds them to the
# records). The classifier's (docs/benchmarks/distill_recipes, 2026-11-29): at the
# experiment's rate its scratch student read 0.392 accuracy there, at 5x 0.474. The byte
# LM's (docs/benchmarks/distill_recipes_lm, 2026-11-30): its scratch student read loss
# 1.919 at the experiment's rate, 1.545 at 5x and 1.528 at 8x; its targets' recipe 1.470 at
# 1x, 1.432 at 3x, 1.429 at 5x and 1.436 at 8x (the teacher 1.376). At the experiment's
# rate both models' targets were read against a scratch student that rate under-trained.
STUDENT_LR = {"byte LM": {"scratch": 8.0, "distilled": 5.0},
              "text classifier": {"scratch": 5.0, "distilled": 5.0}}


def _lr_note(model: str, kind: str) -> str:
    k = STUDENT_LR[model][kind]
    return f", lr {k:g}x" if k != 1.0 else ""


def scratch_student(model: str, s: dict, *, lr_scale: float | None = None):
    """The config of `model`'s student from scratch, for its `student_steps`, at
    `lr_scale` (default `STUDENT_LR`'s) times its experiment's learning rate."""
    cd = student(experiment(model, s), s["student_steps"][model])
    cd.train.lr = cd.train.lr * (STUDENT_LR[model]["scratch"] if lr_scale is None else lr_scale)
    return cd


def distilled_student(model: str, s: dict, tdir: str, fields: dict, *,
                      lr_scale: float | None = None):
    """The config of `model`'s student distilled from the teacher in `tdir` with these
    `train.distill` fields (a row of `distilled_students`), for its `student_steps`, at
    `lr_scale` (default `STUDENT_LR`'s) times its experiment's learning rate."""
    cd = student(experiment(model, s), s["student_steps"][model])
    cd.train.distill.update(teacher=tdir, **fields)
    cd.train.lr = cd.train.lr * (STUDENT_LR[model]["distilled"] if lr_scale is None
                                 else lr_scale)
    return cd


def _seeded(cd, out: str, seeds: int) -> list[tuple]:
    """The runs of `cd` at `seeds` seeds, its own and the next ones: [(config, workdir)],
    the first in `out`, the others in `out`_seedK."""
    import copy
    runs = [(cd, out)]
    for k in range(1, seeds):
        ck = copy.deepcopy(cd)
        ck.seed = cd.seed + k
        runs.append((ck, f"{out}_seed{k}"))
    return runs


def _seeded_row(model: str, method: str, setting: str, cd, out: str, metric: str,
                seeds: int) -> dict:
    """The row of `cd` trained at `seeds` seeds (`_seeded`): the metric is their mean,
    `seed_values` each."""
    if seeds <= 1:
        return _row(model, method, setting, _train(cd, out), out, metric)
    summaries = [_train(c, o) for c, o in _seeded(cd, out, seeds)]
    values = [summ["eval"].get(metric) for summ in summaries]
    row = _row(model, method, f"{setting}, mean of {seeds} seeds", summaries[0], out, metric)
    row["value"], row["seed_values"] = float(np.mean(values)), values
    return row


def _distill_plan(s: dict, workdir: str, model: str) -> tuple[tuple, list[tuple]]:
    """`model`'s distill runs: its teacher's (config, workdir), then each student row's
    (method, setting, config, workdir, seeds): the scratch student and `distilled_students`."""
    tag, tdir = model.replace(" ", "_"), _teacher_dir(workdir, model)
    steps, seeds = s["student_steps"][model], s["seeds"][model]
    rows = [("student, scratch", "half depth and width" + (f", {steps} steps" if steps else "")
             + _lr_note(model, "scratch"), scratch_student(model, s),
             os.path.join(workdir, f"{tag}_scratch"), seeds)]
    for method, setting, fields, suffix in distilled_students(model):
        rows.append((method, setting + _lr_note(model, "distilled"),
                     distilled_student(model, s, tdir, fields),
                     os.path.join(workdir, f"{tag}_{suffix}"),
                     seeds if method == DISTILLED else 1))
    return (teacher_config(model, s), tdir), rows


def _distill_model_rows(model: str, teacher: tuple, plan: list[tuple]) -> list[dict]:
    """The distill part's rows of one model from its `_distill_plan`, each run trained into
    its workdir (or reused where finished there)."""
    metric = MODELS[model][2]
    tcd, tdir = teacher
    rows = [_row(model, "teacher", "", _train(tcd, tdir), tdir, metric)]
    return rows + [_seeded_row(model, method, setting, cd, out, metric, seeds)
                   for method, setting, cd, out, seeds in plan]


def _side_by_side(s: dict, runs: list[tuple], desc: str = "runs side by side",
                  train=None) -> None:
    """`runs` ([(config, workdir)], independent of each other) trained side by side, one
    process a core (`harness.train_side_by_side`), where `SIZES` says so; the part's rows
    then reuse them. `train`: a module-level function of (config, workdir) other than
    `_train` (`_quantize`)."""
    if s["side_by_side"]:
        harness.train_side_by_side(train or _train, runs, desc)


def _ahead(s: dict, runs: list[tuple]) -> None:
    """Queue `runs` ([(config, workdir)], those later batches will ask for) in the
    side-by-side processes, where `SIZES` says so (`harness.train_ahead`): each to train
    once the runs it reads (`_sources`) are done there, whenever a batch (`_side_by_side`)
    has no run left for a process. A run that reads a folder those processes do not train
    waits until a batch asks for it."""
    if s["side_by_side"]:
        harness.train_ahead(_train, runs, [_sources(cd) for cd, _ in runs])


def _quantize(job: tuple, out: str, reuse: bool = False) -> dict:
    """The summary of `hpnlp.compress.ptq.quantize(run_dir, out, q)` (`job` = (run_dir, q));
    `reuse`: the one `_side_by_side` wrote into `out` this run, read back."""
    import json

    from hpnlp.compress import ptq
    if reuse:
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)
    run_dir, q = job
    return ptq.quantize(run_dir, out, q, repeats=3)


def side_by_side_processes(s: dict):
    """The block inside which `_side_by_side`'s batches share one set of processes
    (`harness.side_by_side_processes`), compiling with the cheap flags where `s` says so."""
    from hpnlp.compile_flags import cheap_compile_flags
    return harness.side_by_side_processes(cheap_compile_flags() if s["cheap_compile"] else ())


def distill_rows(s: dict, workdir: str) -> list[dict]:
    """Both models' rows: both teachers side by side, then every student of both."""
    plans = {model: _distill_plan(s, workdir, model) for model in MODELS}
    _side_by_side(s, [teacher for teacher, _ in plans.values()], "distill: teachers")
    _side_by_side(s, [run for _, plan in plans.values() for _, _, cd, out, seeds in plan
                      for run in _seeded(cd, out, seeds)], "distill: students")
    return [row for model, (teacher, plan) in plans.items()
            for row in _distill_model_rows(model, teacher, plan)]


def prune_schedule(s: dict, n: int | None = None) -> dict:
    """Every pruning run's schedule over its `n` fine-tuning steps (default the unstructured
    runs' `prune_steps`): gradual cubic from a tenth of them (so movement scores have
    accumulated before the first mask; the same start for every method) to the target at
    three quarters of them, masks recomputed every 5 steps."""
    n = n or s["prune_steps"]
    return dict(schedule="cubic", start_step=n // 10, end_step=max(n // 10 + 1, 3 * n // 4),
                every=5)


def _teacher_dir(workdir: str, model: str = "byte LM") -> str:
    return os.path.join(workdir, f"{model.replace(' ', '_')}_teacher")


def _teacher(s: dict, workdir: str, model: str = "byte LM") -> str:
    """The teacher's workdir, trained there unless `_train` finds it finished."""
    tdir = _teacher_dir(workdir, model)
    _trained(s, teacher_config(model, s), tdir)
    return tdir


def _trained(s: dict, cd, out: str) -> dict:
    """`_train(cd, out)` here, once the side-by-side processes (`_side_by_side`) have
    trained it or found it trained: a run queued ahead (`runs_ahead`) may be training there."""
    _side_by_side(s, [(cd, out)], os.path.basename(out))
    return _train(cd, out)


def _prune_jobs(s: dict, workdir: str, tdir: str) -> list[tuple]:
    """The `prune` part's runs: [(name, sparsity, method, config, workdir)]."""
    model, jobs = "byte LM", []
    for name, sp, method in [("dense fine-tune", 0.0, None)] + [
            (f"{method}", sp, method) for sp in s["sparsities"]
            for method in ("magnitude", "movement", "random")]:
        cd = experiment(model, s)
        cd.train.steps, cd.train.warmup_steps = s["prune_steps"], 1
        cd.train.lr = cd.train.lr * 0.3
        cd.train.init_from = tdir
        if method:
            cd.train.prune.update(method=method, sparsity=sp, **prune_schedule(s))
        out = os.path.join(workdir, f"prune_{name.replace(' ', '_')}_{sp}")
        jobs.append((name, sp, method, cd, out))
    return jobs


def prune_rows(s: dict, workdir: str) -> list[dict]:
    model, metric = "byte LM", "loss"
    jobs = _prune_jobs(s, workdir, _teacher(s, workdir))
    _side_by_side(s, [(cd, out) for *_, cd, out in jobs], "prune")
    rows = []
    for name, sp, method, cd, out in tqdm(jobs, desc="prune", leave=False):
        r = _row(model, "prune " + name if method else name, f"{sp:.0%}", _train(cd, out), out, metric)
        r["sparsity"] = sp
        if method in s["sparse_methods"] and sp >= sparsify.MIN_SPARSITY:  # served sparse too
            r["sparse"] = _sparsified(out, s)
        rows.append(r)
    return rows


def _sparsified(workdir: str, s: dict) -> str:
    """The pruned run in `workdir` written by `sparsify` (reused where done for this
    checkpoint); its folder."""
    import json

    from hpnlp.train.checkpoint import Checkpointer, load_run_config
    out = workdir.rstrip("/") + "_sparse"
    done = os.path.join(out, "summary.json")
    # a twin written before the run last trained (its step alike) is of another model
    if os.path.exists(done) and os.path.getmtime(done) >= os.path.getmtime(
            os.path.join(workdir, "summary.json")):
        ck = Checkpointer(workdir, load_run_config(workdir), keep=1)
        step = ck.latest_step()
        ck.close()
        try:
            with open(done) as f:
                if json.load(f)["step"] == step:
                    return out
        except (OSError, ValueError, KeyError, TypeError):  # a cut summary (a bug hunt,
            pass  # session 96): sparsified again
    sparsify.sparsify(workdir, out, eval_batches=s["eval_batches"] or 1, repeats=1)
    return out


_PARAM_COUNTS: dict[str, int] = {}  # config (JSON) -> param_count: half_rank's bisection runs twice


def param_count(cd) -> int:
    """Parameters of the run `cd` would train (factorized where model.lowrank says), from
    shapes alone."""
    import json

    from hpnlp.config import Config, from_configdict, to_json, validate
    cfg = validate(cd if isinstance(cd, Config) else from_configdict(cd))
    key = json.dumps(to_json(cfg), sort_keys=True, default=str)
    if key not in _PARAM_COUNTS:
        _PARAM_COUNTS[key] = _param_count(cfg)
    return _PARAM_COUNTS[key]


def _param_count(cfg) -> int:
    from hpnlp import models
    return models.param_count(_abstract_params(cfg, models.build(cfg, deterministic=True)))


def _abstract_params(cfg, model):
    """`model`'s parameters (shapes and dtypes) as a run of `cfg` trains and saves them:
    factorized where model.lowrank says."""
    import flax.linen as nn

    from hpnlp.train.loop import dummy_batch
    batch = dummy_batch("lm" if cfg.model.kind == "lm" else "classify", 1, cfg.data.seq_len)

    def init(key):
        p = model.init(key, batch)["params"]
        if cfg.model.lowrank.enabled():
            from hpnlp.compress import lowrank
            p = lowrank.init_transform(cfg, model, batch)(p)
        return nn.unbox(p)
    return jax.eval_shape(init, jax.random.key(0))


def closest(values, size, target: float):
    """A value among `values` (ascending) whose `size(value)` is closest to `target`, for a
    `size` monotone in the value: bisection, so a few of its (traced) evaluations rather
    than one per value."""
    values, seen = list(values), {}

    def size_of(v):  # each value's size evaluated once
        if v not in seen:
            seen[v] = size(v)
        return seen[v]
    sign = 1 if size_of(values[-1]) >= size_of(values[0]) else -1
    lo, hi = 0, len(values) - 1
    while lo < hi:  # the first value whose signed size reaches the target
        mid = (lo + hi) // 2
        if sign * size_of(values[mid]) < sign * target:
            lo = mid + 1
        else:
            hi = mid
    return min(values[max(lo - 1, 0):lo + 1], key=lambda v: abs(size_of(v) - target))


def _with_rank(s: dict, r: int):
    cd = experiment("byte LM", s)
    cd.model.lowrank.rank = r
    return cd


def half_rank(s: dict) -> int:
    """The rank whose factorized byte LM has about half the teacher's parameters."""
    base = experiment("byte LM", s)
    return closest(range(1, min(base.model.width, base.model.mlp_dim) + 1),
                   lambda r: param_count(_with_rank(s, r)), param_count(base) / 2)


def _lowrank_config(s: dict, workdir: str, r: int, tdir: str) -> tuple:
    """(config, workdir) of the byte-LM teacher in `tdir` factorized at rank `r` and
    fine-tuned for the pruning runs' steps."""
    cd = _with_rank(s, r)
    cd.train.steps, cd.train.warmup_steps = s["prune_steps"], 1
    cd.train.lr = cd.train.lr * 0.3
    cd.train.init_from = tdir
    return cd, os.path.join(workdir, f"lowrank_{r}")


def _lowrank_runs(s: dict, workdir: str, tdir: str) -> tuple:
    """(the half-parameter rank, {rank: its run}, the dense run of about its size, that
    run's width) of the `lowrank` part, runs as (config, workdir)."""
    model = "byte LM"
    base = experiment(model, s)
    limit = min(base.model.width, base.model.mlp_dim)
    r_half = half_rank(s)
    ranks = {max(1, r_half // 2), r_half, min(limit, 2 * r_half)} if s["lowrank_sweep"] else {r_half}
    heads = base.model.num_heads

    def dense_of(width):  # trained as the teacher is, at its rate
        cd = teacher_config(model, s)
        cd.model.width, cd.model.mlp_dim = width, 4 * width
        # the same total as the factorized models' (the teacher's steps and their fine-tune's),
        # as `_structured_scratch`'s: the records up to 2026-12-06 gave it the teacher's alone
        # (review r10), and here steps buy more than the teacher's weights
        cd.train.steps += s["prune_steps"]
        return cd
    # a dense model of about the half-rank model's size, from scratch for the same steps
    width = closest(range(2 * heads, base.model.width + 1, 2 * heads),
                    lambda w: param_count(dense_of(w)), param_count(_with_rank(s, r_half)))
    cd = dense_of(width)
    # its steps in the folder's name: a workdir's run of the earlier 800 steps stays aside
    # (under its old name `_train` would refuse it as a saved run of another config)
    dense = (cd, os.path.join(workdir, f"dense_width_{width}_{cd.train.steps}_steps"))
    return r_half, {r: _lowrank_config(s, workdir, r, tdir) for r in sorted(ranks)}, dense, width


def lowrank_rows(s: dict, workdir: str) -> list[dict]:
    model, metric = "byte LM", "loss"
    tdir = _teacher(s, workdir)
    r_half, runs, dense, width = _lowrank_runs(s, workdir, tdir)
    rows = []
    _side_by_side(s, list(runs.values()) + [dense], "lowrank")
    for r, (cd, out) in runs.items():
        summary = _train(cd, out)
        row = _row(model, "low-rank SVD + fine-tune", f"rank {r}", summary, out, metric)
        row["rank"], row["half_params"] = r, r == r_half
        rows.append(row)
    rows.append(_row(model, "dense, scratch",
                     f"width {width}, same size, {dense[0].train.steps} steps", _train(*dense),
                     dense[1], metric))
    value = _teacher_value(tdir, metric)
    for row in rows:
        row["teacher_value"] = value
    return rows


def _teacher_value(tdir: str, metric: str) -> float:
    import json
    with open(os.path.join(tdir, "summary.json")) as f:
        return json.load(f)["eval"][metric]


def structured_config(cd, sparsity: float):
    """The config `python -m hpnlp.compress shrink` makes of `cd` pruned structurally at
    `sparsity` (hpnlp.compress.prune.group_masks' counts)."""
    m = cd.model
    keep = lambda n: n - min(round(sparsity * n), n - 1)  # noqa: E731
    m.head_dim = m.head_dim or m.width // m.num_heads
    m.num_heads, m.mlp_dim = keep(m.num_heads), keep(m.mlp_dim)
    return cd


# The structured fine-tune's learning rate as a multiple of the experiment's, with its steps
# (`SIZES` `structured_steps`): the pair `python -m hpnlp.bench distill_recipes --model 'byte
# LM'`'s structured check finds best on the validation split (tests/test_bench.py holds both
# to its record). docs/benchmarks/distill_recipes_lm, 2026-11-29 (the AMD EPYC Zen 4),
# against the teacher's loss 1.385 there: 1.471 at 0.3x for 400 steps (the compress record's
# before), 1.430 at 1x, 1.639 at 3x; 1.382 at 1x for 600 steps, 1.349 for 800 (the best
# then). Re-recorded 2026-11-30 on the Xeon model 207, against the teacher's 1.376: 1.369
# at 0.6x for 800 steps, 1.384 at 1x, 1.386 at 1.5x (1x until then).
STRUCTURED_LR = 0.6


def structured_sparsity(s: dict) -> float:
    """The structured sparsity whose shrunk byte LM has about half the teacher's parameters."""
    half = param_count(experiment("byte LM", s)) / 2
    return closest([i / 100 for i in range(5, 96)],
                   lambda v: param_count(structured_config(experiment("byte LM", s), v)), half)


def structured_pruned(s: dict, tdir: str, *, lr_scale: float | None = None,
                      steps: int | None = None, sparsity: float | None = None):
    """The byte LM fine-tuned from the teacher in `tdir` while pruned structurally to
    `sparsity` (default `structured_sparsity`'s, about a second to find: a caller of several
    passes it; whole heads and MLP neurons by their weights' L2 norm, on the pruning runs'
    schedule over its steps): at `lr_scale` (default `STRUCTURED_LR`) times the
    experiment's rate for `steps` (default `structured_steps`)."""
    cd = experiment("byte LM", s)
    n = steps or s["structured_steps"]
    cd.train.steps, cd.train.warmup_steps = n, 1
    cd.train.lr = cd.train.lr * (STRUCTURED_LR if lr_scale is None else lr_scale)
    cd.train.init_from = tdir
    sp = structured_sparsity(s) if sparsity is None else sparsity
    cd.train.prune.update(method="magnitude", sparsity=sp,
                          structure="structured", **prune_schedule(s, n))
    return cd


def _structured_scratch(s: dict, shape):
    """The config of the shrunk byte LM (`shape`: its num_heads, head_dim and mlp_dim), from
    scratch as the teacher, for the teacher's steps and the structured fine-tune's."""
    cd = teacher_config("byte LM", s)
    cd.model.update(num_heads=shape["num_heads"], head_dim=shape["head_dim"],
                    mlp_dim=shape["mlp_dim"])
    cd.train.steps += s["structured_steps"]  # the same total as the pruned model's
    return cd


def _structured_runs(s: dict, workdir: str, tdir: str) -> tuple:
    """(the structured sparsity, the pruned fine-tune's run, its scratch twin's run) of the
    `structured` part, runs as (config, workdir): the twin at the shrink's shape, foreseen."""
    sp = structured_sparsity(s)
    pruned = structured_pruned(s, tdir, sparsity=sp)
    twin = _structured_scratch(s, structured_config(experiment("byte LM", s), sp).model)
    return (sp, (pruned, os.path.join(workdir, "structured_pruned")),
            (twin, os.path.join(workdir, "structured_scratch")))


def structured_rows(s: dict, workdir: str) -> list[dict]:
    """The byte-LM teacher pruned structurally (`structured_pruned`) at the sparsity whose
    shrunk model has about half the teacher's parameters, then shrunk; beside it the same
    small config trained from scratch for the teacher's steps plus the fine-tune's."""
    from hpnlp.compress import prune

    model, metric = "byte LM", "loss"
    tdir = _teacher(s, workdir)
    sp, (cd, pdir), twin = _structured_runs(s, workdir, tdir)
    odir, sdir = twin[1], os.path.join(workdir, "structured_shrunk")
    _side_by_side(s, [(cd, pdir), twin], "structured")
    _train(cd, pdir)
    if os.path.exists(sdir):  # shrunk afresh from the pruned run of this config
        import shutil
        shutil.rmtree(sdir)
    summ = prune.shrink_run(pdir, sdir)
    small = summ["model"]
    shape = f"heads {small['num_heads'][1]}, MLP {small['mlp_dim'][1]}"
    rows = [_row(model, "structured prune + shrink", f"{sp:.0%}: {shape}",
                 dict(summ, param_count=summ["params"]["shrunk"]), sdir, metric)]
    rows[0].update(half_params=True, masked_eval=summ["eval_masked"])
    scratch = _structured_scratch(s, dict(num_heads=small["num_heads"][1],
                                          head_dim=small["head_dim"], mlp_dim=small["mlp_dim"][1]))
    rows.append(_row(model, "dense, scratch", f"{shape}, same size, {scratch.train.steps} steps",
                     _train(scratch, odir), odir, metric))
    value = _teacher_value(tdir, metric)
    for row in rows:
        row["teacher_value"] = value
    return rows


PIPELINE = "distill + prune 50% + int8"  # Deep Compression's row: `pipeline_size_ratio`


def _pipeline_pruned(s: dict, workdir: str) -> tuple:
    """(config, workdir) of the pipeline's run: the targets' distilled LM student pruned to
    50% while fine-tuned."""
    cd = student(experiment("byte LM", s))
    cd.train.steps, cd.train.warmup_steps, cd.train.lr = s["prune_steps"], 1, cd.train.lr * 0.3
    cd.train.init_from = os.path.join(workdir, f"byte_LM_{distilled_students('byte LM')[-1][3]}")
    cd.train.prune.update(method="magnitude", sparsity=0.5)
    return cd, os.path.join(workdir, "pipeline_pruned")


def pipeline_rows(s: dict, workdir: str) -> list[dict]:
    """Distilled LM student -> pruned to 50% while fine-tuned -> int8 weights (packed file);
    and the half-parameter low-rank model (the `lowrank` part's run) -> w8a8, its factors'
    products on the int8 kernels."""
    from hpnlp.config import QuantConfig

    model = "byte LM"
    cd, pdir = _pipeline_pruned(s, workdir)
    # the run it starts from: the targets' distilled student (the distill part's, reused)
    fields, ddir, tdir = distilled_students(model)[-1][2], cd.train.init_from, _teacher(s, workdir)
    _trained(s, distilled_student(model, s, tdir, fields), ddir)
    r = half_rank(s)
    lcd, ldir = _lowrank_config(s, workdir, r, tdir)  # the lowrank part's run
    _side_by_side(s, [(cd, pdir), (lcd, ldir)], "pipeline: runs")  # (reused when it ran)
    for c, out in ((cd, pdir), (lcd, ldir)):
        _train(c, out)
    jobs = [((run_dir, q), os.path.join(workdir, name)) for run_dir, q, name in (
        (pdir, QuantConfig(weights="int8"), "pipeline_int8"),
        (ldir, QuantConfig(weights="int8", activations="int8"), "lowrank_w8a8"))]
    _side_by_side(s, jobs, "pipeline: quantize", _quantize)  # their summaries read below
    rows = []
    for (method, setting), ((run_dir, q), qdir) in zip(
            ((PIPELINE, ""), ("low rank + w8a8", f"rank {r}, int8 weights and activations")),
            jobs):
        summ = _quantize((run_dir, q), qdir, reuse=s["side_by_side"])
        rows.append({"model": model, "method": method, "setting": setting,
                     "params": summ["size_bytes"]["float32_params"] // 4,
                     "size_bytes": summ["size_bytes"]["quantized_file"], "metric": "loss",
                     "value": summ["eval"]["quantized"]["loss"], "eval": summ["eval"]["quantized"],
                     "workdir": os.path.abspath(run_dir), "quantized": os.path.abspath(qdir),
                     "teacher_size_bytes": param_count(experiment(model, s)) * 4})
    return rows


# ------------------------------------------------------------------------- report

PARTS = ("distill", "prune", "structured", "lowrank", "pipeline")


def gap_closed(student: float, scratch: float, teacher: float,
               metric: str = "loss") -> float | None:
    """The share of the scratch student's gap to the teacher that `student` closes, on a
    loss (`metric` "loss": lower is better) or an accuracy alike; None where there is no
    gap: the teacher no better than the scratch student (a review, session 116: a scratch
    student past the teacher made the share of a worse student large and positive, met)."""
    if (teacher >= scratch) if metric == "loss" else (teacher <= scratch):
        return None
    return (scratch - student) / (scratch - teacher)


def _gap_closed(rows: list[dict], model: str, method: str = DISTILLED) -> float | None:
    by = {r["method"]: r["value"] for r in rows if r["model"] == model}
    t, sc, d = by.get("teacher"), by.get("student, scratch"), by.get(method)
    return None if None in (t, sc, d) else gap_closed(d, sc, t, MODELS[model][2])


def _half(rows: list[dict]) -> tuple[float | None, float | None]:
    """(forward speed-up over the teacher, relative eval-loss increase) of the row marked
    as the half-parameter model."""
    half = next((r for r in rows if r.get("half_params")), None)
    if not half or "forward_s" not in half:
        return None, None
    return (report.ratio(half["teacher_forward_s"], half["forward_s"]),
            half["value"] / half["teacher_value"] - 1.0)


def _targets(p: dict) -> dict:
    deep = next((r for r in p.get("pipeline") or [] if r["method"] == PIPELINE), None)
    ratio = deep["teacher_size_bytes"] / deep["size_bytes"] if deep else None
    st_speed, st_loss = _half(p.get("structured") or [])
    lr_speed, lr_loss = _half(p.get("lowrank") or [])
    distill = p.get("distill") or []
    return report.targets_of_parts(p.get("seconds"), {  # (those of the parts it ran)
        "distill": {
            "distill_gap_closed_lm": report.target(_gap_closed(distill, "byte LM"), 0.5, ">="),
            "distill_gap_closed_text": report.target(_gap_closed(distill, "text classifier"),
                                                     0.5, ">=")},
        "structured": {"structured_half_params_speedup": report.target(st_speed, 1.6, ">="),
                       "structured_half_params_loss_rel": report.target(st_loss, 0.03, "<=")},
        "lowrank": {"lowrank_half_params_speedup": report.target(lr_speed, 1.6, ">="),
                    "lowrank_half_params_loss_rel": report.target(lr_loss, 0.03, "<=")},
        "pipeline": {"pipeline_size_ratio": report.target(ratio, 8.0, ">=")}})


def _rows(p: dict) -> list[dict]:
    return [r for part in PARTS for r in p.get(part) or []]


def _markdown(p: dict) -> str:
    def rel(r):
        dense = report.fmt(report.ratio(r.get("teacher_forward_s"), r.get("forward_s")), "x")
        if not r.get("sparse_forward_s"):
            return dense
        sparse = report.ratio(r["teacher_forward_s"], r["sparse_forward_s"])
        return f"{dense}; sparse {report.fmt(sparse, 'x')}"

    out = [report.header_md(p["machine"], {}), "",
           report.table(["model", "method", "setting", "params", "size KiB", "eval metric",
                         "forward vs teacher"], [
               [r["model"], r["method"], r["setting"], f"{r['params']:,}",
                f"{r['size_bytes'] / 1024:.0f}", f"{r['metric']} {r['value']:.4f}", rel(r)]
               for r in _rows(p)]), "",
           "Forward: one eval batch, every model timed in turn (a new order each round) over the "
           "same rounds at the end of the run (median), as a speed-up over its teacher. A pruned "
           "model computes its dense products on XLA:CPU, so its first figure shows the timing "
           "noise (about 1.00x); `sparse`: the same model served by hpnlp's sparse kernel "
           "(`python -m hpnlp.compress sparsify`, every qkv, out and MLP weight stored by its "
           "nonzeros), for the unstructured runs from "
           f"{sparsify.MIN_SPARSITY:.0%} sparsity on. Size KiB: float32 parameters (the "
           "pipeline: its int8 file on disk).", ""]
    if p.get("distill"):
        for model in MODELS:
            ran = {r["method"] for r in p["distill"] if r["model"] == model}
            gaps = [f"`{method}` {report.fmt(_gap_closed(p['distill'], model, method))}"
                    for method, *_ in distilled_students(model) if method in ran]
            if gaps:
                out += [f"Gap closed, {model}: " + ", ".join(gaps) + (
                    " (the last, the targets' row)." if DISTILLED in ran else "."), ""]
        seeded = [r for r in p["distill"] if r.get("seed_values")]
        if seeded:
            out += ["Rows read as the mean of several seeds, each seed's value: " + "; ".join(
                f"{r['model']}, {r['method']}: " + ", ".join(f"{v:.4f}" for v in r["seed_values"])
                for r in seeded) + ". The other students ran the first seed only.", ""]
    out += report.seconds_md(p)
    out += [report.targets_md(p.get("targets"), p.get("quick"))]
    return "\n".join(out)


def prunable_params(model: str) -> int:
    """The entries of `model`'s teacher that the prune part's runs prune (its blocks' qkv,
    out and MLP kernels: `train.prune.layers`' default on a Transformer; the embedding,
    biases and norms stay dense)."""
    from hpnlp.config import from_configdict, validate
    m = validate(from_configdict(experiment(model, SIZES["full"]))).model
    E, H, D, G = m.width, m.num_heads, m.dims_per_head(), m.kv_heads()
    return m.depth * (E * (H * D + 2 * G * D) + H * D * E + 2 * E * m.mlp_dim)


def _plot(p: dict, out_dir: str) -> None:
    """Quality against size per model: one colour and marker per method and part, its
    settings (sparsities, ranks) joined by a line, the legend beside the axes. A pruned
    row's size is its float32 nonzeros: its sparsity of the pruned kernels only (a review,
    session 118: taken of every parameter, the 95% runs plotted at a third of their size);
    rows of one method name in two parts (the structured and low-rank parts' scratch twins)
    are two lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    markers = "os^vDP*Xph<>"
    for ax, model in zip(axes, MODELS):
        by_method: dict[str, list] = {}
        rows = [(part, r) for part in PARTS for r in p.get(part) or [] if r["model"] == model]
        parts_of: dict[str, set] = {}
        for part, r in rows:
            parts_of.setdefault(r["method"], set()).add(part)
        prunable = prunable_params(model) if any(r.get("sparsity") for _, r in rows) else 0
        for part, r in rows:
            pruned = r["sparsity"] * prunable if r.get("sparsity") else 0.0
            size = 4 * (r["params"] - pruned) if pruned else r["size_bytes"]
            label = f"{r['method']} ({part})" if len(parts_of[r["method"]]) > 1 else r["method"]
            by_method.setdefault(label, []).append((size / 1024, r["value"]))
        for i, (method, pts) in enumerate(by_method.items()):
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=markers[i % len(markers)],
                    color=plt.cm.tab20(i % 20), linestyle="-" if len(pts) > 1 else "none",
                    label=method)
        ax.set_xscale("log")
        ax.set_xlabel("KiB (float32 nonzeros; the pipeline: its int8 file)")
        ax.set_ylabel(MODELS[model][2])
        ax.set_title(model)
        if by_method:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    report.savefig(fig, os.path.join(out_dir, "quality_vs_size.png"))


def runs_ahead(s: dict, workdir: str, parts) -> list[tuple]:
    """The runs of `parts`, [(config, workdir)]: first those that read no other run (the
    teachers, each model's scratch students, the structured part's scratch twin, the
    lowrank part's dense model), then the rest, each in the parts' order. `run` queues them
    (`harness.train_ahead`, each after the runs it reads: `_sources`), so that a core a
    part's batch has nothing left for (both teachers train side by side, the classifier's
    longer; a part's longest run) trains a later part's run rather than idling."""
    tdir = _teacher_dir(workdir)
    runs = [(teacher_config(model, s), _teacher_dir(workdir, model)) for model in MODELS
            if "distill" in parts or (model == "byte LM" and set(parts) - {"distill"})]
    if "distill" in parts:
        runs += [run for model in MODELS
                 for *_, cd, out, seeds in _distill_plan(s, workdir, model)[1]
                 for run in _seeded(cd, out, seeds)]
    if "prune" in parts:
        runs += [(cd, out) for *_, cd, out in _prune_jobs(s, workdir, tdir)]
    if "structured" in parts:
        runs += list(_structured_runs(s, workdir, tdir)[1:])
    if "lowrank" in parts:
        _, ranked, dense, _ = _lowrank_runs(s, workdir, tdir)
        runs += list(ranked.values()) + [dense]
    if "pipeline" in parts:
        runs.append(_pipeline_pruned(s, workdir))
    return sorted(runs, key=lambda run: bool(_sources(run[0])))  # (stable)


def run(out_dir: str, *, quick: bool, parts=PARTS, workdir: str | None = None) -> dict:
    s = SIZES["quick" if quick else "full"]
    makers = {"distill": distill_rows, "prune": prune_rows, "structured": structured_rows,
              "lowrank": lowrank_rows, "pipeline": pipeline_rows}
    with tempfile.TemporaryDirectory() as tmp:
        if not jax.config.jax_compilation_cache_dir:
            # one compilation cache for the run: the runs that share a program (a student
            # started from the teacher's weights is the scratch student's; the forward timing
            # recompiles every trained model's evaluation) compile it once
            jax.config.update("jax_compilation_cache_dir", os.path.join(tmp, "jax_cache"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
        payload = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
                   "machine": harness.machine_info(), "seconds": {}}
        wd = workdir or tmp
        before = runs_in(wd)
        with side_by_side_processes(s):  # every part's batches in one set of them
            _ahead(s, runs_ahead(s, wd, parts))
            harness.run_parts(payload, {name: functools.partial(make, s, wd)
                                        for name, make in makers.items()}, parts)
        t0 = time.perf_counter()
        teachers = {m: os.path.abspath(os.path.join(wd, f"{m.replace(' ', '_')}_teacher"))
                    for m in MODELS}
        measure_forward(_rows(payload), teachers, rounds=s["timing_rounds"])
        payload["seconds"]["forward timing"] = time.perf_counter() - t0
    payload["reused_runs"] = reused_since(before)
    report.targets_unless_quick(payload, quick, lambda: _targets(payload))
    report.write(out_dir, "compress", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_parts_arguments(p, PARTS, workdir_help="keep the runs' workdirs here")


main = harness.parts_main(run)
