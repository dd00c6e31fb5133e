"""What movement pruning's scores pick on the compress bench's byte LM: one-shot masks after
a few fine-tuning steps, against magnitude, random and the movement scores mapped.

    python tools/movement_oneshot.py --workdir W [--sparsity 0.3] [--steps 20]

The compress bench's prune part fine-tunes its byte-LM teacher (W/byte_LM_teacher, trained
there first if missing, as `python -m hpnlp.bench compress --workdir W` trains it) while
pruning, on the task the teacher learned. Here each criterion instead fine-tunes it for
`--steps` steps at the prune part's rate with no mask, then prunes `--sparsity` of each
pruned product at once (`schedule=oneshot`, `start_step=steps`) and evaluates on
`--eval-batches` eval batches, with no further training: the loss then reads how well the
criterion ranked the weights. The movement variants map the scores before the top-k
(`prune.scores` wrapped in this process): "reversed" keeps the lowest, "|score|" prunes
the scores nearest zero and keeps both tails. It prints each criterion's eval loss and,
by product, the mean |W| of the weights it pruned (the teacher's values) over the mean
|W| of all of them.

On the Xeon model 207 (2026-11-30, the defaults: 20 steps, 30%, 8 batches; the teacher
of docs/benchmarks/compress_xeon_m207), eval loss: magnitude 1.409, random 2.501,
movement 5.282, reversed 5.454, |score| 2.765. The movement scores (Adam-trained,
`prune.movement_update`) pruned weights of random pruning's mean size (0.93-0.99 of the
mean, by product; reversed 1.01-1.06) and did twice random's damage either way round,
while pruning the scores nearest zero did about what random did. Under Adam a score's
size says how steadily its weight's gradient kept one sign: the tails are the weights
the loss still pulls on, either way. On the teacher's own task, where a weight's drift
toward zero is not the sign of a weight the task does not need (Sanh et al.'s premise,
for transfer fine-tuning), ranking by movement prunes them first.
"""

import argparse
import os
import shutil

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import numpy as np

from ablib import print_cpu

METHODS = ("magnitude", "random", "movement", "movement, reversed", "movement, |score|")
# how each movement variant maps the scores before the top-k keeps the highest
VARIANTS = {"reversed": lambda s: -s, "|score|": abs}


def final_params(workdir: str) -> dict:
    """{path tuple: array} of the newest checkpoint's parameters in `workdir`."""
    import flax.traverse_util as traverse
    import orbax.checkpoint as ocp
    from hpnlp.train.checkpoint import _newest  # the newest step, or a NoCheckpoint naming it
    manager, step = _newest(workdir)
    manager.close()
    state = ocp.PyTreeCheckpointer().restore(os.path.join(manager.directory, str(step), "state"))
    return {k: np.asarray(v) for k, v in traverse.flatten_dict(state["params"]).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True,
                        help="the compress bench's workdir (its byte_LM_teacher is the start)")
    parser.add_argument("--sparsity", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=8,
                        help="eval batches per evaluation (0: the whole eval split)")
    args = parser.parse_args()
    if args.eval_batches < 0:  # a bug hunt: refused only after the teacher's training
        parser.error(f"--eval-batches {args.eval_batches}: give 0 (the whole split) or more")
    if not 0.0 < args.sparsity < 1.0:
        parser.error(f"--sparsity {args.sparsity}: must be in (0, 1)")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be at least 1")

    from hpnlp.bench import compress
    from hpnlp.compress import prune
    from hpnlp.train import run

    print_cpu()
    s = compress.SIZES["full"]
    tdir = compress._teacher(s, args.workdir)
    teacher = final_params(tdir)
    variant = {"map": None}
    scores = prune.scores

    def mapped(method, weights, seed, movement=None):
        out = scores(method, weights, seed, movement)
        return out if variant["map"] is None else {k: variant["map"](v) for k, v in out.items()}
    prune.scores = mapped  # read at trace time by compute_masks

    print(f"{'criterion':20s} {'eval loss':>9s}  pruned mean |W| / mean |W|, by product")
    for name in METHODS:
        variant["map"] = VARIANTS.get(name.partition(", ")[2])
        cd = compress.experiment("byte LM", s)
        cd.train.steps, cd.train.warmup_steps = args.steps + 1, 1
        cd.train.lr = cd.train.lr * 0.3  # the prune part's rate
        cd.train.init_from = tdir
        cd.train.eval_batches = args.eval_batches
        cd.train.prune.update(method=name.split(",")[0], sparsity=args.sparsity,
                              schedule="oneshot", start_step=args.steps)
        out = os.path.join(args.workdir, "movement_oneshot", name.replace(", ", "_"))
        shutil.rmtree(out, ignore_errors=True)
        loss = run(cd, out)["eval"]["loss"]
        ratios = []
        for k, w in final_params(out).items():
            if w.ndim < 2 or k not in teacher or not np.mean(w == 0) > 0.5 * args.sparsity:
                continue
            t = np.abs(teacher[k])
            name_k = "/".join(x for x in k if x not in ("trunk", "attention", "kernel"))
            ratios.append(f"{name_k} {t[w == 0].mean() / t.mean():.2f}")
        print(f"{name:20s} {loss:9.4f}  {', '.join(ratios)}", flush=True)


if __name__ == "__main__":
    main()
