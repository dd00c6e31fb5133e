"""`python -m hpnlp.bench compress`: distillation and pruning against honest baselines.

In one run on this CPU:

1. Distillation (`distill`): on the default byte LM (experiments/lm.py) and the text
   classifier (experiments/lra.py:text at 256 bytes), the teacher is trained; a student at
   half the depth, width, heads and MLP width is trained twice for the teacher's steps:
   from scratch, and distilled from the teacher (soft targets at T = 2, alpha = 0.5).
   Reported: eval metric (loss for the LM, accuracy for the classifier), parameters, size,
   and forward time relative to the teacher. `gap closed` = (scratch - distilled) /
   (scratch - teacher) on the eval metric.
2. Pruning (`prune`): the byte-LM teacher fine-tuned for the same steps at 50/75/90/95%
   sparsity with magnitude, movement (Sanh et al. 2020) and random (the control) masks, all
   on the same gradual cubic schedule (0 at the first step to the target at three quarters
   of the steps, masks recomputed every 5 steps), beside the dense fine-tune of the same
   steps. The paper's claim to check: movement beats magnitude at high sparsity during
   fine-tuning. Unstructured sparsity saves size only (a pruned model runs at its dense
   speed on XLA:CPU, which has no sparse product).
3. Low-rank factorization (`lowrank`): the byte-LM teacher's qkv, out and MLP weights
   replaced by truncated-SVD factors (`model.lowrank.rank`, `train.init_from`) at the rank
   that halves its parameters, half that rank and twice it, each fine-tuned for the pruning
   runs' steps; beside them a dense model of about the half-parameter size (width scaled)
   trained from scratch for the teacher's steps. Eval loss, parameters and forward time.
4. Pipeline (`pipeline`, Deep Compression's order): the distilled LM student pruned to 50%
   while fine-tuned, then int8 weights by `python -m hpnlp.compress quantize`: its
   quantized file on disk against the float32 teacher's parameters.

Targets (issue 21; `targets` in results.json): distillation closes at least half of the
scratch-teacher gap on both models (`distill_gap_closed_lm`, `distill_gap_closed_text`
>= 0.5); the pipeline ends at least 8x smaller on disk than the float32 teacher
(`pipeline_size_ratio` >= 8); the factorized model at half the parameters runs at least
1.6x faster than the teacher (`lowrank_half_params_speedup`) and loses at most 3% relative
eval loss (`lowrank_half_params_loss_rel`). Structured pruning (the issue's other targets)
is not built yet and has no rows. `--quick` shrinks every run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from hpnlp.bench import harness, report

SIZES = {
    "full": dict(lm_steps=None, cls_steps=600, cls_len=256, prune_steps=200,
                 sparsities=(0.5, 0.75, 0.9, 0.95), eval_batches=None),
    "quick": dict(lm_steps=12, cls_steps=12, cls_len=64, prune_steps=6, sparsities=(0.5, 0.9),
                  eval_batches=2),
}
MODELS = {"byte LM": ("lm.py", "bytes", "loss"), "text classifier": ("lra.py", "text", "accuracy")}


def experiment(model: str, s: dict):
    """The teacher's config: the default byte LM or the text classifier (shrunk by --quick)."""
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


