"""`python -m hpnlp.bench prune_transfer`: movement against magnitude pruning in transfer.

The compress bench prunes the byte LM while fine-tuning it on the task it already learned,
where movement pruning lost to magnitude at every sparsity (`tools/movement_oneshot.py`
shows why: there a weight's movement does not mark what the task can lose). Sanh et al.
(2020) claim that movement beats magnitude at high sparsity in *transfer*: a pretrained
model fine-tuned on a new task. This is the transfer the shipped corpus offers. The
compress bench's byte LM teacher (trained in --workdir, or reused from a compress run
there) starts the text classifier (`train.init_params='trunk'`, hpnlp.train.transfer: the
LM's embedding and trunk, the classifier's head its own draw; the classifier given the
LM's MLP width, its causal attention, `model.causal`, so that it reads the trunk's
features as they were trained, and its length, 128 bytes, so that every position's
embedding is one the LM trained), which fine-tunes for `steps` while pruned to each sparsity
by magnitude, movement and random, on the compress bench's schedule
(`compress.prune_schedule`: gradual cubic, masks every 5 steps), at the classifier
experiment's learning rate. Beside them: the dense fine-tune from the trunk, and the same
classifier from scratch for the same steps (what the pretraining is worth, the claim's
premise). Scored on eval accuracy: the held-out chapters, which the LM did not train on
either.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
from tqdm.auto import tqdm

from hpnlp.bench import compress, harness, report

METHODS = ("magnitude", "movement", "random")
SIZES = {"full": dict(steps=200, sparsities=(0.5, 0.75, 0.9, 0.95)),
         "quick": dict(steps=6, sparsities=(0.9,))}
SCRATCH, DENSE = "classifier, scratch", "classifier from the LM's trunk, dense"


def classifier(s: dict, steps: int):
    """The compress bench's text classifier with the byte LM's trunk shape, its causal
    attention (`model.causal`: the LM's trunk read as it was trained) and its length (every
    position one the LM's table trained), for `steps`."""
    cd = compress.experiment("text classifier", s)
    lm = compress.experiment("byte LM", s).model
    cd.model.mlp_dim, cd.model.causal = lm.mlp_dim, True
    cd.data.seq_len = cd.model.max_len = lm.max_len
    cd.train.steps, cd.train.warmup_steps = steps, max(1, steps // 5)
    return cd


def _row(method: str, sparsity: float, summary: dict, workdir: str) -> dict:
    ev = summary["eval"]
    return {"method": method, "sparsity": sparsity, "accuracy": ev["accuracy"],
            "loss": ev["loss"], "params": summary["param_count"],
            "workdir": os.path.abspath(workdir)}


def rows(s: dict, sizes: dict, workdir: str) -> tuple[str, list[dict]]:
    """(the LM teacher's workdir, the rows): the scratch classifier, the dense fine-tune, and
    each method at each sparsity, trained into `workdir` (reused where finished there)."""
    lm = compress._teacher_dir(workdir)
    n = sizes["steps"]
    jobs = [(SCRATCH, 0.0, None), (DENSE, 0.0, None)] + [
        (m, sp, m) for sp in sizes["sparsities"] for m in METHODS]
    runs = []
    for name, sp, method in jobs:
        cd = classifier(s, n)
        if name != SCRATCH:
            cd.train.update(init_from=lm, init_params="trunk")
        if method:
            cd.train.prune.update(method=method, sparsity=sp, **compress.prune_schedule(s, n))
        runs.append((cd, os.path.join(workdir, "transfer_" + (method or name.split(",")[-1].strip())
                                      + (f"_{sp}" if method else ""))))
    # queued with the teacher: the scratch classifier, which reads no run, trains beside it
    compress._ahead(s, [(compress.teacher_config("byte LM", s), lm)] + runs)
    compress._teacher(s, workdir)
    compress._side_by_side(s, runs, "prune_transfer")  # one process a core; reused below
    return lm, [_row(name, sp, compress._train(cd, run_dir), run_dir)
                for (name, sp, _), (cd, run_dir) in tqdm(list(zip(jobs, runs)),
                                                          desc="prune_transfer", leave=False)]


def _by(p: dict) -> dict:
    return {(r["method"], r["sparsity"]): r for r in p["rows"]}


def margins(p: dict) -> dict:
    """Movement's accuracy less magnitude's, by sparsity."""
    by = _by(p)
    return {sp: by[("movement", sp)]["accuracy"] - by[("magnitude", sp)]["accuracy"]
            for sp in p["sizes"]["sparsities"]}


def _markdown(p: dict) -> str:
    by, sps, gap = _by(p), p["sizes"]["sparsities"], margins(p)
    scratch, dense = by[(SCRATCH, 0.0)], by[(DENSE, 0.0)]
    helps = dense["accuracy"] > scratch["accuracy"]
    out = [report.header_md(p["machine"], {}), "",
           f"The byte LM ({p['lm']['params']:,} parameters, eval loss "
           f"{p['lm']['loss']:.4f}) starts the text classifier ({dense['params']:,} "
           f"parameters) from its embedding and trunk; the classifier fine-tunes "
           f"{p['sizes']['steps']} steps on the corpus's section labels, pruned by each "
           "method on the same schedule; one seed each. Eval accuracy (the majority class: "
           f"{p['majority_accuracy']:.3f}):", "",
           report.table(["sparsity"] + list(METHODS) + ["movement - magnitude"], [
               [f"{sp:.0%}"] + [f"{by[(m, sp)]['accuracy']:.4f}" for m in METHODS]
               + [f"{gap[sp]:+.4f}"] for sp in sps]), "",
           f"Dense, no pruning: from the LM's trunk {dense['accuracy']:.4f}; from scratch "
           f"{scratch['accuracy']:.4f} (the same steps): the pretrained trunk "
           + ("helps" if helps else "does not help") + " this classifier"
           + ("." if helps else
              ", so the premise of Sanh et al.'s claim (a pretrained model worth keeping) "
              "does not hold here."), ""]
    return "\n".join(out + report.seconds_md(p))


def _plot(p: dict, out_dir: str) -> None:
    import matplotlib.pyplot as plt
    by, sps = _by(p), p["sizes"]["sparsities"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for m in METHODS:
        ax.plot([100 * sp for sp in sps], [by[(m, sp)]["accuracy"] for sp in sps], marker="o",
                label=m)
    for name, ls in ((DENSE, "--"), (SCRATCH, ":")):
        ax.axhline(by[(name, 0.0)]["accuracy"], color="black", ls=ls, lw=1, label=name)
    ax.set_xlabel("sparsity (%)")
    ax.set_ylabel("eval accuracy")
    ax.set_title("Pruning while fine-tuning the byte LM's trunk as a classifier")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    report.savefig(fig, os.path.join(out_dir, "accuracy_vs_sparsity.png"))


def run(out_dir: str, *, quick: bool, workdir: str | None = None) -> dict:
    size = "quick" if quick else "full"
    s, sizes = compress.SIZES[size], SIZES[size]
    with tempfile.TemporaryDirectory() as tmp:
        if not jax.config.jax_compilation_cache_dir:  # runs of one shape compile once
            jax.config.update("jax_compilation_cache_dir", os.path.join(tmp, "jax_cache"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
        t0, before = time.perf_counter(), compress.runs_in(workdir or tmp)
        with compress.side_by_side_processes(s):
            lm, found = rows(s, sizes, workdir or tmp)
        import json
        with open(os.path.join(lm, "summary.json")) as f:
            lm_summary = json.load(f)
        with open(os.path.join(found[0]["workdir"], "summary.json")) as f:
            baseline = json.load(f)["baseline"]
        payload = {"sizes": {k: list(v) if isinstance(v, tuple) else v
                             for k, v in sizes.items()},
                   "machine": harness.machine_info(), "rows": found,
                   "lm": {"loss": lm_summary["eval"]["loss"],
                          "params": lm_summary["param_count"]},
                   "majority_accuracy": baseline["majority_accuracy"],
                   "seconds": {"all": time.perf_counter() - t0},
                   "reused_runs": compress.reused_since(before)}
        payload["movement_minus_magnitude"] = {str(k): v for k, v in margins(payload).items()}
    payload["quick"] = bool(quick)  # its own, not only the CLI's (session 107)
    report.write(out_dir, "prune_transfer", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=None, help="keep the runs' workdirs here (reused; a "
                   "compress run's --workdir lends its byte LM teacher)")


def main(args) -> None:
    run(args.out, quick=args.quick, workdir=args.workdir)