def student(cd):
    """Half the teacher's depth, width, heads and MLP width."""
    m = cd.model
    m.depth, m.width = max(1, m.depth // 2), m.width // 2
    m.num_heads, m.mlp_dim = max(1, m.num_heads // 2), m.mlp_dim // 2
    return cd


def forward_time(workdir: str, *, repeats: int = 5) -> tuple[int, float]:
    """(parameters, median forward seconds over one eval batch) of a trained run."""
    from hpnlp import data as data_lib
    from hpnlp import models
    from hpnlp.train import Trainer
    from hpnlp.train.checkpoint import load_run_config

    tr = Trainer(load_run_config(workdir), workdir, read_only=True)
    state, _ = tr.initial_state()
    batch = next(iter(data_lib.make_iterator(tr.task, tr.cfg.data, split="eval",
                                             batch_size=tr.cfg.train.batch_size)))
    fn = jax.jit(lambda p, b: tr.eval_model.apply({"params": p}, b, method="evaluate"))
    jax.block_until_ready(fn(state.params, batch))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(state.params, batch))
        times.append(time.perf_counter() - t0)
    return models.param_count(state.params), float(np.median(times))


def _row(model: str, method: str, setting: str, summary: dict, workdir: str, metric: str) -> dict:
    params, fwd = forward_time(workdir)
    ev = summary["eval"]
    return {"model": model, "method": method, "setting": setting, "params": params,
            "size_bytes": params * 4, "metric": metric, "value": ev.get(metric),
            "eval": ev, "forward_s": fwd}


def distill_rows(s: dict, workdir: str) -> list[dict]:
    from hpnlp.train import run

    rows = []
    for model, (_, _, metric) in MODELS.items():
        tag = model.replace(" ", "_")
        tdir = os.path.join(workdir, f"{tag}_teacher")
        rows.append(_row(model, "teacher", "", run(experiment(model, s), tdir), tdir, metric))
        sdir = os.path.join(workdir, f"{tag}_scratch")
        rows.append(_row(model, "student, scratch", "half depth and width",
                         run(student(experiment(model, s)), sdir), sdir, metric))
        cd = student(experiment(model, s))
        cd.train.distill.update(teacher=tdir, alpha=0.5, temperature=2.0)
        ddir = os.path.join(workdir, f"{tag}_distilled")
        rows.append(_row(model, "student, distilled", "T=2, alpha=0.5", run(cd, ddir), ddir,
                         metric))
    return rows


def prune_rows(s: dict, workdir: str) -> list[dict]:
    from hpnlp.train import run

    model, metric = "byte LM", "loss"
    tdir = os.path.join(workdir, "byte_LM_teacher")
    if not os.path.exists(os.path.join(tdir, "summary.json")):
        run(experiment(model, s), tdir)
    jobs = [("dense fine-tune", 0.0, None)] + [
        (f"{method}", sp, method) for sp in s["sparsities"]
        for method in ("magnitude", "movement", "random")]
    rows = []
    for name, sp, method in tqdm(jobs, desc="prune", leave=False):
        cd = experiment(model, s)
        cd.train.steps, cd.train.warmup_steps = s["prune_steps"], 1
        cd.train.lr = cd.train.lr * 0.3
        cd.train.init_from = tdir
        if method:
            cd.train.prune.update(method=method, sparsity=sp, schedule="cubic", start_step=0,
                                  end_step=max(1, 3 * s["prune_steps"] // 4), every=5)
        out = os.path.join(workdir, f"prune_{name.replace(' ', '_')}_{sp}")
        r = _row(model, "prune " + name if method else name, f"{sp:.0%}", run(cd, out), out, metric)
        r["sparsity"] = sp
        rows.append(r)
    return rows


def param_count(cd) -> int:
    """Parameters of the run `cd` would train (factorized where model.lowrank says), from
    shapes alone."""
    import flax.linen as nn

    from hpnlp import models
    from hpnlp.config import from_configdict, validate
    from hpnlp.train.loop import dummy_batch
    cfg = validate(from_configdict(cd))
    model = models.build(cfg, deterministic=True)
    batch = dummy_batch("lm" if cfg.model.kind == "lm" else "classify", 1, cfg.data.seq_len)

    def init(key):
        p = model.init(key, batch)["params"]
        if cfg.model.lowrank.rank:
            from hpnlp.compress import lowrank
            p = lowrank.init_transform(cfg, model, batch)(p)
        return nn.unbox(p)
    return models.param_count(jax.eval_shape(init, jax.random.key(0)))


def lowrank_rows(s: dict, workdir: str) -> list[dict]:
    from hpnlp.train import run

    model, metric = "byte LM", "loss"
    tdir = os.path.join(workdir, "byte_LM_teacher")
    if not os.path.exists(os.path.join(tdir, "summary.json")):
        run(experiment(model, s), tdir)
    base = experiment(model, s)
    half = param_count(base) / 2
    limit = min(base.model.width, base.model.mlp_dim)

    def with_rank(r):
        cd = experiment(model, s)
        cd.model.lowrank.rank = r
        return cd
    r_half = min(range(1, limit + 1), key=lambda r: abs(param_count(with_rank(r)) - half))
    rows = []
    for r in sorted({max(1, r_half // 2), r_half, min(limit, 2 * r_half)}):
        cd = with_rank(r)
        cd.train.steps, cd.train.warmup_steps = s["prune_steps"], 1
        cd.train.lr = cd.train.lr * 0.3
        cd.train.init_from = tdir
        out = os.path.join(workdir, f"lowrank_{r}")
        row = _row(model, "low-rank SVD + fine-tune", f"rank {r}", run(cd, out), out, metric)
        row["rank"], row["half_params"] = r, r == r_half
        rows.append(row)
    # a dense model of about the same size, from scratch for the teacher's steps
    target = next(r["params"] for r in rows if r["half_params"])
    heads = base.model.num_heads

    def dense_of(width):
        cd = experiment(model, s)
        cd.model.width, cd.model.mlp_dim = width, 4 * width
        return cd
    width = min(range(2 * heads, base.model.width + 1, 2 * heads),
                key=lambda w: abs(param_count(dense_of(w)) - target))
    out = os.path.join(workdir, f"dense_width_{width}")
    rows.append(_row(model, "dense, scratch", f"width {width}, same size", run(dense_of(width), out),
                     out, metric))
    # the teacher's forward time, measured now beside its factorized versions
    import json
    with open(os.path.join(tdir, "summary.json")) as f:
        t_loss = json.load(f)["eval"][metric]
    _, t_fwd = forward_time(tdir)
    for row in rows:
        row["teacher_forward_s"], row["teacher_value"] = t_fwd, t_loss
    return rows


def pipeline_rows(s: dict, workdir: str) -> list[dict]:
    """Distilled LM student -> pruned to 50% while fine-tuned -> int8 weights (packed file)."""
    from hpnlp.compress import ptq
    from hpnlp.config import QuantConfig
    from hpnlp.train import run

    model = "byte LM"
    ddir = os.path.join(workdir, "byte_LM_distilled")
    tdir = os.path.join(workdir, "byte_LM_teacher")
    if not os.path.exists(os.path.join(ddir, "summary.json")):
        run(experiment(model, s), tdir)
        cd = student(experiment(model, s))
        cd.train.distill.teacher = tdir
        run(cd, ddir)
    cd = student(experiment(model, s))
    cd.train.steps, cd.train.warmup_steps, cd.train.lr = s["prune_steps"], 1, cd.train.lr * 0.3
    cd.train.init_from = ddir
    cd.train.prune.update(method="magnitude", sparsity=0.5)
    pdir = os.path.join(workdir, "pipeline_pruned")
    run(cd, pdir)
    summ = ptq.quantize(pdir, os.path.join(workdir, "pipeline_int8"), QuantConfig(weights="int8"),
                        repeats=3)
    t_params, _ = forward_time(tdir)
    return [{"model": model, "method": "distill + prune 50% + int8", "setting": "",
             "params": summ["size_bytes"]["float32_params"] // 4,
             "size_bytes": summ["size_bytes"]["quantized_file"], "metric": "loss",
             "value": summ["eval"]["quantized"]["loss"], "eval": summ["eval"]["quantized"],
             "forward_s": summ["forward"]["quantized_s"], "teacher_size_bytes": t_params * 4}]


# ------------------------------------------------------------------------- report

def _gap_closed(rows: list[dict], model: str) -> float | None:
    by = {r["method"]: r["value"] for r in rows if r["model"] == model}
    t, sc, d = by.get("teacher"), by.get("student, scratch"), by.get("student, distilled")
    if None in (t, sc, d) or t == sc:
        return None
    return (sc - d) / (sc - t)  # the same formula for a loss and an accuracy


def _targets(distill: list[dict], pipeline: list[dict], lowrank: list[dict] = ()) -> dict:
    ratio = (pipeline[0]["teacher_size_bytes"] / pipeline[0]["size_bytes"]) if pipeline else None
    half = next((r for r in lowrank if r.get("half_params")), None)
    speed = loss_rel = None
    if half:
        speed = report.ratio(half["teacher_forward_s"], half["forward_s"])
        loss_rel = half["value"] / half["teacher_value"] - 1.0
    return {
        "lowrank_half_params_speedup": report.target(speed, 1.6, ">="),
        "lowrank_half_params_loss_rel": report.target(loss_rel, 0.03, "<="),"distill_gap_closed_lm": report.target(_gap_closed(distill, "byte LM"), 0.5, ">="),
            "distill_gap_closed_text": report.target(_gap_closed(distill, "text classifier"),
                                                     0.5, ">="),
            "pipeline_size_ratio": report.target(ratio, 8.0, ">=")}


def _markdown(p: dict) -> str:
    teacher = {r["model"]: r for r in p["distill"] if r["method"] == "teacher"}
    prune_ref = {r["model"]: r for r in p["prune"] if r["method"] == "dense fine-tune"}

    def rel(r):
        ref = teacher.get(r["model"]) or prune_ref.get(r["model"])
        ref_s = r.get("teacher_forward_s") or (ref["forward_s"] if ref else None)
        return report.fmt(report.ratio(ref_s, r["forward_s"]), "x") if ref_s else "–"

    rows = p["distill"] + p["prune"] + p.get("lowrank", []) + p["pipeline"]
    out = [report.header_md(p["machine"], {}), "",
           report.table(["model", "method", "setting", "params", "size KiB", "eval metric",
                         "forward vs teacher"], [
               [r["model"], r["method"], r["setting"], f"{r['params']:,}",
                f"{r['size_bytes'] / 1024:.0f}", f"{r['metric']} {r['value']:.4f}", rel(r)]
               for r in rows]), ""]
    if p["distill"]:
        out += [f"Gap closed by distillation: byte LM "
                f"{report.fmt(_gap_closed(p['distill'], 'byte LM'))}, text classifier "
                f"{report.fmt(_gap_closed(p['distill'], 'text classifier'))}.", ""]
    out += [report.targets_md(p["targets"])]
    return "\n".join(out)


def _plot(p: dict, out_dir: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, model in zip(axes, MODELS):
        rows = [r for r in p["distill"] + p["prune"] + p.get("lowrank", []) + p["pipeline"]
                if r["model"] == model]
        for r in rows:
            size = r["size_bytes"] * (1 - r.get("sparsity", 0.0))  # nonzeros, as float32
            ax.scatter(size / 1024, r["value"], label=f"{r['method']} {r['setting']}".strip())
        ax.set_xscale("log")
        ax.set_xlabel("KiB (float32 nonzeros; the pipeline: its int8 file)")
        ax.set_ylabel(MODELS[model][2])
        ax.set_title(model)
        if rows:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "quality_vs_size.png"), dpi=120)
    plt.close(fig)


def run(out_dir: str, *, quick: bool, parts=("distill", "prune", "lowrank", "pipeline"),
        workdir: str | None = None) -> dict:
    s = SIZES["quick" if quick else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        wd = workdir or tmp
        distill = distill_rows(s, wd) if "distill" in parts else []
        prune = prune_rows(s, wd) if "prune" in parts else []
        low = lowrank_rows(s, wd) if "lowrank" in parts else []
        pipeline = pipeline_rows(s, wd) if "pipeline" in parts else []
    payload = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
               "machine": harness.machine_info(), "distill": distill, "prune": prune,
               "lowrank": low, "pipeline": pipeline, "targets": _targets(distill, pipeline, low)}
    report.write(out_dir, "compress", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default="distill,prune,lowrank,pipeline",
                   help="comma list of distill, prune, lowrank, pipeline")
    p.add_argument("--workdir", default=None, help="keep the runs' workdirs here")


def main(args) -> dict:
    return run(args.out, quick=args.quick, parts=tuple(args.parts.split(",")), workdir=args.workdir)
